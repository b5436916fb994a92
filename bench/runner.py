"""bench/run's body, in sections (--only picks some):
- ch1: chapter 1 of the guide, our 01-single-gpu against the Python reference on transformers;
- ddp: chapter 2, 2 ranks x 1 thread on the CPU (PyTorch over Gloo, ours through shared memory or, with
  --our-transports gloo, Gloo too): our 02-distributed-data-parallel under
  meshrun against PyTorch's DistributedDataParallel under torchrun, ZeroRedundancyOptimizer off
  and on, plus one rank of each stack (chapter 1 at the same per-rank batch) for the scaling;
- fsdp, tp, 2d: chapters 4, 6 and 7, 2 ranks x 1 thread on the CPU, likewise: our
  04-fully-sharded-data-parallel, 06-tensor-parallel and 07-2d-parallel under meshrun against the
  guide's FSDP2, tensor-parallel and 2D scripts under torchrun (opt-in: --only fsdp,tp,2d);
- pp: chapter 11, 2 ranks x 1 thread on the CPU, likewise: our 11-pipeline-parallel under meshrun
  against PyTorch's torch.distributed.pipelining (PipelineStage and its schedules) under torchrun,
  per schedule, the same split into stages and the same micro-batches (opt-in: --only pp);
- ch1-bf16: chapter 1 in bfloat16 (opt-in: --only ch1-bf16);
- ch5: chapter 5's memory savers against their cost, each beside the Python stack's (opt-in:
  --only ch5): activation checkpointing at llama-100m, sequence 1024, 2 ranks of FSDP (also with
  AdamW stepping in backward, ours only), and the chunked loss at a vocabulary of 128256,
  sequence 2048, in chapter 1;
- profile: where chapter 1's time goes, op by op: both sides under their profilers (our --profile,
  torch.profiler in the reference) at llama-tiny, llama-6x384 and llama-100m, 2 threads, fp32, the
  top ops by self time per step in forward and backward side by side (opt-in: --only profile);
- compile-time: the cost of including meshtorch.
Each pair runs in turns (A/B/A/B...) so that a change in the machine's load hits both sides alike,
then medians and ratios per pair. Run it through bench/run, which prepares the Python environment.
"""

import argparse
import datetime
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "bench" / "reference"
sys.path.insert(0, str(REFERENCE))
from metrics_summary import read_jsonl, summarize  # noqa: E402

import context_parallel  # noqa: E402  (bench/context_parallel.py: the cp section)
import generate_bench  # noqa: E402  (bench/generate_bench.py: the generate section)

# Per size: the config folder both sides read, batch x sequence, steps, and steps left out as
# warm-up. The step counts keep bench/run under 20 minutes on 2 cores; llama-100m's first step
# alone takes seconds (first touch of ~1.2 GB of weights, optimizer state and activations).
SIZES = {
    "llama-tiny": dict(config=REFERENCE / "configs" / "llama-tiny", batch=8, seq=256, steps=25, warmup=5),
    # Between them (opt-in through --sizes): hidden 384, head_dim 64, GQA 3:1, a 4096 vocabulary.
    "llama-6x384": dict(config=REFERENCE / "configs" / "llama-6x384", batch=8, seq=256, steps=12, warmup=3),
    "llama-100m": dict(config=REFERENCE / "configs" / "llama-100m", batch=2, seq=256, steps=5, warmup=2),
}
QUICK = {"llama-tiny": dict(steps=8, warmup=3), "llama-6x384": dict(steps=4, warmup=2),
         "llama-100m": dict(steps=3, warmup=1)}
# The DDP section: per-rank batch x sequence as above (so one rank of it is chapter 1's run), fewer
# steps at llama-tiny, where a step is short and its spread small.
DDP_SIZES = {
    "llama-tiny": dict(config=REFERENCE / "configs" / "llama-tiny", batch=8, seq=256, steps=20, warmup=5),
    "llama-100m": dict(config=REFERENCE / "configs" / "llama-100m", batch=2, seq=256, steps=5, warmup=2),
}
# Repetitions and ZeroRedundancyOptimizer settings per size: llama-100m's runs take half a minute
# each, so one repetition without ZeRO keeps the section near 6 minutes on 2 cores.
DDP_DEFAULTS = {"llama-tiny": (3, ["off", "on"]), "llama-100m": (1, ["off"])}
DDP_QUICK = {"llama-tiny": dict(steps=8, warmup=3), "llama-100m": dict(steps=3, warmup=1)}
DDP_RANKS = 2
# A plain bench/run runs DEFAULT_SECTIONS (about 16 minutes on 2 idle cores); the others would take
# it past 20 minutes (fsdp + tp + 2d about 6 more at llama-tiny, pp about 2 with its three schedules,
# ch1-bf16 about as long as ch1, profile about 4), so they are opt-in through --only.
SECTIONS = ["ch1", "ddp", "fsdp", "tp", "2d", "pp", "cp", "zero2", "ch5", "ch1-bf16", "profile", "generate",
            "compile-time"]
DEFAULT_SECTIONS = ["ch1", "ddp", "compile-time"]
DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16"}
IMPL_NAMES = {"ours": "meshtorch", "hf-eager": "HF eager", "hf-compile": "HF compile",
              "ours-unfused": "meshtorch --fused off", "ours-1": "meshtorch 1 rank", "hf-1": "PyTorch 1 rank",
              "ours-ddp": "meshtorch DDP", "torch-ddp": "PyTorch DDP",
              "ours-ddp-zero": "meshtorch DDP + ZeRO", "torch-ddp-zero": "PyTorch DDP + ZeRO"}
PHASES = ["data", "forward", "backward", "update"]


def log(msg):
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def skipped_unbuilt(name, title, paths):
    """For a section whose binaries are not all built: logs and prints that it is skipped, and
    returns the section's (report, docs sections, runs expected, runs done); None when all are."""
    missing = [p for p in paths if not os.access(p, os.X_OK)]
    if not missing:
        return None
    shown = ", ".join(os.path.relpath(p, ROOT) if str(p).startswith(str(ROOT)) else str(p) for p in missing)
    line = f"{name}: skipped: {shown} not built"
    log(line)
    print(f"## {title}\n\n{line}\n")
    return line, {}, 0, 0


def rotated(items, rep):
    """`items` turned by `rep` places: the order of a repetition's runs, so that a trend in the
    machine's load favours none of them."""
    turn = rep % len(items)
    return items[turn:] + items[:turn]


def parse_args():
    p = argparse.ArgumentParser(prog="bench/run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(DEFAULT_SECTIONS),
                   help="comma-separated sections to run: " + ", ".join(SECTIONS) + ", or 'all' (default: "
                        + ",".join(DEFAULT_SECTIONS) + ")")
    p.add_argument("--sizes", default="llama-tiny,llama-100m", help="comma-separated: " + ", ".join(SIZES))
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--reps", type=int, default=3, help="runs of each side per pair, taken in turns")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--compile-sizes", default="llama-tiny",
                   help="sizes at which the torch.compile variant of the reference runs too ('' for none); "
                        "its first run compiles for about a minute per size")
    p.add_argument("--unfused-sizes", default="llama-tiny",
                   help="sizes at which our binary runs with --fused off too (LibTorch's composite ops instead of "
                        "the fused kernels; '' for none)")
    p.add_argument("--bin", default=str(ROOT / "build" / "bin" / "01-single-gpu"), help="our chapter-1 binary")
    p.add_argument("--reference-only", action="store_true", help="run only the Python side")
    p.add_argument("--ddp-sizes", default=None,
                   help="sizes of the DDP section (default llama-tiny,llama-100m; llama-tiny with --quick)")
    p.add_argument("--ddp-reps", type=int, default=None,
                   help="repetitions of the DDP section at every size (default: 3 at llama-tiny, 1 at llama-100m)")
    p.add_argument("--ddp-zero", default=None,
                   help="ZeroRedundancyOptimizer in the DDP section: off, on or off,on at every size "
                        "(default: off,on at llama-tiny, off at llama-100m)")
    p.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP gradient bucket size, both sides")
    p.add_argument("--ddp-bin", default=str(ROOT / "build" / "bin" / "02-distributed-data-parallel"),
                   help="our chapter-2 binary")
    p.add_argument("--par-sizes", default="llama-tiny",
                   help="sizes of the fsdp, tp, 2d and pp sections (comma-separated: " + ", ".join(DDP_SIZES) + ")")
    p.add_argument("--par-reps", type=int, default=None,
                   help="repetitions of the fsdp, tp, 2d and pp sections (default 3)")
    p.add_argument("--fsdp-variants", default="reshard",
                   help="fsdp section variants, comma-separated: reshard (reshard_after_forward on, the guide's "
                        "setting; each side prefetches as it does by default), keep (--no-reshard-after-forward), "
                        "offload (--cpu-offload), noprefetch (--prefetch-layers 0 on both sides), ac (every decoder "
                        "layer checkpointed on both sides: chapter 5's recipe)")
    p.add_argument("--our-transports", default=os.environ.get("MESHTORCH_CPU_TRANSPORT") or "shm",
                   help="CPU transports of our multi-rank runs, comma-separated: shm (collectives through shared "
                        "memory, the default) and gloo (Gloo's sockets, as PyTorch's side). The first serves every "
                        "section; in the fsdp, tp, 2d and pp sections each further one adds rows of ours on it, "
                        "paired with the same PyTorch runs (default: $MESHTORCH_CPU_TRANSPORT, else shm)")
    p.add_argument("--tp-size", type=int, default=2, help="--tp of the tp and 2d sections (2d: mesh (2/tp, tp))")
    p.add_argument("--fsdp-bin", default=str(ROOT / "build" / "bin" / "04-fully-sharded-data-parallel"),
                   help="our chapter-4 binary")
    p.add_argument("--tp-bin", default=str(ROOT / "build" / "bin" / "06-tensor-parallel"), help="our chapter-6 binary")
    p.add_argument("--2d-bin", dest="twod_bin", default=str(ROOT / "build" / "bin" / "07-2d-parallel"),
                   help="our chapter-7 binary")
    p.add_argument("--pp-bin", default=str(ROOT / "build" / "bin" / "11-pipeline-parallel"), help="our chapter-11 binary")
    p.add_argument("--pp-schedules", default="1f1b,interleaved-1f1b,zbv",
                   help="pp section schedules, comma-separated: " + ", ".join(PP_SCHEDULES)
                        + " (interleaved-1f1b and zbv with 2 stages per rank)")
    p.add_argument("--cp-bin", default=str(ROOT / "build" / "bin" / "12-context-parallel"), help="our chapter-12 binary")
    p.add_argument("--pp-microbatches", type=int, default=4,
                   help="micro-batches per step in the pp section, both sides (divides each size's batch: "
                        "llama-tiny 8, llama-100m 4)")
    p.add_argument("--bf16-compile-sizes", default="",
                   help="sizes at which ch1-bf16 also runs the torch.compile variant (default: none)")
    p.add_argument("--meshrun", default=str(ROOT / "build" / "bin" / "meshrun"), help="our launcher")
    p.add_argument("--ch5-bin", default=str(ROOT / "build" / "bin" / "05-training-llama-405b"),
                   help="our chapter-5 binary (the ch5 section)")
    p.add_argument("--ch5-reps", type=int, default=1, help="repetitions of the ch5 section (default 1: ~12 minutes)")
    p.add_argument("--engine-bin", default=str(ROOT / "build" / "bin" / "08-alternative-frameworks"),
                   help="our chapter-8 binary (the zero2 section)")
    p.add_argument("--profile-sizes", default=",".join(PROFILE_SIZES),
                   help="sizes of the profile section (comma-separated: " + ", ".join(PROFILE_SIZES) + ")")
    p.add_argument("--quick", action="store_true", help="one run per side and few steps: checks the wiring, not a measurement")
    p.add_argument("--no-compile-time", action="store_true", help="skip the compile-time benchmark")
    p.add_argument("--out", default=str(ROOT / "bench" / "out"))
    p.add_argument("--update-docs", action="store_true", help="write the tables into docs/performance.md")
    p.add_argument("--timeout", type=int, default=900, help="seconds allowed per run")
    return p.parse_args()


