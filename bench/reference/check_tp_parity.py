"""Checks that the tensor-parallel reference (train_llm_ch6.py's plan, and with --fsdp chapter 7's
TP + fully_shard) computes what the unsharded chapter-1 model computes: same weights (built at the
same seed before sharding), same batches, a few AdamW steps; prints both losses and the largest
gradient difference per step, the largest parameter difference at the end, and exits non-zero
beyond the tolerances (--tol for losses and gradients, lr / 10 for parameters).

    OMP_NUM_THREADS=1 bench/.venv/bin/torchrun --standalone --nproc-per-node 2 \
        bench/reference/check_tp_parity.py -m bench/reference/configs/llama-tiny -d corpus.txt --tp 2 [--fsdp]
"""

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from transformers import AutoConfig, AutoModelForCausalLM

from train_llm_ch1 import ByteBlocks, encode_text_file
from train_llm_ch6 import apply_tensor_parallel


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model-name", required=True)
    p.add_argument("-d", "--dataset-name", required=True)
    p.add_argument("-b", "--batch-size", type=int, default=2)
    p.add_argument("-s", "--seq-length", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--fsdp", action="store_true", help="also fully_shard every layer and the root over dp (chapter 7)")
    p.add_argument("--tol", type=float, default=1e-4)
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()

    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.model_name, use_cache=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reference = copy.deepcopy(model)
    apply_tensor_parallel(model, mesh["tp"])
    if args.fsdp:
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=True, mesh=mesh["dp"])
        fully_shard(model, reshard_after_forward=False, mesh=mesh["dp"])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, fused=True)
    data = ByteBlocks(encode_text_file(args.dataset_name), args.seq_length)
    g = torch.Generator().manual_seed(args.seed)
    worst = worst_grad = 0.0
    for step in range(args.steps):
        # The global batch: dp x batch rows; this dp coordinate takes its slice.
        rows = torch.randint(len(data), (dp * args.batch_size,), generator=g)
        full = data.blocks[rows]
        mine = full[dp_rank * args.batch_size : (dp_rank + 1) * args.batch_size]
        pos = torch.arange(args.seq_length).unsqueeze(0)
        with loss_parallel():
            loss = model(input_ids=mine, labels=mine, position_ids=pos).loss
            loss.backward()
        grads = {n: (q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad).clone() for n, q in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        # Each dp coordinate's loss is its slice's mean; the global mean is their mean.
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss = loss / world  # summed over dp x tp ranks that each hold their slice's mean

        ref_loss = reference(input_ids=full, labels=full).loss
        ref_loss.backward()
        gdiff = max((grads[n] - q.grad).abs().max().item() for n, q in reference.named_parameters())
        worst_grad = max(worst_grad, gdiff)
        ref_opt.step()
        ref_opt.zero_grad()
        diff = abs(loss.item() - ref_loss.item())
        worst = max(worst, diff)
        if rank == 0:
            print(f"step {step + 1}: sharded {loss.item():.6f}  unsharded {ref_loss.item():.6f}  |diff| {diff:.2e}  largest gradient difference {gdiff:.2e}", flush=True)

    pdiff = 0.0
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        full_param = param.full_tensor() if isinstance(param, DTensor) else param
        d = (full_param.detach() - ref_params[name].detach()).abs().max().item()
        pdiff = max(pdiff, d)
    if rank == 0:
        print(f"largest parameter difference after {args.steps} steps: {pdiff:.2e} (lr {args.lr})", flush=True)
    # AdamW divides each gradient by its running RMS, so where a gradient is nearly zero (rows of
    # lm_head for tokens the batches lack) rounding differences of the sharded sums grow to a
    # fraction of lr in the parameters; a wrong plan gives differences of lr and more.
    ok = worst <= args.tol and worst_grad <= args.tol and pdiff <= 0.1 * args.lr
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
