#!/usr/bin/env python3
"""End-to-end checks of examples/12-context-parallel against chapter 1, run by CTest on CPU with
Gloo, fp32, one thread per rank.

usage: chapter12_checks.py MESHRUN CHAPTER1 CHAPTER7 CHAPTER12
       {cp2-parity|cp4-parity|cp-tp-parity|families-cp-parity|fsdp-cp-parity|composition-parity|pp-cp-parity|resume-across-meshes|
        bad-flags}
"""
import pathlib
import sys
import tempfile
import time

from chapter02_checks import CLIP, COMMON, common_except, compare_grad_norms, compare_losses, compare_params, metrics, model_file, run
from ports import free_port


def run_cp(tools, nproc, *args, expect_ok=True):
    return run([tools["meshrun"], "--nproc-per-node", str(nproc), "--master-port", str(free_port()), "--",
                tools["chapter12"], *common_except(args), *args], expect_ok=expect_ok)


def parity(tools, single_batch, nproc, args, seq=64, steps=30, extra=()):
    """Chapter 1 and chapter 12 on the same global batch of `seq` positions: losses within 1e-5
    relative at every logged step, the final weights within 1e-4."""
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["-s", str(seq), "--save-dir", tmp, "--max-steps", str(steps), "--ckpt-freq", str(steps), *extra]
        run([tools["chapter1"], *common_except(flags), "-b", str(single_batch), "-e", "one", *flags])
        out = run_cp(tools, nproc, *args, "-e", "cp", *flags)
        compare_losses(metrics(f"{tmp}/one"), metrics(f"{tmp}/cp"), 1e-5)
        if CLIP[0] in extra:
            compare_grad_norms(metrics(f"{tmp}/one"), metrics(f"{tmp}/cp"), 1e-4)
        compare_params(model_file(f"{tmp}/one"), model_file(f"{tmp}/cp"), 1e-4)
        return out


def cp2_parity(tools):
    # Both methods on 2 ranks at 64 and 256 positions, clipped every step at 64.
    for rotate in ("ring", "allgather"):
        for seq in (64, 256):
            print(f"--- --cp-rotate {rotate}, -s {seq}")
            out = parity(tools, 4, 2, ["-b", "4", "--cp", "2", "--cp-rotate", rotate], seq=seq,
                         extra=CLIP if seq == 64 else ())
            assert "context parallel over CP" in out.stdout, out.stdout


def cp4_parity(tools):
    # 4 ranks, 8 chunks: 8 positions a chunk at -s 64.
    for rotate in ("ring", "allgather"):
        for seq in (64, 256):
            print(f"--- --cp-rotate {rotate}, -s {seq}")
            parity(tools, 4, 4, ["-b", "4", "--cp", "4", "--cp-rotate", rotate], seq=seq)


def cp_tp_parity(tools):
    # 4 ranks: CP 2 x TP 2 (sequence parallel inside each CP rank's 32 positions).
    for seq in (64, 256):
        print(f"--- -s {seq}")
        parity(tools, 4, 4, ["-b", "4", "--cp", "2", "--tp", "2"], seq=seq, extra=CLIP if seq == 64 else ())


def families_cp_parity(tools):
    # A Qwen3 (per-head q/k norms) and a Qwen2 (q/k/v biases) folder under CP 2 x TP 2: each CP rank's
    # chunks through the family's attention, the heads split over TP.
    configs = pathlib.Path(__file__).resolve().parent.parent / "hf_parity" / "configs"
    for folder in ("qwen3-gqa-tied", "qwen2-gqa"):
        print(f"--- {folder}")
        parity(tools, 4, 4, ["-b", "4", "--cp", "2", "--tp", "2"], steps=10, extra=("-m", str(configs / folder)))


def fsdp_cp_parity(tools):
    # 4 ranks: FSDP 2 x CP 2 (FSDP shards over all 4), and DP 2 x CP 2 (DDP over all 4).
    print("--- FSDP 2 x CP 2")
    parity(tools, 4, 4, ["-b", "2", "--cp", "2"], extra=CLIP)
    parity(tools, 4, 4, ["-b", "2", "--cp", "2"], seq=256)
    print("--- DP 2 x CP 2")
    parity(tools, 4, 4, ["-b", "2", "--cp", "2", "--dp", "2", "--cp-rotate", "allgather"], extra=CLIP)


def composition_parity(tools):
    # Recomputed layers repeat their exchanges; the chunked loss; two micro-batches a step.
    for rotate in ("ring", "allgather"):
        print(f"--- --cp-rotate {rotate} with activation checkpointing, a chunked loss and 2 micro-batches")
        parity(tools, 4, 2, ["-b", "4", "--cp", "2", "--cp-rotate", rotate, "--microbatches", "2"],
               extra=["--activation-checkpointing", "full", "--loss-chunk", "16"])