def machine_description():
    cpu = platform.processor() or platform.machine()
    try:
        info = {}
        with open("/proc/cpuinfo") as fp:
            for line in fp:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
        cpu = info.get("model name", cpu)
        if "cpu family" in info:
            cpu += f" (family {info['cpu family']}, model {info.get('model', '?')})"
        simd = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx2") if f in info.get("flags", "").split()]
        if simd:
            cpu += ", " + " ".join(simd)
    except OSError:
        pass
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    except (ValueError, OSError):
        mem_gib = float("nan")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_gib, 1), "commit": commit,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "loadavg_start": os.getloadavg()[0]}


def train_flops_per_token(config_dir, seq):
    """Forward + backward FLOPs per token: 6 x the parameters that take part in a matmul (the
    embedding lookup does not; the LM head does, tied or not) + 12 x layers x seq x q_size for
    attention scores and values, counted without the causal half, as PaLM's MFU does."""
    c = json.loads((Path(config_dir) / "config.json").read_text())
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    q = c["num_attention_heads"] * head_dim
    kv = c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * c["intermediate_size"]
    return 6 * (layers * per_layer + h * c["vocab_size"]) + 12 * layers * seq * q


def gemm_peaks(threads_list, dtype="float32"):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gemm_peak.py"), "--threads",
                           ",".join(map(str, threads_list)), "--dtypes", dtype], capture_output=True, text=True)
    if proc.returncode != 0:
        log("gemm_peak.py failed: " + proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "")
        return {}
    return {int(k): v for k, v in json.loads(proc.stdout)[dtype].items()}


def free_port():
    """A port nothing listens on now, for meshrun's rendezvous (a test or another run on the
    machine may hold the default 29500); meshrun also uses the next one."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port < 65535:
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    pass


def command(impl, spec, threads, name, args, corpus, runs_dir):
    """The command line of one run: impl is a key of IMPL_NAMES."""
    common = ["-m", str(spec["config"]), "-d", str(corpus), "-b", str(spec["batch"]), "-s", str(spec["seq"]),
              "--max-steps", str(spec["steps"]), "--log-freq", "1", "--lr", "3e-4", "--seed", "0",
              "--dtype", args.dtype, "--threads", str(threads), "-e", name, "--save-dir", str(runs_dir)]
    ours_flags = ["--device", "cpu", "--ckpt-freq", "1000000"]
    reference = ["--warmup-steps", str(spec["warmup"])]
    if impl in ("ours", "ours-1", "ours-unfused"):
        return [args.bin, *common, *ours_flags] + (["--fused", "off"] if impl == "ours-unfused" else [])
    if impl in ("hf-eager", "hf-compile", "hf-1"):
        return [sys.executable, str(REFERENCE / "train_llm_ch1.py"), *common, *reference] + (
            ["--compile"] if impl == "hf-compile" else [])
    zero = impl.endswith("-zero")
    if impl.startswith("ours-ddp"):
        return [args.meshrun, "--nproc-per-node", str(DDP_RANKS), "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), "--", args.ddp_bin, *common, *ours_flags,
                "--zero" if zero else "--no-zero", "--bucket-cap-mb", str(args.bucket_cap_mb)]
    if impl.startswith("torch-ddp"):
        torchrun = Path(sys.executable).parent / "torchrun"
        launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
        return [*launcher, "--standalone", "--nproc-per-node", str(DDP_RANKS), str(REFERENCE / "train_llm_ch2.py"),
                *common, *reference, "--bucket-cap-mb", str(args.bucket_cap_mb)] + (["--zero"] if zero else [])
    raise ValueError(impl)


def run_one(impl, spec, threads, name, args, corpus, runs_dir):
    """Runs one side once; returns the summary of its metrics.jsonl (rank 0's), or None."""
    cmd = command(impl, spec, threads, name, args, corpus, runs_dir)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return run_cmd(cmd, spec, name, args, runs_dir, env)


def run_cmd(cmd, spec, name, args, runs_dir, env):
    """Runs one command line (an experiment named name under runs_dir); returns the summary of its
    metrics.jsonl (rank 0's), or None."""
    run_dir = runs_dir / name
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)  # a leftover experiment would be resumed
    run_dir.mkdir(parents=True, exist_ok=True)
    loadavg = os.getloadavg()[0]  # before the run: what else the machine was doing
    start = time.perf_counter()
    with open(runs_dir / f"{name}.log", "w") as out:
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=args.timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - start
    metrics = run_dir / "metrics.jsonl"
    if rc != 0 or not metrics.exists():
        tail = (runs_dir / f"{name}.log").read_text(errors="replace").splitlines()[-8:]
        log(f"{name}: failed (exit {rc}); last lines of {runs_dir / (name + '.log')}:")
        for line in tail:
            log("    " + line)
        return None
    summary = summarize(read_jsonl(metrics), spec["warmup"])
    summary["wall_s"] = wall
    summary["loadavg"] = loadavg
    log(f"{name}: {summary['tokens_per_s']:.0f} tokens/s, {summary['time/total']:.1f} ms/step, "
        f"peak RSS {summary['peak_rss_gb']:.2f} GB, {wall:.1f} s")
    return summary


def median_of(runs, key):
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def fmt(value, digits=1):
    if value is None:
        return "—"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def ratio(a, b):
    return f"{a / b:.2f}" if a is not None and b else "—"


def paired_ratio(ours, theirs, key):
    """Median over repetitions of ours[i] / theirs[i]: the runs of one repetition follow each other
    within a minute, so a change in the machine's load cancels in the pair."""
    pairs = [(o[key], t[key]) for o, t in zip(ours, theirs) if o.get(key) and t.get(key)]
    return f"{statistics.median(o / t for o, t in pairs):.2f}" if pairs else "—"


