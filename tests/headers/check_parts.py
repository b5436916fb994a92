#!/usr/bin/env python3
"""Each header whose definitions are marked `#if MESHTORCH_DEFINES(part)` is reached by the includes
of include/meshtorch/src/<part>.hpp, the one source that compiles them with separate compilation;
a header names one part; and every part named has its source. Prints what is wrong and exits 1.

    check_parts.py INCLUDE_DIR
"""
import pathlib
import re
import sys

include_dir = pathlib.Path(sys.argv[1])
INCLUDE = re.compile(r'^#include <(meshtorch/[^>]+)>', re.M)
DEFINES = re.compile(r'^#if MESHTORCH_DEFINES\((\w+)\)', re.M)

headers = {str(p.relative_to(include_dir)): p.read_text() for p in include_dir.glob('meshtorch/**/*.hpp')}


def reach(start):
    seen, todo = set(), [start]
    while todo:
        header = todo.pop()
        if header in seen or header not in headers:
            continue
        seen.add(header)
        todo.extend(INCLUDE.findall(headers[header]))
    return seen


problems = []
parts = {}
for header, text in sorted(headers.items()):
    if header.startswith('meshtorch/src/'):
        continue
    named = set(DEFINES.findall(text))
    if len(named) > 1:
        problems.append(f'{header}: definitions marked for several parts ({", ".join(sorted(named))}); one per header')
    for part in named:
        parts.setdefault(part, []).append(header)

for part, members in sorted(parts.items()):
    source = f'meshtorch/src/{part}.hpp'
    if source not in headers:
        problems.append(f'part {part!r} ({", ".join(members)}) has no source {source}')
        continue
    reached = reach(source)
    for header in members:
        if header not in reached:
            problems.append(f'{header}: its definitions (MESHTORCH_DEFINES({part})) are not compiled: '
                            f'{source} does not include it')

for problem in problems:
    print(problem)
counted = sum(len(m) for m in parts.values())
print(f'{counted} headers with definitions in {len(parts)} parts; {len(problems)} problem(s)')
sys.exit(1 if problems else 0)
