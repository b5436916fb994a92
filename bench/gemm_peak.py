"""The machine's achievable fp32 (and bf16) matmul rate: the best of several large square
matmuls through torch (MKL/oneDNN on x86), per thread count. tokens/s figures are read against
it: model FLOPs per second / this peak is the fraction of the achievable that a run reaches.

    python gemm_peak.py [--threads 1,2] [--n 2048] [--dtypes float32,bfloat16]

Prints one JSON object {dtype: {threads: GFLOP/s}}.
"""

import argparse
import json
import time

import torch


def peak_gflops(n, dtype, threads, seconds=2.0):
    torch.set_num_threads(threads)
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    c = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=c)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--dtypes", default="float32")
    args = p.parse_args()
    out = {}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        out[name] = {int(t): round(peak_gflops(args.n, dtype, int(t)), 1) for t in args.threads.split(",")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