def tables(results, args, sizes, threads_list, impls, peaks):
    """Markdown: a summary table, then one table per size with the phases."""
    lines = []
    if peaks:
        lines.append(f"{DTYPE_SHORT[args.dtype]} GEMM peak measured in this run (2048^3 matmul, best of 2 s at start and at end): " +
                     ", ".join(f"{fmt(peaks[t])} GFLOP/s with {t} thread{'s' if t > 1 else ''}" for t in sorted(peaks)) +
                     ". '% of peak' = tokens/s x training FLOPs per token / that peak.")
        lines.append("")
    lines.append(f"Chapter 1, single process, {args.dtype}, CPU. Medians over {args.reps} run(s) per side, each the "
                 "median over its steps after warm-up. Ratios are ours / theirs, the median over repetitions of the "
                 "ratio within a repetition (tokens/s: above 1 means we are faster; ms and memory: below 1 means we "
                 "use less).")
    lines.append("")
    header = "| model | threads | meshtorch tokens/s | HF eager tokens/s | ours / HF eager |"
    rule = "| --- | ---: | ---: | ---: | ---: |"
    if "hf-compile" in impls:
        header += " HF compile tokens/s | ours / HF compile |"
        rule += " ---: | ---: |"
    if "ours-unfused" in impls:
        header += " meshtorch --fused off tokens/s | fused / unfused |"
        rule += " ---: | ---: |"
    header += " meshtorch % of peak | HF eager % of peak |"
    rule += " ---: | ---: |"
    header += " meshtorch peak RSS GB | HF eager peak RSS GB | ours / HF eager |"
    rule += " ---: | ---: | ---: |"
    lines += [header, rule]
    for size in sizes:
        for t in threads_list:
            r = {impl: results.get((size, t, impl), []) for impl in impls}
            ours = median_of(r.get("ours", []), "tokens_per_s")
            eager = median_of(r["hf-eager"], "tokens_per_s")
            row = f"| {size} | {t} | {fmt(ours)} | {fmt(eager)} | {paired_ratio(r.get('ours', []), r['hf-eager'], 'tokens_per_s')} |"
            if "hf-compile" in impls:
                comp = median_of(r["hf-compile"], "tokens_per_s")
                row += f" {fmt(comp)} | {paired_ratio(r.get('ours', []), r['hf-compile'], 'tokens_per_s')} |"
            if "ours-unfused" in impls:
                unfused = median_of(r["ours-unfused"], "tokens_per_s")
                row += f" {fmt(unfused)} | {paired_ratio(r.get('ours', []), r['ours-unfused'], 'tokens_per_s')} |"
            flops = train_flops_per_token(SIZES[size]["config"], SIZES[size]["seq"])
            pct = lambda tps: f"{100 * tps * flops / 1e9 / peaks[t]:.0f}%" if tps and peaks.get(t) else "—"
            row += f" {pct(ours)} | {pct(eager)} |"
            mo = median_of(r.get("ours", []), "peak_rss_gb")
            me = median_of(r["hf-eager"], "peak_rss_gb")
            row += f" {fmt(mo, 2)} | {fmt(me, 2)} | {paired_ratio(r.get('ours', []), r['hf-eager'], 'peak_rss_gb')} |"
            lines.append(row)
    for size in sizes:
        spec = SIZES[size]
        lines.append("")
        lines.append(f"### {size}: batch {spec['batch']} x sequence {spec['seq']}, {spec['steps']} steps "
                     f"of which {spec['warmup']} warm-up")
        lines.append("")
        lines.append("| threads | run | tokens/s (min–max) | ms/step | data | forward | backward | update | "
                     "peak RSS GB | process s |")
        lines.append("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for t in threads_list:
            for impl in impls:
                runs = results.get((size, t, impl), [])
                if not runs:
                    lines.append(f"| {t} | {IMPL_NAMES[impl]} | not run |  |  |  |  |  |  |  |")
                    continue
                tps = [r["tokens_per_s"] for r in runs]
                cells = [f"{fmt(median_of(runs, 'tokens_per_s'))} ({fmt(min(tps))}–{fmt(max(tps))})",
                         fmt(median_of(runs, "time/total"))]
                cells += [fmt(median_of(runs, f"time/{p}"), 2) for p in PHASES]
                cells += [fmt(median_of(runs, "peak_rss_gb"), 2), fmt(median_of(runs, "wall_s"))]
                lines.append(f"| {t} | {IMPL_NAMES[impl]} | " + " | ".join(cells) + " |")
            ours = results.get((size, t, "ours"), [])
            for ref in [i for i in impls if i != "ours"]:
                theirs = results.get((size, t, ref), [])
                if not ours or not theirs:
                    continue
                cells = [paired_ratio(ours, theirs, k)
                         for k in ["tokens_per_s", "time/total", *[f"time/{p}" for p in PHASES], "peak_rss_gb", "wall_s"]]
                lines.append(f"| {t} | ours / {IMPL_NAMES[ref]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def update_docs(sections):
    """Replaces the text between <!-- bench/run:NAME --> and <!-- /bench/run:NAME --> markers."""
    page = ROOT / "docs" / "performance.md"
    text = page.read_text()
    for name, body in sections.items():
        begin, end = f"<!-- bench/run:{name} -->", f"<!-- /bench/run:{name} -->"
        a, b = text.find(begin), text.find(end)
        if a < 0 or b < a:
            log(f"docs/performance.md has no {begin} ... {end} section; left as it is")
            continue
        text = text[: a + len(begin)] + "\n" + body.strip() + "\n" + text[b:]
    page.write_text(text)
    log("tables written into docs/performance.md")
    chart = ROOT / "docs" / "images" / "performance-ratios.png"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "meshtorch-plot"), "ratios", str(page), "-o",
                           str(chart)], capture_output=True, text=True)
    log(f"the ratios chart redrawn: {chart}" if proc.returncode == 0 else
        f"the ratios chart was not redrawn (tools/meshtorch-plot failed):\n{proc.stderr}")


def chapter1(args, corpus, runs_dir, out, machine, stem="chapter1"):
    """The chapter-1 section in args.dtype; returns (report, docs sections, runs expected, runs
    done). stem names its files (bench/out/<stem>.md, .json) and its docs section."""
    sizes = [s for s in args.sizes.split(",") if s]
    threads_list = [int(t) for t in args.threads.split(",") if t]
    compile_sizes = {s for s in args.compile_sizes.split(",") if s}
    unfused_sizes = {s for s in args.unfused_sizes.split(",") if s}
    if args.quick:
        for s, q in QUICK.items():
            SIZES[s].update(q)
    with_ours = not args.reference_only
    if with_ours and not os.access(args.bin, os.X_OK):
        log(f"our binary {args.bin} is not built yet: build it with scripts/setup (see README.md). "
            "Measuring the Python reference alone; the ratio columns stay empty.")
        with_ours = False

    started = time.perf_counter()
    loadavg_start = os.getloadavg()[0]
    peaks = gemm_peaks(threads_list, args.dtype)
    results = {}
    ours_impls = lambda size_set: (["ours"] + (["ours-unfused"] if unfused_sizes & size_set else [])) if with_ours else []
    impls_all = ours_impls(set(sizes)) + ["hf-eager"] + (["hf-compile"] if compile_sizes & set(sizes) else [])
    expected = 0
    for size in sizes:
        impls = ours_impls({size}) + ["hf-eager"] + (["hf-compile"] if size in compile_sizes else [])
        for t in threads_list:
            for rep in range(1, args.reps + 1):
                for impl in impls:
                    expected += 1
                    prefix = "" if args.dtype == "float32" else f"{DTYPE_SHORT[args.dtype]}-"
                    summary = run_one(impl, SIZES[size], t, f"{prefix}{size}-t{t}-{impl}-r{rep}", args, corpus, runs_dir)
                    if summary is not None:
                        results.setdefault((size, t, impl), []).append(summary)
    loadavg_end = os.getloadavg()[0]
    # A best-of measurement can only be lowered by other load: take the better of start and end.
    for t, v in gemm_peaks(threads_list, args.dtype).items():
        peaks[t] = max(v, peaks.get(t, 0.0))
    machine = dict(machine)
    machine[f"gemm_peak_gflops_{DTYPE_SHORT[args.dtype]}"] = peaks
    minutes = round((time.perf_counter() - started) / 60, 1)

    text = [f"## Chapter 1 throughput, {args.dtype} ({machine['date']}, commit {machine['commit']})", "",
            f"{machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB; load average "
            f"{loadavg_start:.2f} at start, {loadavg_end:.2f} at end; {minutes} minutes.", ""]
    if not with_ours:
        text += ["Our binary was not run (not built, or --reference-only): the meshtorch columns are empty.", ""]
    if args.quick:
        text += ["**--quick: one short run per side; this checks the wiring and measures nothing.**", ""]
    text.append(tables(results, args, sizes, threads_list, impls_all, peaks))
    report = "\n".join(text)
    (out / f"{stem}.md").write_text(report)
    (out / f"{stem}.json").write_text(json.dumps(
        {"machine": {**machine, "loadavg_start": loadavg_start, "loadavg_end": loadavg_end, "bench_minutes": minutes},
         "args": vars(args),
         "sizes": {s: {k: str(v) for k, v in SIZES[s].items()} for s in sizes},
         "runs": [{"size": s, "threads": t, "impl": i, **r} for (s, t, i), rs in results.items() for r in rs]},
        indent=1))
    print(report)
    log(f"tables written to {out / (stem + '.md')} (raw figures in {out / (stem + '.json')})")

    import torch
    peak_text = ", ".join(f"{fmt(v)} GFLOP/s with {t} thread{'s' if t > 1 else ''}" for t, v in sorted(peaks.items()))
    sections = {stem: report.split("\n", 2)[2]}  # without the heading line
    if args.dtype == "float32":  # the machine line quotes the fp32 peak
        sections["machine"] = (f"{machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB "
                               f"(measured {machine['date']}, commit {machine['commit']}, torch {torch.__version__}). "
                               f"fp32 GEMM peak: {peak_text or 'not measured'}.")
    return report, sections, expected, sum(len(v) for v in results.values())


def ddp_plan(args):
    """{size: (repetitions, [zero settings])} of the DDP section."""
    sizes = [s for s in (args.ddp_sizes or ("llama-tiny" if args.quick else "llama-tiny,llama-100m")).split(",") if s]
    plan = {}
    for size in sizes:
        if size not in DDP_SIZES:
            sys.exit(f"bench/run: unknown DDP size {size!r}; known: {', '.join(DDP_SIZES)}")
        reps, zero = DDP_DEFAULTS[size]
        if args.quick:
            reps = 1
        if args.ddp_reps:
            reps = args.ddp_reps
        if args.ddp_zero:
            zero = [z for z in args.ddp_zero.split(",") if z]
            if not set(zero) <= {"off", "on"}:
                sys.exit(f"bench/run: --ddp-zero takes off, on or off,on, not {args.ddp_zero!r}")
        plan[size] = (reps, zero)
    return plan


def paired(a, b, key):
    """Median over the repetitions both dicts (rep -> summary) hold of a[rep][key] / b[rep][key]."""
    values = [a[r][key] / b[r][key] for r in a if r in b and a[r].get(key) and b[r].get(key)]
    return statistics.median(values) if values else None


