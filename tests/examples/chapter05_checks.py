#!/usr/bin/env python3
"""End-to-end checks of examples/05-training-llama-405b on CPU with Gloo, fp32, one thread per
rank: the recipe (every layer checkpointed, CPU offload, prefetch, reduce-scatters in flight, a
chunked loss) against chapter 1 on the same global batch and against itself with all of that
off; pretrained weights read by rank 0 or by every rank; a 400 MB bf16 folder that transformers
wrote, loaded by every rank for its own rows within half the folder plus its largest tensor; and
launch.sh over a hosts file (ssh faked as in chapter 3's checks: each "host" is this machine).

usage: chapter05_checks.py MESHRUN CHAPTER1 CHAPTER5 CONSOLIDATE CHECK [VENV_PYTHON]
  CHECK: recipe-parity, optimizer-in-backward, offload, resume, pretrained, load-folder (needs VENV_PYTHON
         with transformers) or launch
"""
import json
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile

from chapter02_checks import (CLIP, check_stop_and_resume, common_except, compare_grad_norms, compare_losses,
                              compare_params, metrics, model_file, run)
from chapter03_checks import FAKES, wait_for_tmux_sessions
from ports import free_port

HERE = pathlib.Path(__file__).resolve().parent
MAKE_FOLDER = HERE.parent / "hf_parity" / "make_transformers_folder.py"
MIB = 2**20
LAUNCH = HERE.parent.parent / "examples" / "05-training-llama-405b" / "launch.sh"
LOSS_RTOL = 1e-5
PARAM_TOL = 1e-4


def single(tools, *args):
    return run([tools["chapter1"], *common_except(args), *args])


def recipe(tools, nproc, *args, expect_ok=True):
    return run([tools["meshrun"], "--nproc-per-node", str(nproc), "--master-port", str(free_port()), "--",
                tools["chapter5"], *common_except(args), *args], expect_ok=expect_ok)


def assert_same_run(save_dir, a, b):
    """Runs a and b under save_dir logged the same losses and left the same checkpoint files on
    both ranks: the weights and AdamW's moments and step counts, every byte."""
    ma, mb = metrics(f"{save_dir}/{a}"), metrics(f"{save_dir}/{b}")
    assert [r["running_loss"] for r in ma] == [r["running_loss"] for r in mb], (ma, mb)
    for rank_file in ("rank0.safetensors", "rank1.safetensors"):
        x = (pathlib.Path(save_dir) / a / "checkpoint" / rank_file).read_bytes()
        y = (pathlib.Path(save_dir) / b / "checkpoint" / rank_file).read_bytes()
        assert x == y, f"{a} and {b}: {rank_file} differs"


def recipe_parity(tools):
    """Chapter 1 with the plain loss against the recipe with everything on (every layer
    checkpointed, CPU offload, prefetch, a reduce-scatter in flight, the loss in chunks of 7
    positions) and with everything off, 30 steps with clipping and warmup; then the recipe
    without checkpointing and prefetch, which must give the same numbers bit for bit."""
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--save-dir", tmp, "--max-steps", "30", "--ckpt-freq", "30", *CLIP]
        single(tools, "-b", "4", "-e", "one", "--loss-chunk", "0", *flags)
        out = recipe(tools, 2, "-b", "2", "-e", "recipe", "--cpu-offload", "--loss-chunk", "7", *flags)
        assert "checkpointed layers: full; prefetch 1 layer(s); shards in CPU memory" in out.stdout, out.stdout
        recipe(tools, 2, "-b", "2", "-e", "off", "--activation-checkpointing", "none", "--prefetch-layers", "0",
               "--loss-chunk", "0", *flags)
        for run_name in ("recipe", "off"):
            compare_losses(metrics(f"{tmp}/one"), metrics(f"{tmp}/{run_name}"), LOSS_RTOL)
            compare_grad_norms(metrics(f"{tmp}/one"), metrics(f"{tmp}/{run_name}"), 1e-4)
            compare_params(model_file(f"{tmp}/one"), model_file(f"{tmp}/{run_name}"), PARAM_TOL)
        # Recomputation and prefetching change no number.
        recipe(tools, 2, "-b", "2", "-e", "same", "--cpu-offload", "--loss-chunk", "7", "--activation-checkpointing",
               "none", "--prefetch-layers", "0", *flags)
        a, b = metrics(f"{tmp}/recipe"), metrics(f"{tmp}/same")
        assert [r["running_loss"] for r in a] == [r["running_loss"] for r in b], (a, b)
        compare_params(model_file(f"{tmp}/recipe"), model_file(f"{tmp}/same"), 0.0)


