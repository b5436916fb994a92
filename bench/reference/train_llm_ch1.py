"""Chapter 1 of the distributed training guide (single device), as the Python reference for bench/.

This is the guide's train_llm.py for chapter 1, changed only where it has to be to run on a CPU
without network access and to be measured against build/bin/01-single-gpu:
- the model config is a local folder holding config.json (-m DIR), never the hub;
- the data is a local text file tokenised like our binary does it: documents separated by blank
  lines, each encoded as <bos>=256, its bytes (byte b -> token b), <eos>=257, then concatenated
  and packed into --seq-length blocks like the guide's group_texts;
- device is the CPU; --dtype picks float32 or bfloat16 (the guide hard-codes bfloat16 on CUDA);
- --threads sets torch.set_num_threads; --compile turns torch.compile on (the guide compiles);
- --max-steps stops early; --warmup-steps are left out of the summary;
- no checkpointing and no wandb: this script only measures;
- --profile DIR records --profile-steps steps from the --profile-from'th with torch.profiler (CPU),
  each phase a record_function("data"/"forward"/"backward"/"update"), and writes DIR/trace.json and
  DIR/ops.json in the shape our --profile writes (include/meshtorch/train/profiler.hpp): per phase,
  per op name, per step, calls and self and total time, an op's self time being its time less that
  of the ops nested in it on its thread (torch.profiler's self_cpu_time_total).
Every --log-freq steps it logs the guide's info dict (and appends it to
<save-dir>/<experiment-name>/metrics.jsonl when -e is given), measured as our binary measures it:
tokens/s and time/total from the wall clock since the last log line (the guide sums its phase
timers, which leaves out loss.item() and the loop's own overhead), peak_rss_gb from the process's
VmHWM, reset after each log line and before the first step. At the end it prints ONE JSON line on
stdout: medians over the log lines after --warmup-steps, and the highest peak RSS.
"""

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoModelForCausalLM

from metrics_summary import summarize

LOGGER = logging.getLogger(__name__)


def main():
    parser = _get_parser()
    args = parser.parse_args()

    logging.basicConfig(
        format="[%(asctime)s] %(levelname)s:%(message)s",
        level=logging.INFO,
        stream=sys.stderr,
    )
    LOGGER.info(args)

    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    torch.manual_seed(args.seed)

    config = AutoConfig.from_pretrained(args.model_name, use_cache=False)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    num_params = sum(p.numel() for p in model.parameters())
    LOGGER.info(f"{num_params} model parameters")
    if args.compile:
        model = torch.compile(model)

    train_data = _load_and_preprocess_data(args, config)
    LOGGER.info(f"{len(train_data)} training samples")

    dataloader = DataLoader(
        train_data,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.num_workers,
        prefetch_factor=2 if args.num_workers > 0 else None,
        generator=torch.Generator().manual_seed(args.seed),
    )
    LOGGER.info(f"{len(dataloader)} batches per epoch")
    if len(dataloader) == 0:
        parser.error(f"{args.dataset_name} holds fewer than one batch of {args.batch_size} x {args.seq_length} tokens")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000, eta_min=args.lr * 1e-2)

    metrics_path = None
    if args.experiment_name:
        exp_dir = Path(args.save_dir) / args.experiment_name
        exp_dir.mkdir(parents=True, exist_ok=True)
        metrics_path = exp_dir / "metrics.jsonl"
        metrics_path.unlink(missing_ok=True)

    state = {"epoch": 0, "global_step": 0, "epoch_step": 0, "running_loss": 0, "running_steps": 0}
    timers = {k: LocalTimer(device) for k in ["data", "forward", "backward", "update"]}
    profiler = StepProfiler(args)
    records = []
    done = False
    reset_peak_rss()
    last_log = time.perf_counter()

    for state["epoch"] in range(state["epoch"], args.num_epochs):
        batches = iter(dataloader)
        for i_step in range(len(dataloader)):
            profiler.begin_step(state["global_step"] + 1)
            with timers["data"], profiler.phase("data"), torch.no_grad():
                batch = next(batches)
                batch = {k: v.to(device=device) for k, v in batch.items()}

            with timers["forward"], profiler.phase("forward"):
                outputs = model(**batch)

            with timers["backward"], profiler.phase("backward"):
                outputs.loss.backward()

            with timers["update"], profiler.phase("update"):
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)

            state["global_step"] += 1
            state["epoch_step"] += 1
            state["running_loss"] += outputs.loss.item()
            state["running_steps"] += 1

            if state["global_step"] % args.log_freq == 0:
                tok_per_step = args.batch_size * args.seq_length
                seconds = time.perf_counter() - last_log
                steps = state["running_steps"]
                info = {
                    "global_step": state["global_step"],
                    "lr": lr_scheduler.get_last_lr()[0],
                    "running_loss": state["running_loss"] / steps,
                    "epoch": state["epoch"],
                    "epoch_progress": state["epoch_step"] / len(dataloader),
                    "num_batches_remaining": len(dataloader) - state["epoch_step"],
                    "tokens_per_s": tok_per_step * steps / seconds,
                    "time/total": 1000 * seconds / steps,
                    **{f"time/{k}": timer.avg_elapsed_ms() for k, timer in timers.items()},
                    "peak_rss_gb": peak_rss_gb(),
                }
                LOGGER.info(info)
                records.append(info)
                if metrics_path is not None:
                    with open(metrics_path, "a") as fp:
                        fp.write(json.dumps(info) + "\n")
                state["running_loss"] = 0
                state["running_steps"] = 0
                for t in timers.values():
                    t.reset()
                reset_peak_rss()
                last_log = time.perf_counter()

            profiler.end_step()
            if args.max_steps and state["global_step"] >= args.max_steps:
                done = True
                break
        state["epoch_step"] = 0
        if done:
            break
    profiler.end_run()

    summary = summarize(records, args.warmup_steps)
    summary.update(
        impl="hf-compile" if args.compile else "hf-eager",
        model=str(args.model_name),
        dtype=args.dtype,
        threads=args.threads,
        batch_size=args.batch_size,
        seq_length=args.seq_length,
        num_params=num_params,
        torch=torch.__version__,
    )
    print(json.dumps(summary), flush=True)