def ddp_tables(results, plan):
    """Markdown: the scaling and side-by-side summary, then one table per size with the phases."""
    lines = ["2 ranks x 1 thread on the CPU, fp32; PyTorch's collectives over Gloo (loopback), ours "
             f"{TRANSPORT_WORDS[os.environ['MESHTORCH_CPU_TRANSPORT']]}. \"1 rank\" is chapter 1 at the same per-rank "
             "batch with 1 thread (our 01-single-gpu; the guide's chapter-1 script on HF transformers), so 2 ranks "
             "process twice its tokens per step. tokens/s counts the global batch (ranks x batch x sequence). "
             "Figures are medians over repetitions of each run's median step after warm-up; every ratio is the "
             "median over repetitions of the ratio within a repetition. Scaling 2/1 = tokens/s with 2 ranks over "
             "tokens/s with 1 rank of the same stack (2.00 would be perfect on 2 cores); ours / PyTorch above 1 "
             "means we are faster.", "",
             "| model | ZeRO | meshtorch 1 rank | meshtorch 2 ranks | meshtorch scaling 2/1 | PyTorch 1 rank "
             "| PyTorch DDP 2 ranks | PyTorch scaling 2/1 | ours / PyTorch, 2 ranks | ours / PyTorch, 1 rank |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    r2 = lambda v: f"{v:.2f}" if v is not None else "—"
    med = lambda runs, key="tokens_per_s": median_of(list(runs.values()), key)
    for size, (reps, zeros) in plan.items():
        get = lambda impl: results.get((size, impl), {})
        for z in zeros:
            suffix = "-zero" if z == "on" else ""
            o1, h1, o2, t2 = get("ours-1"), get("hf-1"), get("ours-ddp" + suffix), get("torch-ddp" + suffix)
            lines.append(f"| {size} | {z} | {fmt(med(o1))} | {fmt(med(o2))} | {r2(paired(o2, o1, 'tokens_per_s'))} "
                         f"| {fmt(med(h1))} | {fmt(med(t2))} | {r2(paired(t2, h1, 'tokens_per_s'))} "
                         f"| {r2(paired(o2, t2, 'tokens_per_s'))} | {r2(paired(o1, h1, 'tokens_per_s'))} |")
    keys = ["tokens_per_s", "time/total", *[f"time/{p}" for p in PHASES], "peak_rss_gb", "wall_s"]
    for size, (reps, zeros) in plan.items():
        spec = DDP_SIZES[size]
        impls = ["ours-1", "hf-1"] + [i + ("-zero" if z == "on" else "") for z in zeros for i in ("ours-ddp", "torch-ddp")]
        lines += ["", f"### DDP, {size}: per-rank batch {spec['batch']} x sequence {spec['seq']}, {spec['steps']} steps "
                      f"of which {spec['warmup']} warm-up, {reps} repetition(s)", "",
                  "| run | tokens/s (min–max) | ms/step | data | forward | backward | update | rank 0 peak RSS GB "
                  "| process s | load avg (min–max) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for impl in impls:
            runs = results.get((size, impl), {})
            if not runs:
                lines.append(f"| {IMPL_NAMES[impl]} | not run |  |  |  |  |  |  |  |  |")
                continue
            tps = [r["tokens_per_s"] for r in runs.values()]
            load = [r["loadavg"] for r in runs.values()]
            cells = [f"{fmt(med(runs))} ({fmt(min(tps))}–{fmt(max(tps))})", fmt(med(runs, "time/total"))]
            cells += [fmt(med(runs, f"time/{p}"), 2) for p in PHASES]
            cells += [fmt(med(runs, "peak_rss_gb"), 2), fmt(med(runs, "wall_s")), f"{min(load):.2f}–{max(load):.2f}"]
            lines.append(f"| {IMPL_NAMES[impl]} | " + " | ".join(cells) + " |")
        pairs = [("ours-1", "hf-1")] + [("ours-ddp" + s, "torch-ddp" + s) for s in ["-zero" if z == "on" else "" for z in zeros]]
        pairs += [("ours-ddp" + s, "ours-1") for s in ["-zero" if z == "on" else "" for z in zeros]]
        pairs += [("torch-ddp" + s, "hf-1") for s in ["-zero" if z == "on" else "" for z in zeros]]
        for a, b in pairs:
            ra, rb = results.get((size, a), {}), results.get((size, b), {})
            if ra and rb:
                cells = [r2(paired(ra, rb, k)) for k in keys]
                lines.append(f"| {IMPL_NAMES[a]} / {IMPL_NAMES[b]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def ddp_section(args, corpus, runs_dir, out, machine):
    """The DDP section; returns (report, docs sections, runs expected, runs done)."""
    plan = ddp_plan(args)
    if args.quick:
        for s, q in DDP_QUICK.items():
            DDP_SIZES[s].update(q)
    with_ours = not args.reference_only
    for path in (args.bin, args.ddp_bin, args.meshrun):
        if with_ours and not os.access(path, os.X_OK):
            log(f"{path} is not built yet: build it with scripts/setup (see README.md). "
                "Measuring the Python side alone; the ratio columns stay empty.")
            with_ours = False
    started = time.perf_counter()
    loadavg_start = os.getloadavg()[0]
    results, expected = {}, 0
    for size, (reps, zeros) in plan.items():
        spec = DDP_SIZES[size]
        pairs = [("ours-1", "hf-1")] + [(f"ours-ddp{s}", f"torch-ddp{s}") for s in ["-zero" if z == "on" else "" for z in zeros]]
        for rep in range(1, reps + 1):
            for pair in pairs:
                # Ours first in odd repetitions, theirs first in even ones: a trend in the load
                # during a pair then favours neither side over the repetitions.
                for impl in (pair if rep % 2 else pair[::-1]):
                    if impl.startswith("ours") and not with_ours:
                        continue
                    expected += 1
                    summary = run_one(impl, spec, 1, f"ddp-{size}-{impl}-r{rep}", args, corpus, runs_dir)
                    if summary is not None:
                        results.setdefault((size, impl), {})[rep] = summary
    loadavg_end = os.getloadavg()[0]
    minutes = round((time.perf_counter() - started) / 60, 1)
    loads = [r["loadavg"] for runs in results.values() for r in runs.values()]
    text = [f"## Chapter 2 DDP throughput ({machine['date']}, commit {machine['commit']})", "",
            f"{machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB; load average "
            f"{loadavg_start:.2f} at start, {loadavg_end:.2f} at end"
            + (f", {min(loads):.2f}–{max(loads):.2f} at the starts of the runs" if loads else "")
            + f"; {minutes} minutes.", ""]
    if not with_ours:
        text += ["Our binaries were not run (not built, or --reference-only): the meshtorch columns are empty.", ""]
    if args.quick:
        text += ["**--quick: one short run per side; this checks the wiring and measures nothing.**", ""]
    text.append(ddp_tables(results, plan))
    report = "\n".join(text)
    (out / "ddp.md").write_text(report)
    (out / "ddp.json").write_text(json.dumps(
        {"machine": {**machine, "loadavg_start": loadavg_start, "loadavg_end": loadavg_end, "bench_minutes": minutes},
         "args": vars(args),
         "plan": {s: {"reps": r, "zero": z, **{k: str(v) for k, v in DDP_SIZES[s].items()}} for s, (r, z) in plan.items()},
         "runs": [{"size": s, "impl": i, "rep": rep, **r} for (s, i), runs in results.items() for rep, r in runs.items()]},
        indent=1))
    print(report)
    log(f"tables written to {out / 'ddp.md'} (raw figures in {out / 'ddp.json'})")
    return report, {"ddp": report.split("\n", 2)[2]}, expected, sum(len(v) for v in results.values())


# The fsdp, tp and 2d sections: 2 ranks x 1 thread, ours under meshrun against the guide's script
# under torchrun, per variant; the per-rank batch, sequence and steps of the DDP section.
PAR_SECTIONS = {
    "fsdp": dict(title="Chapter 4 FSDP2", chapter="04-fully-sharded-data-parallel", bin_arg="fsdp_bin",
                 reference="train_llm_ch4.py", ours="meshtorch FSDP", theirs="PyTorch FSDP2"),
    "tp": dict(title="Chapter 6 tensor parallel", chapter="06-tensor-parallel", bin_arg="tp_bin",
               reference="train_llm_ch6.py", ours="meshtorch TP", theirs="PyTorch TP"),
    "2d": dict(title="Chapter 7 2D parallel", chapter="07-2d-parallel", bin_arg="twod_bin",
               reference="train_llm_ch7.py", ours="meshtorch 2D", theirs="PyTorch 2D"),
    # Both sides time the whole schedule (every forward and backward) as one phase, "pipeline".
    "pp": dict(title="Chapter 11 pipeline parallel", chapter="11-pipeline-parallel", bin_arg="pp_bin",
               reference="train_llm_ch11.py", ours="meshtorch PP", theirs="PyTorch PP",
               phases=["data", "pipeline", "update"], variant_label="schedule"),
}
PAR_RANKS = 2
# The pp section: the DDP section's sizes, but a batch that splits into 4 micro-batches at llama-100m.
PP_SIZES = {s: dict(v, batch=4) if s == "llama-100m" else dict(v) for s, v in DDP_SIZES.items()}
# --stages-per-rank of each schedule: 2 where the schedule holds several stages per rank (ZBV: exactly 2).
PP_SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zbv": 2}
FSDP_VARIANTS = {"reshard": ["--reshard-after-forward"], "keep": ["--no-reshard-after-forward"],
                 "offload": ["--cpu-offload", "--reshard-after-forward"],
                 "noprefetch": ["--reshard-after-forward", "--prefetch-layers", "0"],
                 "ac": ["--reshard-after-forward", "--activation-checkpointing", "full"]}


def par_sizes(kind):
    """The sizes table of one section: the DDP section's, but the pp section's own batch."""
    return PP_SIZES if kind == "pp" else DDP_SIZES


def par_variants(kind, args):
    """{variant name: flags given to both sides} of one section."""
    if kind == "pp":
        names = [v for v in args.pp_schedules.split(",") if v]
        unknown = [v for v in names if v not in PP_SCHEDULES]
        if unknown:
            sys.exit(f"bench/run: unknown --pp-schedules {', '.join(unknown)}; known: {', '.join(PP_SCHEDULES)}")
        return {v: ["--pp", str(PAR_RANKS), "--schedule", v, "--stages-per-rank", str(PP_SCHEDULES[v]),
                    "--microbatches", str(args.pp_microbatches)] for v in names}
    if kind == "fsdp":
        names = [v for v in args.fsdp_variants.split(",") if v]
        unknown = [v for v in names if v not in FSDP_VARIANTS]
        if unknown:
            sys.exit(f"bench/run: unknown --fsdp-variants {', '.join(unknown)}; known: {', '.join(FSDP_VARIANTS)}")
        return {v: FSDP_VARIANTS[v] for v in names}
    if PAR_RANKS % args.tp_size:
        sys.exit(f"bench/run: --tp-size {args.tp_size} does not divide {PAR_RANKS} ranks")
    dp = PAR_RANKS // args.tp_size
    name = f"tp{args.tp_size}" if kind == "tp" else f"dp{dp}xtp{args.tp_size}"
    return {name: ["--tp", str(args.tp_size)]}


def par_command(kind, side, spec, flags, name, args, corpus, runs_dir):
    common = ["-m", str(spec["config"]), "-d", str(corpus), "-b", str(spec["batch"]), "-s", str(spec["seq"]),
              "--max-steps", str(spec["steps"]), "--log-freq", "1", "--lr", "3e-4", "--seed", "0",
              "--dtype", args.dtype, "--threads", "1", "-e", name, "--save-dir", str(runs_dir), *flags]
    if side == "ours":
        return [args.meshrun, "--nproc-per-node", str(PAR_RANKS), "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), "--", getattr(args, PAR_SECTIONS[kind]["bin_arg"]), *common,
                "--device", "cpu", "--ckpt-freq", "1000000"]
    torchrun = Path(sys.executable).parent / "torchrun"
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", "--nproc-per-node", str(PAR_RANKS),
            str(REFERENCE / PAR_SECTIONS[kind]["reference"]), *common, "--warmup-steps", str(spec["warmup"]),
            *(pp_reference_flags(spec, flags) if kind == "pp" else [])]


def pp_reference_flags(spec, flags):
    """What the PyTorch side of the pp section needs beyond the shared flags: our binary's split into
    stages, given explicitly (ours splits by itself and logs it; the tables check both logs), and
    for ZBV the handshake Gloo refuses left out (see train_llm_ch11.py)."""
    from train_llm_ch11 import balanced_units, unit_costs  # torch and transformers: imported only here

    value = lambda flag: flags[flags.index(flag) + 1]
    stages = int(value("--pp")) * int(value("--stages-per-rank"))
    config = json.loads((Path(spec["config"]) / "config.json").read_text())
    units = balanced_units(unit_costs(config, spec["seq"]), stages)
    return ["--units-per-stage", ",".join(map(str, units))] + (
        ["--skip-self-handshake"] if value("--schedule") == "zbv" else [])


def pp_details(summary, name, spec, runs_dir):
    """Adds to a pp run's summary what metrics_summary leaves out: the median of its "pipeline"
    phase, every step's loss, and the split into stages its log names."""
    records = read_jsonl(runs_dir / name / "metrics.jsonl")
    measured = [r for r in records if r["global_step"] > spec["warmup"]] or records
    if all("time/pipeline" in r for r in measured):
        summary["time/pipeline"] = statistics.median(r["time/pipeline"] for r in measured)
    summary["losses"] = [r["running_loss"] for r in records]
    found = re.search(r"micro-batches: ([^)]*)\)", (runs_dir / f"{name}.log").read_text(errors="replace"))
    summary["split"] = found.group(1) if found else None
    return summary


TRANSPORT_WORDS = {"shm": "through shared memory (MESHTORCH_CPU_TRANSPORT=shm)",
                   "gloo": "over Gloo (MESHTORCH_CPU_TRANSPORT=gloo)"}


def our_transports(args):
    """Our side's CPU transports, the main one first."""
    names = [t for t in args.our_transports.split(",") if t]
    unknown = [t for t in names if t not in TRANSPORT_WORDS]
    if unknown or not names:
        sys.exit(f"bench/run: unknown --our-transports {', '.join(unknown)}; known: {', '.join(TRANSPORT_WORDS)}")
    if len(set(names)) != len(names):
        sys.exit(f"bench/run: --our-transports {args.our_transports} names a transport twice")
    return names


def our_sides(transports):
    """(result key, transport) of our side on each transport: "ours" on the main one."""
    return [("ours" if i == 0 else f"ours-{t}", t) for i, t in enumerate(transports)]


def on_transport(text, side, transport):
    """A row label for our side: the extra transports say which they are."""
    return text if side == "ours" else f"{text} on {transport}"


def par_tables(kind, results, sizes, variants, reps, args):
    meta = PAR_SECTIONS[kind]
    phases = meta.get("phases", PHASES)
    variant = meta.get("variant_label", "variant")
    r2 = lambda v: f"{v:.2f}" if v is not None else "—"
    med = lambda runs, key="tokens_per_s": median_of(list(runs.values()), key)
    shared = ("with pipeline parallelism the ranks of a pipeline share one batch, split into "
              f"{args.pp_microbatches} micro-batches" if kind == "pp" else
              "with tensor parallelism the ranks of a TP group share one batch")
    transports = our_transports(args)
    lines = [f"{PAR_RANKS} ranks x 1 thread on the CPU, {args.dtype}; PyTorch's collectives over Gloo (loopback), ours "
             f"{TRANSPORT_WORDS[transports[0]]}. tokens/s counts the global "
             f"batch (data-parallel ranks x batch x sequence: {shared}). Figures are medians over repetitions of each "
             "run's median step after warm-up; every ratio "
             "is the median over repetitions of the ratio within a repetition (ours / PyTorch; tokens/s: above 1 means "
             "we are faster; ms and memory: below 1 means we use less).", "",
             f"| model | {variant} | {meta['ours']} tokens/s | {meta['theirs']} tokens/s | ours / PyTorch "
             f"| {meta['ours']} rank 0 peak RSS GB | {meta['theirs']} rank 0 peak RSS GB | ours / PyTorch |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for size in sizes:
        for v in variants:
            t = results.get((size, v, "torch"), {})
            for side, transport in our_sides(transports):
                o = results.get((size, v, side), {})
                lines.append(f"| {size} | {on_transport(v, side, transport)} | {fmt(med(o))} | {fmt(med(t))} "
                             f"| {r2(paired(o, t, 'tokens_per_s'))} | {fmt(med(o, 'peak_rss_gb'), 2)} | {fmt(med(t, 'peak_rss_gb'), 2)} "
                             f"| {r2(paired(o, t, 'peak_rss_gb'))} |")
    keys = ["tokens_per_s", "time/total", *[f"time/{p}" for p in phases], "peak_rss_gb", "wall_s"]
    for size in sizes:
        spec = par_sizes(kind)[size]
        lines += ["", f"### {meta['title']}, {size}: per-rank batch {spec['batch']} x sequence {spec['seq']}, "
                      f"{spec['steps']} steps of which {spec['warmup']} warm-up, {reps} repetition(s)", "",
                  f"| {variant} | run | tokens/s (min–max) | ms/step | " + " | ".join(phases)
                  + " | rank 0 peak RSS GB | process s | load avg (min–max) |",
                  "| --- | --- |" + " ---: |" * (len(phases) + 5)]
        for v in variants:
            sides = our_sides(transports)
            for side, label in [*((o, on_transport(meta["ours"], o, t)) for o, t in sides), ("torch", meta["theirs"])]:
                runs = results.get((size, v, side), {})
                if not runs:
                    lines.append(f"| {v} | {label} | not run |" + "  |" * (len(phases) + 4))
                    continue
                tps = [r["tokens_per_s"] for r in runs.values()]
                load = [r["loadavg"] for r in runs.values()]
                cells = [f"{fmt(med(runs))} ({fmt(min(tps))}–{fmt(max(tps))})", fmt(med(runs, "time/total"))]
                cells += [fmt(med(runs, f"time/{p}"), 2) for p in phases]
                cells += [fmt(med(runs, "peak_rss_gb"), 2), fmt(med(runs, "wall_s")), f"{min(load):.2f}–{max(load):.2f}"]
                lines.append(f"| {v} | {label} | " + " | ".join(cells) + " |")
            t = results.get((size, v, "torch"), {})
            for side, transport in sides:
                o = results.get((size, v, side), {})
                if o and t:
                    lines.append(f"| {v} | {on_transport('ours', side, transport)} / PyTorch | "
                                 + " | ".join(r2(paired(o, t, k)) for k in keys) + " |")
    if kind == "pp":
        lines += pp_loss_table(results, sizes, variants)
    return "\n".join(lines) + "\n"


def pp_loss_table(results, sizes, variants):
    """Markdown lines: per schedule, the split each side logged and the loss curves. The two stacks
    draw different initial weights and data orders (different random generators), so their curves
    agree only roughly; within one stack every schedule must give the same losses as the first one
    (the same model and batches, only the order of the work changes)."""
    first_run = lambda runs: runs[min(runs)] if runs else None
    fmt_losses = lambda r: f"{r['losses'][0]:.4f} → {r['losses'][-1]:.4f}" if r and r.get("losses") else "—"

    def largest_gap(a, b):
        if not a or not b or not a.get("losses") or not b.get("losses"):
            return "—"
        return f"{max(abs(x - y) for x, y in zip(a['losses'], b['losses'])):.2g}"

    lines = ["", "Loss curves (each side's first repetition; → joins the first and the last step's loss). \"same "
             "split\": the split PyTorch was given equals the one our binary logged. Ours and PyTorch's start from "
             "different initial weights and see the batches in a different order, so their curves agree only "
             "roughly; within one stack every schedule runs the same model on the same batches, so its losses "
             f"must equal the {variants[0]} run's (the last two columns, largest difference over the steps).", "",
             "| model | schedule | split (ours) | same split | meshtorch loss | PyTorch loss | largest step gap ours "
             f"− PyTorch | meshtorch vs its {variants[0]} | PyTorch vs its {variants[0]} |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for size in sizes:
        base = {side: first_run(results.get((size, variants[0], side), {})) for side in ("ours", "torch")}
        for v in variants:
            o, t = (first_run(results.get((size, v, side), {})) for side in ("ours", "torch"))
            cell = lambda text: str(text).replace("|", "\\|")  # the split's stage separator, in a table cell
            split = cell((o or t or {}).get("split") or "—")
            same = "yes" if o and t and o.get("split") and o.get("split") == t.get("split") else (
                "**no**: PyTorch " + cell(t.get("split")) if o and t else "—")
            lines.append(f"| {size} | {v} | {split} | {same} | {fmt_losses(o)} | {fmt_losses(t)} | {largest_gap(o, t)} "
                         f"| {largest_gap(o, base['ours'])} | {largest_gap(t, base['torch'])} |")
    return lines


# The zero2 section: ZeRO stage 2 (chapter 8's engine) against PyTorch's DDP +
# ZeroRedundancyOptimizer (the guide's chapter-2 script with --zero) and against our stage 1, 2
# ranks x 1 thread, the DDP section's sizes; DeepSpeed itself needs CUDA to install.
ZERO2_SIDES = {"ours-zero2": "meshtorch ZeRO-2", "ours-zero1": "meshtorch ZeRO-1",
               "torch-ddp-zero": "PyTorch DDP + ZeroRedundancyOptimizer"}


def zero2_command(side, spec, name, args, corpus, runs_dir):
    if side == "torch-ddp-zero":
        return command(side, spec, 1, name, args, corpus, runs_dir)
    stage = 2 if side == "ours-zero2" else 1
    config = runs_dir / f"{name}.ds_config.json"
    # The DDP section's settings as DeepSpeed keys: the bucket size in elements of fp32 or bf16.
    elements = int(args.bucket_cap_mb * 2**20 / (2 if args.dtype == "bfloat16" else 4))
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
        "bf16": {"enabled": args.dtype == "bfloat16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": elements}, "steps_per_print": 1}))
    return [args.meshrun, "--nproc-per-node", str(DDP_RANKS), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "--", args.engine_bin, "--deepspeed-config", str(config),
            "-m", str(spec["config"]), "-d", str(corpus), "-s", str(spec["seq"]), "--max-steps", str(spec["steps"]),
            "--seed", "0", "--threads", "1", "-e", name, "--save-dir", str(runs_dir), "--device", "cpu",
            "--ckpt-freq", "1000000"]


def zero2_section(args, corpus, runs_dir, out, machine):
    """The zero2 section; returns (report, docs sections, runs expected, runs done)."""
    if not args.reference_only and (skipped := skipped_unbuilt("zero2", "ZeRO-2", (args.engine_bin, args.meshrun))):
        return skipped
    sizes = [s for s in args.par_sizes.split(",") if s]
    if args.quick:
        for s, q in DDP_QUICK.items():
            DDP_SIZES[s].update(q)
    reps = 1 if args.quick else (args.par_reps or 3)
    sides = [s for s in ZERO2_SIDES if not (args.reference_only and s.startswith("ours"))]
    started = time.perf_counter()
    results, expected = {}, 0
    for size in sizes:
        spec = DDP_SIZES[size]
        for rep in range(1, reps + 1):
            # The order turns every repetition, so a trend in the load favours no side.
            for side in rotated(sides, rep):
                expected += 1
                name = f"zero2-{size}-{side}-r{rep}"
                env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                           TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
                summary = run_cmd(zero2_command(side, spec, name, args, corpus, runs_dir), spec, name, args, runs_dir,
                                  env)
                if summary is not None:
                    results.setdefault((size, side), {})[rep] = summary
    minutes = round((time.perf_counter() - started) / 60, 1)
    r2 = lambda v: f"{v:.2f}" if v is not None else "—"
    med = lambda runs, key="tokens_per_s": median_of(list(runs.values()), key)
    lines = [f"## ZeRO-2 throughput and memory ({machine['date']}, commit {machine['commit']})", "",
             f"{machine['cpu']}, {machine['cores']} cores; {DDP_RANKS} ranks x 1 thread on the CPU, PyTorch's "
             f"collectives over Gloo (loopback), ours {TRANSPORT_WORDS[os.environ['MESHTORCH_CPU_TRANSPORT']]}, "
             f"{args.dtype}, {reps} repetition(s), {minutes} minutes. tokens/s counts the global batch; "
             "rank 0's peak RSS. Ratios are medians over repetitions of the ratio within a repetition "
             "(tokens/s above 1: ZeRO-2 is faster; memory below 1: ZeRO-2 uses less).", "",
             "| model | " + " | ".join(f"{ZERO2_SIDES[s]} tokens/s" for s in ZERO2_SIDES)
             + " | ZeRO-2 / PyTorch | ZeRO-2 / ZeRO-1 | " + " | ".join(f"{ZERO2_SIDES[s]} peak RSS GB" for s in ZERO2_SIDES)
             + " | ZeRO-2 / PyTorch | ZeRO-2 / ZeRO-1 |",
             "| --- |" + " ---: |" * 10]
    for size in sizes:
        get = lambda side: results.get((size, side), {})
        z2, z1, t = get("ours-zero2"), get("ours-zero1"), get("torch-ddp-zero")
        lines.append(f"| {size} | " + " | ".join(fmt(med(get(s))) for s in ZERO2_SIDES)
                     + f" | {r2(paired(z2, t, 'tokens_per_s'))} | {r2(paired(z2, z1, 'tokens_per_s'))} | "
                     + " | ".join(fmt(med(get(s), 'peak_rss_gb'), 2) for s in ZERO2_SIDES)
                     + f" | {r2(paired(z2, t, 'peak_rss_gb'))} | {r2(paired(z2, z1, 'peak_rss_gb'))} |")
    if args.quick:
        lines += ["", "**--quick: one short run per side; this checks the wiring and measures nothing.**"]
    report = "\n".join(lines) + "\n"
    (out / "zero2.md").write_text(report)
    (out / "zero2.json").write_text(json.dumps(
        {"machine": machine, "runs": [{"size": s, "side": side, "rep": r, **v}
                                      for (s, side), runs in results.items() for r, v in runs.items()]}, indent=1))
    print(report)
    return report, {"zero2": report.split("\n", 2)[2]}, expected, sum(len(v) for v in results.values())


def par_section(kind, args, corpus, runs_dir, out, machine):
    """One of the fsdp, tp and 2d sections; returns (report, docs sections, runs expected, runs done).
    Without our binary (or meshrun) the section is skipped, unless --reference-only asks for the
    Python side alone."""
    meta = PAR_SECTIONS[kind]
    ours_bin = getattr(args, meta["bin_arg"])
    with_ours = not args.reference_only
    if with_ours and (skipped := skipped_unbuilt(kind, meta["title"], (ours_bin, args.meshrun))):
        return skipped
    sizes = [s for s in args.par_sizes.split(",") if s]
    for size in sizes:
        if size not in DDP_SIZES:
            sys.exit(f"bench/run: unknown size {size!r} in --par-sizes; known: {', '.join(DDP_SIZES)}")
    if args.quick:
        for s, q in DDP_QUICK.items():
            par_sizes(kind)[s].update(q)
    reps = 1 if args.quick else (args.par_reps or 3)
    variants = par_variants(kind, args)
    started = time.perf_counter()
    loadavg_start = os.getloadavg()[0]
    results, expected = {}, 0
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    transports = our_transports(args)
    ours = [side for side, _ in our_sides(transports)]
    for size in sizes:
        spec = par_sizes(kind)[size]
        for rep in range(1, reps + 1):
            for v, flags in variants.items():
                # Ours first in odd repetitions, theirs first in even ones, as in the DDP section.
                for side in ([*ours, "torch"] if rep % 2 else ["torch", *ours]):
                    if side != "torch" and not with_ours:
                        continue
                    expected += 1
                    name = f"{kind}-{size}-{v}-{side}-r{rep}"
                    cmd = par_command(kind, "torch" if side == "torch" else "ours", spec, flags, name, args, corpus,
                                      runs_dir)
                    transport = transports[ours.index(side)] if side != "torch" else "gloo"
                    summary = run_cmd(cmd, spec, name, args, runs_dir, dict(env, MESHTORCH_CPU_TRANSPORT=transport))
                    if summary is not None and kind == "pp":
                        summary = pp_details(summary, name, spec, runs_dir)
                    if summary is not None:
                        results.setdefault((size, v, side), {})[rep] = summary
    loadavg_end = os.getloadavg()[0]
    minutes = round((time.perf_counter() - started) / 60, 1)
    loads = [r["loadavg"] for runs in results.values() for r in runs.values()]
    text = [f"## {meta['title']} throughput ({machine['date']}, commit {machine['commit']})", "",
            f"{machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB; load average "
            f"{loadavg_start:.2f} at start, {loadavg_end:.2f} at end"
            + (f", {min(loads):.2f}–{max(loads):.2f} at the starts of the runs" if loads else "")
            + f"; {minutes} minutes.", ""]
    if not with_ours:
        text += ["Our binary was not run (--reference-only): the meshtorch columns are empty.", ""]
    if args.quick:
        text += ["**--quick: one short run per side; this checks the wiring and measures nothing.**", ""]
    text.append(par_tables(kind, results, sizes, list(variants), reps, args))
    report = "\n".join(text)
    (out / f"{kind}.md").write_text(report)
    (out / f"{kind}.json").write_text(json.dumps(
        {"machine": {**machine, "loadavg_start": loadavg_start, "loadavg_end": loadavg_end, "bench_minutes": minutes},
         "args": vars(args), "variants": variants,
         "sizes": {s: {k: str(v) for k, v in par_sizes(kind)[s].items()} for s in sizes},
         "runs": [{"size": s, "variant": v, "side": side, "rep": rep, **r}
                  for (s, v, side), runs in results.items() for rep, r in runs.items()]},
        indent=1))
    print(report)
    log(f"tables written to {out / (kind + '.md')} (raw figures in {out / (kind + '.json')})")
    return report, {kind: report.split("\n", 2)[2]}, expected, sum(len(v) for v in results.values())


# The ch5 section: issue 14's targets. Activation checkpointing: llama-100m, batch 1 x sequence
# 1024 per rank, 2 ranks x 1 thread of FSDP; ours is chapter 5's binary with the recipe's
# checkpointing on or off (its other defaults as they are), theirs the guide's FSDP2 script with
# checkpoint_wrapper on every decoder layer or without. The chunked loss: chapter 1 at hidden 512,
# 2 layers, vocabulary 128256, batch 1 x sequence 2048, 2 threads; ours with the automatic chunks
# or --loss-chunk 0, theirs transformers' loss (full logits). Every run with a fixed mmap threshold
# (MALLOC_MMAP_THRESHOLD_, both stacks use glibc's malloc), so that freed activations leave the
# resident set and peak RSS measures what is held at once.
CH5_PARTS = {
    "checkpointing": dict(spec=dict(config=REFERENCE / "configs" / "llama-100m", batch=1, seq=1024, steps=4, warmup=1),
                          variants={"none": ["--activation-checkpointing", "none"],
                                    "full": ["--activation-checkpointing", "full"]},
                          targets="peak RSS full / none <= 0.6, step time <= 1.4"),
    # The same runs with AdamW stepping each layer in backward (--optimizer-in-backward, both
    # variants): the recipe's memory option for runs without clipping or accumulation. The
    # guide's script has no counterpart, so PyTorch does not run it.
    "in-backward": dict(spec=dict(config=REFERENCE / "configs" / "llama-100m", batch=1, seq=1024, steps=4, warmup=1),
                        variants={"none": ["--activation-checkpointing", "none", "--optimizer-in-backward"],
                                  "full": ["--activation-checkpointing", "full", "--optimizer-in-backward"]},
                        label="checkpointing, AdamW in backward",
                        targets="peak RSS full / none <= 0.6, step time <= 1.4",
                        torch_variants=[]),
    "loss": dict(spec=dict(config=REFERENCE / "configs" / "llama-vocab128k", batch=1, seq=2048, steps=4, warmup=1),
                 variants={"plain": ["--loss-chunk", "0"], "chunked": []},
                 targets="peak RSS chunked / plain <= 0.5, step time within 10%",
                 torch_variants=["plain"]),  # transformers has no chunked loss: its plain run is the baseline
}


def ch5_command(part, side, variant, spec, name, args, corpus, runs_dir):
    flags = CH5_PARTS[part]["variants"][variant]
    common = ["-m", str(spec["config"]), "-d", str(corpus), "-b", str(spec["batch"]), "-s", str(spec["seq"]),
              "--max-steps", str(spec["steps"]), "--log-freq", "1", "--lr", "3e-4", "--seed", "0",
              "--dtype", "float32", "-e", name, "--save-dir", str(runs_dir)]
    ours = ["--device", "cpu", "--ckpt-freq", "1000000"]
    if part == "loss":
        common += ["--threads", "2"]
        if side == "ours":
            return [args.bin, *common, *ours, *flags]
        return [sys.executable, str(REFERENCE / "train_llm_ch1.py"), *common, "--warmup-steps", str(spec["warmup"])]
    common += ["--threads", "1", *flags]
    if side == "ours":
        return [args.meshrun, "--nproc-per-node", str(PAR_RANKS), "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), "--", args.ch5_bin, *common, *ours]
    torchrun = Path(sys.executable).parent / "torchrun"
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", "--nproc-per-node", str(PAR_RANKS), str(REFERENCE / "train_llm_ch4.py"),
            *common, "--warmup-steps", str(spec["warmup"])]


def ch5_section(args, corpus, runs_dir, out, machine):
    """The ch5 section; returns (report, docs sections, runs expected, runs done)."""
    if not args.reference_only and (
            skipped := skipped_unbuilt("ch5", "Chapter 5", (args.ch5_bin, args.bin, args.meshrun))):
        return skipped
    sides = ["torch"] if args.reference_only else ["ours", "torch"]
    started = time.perf_counter()
    results, expected = {}, 0
    for part, meta in CH5_PARTS.items():
        spec = dict(meta["spec"])
        if args.quick:
            spec.update(steps=2, warmup=1)
        runs = [(v, side) for v in meta["variants"] for side in sides
                if side == "ours" or v in meta.get("torch_variants", meta["variants"])]
        for rep in range(1, args.ch5_reps + 1):
            # The order turns every repetition, so a trend in the load favours no run.
            for v, side in rotated(runs, rep):
                expected += 1
                name = f"ch5-{part}-{v}-{side}-r{rep}"
                threads = "2" if part == "loss" else "1"
                env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, HF_HUB_OFFLINE="1",
                           TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                           MALLOC_MMAP_THRESHOLD_="1048576")
                summary = run_cmd(ch5_command(part, side, v, spec, name, args, corpus, runs_dir), spec, name, args,
                                  runs_dir, env)
                if summary is not None:
                    results.setdefault((part, v, side), {})[rep] = summary
    minutes = round((time.perf_counter() - started) / 60, 1)
    r2 = lambda v: f"{v:.2f}" if v is not None else "—"
    med = lambda runs, key: median_of(list(runs.values()), key)
    label = {"ours": "meshtorch", "torch": "PyTorch"}
    lines = [f"## Chapter 5: memory savers ({machine['date']}, commit {machine['commit']})", "",
             f"{machine['cpu']}, {machine['cores']} cores; fp32, MALLOC_MMAP_THRESHOLD_=1048576 on both stacks, "
             f"{args.ch5_reps} repetition(s), {minutes} minutes. Checkpointing: llama-100m, batch 1 x sequence 1024 "
             "per rank, 2 ranks x 1 thread of FSDP (ours: chapter 5; PyTorch: the guide's FSDP2 script with "
             "checkpoint_wrapper on every decoder layer); the same with --optimizer-in-backward in both variants, ours "
             "only (the guide's script has no counterpart). Loss: chapter 1 at hidden 512, 2 layers, vocabulary "
             "128256, batch 1 x sequence 2048, 2 threads (ours chunked automatically or --loss-chunk 0; PyTorch: "
             "transformers' loss over the full logits). Step times are medians after the first step; RSS is rank "
             "0's peak. Ratios are medians over repetitions of the ratio within one.", "",
             "| part | variant | stack | ms/step | forward | backward | update | peak RSS GB |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for part, meta in CH5_PARTS.items():
        for v in meta["variants"]:
            for side in ("ours", "torch"):
                if side == "torch" and v not in meta.get("torch_variants", meta["variants"]):
                    continue
                runs = results.get((part, v, side), {})
                if not runs:
                    lines.append(f"| {meta.get('label', part)} | {v} | {label[side]} | not run |  |  |  |  |")
                    continue
                lines.append(f"| {meta.get('label', part)} | {v} | {label[side]} | {fmt(med(runs, 'time/total'))} | "
                             + " | ".join(fmt(med(runs, f"time/{p}")) for p in ("forward", "backward", "update"))
                             + f" | {fmt(med(runs, 'peak_rss_gb'), 2)} |")
    lines += ["", "| part | ratio | peak RSS | ms/step | target |", "| --- | --- | ---: | ---: | --- |"]
    for part, meta in CH5_PARTS.items():
        saver, base = list(meta["variants"])[::-1]
        torch_variants = meta.get("torch_variants", meta["variants"])
        get = lambda v, side: results.get((part, v, side), {})
        for side in ("ours", "torch"):
            if side == "torch" and saver not in torch_variants:
                continue
            a, b = get(saver, side), get(base, side)
            lines.append(f"| {meta.get('label', part)} | {label[side]} {saver} / {base} | {r2(paired(a, b, 'peak_rss_gb'))} "
                         f"| {r2(paired(a, b, 'time/total'))} | {meta['targets'] if side == 'ours' else ''} |")
        if not torch_variants:
            continue
        for v in (base, saver):
            # Against PyTorch's run of the same variant, or of its baseline where it has no saver.
            theirs = v if v in torch_variants else base
            a, b = get(v, "ours"), get(theirs, "torch")
            lines.append(f"| {part} | ours {v} / PyTorch {theirs} | {r2(paired(a, b, 'peak_rss_gb'))} "
                         f"| {r2(paired(a, b, 'time/total'))} | |")
    if args.quick:
        lines += ["", "**--quick: one short run per side; this checks the wiring and measures nothing.**"]
    report = "\n".join(lines) + "\n"
    (out / "ch5.md").write_text(report)
    (out / "ch5.json").write_text(json.dumps(
        {"machine": machine, "runs": [{"part": part, "variant": v, "side": side, "rep": r, **x}
                                      for (part, v, side), runs in results.items() for r, x in runs.items()]},
        indent=1))
    print(report)
    return report, {"ch5": report.split("\n", 2)[2]}, expected, sum(len(v) for v in results.values())


# The profile section: chapter 1 under each side's profiler, at chapter 1's batch x sequence per size
# and a size between them (hidden 384, head_dim 64, GQA 3:1, a 4096 vocabulary of which the byte
# tokenizer uses 258 ids, so that the head is a large GEMM as in a real model). Each run profiles
# `steps` steps after `warmup`; the whole section takes about 3 minutes on 2 cores.
PROFILE_SIZES = {
    "llama-tiny": dict(config=REFERENCE / "configs" / "llama-tiny", batch=8, seq=256, warmup=5, steps=3),
    "llama-6x384": dict(config=REFERENCE / "configs" / "llama-6x384", batch=8, seq=256, warmup=5, steps=3),
    "llama-100m": dict(config=REFERENCE / "configs" / "llama-100m", batch=2, seq=256, warmup=5, steps=3),
}
PROFILE_THREADS = 2
PROFILE_TOP = 12  # ops per phase table
# Ops that are matrix products (aten::linear and aten::matmul only dispatch to the others: their self
# time is the dispatch's); attention's fused kernel is counted on its own.
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul", "aten::linear",
            "aten::mv", "aten::dot"}