def optimizer_in_backward(tools):
    """The recipe (checkpointing, CPU offload, prefetch, chunked loss) with AdamW stepping each
    layer in backward gives the same losses, weights and optimizer state, bit for bit, as the
    step after backward, over 12 steps without clipping; with clipping or accumulation it is
    refused at start-up, naming the flag; and it resumes."""
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["-b", "2", "--save-dir", tmp, "--max-steps", "12", "--ckpt-freq", "12", "--cpu-offload",
                 "--loss-chunk", "7", "--lr-schedule", "warmup-cosine", "--warmup-steps", "3"]
        recipe(tools, 2, "-e", "after", *flags)
        recipe(tools, 2, "-e", "during", "--optimizer-in-backward", *flags)
        assert_same_run(tmp, "after", "during")
        for extra, message in ((["--max-grad-norm", "1"], "clipping by the global norm (--max-grad-norm 1)"),
                               (["--grad-accum", "2"], "2 micro-batches per step (--grad-accum")):
            refused = recipe(tools, 2, "-e", "refused", "--optimizer-in-backward", *extra, *flags, expect_ok=False)
            assert refused.returncode != 0 and message in refused.stdout + refused.stderr, (extra, refused.stderr)
        check_stop_and_resume(lambda *args: recipe(tools, 2, *args), tmp,
                              ["-b", "2", "--save-dir", tmp, "--ckpt-freq", "10", "--optimizer-in-backward"])


def offload(tools):
    """Where AdamW and the gradients live changes no byte: the recipe with its shards on the device,
    with everything in CPU memory (--cpu-offload: gradients landing in .grad after later layers'
    reduce-scatters, zeroed in place between steps) and with AdamW alone on the host
    (--optimizer-offload), over 12 steps with clipping and 2 micro-batches per step, leaves the
    same checkpoint files; so does --optimizer-offload with AdamW stepping in backward. Both
    offloads at once are refused, naming the flags; --optimizer-offload resumes."""
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["-b", "2", "--save-dir", tmp, "--max-steps", "12", "--ckpt-freq", "12", "--loss-chunk", "7", *CLIP]

        recipe(tools, 2, "-e", "device", "--grad-accum", "2", *flags)
        recipe(tools, 2, "-e", "host", "--grad-accum", "2", "--cpu-offload", *flags)
        out = recipe(tools, 2, "-e", "optimizer", "--grad-accum", "2", "--optimizer-offload", *flags)
        assert "shards on the device, AdamW's state in host memory" in out.stdout, out.stdout
        assert_same_run(tmp, "device", "host")
        assert_same_run(tmp, "device", "optimizer")
        no_clip = [f for f in flags if f not in ("--max-grad-norm", "0.5")]
        recipe(tools, 2, "-e", "after", *no_clip)
        recipe(tools, 2, "-e", "during", "--optimizer-offload", "--optimizer-in-backward", *no_clip)
        assert_same_run(tmp, "after", "during")
        refused = recipe(tools, 2, "-e", "both", "--optimizer-offload", "--cpu-offload", *flags, expect_ok=False)
        assert refused.returncode != 0 and re.search(r"--(cpu|optimizer)-offload excludes --(optimizer|cpu)-offload",
                                                     refused.stderr), refused.stderr
        check_stop_and_resume(lambda *args: recipe(tools, 2, *args), tmp,
                              ["-b", "2", "--save-dir", tmp, "--ckpt-freq", "10", "--optimizer-offload"])


def resume(tools):
    """The recipe stopped at step 10 and resumed to 15 logs the straight run's losses."""
    with tempfile.TemporaryDirectory() as tmp:
        check_stop_and_resume(lambda *args: recipe(tools, 2, *args), tmp,
                              ["-b", "2", "--save-dir", tmp, "--ckpt-freq", "10", "--cpu-offload", "--loss-chunk", "7"])
        compare_params(model_file(f"{tmp}/straight"), model_file(f"{tmp}/stopped"), 1e-6)


