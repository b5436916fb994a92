#!/usr/bin/env python3
"""End-to-end checks of examples/06-tensor-parallel against chapter 1, run by CTest on CPU with
Gloo, fp32, one thread per rank.

usage: chapter06_checks.py MESHRUN CHAPTER1 CHAPTER6 {tp-parity|dp-tp-parity|qwen3-tp-parity|qwen2-tp-parity|mistral-tp-parity|resume|bad-input}
       CONSOLIDATE
"""
import pathlib
import sys
import tempfile

from chapter02_checks import (CLIP, compare_grad_norms, COMMON, manifest, check_stop_and_resume, common_except, compare_losses, compare_params,
                              metrics, model_file, read_safetensors, run)
from ports import free_port


def tp_run(tools, nproc, *args, expect_ok=True):
    return run([tools["meshrun"], "--nproc-per-node", str(nproc), "--master-port", str(free_port()), "--",
                tools["chapter6"], *common_except(args), *args], expect_ok=expect_ok)


def parity(tools, single_batch, nproc, tp_args, steps=20, extra=()):
    """One process with the global batch against the TP (x DP) run: losses and final weights."""
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--save-dir", tmp, "--max-steps", str(steps), "--ckpt-freq", str(steps), *extra]
        run([tools["chapter1"], *common_except(extra), "-b", str(single_batch), "-e", "one", *flags])
        tp_run(tools, nproc, *tp_args, "-e", "tp", *flags)
        compare_losses(metrics(f"{tmp}/one"), metrics(f"{tmp}/tp"), 1e-5)
        if extra == CLIP:
            compare_grad_norms(metrics(f"{tmp}/one"), metrics(f"{tmp}/tp"), 1e-4)
        # The TP checkpoint holds each rank's chunks (no rank gathers a weight); assembled, they
        # are chapter 1's weights.
        compare_params(model_file(f"{tmp}/one"), model_file(f"{tmp}/tp"), 1e-4)


def tp_parity(tools):
    # Recomputation repeats the layers' TP collectives in backward; results must not change. With
    # LibTorch's composite ops instead of the fused kernels on both sides (dp-tp-parity runs them).
    parity(tools, 4, 2, ["-b", "4", "--tp", "2", "--activation-checkpointing", "full"], extra=("--fused", "off"))


def dp_tp_parity(tools):
    # 4 ranks as 2 DP x 2 TP, 2 samples per DP rank: chapter 1's batch of 4. With clipping, whose
    # norm counts the TP chunks once each and the norm weights TP leaves whole once, not twice.
    parity(tools, 4, 4, ["-b", "2", "--tp", "2"], extra=CLIP)


def qwen3_tp_parity(tools):
    # A Qwen3 folder (q_norm and k_norm over each head, head_dim 32 apart from hidden / heads): the
    # heads split over 2 ranks, each rank's gradient of the per-head norms a partial sum.
    qwen3 = pathlib.Path(__file__).resolve().parent.parent / "hf_parity" / "configs" / "qwen3-gqa-tied"
    parity(tools, 4, 2, ["-b", "4", "--tp", "2"], extra=(*CLIP, "-m", str(qwen3)))


def qwen2_tp_parity(tools):
    # A Qwen2 folder whose biases are far from their zero start (5 steps of chapter 1 at --lr 1e-2,
    # consolidated): each TP rank must load its heads' rows of the q, k and v biases with their
    # weights, and a bias loaded into the wrong rank's rows would show in the first loss.
    qwen2 = pathlib.Path(__file__).resolve().parent.parent / "hf_parity" / "configs" / "qwen2-gqa"
    with tempfile.TemporaryDirectory() as tmp:
        run([tools["chapter1"], *common_except(["-m"]), "-m", str(qwen2), "-b", "4", "--lr", "1e-2", "--max-steps", "5",
             "--save-dir", tmp, "-e", "pre"])
        run([tools["consolidate"], f"{tmp}/pre/checkpoint", f"{tmp}/folder"])
        biases = {name: values for name, (shape, values) in read_safetensors(f"{tmp}/folder/model.safetensors").items()
                  if name.endswith("_proj.bias")}
        assert len(biases) == 2 * 3, sorted(biases)
        assert all(max(abs(v) for v in values) > 1e-3 for values in biases.values()), "biases still near zero"
        parity(tools, 4, 2, ["-b", "4", "--tp", "2"], extra=(*CLIP, "-m", f"{tmp}/folder"))


