#!/usr/bin/env python3
"""The folders of include/meshtorch/ are layers: README's layout block lists them in dependency
order, and a header includes only headers of its own folder and of the folders above it.

Usage: check_layers.py REPO_ROOT. Prints each include that reaches down, and each folder the block
does not list; exits 1 if there is any.
"""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1])
readme = (root / "README.md").read_text()
start = readme.find("include/meshtorch/ ")
if start < 0:
    sys.exit("README.md: no layout block starting with 'include/meshtorch/'")
block = readme[start:readme.index("\nexamples/", start)]
order = [m.group(1) for m in re.finditer(r"^  ([a-z_]+)/", block, re.M)]
rank = {folder: i for i, folder in enumerate(order)}

include = root / "include" / "meshtorch"
problems = []
# src/ holds the separately compiled sources of every layer: it is not one.
for folder in sorted(p.name for p in include.iterdir() if p.is_dir() and p.name != "src"):
    if folder not in rank:
        problems.append(f"README.md: the layout block does not list include/meshtorch/{folder}/")
for header in sorted(include.rglob("*.hpp")):
    relative = header.relative_to(include)
    if len(relative.parts) < 2 or relative.parts[0] not in rank:
        continue
    own = relative.parts[0]
    for number, line in enumerate(header.read_text().splitlines(), 1):
        m = re.match(r"#include <meshtorch/([a-z_]+)/", line)
        if m and m.group(1) in rank and rank[m.group(1)] > rank[own]:
            problems.append(f"include/meshtorch/{relative}:{number}: includes {m.group(1)}/, which README's "
                            f"layout block puts below {own}/ (move the header, or the folder in the block)")
print("layers, top first:", " ".join(order))
print("\n".join(problems) if problems else "every header includes only its folder and the folders above it")
sys.exit(1 if problems else 0)
