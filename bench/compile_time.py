#!/usr/bin/env python3
"""Compile time of meshtorch over plain LibTorch: each translation unit in bench/compile_time/
is compiled to an object file, without a precompiled header and without ccache, in turns
(A/B/C, A/B/C, ...), and the median wall time, CPU time (user + system: it holds when other
jobs share the cores, where wall time does not) and the compiler's peak memory are reported.
The meshtorch units are compiled twice, header-only and with MESHTORCH_SEPARATE_COMPILATION (and,
as meshtorch_compiled_library() builds them, without FMT_HEADER_ONLY: fmt's engine is compiled once,
in src/core.hpp), and the source file of the core part, which separate compilation adds to a
program once (<meshtorch/src/core.hpp>), is timed too.

    python3 bench/compile_time.py [--reps 3] [--out bench/out/compile-time.md]

The flags are those of the build: the entry for examples/01-single-gpu in
build/compile_commands.json when the build exports one (CMAKE_EXPORT_COMPILE_COMMANDS=ON), less
the PCH and dependency-file options; otherwise the include paths and definitions that
cmake/meshtorchLibTorch.cmake gives meshtorch::torch, with -std=c++20 -O2 -DNDEBUG.
Standard library only.
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "bench" / "compile_time"
SEPARATE = ["-DMESHTORCH_SEPARATE_COMPILATION"]
# (key, source, label, extra flags): header-only, then with MESHTORCH_SEPARATE_COMPILATION (the
# library's non-template functions compiled once per program, in the file that includes
# <meshtorch/src/core.hpp>, whose own cost is the last row).
UNITS = [
    ("torch", "torch_only.cpp", "`<torch/torch.h>` only", []),
    ("umbrella", "meshtorch_umbrella.cpp", "+ `<meshtorch/meshtorch.hpp>`", []),
    ("plan2d", "meshtorch_plan2d.cpp", "+ a 2D Llama plan (FSDP<4> x TP<8>, llama-3.1-8b) applied to a model", []),
    ("umbrella-separate", "meshtorch_umbrella.cpp", "+ `<meshtorch/meshtorch.hpp>`, separate compilation", SEPARATE),
    ("plan2d-separate", "meshtorch_plan2d.cpp", "+ the 2D plan, separate compilation", SEPARATE),
    ("pipeline-separate", "meshtorch_pipeline.cpp",
     "+ a pipeline mesh (DP<2> x PP<4> x TP<8>, llama-3.1-8b, interleaved 1F1B) stepped, separate compilation",
     SEPARATE),
    ("src", "meshtorch_src.cpp", "`<meshtorch/src/core.hpp>`: the core part's separately compiled functions, once per program", SEPARATE),
]


def compiler_from_cache(build):
    cache = build / "CMakeCache.txt"
    if cache.exists():
        m = re.search(r"^CMAKE_CXX_COMPILER:\w+=(.+)$", cache.read_text(), re.M)
        if m and m.group(1).strip():
            return m.group(1).strip()
    return os.environ.get("CXX", "c++")


def flags_from_compile_commands(path):
    entries = json.loads(path.read_text())
    entry = next((e for e in entries if e["file"].endswith("01-single-gpu/train_llm.cpp")), None)
    entry = entry or next((e for e in entries if "torch/csrc/api/include" in e.get("command", " ".join(e.get("arguments", [])))), None)
    if entry is None:
        return None
    tokens = entry.get("arguments") or shlex.split(entry["command"])
    if Path(tokens[0]).name in ("ccache", "sccache"):
        tokens = tokens[1:]
    compiler, rest = tokens[0], tokens[1:]
    keep = []
    skip_next = False
    for i, tok in enumerate(rest):
        if skip_next:
            skip_next = False
            continue
        if tok in ("-o", "-MF", "-MT", "-MQ", "-include", "-Xclang", "-c"):
            skip_next = tok != "-c"
            continue
        if tok in ("-MD", "-MMD", "-Winvalid-pch") or tok.startswith("-include") or tok.endswith((".cpp", ".cc", ".cxx")):
            continue
        if tok == "-isystem" or tok == "-I":
            keep += [tok, rest[i + 1]]
            skip_next = True
            continue
        keep.append(tok)
    return compiler, keep, f"build/compile_commands.json (the entry for {Path(entry['file']).name})"


def default_flags():
    libtorch = Path(os.environ.get("MESHTORCH_LIBTORCH", ROOT / ".deps" / "libtorch"))
    flags = ["-std=c++20", "-O2", "-DNDEBUG", "-DUSE_DISTRIBUTED", "-DUSE_C10D_GLOO", "-DFMT_HEADER_ONLY",
             "-I", str(ROOT / "include"),
             "-isystem", str(libtorch / "include"),
             "-isystem", str(libtorch / "include" / "torch" / "csrc" / "api" / "include")]
    return flags, "the include paths and definitions of cmake/meshtorchLibTorch.cmake"


def compile_once(compiler, flags, source, obj):
    start = time.perf_counter()
    proc = subprocess.Popen([compiler, *flags, "-c", str(source), "-o", str(obj)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024**2, proc.returncode, output


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--build", default=str(ROOT / "build"))
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "compile-time.md"))
    p.add_argument("--only", default="", help="comma-separated unit keys (torch is always timed, as the base)")
    args = p.parse_args()
    if args.only:
        keep = {"torch", *args.only.split(",")}
        unknown = keep - {name for name, *_ in UNITS}
        if unknown:
            sys.exit(f"compile_time.py: --only: no unit {', '.join(sorted(unknown))}; the units are "
                     f"{', '.join(name for name, *_ in UNITS)}")
        UNITS[:] = [unit for unit in UNITS if unit[0] in keep]

    build = Path(args.build)
    found = flags_from_compile_commands(build / "compile_commands.json") if (build / "compile_commands.json").exists() else None
    if found:
        compiler, flags, origin = found
    else:
        compiler = compiler_from_cache(build)
        flags, origin = default_flags()
    libtorch_header = next((Path(f[len("-I"):] if f.startswith("-I") and len(f) > 2 else f) / "torch" / "torch.h"
                            for f in flags if "torch/csrc/api/include" in f), None)
    if libtorch_header is None or not libtorch_header.exists():
        sys.exit("compile_time.py: LibTorch's headers are not where the flags say; run scripts/setup first")

    print(f"[compile-time] {compiler} {' '.join(flags)}", file=sys.stderr)
    print(f"[compile-time] flags from {origin}; {args.reps} run(s) per unit", file=sys.stderr)
    times = {name: [] for name, *_ in UNITS}
    cpu = {name: [] for name, *_ in UNITS}
    memory = {name: [] for name, *_ in UNITS}
    errors = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for name, source, _, extra in UNITS:
                if name in errors:
                    continue
                unit_flags = flags + extra
                if extra == SEPARATE:  # as meshtorch_compiled_library(): fmt compiled once, in src/core.hpp
                    unit_flags = [f for f in unit_flags if not f.startswith("-DFMT_HEADER_ONLY")]
                seconds, cpu_seconds, gib, rc, output = compile_once(compiler, unit_flags, SOURCES / source,
                                                                     Path(tmp) / "unit.o")
                if rc != 0:
                    first = [l for l in output.splitlines() if "error" in l][:3] or output.splitlines()[:3]
                    errors[name] = " / ".join(l.strip() for l in first).replace(str(ROOT) + "/", "")
                    print(f"[compile-time] {name}: does not compile: {errors[name]}", file=sys.stderr)
                    continue
                times[name].append(seconds)
                cpu[name].append(cpu_seconds)
                memory[name].append(gib)
                print(f"[compile-time] {name}: {seconds:.1f} s, {cpu_seconds:.1f} s CPU, {gib:.2f} GiB", file=sys.stderr)

    base = statistics.median(times["torch"]) if times["torch"] else None
    cpu_base = statistics.median(cpu["torch"]) if cpu["torch"] else None
    load = os.getloadavg()[0]
    lines = ["## Compile time", "",
             f"One translation unit compiled to an object file, no precompiled header, no ccache; "
             f"median of {args.reps} run(s); flags from {origin}; load average {load:.1f} on {os.cpu_count()} "
             f"cores at the end.", "",
             "| translation unit | seconds | over `<torch/torch.h>` | CPU seconds | CPU over `<torch/torch.h>` | compiler peak memory GiB |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, _, label, _ in UNITS:
        if name in errors:
            lines.append(f"| {label} | does not compile yet | | | | |")
            continue
        t = statistics.median(times[name])
        over = f"+{t - base:.1f} s ({(t / base - 1) * 100:+.0f}%)" if base and name != "torch" else ""
        c = statistics.median(cpu[name])
        cpu_over = f"{c / cpu_base:.2f}x" if cpu_base and name != "torch" else ""
        lines.append(f"| {label} | {t:.1f} | {over} | {c:.1f} | {cpu_over} | {statistics.median(memory[name]):.2f} |")
    if errors:
        lines += ["", "Not compiled: " + "; ".join(f"{n}: {e}" for n, e in errors.items())]
    report = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report)
    print(report)
    return 1 if "torch" in errors else 0


if __name__ == "__main__":
    sys.exit(main())