COPY_OPS = ["aten::copy_", "aten::clone", "aten::contiguous"]
PROFILE_SIDES = {"ours": "meshtorch", "hf-eager": "HF eager"}


def is_attention_op(name):
    """LibTorch's scaled-dot-product kernels (HF's side, ours with --fused off), and ours: the
    forward's scope and its backward's autograd node, whose products run inside it."""
    return "scaled_dot_product" in name or "causal_attention" in name


def profile_totals(phase_ops):
    """(wall, GEMM, attention, other ops, outside ops) in ms per step and the copy ops' calls, for
    one phase of an ops.json (or several, summed)."""
    totals = dict(wall=0.0, gemm=0.0, attention=0.0, other=0.0, outside=0.0, copy_ms=0.0,
                  **{op: 0.0 for op in COPY_OPS})
    for phase in phase_ops:
        totals["wall"] += phase["time_us"] / 1e3
        in_ops = 0.0
        for name, op in phase["ops"].items():
            ms = op["self_us"] / 1e3
            in_ops += ms
            if name in GEMM_OPS:
                totals["gemm"] += ms
            elif is_attention_op(name):
                totals["attention"] += ms
            else:
                totals["other"] += ms
            if name in COPY_OPS:
                totals[name] += op["calls"]
                totals["copy_ms"] += ms
        totals["outside"] += max(0.0, phase["time_us"] / 1e3 - in_ops)
    return totals


