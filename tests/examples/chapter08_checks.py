#!/usr/bin/env python3
"""End-to-end checks of examples/08-alternative-frameworks (the DeepSpeed-style engine) against
chapter 1 on the same global batch, run by CTest on CPU with Gloo, fp32, one thread per rank.

usage: chapter08_checks.py MESHRUN CHAPTER1 CHAPTER8 {stages-parity|clipping-parity|optimizer-offload|resume|config-errors}
"""
import json
import pathlib
import re
import sys
import tempfile

from chapter02_checks import (CLIP, check_stop_and_resume, common_except, compare_grad_norms, compare_losses,
                              compare_params, metrics, model_file, run)
from ports import free_port

LOSS_RTOL = 1e-5
PARAM_TOL = 1e-4


def config(path, stage, micro=2, accumulation=2, clipping=False, **extra):
    """A ds_config.json: `micro` x `accumulation` x 2 ranks = chapter 1's -b 8."""
    c = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
         "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                   "weight_decay": 0.01}},
         "zero_optimization": {"stage": stage}, "steps_per_print": 5}
    if clipping:  # chapter 1's CLIP flags as DeepSpeed keys
        c["gradient_clipping"] = 0.5
        c["scheduler"] = {"type": "WarmupCosineLR",
                          "params": {"total_num_steps": 40, "warmup_num_steps": 4, "warmup_type": "linear",
                                     "cos_min_ratio": 1e-4}}
    c.update(extra)
    pathlib.Path(path).write_text(json.dumps(c))
    return str(path)


def single(tools, *args):
    return run([tools["chapter1"], *common_except(args), *args])


def engine(tools, nproc, config_file, *args, expect_ok=True):
    # The config decides the dtype (bf16.enabled): chapter 1's --dtype is left out.
    return run([tools["meshrun"], "--nproc-per-node", str(nproc), "--master-port", str(free_port()), "--",
                tools["chapter8"], "--deepspeed-config", config_file, *common_except((*args, "--dtype")), *args],
               expect_ok=expect_ok)


def model_state_mb(stdout):
    """rank 0's measured model state (weights + gradients + optimizer state) at the first step."""
    m = re.search(r"\[rank=0\].*model state on this rank at the first step: .* total ([0-9.]+) MB", stdout)
    assert m, stdout
    return float(m.group(1))


def parity(tools, clipping):
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--save-dir", tmp, "--max-steps", "30", "--ckpt-freq", "30"]
        lr = ["--lr", "3e-4"] + (CLIP if clipping else ["--lr-schedule", "constant"])
        single(tools, "-b", "8", *lr, "-e", "one", *flags)
        totals = []
        for stage in range(4):
            # With clipping, stage 2 also runs without overlap and with small buckets (~80 KB).
            zero = {"stage": 2, "overlap_comm": False, "reduce_bucket_size": 20000} if clipping and stage == 2 else None
            ds = config(f"{tmp}/stage{stage}.json", stage, clipping=clipping,
                        **({"zero_optimization": zero} if zero else {}))
            out = engine(tools, 2, ds, "-e", f"stage{stage}", *flags)
            assert f"ZeRO stage {stage}" in out.stdout, out.stdout
            # Stage 3's module weights are not leaves: measuring the model state asked them for
            # their .grad, and LibTorch warned 78 times in 8 steps.
            assert "not a leaf Tensor" not in out.stderr, out.stderr[:2000]
            print(f"stage {stage}:")
            compare_losses(metrics(f"{tmp}/one"), metrics(f"{tmp}/stage{stage}"), LOSS_RTOL)
            if clipping:
                compare_grad_norms(metrics(f"{tmp}/one"), metrics(f"{tmp}/stage{stage}"), 1e-4)
            compare_params(model_file(f"{tmp}/one"), model_file(f"{tmp}/stage{stage}"), PARAM_TOL)
            totals.append(model_state_mb(out.stdout))
        # Each stage holds strictly less model state per rank than the one before.
        print(f"model state per rank, stages 0-3: {totals} MB")
        assert all(a > b for a, b in zip(totals, totals[1:])), totals


def stages_parity(tools):
    parity(tools, clipping=False)


def clipping_parity(tools):
    parity(tools, clipping=True)


