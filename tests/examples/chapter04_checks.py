#!/usr/bin/env python3
"""End-to-end checks of examples/04-fully-sharded-data-parallel against chapter 1 on the same
global batch, run by CTest on CPU with Gloo, fp32, one thread per rank.

usage: chapter04_checks.py MESHRUN CHAPTER1 CHAPTER4
       {fsdp-parity|no-reshard-offload-parity|grad-accum-parity|qwen3-fsdp-parity|qwen2-fsdp-parity|mistral-fsdp-parity|resume|export|bf16}
"""
import pathlib
import sys
import tempfile

from chapter02_checks import (CLIP, compare_grad_norms, check_stop_and_resume, common_except, compare_losses, compare_params, metrics,
                              model_file, weight_elements_per_rank, run)
from ports import free_port

# Losses agree to rounding (~1e-7 measured); weights after 30 AdamW steps to 1e-4, since Adam
# divides by sqrt(v), which magnifies rounding in the smallest gradients.
LOSS_RTOL = 1e-5
PARAM_TOL = 1e-4


def single(tools, *args):
    return run([tools["chapter1"], *common_except(args), *args])


def fsdp(tools, nproc, *args, expect_ok=True):
    return run([tools["meshrun"], "--nproc-per-node", str(nproc), "--master-port", str(free_port()), "--",
                tools["chapter4"], *common_except(args), *args], expect_ok=expect_ok)


def consolidate(tools, save_dir, name):
    out = pathlib.Path(save_dir) / f"{name}-full"
    run([tools["chapter4"], "--save-dir", str(save_dir), "-e", name, "--consolidate-to", str(out)])
    return out


def parity(tools, single_batch, fsdp_args, steps=30, extra=()):
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--save-dir", tmp, "--max-steps", str(steps), "--ckpt-freq", str(steps), *extra]
        single(tools, "-b", str(single_batch), "-e", "one", *flags)
        out = fsdp(tools, 2, *fsdp_args, "-e", "two", *flags)
        assert "this rank holds" in out.stdout, out.stdout
        compare_losses(metrics(f"{tmp}/one"), metrics(f"{tmp}/two"), LOSS_RTOL)
        if extra == CLIP:
            compare_grad_norms(metrics(f"{tmp}/one"), metrics(f"{tmp}/two"), 1e-4)
        checkpoint = pathlib.Path(tmp) / "two" / "checkpoint"
        shards = sorted(p.name for p in checkpoint.glob("rank*.safetensors"))
        assert shards == ["rank0.safetensors", "rank1.safetensors"], shards
        compare_params(model_file(f"{tmp}/one"), consolidate(tools, tmp, "two") / "model.safetensors", PARAM_TOL)


def fsdp_parity(tools):
    # With gradient clipping over the FSDP shards and a warmup schedule.
    parity(tools, 4, ["-b", "2"], extra=CLIP)


def no_reshard_offload_parity(tools):
    # And the loss over chunks of 7 positions, under the root unit's gathered output weight; with
    # LibTorch's composite ops instead of the fused kernels on both sides (the other checks run them).
    parity(tools, 4, ["-b", "2", "--no-reshard-after-forward", "--cpu-offload", "--loss-chunk", "7"],
           extra=("--fused", "off"))


def qwen3_fsdp_parity(tools):
    # A Qwen3 folder: q_norm and k_norm sharded by rows like every other weight.
    qwen3 = pathlib.Path(__file__).resolve().parent.parent / "hf_parity" / "configs" / "qwen3-gqa-tied"
    parity(tools, 4, ["-b", "2"], extra=(*CLIP, "-m", str(qwen3)))


def qwen2_fsdp_parity(tools):
    # A Qwen2 folder: the q, k and v biases sharded by rows with the weights of their unit.
    qwen2 = pathlib.Path(__file__).resolve().parent.parent / "hf_parity" / "configs" / "qwen2-gqa"
    parity(tools, 4, ["-b", "2"], extra=(*CLIP, "-m", str(qwen2)))


def mistral_fsdp_parity(tools):
    # A Mistral folder (a sliding window of 32): trained within the window, at -s 32.
    mistral = pathlib.Path(__file__).resolve().parent.parent / "hf_parity" / "configs" / "mistral-window-32"
    parity(tools, 4, ["-b", "2"], extra=(*CLIP, "-m", str(mistral), "-s", "32"))


def grad_accum_parity(tools):
    # With every other decoder layer recomputed in backward (inside FSDP's units).
    parity(tools, 8, ["-b", "2", "--grad-accum", "2", "--activation-checkpointing", "2"])