class StepProfiler:
    """--profile: torch.profiler over --profile-steps steps from the run's --profile-from'th, written
    as our binary's --profile writes them (DIR/trace.json, DIR/ops.json)."""

    PHASES = ("data", "forward", "backward", "update")
    OUTSIDE = "other"  # the phase of ops that ran outside every phase

    def __init__(self, args):
        self.dir, self.first, self.steps = args.profile, args.profile_from, args.profile_steps
        self.prof, self.profiled, self.first_global_step = None, 0, 0

    def phase(self, name):
        # Only while recording: record_function is an op call even with the profiler off.
        return torch.profiler.record_function(name) if self.prof is not None else contextlib.nullcontext()

    def begin_step(self, global_step):
        if self.dir and global_step == self.first:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.start()
            self.first_global_step = global_step
            LOGGER.info(f"profile: recording {self.steps} step(s) from global_step {global_step} into {self.dir}")

    def end_step(self):
        if self.prof is not None:
            self.profiled += 1
            if self.profiled == self.steps:
                self._stop(complete=True)

    def end_run(self):
        if self.prof is not None:
            self._stop(complete=False)

    def _stop(self, complete):
        prof, self.prof = self.prof, None
        prof.stop()
        steps = max(self.profiled, 1)
        phases = {}
        for event in prof.events():  # cpu_children and cpu_parent nest intervals per thread
            if event.is_async or event.device_type != torch.autograd.DeviceType.CPU:
                continue
            parent = event.cpu_parent
            while parent is not None and parent.name not in self.PHASES:
                parent = parent.cpu_parent
            if event.name in self.PHASES:
                phase = phases.setdefault(event.name, {"time_us": 0.0, "ops": {}})
                phase["time_us"] += event.cpu_time_total / steps
                continue
            phase = phases.setdefault(parent.name if parent is not None else self.OUTSIDE, {"time_us": 0.0, "ops": {}})
            if event.cpu_parent is None:  # outside every phase: its time is the phase "other"'s
                phase["time_us"] += event.cpu_time_total / steps
            op = phase["ops"].setdefault(event.name, {"calls": 0.0, "self_us": 0.0, "total_us": 0.0})
            op["calls"] += 1 / steps
            op["self_us"] += event.self_cpu_time_total / steps
            op["total_us"] += event.cpu_time_total / steps
        out = Path(self.dir)
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / "trace.json"))
        (out / "ops.json").write_text(json.dumps({
            "stack": "transformers", "rank": 0, "first_step": self.first, "first_global_step": self.first_global_step,
            "steps": self.profiled, "complete": complete, "per": "step; times in microseconds",
            "phases": {name: {"time_us": p["time_us"], "ops": dict(sorted(p["ops"].items()))}
                       for name, p in sorted(phases.items())}}, indent=1) + "\n")
        ended = "" if complete else f" (the run ended before the {self.steps} asked for)"
        LOGGER.info(f"profile: {self.profiled} step(s) from global_step {self.first_global_step}{ended}: "
                    f"{out / 'trace.json'} and {out / 'ops.json'}")