def mistral_tp_parity(tools):
    # A Mistral folder (a sliding window of 32): trained within the window, at -s 32.
    mistral = pathlib.Path(__file__).resolve().parent.parent / "hf_parity" / "configs" / "mistral-window-32"
    parity(tools, 4, 2, ["-b", "4", "--tp", "2"], extra=(*CLIP, "-m", str(mistral), "-s", "32"))


def resume(tools):
    with tempfile.TemporaryDirectory() as tmp:
        check_stop_and_resume(lambda *args: tp_run(tools, 2, *args), tmp,
                              ["-b", "2", "--tp", "2", "--save-dir", tmp, "--ckpt-freq", "10"])
        compare_params(model_file(f"{tmp}/straight"), model_file(f"{tmp}/stopped"), 1e-6)
        # No piece of a sharded weight is whole: each TP rank saved its chunk.
        chunked = [name for name, record in manifest(f"{tmp}/stopped")["tensors"].items()
                   if len(record["pieces"]) == 2]
        assert len(chunked) >= 4, chunked
        # The TP-2 checkpoint resumes with TP 1 on one rank (weights and AdamW state resharded).
        tp_run(tools, 2, "-b", "2", "--tp", "2", "--save-dir", tmp, "--ckpt-freq", "10", "-e", "straight",
               "--max-steps", "25")
        one = tp_run(tools, 1, "-b", "2", "--tp", "1", "--save-dir", tmp, "--ckpt-freq", "10", "-e", "stopped",
                     "--max-steps", "25")
        assert "from 2 ranks" in one.stdout, one.stdout
        compare_losses(metrics(f"{tmp}/straight"), metrics(f"{tmp}/stopped"), 1e-5)
        compare_params(model_file(f"{tmp}/straight"), model_file(f"{tmp}/stopped"), 1e-4)


def bad_input(tools):
    cases = [
        (2, ["--tp", "3"], "world size 2 is not a multiple of 3"),
        (3, ["--tp", "3"], "num_attention_heads is not divisible by the TP size (3)"),
        (3, ["--tp", "2"], "world size 3 is not a multiple of 2"),
        (2, ["--tp", "2", "-s", "63"], "--seq-length 63 is not divisible by the TP size 2"),
        (4, ["--tp", "4", "-m", "llama-tiny"], None),  # llama-tiny splits 4 ways: no error
    ]
    for nproc, args, message in cases:
        proc = tp_run(tools, nproc, *args, "-b", "1", "--max-steps", "1", expect_ok=message is None)
        text = proc.stdout + proc.stderr
        if message is not None:
            assert proc.returncode != 0 and message in text, f"{args}: expected {message!r} in:\n{text}"
        print(f"{nproc} ranks {' '.join(args)}: {'refused' if message else 'ran'}")


if __name__ == "__main__":
    tools = {"meshrun": sys.argv[1], "chapter1": sys.argv[2], "chapter6": sys.argv[3], "consolidate": sys.argv[5]}
    {"tp-parity": tp_parity, "dp-tp-parity": dp_tp_parity, "qwen3-tp-parity": qwen3_tp_parity,
     "qwen2-tp-parity": qwen2_tp_parity, "mistral-tp-parity": mistral_tp_parity, "resume": resume,
     "bad-input": bad_input}[sys.argv[4]](tools)
    print("ok")
