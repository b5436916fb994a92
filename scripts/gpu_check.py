#!/usr/bin/env python3
"""The Python side of scripts/gpu-check, on the GPU machine's python3 (PyTorch with CUDA and
transformers). Subcommands:

  peak OUT.json                  the GPU's bf16 (and fp32) matmul rate: 8192^3 products, the mean
                                 of ten timed after three warm-ups
  config DIR                     a ~1B Llama config.json (Llama-3.2-1B's shape) for the benchmark
  init-weights CONFIG_DIR DIR    an HF model folder (config.json + model.safetensors) from the
                                 config, fp32, seeded: both devices of the fp32 comparison start
                                 from the same weights
  reference [flags]              the guide's chapter-1 loop on CUDA (HF transformers, bf16 weights,
                                 fused AdamW, cosine schedule), eager or --compile, measured as our
                                 binary measures itself; prints one JSON summary line
  summary METRICS.jsonl WARMUP   our binary's metrics.jsonl summarised the same way
  report STEPS.jsonl OUT_DIR     gpu-check.json and gpu-check.md from the steps' records
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench" / "reference"))


def cmd_peak(args):
    import torch

    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    n = 8192
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            a @ b
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1000 / 10
        out[f"{name}_tflops"] = round(2 * n**3 / seconds / 1e12, 1)
    Path(args.out).write_text(json.dumps(out) + "\n")
    print(json.dumps(out))


def llama_1b_config():
    """Llama-3.2-1B's shape (16 layers, hidden 2048, 32 heads, 8 KV heads, MLP 8192, vocab 128256,
    tied embeddings); the byte-level data uses ids below 258 of its vocabulary."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
        "initializer_range": 0.02, "bos_token_id": 256, "eos_token_id": 257, "torch_dtype": "bfloat16",
    }


def cmd_config(args):
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    (Path(args.dir) / "config.json").write_text(json.dumps(llama_1b_config(), indent=2) + "\n")


def cmd_init_weights(args):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.config_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(args.dir, safe_serialization=True)


def flops_per_token(config, seq_length):
    """Model FLOPs per trained token: 6 N for the weights' matmuls (forward and backward; the tied
    embedding counted once, as the output head) plus 12 L d s for attention's scores and values
    (PaLM's appendix B; causal masking not subtracted), the convention MFU figures use."""
    d, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    head_dim = config.get("head_dim") or d // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * inter
    head = d * config["vocab_size"]
    n = layers * per_layer + head
    return 6 * n + 12 * layers * d * seq_length, n


def cmd_reference(args):
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoConfig, AutoModelForCausalLM
    from metrics_summary import summarize
    from train_llm_ch1 import ByteBlocks, LocalTimer, encode_text_file

    device = torch.device("cuda")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.model_name, use_cache=False)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    num_params = sum(p.numel() for p in model.parameters())
    if args.compile:
        model = torch.compile(model)
    data = ByteBlocks(encode_text_file(args.dataset_name), args.seq_length)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=1,
                        prefetch_factor=2, generator=torch.Generator().manual_seed(args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000, eta_min=args.lr * 1e-2)
    timers = {k: LocalTimer(device) for k in ["data", "forward", "backward", "update"]}
    records, step, running, running_steps = [], 0, 0.0, 0
    torch.cuda.reset_peak_memory_stats()
    last = time.perf_counter()
    batches = iter(loader)
    while step < args.max_steps:
        with timers["data"], torch.no_grad():
            batch = {k: v.to(device=device) for k, v in next(batches).items()}
        with timers["forward"]:
            outputs = model(**batch)
        with timers["backward"]:
            outputs.loss.backward()
        with timers["update"]:
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
        step += 1
        running += outputs.loss.item()
        running_steps += 1
        if step % args.log_freq == 0:
            seconds = time.perf_counter() - last
            records.append({
                "global_step": step, "running_loss": running / running_steps,
                "tokens_per_s": args.batch_size * args.seq_length * running_steps / seconds,
                "time/total": 1000 * seconds / running_steps,
                **{f"time/{k}": t.avg_elapsed_ms() for k, t in timers.items()},
                "peak_alloc_gb": torch.cuda.max_memory_allocated() / 2**30,
                "peak_resv_gb": torch.cuda.max_memory_reserved() / 2**30,
            })
            print(json.dumps(records[-1]), file=sys.stderr, flush=True)
            running, running_steps = 0.0, 0
            for t in timers.values():
                t.reset()
            torch.cuda.reset_peak_memory_stats()
            last = time.perf_counter()
    summary = summarize(records, args.warmup_steps)
    summary["peak_alloc_gb"] = max(r["peak_alloc_gb"] for r in records)
    summary.update(impl="hf-compile" if args.compile else "hf-eager", num_params=num_params, torch=torch.__version__,
                   batch_size=args.batch_size, seq_length=args.seq_length, dtype=args.dtype)
    print(json.dumps(summary), flush=True)