def optimizer_offload(tools):
    """Stages 1-3 with offload_optimizer alone (AdamW's state and step on the host, the weights on
    the device) log the same losses and save the same weights, bit for bit, as without it, over 12
    steps with clipping and accumulation."""
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--save-dir", tmp, "--max-steps", "12", "--ckpt-freq", "12"]
        for stage in (1, 2, 3):
            plain = config(f"{tmp}/stage{stage}.json", stage, clipping=True)
            offloaded = config(f"{tmp}/stage{stage}-offload.json", stage, clipping=True,
                               zero_optimization={"stage": stage, "offload_optimizer": {"device": "cpu"}})
            engine(tools, 2, plain, "-e", f"stage{stage}", *flags)
            out = engine(tools, 2, offloaded, "-e", f"stage{stage}-offload", *flags)
            assert "AdamW's state and step offloaded to the CPU" in out.stdout, out.stdout
            a, b = metrics(f"{tmp}/stage{stage}"), metrics(f"{tmp}/stage{stage}-offload")
            assert [r["running_loss"] for r in a] == [r["running_loss"] for r in b], (stage, a, b)
            compare_params(model_file(f"{tmp}/stage{stage}"), model_file(f"{tmp}/stage{stage}-offload"), 0.0)
            print(f"stage {stage}: the same losses and weights with the optimizer offloaded")


def resume(tools):
    """For every stage: 15 steps straight against 10, a stop and engine.load_checkpoint to 15."""
    with tempfile.TemporaryDirectory() as tmp:
        for stage in range(4):
            save_dir = pathlib.Path(tmp) / f"stage{stage}"
            save_dir.mkdir()
            ds = config(save_dir / "ds_config.json", stage, clipping=True)
            check_stop_and_resume(lambda *args: engine(tools, 2, ds, *args), save_dir,
                                  ["--save-dir", str(save_dir), "--ckpt-freq", "10"])
            compare_params(model_file(save_dir / "straight"), model_file(save_dir / "stopped"), 1e-6)


def config_errors(tools):
    """Bad configs end the run at start-up with the key path; nothing trains."""
    with tempfile.TemporaryDirectory() as tmp:
        cases = [
            ({"zero_optimization": {"stage": "two"}}, 'zero_optimization.stage: expected an integer 0-3, got "two"'),
            ({"zero_optimization": {"stage": 2, "round_robin_gradients": True}},
             "zero_optimization.round_robin_gradients: not a key meshtorch implements"),
            ({"wall_clock_breakdown": True}, "wall_clock_breakdown: not a key meshtorch implements"),
            ({"train_batch_size": 64}, "train_batch_size 64 is not train_micro_batch_size_per_gpu 2 x "
                                       "gradient_accumulation_steps 2 x 2 data-parallel ranks = 8"),
            ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
             "zero_optimization.offload_param: parameters are offloaded with stage 3 only"),
            ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
             "zero_optimization.offload_optimizer: optimizer offload needs ZeRO stage 1, 2 or 3"),
            ({"optimizer": {"type": "Lamb"}}, "optimizer.type: expected one of AdamW, Adam, got \"Lamb\""),
            ({"fp16": {"enabled": True}}, "fp16.enabled: fp16 with loss scaling is not implemented"),
            # 2 x 2^62 x 2 wrapped to 0, which the sampler divided by (SIGFPE).
            ({"gradient_accumulation_steps": 4611686018427387904},
             "train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel ranks = 2 x "
             "4611686018427387904 x 2 overflows a 64-bit integer"),
            # Printed wrapped ("-1 is out of range") and cut at the NUL before.
            ({"zero_optimization": {"stage": 18446744073709551615}},
             "zero_optimization.stage: 18446744073709551615 is out of range; expected an integer 0-3"),
            ({"a\u0000b": 1}, "a\\u0000b: not a key meshtorch implements"),
        ]
        for i, (change, message) in enumerate(cases):
            ds = config(f"{tmp}/bad{i}.json", 0, **change)
            if "zero_optimization" in change:
                c = json.loads(pathlib.Path(ds).read_text())
                c["zero_optimization"] = change["zero_optimization"]
                pathlib.Path(ds).write_text(json.dumps(c))
            out = engine(tools, 2, ds, "--max-steps", "2", expect_ok=False)
            print(f"{change} -> exit {out.returncode}")
            assert out.returncode != 0, out.stdout
            assert message in out.stdout + out.stderr, (message, out.stdout, out.stderr)
            assert "global_step" not in out.stdout, out.stdout
        # What the config decides is not also a flag.
        out = run([tools["chapter8"], "--deepspeed-config", config(f"{tmp}/ok.json", 0), "-b", "4"], expect_ok=False)
        assert out.returncode != 0 and "-b" in out.stderr + out.stdout, (out.stdout, out.stderr)


if __name__ == "__main__":
    tools = {"meshrun": sys.argv[1], "chapter1": sys.argv[2], "chapter8": sys.argv[3]}
    {"stages-parity": stages_parity, "clipping-parity": clipping_parity, "optimizer-offload": optimizer_offload,
     "resume": resume,
     "config-errors": config_errors}[sys.argv[4]](tools)
    print("ok")