def resume(tools):
    with tempfile.TemporaryDirectory() as tmp:
        check_stop_and_resume(lambda *args: fsdp(tools, 2, *args), tmp,
                              ["-b", "2", "--save-dir", tmp, "--ckpt-freq", "10"])
        compare_params(consolidate(tools, tmp, "straight") / "model.safetensors",
                       consolidate(tools, tmp, "stopped") / "model.safetensors", 1e-6)
        # Each rank saved about half of every weight's rows.
        sizes = weight_elements_per_rank(f"{tmp}/stopped")
        print(f"weight elements per rank: {sizes}")
        assert sorted(sizes) == [0, 1] and abs(sizes[0] - sizes[1]) <= 0.01 * sum(sizes.values()), sizes
        # The 2-rank checkpoint resumes on 1 rank with the same global batch, as the 2-rank run goes on.
        fsdp(tools, 2, "-b", "2", "--save-dir", tmp, "--ckpt-freq", "10", "-e", "straight", "--max-steps", "25")
        one = fsdp(tools, 1, "-b", "4", "--save-dir", tmp, "--ckpt-freq", "10", "-e", "stopped", "--max-steps", "25")
        assert "from 2 ranks" in one.stdout, one.stdout
        compare_losses(metrics(f"{tmp}/straight"), metrics(f"{tmp}/stopped"), LOSS_RTOL)
        compare_params(model_file(f"{tmp}/straight"), model_file(f"{tmp}/stopped"), PARAM_TOL)


def export(tools):
    """The consolidated folder loads into chapter 1 and back into chapter 4: with a vanishing
    learning rate, the checkpoint after one step holds exactly the weights that were loaded."""
    with tempfile.TemporaryDirectory() as tmp:
        fsdp(tools, 2, "-b", "2", "--save-dir", tmp, "-e", "sharded", "--max-steps", "10", "--ckpt-freq", "10")
        full = consolidate(tools, tmp, "sharded")
        assert (full / "config.json").exists()
        single(tools, "-m", str(full), "-b", "4", "--lr", "1e-30", "--save-dir", tmp, "-e", "loaded",
               "--max-steps", "1", "--ckpt-freq", "1")
        compare_params(full / "model.safetensors", model_file(f"{tmp}/loaded"), 1e-7)
        # And into chapter 4's shards, each rank reading its rows, or rank 0 reading and broadcasting.
        for read_by in ("every-rank", "rank0"):
            fsdp(tools, 2, "-m", str(full), "-b", "2", "--lr", "1e-30", "--save-dir", tmp, "-e", f"sharded-{read_by}",
                 "--max-steps", "1", "--ckpt-freq", "1", "--weights-read-by", read_by)
            compare_params(full / "model.safetensors", model_file(f"{tmp}/sharded-{read_by}"), 1e-7)


def bf16(tools):
    """bf16 compute with fp32 shards and reduction trains: the loss falls as in fp32."""
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["-b", "2", "--save-dir", tmp, "--max-steps", "30", "--ckpt-freq", "30"]
        fsdp(tools, 2, *flags, "-e", "fp32")
        out = fsdp(tools, 2, *flags, "-e", "bf16", "--dtype", "bfloat16")
        assert "compute bfloat16, shards float32" in out.stdout, out.stdout
        a, b = metrics(f"{tmp}/fp32"), metrics(f"{tmp}/bf16")
        for x, y in zip(a, b):
            print(f"step {x['global_step']}: fp32 {x['running_loss']:.6f} bf16 {y['running_loss']:.6f}")
            assert abs(x["running_loss"] - y["running_loss"]) <= 0.02 * x["running_loss"], (x, y)
        assert b[-1]["running_loss"] < b[0]["running_loss"], b
        # The shards (and so the checkpoint) stay fp32.
        full = consolidate(tools, tmp, "bf16")
        assert '"F32"' in (full / "model.safetensors").read_bytes()[:4096].decode("latin-1")


if __name__ == "__main__":
    tools = {"meshrun": sys.argv[1], "chapter1": sys.argv[2], "chapter4": sys.argv[3]}
    {"fsdp-parity": fsdp_parity, "no-reshard-offload-parity": no_reshard_offload_parity,
     "grad-accum-parity": grad_accum_parity, "qwen3-fsdp-parity": qwen3_fsdp_parity,
     "qwen2-fsdp-parity": qwen2_fsdp_parity, "mistral-fsdp-parity": mistral_fsdp_parity, "resume": resume,
     "export": export, "bf16": bf16}[sys.argv[4]](tools)
    print("ok")