def profile_tables(size, spec, profiles):
    """Markdown for one size: per phase (forward, backward) the top ops by self time, both sides,
    then the totals per phase and per step."""
    ours, theirs = profiles.get("ours"), profiles.get("hf-eager")
    lines = [f"### {size}: batch {spec['batch']} x sequence {spec['seq']}, {spec['steps']} step(s) profiled after "
             f"{spec['warmup']}", ""]
    if ours is None and theirs is None:
        return lines + ["not run", ""]
    ms = lambda op: f"{op['self_us'] / 1e3:.2f}" if op else "—"
    calls = lambda op: f"{op['calls']:g}" if op else "—"
    for phase in ("forward", "backward"):
        sides = [p["phases"].get(phase, {"ops": {}})["ops"] if p else {} for p in (ours, theirs)]
        names = sorted(set(sides[0]) | set(sides[1]),
                       key=lambda n: -max(s.get(n, {"self_us": 0})["self_us"] for s in sides))[:PROFILE_TOP]
        lines += [f"{phase.capitalize()}, the top {len(names)} ops by self time (ms per step; calls per step):", "",
                  "| op | meshtorch ms | HF eager ms | meshtorch calls | HF eager calls |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for name in names:
            a, b = sides[0].get(name), sides[1].get(name)
            lines.append(f"| `{name}` | {ms(a)} | {ms(b)} | {calls(a)} | {calls(b)} |")
        lines.append("")
    lines += ["Totals, ms per step: the phase's wall time, its ops' self time (GEMMs: "
              + ", ".join(sorted(GEMM_OPS))
              + "; attention: the scaled-dot-product kernel, or ours (kernels::causal_attention) with its products; "
              "every other op), "
              "the time in no op (framework and interpreter), and the copy ops' calls and self time:", "",
              "| phase | run | wall | GEMM | attention | other ops | outside ops | "
              + " / ".join(f"`{op}`" for op in COPY_OPS) + " calls | copies ms |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for phase in ("forward", "backward", "step"):
        for side, profile in (("ours", ours), ("hf-eager", theirs)):
            if profile is None:
                lines.append(f"| {phase} | {PROFILE_SIDES[side]} | not run |  |  |  |  |  |  |")
                continue
            phases = list(profile["phases"].values()) if phase == "step" else \
                [profile["phases"].get(phase, {"time_us": 0.0, "ops": {}})]
            t = profile_totals(phases)
            lines.append(f"| {phase} | {PROFILE_SIDES[side]} | {t['wall']:.1f} | {t['gemm']:.1f} | "
                         f"{t['attention']:.1f} | {t['other']:.1f} | {t['outside']:.1f} | "
                         + " / ".join(f"{t[op]:g}" for op in COPY_OPS) + f" | {t['copy_ms']:.2f} |")
    return lines + [""]


def profile_section(args, corpus, runs_dir, out, machine):
    """The profile section: chapter 1 under each side's profiler; returns (report, docs sections,
    runs expected, runs done)."""
    if not args.reference_only and (skipped := skipped_unbuilt("profile", "Chapter 1 op profile", (args.bin,))):
        return skipped
    sizes = [s for s in args.profile_sizes.split(",") if s]
    for s in sizes:
        if s not in PROFILE_SIZES:
            sys.exit(f"bench/run: unknown profile size {s!r}; known: {', '.join(PROFILE_SIZES)}")
    sides = ["hf-eager"] if args.reference_only else ["ours", "hf-eager"]
    fp32 = argparse.Namespace(**{**vars(args), "dtype": "float32"})
    started = time.perf_counter()
    results, expected = {}, 0
    for size in sizes:
        spec = dict(PROFILE_SIZES[size], **(dict(warmup=1, steps=1) if args.quick else {}))
        # One step after the profiled ones: our run saves a checkpoint at its last step (-e), which
        # would land in the last profiled step's "other" phase.
        run_spec = dict(spec, steps=spec["warmup"] + spec["steps"] + 1)
        for side in sides:
            expected += 1
            name = f"profile-{size}-{side}"
            folder = runs_dir / name / "profile"
            # Ours with the batch whole (--cpu-batch-split off), as the reference runs it: each op is
            # then one call over the batch on both sides, its self time wall time; split, each half's
            # ops would add their threads' times. The split's gain is in the chapter 1 section.
            cmd = command(side, run_spec, PROFILE_THREADS, name, fp32, corpus, runs_dir) + [
                "--profile", str(folder), "--profile-from", str(spec["warmup"] + 1),
                "--profile-steps", str(spec["steps"])] + (["--cpu-batch-split", "off"] if side == "ours" else [])
            env = dict(os.environ, OMP_NUM_THREADS=str(PROFILE_THREADS), MKL_NUM_THREADS=str(PROFILE_THREADS),
                       HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
            if run_cmd(cmd, run_spec, name, fp32, runs_dir, env) is None:
                continue
            ops = folder / "ops.json"
            if not ops.exists():
                log(f"{name}: no {ops}")
                continue
            results[(size, side)] = json.loads(ops.read_text())
    minutes = round((time.perf_counter() - started) / 60, 1)
    lines = [f"## Chapter 1 op profile ({machine['date']}, commit {machine['commit']})", "",
             f"{machine['cpu']}, {machine['cores']} cores; chapter 1, float32, {PROFILE_THREADS} threads, one run per "
             f"side and size; {minutes} minutes. meshtorch: `01-single-gpu --profile --cpu-batch-split off` (LibTorch's "
             "Kineto profiler; the batch whole, as the reference runs it, so that each op is one call on both sides); HF "
             "eager: `train_llm_ch1.py --profile` (torch.profiler). An op's self time is its time less that of the "
             "ops nested in it, counted in the phase (user scope) it ran in; both profilers add a few microseconds per "
             "op, so small ops look dearer than they are.", ""]
    if args.quick:
        lines += ["**--quick: one profiled step after one warm-up step per side; this checks the wiring and measures "
                  "nothing.**", ""]
    for size in sizes:
        spec = dict(PROFILE_SIZES[size], **(dict(warmup=1, steps=1) if args.quick else {}))
        lines += profile_tables(size, spec, {side: results.get((size, side)) for side in sides})
    report = "\n".join(lines)
    (out / "profile.md").write_text(report)
    (out / "profile.json").write_text(json.dumps(
        {"machine": machine,
         "runs": [{"size": size, "side": side, **profile} for (size, side), profile in results.items()]},
        indent=1))
    print(report)
    log(f"tables written to {out / 'profile.md'} (each side's ops.json in {out / 'profile.json'})")
    return report, {"profile": report.split("\n", 2)[2]}, expected, len(results)


def main():
    args = parse_args()
    sections = SECTIONS if args.only == "all" else [s for s in args.only.split(",") if s]
    for s in sections:
        if s not in SECTIONS:
            sys.exit(f"bench/run: unknown section {s!r} in --only; known: {', '.join(SECTIONS)}")
    for s in [s for s in args.sizes.split(",") if s]:
        if s not in SIZES:
            sys.exit(f"bench/run: unknown size {s!r}; known: {', '.join(SIZES)}")
    if args.quick:
        args.reps = 1
    # Our side's main CPU transport, for every section that runs our multi-rank binaries (the fsdp,
    # tp, 2d and pp sections set it per run, for --our-transports' further ones).
    os.environ["MESHTORCH_CPU_TRANSPORT"] = our_transports(args)[0]

    out = Path(args.out)
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.txt"
    if not corpus.exists():
        subprocess.run([sys.executable, str(REFERENCE / "make_corpus.py"), str(corpus), "--mb", "4"], check=True)

    machine = machine_description()
    log(f"{machine['cpu']}, {machine['cores']} cores, load average {machine['loadavg_start']:.2f} at start; "
        f"sections: {', '.join(sections)}")
    docs, expected, done = {}, 0, 0
    bf16_args = argparse.Namespace(**{**vars(args), "dtype": "bfloat16", "compile_sizes": args.bf16_compile_sizes})
    runs = [("ch1", lambda: chapter1(args, corpus, runs_dir, out, machine)),
            ("ddp", lambda: ddp_section(args, corpus, runs_dir, out, machine)),
            *[(k, lambda k=k: par_section(k, args, corpus, runs_dir, out, machine)) for k in PAR_SECTIONS],
            ("cp", lambda: context_parallel.cp_section(sys.modules[__name__], args, corpus, runs_dir, out, machine)),
            ("zero2", lambda: zero2_section(args, corpus, runs_dir, out, machine)),
            ("ch5", lambda: ch5_section(args, corpus, runs_dir, out, machine)),
            ("ch1-bf16", lambda: chapter1(bf16_args, corpus, runs_dir, out, machine, stem="chapter1-bf16")),
            ("profile", lambda: profile_section(args, corpus, runs_dir, out, machine)),
            ("generate", lambda: generate_bench.generate_section(sys.modules[__name__], args, runs_dir, out, machine))]
    for name, section in runs:
        if name in sections:
            _, section_docs, e, d = section()
            docs.update(section_docs)
            expected += e
            done += d

    if "compile-time" in sections and not args.no_compile_time:
        reps = "1" if args.quick else "2"
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "compile_time.py"), "--reps", reps,
                               "--out", str(out / "compile-time.md")], cwd=ROOT)
        if proc.returncode != 0:
            log("the compile-time benchmark failed (see above)")
        elif (out / "compile-time.md").exists():
            docs["compile-time"] = (out / "compile-time.md").read_text().split("\n", 1)[1]  # without its heading

    if args.update_docs:
        update_docs(docs)

    if done < expected:
        log(f"{expected - done} of {expected} runs failed")
        sys.exit(1)


if __name__ == "__main__":
    main()
