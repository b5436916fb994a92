#!/usr/bin/env python3
"""End-to-end checks of examples/02-distributed-data-parallel (and the chapter-3 launch paths),
run by CTest on CPU with Gloo, fp32, one thread per rank.

usage: chapter02_checks.py MESHRUN CHAPTER1 CHAPTER2 {ddp-parity|grad-accum-parity|zero-parity|resume|two-nodes|flag-mismatch|elastic|token-cache|tensorboard}
"""
import json
import os
import pathlib
import struct
import subprocess
import sys
import tempfile
import time
from array import array

from ports import free_port

COMMON = ["-m", "llama-tiny", "-d", "builtin", "-s", "64", "--threads", "1", "--dtype", "float32",
          "--log-freq", "5", "--seed", "3"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run(cmd, expect_ok=True):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    if expect_ok and proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def single(tools, *args):
    return run([tools["chapter1"], *COMMON, *args])


def ddp(tools, nproc, *args, expect_ok=True):
    return run([tools["meshrun"], "--nproc-per-node", str(nproc), "--master-port", str(free_port()), "--",
                tools["chapter2"], *COMMON, *args], expect_ok=expect_ok)


def metrics(exp_dir):
    return [json.loads(line) for line in (pathlib.Path(exp_dir) / "metrics.jsonl").read_text().splitlines()]


def read_safetensors(path):
    """name -> (shape, list of floats); float32 only, enough for the fp32 runs here."""
    data = pathlib.Path(path).read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = data[8 + size + begin:8 + size + end]
        values = array("f", raw) if info["dtype"] == "F32" else array("B", raw)
        out[name] = (info["shape"], values)
    return out


def common_except(args):
    """COMMON's flag-value pairs, less those that args sets itself."""
    pairs = [COMMON[i:i + 2] for i in range(0, len(COMMON), 2)]
    return [x for flag, value in pairs if flag not in args for x in (flag, value)]


def check_stop_and_resume(launch, save_dir, flags):
    """15 steps straight against 10 steps, a stop and a resume to 15, each run by launch(*args)
    with flags that save a checkpoint every 10 steps: the resumed run says so and logs the same
    losses (within 1e-6), the last 5 steps' after the resume. Weights are the caller's to compare
    (the weights and AdamW's moments after the resumed steps), since where they are saved differs
    by chapter."""
    launch(*flags, "-e", "straight", "--max-steps", "15")
    launch(*flags, "-e", "stopped", "--max-steps", "10")
    second = launch(*flags, "-e", "stopped", "--max-steps", "15")
    assert "resumed from" in second.stdout and "global_step 10" in second.stdout, second.stdout
    straight, resumed = metrics(f"{save_dir}/straight"), metrics(f"{save_dir}/stopped")
    assert [r["global_step"] for r in resumed] == [5, 10, 15], resumed
    for a, b in zip(straight, resumed):
        print(f"step {a['global_step']}: straight {a['running_loss']:.9f} resumed {b['running_loss']:.9f}")
        assert abs(a["running_loss"] - b["running_loss"]) <= 1e-6, (a, b)


def compare_losses(a, b, rtol):
    assert [r["global_step"] for r in a] == [r["global_step"] for r in b], (a, b)
    worst = 0.0
    for x, y in zip(a, b):
        rel = abs(x["running_loss"] - y["running_loss"]) / abs(x["running_loss"])
        print(f"step {x['global_step']}: {x['running_loss']:.9f} vs {y['running_loss']:.9f} (rel {rel:.2e})")
        worst = max(worst, rel)
    assert worst <= rtol, f"losses differ by {worst:.3e} relative, more than {rtol}"
    return worst


# Gradient clipping by the global norm (0.5 is below every step's norm here, so every step clips)
# and a warmup schedule, in one parity check of each multi-rank chapter.
CLIP = ["--max-grad-norm", "0.5", "--lr-schedule", "warmup-cosine", "--warmup-steps", "4", "--lr-decay-steps", "40"]


def compare_grad_norms(a, b, rtol):
    """The grad_norm of every metrics line: the whole model's norm, whatever the layout."""
    for x, y in zip(a, b):
        assert "grad_norm" in x and "grad_norm" in y, (x, y)
        assert x["grad_norm"] > 0.5, f"step {x['global_step']}: grad_norm {x['grad_norm']} did not need clipping"
        rel = abs(x["grad_norm"] - y["grad_norm"]) / x["grad_norm"]
        assert rel <= rtol, f"step {x['global_step']}: grad_norm {x['grad_norm']} vs {y['grad_norm']}"
    print(f"grad_norm equal within {rtol} at {len(a)} steps: {a[0]['grad_norm']:.4f} ... {a[-1]['grad_norm']:.4f}")


def compare_params(a, b, tol):
    """max |a - b| / max(1, max |a|) over all tensors of two sets of weights: model.safetensors
    files or what checkpoint_weights returns."""
    a = a if isinstance(a, dict) else read_safetensors(a)
    b = b if isinstance(b, dict) else read_safetensors(b)
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    worst, where = 0.0, None
    for name in a:
        (shape_a, va), (shape_b, vb) = a[name], b[name]
        assert shape_a == shape_b, (name, shape_a, shape_b)
        scale = max(1.0, max(abs(v) for v in va))
        diff = max(abs(x - y) for x, y in zip(va, vb)) / scale
        if diff > worst:
            worst, where = diff, name
    print(f"parameters: largest difference {worst:.3e} (in {where}) over {len(a)} tensors")
    assert worst <= tol, f"parameters differ by {worst:.3e} in {where}, more than {tol}"
    return worst


def manifest(exp_dir):
    return json.loads((pathlib.Path(exp_dir) / "checkpoint" / "manifest.json").read_text())


def checkpoint_weights(exp_dir, prefix=""):
    """The whole tensors of an experiment's latest checkpoint, assembled from every rank's pieces
    as the manifest places them: name -> (shape, list of floats). Model weights by default;
    prefix "optimizer/" gives AdamW's state."""
    folder = pathlib.Path(exp_dir) / "checkpoint"
    files, out = {}, {}
    for name, record in manifest(exp_dir)["tensors"].items():
        optimizer = name.startswith("optimizer/")
        if (prefix == "optimizer/") != optimizer or not name.startswith(prefix):
            continue
        shape = record["shape"]
        row = shape[1] if len(shape) == 2 else 1
        values = array("f", bytes(4 * max(1, row * (shape[0] if shape else 1))))
        for piece in record["pieces"]:
            part = files.setdefault(piece["file"], None) or read_safetensors(folder / piece["file"])
            files[piece["file"]] = part
            _, data = part[piece["key"]]
            offsets, sizes = piece["offsets"], piece["sizes"]
            if len(shape) == 2:  # rows of a box [r0:r1, c0:c1]
                for i in range(sizes[0]):
                    start = (offsets[0] + i) * row + offsets[1]
                    values[start:start + sizes[1]] = data[i * sizes[1]:(i + 1) * sizes[1]]
            elif len(shape) == 1:
                values[offsets[0]:offsets[0] + sizes[0]] = data
            else:
                values[0:1] = data
        out[name] = (shape, values)
    return out


def model_file(exp_dir):
    """The weights of an experiment's latest checkpoint, whatever layout saved it."""
    return checkpoint_weights(exp_dir)


def weight_elements_per_rank(exp_dir, prefix=""):
    """Elements of the pieces each rank file of the latest checkpoint holds (model weights, or
    the tensors under prefix), by rank."""
    counts = {}
    for name, record in manifest(exp_dir)["tensors"].items():
        if (prefix == "optimizer/") != name.startswith("optimizer/") or not name.startswith(prefix):
            continue
        for piece in record["pieces"]:
            n = 1
            for size in piece["sizes"]:
                n *= size
            counts[piece["rank"]] = counts.get(piece["rank"], 0) + n
    return counts


def parity(tools, single_batch, ddp_args, steps, extra=()):
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--save-dir", tmp, "--max-steps", str(steps), "--ckpt-freq", str(steps), *extra]
        single(tools, "-b", str(single_batch), "-e", "one", *flags)
        ddp(tools, 2, *ddp_args, "-e", "two", *flags)
        compare_losses(metrics(f"{tmp}/one"), metrics(f"{tmp}/two"), 1e-4)
        if extra == CLIP:
            compare_grad_norms(metrics(f"{tmp}/one"), metrics(f"{tmp}/two"), 1e-4)
        compare_params(model_file(f"{tmp}/one"), model_file(f"{tmp}/two"), 1e-4)


def ddp_parity(tools):
    # DDP with every decoder layer recomputed in backward against chapter 1 without.
    parity(tools, 4, ["-b", "2", "--activation-checkpointing", "full"], 30)


def grad_accum_parity(tools):
    # With clipping (after the last micro-batch) and a warmup schedule.
    parity(tools, 8, ["-b", "2", "--grad-accum", "2"], 30, CLIP)


def zero_parity(tools):
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["-b", "2", "--save-dir", tmp, "--max-steps", "20", "--ckpt-freq", "20"]
        ddp(tools, 2, *flags, "-e", "zero", "--zero")
        ddp(tools, 2, *flags, "-e", "plain", "--no-zero")
        compare_losses(metrics(f"{tmp}/plain"), metrics(f"{tmp}/zero"), 1e-6)
        compare_params(model_file(f"{tmp}/plain"), model_file(f"{tmp}/zero"), 1e-5)
        compare_params(checkpoint_weights(f"{tmp}/plain", "optimizer/"),
                       checkpoint_weights(f"{tmp}/zero", "optimizer/"), 1e-5)
        # Optimizer state: the replicated run's is all saved by rank 0 (the replicas are equal),
        # each ZeRO rank saves the ~1/2 it holds.
        plain = weight_elements_per_rank(f"{tmp}/plain", "optimizer/")
        shards = weight_elements_per_rank(f"{tmp}/zero", "optimizer/")
        full = sum(plain.values())
        print(f"optimizer state elements saved per rank: replicated {plain}, ZeRO {shards}")
        assert list(plain) == [0], plain
        assert sum(shards.values()) == full, (shards, full)
        for shard in shards.values():
            assert abs(shard / full - 0.5) <= 0.05, f"shard {shard} of {full} is not ~1/2"


def resume(tools):
    with tempfile.TemporaryDirectory() as tmp:
        check_stop_and_resume(lambda *args: ddp(tools, 2, *args), tmp,
                              ["-b", "2", "--save-dir", tmp, "--ckpt-freq", "10"])
        compare_params(model_file(f"{tmp}/straight"), model_file(f"{tmp}/stopped"), 1e-6)
        # The ZeRO checkpoint of 2 ranks resumes on 1 with the same global batch: one rank now
        # holds the whole optimizer state, filled from both ranks' pieces, and trains on as the
        # 2-rank run does (the data order is the same; only reduction order differs).
        ddp(tools, 2, "-b", "2", "--save-dir", tmp, "--ckpt-freq", "10", "-e", "straight", "--max-steps", "25")
        one = ddp(tools, 1, "-b", "4", "--save-dir", tmp, "--ckpt-freq", "10", "-e", "stopped", "--max-steps", "25")
        assert "resharded" in one.stdout and "from 2 ranks" in one.stdout, one.stdout
        compare_losses(metrics(f"{tmp}/straight"), metrics(f"{tmp}/stopped"), 1e-5)
        compare_params(model_file(f"{tmp}/straight"), model_file(f"{tmp}/stopped"), 1e-4)


def flag_mismatch(tools):
    """Ranks started with different values of a flag fail at start-up, naming the flag and both values;
    --cpu-batch-split, which only chapter 1 takes up, is refused."""
    cases = [("--ckpt-freq", "10", "20", "ckpt-freq"), ("--lr", "0.001", "0.0003", "lr"),
             ("--bucket-cap-mb", "25", "50", "bucket-cap-mb"), ("--max-steps", "10", "20", "max-steps"),
             ("-e", "left", "right", "experiment-name")]
    with tempfile.TemporaryDirectory() as tmp:
        for flag, rank0_value, rank1_value, name in cases:
            # The same command on both ranks, but for the one flag: rank 1 takes another value.
            program = " ".join([tools["chapter2"], *COMMON, "-b", "2", "--save-dir", tmp])
            script = (f'if [ "$RANK" = 1 ]; then exec {program} {flag} {rank1_value}; '
                      f'else exec {program} {flag} {rank0_value}; fi')
            start = time.monotonic()
            proc = subprocess.run([tools["meshrun"], "--nproc-per-node", "2", "--master-port", str(free_port()), "--",
                                   "bash", "-c", script], capture_output=True, text=True, timeout=120, env=ENV)
            seconds = time.monotonic() - start
            text = proc.stdout + proc.stderr
            print(f"{flag} {rank0_value} / {rank1_value}: exit {proc.returncode} after {seconds:.1f} s")
            assert proc.returncode != 0, text
            assert f"rank 1 was started with '{name}=" in text and f"but rank 0 with '{name}=" in text, text
            assert rank1_value in text and rank0_value in text, text
            assert seconds < 10, f"{flag}: the mismatch took {seconds:.1f} s to stop the run"
        # A flag only chapter 1 takes up is refused at start-up, not ignored.
        proc = subprocess.run([tools["meshrun"], "--nproc-per-node", "2", "--master-port", str(free_port()), "--",
                               tools["chapter2"], *COMMON, "-b", "2", "--save-dir", tmp, "--cpu-batch-split", "2"],
                              capture_output=True, text=True, timeout=120, env=ENV)
        assert proc.returncode != 0 and "--cpu-batch-split 2: only chapter 1's model" in proc.stdout + proc.stderr, \
            proc.stdout + proc.stderr


def two_nodes(tools):
    """Two meshruns on loopback, as two nodes of one job, against one meshrun with two ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["-b", "2", "--save-dir", tmp, "--max-steps", "20", "--ckpt-freq", "20"]
        ddp(tools, 2, *flags, "-e", "one-node")
        port = free_port()
        nodes = [subprocess.Popen([tools["meshrun"], "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node",
                                   "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-timeout",
                                   "60", "--", tools["chapter2"], *COMMON, *flags, "-e", "two-nodes"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
                 for rank in range(2)]
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
        for rank, (node, output) in enumerate(zip(nodes, outputs)):
            assert node.returncode == 0, f"node {rank} failed ({node.returncode}):\n{output}"
        assert "rank 1 of 2" in outputs[1], outputs[1]
        compare_losses(metrics(f"{tmp}/one-node"), metrics(f"{tmp}/two-nodes"), 1e-6)
        compare_params(model_file(f"{tmp}/one-node"), model_file(f"{tmp}/two-nodes"), 1e-6)


def token_cache(tools):
    """-d a text file on 2 ranks: rank 0 tokenises it once into its token cache and both ranks map
    it; a second start reuses it; two nodes whose cache folders differ (MESHTORCH_DATA_CACHE on
    node-local disk) each write their own, and every run logs the same losses."""
    with tempfile.TemporaryDirectory() as tmp:
        data = pathlib.Path(tmp) / "corpus.txt"
        data.write_text("\n\n".join(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (1 + i % 5)
                                    for i in range(200)) + "\n")
        flags = ["-d", str(data), "-b", "2", "--save-dir", tmp, "--max-steps", "10", "--ckpt-freq", "1000"]
        first = ddp(tools, 2, *flags, "-e", "first")
        assert "(written now)" in first.stdout, first.stdout
        caches = list((data.parent / ".meshtorch-cache").glob("tokens-*.ids"))
        assert len(caches) == 1, caches
        written = caches[0].stat().st_mtime_ns
        second = ddp(tools, 2, *flags, "-e", "second")
        assert "(reused)" in second.stdout, second.stdout
        assert caches[0].stat().st_mtime_ns == written, "the second start rewrote the cache"
        compare_losses(metrics(f"{tmp}/first"), metrics(f"{tmp}/second"), 1e-9)
        port = free_port()
        nodes = [subprocess.Popen([tools["meshrun"], "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node",
                                   "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-timeout",
                                   "60", "--", tools["chapter2"], *COMMON, *flags, "-e", "two-nodes"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=dict(ENV, MESHTORCH_DATA_CACHE=f"{tmp}/node{rank}-cache"))
                 for rank in range(2)]
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
        for rank, (node, output) in enumerate(zip(nodes, outputs)):
            assert node.returncode == 0, f"node {rank} failed ({node.returncode}):\n{output}"
            assert len(list(pathlib.Path(f"{tmp}/node{rank}-cache").glob("tokens-*.ids"))) == 1, \
                f"node {rank} wrote no cache of its own:\n{output}"
        compare_losses(metrics(f"{tmp}/first"), metrics(f"{tmp}/two-nodes"), 1e-6)

        # A malformed line, met by rank 0 while it writes the cache: every rank stops at once with
        # rank 0's message (file and line), none waits for a cache that will never come.
        bad = pathlib.Path(tmp) / "bad.jsonl"
        bad.write_text('{"text": "fine"}\n{"text": 3}\n')
        started = time.monotonic()
        proc = ddp(tools, 2, *flags, "-d", str(bad), "-e", "bad", expect_ok=False)
        seconds = time.monotonic() - started
        assert proc.returncode != 0, proc.stdout
        text = proc.stdout + proc.stderr
        assert f"rank 0: {bad}:2: field 'text' must be a string" in text, text
        assert seconds < 30, f"the failed start took {seconds:.1f} s"
        assert not (pathlib.Path(tmp) / ".meshtorch-cache").exists() or \
            not list((pathlib.Path(tmp) / ".meshtorch-cache").glob("tokens-*.ids.tmp*")), "a partial cache was left"
        print(f"a malformed line stopped both ranks in {seconds:.1f} s, naming rank 0 and {bad.name}:2")


VENV_PYTHON = pathlib.Path(__file__).resolve().parents[2] / "bench" / ".venv" / "bin" / "python"
# Metrics every rank computes alike (the global batch's loss, the schedule, the data position).
GLOBAL_METRICS = ["running_loss", "lr", "epoch", "epoch_progress", "num_batches_remaining"]


def as_float32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def read_run(run_dir):
    out = subprocess.run([str(VENV_PYTHON), str(pathlib.Path(__file__).with_name("read_tensorboard.py")),
                          str(run_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"reading {run_dir} failed:\n{out.stderr}"
    return json.loads(out.stdout)


def check_run(run, records, keys, where):
    """`run` (read_tensorboard.py's JSON) holds, for each of `keys`, the records' values at their steps."""
    steps = [r["global_step"] for r in records]
    assert run["file_versions"] and all(v == "brain.Event:2" for v in run["file_versions"]), (where, run)
    for key in keys:
        got = run["scalars"].get(key)
        assert got, f"{where}: no scalar '{key}' (has {sorted(run['scalars'])})"
        assert [step for step, _ in got] == steps, (where, key, got, steps)
        for (step, value), record in zip(got, records):
            assert value == as_float32(record[key]), f"{where}: {key} at step {step} is {value}, metrics.jsonl {record[key]}"


def tensorboard(tools):
    """--tensorboard in each --tracking-ranks mode on 2 ranks: the tensorboard package's reader
    finds, in every run folder the mode makes, each metric of metrics.jsonl at its steps (rank 0's
    run: every value equal as float32; the others: the global ones), the flags as text, and a
    session start where a run resumed."""
    probe = subprocess.run([str(VENV_PYTHON), "-c", "import tensorboard"], capture_output=True) \
        if VENV_PYTHON.exists() else None
    if probe is None or probe.returncode != 0:
        print(f"skipped: {VENV_PYTHON} with the tensorboard package is needed (bench/setup-python)")
        sys.exit(77)
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["-b", "2", "--save-dir", tmp, "--max-steps", "10", "--log-freq", "5", "--tensorboard"]
        ddp(tools, 2, *flags, "-e", "rank0", "--tracking-ranks", "rank0")
        ddp(tools, 2, *flags, "-e", "all", "--tracking-ranks", "all")
        port = free_port()
        nodes = [subprocess.Popen([tools["meshrun"], "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node",
                                   "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-timeout",
                                   "60", "--", tools["chapter2"], *COMMON, *flags, "-e", "node", "--tracking-ranks",
                                   "node"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
                 for rank in range(2)]
        for rank, node in enumerate(nodes):
            output = node.communicate(timeout=300)[0]
            assert node.returncode == 0, f"node {rank} failed ({node.returncode}):\n{output}"

        expected_runs = {"rank0": ["."], "all": ["rank-0", "rank-1"], "node": ["node-0", "node-1"]}
        for mode, runs in expected_runs.items():
            root = pathlib.Path(tmp) / mode / "tensorboard"
            subfolders = sorted(p.name for p in root.iterdir() if p.is_dir())
            assert subfolders == ([] if runs == ["."] else runs), (mode, subfolders)
            records = metrics(pathlib.Path(tmp) / mode)
            every_key = [k for k, v in records[0].items()
                         if k != "global_step" and isinstance(v, (int, float)) and not isinstance(v, bool)]
            for index, name in enumerate(runs):
                run = read_run(root / name)
                check_run(run, records, every_key if index == 0 else GLOBAL_METRICS, f"{mode}/{name}")
                assert f'tracking-ranks="{mode}"' in run["texts"].get("flags", ""), run["texts"]
            print(f"{mode}: {len(runs)} run(s), {len(every_key)} metrics at steps "
                  f"{[r['global_step'] for r in records]} equal to metrics.jsonl")

        # A resumed run marks its restart, so that TensorBoard drops what came after the checkpoint.
        ddp(tools, 2, *flags, "--max-steps", "20", "-e", "rank0", "--tracking-ranks", "rank0")
        run = read_run(pathlib.Path(tmp) / "rank0" / "tensorboard")
        assert run["files"] == 2 and run["session_starts"] == [[10, 1]], run
        check_run(run, metrics(pathlib.Path(tmp) / "rank0"), GLOBAL_METRICS, "rank0 resumed")

        # --eval-freq's lines reach TensorBoard as scalars of their own, at their steps.
        ddp(tools, 2, *flags, "-e", "eval", "--tracking-ranks", "rank0", "--eval-split", "0.002", "--eval-freq", "5")
        evaluations = [r for r in metrics(pathlib.Path(tmp) / "eval") if "eval_loss" in r]
        assert [r["global_step"] for r in evaluations] == [5, 10], evaluations
        check_run(read_run(pathlib.Path(tmp) / "eval" / "tensorboard"), evaluations,
                  ["eval_loss", "eval_perplexity", "eval_tokens"], "eval")


def elastic(tools):
    """An elastic job of 1 to 2 nodes loses a node: node 0 restarts alone, resumes from the 2-rank
    checkpoint resharded onto 1 rank, and with --global-batch-size keeps the batch and data order
    (2 micro-batches instead of 2 ranks), so it logs the losses of a straight 2-rank run."""
    with tempfile.TemporaryDirectory() as tmp:
        exp_dir = pathlib.Path(tmp) / "elastic"
        flags = ["-b", "2", "--global-batch-size", "4", "--save-dir", tmp, "--max-steps", "100", "--ckpt-freq", "10"]
        ddp(tools, 2, *flags, "-e", "straight")
        node = [tools["meshrun"], "--nnodes", "1:2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), "--rdzv-timeout", "60", "--rdzv-last-call", "1",
                "--max-restarts", "1", "--", tools["chapter2"], *COMMON, *flags, "-e", "elastic"]
        first = subprocess.Popen(node, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
        time.sleep(0.3)  # the first meshrun becomes node 0
        second = subprocess.Popen(node, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
        deadline = time.monotonic() + 120
        while not (exp_dir / "checkpoint").exists():
            assert time.monotonic() < deadline and first.poll() is None, "no checkpoint appeared"
            time.sleep(0.05)
        second.kill()  # the node is gone: its meshrun, and with it its rank
        lost_output = second.communicate(timeout=60)[0]
        output = first.communicate(timeout=300)[0]
        assert first.returncode == 0, f"node 0 failed ({first.returncode}):\n{output}\nnode 1:\n{lost_output}"
        assert "attempt 0 runs on 2 node(s)" in output and "attempt 1 runs on 1 node(s)" in output, output
        assert "resharded" in output and "from 2 ranks" in output, output
        resumed_at = int(output.split("resumed from")[1].split("at global_step ")[1].split()[0])
        print(f"node 1 lost; node 0 resumed alone at global_step {resumed_at}")
        assert resumed_at < 100, output
        # The same micro-batches of 2 either way, and halving is exact: equal up to summation order.
        compare_losses(metrics(f"{tmp}/straight"), metrics(exp_dir), 1e-6)
        compare_params(model_file(f"{tmp}/straight"), model_file(exp_dir), 1e-6)


if __name__ == "__main__":
    tools = {"meshrun": sys.argv[1], "chapter1": sys.argv[2], "chapter2": sys.argv[3]}
    {"ddp-parity": ddp_parity, "grad-accum-parity": grad_accum_parity, "zero-parity": zero_parity,
     "resume": resume, "two-nodes": two_nodes, "flag-mismatch": flag_mismatch,
     "elastic": elastic, "token-cache": token_cache, "tensorboard": tensorboard}[sys.argv[4]](tools)
    print("ok")
