"""Chapter 6 of the distributed training guide (tensor parallel + sequence parallel), as the
Python reference for bench/. Start it with torchrun, one process per rank:

    OMP_NUM_THREADS=1 bench/.venv/bin/torchrun --standalone --nproc-per-node 2 \
        bench/reference/train_llm_ch6.py -m bench/reference/configs/llama-tiny -d corpus.txt -b 8 --tp 2 ...

This is the guide's chapter-6 train_llm.py on top of chapter 2 (train_llm_ch2.py; data, timers
and measurements from train_llm_ch1.py, unchanged), adapted only to run on a CPU without network
access:
- the process group is Gloo on the CPU and the 2-D device mesh ("dp", "tp") is made on the CPU
  (the guide: NCCL, mesh (nodes, GPUs per node)); --tp sets the TP size, by default the ranks of
  one node (LOCAL_WORLD_SIZE), which is the guide's layout; dp = world / tp;
- the guide's plan per decoder layer: input/post-attention norms SequenceParallel, attention and
  MLP inputs PrepareModuleInput Shard(1) -> Replicate, q/k/v and gate/up ColwiseParallel, o/down
  RowwiseParallel with Shard(1) output; final norm SequenceParallel;
- the embedding: the guide shards it ColwiseParallel(output_layouts=Shard(1)) (hidden dimension);
  here it is RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)) (vocabulary rows,
  reduce-scattered onto the sequence dimension), as torchtitan's Llama plan does: it gives the
  same Shard(1) output with one reduce-scatter instead of a gather of the hidden dimension;
- lm_head ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
  use_local_output=False) and the loss under loss_parallel(): the guide's loss-parallel variant
  (cross entropy over the vocabulary shards, the full logits never gathered);
- explicit position_ids (the sequence is sharded, so the model cannot infer them), as the guide;
  transformers 5.x's LlamaAttention reshapes q/k/v with view(..., -1, head_dim), so each rank's
  shard of heads needs no change to the module (older versions read num_heads from the config and
  needed it divided by the TP size);
- the weights: the guide builds the model on the device, shards it, then calls to_empty and
  init_weights, which re-initialises every shard. On a CPU mesh DTensor has no RNG tracker, so
  every rank would draw identical shards; here the model is built as in chapter 1 (seed, full
  weights on every rank) and parallelize_module distributes those weights. At the same seed,
  batch and --tp with dp = 1 the first steps then see the same weights and data as
  train_llm_ch1.py, and their losses agree;
- a DistributedSampler over the dp coordinate (num_replicas = dp size, rank = dp rank): all
  ranks of a TP group get the same batch; throughput counts dp_size x batch x seq;
- rank 0 alone writes the experiment folder and metrics.jsonl;
- --compile (off by default; the guide's chapter 6 does not compile) fails with torch 2.11 on the
  CPU: dynamo cannot trace the vocabulary-sharded embedding's masked partial output (an index_put_
  on a real tensor under fake tensors), so the TP references are measured eager;
- no DCP checkpoints, no wandb, no error files: this script only measures.
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
import torch.distributed.tensor.parallel as tp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel
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
    device, mesh = init_distributed(args, rank, local_rank, world_size, parser)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    dp_size = mesh["dp"].size()

    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.model_name, use_cache=False)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    num_params = sum(p.numel() for p in model.parameters())
    LOGGER.info(f"{num_params} model parameters")

    apply_tensor_parallel(model, mesh["tp"])
    model.train()
    if args.compile:
        model = torch.compile(model)

    train_data, sampler, dataloader = make_dataloader(args, config, mesh, rank, parser)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000, eta_min=args.lr * 1e-2)

    records = train(args, model, optimizer, lr_scheduler, sampler, dataloader, device, rank, dp_size)

    if rank == 0:
        summary = summarize(records, args.warmup_steps)
        summary.update(
            impl="torch-tp",
            model=str(args.model_name),
            dtype=args.dtype,
            threads=args.threads,
            world_size=world_size,
            dp=dp_size,
            tp=mesh["tp"].size(),
            batch_size=args.batch_size,
            seq_length=args.seq_length,
            num_params=num_params,
            torch=torch.__version__,
        )
        print(json.dumps(summary), flush=True)
    dist.destroy_process_group()


def init_distributed(args, rank, local_rank, world_size, parser):
    """Gloo on the CPU (NCCL with --device cuda), then the ("dp", "tp") mesh."""
    if torch.cuda.is_available() and args.device == "cuda":
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, device_id=device if device.type == "cuda" else None)
    tp_size = args.tp or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % tp_size != 0:
        parser.error(f"--tp {tp_size} does not divide the world size {world_size}")
    mesh = init_device_mesh(device.type, (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    LOGGER.info(f"rank {rank} of {world_size} on {device}, backend {backend}, dp_size={mesh['dp'].size()} tp_size={mesh['tp'].size()}")
    return device, mesh


def apply_tensor_parallel(model, tp_mesh):
    """The guide's plan (see the module docstring for the embedding and lm_head)."""
    tp.parallelize_module(
        model,
        tp_mesh,
        # The guide: ColwiseParallel(output_layouts=Shard(1)); torchtitan's Llama plan, used here:
        {"model.embed_tokens": tp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))},
    )
    for layer in model.model.layers:
        tp.parallelize_module(
            layer,
            tp_mesh,
            {
                # SequenceParallel will apply sharding to sequence dimension.
                "input_layernorm": tp.SequenceParallel(),
                # The input to self_attn (the output of the SequenceParallel input_layernorm) is
                # sharded on dimension 1, but the attention needs the whole sequence.
                "self_attn": tp.PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(dim=1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                "self_attn.q_proj": tp.ColwiseParallel(),
                "self_attn.k_proj": tp.ColwiseParallel(),
                "self_attn.v_proj": tp.ColwiseParallel(),
                "self_attn.o_proj": tp.RowwiseParallel(output_layouts=Shard(1)),
                # Another sharding along sequence dimension.
                "post_attention_layernorm": tp.SequenceParallel(),
                "mlp": tp.PrepareModuleInput(
                    input_layouts=Shard(dim=1),
                    desired_input_layouts=Replicate(),
                ),
                "mlp.gate_proj": tp.ColwiseParallel(),
                "mlp.up_proj": tp.ColwiseParallel(),
                "mlp.down_proj": tp.RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    tp.parallelize_module(
        model,
        tp_mesh,
        {
            "model.norm": tp.SequenceParallel(),
            # Loss parallel: the logits stay sharded over the vocabulary.
            "lm_head": tp.ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )


def make_dataloader(args, config, mesh, rank, parser):
    """Rank 0 reads the data first (as in chapter 2); the sampler splits over the dp coordinate."""
    if rank == 0:
        train_data = _load_and_preprocess_data(args, config)
    dist.barrier()
    if rank != 0:
        train_data = _load_and_preprocess_data(args, config)
    LOGGER.info(f"{len(train_data)} training samples")

    dp_size = mesh["dp"].size()
    # NOTE: every rank of a TP group (same dp coordinate) gets the same batch
    sampler = DistributedSampler(
        train_data,
        shuffle=True,
        drop_last=True,
        seed=args.seed,
        num_replicas=dp_size,
        rank=mesh["dp"].get_local_rank(),
    )
    dataloader = DataLoader(
        train_data,
        batch_size=args.batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=args.num_workers,
        prefetch_factor=2 if args.num_workers > 0 else None,
    )
    LOGGER.info(f"{len(dataloader)} batches per epoch, global batch {dp_size * args.batch_size}")
    if len(dataloader) == 0:
        parser.error(f"{args.dataset_name} holds fewer than one global batch of {dp_size} x {args.batch_size} x {args.seq_length} tokens")
    return train_data, sampler, dataloader


def train(args, model, optimizer, lr_scheduler, sampler, dataloader, device, rank, dp_size, before_step=None):
    """The guide's loop, measured as chapter 1 measures it; returns rank 0's log lines."""
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
            if before_step is not None:
                before_step()

            with timers["data"], torch.no_grad():
                batch = next(batches)
                batch = {k: v.to(device=device) for k, v in batch.items()}
                batch["position_ids"] = torch.arange(0, args.seq_length, device=device, dtype=torch.long).unsqueeze(0)

            with timers["forward"], loss_parallel():
                outputs = model(**batch)
                del batch

            with timers["backward"], loss_parallel():
                outputs.loss.backward()

            with timers["update"]:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)

            loss = outputs.loss
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()  # replicated over the TP group: a local read
            state["global_step"] += 1
            state["epoch_step"] += 1
            state["running_loss"] += loss.item()
            state["running_steps"] += 1

            if state["global_step"] % args.log_freq == 0:
                tok_per_step = dp_size * args.batch_size * args.seq_length
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
    return records


def _get_parser():
    parser = _ch1_parser()
    parser.add_argument("--tp", "--tensor-parallel", dest="tp", default=0, type=int,
                        help="tensor-parallel size (default: the ranks of one node, LOCAL_WORLD_SIZE)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one GPU per rank, NCCL")
    return parser


if __name__ == "__main__":
    main()