BOS, EOS = 256, 257


def encode_text_file(path):
    """Documents are separated by blank lines; each becomes <bos> bytes <eos> (lines inside a
    document joined by a newline), all concatenated: our binary's byte-level tokenisation."""
    with open(path, "rb") as fp:
        lines = fp.read().split(b"\n")
    pieces, current = [], []
    for line in lines:
        if line:
            current.append(line)
        elif current:
            pieces.append(b"\n".join(current))
            current = []
    if current:
        pieces.append(b"\n".join(current))
    tokens = np.empty(sum(len(p) + 2 for p in pieces), dtype=np.int64)
    pos = 0
    for piece in pieces:
        tokens[pos] = BOS
        tokens[pos + 1 : pos + 1 + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
        tokens[pos + 1 + len(piece)] = EOS
        pos += len(piece) + 2
    return tokens


class ByteBlocks(Dataset):
    """The token stream packed into seq_length blocks with the tail dropped, like the guide's
    group_texts; labels are the inputs (the model shifts them)."""

    def __init__(self, tokens, seq_length):
        n = len(tokens) // seq_length
        self.blocks = torch.from_numpy(tokens[: n * seq_length].reshape(n, seq_length))

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def _load_and_preprocess_data(args, config):
    if args.dataset_name == "builtin" or not os.path.isfile(args.dataset_name):
        raise SystemExit(
            f"-d {args.dataset_name}: pass a text file (the 'builtin' corpus exists only in the C++ "
            "binary; bench/reference/make_corpus.py writes one that both sides can read)"
        )
    if config.vocab_size < 258:
        raise SystemExit(f"vocab_size = {config.vocab_size} in {args.model_name}/config.json: the byte tokenizer needs >= 258")
    seq_length = args.seq_length
    if seq_length > config.max_position_embeddings:
        seq_length = min(1024, config.max_position_embeddings)
    args.seq_length = seq_length
    return ByteBlocks(encode_text_file(args.dataset_name), seq_length)


def peak_rss_gb():
    """The process's peak resident set (VmHWM) in GiB, as our binary reports it on the CPU."""
    with open("/proc/self/status") as fp:
        for line in fp:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024**2
    return 0.0


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as fp:  # resets VmHWM to the current RSS
        fp.write("5")


class LocalTimer:
    def __init__(self, device: torch.device):
        if device.type == "cpu":
            self.synchronize = lambda: None
        elif device.type == "cuda":
            self.synchronize = torch.cuda.synchronize
        self.measurements = []
        self.start_time = None

    def __enter__(self):
        self.synchronize()
        self.start_time = time.perf_counter()
        return self

    def __exit__(self, type, value, traceback):
        if traceback is None:
            self.synchronize()
            end_time = time.perf_counter()
            self.measurements.append(end_time - self.start_time)
        self.start_time = None

    def avg_elapsed_ms(self):
        return 1000 * (sum(self.measurements) / len(self.measurements))

    def reset(self):
        self.measurements = []
        self.start_time = None


def _get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("-e", "--experiment-name", default=None)
    parser.add_argument("-d", "--dataset-name", required=True, help="a text file, read as bytes")
    parser.add_argument("-m", "--model-name", required=True, help="a folder holding an HF config.json")
    parser.add_argument("--save-dir", default="../outputs")
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--num-epochs", default=100, type=int)
    parser.add_argument("--lr", default=3e-5, type=float)
    parser.add_argument("-b", "--batch-size", default=1, type=int)
    parser.add_argument("--log-freq", default=100, type=int)
    parser.add_argument("-s", "--seq-length", default=1024, type=int)
    parser.add_argument("--max-steps", default=0, type=int, help="stop at this global step (0: run all epochs)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", default=torch.get_num_threads(), type=int)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model, as the guide does on GPU")
    parser.add_argument("--warmup-steps", default=2, type=int, help="steps left out of the final summary")
    parser.add_argument("--num-workers", default=1, type=int, help="data loader workers (the guide uses 1)")
    parser.add_argument("--profile", default="", metavar="DIR",
                        help="profile --profile-steps steps into DIR/trace.json and DIR/ops.json (empty: off)")
    parser.add_argument("--profile-from", default=5, type=_positive, help="the first profiled step (after warm-up)")
    parser.add_argument("--profile-steps", default=3, type=_positive, help="steps profiled")
    return parser


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


if __name__ == "__main__":
    main()
