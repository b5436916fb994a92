#!/usr/bin/env python3
"""End-to-end checks of examples/11-pipeline-parallel against chapter 1, run by CTest on CPU with
Gloo, fp32, one thread per rank.

usage: chapter11_checks.py MESHRUN CHAPTER1 CHAPTER7 CHAPTER11
       {1f1b-parity|schedules-parity|fsdp-pp-parity|pp-tp-parity|resume-across-meshes|stalled-stage|bad-flags}
"""
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from chapter02_checks import (CLIP, COMMON, ENV, common_except, compare_grad_norms, compare_losses, compare_params,
                              metrics, model_file, run)
from ports import free_port


def run_pp(tools, nproc, *args, expect_ok=True, common=COMMON):
    return run([tools["meshrun"], "--nproc-per-node", str(nproc), "--master-port", str(free_port()), "--",
                tools["chapter11"], *common, *args], expect_ok=expect_ok)


def parity(tools, single_batch, nproc, args, steps=20, extra=(), model=None):
    """`model` (a preset or folder) instead of COMMON's llama-tiny, on both sides."""
    common = COMMON if model is None else [*common_except(["-m"]), "-m", model]
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--save-dir", tmp, "--max-steps", str(steps), "--ckpt-freq", str(steps), *extra]
        run([tools["chapter1"], *common, "-b", str(single_batch), "-e", "one", *flags])
        out = run_pp(tools, nproc, *args, "-e", "pp", *flags, common=common)
        compare_losses(metrics(f"{tmp}/one"), metrics(f"{tmp}/pp"), 1e-5)
        if extra == CLIP:
            compare_grad_norms(metrics(f"{tmp}/one"), metrics(f"{tmp}/pp"), 1e-4)
        compare_params(model_file(f"{tmp}/one"), model_file(f"{tmp}/pp"), 1e-4)
        return out


def one_f_one_b_parity(tools):
    # 2 stages on 2 ranks, chapter 1's batch of 4 in 4 micro-batches, clipped every step.
    out = parity(tools, 4, 2, ["-b", "4", "--pp", "2", "--schedule", "1f1b", "--microbatches", "4"], extra=CLIP)
    assert "0F0" in out.stdout and "1B3" in out.stdout, "the schedule's grid is not in the log:\n" + out.stdout
    # The measured balance: each stage's compute per step, the slowest over the mean, each rank's idle share.
    balance = re.search(r"pipeline, (\d+) steps after the first: compute per step by stage: 0 ([0-9.]+) ms, "
                        r"1 ([0-9.]+) ms \(slowest / mean ([0-9.]+)\); idle per rank: 0 (\d+)%, 1 (\d+)% "
                        r"\(the table's bubble: 20%\)", out.stdout)
    assert balance, "the measured stage balance is not in the log:\n" + out.stdout
    steps, stage0, stage1, ratio, idle0, idle1 = balance.groups()
    assert int(steps) == 19 and float(stage0) > 0 and float(stage1) > 0, balance.group(0)
    assert abs(float(ratio) - max(float(stage0), float(stage1)) * 2 / (float(stage0) + float(stage1))) < 0.01, \
        balance.group(0)
    assert 0 <= int(idle0) < 100 and 0 <= int(idle1) < 100, balance.group(0)


def schedules_parity(tools):
    # GPipe, and the two schedules of 2 stages per rank (4 stages of llama-tiny's 6 units).
    for args in (["--schedule", "gpipe", "--microbatches", "2"],
                 ["--schedule", "interleaved-1f1b", "--stages-per-rank", "2", "--microbatches", "4"],
                 ["--schedule", "zbv", "--stages-per-rank", "2", "--microbatches", "4"]):
        print("---", " ".join(args))
        parity(tools, 4, 2, ["-b", "4", "--pp", "2", *args], steps=10)