def pretrained(tools):
    """An HF folder's weights, read by rank 0 and broadcast (the recipe's default) or by every
    rank for its own rows, train as chapter 1 trains them."""
    with tempfile.TemporaryDirectory() as tmp:
        recipe(tools, 2, "-b", "2", "--save-dir", tmp, "-e", "source", "--max-steps", "5", "--ckpt-freq", "5")
        folder = pathlib.Path(tmp) / "folder"
        run([tools["consolidate"], str(pathlib.Path(tmp) / "source" / "checkpoint"), str(folder)])
        flags = ["-m", str(folder), "--save-dir", tmp, "--max-steps", "10", "--ckpt-freq", "10"]
        single(tools, "-b", "4", "-e", "one", *flags)
        for read_by in ("rank0", "every-rank"):
            recipe(tools, 2, "-b", "2", "-e", read_by, "--weights-read-by", read_by, *flags)
            compare_losses(metrics(f"{tmp}/one"), metrics(f"{tmp}/{read_by}"), LOSS_RTOL)
            compare_params(model_file(f"{tmp}/one"), model_file(f"{tmp}/{read_by}"), PARAM_TOL)


def safetensors_sizes(folder):
    """{tensor name: bytes} of every tensor in a folder's safetensors files (their JSON headers)."""
    sizes = {}
    for path in pathlib.Path(folder).glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, entry in header.items():
            if name != "__metadata__":
                sizes[name] = entry["data_offsets"][1] - entry["data_offsets"][0]
    return sizes


COMPARE_FOLDERS = """
import sys, pathlib, torch
from safetensors.torch import load_file
def tensors(folder):
    out = {}
    for path in sorted(pathlib.Path(folder).glob("*.safetensors")):
        out.update(load_file(path))
    return out
theirs, ours = tensors(sys.argv[1]), tensors(sys.argv[2])
assert sorted(theirs) == sorted(ours), (sorted(theirs), sorted(ours))
for name, tensor in theirs.items():
    assert torch.equal(tensor.float(), ours[name].float()), name
print(f"{len(theirs)} tensors equal")
"""


def load_folder(tools):
    """A folder of about 400 MB that transformers wrote (five bf16 safetensors files and an
    index) loaded by 2 ranks, each reading only its rows: what building and filling the model
    adds to a rank's resident set at its peak is its pieces plus at most the folder's largest
    tensor. In the files' bf16 that is half the folder plus the largest tensor; the recipe keeps
    fp32 pieces (its master weights), twice their bytes in the files, and the check says both.
    The pieces equal the files' slices: one step at learning rate 0 (the warmup's first), saved
    and consolidated, gives the folder's tensors back bit for bit. Rank 0 reading for everyone
    holds a whole weight at once beside its pieces (the one buffer every weight is read or
    received into): the same bound, with the largest tensor whole instead of its half."""
    python = tools.get("python")
    if not python or not os.access(python, os.X_OK):
        print(f"skipped: no bench environment at {python} (install it with bench/setup-python)")
        sys.exit(77)
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp) / "transformers"
        run([python, str(MAKE_FOLDER), str(folder), "--size", "400mb"])
        sizes = safetensors_sizes(folder)
        folder_mib, largest_mib = sum(sizes.values()) / MIB, max(sizes.values()) / MIB
        assert len(list(folder.glob("*.safetensors"))) >= 4 and 380 < folder_mib < 400, (folder_mib, sizes)
        for read_by in ("every-rank", "rank0"):
            # Only the first run's checkpoint is consolidated below: the second saves none (writing
            # 2.4 GB of weights and AdamW's moments is most of a run's time).
            saving = ["-e", read_by, "--ckpt-freq", "1"] if read_by == "every-rank" else ["--ckpt-freq", "1000"]
            out = recipe(tools, 2, "-m", str(folder), "--weights-read-by", read_by, "-s", "32", "-b", "1",
                         "--save-dir", tmp, *saving, "--max-steps", "1",
                         "--lr-schedule", "warmup-decay", "--warmup-steps", "10", "--warmup-type", "linear")
            reports = re.findall(r"\[rank=(\d+)\] \[INFO\] weights from \S+ read by \S+: this rank read (\d+) of the model's (\d+) elements; resident set "
                                 r"\+(\d+) MiB at the peak of loading, its pieces (\d+) MiB", out.stdout)
            assert len(reports) == 2, out.stdout
            for rank, read, whole, growth, pieces in sorted(reports):
                growth, pieces = int(growth), int(pieces)
                print(f"{read_by}, rank {rank}: read {int(read) / int(whole):.2f} of the elements; resident set "
                      f"+{growth} MiB at the peak of loading: its fp32 pieces {pieces} MiB + {growth - pieces} MiB "
                      f"read at once (folder {folder_mib:.0f} MiB, largest tensor {largest_mib:.0f} MiB; in the "
                      f"files' bf16 the pieces and the reads come to {pieces / 2 + growth - pieces:.0f} MiB, "
                      f"half the folder plus the largest tensor {folder_mib / 2 + largest_mib:.0f} MiB)")
                assert pieces >= folder_mib - 2, (pieces, folder_mib)  # fp32 halves of a bf16 folder
                # + 12 MiB: the listing, headers, Gloo's buffers and what else the build allocates.
                # Measured: 5 MiB over half the largest tensor reading by every rank, 7.5-8.5 MiB over
                # the whole one reading by rank 0 (8 MiB of room failed once by 0.5 MiB under ctest -j2).
                bound = largest_mib + 12
                assert growth - pieces <= bound, (read_by, rank, growth, pieces, bound)
                if read_by == "every-rank":  # the issue's criterion, in the files' bf16
                    assert pieces / 2 + growth - pieces <= folder_mib / 2 + largest_mib, (rank, growth, pieces)
        consolidated = pathlib.Path(tmp) / "consolidated"
        run([tools["consolidate"], str(pathlib.Path(tmp) / "every-rank" / "checkpoint"), str(consolidated)])
        print(run([python, "-c", COMPARE_FOLDERS, str(folder), str(consolidated)]).stdout.strip())


