#!/usr/bin/env python3
"""End-to-end checks of examples/01-single-gpu, run by CTest.

usage: chapter01_checks.py BINARY CONSOLIDATE {loss-falls|resume|bad-input|folder-tokenizer}

CONSOLIDATE is the meshtorch-consolidate tool, which turns a checkpoint into an HF folder.
"""
import json
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
    common = ["-m", "llama-tiny", "-d", "builtin", "--log-freq", "10", "--ckpt-freq", "20", "-b", "4", "-s", "128"]
    with tempfile.TemporaryDirectory() as tmp:
        run(binary, *common, "-e", "straight", "--save-dir", tmp, "--max-steps", "40")
        run(binary, *common, "-e", "stopped", "--save-dir", tmp, "--max-steps", "20")
        second = run(binary, *common, "-e", "stopped", "--save-dir", tmp, "--max-steps", "40")
        assert "resumed from" in second.stdout and "global_step 20" in second.stdout, second.stdout
        straight, resumed = metrics(tmp, "straight"), metrics(tmp, "stopped")
        assert [r["global_step"] for r in resumed] == [10, 20, 30, 40], resumed
        for a, b in zip(straight, resumed):
            print(f"step {a['global_step']}: straight {a['running_loss']:.9f} resumed {b['running_loss']:.9f}")
            assert abs(a["running_loss"] - b["running_loss"]) <= 1e-6, (a, b)
            assert a["lr"] == b["lr"], (a, b)
        # The checkpoint is the sharded format (one rank here), with its manifest and state.
        ckpt = pathlib.Path(tmp) / "stopped" / "checkpoint"
        for name in ["config.json", "manifest.json", "rank0.safetensors", "state.json"]:
            assert (ckpt / name).exists(), name
        state = json.loads((ckpt / "state.json").read_text())
        assert state["global_step"] == 40, state
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
    """A model folder with a tokenizer.json trains on a JSONL data set tokenised by it."""
    fixture = pathlib.Path(__file__).resolve().parent.parent / "data" / "fixtures" / "bpe"
    tokenizer = json.loads((fixture / "tokenizer.json").read_text())
    vocab = max([*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer["added_tokens"])]) + 1
    vocab = (vocab + 63) // 64 * 64  # padded, as real checkpoints pad their vocabularies
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp) / "model"
        folder.mkdir()
        for name in ["tokenizer.json", "tokenizer_config.json"]:
            (folder / name).write_bytes((fixture / name).read_bytes())
        (folder / "config.json").write_text(json.dumps({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 256, "tie_word_embeddings": False}))
        corpus = pathlib.Path(__file__).resolve().parent.parent / "data" / "fixtures" / "corpus.jsonl"
        lines = [json.loads(line) for line in corpus.read_text().splitlines() if line.strip()]
        data = pathlib.Path(tmp) / "data.jsonl"
        data.write_text("".join(json.dumps({"text": text}) + "\n" for text in lines * 4))
        out = run(binary, "-m", str(folder), "-d", str(data), "-s", "32", "-b", "2", "-e", "folder",
                  "--save-dir", tmp, "--max-steps", "20", "--log-freq", "10", "--ckpt-freq", "1000")
        assert "tokenizer: " in out.stdout and "byte tokenizer" not in out.stdout, out.stdout
        records = metrics(tmp, "folder")
        assert [r["global_step"] for r in records] == [10, 20], records
        print(f"running_loss {records[0]['running_loss']:.4f} -> {records[1]['running_loss']:.4f} with the "
              f"folder's tokenizer ({vocab} ids)")
        assert records[1]["running_loss"] < records[0]["running_loss"], records


def bad_input(binary):
    with tempfile.TemporaryDirectory() as tmp:
        cases = [
            (["-m", "no-such-model"], "neither a preset"),
            (["-d", f"{tmp}/missing.txt"], "neither 'builtin' nor an existing file"),
            (["-b", "100000"], "do not fill one global batch"),
        ]
        config_dir = pathlib.Path(tmp) / "model"
        config_dir.mkdir()
        (config_dir / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 2}')
        cases.append((["-m", str(config_dir)], "'intermediate_size' is missing"))
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


if __name__ == "__main__":
    binary, consolidate, check = sys.argv[1:4]
    if check == "resume":
        resume(binary, consolidate)
    else:
        {"folder-tokenizer": folder_tokenizer, "loss-falls": loss_falls, "bad-input": bad_input}[check](binary)
    print("ok")