def fsdp_pp_parity(tools):
    """FSDP inside the stages and replicas of the pipeline: FSDP 2 x PP 2 (the rest of the world is
    FSDP) and DP 2 x PP 2 on 4 ranks, clipped, 2 samples per data-parallel rank in 2 micro-batches;
    DP 2 x FSDP 2 x PP 2 (HSDP) on 8 ranks; FSDP 2 x PP 2 gathering whole stages under ZBV."""
    out = parity(tools, 4, 4, ["-b", "2", "--pp", "2", "--microbatches", "2"], extra=CLIP)
    assert "-> FSDP over FSDP (" in out.stdout and "FSDP 1 of 2, PP 1 of 2" in out.stdout, out.stdout
    out = parity(tools, 4, 4, ["-b", "2", "--pp", "2", "--dp", "2", "--microbatches", "2"], extra=CLIP)
    assert "-> DDP over DP" in out.stdout and "DP 1 of 2, FSDP 0 of 1" in out.stdout, out.stdout
    parity(tools, 8, 8, ["-b", "2", "--pp", "2", "--dp", "2", "--schedule", "interleaved-1f1b", "--stages-per-rank",
                         "2", "--microbatches", "2"], steps=10)
    # Without resharding after forward, each stage is gathered once a step (the table's UNSHARD and
    # RESHARD, printed under the grid), under ZBV too.
    out = parity(tools, 4, 4, ["-b", "2", "--pp", "2", "--schedule", "zbv", "--stages-per-rank", "2",
                               "--microbatches", "2", "--no-reshard-after-forward"], steps=10)
    assert "rank 0: gathers stage 0 at tick 0" in out.stdout and "frees stage 3 after tick" in out.stdout, out.stdout
    # ZBV layer by layer with every layer checkpointed: their gradients come from the input step's
    # recomputation, once.
    parity(tools, 4, 4, ["-b", "2", "--pp", "2", "--schedule", "zbv", "--stages-per-rank", "2", "--microbatches", "2",
                         "--activation-checkpointing", "full"], steps=10)


def pp_tp_parity(tools):
    # 4 ranks: 2 stages, each split over 2 TP ranks (sequence parallel), ZBV with 2 stages per rank.
    parity(tools, 4, 4, ["-b", "4", "--pp", "2", "--tp", "2", "--microbatches", "2"], extra=CLIP)
    parity(tools, 4, 4, ["-b", "4", "--pp", "2", "--tp", "2", "--schedule", "zbv", "--stages-per-rank", "2",
                         "--microbatches", "2"], steps=10)


def qwen3_pp_tp_parity(tools):
    # A Qwen3 folder (q_norm and k_norm over each head): 2 stages, each over 2 TP ranks, whose
    # per-head norms' partial gradients are summed within the stage.
    qwen3 = pathlib.Path(__file__).resolve().parent.parent / "hf_parity" / "configs" / "qwen3-gqa-tied"
    parity(tools, 4, 4, ["-b", "4", "--pp", "2", "--tp", "2", "--microbatches", "2"], extra=CLIP, model=str(qwen3))


def qwen2_pp_tp_parity(tools):
    # A Qwen2 folder (q/k/v biases, TP-sharded with their weights) in 2 stages over 2 TP ranks, under
    # ZBV: the split backward's weight step reaches the biases too.
    qwen2 = pathlib.Path(__file__).resolve().parent.parent / "hf_parity" / "configs" / "qwen2-gqa"
    parity(tools, 4, 4, ["-b", "4", "--pp", "2", "--tp", "2", "--schedule", "zbv", "--stages-per-rank", "2",
                         "--microbatches", "2"], steps=10, model=str(qwen2))


def resume_across_meshes(tools):
    """PP 2 for 5 steps, then chapter 7's FSDP 2 for 5, then PP 2 again to 15 (global batch 4
    throughout): the losses and weights of the straight PP run."""
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--save-dir", tmp, "--ckpt-freq", "5"]
        pp = ["-b", "4", "--pp", "2", "--microbatches", "2"]
        run_pp(tools, 2, *pp, *flags, "-e", "straight", "--max-steps", "15")
        run_pp(tools, 2, *pp, *flags, "-e", "moved", "--max-steps", "5")
        fsdp = run([tools["meshrun"], "--nproc-per-node", "2", "--master-port", str(free_port()), "--",
                    tools["chapter7"], *COMMON, "-b", "2", "--tp", "1", *flags, "-e", "moved", "--max-steps", "10"])
        assert "resumed from" in fsdp.stdout, fsdp.stdout
        back = run_pp(tools, 2, *pp, *flags, "-e", "moved", "--max-steps", "15")
        assert "resumed from" in back.stdout, back.stdout
        compare_losses(metrics(f"{tmp}/straight"), metrics(f"{tmp}/moved"), 1e-5)
        compare_params(model_file(f"{tmp}/straight"), model_file(f"{tmp}/moved"), 1e-4)