def launch(tools):
    """launch.sh on two "hosts" (one rank each): both start from the hosts file, the recipe's
    flags reach the binary, and the caller's flags override its defaults."""
    if shutil.which("tmux") is None:
        print("tmux is not installed: skipped")
        sys.exit(77)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        bindir, fakes = root / "bin", root / "fakes"
        bindir.mkdir()
        fakes.mkdir()
        for name, path in [("meshrun", tools["meshrun"]), ("05-training-llama-405b", tools["chapter5"])]:
            (bindir / name).symlink_to(pathlib.Path(path).resolve())
        (fakes / "ssh").write_text(FAKES["ssh"])
        (fakes / "ssh").chmod(0o755)
        (root / "hosts").write_text("127.0.0.1\nlocalhost\n")
        env = dict(os.environ, MESHTORCH_BIN=str(bindir), FAKE_ROOT=str(root), WORKDIR=str(root),
                   PATH=f"{fakes}:{os.environ['PATH']}", MODEL="llama-tiny", DATA="builtin", NPROC_PER_NODE="1",
                   THREADS_PER_RANK="1", EXPERIMENT="recipe", SESSION="recipe-test", MASTER_PORT=str(free_port()))
        dry = subprocess.run([LAUNCH, root / "hosts"], env=dict(env, DRY_RUN="1"), capture_output=True, text=True)
        assert dry.returncode == 0, dry.stderr
        commands = [line.replace("\\ ", " ") for line in dry.stdout.splitlines()]  # the remote command is quoted
        assert len(commands) == 2 and "--node-rank 1" in commands[1], commands
        for expected in ("NCCL_CROSS_NIC=1", "OMP_NUM_THREADS=1", "05-training-llama-405b", "--cpu-offload",
                         "-s 4096"):
            assert expected in commands[0], (expected, commands[0])
        proc = subprocess.run([LAUNCH, root / "hosts", "-s", "64", "-b", "2", "--dtype", "float32", "--max-steps",
                               "6", "--log-freq", "3", "--save-dir", str(root / "runs")],
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        wait_for_tmux_sessions(root, env, ["127.0.0.1", "localhost"], "recipe-test")
        logs = sorted((root / "logs").glob("*/*/stdout.log"))
        assert len(logs) == 2, logs
        text = logs[0].read_text()
        assert "checkpointed layers: full" in text and "shards in CPU memory" in text, text
        records = [json.loads(line) for line in (root / "runs" / "recipe" / "metrics.jsonl").read_text().splitlines()]
        assert [r["global_step"] for r in records] == [3, 6], records
        print("losses:", [round(r["running_loss"], 6) for r in records])


if __name__ == "__main__":
    tools = {"meshrun": sys.argv[1], "chapter1": sys.argv[2], "chapter5": sys.argv[3], "consolidate": sys.argv[4],
             "python": sys.argv[6] if len(sys.argv) > 6 else None}
    {"recipe-parity": recipe_parity, "resume": resume, "pretrained": pretrained, "load-folder": load_folder,
     "optimizer-in-backward": optimizer_in_backward, "offload": offload,
     "launch": launch}[sys.argv[5]](tools)
    print("ok")