def pp_cp_parity(tools):
    """The pipeline's axis with CP inside the stages: PP 2 x CP 2 on 4 ranks, clipped; on 8 ranks PP 2
    x CP 2 x TP 2 by each --cp-rotate method (-s 64, and 256 under ZBV) and PP 2 x FSDP 2 x CP 2."""
    out = parity(tools, 4, 4, ["-b", "4", "--pp", "2", "--cp", "2", "--microbatches", "2"], extra=CLIP)
    assert "context parallel over CP (ring) -> FSDP over FSDP x CP" in out.stdout, out.stdout
    parity(tools, 4, 8, ["-b", "4", "--pp", "2", "--cp", "2", "--tp", "2", "--cp-rotate", "allgather",
                         "--microbatches", "2"], extra=CLIP)
    parity(tools, 4, 8, ["-b", "4", "--pp", "2", "--cp", "2", "--tp", "2", "--schedule", "zbv", "--stages-per-rank",
                         "2", "--microbatches", "2"], seq=256, steps=10)
    out = parity(tools, 4, 8, ["-b", "2", "--pp", "2", "--cp", "2", "--microbatches", "2"], steps=10)
    assert "FSDP 1 of 2, PP 1 of 2, CP 1 of 2" in out.stdout, out.stdout


def resume_across_meshes(tools):
    """CP 2 for 5 steps, then chapter 7's FSDP 2 for 5, then FSDP 2 x CP 2 to 15 (global batch 4
    throughout): the losses and weights of a straight CP 2 run."""
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--save-dir", tmp, "--ckpt-freq", "5"]
        run_cp(tools, 2, "-b", "4", "--cp", "2", *flags, "-e", "straight", "--max-steps", "15")
        run_cp(tools, 2, "-b", "4", "--cp", "2", *flags, "-e", "moved", "--max-steps", "5")
        fsdp = run([tools["meshrun"], "--nproc-per-node", "2", "--master-port", str(free_port()), "--",
                    tools["chapter7"], *COMMON, "-b", "2", "--tp", "1", *flags, "-e", "moved", "--max-steps", "10"])
        assert "resumed from" in fsdp.stdout, fsdp.stdout
        back = run_cp(tools, 4, "-b", "2", "--cp", "2", *flags, "-e", "moved", "--max-steps", "15")
        assert "resumed from" in back.stdout, back.stdout
        compare_losses(metrics(f"{tmp}/straight"), metrics(f"{tmp}/moved"), 1e-5)
        compare_params(model_file(f"{tmp}/straight"), model_file(f"{tmp}/moved"), 1e-4)


def bad_flags(tools):
    """A sequence that does not split is refused before any step, in under 5 s, naming the flag and
    the nearest lengths that work."""
    cases = [
        (2, ["--cp", "2", "-s", "66"], "-s/--seq-length 66 does not split into 2 x --cp 2 equal chunks "
                                       "(context parallel's balanced causal split); use a multiple of 4: 64 or 68"),
        (4, ["--cp", "4", "-s", "60"], "-s/--seq-length 60 does not split into 2 x --cp 4 equal chunks "
                                       "(context parallel's balanced causal split); use a multiple of 8: 56 or 64"),
        (4, ["--cp", "2", "--tp", "2", "-s", "62"], "with each rank's positions a multiple of --tp 2 (context "
                                                    "parallel's balanced causal split); use a multiple of 4: 60 or 64"),
        (2, ["--cp", "2", "--cp-rotate", "spiral"], "--cp-rotate"),
    ]
    for nproc, args, needle in cases:
        started = time.monotonic()
        proc = run_cp(tools, nproc, "-b", "4", "--max-steps", "2", *args, expect_ok=False)
        took = time.monotonic() - started
        text = proc.stdout + proc.stderr
        print(f"{' '.join(args)}: exit {proc.returncode} in {took:.1f} s")
        assert proc.returncode != 0, text
        assert needle in text, f"{needle!r} not in:\n{text}"
        assert took < 5, f"refused after {took:.1f} s"


if __name__ == "__main__":
    tools = {"meshrun": sys.argv[1], "chapter1": sys.argv[2], "chapter7": sys.argv[3], "chapter12": sys.argv[4]}
    {"cp2-parity": cp2_parity, "cp4-parity": cp4_parity, "cp-tp-parity": cp_tp_parity, "families-cp-parity": families_cp_parity,
     "fsdp-cp-parity": fsdp_cp_parity, "composition-parity": composition_parity, "pp-cp-parity": pp_cp_parity,
     "resume-across-meshes": resume_across_meshes, "bad-flags": bad_flags}[sys.argv[5]](tools)
