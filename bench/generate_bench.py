"""bench/run's generate section: meshtorch-generate against transformers' generate (eager, its own KV
cache) on the same random folder, greedy, exactly 128 new tokens per prompt, 2 threads, fp32: one
prompt (batch 1), and 8 prompts of mixed lengths left-padded into one batch. Each side times the
generation alone (not the loading): meshtorch-generate prints it, hf_generate.py measures it around
generate(). Tokens per second are the batch's new tokens over that time; the figure is the median
of the repetitions (our side: one process each, with no warm-up call; the reference: calls after
a warm-up call in one process).
"""
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

GENERATE_SIZES = ["llama-100m"]
GENERATE_THREADS = 2
NEW_TOKENS = 128
# Prompt lengths: batch 1, and a batch of 8 of mixed lengths.
BATCHES = {"batch 1": [32], "batch 8": [32, 7, 19, 64, 3, 45, 28, 11]}


def prompts_of(lengths, vocab):
    """Deterministic token ids in [3, vocab), one list per length."""
    out, x = [], 12345
    for n in lengths:
        row = []
        for _ in range(n):
            x = (x * 1103515245 + 12345) % (2 ** 31)
            row.append(3 + x % (vocab - 3))
        out.append(row)
    return out


def ours_once(binary, folder, prompts, threads, runs_dir, name):
    text = "".join(json.dumps(p) + "\n" for p in prompts)
    proc = subprocess.run([str(binary), str(folder), "--ids", "--ignore-eos", "--max-new-tokens", str(NEW_TOKENS),
                           "--threads", str(threads)], input=text, capture_output=True, text=True, timeout=900,
                          env={"OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin"})
    (runs_dir / f"{name}.log").write_text(proc.stdout + proc.stderr)
    found = re.search(r"(\d+) new tokens for \d+ prompt\(s\) in ([\d.]+) s", proc.stderr)
    if proc.returncode != 0 or not found:
        return None
    return int(found.group(1)), float(found.group(2))


def generate_section(runner, args, runs_dir, out, machine):
    """Returns (report, docs sections, runs expected, runs done)."""
    binary = Path(args.bin).parent / "meshtorch-generate"
    if not args.reference_only and (skipped := runner.skipped_unbuilt("generate", "Generation", (binary,))):
        return skipped
    reps = 1 if args.quick else args.reps
    started = time.perf_counter()
    results, expected, done = {}, 0, 0
    for size in GENERATE_SIZES:
        folder = out / "generate" / size
        if not (folder / "config.json").exists():
            subprocess.run([sys.executable, str(runner.REFERENCE / "hf_generate.py"), "--make-folder",
                            str(runner.REFERENCE / "configs" / size), str(folder)], check=True)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        for batch, lengths in BATCHES.items():
            prompts = prompts_of(lengths, vocab)
            prompts_file = runs_dir / f"generate-{size}-{batch.replace(' ', '')}-prompts.json"
            prompts_file.write_text(json.dumps(prompts))
            expected += 2
            ours = [] if args.reference_only else \
                [ours_once(binary, folder, prompts, GENERATE_THREADS, runs_dir, f"generate-{size}-{batch}-{r}")
                 for r in range(reps)]
            ours = [r for r in ours if r]
            if ours:
                done += 1
                results[(size, batch, "ours")] = (ours[0][0], statistics.median(s for _, s in ours))
            proc = subprocess.run([sys.executable, str(runner.REFERENCE / "hf_generate.py"), str(folder),
                                   str(prompts_file), "--new-tokens", str(NEW_TOKENS), "--threads",
                                   str(GENERATE_THREADS), "--reps", str(reps)], capture_output=True, text=True,
                                  timeout=1800)
            (runs_dir / f"generate-{size}-{batch}-hf.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode == 0:
                line = json.loads(proc.stdout.strip().splitlines()[-1])
                done += 1
                results[(size, batch, "hf")] = (line["tokens"], line["seconds"])
    minutes = round((time.perf_counter() - started) / 60, 1)
    rate = lambda key: results[key][0] / results[key][1] if key in results else None
    show = lambda value, digits=1: "—" if value is None else f"{value:.{digits}f}"
    lines = [f"## Generation ({machine['date']}, commit {machine['commit']})", "",
             f"{machine['cpu']}, {machine['cores']} cores; fp32, {GENERATE_THREADS} threads, greedy, {NEW_TOKENS} new "
             f"tokens per prompt (no stop at eos), a random folder of each size; median of {reps} run(s) per side; "
             f"{minutes} minutes. meshtorch: `meshtorch-generate --ids --ignore-eos` (its own timing of generate, "
             "one process a run); transformers: `generate(do_sample=False, min_new_tokens=...)` eager with its KV "
             "cache (bench/reference/hf_generate.py, after a warm-up call).", "",
             "| size | batch | meshtorch tokens/s | transformers tokens/s | meshtorch / transformers |",
             "| --- | --- | ---: | ---: | ---: |"]
    for size in GENERATE_SIZES:
        for batch in BATCHES:
            a, b = rate((size, batch, "ours")), rate((size, batch, "hf"))
            lines.append(f"| {size} | {batch} | {show(a)} | {show(b)} | {show(a / b if a and b else None, 2)} |")
        one, eight = rate((size, "batch 1", "ours")), rate((size, "batch 8", "ours"))
        lines += ["", f"{size}: meshtorch's batch of 8 gives {show(eight / one if one and eight else None, 2)}x the "
                      "tokens per second of batch 1.", ""]
    report = "\n".join(lines)
    (out / "generate.md").write_text(report)
    print(report)
    return report, {"generate": report.split("\n", 2)[2]}, expected, done
