"""Chapter 7 of the distributed training guide (2D parallel: FSDP over "dp" + TP over "tp"), as
the Python reference for bench/. Start it with torchrun, one process per rank:

    OMP_NUM_THREADS=1 bench/.venv/bin/torchrun --standalone --nproc-per-node 2 \
        bench/reference/train_llm_ch7.py -m bench/reference/configs/llama-tiny -d corpus.txt -b 8 --tp 2 ...

This is the guide's chapter-7 train_llm.py: chapter 6 (train_llm_ch6.py, whose mesh, plan, data
and loop it reuses unchanged, with the same adaptations to the CPU), then `fully_shard` every
decoder layer (reshard_after_forward=True) and the root (reshard_after_forward=False) over the
mesh's "dp" dimension, as in the guide. --tp (or the guide's --tensor-parallel) sets the TP size
and the mesh is (world / tp, tp); its default here is the ranks of one node, as in chapter 6 (the
guide's default of 8 needs 8 ranks). Each step starts with `model.unshard()` (prefetch of the
root's parameters), as in the guide. The guide compiles the model and the loss function; here
--compile does, as in the other references (off by default), but with torch 2.11 on the CPU it
fails as chapter 6's does (dynamo cannot trace the vocabulary-sharded embedding), so the 2D
reference is measured eager. The model stays in --dtype without a
MixedPrecisionPolicy, as in the guide. At the end rank 0 prints ONE JSON line on stdout, the same
summary as chapter 1's.
"""

import json
import logging
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from metrics_summary import summarize
from train_llm_ch6 import _get_parser, apply_tensor_parallel, init_distributed, make_dataloader, train

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
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=True, mesh=mesh["dp"])
    fully_shard(model, reshard_after_forward=False, mesh=mesh["dp"])
    model.train()

    fsdp_model = model
    if args.compile:
        model = torch.compile(model)
        fsdp_model.loss_function = torch.compile(fsdp_model.loss_function)

    train_data, sampler, dataloader = make_dataloader(args, config, mesh, rank, parser)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000, eta_min=args.lr * 1e-2)

    # NOTE: model.unshard() before each step prefetches the first layer, as in the guide
    records = train(args, model, optimizer, lr_scheduler, sampler, dataloader, device, rank, dp_size,
                    before_step=fsdp_model.unshard)

    if rank == 0:
        summary = summarize(records, args.warmup_steps)
        summary.update(
            impl="torch-2d",
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


if __name__ == "__main__":
    main()
