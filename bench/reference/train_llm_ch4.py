"""Chapter 4 of the distributed training guide (FSDP2, fully_shard), as the Python reference for
bench/. Start it with torchrun, one process per rank:

    OMP_NUM_THREADS=1 bench/.venv/bin/torchrun --standalone --nproc-per-node 2 \
        bench/reference/train_llm_ch4.py -m bench/reference/configs/llama-tiny -d corpus.txt -b 8 ...

This is the guide's chapter-4 train_llm.py on top of chapter 2 (train_llm_ch2.py; data, timers
and measurements from train_llm_ch1.py, unchanged), adapted only to run on a CPU without network
access:
- the process group is Gloo on the CPU (the guide: NCCL, one GPU per rank);
- the model is built on the meta device (no memory), then `fully_shard` wraps each decoder layer
  and then the root, with the guide's settings: reshard_after_forward (here a flag,
  --reshard-after-forward / --no-reshard-after-forward, on by default as in the guide),
  CPUOffloadPolicy with --cpu-offload (pin_memory only on CUDA: pinning needs a driver), and MixedPrecisionPolicy(param_dtype=<--dtype>,
  reduce_dtype=float32) (bf16 parameters in compute, fp32 gradient reduction; with
  --dtype float32 both are fp32). The model is created in --dtype, as the guide creates it in bf16;
- then `to_empty` materialises the shards and every module's reset_parameters re-initialises
  them; LlamaRMSNorm and LlamaRotaryEmbedding have none, so they get one, as in the guide (norm
  weights to one; the rotary inverse frequencies recomputed, since buffers are not parameters).
  transformers 5.x has no `rope_init_fn` attribute on the rotary module any more, so the reset
  calls the rope type's init function itself;
- each step starts with `model.unshard()` (prefetch of the root's parameters), as in the guide;
  with --cpu-offload, `zero_grad(set_to_none=False)` as in the guide;
- a DistributedSampler (shuffle, drop_last, seed, set_epoch per epoch), as in chapter 2;
- rank 0 alone writes the experiment folder and metrics.jsonl; throughput counts
  world_size x batch x seq tokens per step;
- no sharded checkpoints, no wandb, no error files: this script only measures.
At the end rank 0 prints ONE JSON line on stdout, the same summary as chapter 1's.
"""

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing, checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from metrics_summary import summarize
from train_llm_ch1 import LocalTimer, _get_parser as _ch1_parser, _load_and_preprocess_data, peak_rss_gb, reset_peak_rss


# The guide's fixes for modules without reset_parameters.
def reset_rope(self: LlamaRotaryEmbedding):
    init_fn = self.compute_default_rope_parameters if self.rope_type == "default" else ROPE_INIT_FUNCTIONS[self.rope_type]
    inv_freq, self.attention_scaling = init_fn(self.config)
    self.inv_freq = inv_freq.to(self.inv_freq.device)
    self.original_inv_freq = self.inv_freq.clone()


LlamaRMSNorm.reset_parameters = lambda self: torch.nn.init.ones_(self.weight)
LlamaRotaryEmbedding.reset_parameters = reset_rope

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

    torch.manual_seed(args.seed)

    # NOTE: meta device will not allocate any memory
    config = AutoConfig.from_pretrained(args.model_name, use_cache=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    num_params = sum(p.numel() for p in model.parameters())
    LOGGER.info(f"{num_params} model parameters")

    fsdp_config = dict(
        reshard_after_forward=args.reshard_after_forward,
        # pin_memory needs a CUDA driver: off on a CPU-only machine (there the offload moves nothing).
        offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda") if args.cpu_offload else None,
        mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
    )
    if fsdp_config["offload_policy"] is None:
        del fsdp_config["offload_policy"]  # fully_shard's default, OffloadPolicy(), offloads nothing
    for decoder in model.model.layers:
        fully_shard(decoder, **fsdp_config)
    fully_shard(model, **fsdp_config)
    if args.prefetch_layers is not None:
        # Explicit prefetching, K layers ahead in forward and behind in backward (0: none);
        # without the flag, fully_shard's own default.
        layers = list(model.model.layers)
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + args.prefetch_layers])
            layer.set_modules_to_backward_prefetch(layers[max(0, i - args.prefetch_layers):i][::-1])
    if args.activation_checkpointing == "full":
        # The guide's chapter 5: every decoder layer recomputed in backward, applied after sharding.
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda module: isinstance(module, LlamaDecoderLayer))

    model.to_empty(device="cpu" if args.cpu_offload else device)
    model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    if args.compile:
        model = torch.compile(model)

    # Rank 0 first, as in chapter 2.
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
            # NOTE: prefetches the first layer
            (model._orig_mod if args.compile else model).unshard()

            with timers["data"], torch.no_grad():
                batch = next(batches)
                batch = {k: v.to(device=device) for k, v in batch.items()}

            with timers["forward"]:
                outputs = model(**batch)
                del batch

            with timers["backward"]:
                outputs.loss.backward()

            with timers["update"]:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=not args.cpu_offload)

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
            impl="torch-fsdp" + ("-offload" if args.cpu_offload else ""),
            model=str(args.model_name),
            dtype=args.dtype,
            threads=args.threads,
            world_size=world_size,
            batch_size=args.batch_size,
            seq_length=args.seq_length,
            reshard_after_forward=args.reshard_after_forward,
            cpu_offload=args.cpu_offload,
            num_params=num_params,
            torch=torch.__version__,
        )
        print(json.dumps(summary), flush=True)
    dist.destroy_process_group()


def _get_parser():
    parser = _ch1_parser()
    parser.add_argument("--cpu-offload", action="store_true", help="CPUOffloadPolicy: parameters, gradients and optimizer state on the CPU")
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                        help="free the gathered parameters after each unit's forward (the guide: on)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one GPU per rank, NCCL")
    parser.add_argument("--prefetch-layers", type=int, default=None,
                        help="layers prefetched ahead in forward and backward (set_modules_to_*_prefetch); "
                             "default: fully_shard's own")
    parser.add_argument("--activation-checkpointing", default="none", choices=["none", "full"],
                        help="full: checkpoint_wrapper on every decoder layer (the guide's chapter 5)")
    return parser


if __name__ == "__main__":
    main()