def stalled_stage(tools):
    """Rank 1 (the last stage) stopped with SIGSTOP under --timeout 20: every rank ends within 40 s
    and the report names rank 1."""
    cmd = [tools["meshrun"], "--nproc-per-node", "2", "--master-port", str(free_port()), "--prefix-output", "--",
           tools["chapter11"], *COMMON, "-b", "4", "--pp", "2", "--microbatches", "2", "--timeout", "20",
           "--log-freq", "1", "--max-steps", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while "global_step=3" not in "".join(lines):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        time.sleep(0.2)
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    ranks = {}
    for pid in children:
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        rank = next((e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"RANK=")), None)
        ranks[rank] = int(pid)
    os.kill(ranks["1"], signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        os.kill(ranks["1"], signal.SIGKILL)
        proc.kill()
        sys.exit("meshrun still runs 60 s after rank 1 stopped:\n" + "".join(lines))
    reader.join(10)
    elapsed = time.monotonic() - stopped
    output = "".join(lines)
    print(output[-4000:])
    print(f"meshrun exited with {code} {elapsed:.1f} s after rank 1 stopped")
    assert code != 0, "meshrun exited with 0"
    assert elapsed < 40, f"the job ended {elapsed:.1f} s after the stop"
    # Rank 0 waits for the stopped rank either at a receive of the schedule or, when the stop came
    # at the step's end, at the loss's all-reduce over PP: both name rank 1 and what waits for it.
    assert re.search(r"the job stalled: rank 1 did not arrive at (its side of recv from 1|all_reduce) #\d+ over the "
                     r"PP (send/recv )?group", output), \
        "meshrun's summary does not name rank 1 and the receive or collective that waits for it"


def bad_flags(tools):
    """Schedules that cannot run are refused at start-up, naming the flag and the fix."""
    cases = [
        (["--schedule", "1f1b", "--microbatches", "1"], "1F1B needs at least as many micro-batches as stages"),
        (["--schedule", "zbv", "--stages-per-rank", "1"], "--stages-per-rank"),
        (["--schedule", "interleaved-1f1b"], "--stages-per-rank"),
        (["--units-per-stage", "2,2"], "--units-per-stage 2,2"),
        (["--stages-per-rank", "4", "--schedule", "interleaved-1f1b"], "lower --pp or --stages-per-rank"),
        (["-b", "3", "--microbatches", "2"], "make -b a multiple of 2"),
        (["--grad-accum", "2"], "use --microbatches"),
        (["--eval-split", "0.01", "--eval-freq", "1"], "evaluate its checkpoints with meshtorch-eval-loss --eval-split"),
    ]
    for args, needle in cases:
        started = time.monotonic()
        proc = run_pp(tools, 2, "-b", "4", "--pp", "2", "--max-steps", "2", *args, expect_ok=False)
        text = proc.stdout + proc.stderr
        print(f"{' '.join(args)}: exit {proc.returncode} in {time.monotonic() - started:.1f} s")
        assert proc.returncode != 0, text
        assert needle in text, f"{needle!r} not in:\n{text}"
    # With FSDP inside the stages (4 ranks: FSDP 2 x PP 2), ZBV's weight step would count a
    # selectively checkpointed layer's gradients twice: refused, naming the flags.
    proc = run_pp(tools, 4, "-b", "2", "--pp", "2", "--max-steps", "2", "--schedule", "zbv", "--stages-per-rank", "2",
                  "--activation-checkpointing", "2", expect_ok=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "--activation-checkpointing 2 with --schedule zbv and FSDP inside the stages" in text, \
        text


if __name__ == "__main__":
    tools = {"meshrun": sys.argv[1], "chapter1": sys.argv[2], "chapter7": sys.argv[3], "chapter11": sys.argv[4]}
    {"1f1b-parity": one_f_one_b_parity, "schedules-parity": schedules_parity, "fsdp-pp-parity": fsdp_pp_parity,
     "pp-tp-parity": pp_tp_parity, "qwen3-pp-tp-parity": qwen3_pp_tp_parity,
     "qwen2-pp-tp-parity": qwen2_pp_tp_parity,
     "resume-across-meshes": resume_across_meshes, "stalled-stage": stalled_stage,
     "bad-flags": bad_flags}[sys.argv[5]](tools)