def cmd_summary(args):
    from metrics_summary import read_jsonl, summarize

    records = read_jsonl(args.metrics)
    summary = summarize(records, args.warmup)
    summary["peak_alloc_gb"] = max((r.get("peak_alloc_gb", 0.0) for r in records), default=0.0)
    summary["impl"] = "meshtorch"
    print(json.dumps(summary))


def fmt(value, digits=1):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def cmd_report(args):
    steps = [json.loads(line) for line in Path(args.steps).read_text().splitlines() if line.strip()]
    out_dir = Path(args.out_dir)
    result = {"steps": steps}
    by_name = {s["step"]: s for s in steps}
    peak = by_name.get("bf16-peak", {}).get("data") or {}
    bench = {}
    for impl in ("meshtorch", "hf-eager", "hf-compile"):
        data = by_name.get(f"bench-{impl}", {}).get("data")
        if data:
            bench[impl] = data
    config = llama_1b_config()
    seq = next((b.get("seq_length") for b in bench.values() if b.get("seq_length")), 2048)
    per_token, n_matmul = flops_per_token(config, seq)
    for data in bench.values():
        if peak.get("bfloat16_tflops") and data.get("tokens_per_s"):
            data["mfu"] = data["tokens_per_s"] * per_token / (peak["bfloat16_tflops"] * 1e12)
    ratios = {}
    ours = bench.get("meshtorch", {}).get("tokens_per_s")
    for impl in ("hf-eager", "hf-compile"):
        theirs = bench.get(impl, {}).get("tokens_per_s")
        if ours and theirs:
            ratios[f"meshtorch/{impl}"] = ours / theirs
    result.update(peak=peak, bench=bench, ratios=ratios, flops_per_token=per_token, matmul_params=n_matmul)
    (out_dir / "gpu-check.json").write_text(json.dumps(result, indent=2) + "\n")

    lines = ["# scripts/gpu-check", ""]
    if peak:
        lines += [f"Machine: {peak.get('device', '?')}, torch {peak.get('torch', '?')}; measured matmul peak "
                  f"{peak.get('bfloat16_tflops', '-')} TFLOP/s bf16, {peak.get('float32_tflops', '-')} TFLOP/s fp32.", ""]
    lines += ["| step | status | seconds | note |", "| --- | --- | --- | --- |"]
    for s in steps:
        note = str(s.get("note", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {s['step']} | {s['status']} | {s.get('seconds', '-')} | {note[:300]} |")
    if bench:
        lines += ["", f"Chapter 1, ~1B Llama (Llama-3.2-1B shape, {n_matmul / 1e9:.2f} B matmul parameters), bf16, "
                  f"seq {seq}, batch {next(iter(bench.values())).get('batch_size', '-')}; medians after warm-up; "
                  f"MFU = tokens/s x {per_token / 1e9:.2f} GFLOP/token / measured bf16 peak.", "",
                  "| impl | tokens/s | MFU | ms/step | data | forward | backward | update | peak alloc GiB | last loss |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for impl, b in bench.items():
            mfu = b.get("mfu")
            lines.append(
                f"| {impl} | {fmt(b.get('tokens_per_s'), 0)} | {fmt(100 * mfu if mfu else None)}% | "
                f"{fmt(b.get('time/total'))} | {fmt(b.get('time/data'))} | {fmt(b.get('time/forward'))} | "
                f"{fmt(b.get('time/backward'))} | {fmt(b.get('time/update'))} | {fmt(b.get('peak_alloc_gb'), 2)} | "
                f"{fmt(b.get('last_loss'), 3)} |")
        for name, ratio in ratios.items():
            lines.append(f"\n{name} tokens/s: {ratio:.2f}x")
    (out_dir / "gpu-check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("peak")
    s.add_argument("out")
    s = sub.add_parser("config")
    s.add_argument("dir")
    s = sub.add_parser("init-weights")
    s.add_argument("config_dir")
    s.add_argument("dir")
    s = sub.add_parser("reference")
    s.add_argument("-m", "--model-name", required=True)
    s.add_argument("-d", "--dataset-name", required=True)
    s.add_argument("-b", "--batch-size", type=int, default=4)
    s.add_argument("-s", "--seq-length", type=int, default=2048)
    s.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    s.add_argument("--lr", type=float, default=3e-5)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--max-steps", type=int, default=15)
    s.add_argument("--log-freq", type=int, default=5)
    s.add_argument("--warmup-steps", type=int, default=5)
    s.add_argument("--compile", action="store_true")
    s = sub.add_parser("summary")
    s.add_argument("metrics")
    s.add_argument("warmup", type=int)
    s = sub.add_parser("report")
    s.add_argument("steps")
    s.add_argument("out_dir")
    args = p.parse_args()
    {"peak": cmd_peak, "config": cmd_config, "init-weights": cmd_init_weights, "reference": cmd_reference,
     "summary": cmd_summary, "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    main()
