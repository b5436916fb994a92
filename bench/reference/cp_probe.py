"""Whether PyTorch's context parallel (torch.distributed.tensor.experimental.context_parallel) runs
here: one causal attention over a sequence split between the ranks of a CP mesh, on the device the
benchmark uses, under torchrun. Rank 0 prints one line: "runs" or "fails: <the error>".

usage: torchrun --nproc-per-node 2 cp_probe.py [--device cpu]
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl")
    torch.set_num_threads(1)
    mesh = init_device_mesh(args.device, (dist.get_world_size(),), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    # The buffers context_parallel shards are the layer's inputs; q, k and v are computed inside it,
    # as in a model (a leaf that requires grad cannot be resharded in place).
    seq, heads, dim = 16 * dist.get_world_size(), 4, 16
    x = torch.randn(1, seq, heads * dim, device=args.device)
    w = torch.randn(heads * dim, 3 * heads * dim, device=args.device, requires_grad=True)
    try:
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            q, k, v = (x @ w).view(1, x.shape[1], 3, heads, dim).permute(2, 0, 3, 1, 4)
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        outcome = "runs"
    except Exception as error:  # what stops it is the finding
        outcome = f"fails: {type(error).__name__}: {' '.join(str(error).split())}"
    if dist.get_rank() == 0:
        print(f"rank 0: {outcome} (torch {torch.__version__})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
