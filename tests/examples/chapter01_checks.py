#!/usr/bin/env python3
"""End-to-end checks of examples/01-single-gpu, run by CTest.

usage: chapter01_checks.py BINARY CONSOLIDATE {loss-falls|resume|run-ends|deterministic|bad-input|folder-tokenizer|
                                               schedules|activation-checkpointing|profile|fused|batch-split|
                                               sliding-window}

CONSOLIDATE is the meshtorch-consolidate tool, which turns a checkpoint into an HF folder.
"""
import array
import json
import math
import os
import re
import pathlib
import subprocess
import sys
import tempfile

KEYS = ["global_step", "lr", "running_loss", "epoch", "epoch_progress", "num_batches_remaining",
        "tokens_per_s", "time/total", "time/data", "time/forward", "time/backward", "time/update",
        "peak_rss_gb"]


def run(binary, *args, expect_ok=True):
    proc = subprocess.run([binary, "--threads", "1", "--dtype", "float32", *args],
                          capture_output=True, text=True, timeout=600)
    if expect_ok and proc.returncode != 0:
        sys.exit(f"{binary} {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def metrics(save_dir, name):
    lines = (pathlib.Path(save_dir) / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def loss_falls(binary):
    with tempfile.TemporaryDirectory() as tmp:
        run(binary, "-m", "llama-tiny", "-d", "builtin", "-e", "falls", "--save-dir", tmp,
            "--max-steps", "60", "--log-freq", "10", "--ckpt-freq", "1000")
        records = metrics(tmp, "falls")
        assert [r["global_step"] for r in records] == [10, 20, 30, 40, 50, 60], records
        for key in KEYS:
            assert all(key in r for r in records), f"metrics.jsonl lacks '{key}'"
        first, last = records[0]["running_loss"], records[-1]["running_loss"]
        print(f"running_loss {first:.4f} at step 10 -> {last:.4f} at step 60")
        assert last <= 0.7 * first, f"loss fell only from {first} to {last}"


def resume(binary, consolidate):
    common = ["-m", "llama-tiny", "-d", "builtin", "--log-freq", "5", "--ckpt-freq", "10", "-b", "4", "-s", "128"]
    with tempfile.TemporaryDirectory() as tmp:
        run(binary, *common, "-e", "straight", "--save-dir", tmp, "--max-steps", "20")
        run(binary, *common, "-e", "stopped", "--save-dir", tmp, "--max-steps", "10")
        second = run(binary, *common, "-e", "stopped", "--save-dir", tmp, "--max-steps", "20")
        assert "resumed from" in second.stdout and "global_step 10" in second.stdout, second.stdout
        straight, resumed = metrics(tmp, "straight"), metrics(tmp, "stopped")
        assert [r["global_step"] for r in resumed] == [5, 10, 15, 20], resumed
        for a, b in zip(straight, resumed):
            print(f"step {a['global_step']}: straight {a['running_loss']:.9f} resumed {b['running_loss']:.9f}")
            assert abs(a["running_loss"] - b["running_loss"]) <= 1e-6, (a, b)
            assert a["lr"] == b["lr"], (a, b)
        # The checkpoint is the sharded format (one rank here), with its manifest and state.
        ckpt = pathlib.Path(tmp) / "stopped" / "checkpoint"
        for name in ["config.json", "manifest.json", "rank0.safetensors", "state.json"]:
            assert (ckpt / name).exists(), name
        state = json.loads((ckpt / "state.json").read_text())
        assert state["global_step"] == 20, state
        # Consolidated, it is an HF folder that chapter 1 starts from: its first loss is the
        # loss the saved weights give, below the untrained model's.
        subprocess.run([consolidate, str(ckpt), f"{tmp}/hf"], check=True, capture_output=True, text=True)
        assert sorted(p.name for p in pathlib.Path(f"{tmp}/hf").iterdir()) == ["config.json", "model.safetensors"]
        again = run(binary, *common_except(common, ["-m"]), "-m", f"{tmp}/hf", "-e", "from-hf", "--save-dir", tmp,
                    "--max-steps", "10")
        fresh = run(binary, *common, "-e", "fresh", "--save-dir", tmp, "--max-steps", "10")
        trained_loss = metrics(tmp, "from-hf")[0]["running_loss"]
        untrained_loss = metrics(tmp, "fresh")[0]["running_loss"]
        print(f"first 10 steps from the consolidated folder {trained_loss:.4f}, from scratch {untrained_loss:.4f}")
        assert trained_loss < 0.9 * untrained_loss, (trained_loss, untrained_loss)
        # Resuming with flags that change the data order is refused, naming the flag.
        bad = run(binary, *common[:-4], "-b", "2", "-s", "128", "-e", "stopped", "--save-dir", tmp,
                  "--max-steps", "60", expect_ok=False)
        assert bad.returncode != 0 and "global_batch" in bad.stderr, bad.stderr


def state_of(folder):
    return json.loads((pathlib.Path(folder) / "checkpoint" / "state.json").read_text())


def run_ends(binary):
    """Where a run starts and how it ends: a final checkpoint, --resume-from, --no-resume, and
    metrics or a log that cannot be written."""
    common = ["-m", "llama-tiny", "-d", "builtin", "--log-freq", "10", "--ckpt-freq", "20", "-b", "4", "-s", "128"]
    with tempfile.TemporaryDirectory() as tmp:
        # A run with -e ends with its final state saved, whatever --ckpt-freq (it used to save
        # nothing after its last multiple of --ckpt-freq).
        run(binary, *common, "-e", "straight", "--save-dir", tmp, "--max-steps", "10")
        run(binary, *common, "-e", "final", "--save-dir", tmp, "--max-steps", "7")
        assert state_of(f"{tmp}/final")["global_step"] == 7, state_of(f"{tmp}/final")
        # --resume-from starts another experiment from that checkpoint, exactly: its step-10
        # window (steps 1-10, half of them before the checkpoint) is the straight run's.
        branch = run(binary, *common, "-e", "branch", "--save-dir", tmp, "--max-steps", "10",
                     "--resume-from", f"{tmp}/final/checkpoint")
        assert "global_step 7" in branch.stdout, branch.stdout
        (a,), (b,) = metrics(tmp, "straight"), metrics(tmp, "branch")
        print(f"step 10: straight {a['running_loss']:.9f}, resumed from step 7 {b['running_loss']:.9f}")
        assert abs(a["running_loss"] - b["running_loss"]) <= 1e-6, (a, b)
        assert state_of(f"{tmp}/branch")["global_step"] == 10 and state_of(f"{tmp}/final")["global_step"] == 7
        # An experiment folder names its latest checkpoint; a folder without one is an error.
        again = run(binary, *common, "-e", "again", "--save-dir", tmp, "--max-steps", "10",
                    "--resume-from", f"{tmp}/branch")
        assert "global_step 10" in again.stdout, again.stdout
        (pathlib.Path(tmp) / "empty").mkdir()
        missing = run(binary, *common, "--max-steps", "10", "--resume-from", f"{tmp}/empty", expect_ok=False)
        assert missing.returncode != 0 and "no checkpoint there" in missing.stderr, missing.stderr
        print(f"--resume-from an empty folder -> {missing.stderr.strip().splitlines()[-1]}")
        # --no-resume starts at step 0 and says which checkpoint its first save replaces.
        fresh = run(binary, *common, "-e", "final", "--save-dir", tmp, "--max-steps", "3", "--no-resume")
        assert "--no-resume: starting at step 0" in fresh.stdout, fresh.stdout
        assert state_of(f"{tmp}/final")["global_step"] == 3, state_of(f"{tmp}/final")
        # A run that restarts at an earlier step than the folder's metrics reach sets the later lines
        # aside (they used to stay, so that each of those steps appeared twice).
        again_straight = run(binary, *common, "-e", "straight", "--save-dir", tmp, "--max-steps", "3", "--no-resume")
        assert "1 line(s) after global_step 0" in again_straight.stdout, again_straight.stdout
        assert metrics(tmp, "straight") == [], metrics(tmp, "straight")
        set_aside = (pathlib.Path(tmp) / "straight" / "metrics.discarded.jsonl").read_text().splitlines()
        assert [json.loads(line)["global_step"] for line in set_aside] == [10], set_aside
        both = run(binary, *common, "--no-resume", "--resume-from", f"{tmp}/branch", expect_ok=False)
        assert both.returncode != 0 and "excludes" in both.stderr, both.stderr
        # Metrics that cannot be written end the run naming the file (they used to be lost silently).
        (pathlib.Path(tmp) / "full").mkdir()
        (pathlib.Path(tmp) / "full" / "metrics.jsonl").symlink_to("/dev/full")
        full = run(binary, *common, "-e", "full", "--save-dir", tmp, "--max-steps", "10", expect_ok=False)
        assert full.returncode != 0 and "metrics.jsonl: writing metrics failed (No space left on device)" in full.stderr, \
            full.stderr
        print(f"metrics on a full disk -> {full.stderr.strip().splitlines()[-1]}")
        # So does a log that cannot be written.
        with open("/dev/full", "w") as stdout:
            proc = subprocess.run([binary, "--threads", "1", "--dtype", "float32", *common, "--max-steps", "10"],
                                  stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=600)
        assert proc.returncode != 0 and "writing the log to stdout failed" in proc.stderr, proc.stderr
        print(f"log on a full disk -> {proc.stderr.strip().splitlines()[-1]}")


def deterministic(binary):
    """--deterministic: two runs give bit-identical losses, and an op that has no deterministic
    kernel would be an error rather than a silent difference."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in ["first", "second"]:
            run(binary, "-m", "llama-tiny", "-d", "builtin", "-b", "4", "-s", "64", "-e", name, "--save-dir", tmp,
                "--max-steps", "20", "--log-freq", "5", "--ckpt-freq", "1000", "--deterministic", "--seed", "3")
        first, second = metrics(tmp, "first"), metrics(tmp, "second")
        assert [r["global_step"] for r in first] == [5, 10, 15, 20], first
        for a, b in zip(first, second):
            print(f"step {a['global_step']}: {a['running_loss']!r} {b['running_loss']!r}")
            assert a["running_loss"] == b["running_loss"], (a, b)


def common_except(common, flags):
    """`common` without the given flags and their values."""
    out, skip = [], False
    for i, arg in enumerate(common):
        if skip:
            skip = False
            continue
        if arg in flags:
            skip = True
            continue
        out.append(arg)
    return out


def folder_tokenizer(binary):
    """A model folder with a tokenizer.json and a chat template trains on a folder of JSONL files
    (texts and conversations) tokenised by it, through the token cache: written on the first start,
    mapped on the next, written again after an edit."""
    fixture = pathlib.Path(__file__).resolve().parent.parent / "data" / "fixtures" / "bpe"
    tokenizer = json.loads((fixture / "tokenizer.json").read_text())
    vocab = max([*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer["added_tokens"])]) + 1
    vocab = (vocab + 63) // 64 * 64  # padded, as real checkpoints pad their vocabularies
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp) / "model"
        folder.mkdir()
        for name in ["tokenizer.json", "tokenizer_config.json"]:
            (folder / name).write_bytes((fixture / name).read_bytes())
        (folder / "chat_template.jinja").write_text(
            "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|eot_id|>{% endfor %}")
        (folder / "config.json").write_text(json.dumps({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 256, "tie_word_embeddings": False, "output_attentions": False}))
        corpus = pathlib.Path(__file__).resolve().parent.parent / "data" / "fixtures" / "corpus.jsonl"
        lines = [json.loads(line) for line in corpus.read_text().splitlines() if line.strip()]
        # A folder data set: -d data --dataset-subset train reads data/train's two JSONL parts in
        # path order; its other file is reported, a blank line counted. Texts, then conversations
        # in the folder's chat template.
        train = pathlib.Path(tmp) / "data" / "train"
        train.mkdir(parents=True)
        records = [json.dumps({"text": text}) + "\n" for text in lines * 4]
        records += [json.dumps({"messages": [{"role": "user", "content": lines[i]},
                                             {"role": "assistant", "content": lines[i + 1]}]}) + "\n"
                    for i in range(0, 40, 2)]
        half = len(records) // 2
        (train / "part-0.jsonl").write_text("".join(records[:half]) + "\n")
        (train / "part-1.jsonl").write_text("".join(records[half:]))
        (train / "NOTES.md").write_text("not data")
        (pathlib.Path(tmp) / "data" / "valid").mkdir()
        data_flags = ["-m", str(folder), "-d", str(pathlib.Path(tmp) / "data"), "--dataset-subset", "train",
                      "-s", "32", "-b", "2", "--save-dir", tmp, "--log-freq", "10", "--ckpt-freq", "1000"]
        out = run(binary, *data_flags, "-e", "folder", "--max-steps", "20")
        assert "data: byte-level BPE" in out.stdout and "byte tokenizer" not in out.stdout, out.stdout
        assert f"chat template {folder / 'chat_template.jinja'}" in out.stdout, out.stdout
        for fact in ["(subset train): 2 file(s) (1 other file(s) not read: NOTES.md)", f"{len(records)} document(s)",
                     "1 field(s) not read, as they do not change the computation: output_attentions",
                     "1 blank line(s) skipped", "(written now)"]:
            assert fact in out.stdout, f"'{fact}' not in:\n{out.stdout}"
        records_run = metrics(tmp, "folder")
        assert [r["global_step"] for r in records_run] == [10, 20], records_run
        print(f"running_loss {records_run[0]['running_loss']:.4f} -> {records_run[1]['running_loss']:.4f} with the "
              f"folder's tokenizer ({vocab} ids)")
        assert records_run[1]["running_loss"] < records_run[0]["running_loss"], records_run
        # The second start maps the cache the first wrote, and trains on the same tokens.
        caches = list((pathlib.Path(tmp) / "data" / "train" / ".meshtorch-cache").glob("tokens-*.ids"))
        assert len(caches) == 1, caches
        again = run(binary, *data_flags, "-e", "again", "--max-steps", "10")
        assert "(reused)" in again.stdout, again.stdout
        assert metrics(tmp, "again")[0]["running_loss"] == records_run[0]["running_loss"]
        # An edited data file is tokenised again, into a cache of its own.
        with open(train / "part-1.jsonl", "a") as f:
            f.write(records[0])
        edited = run(binary, *data_flags, "-e", "edited", "--max-steps", "10")
        assert "(written now)" in edited.stdout and f"{len(records) + 1} document(s)" in edited.stdout, edited.stdout
        assert len(list(caches[0].parent.glob("tokens-*.ids"))) == 2


def bad_input(binary):
    with tempfile.TemporaryDirectory() as tmp:
        cases = [
            (["-m", "no-such-model"], "neither a preset"),
            (["-d", f"{tmp}/missing.txt"], "neither 'builtin', an existing file or folder"),
            (["-d", tmp, "--dataset-subset", "nope"], "has no such subfolder"),
            (["-b", "100000"], "do not fill one global batch"),
            # 4 x 2^62 wrapped to 0, which the sampler divided by (SIGFPE).
            (["-b", "4", "--grad-accum", "4611686018427387904"],
             "the global batch -b/--batch-size 4 x 1 data-parallel rank(s) x --grad-accum 4611686018427387904 "
             "overflows a 64-bit integer"),
            # Evaluation needs blocks held out, and holding out needs blocks left to train on.
            (["--eval-freq", "5"], "--eval-freq requires --eval-split"),
            (["--eval-freq", "5", "--eval-split", "0"], "--eval-freq 5: no blocks are held out to evaluate on"),
            (["--eval-split", "1"], "--eval-split 1: give the fraction of blocks held out, above 0 and below 1"),
            (["-d", f"{tmp}/tiny.txt", "-s", "64", "--eval-split", "0.9"], "has 2 block(s) of 64 tokens, which would "
             "leave none to train on"),
        ]
        (pathlib.Path(tmp) / "tiny.txt").write_text("a few words " * 12)  # 144 bytes: 2 blocks of 64
        config_dir = pathlib.Path(tmp) / "model"
        config_dir.mkdir()
        (config_dir / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 2}')
        cases.append((["-m", str(config_dir)], "'intermediate_size' is missing"))
        # A chat template that calls itself without end (SIGSEGV before), stopped by name.
        fixture = pathlib.Path(__file__).resolve().parent.parent / "data" / "fixtures" / "bpe"
        chat_dir = pathlib.Path(tmp) / "chat-model"
        chat_dir.mkdir()
        (chat_dir / "tokenizer.json").write_bytes((fixture / "tokenizer.json").read_bytes())
        (chat_dir / "config.json").write_text(json.dumps({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 256, "tie_word_embeddings": False}))
        (chat_dir / "chat_template.jinja").write_text("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
        (pathlib.Path(tmp) / "conv.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
        cases.append((["-m", str(chat_dir), "-d", f"{tmp}/conv.jsonl"],
                      f"conv.jsonl:1: the chat template {chat_dir / 'chat_template.jinja'} nests deeper than 256 "
                      "levels"))
        for args, message in cases:
            proc = run(binary, *args, "--max-steps", "1", expect_ok=False)
            assert proc.returncode != 0, args
            assert message in proc.stderr, f"{args}: expected '{message}' in:\n{proc.stderr}"
            print(f"{' '.join(args)} -> {proc.stderr.strip().splitlines()[-1]}")
        # A loss that turns non-finite stops the run at once, with an error, and saves nothing
        # (it used to exit 0 with NaN weights and a checkpoint whose running_loss was null).
        proc = run(binary, "--lr", "nan", "-e", "nan", "--save-dir", tmp, "--max-steps", "5", "--ckpt-freq", "2",
                   expect_ok=False)
        assert proc.returncode != 0 and "the loss of global_step 2 is nan" in proc.stderr, proc.stderr
        assert not list((pathlib.Path(tmp) / "nan").glob("ckpt-*")), list((pathlib.Path(tmp) / "nan").iterdir())
        print(f"--lr nan -> {proc.stderr.strip().splitlines()[-1]}")
        # Finite losses do not make finite weights: with --lr 1e30 steps were saved whose weights
        # were all non-finite, and the good checkpoint before them was deleted. Now the save is
        # refused naming the step, and the last checkpoint saved resumes with finite weights.
        exp = pathlib.Path(tmp) / "huge-lr"
        run(binary, "-e", "huge-lr", "--save-dir", tmp, "--max-steps", "2", "--ckpt-freq", "2")
        proc = run(binary, "--lr", "1e30", "-e", "huge-lr", "--save-dir", tmp, "--max-steps", "10", "--ckpt-freq", "1",
                   expect_ok=False)
        assert proc.returncode != 0 and "non-finite value(s)" in proc.stderr, proc.stderr
        refused = re.search(r"not saving global_step (\d+)", proc.stderr)
        assert refused, proc.stderr
        kept = os.readlink(exp / "checkpoint")
        assert int(kept.split("-")[1]) < int(refused.group(1)), (kept, refused.group(1))
        # Every float it holds is finite, and it loads (a run that stops at its step only resumes).
        data = (exp / kept / "rank0.safetensors").read_bytes()
        header_length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + header_length])
        floats = array.array("f")
        for name, entry in header.items():
            if name != "__metadata__" and entry["dtype"] == "F32":
                begin, end = entry["data_offsets"]
                floats.frombytes(data[8 + header_length + begin:8 + header_length + end])
        assert len(floats) > 0 and all(math.isfinite(x) for x in floats), kept
        run(binary, "-e", "huge-lr", "--save-dir", tmp, "--max-steps", kept.split("-")[1].lstrip("0"))
        print(f"--lr 1e30 -> {refused.group(0)}; {kept} kept: {len(floats)} finite floats, resumes")


def schedules(binary):
    """--lr-schedule warmup-cosine / warmup-decay log DeepSpeed's rates step by step, and
    --max-grad-norm the norm before clipping; settings that cannot work are refused."""
    import math

    def warmup_fraction(step, warmup, kind):
        return math.log(step + 1) / math.log(warmup) if kind == "log" else step / warmup

    def warmup_cosine(step, lr, total, warmup, kind, cos_min=1e-4):  # WarmupCosineLR, held at the end
        if step < warmup:
            return lr * warmup_fraction(step, warmup, kind)
        progress = min(1.0, (step - warmup + 1) / (total - warmup))
        return lr * max(0.0, cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)

    def warmup_decay(step, lr, total, warmup, kind):  # WarmupDecayLR
        if step < warmup:
            return lr * warmup_fraction(step, warmup, kind)
        return lr * max(0.0, (total - step) / max(1.0, total - warmup))

    common = ["-m", "llama-tiny", "-d", "builtin", "-b", "4", "-s", "64", "--log-freq", "1", "--max-steps", "20",
              "--lr", "0.001"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, formula, kind in [("warmup-cosine", warmup_cosine, "linear"), ("warmup-decay", warmup_decay, "log")]:
            run(binary, *common, "-e", name, "--save-dir", tmp, "--lr-schedule", name, "--warmup-steps", "5",
                "--warmup-type", kind, "--lr-decay-steps", "16", "--max-grad-norm", "0.5")
            records = metrics(tmp, name)
            assert [r["global_step"] for r in records] == list(range(1, 21)), records
            for r in records:
                # The line of step g reports the rate of the next update, as the guide's get_last_lr().
                expected = formula(r["global_step"], 1e-3, 16, 5, kind)
                assert abs(r["lr"] - expected) <= 1e-12 + 1e-9 * expected, (name, r["global_step"], r["lr"], expected)
                assert r["grad_norm"] > 0, r
            print(f"{name} ({kind} warmup): lr {[round(r['lr'], 6) for r in records[:7]]} ...; grad_norm "
                  f"{records[0]['grad_norm']:.3f} -> {records[-1]['grad_norm']:.3f}")
        for flags, message in [(["--warmup-steps", "5"], "--lr-schedule cosine has no warmup"),
                               (["--lr-schedule", "warmup-cosine", "--warmup-steps", "20", "--lr-decay-steps", "20"],
                                "20 total steps leave nothing after 20 warmup steps"),
                               (["--lr-schedule", "warmup-decay", "--warmup-steps", "1", "--warmup-type", "log"],
                                "a log warmup needs at least 2 warmup steps")]:
            refused = run(binary, *common, *flags, expect_ok=False)
            assert refused.returncode != 0 and message in refused.stderr, (flags, refused.stderr)


def activation_checkpointing(binary):
    """--activation-checkpointing full / k: the same losses and weights as without (the layers
    run again in backward, on the same inputs), and less memory at a long sequence."""
    common = ["-m", "llama-tiny", "-d", "builtin", "-b", "8", "-s", "512", "--log-freq", "2", "--max-steps", "4",
              "--ckpt-freq", "4"]
    with tempfile.TemporaryDirectory() as tmp:
        peaks = {}
        for mode in ["none", "full", "2"]:
            run(binary, *common, "-e", mode, "--save-dir", tmp, "--activation-checkpointing", mode)
            peaks[mode] = max(r["peak_rss_gb"] for r in metrics(tmp, mode))
        # The loss over chunks of 100 positions (41 chunks of 4096) instead of all logits at once.
        run(binary, *common, "-e", "chunked", "--save-dir", tmp, "--loss-chunk", "100")
        peaks["chunked loss"] = max(r["peak_rss_gb"] for r in metrics(tmp, "chunked"))
        for mode in ["full", "2", "chunked"]:
            for a, b in zip(metrics(tmp, "none"), metrics(tmp, mode)):
                assert abs(a["running_loss"] - b["running_loss"]) <= 1e-6 * abs(a["running_loss"]), (mode, a, b)
        print("peak resident memory (GB): " + ", ".join(f"{mode} {peak:.3f}" for mode, peak in peaks.items()))
        refused = run(binary, *common, "--activation-checkpointing", "some", expect_ok=False)
        assert refused.returncode != 0 and "use none, full" in refused.stderr, refused.stderr


def profile(binary):
    """--profile: the profiler records steps 2 and 3 of 4 and writes a Chrome trace and, per phase
    and op, the calls and times per step, each op in the phase it ran in (backward's ops inside
    "backward": on the CPU autograd runs on the thread that calls backward()); a run that ends
    first writes what it recorded; bad values are refused naming the flag."""
    with tempfile.TemporaryDirectory() as tmp:
        out = run(binary, "-m", "llama-tiny", "-d", "builtin", "-b", "4", "-s", "64", "--max-steps", "4",
                  "--log-freq", "1", "--profile", f"{tmp}/prof", "--profile-from", "2", "--profile-steps", "2")
        assert "profile: recording 2 step(s) from global_step 2" in out.stdout, out.stdout
        ops = json.loads((pathlib.Path(tmp) / "prof" / "ops.json").read_text())
        assert ops["steps"] == 2 and ops["complete"] and ops["first_global_step"] == 2, {
            k: v for k, v in ops.items() if k != "phases"}
        phases = ops["phases"]
        for phase in ["data", "forward", "backward", "update"]:
            assert phase in phases and phases[phase]["time_us"] > 0, (phase, list(phases))
        for phase in ["forward", "backward"]:
            mm = phases[phase]["ops"].get("aten::mm")
            assert mm and mm["calls"] > 0 and mm["self_us"] > 0 and mm["total_us"] >= mm["self_us"], (phase, mm)
            # The ops' self times add up to no more than the phase: nothing is counted twice.
            self_us = sum(op["self_us"] for op in phases[phase]["ops"].values())
            assert self_us <= phases[phase]["time_us"] * 1.001, (phase, self_us, phases[phase]["time_us"])
            print(f"{phase}: {phases[phase]['time_us'] / 1e3:.2f} ms per step, aten::mm {mm['calls']:g} calls "
                  f"{mm['self_us'] / 1e3:.2f} ms")
        # The fused kernels are named in forward as ATen's ops are.
        for kernel in ["meshtorch::add_rms_norm", "meshtorch::swiglu", "meshtorch::rotary"]:
            assert kernel in phases["forward"]["ops"], (kernel, sorted(phases["forward"]["ops"]))
        # Backward's matrix products run in backward, not outside every phase.
        assert "aten::mm" not in phases.get("other", {}).get("ops", {}), phases.get("other")
        assert "_fused_adamw_" in " ".join(phases["update"]["ops"]), phases["update"]["ops"].keys()
        trace = json.loads((pathlib.Path(tmp) / "prof" / "trace.json").read_text())
        names = {event.get("name") for event in trace["traceEvents"]}
        assert {"forward", "backward", "aten::mm"} <= names, sorted(n for n in names if n)[:20]
        assert "profile:   aten::mm" in out.stdout, out.stdout
        # The run ends inside the window: what was recorded is written, and the log says so.
        short = run(binary, "-m", "llama-tiny", "-d", "builtin", "-b", "2", "-s", "32", "--max-steps", "2",
                    "--profile", f"{tmp}/short", "--profile-from", "2", "--profile-steps", "3")
        assert "the run ended before the 3 asked for" in short.stdout, short.stdout
        short_ops = json.loads((pathlib.Path(tmp) / "short" / "ops.json").read_text())
        assert short_ops["steps"] == 1 and not short_ops["complete"], short_ops
        for flags, flag in [(["--profile-steps", "0"], "--profile-steps"), (["--profile-from", "0"], "--profile-from")]:
            refused = run(binary, "--profile", f"{tmp}/bad", *flags, "--max-steps", "1", expect_ok=False)
            assert refused.returncode != 0 and flag in refused.stderr, (flags, refused.stderr)
            print(f"{' '.join(flags)} -> {refused.stderr.strip().splitlines()[0]}")
        assert not (pathlib.Path(tmp) / "bad").exists()


def fused(binary):
    """--fused on (the default) against off: the fused kernels give LibTorch's composite ops'
    losses over 30 steps (fp32: summation order only), in no more memory."""
    common = ["-m", "llama-tiny", "-d", "builtin", "-b", "4", "-s", "128", "--log-freq", "5", "--max-steps", "30",
              "--ckpt-freq", "1000"]
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ["on", "off"]:
            run(binary, *common, "-e", mode, "--save-dir", tmp, "--fused", mode)
        on, off = metrics(tmp, "on"), metrics(tmp, "off")
        assert [r["global_step"] for r in on] == [r["global_step"] for r in off] == [5, 10, 15, 20, 25, 30], on
        for a, b in zip(on, off):
            assert abs(a["running_loss"] - b["running_loss"]) <= 1e-5 * abs(b["running_loss"]), (a, b)
        print("losses (fused, composite): " + ", ".join(f"{a['running_loss']:.5f}/{b['running_loss']:.5f}"
                                                         for a, b in zip(on, off)))
        print(f"peak RSS GB: fused {max(r['peak_rss_gb'] for r in on):.3f}, "
              f"composite {max(r['peak_rss_gb'] for r in off):.3f}")
        refused = run(binary, *common, "--fused", "maybe", expect_ok=False)
        assert refused.returncode != 0 and "--fused" in refused.stderr, refused.stderr


def batch_split(binary):
    """--cpu-batch-split: with 2 threads each batch is split in two by default, each half's forward
    and backward on a thread of its own; the losses are those of one team of 2 threads over the
    whole batch within 1e-5 over 30 steps, bit for bit the same in a second run, and an odd batch
    (3 rows: parts of 2 and 1) is weighted by its rows. Counts that would vary the bits under
    --deterministic, and bad values, are refused naming the flag."""
    common = ["-m", "llama-tiny", "-d", "builtin", "-s", "128", "--log-freq", "5", "--max-steps", "30",
              "--ckpt-freq", "1000", "--threads", "2"]
    announced = "--cpu-batch-split auto: each micro-batch in 2 parts, each on a thread of its own with 1 intra-op"
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"split": ["-b", "4"], "again": ["-b", "4"], "whole": ["-b", "4", "--cpu-batch-split", "off"],
                "odd-split": ["-b", "3"], "odd-whole": ["-b", "3", "--cpu-batch-split", "off"]}
        for name, flags in runs.items():
            out = run(binary, *common, *flags, "-e", name, "--save-dir", tmp)
            assert (announced in out.stdout) == ("off" not in flags), (name, out.stdout[-2000:])
        for split, whole in [("split", "whole"), ("odd-split", "odd-whole")]:
            a_runs, b_runs = metrics(tmp, split), metrics(tmp, whole)
            assert [r["global_step"] for r in a_runs] == [5, 10, 15, 20, 25, 30], a_runs
            for a, b in zip(a_runs, b_runs):
                assert abs(a["running_loss"] - b["running_loss"]) <= 1e-5 * abs(b["running_loss"]), (split, a, b)
            print(f"{split} against {whole}: " + ", ".join(f"{a['running_loss']:.6f}/{b['running_loss']:.6f}"
                                                          for a, b in zip(a_runs, b_runs)))
        for a, b in zip(metrics(tmp, "split"), metrics(tmp, "again")):
            assert a["running_loss"] == b["running_loss"], (a, b)
        # The profile counts each half's ops in the phase it ran in: twice the products a step.
        calls = {}
        for name, flags in [("prof-split", []), ("prof-whole", ["--cpu-batch-split", "off"])]:
            run(binary, *common_except(common, ["--max-steps", "--log-freq"]), "-b", "4", "--max-steps", "3",
                "-e", name, "--save-dir", tmp, "--profile", f"{tmp}/{name}", "--profile-from", "2",
                "--profile-steps", "2", *flags)
            phases = json.loads((pathlib.Path(tmp) / name / "ops.json").read_text())["phases"]
            assert "aten::mm" not in phases.get("other", {}).get("ops", {}), (name, phases.get("other"))
            calls[name] = [phases[phase]["ops"]["aten::mm"]["calls"] for phase in ["forward", "backward"]]
        assert calls["prof-split"] == [2 * c for c in calls["prof-whole"]], calls
        for flags, says in [(["--cpu-batch-split", "3", "--deterministic"], "give at most 2"),
                            (["--cpu-batch-split", "2", "--grad-accum", "2", "--deterministic"], "--grad-accum 2"),
                            (["--cpu-batch-split", "5"], "more parts than a micro-batch's 4 rows"),
                            (["--cpu-batch-split", "zero"], "expected auto, off or a count")]:
            refused = run(binary, *common, "-b", "4", "--max-steps", "1", *flags, expect_ok=False)
            assert refused.returncode != 0 and says in refused.stderr, (flags, refused.stderr)
            print(f"{' '.join(flags)} -> {refused.stderr.strip().splitlines()[-1]}")


def sliding_window(binary):
    """A Mistral config whose sliding_window (32) is shorter than -s is refused before the data is
    read, naming the window and the fix; within the window it trains."""
    mistral = pathlib.Path(__file__).resolve().parent.parent / "hf_parity" / "configs" / "mistral-window-32"
    common = ["-m", str(mistral), "-d", "builtin", "-b", "2", "--max-steps", "2", "--log-freq", "1"]
    refused = run(binary, *common, "-s", "64", expect_ok=False)
    assert refused.returncode != 0, refused.stdout
    assert ("-s/--seq-length 64 is longer than the sliding_window of " in refused.stderr and
            "(32 positions); sliding-window attention is not implemented, so train with -s 32 or less" in refused.stderr), \
        refused.stderr
    assert "global_step" not in refused.stdout + refused.stderr
    trained = run(binary, *common, "-s", "32")
    assert "global_step=2" in trained.stdout + trained.stderr, trained.stdout + trained.stderr
    print(refused.stderr.strip().splitlines()[-1])


if __name__ == "__main__":
    binary, consolidate, check = sys.argv[1:4]
    if check == "resume":
        resume(binary, consolidate)
    else:
        {"folder-tokenizer": folder_tokenizer, "loss-falls": loss_falls, "run-ends": run_ends,
         "deterministic": deterministic, "schedules": schedules,
         "activation-checkpointing": activation_checkpointing,
         "bad-input": bad_input, "profile": profile, "fused": fused, "batch-split": batch_split,
         "sliding-window": sliding_window}[check](binary)
    print("ok")
