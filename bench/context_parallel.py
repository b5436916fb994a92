"""bench/run's cp section: chapter 12's context parallel on 2 ranks x 1 thread against chapter 4's
FSDP on the same 2 ranks and the same global batch (FSDP gives each rank whole sequences, CP splits
every sequence over both), and against chapter 1 in one process for the memory a sequence costs.
PyTorch's own context_parallel is probed first (bench/reference/cp_probe.py): where it does not
run on this device, the section says so, with PyTorch's error, and compares our two layouts.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

CP_RANKS = 2
# Long sequences, where context parallel pays: the global batch is `batch` sequences.
CP_SIZES = {
    "llama-tiny": dict(config="llama-tiny", batch=2, seq=4096, steps=8, warmup=3),
    "llama-100m": dict(config="llama-100m", batch=2, seq=4096, steps=3, warmup=1),
}
CP_QUICK = {"llama-tiny": dict(seq=512, steps=4, warmup=1), "llama-100m": dict(seq=512, steps=2, warmup=1)}
CP_SIDES = {"ours-cp": "meshtorch CP 2 (ring)", "ours-cp-allgather": "meshtorch CP 2 (allgather)",
            "ours-fsdp": "meshtorch FSDP 2", "ours-one": "meshtorch 1 process"}


def probe_pytorch(runner, runs_dir):
    """PyTorch's context_parallel on this machine's CPU: (runs, the probe's line)."""
    torchrun = Path(sys.executable).parent / "torchrun"
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    cmd = [*launcher, "--standalone", "--nproc-per-node", str(CP_RANKS), str(REFERENCE / "cp_probe.py")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=runner.ROOT, timeout=300)
    (runs_dir / "cp-probe.log").write_text(proc.stdout + proc.stderr)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("rank 0:")]
    if not lines:
        return False, f"the probe did not report (exit {proc.returncode}; see {runs_dir / 'cp-probe.log'})"
    outcome = lines[0].split(":", 1)[1].strip()
    return outcome.startswith("runs"), outcome


REFERENCE = Path(__file__).resolve().parent / "reference"


def command(side, spec, name, args, corpus, runs_dir):
    common = ["-m", str(REFERENCE / "configs" / spec["config"]), "-d", str(corpus), "-s", str(spec["seq"]), "--max-steps",
              str(spec["steps"]), "--log-freq", "1", "--lr", "3e-4", "--seed", "0", "--dtype", args.dtype,
              "--threads", "1", "-e", name, "--save-dir", str(runs_dir), "--device", "cpu", "--ckpt-freq", "1000000"]
    if side == "ours-one":  # one process on the same cores, the whole global batch
        return [args.bin, *common, "-b", str(spec["batch"]), "--threads", str(CP_RANKS)]
    launch = [args.meshrun, "--nproc-per-node", str(CP_RANKS), "--master-addr", "127.0.0.1", "--master-port",
              str(args.free_port()), "--"]
    if side == "ours-fsdp":  # each rank whole sequences: its share of the global batch
        return [*launch, args.fsdp_bin, *common, "-b", str(spec["batch"] // CP_RANKS)]
    rotate = "allgather" if side == "ours-cp-allgather" else "ring"
    return [*launch, args.cp_bin, *common, "-b", str(spec["batch"]), "--cp", str(CP_RANKS), "--cp-rotate", rotate]


def cp_section(runner, args, corpus, runs_dir, out, machine):
    """The cp section; returns (report, docs sections, runs expected, runs done)."""
    if skipped := runner.skipped_unbuilt("cp", "Context parallel", (args.cp_bin, args.fsdp_bin, args.bin, args.meshrun)):
        return skipped
    sizes = [s for s in args.par_sizes.split(",") if s]
    for size in sizes:
        if size not in CP_SIZES:
            sys.exit(f"bench/run: unknown size {size!r} in --par-sizes for cp; known: {', '.join(CP_SIZES)}")
        if args.quick:
            CP_SIZES[size].update(CP_QUICK[size])
    reps = 1 if args.quick else (args.par_reps or 2)
    pytorch_runs, probe = probe_pytorch(runner, runs_dir)
    runner.log(f"PyTorch's context_parallel on the CPU: {probe}")
    args.free_port = runner.free_port
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    started = time.perf_counter()
    results, expected = {}, 0
    sides = list(CP_SIDES)
    for size in sizes:
        spec = CP_SIZES[size]
        for rep in range(1, reps + 1):
            # The order turns every repetition, so a trend in the load favours no side.
            for side in runner.rotated(sides, rep):
                expected += 1
                name = f"cp-{size}-{side}-r{rep}"
                summary = runner.run_cmd(command(side, spec, name, args, corpus, runs_dir), spec, name, args,
                                         runs_dir, env)
                if summary is not None:
                    results.setdefault((size, side), {})[rep] = summary
    minutes = round((time.perf_counter() - started) / 60, 1)
    r2 = lambda v: f"{v:.2f}" if v is not None else "—"
    med = lambda runs, key="tokens_per_s": runner.median_of(list(runs.values()), key)
    lines = [f"## Context parallel ({machine['date']}, commit {machine['commit']})", "",
             f"{machine['cpu']}, {machine['cores']} cores; {CP_RANKS} ranks x 1 thread on the CPU, collectives "
             f"{runner.TRANSPORT_WORDS[os.environ['MESHTORCH_CPU_TRANSPORT']]} (the ring's sends and receives over "
             f"Gloo), {args.dtype}, {reps} repetition(s), {minutes} minutes. Every side trains on the same global "
             "batch of long sequences: CP splits each over both ranks, FSDP gives each rank whole ones, one "
             "process (2 threads) takes them all. tokens/s counts the global batch; memory is rank 0's peak RSS. "
             "Ratios are medians over repetitions of the ratio within a repetition.", "",
             f"PyTorch's `context_parallel` on this CPU: {'runs' if pytorch_runs else 'does not run'} ({probe}). "
             + ("" if pytorch_runs else "Its CP dispatches scaled-dot-product attention only to the CUDA kernels "
                "(flash, efficient, cuDNN), so there is no PyTorch side to compare on a CPU; the comparison with it "
                "waits for a GPU."), "",
             "| model | sequence | " + " | ".join(f"{CP_SIDES[s]} tokens/s" for s in sides)
             + " | CP / FSDP | " + " | ".join(f"{CP_SIDES[s]} peak RSS GB" for s in sides)
             + " | CP / 1 process (memory) |",
             "| --- | ---: |" + " ---: |" * (2 * len(sides) + 2)]
    for size in sizes:
        get = lambda side: results.get((size, side), {})
        lines.append(f"| {size} | {CP_SIZES[size]['seq']} | " + " | ".join(runner.fmt(med(get(s))) for s in sides)
                     + f" | {r2(runner.paired(get('ours-cp'), get('ours-fsdp'), 'tokens_per_s'))} | "
                     + " | ".join(runner.fmt(med(get(s), 'peak_rss_gb'), 2) for s in sides)
                     + f" | {r2(runner.paired(get('ours-cp'), get('ours-one'), 'peak_rss_gb'))} |")
    if args.quick:
        lines += ["", "**--quick: one short run per side; this checks the wiring and measures nothing.**"]
    report = "\n".join(lines) + "\n"
    (out / "cp.md").write_text(report)
    print(report)
    return report, {"cp": report.split("\n", 2)[2]}, expected, sum(len(v) for v in results.values())
