"""Chapter 2 of the distributed training guide (DistributedDataParallel), as the Python reference
for bench/. Start it with torchrun, one process per rank:

    OMP_NUM_THREADS=1 bench/.venv/bin/torchrun --standalone --nproc-per-node 2 \
        bench/reference/train_llm_ch2.py -m bench/reference/configs/llama-tiny -d corpus.txt -b 8 ...

This is the guide's chapter-2 train_llm.py on top of chapter 1 (train_llm_ch1.py, whose data,
timers and measurements it reuses unchanged), adapted only to run on a CPU without network access:
- the process group is Gloo on the CPU (the guide: NCCL, one GPU per rank); rank, world size and
  the rendezvous come from torchrun's environment, as in the guide;
- the model is wrapped in DistributedDataParallel with the guide's settings that exist on the
  CPU: gradients as views into the buckets, --bucket-cap-mb (25, torch's default and ours);
  device_ids only on CUDA. --compile compiles before wrapping, as the guide does;
- a DistributedSampler (shuffle, drop_last, seed, set_epoch per epoch): each rank takes its share
  of the data, so a step's global batch is world_size x --batch-size samples, as in our binary;
- --zero wraps AdamW in ZeroRedundancyOptimizer (optimizer state sharded across ranks), as the
  guide shows; without it, plain AdamW (fused, as in chapter 1);
- rank 0 alone writes the experiment folder and metrics.jsonl; throughput counts
  world_size x batch x seq tokens per step, as in the guide;
- --threads sets torch.set_num_threads per rank (the runner gives each rank one thread, and sets
  OMP_NUM_THREADS=1 as torchrun itself does for several ranks);
- no checkpoints, no wandb, no error files: this script only measures.
At the end rank 0 prints ONE JSON line on stdout, the same summary as chapter 1's.
"""

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM

from metrics_summary import summarize
from train_llm_ch1 import LocalTimer, _get_parser as _ch1_parser, _load_and_preprocess_data, peak_rss_gb, reset_peak_rss

LOGGER = logging.getLogger(__name__)


def main():
    parser = _get_parser()
    args = parser.parse_args()

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])

    logging.basicConfig(
        format=f"[%(asctime)s] [rank={rank}] %(levelname)s:%(message)s",
        level=logging.INFO,
        stream=sys.stderr,
    )
    LOGGER.info(args)

    torch.set_num_threads(args.threads)
    if torch.cuda.is_available() and args.device == "cuda":
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, device_id=device if device.type == "cuda" else None)
    LOGGER.info(f"rank {rank} of {world_size} on {device}, backend {backend}")

    # Every rank uses the same seed, and DDP broadcasts rank 0's weights at wrap anyway.
    torch.manual_seed(args.seed)

    config = AutoConfig.from_pretrained(args.model_name, use_cache=False)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    num_params = sum(p.numel() for p in model.parameters())
    LOGGER.info(f"{num_params} model parameters")
    if args.compile:
        model = torch.compile(model)

    model = DistributedDataParallel(
        model,
        device_ids=[local_rank] if device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_cap_mb,
        gradient_as_bucket_view=True,
    )

    # Rank 0 first (the guide: it downloads and tokenises into the shared cache, then the others
    # read it); here every rank reads the local text file, after rank 0.
    if rank == 0:
        train_data = _load_and_preprocess_data(args, config)
    dist.barrier()
    if rank != 0:
        train_data = _load_and_preprocess_data(args, config)
    LOGGER.info(f"{len(train_data)} training samples")

    sampler = DistributedSampler(train_data, shuffle=True, drop_last=True, seed=args.seed)
    dataloader = DataLoader(
        train_data,
        batch_size=args.batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=args.num_workers,
        prefetch_factor=2 if args.num_workers > 0 else None,
    )
    LOGGER.info(f"{len(dataloader)} batches per epoch, global batch {world_size * args.batch_size}")
    if len(dataloader) == 0:
        parser.error(f"{args.dataset_name} holds fewer than one global batch of {world_size} x {args.batch_size} x {args.seq_length} tokens")

    if args.zero:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr, fused=True)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000, eta_min=args.lr * 1e-2)

    metrics_path = None
    if args.experiment_name:
        exp_dir = Path(args.save_dir) / args.experiment_name
        if rank == 0:
            exp_dir.mkdir(parents=True, exist_ok=True)
            metrics_path = exp_dir / "metrics.jsonl"
            metrics_path.unlink(missing_ok=True)
        dist.barrier()

    state = {"epoch": 0, "global_step": 0, "epoch_step": 0, "running_loss": 0, "running_steps": 0}
    timers = {k: LocalTimer(device) for k in ["data", "forward", "backward", "update"]}
    records = []
    done = False
    reset_peak_rss()
    last_log = time.perf_counter()

    for state["epoch"] in range(state["epoch"], args.num_epochs):
        sampler.set_epoch(state["epoch"])
        batches = iter(dataloader)
        for i_step in range(len(dataloader)):
            with timers["data"], torch.no_grad():
                batch = next(batches)
                batch = {k: v.to(device=device) for k, v in batch.items()}

            with timers["forward"]:
                outputs = model(**batch)

            with timers["backward"]:
                outputs.loss.backward()

            with timers["update"]:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)

            state["global_step"] += 1
            state["epoch_step"] += 1
            state["running_loss"] += outputs.loss.item()
            state["running_steps"] += 1

            if state["global_step"] % args.log_freq == 0:
                tok_per_step = world_size * args.batch_size * args.seq_length
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
                if rank == 0:
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

            if args.max_steps and state["global_step"] >= args.max_steps:
                done = True
                break
        state["epoch_step"] = 0
        if done:
            break

    if rank == 0:
        summary = summarize(records, args.warmup_steps)
        summary.update(
            impl="torch-ddp-zero" if args.zero else "torch-ddp",
            model=str(args.model_name),
            dtype=args.dtype,
            threads=args.threads,
            world_size=world_size,
            batch_size=args.batch_size,
            seq_length=args.seq_length,
            num_params=num_params,
            torch=torch.__version__,
        )
        print(json.dumps(summary), flush=True)
    dist.destroy_process_group()


def _get_parser():
    parser = _ch1_parser()
    parser.add_argument("--zero", action="store_true", help="shard AdamW's state with ZeroRedundancyOptimizer")
    parser.add_argument("--bucket-cap-mb", default=25, type=float, help="DDP gradient bucket size in MiB")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one GPU per rank, NCCL")
    return parser


if __name__ == "__main__":
    main()
