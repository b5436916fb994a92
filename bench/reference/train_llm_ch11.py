"""Chapter 11 (beyond the guide: pipeline parallel), as the Python reference for bench/, on
PyTorch's own torch.distributed.pipelining. Start it with torchrun, one process per rank:

    OMP_NUM_THREADS=1 bench/.venv/bin/torchrun --standalone --nproc-per-node 2 \
        bench/reference/train_llm_ch11.py -m bench/reference/configs/llama-tiny -d corpus.txt -b 8 \
        --pp 2 --schedule 1f1b --microbatches 4 ...

The guide has no pipeline chapter; this script is the guide's loop (chapter 6's data and
measurements: train_llm_ch6.py's data loader, train_llm_ch1.py's timers and summary, unchanged)
around the recipe torchtitan's pipeline_llama follows, with its flags named as our
11-pipeline-parallel names them:
- the process group is Gloo on the CPU and the 2-D device mesh is ("dp", "pp"): --pp ranks hold
  the stages of one model, dp = world / pp replicas read different batches (a DistributedSampler
  over the dp coordinate, as in chapter 6), their gradients and losses averaged over dp after each
  schedule step (an all-reduce per parameter: bench/ runs dp = 1, where there is none);
- the model is built as in chapter 1 (seed, full weights on every rank: the same initial weights
  as train_llm_ch1.py at the same seed), then each of this rank's stages is a deep copy with the
  units other stages hold deleted (torchtitan's recipe: drop the layers, the embedding, the norm
  and the head the stage does not hold), and the full model is dropped;
- the cut: the embedding, each decoder layer and the final norm with the head are units, each
  stage a contiguous run of them (--units-per-stage 3,3). Without the flag the units are split as
  our binary splits them (the slowest stage as fast as it can be, each unit costed by its forward
  FLOPs per token), so that both sides train the same stages;
- the stages go on ranks as PyTorch's schedules place them: stage s on rank s % pp (GPipe, 1F1B,
  Interleaved 1F1B), in a V for ZBV (rank r holds stages r and 2 pp - 1 - r);
- PipelineStage per stage (shapes inferred at the first step) and the schedule --schedule names:
  ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B (--stages-per-rank 2 or more) or
  ScheduleZBVZeroBubble (exactly 2); -b is the batch per dp rank, split into --microbatches
  equal micro-batches (default: the number of stages);
- the loss on the last stage is transformers' causal-LM loss (the mean next-token cross entropy
  of the micro-batch, as chapter 1's outputs.loss) and the schedule scales the gradients by
  1 / micro-batches: with equal micro-batches, the gradients and loss of chapter 1's mean over the
  whole batch. The step's loss is the mean of the micro-batches', summed over the PP group (zeros
  on the ranks without the last stage) so that rank 0 logs it, as our binary does;
- timers: data, pipeline (the whole schedule: every forward and backward) and update, the phases
  our binary times; AdamW (fused, as chapter 1) over this rank's stages' parameters;
- rank 0 alone writes the experiment folder and metrics.jsonl; no checkpoints, no wandb;
- ZBV on Gloo: before its first step each PipelineStage greets its neighbours' ranks with a
  send and a receive, and ZBV's V puts two neighbouring stages (1 and 2 of 4) on the last rank,
  which then sends to itself; Gloo refuses ("Pair is not connected"), where NCCL accepts it. The
  schedule itself already skips the transfers between stages of one rank. --skip-self-handshake
  (off by default: PyTorch as it ships) leaves those greetings to itself out, and nothing else.
At the end rank 0 prints ONE JSON line on stdout, the same summary as chapter 1's, with the split,
the schedule and every logged step's loss added.
"""

import copy
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.stage import _PipelineStageBase
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from metrics_summary import summarize
from train_llm_ch1 import LocalTimer, _get_parser as _ch1_parser, peak_rss_gb, reset_peak_rss
from train_llm_ch6 import make_dataloader

LOGGER = logging.getLogger(__name__)

# (class, whether it takes a list of stages) per --schedule, named as our binary names them.
SCHEDULES = {
    "gpipe": (ScheduleGPipe, False),
    "1f1b": (Schedule1F1B, False),
    "interleaved-1f1b": (ScheduleInterleaved1F1B, True),
    "zbv": (ScheduleZBVZeroBubble, True),
}


def main():
    parser = _get_parser()
    args = parser.parse_args()

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])

    logging.basicConfig(
        format=f"[%(asctime)s] [rank={rank}] %(levelname)s:%(message)s",
        level=logging.INFO,
        stream=sys.stderr,
    )
    LOGGER.info(args)

    torch.set_num_threads(args.threads)
    device, mesh = init_distributed(args, rank, world_size, parser)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    dp_size, pp = mesh["dp"].size(), mesh["pp"].size()

    schedule_class, takes_list = SCHEDULES[args.schedule]
    num_stages = pp * args.stages_per_rank
    if args.schedule in ("gpipe", "1f1b") and args.stages_per_rank != 1:
        parser.error(f"--schedule {args.schedule} runs one stage per rank; use interleaved-1f1b or zbv")
    if args.schedule == "zbv" and args.stages_per_rank != 2:
        parser.error("--schedule zbv runs exactly 2 stages per rank (--stages-per-rank 2)")
    if args.compile:
        parser.error("--compile: the stages run eager (as the tp and 2d references are measured)")
    microbatches = args.microbatches or num_stages
    if args.batch_size % microbatches:
        parser.error(f"-b {args.batch_size} does not split into --microbatches {microbatches} equal micro-batches")

    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.model_name, use_cache=False)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    num_params = sum(p.numel() for p in model.parameters())
    LOGGER.info(f"{num_params} model parameters")

    units = args.units_per_stage or balanced_units(unit_costs(config.to_dict(), args.seq_length), num_stages)
    if len(units) != num_stages or sum(units) != config.num_hidden_layers + 2 or min(units) < 1:
        parser.error(f"--units-per-stage {','.join(map(str, units))}: {num_stages} stages of at least one unit "
                     f"adding up to {config.num_hidden_layers} layers + the embedding and the head")
    parts = stage_parts(units, config.num_hidden_layers)
    split = describe(parts)
    pp_rank = mesh["pp"].get_local_rank()
    if args.schedule == "zbv":
        local = [pp_rank, 2 * pp - 1 - pp_rank]  # the V: rank 0 holds the first and the last stage
    else:
        local = [pp_rank + k * pp for k in range(args.stages_per_rank)]
    modules = [cut_stage(model, parts[s]) for s in local]
    del model  # each rank keeps its stages only
    LOGGER.info(f"pipeline {args.schedule} over {pp} ranks ({num_stages} stages, {args.stages_per_rank} per rank, "
                f"{microbatches} micro-batches: {split}); rank {rank} holds stage(s) {local}: "
                f"{sum(p.numel() for m in modules for p in m.parameters())} parameters")

    pp_group = mesh["pp"].get_group()
    if args.skip_self_handshake:
        skip_self_handshake()
    stages = [PipelineStage(m, s, num_stages, device, group=pp_group) for m, s in zip(modules, local)]

    def loss_fn(logits, labels):
        # Chapter 1's outputs.loss on the micro-batch: the mean next-token cross entropy.
        return ForCausalLMLoss(logits, labels, vocab_size=config.vocab_size)

    schedule = schedule_class(stages if takes_list else stages[0], microbatches, loss_fn=loss_fn)

    train_data, sampler, dataloader = make_dataloader(args, config, mesh, rank, parser)

    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, fused=True)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000, eta_min=args.lr * 1e-2)

    holds_first, holds_last = 0 in local, num_stages - 1 in local
    dp_group = mesh["dp"].get_group() if dp_size > 1 else None
    records = train(args, schedule, holds_first, holds_last, pp_group, dp_group, params, optimizer, lr_scheduler,
                    sampler, dataloader, device, rank, dp_size)

    if rank == 0:
        summary = summarize(records, args.warmup_steps)
        summary.update(
            impl="torch-pp",
            model=str(args.model_name),
            dtype=args.dtype,
            threads=args.threads,
            world_size=world_size,
            dp=dp_size,
            pp=pp,
            schedule=args.schedule,
            stages_per_rank=args.stages_per_rank,
            microbatches=microbatches,
            split=split,
            losses=[r["running_loss"] for r in records],
            batch_size=args.batch_size,
            seq_length=args.seq_length,
            num_params=num_params,
            torch=torch.__version__,
        )
        print(json.dumps(summary), flush=True)
    dist.destroy_process_group()


def init_distributed(args, rank, world_size, parser):
    """Gloo on the CPU, then the ("dp", "pp") mesh."""
    device = torch.device("cpu")
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)
    if world_size % args.pp != 0:
        parser.error(f"--pp {args.pp} does not divide the world size {world_size}")
    mesh = init_device_mesh(device.type, (world_size // args.pp, args.pp), mesh_dim_names=("dp", "pp"))
    LOGGER.info(f"rank {rank} of {world_size} on {device}, backend gloo, dp_size={mesh['dp'].size()} "
                f"pp_size={mesh['pp'].size()}")
    return device, mesh


def skip_self_handshake():
    """PipelineStage's first-step greetings without those a rank would send to itself (see the
    module docstring: Gloo cannot pair a rank with itself)."""
    greetings = _PipelineStageBase._get_init_p2p_neighbors_ops

    def to_other_ranks(self):
        return [op for op in greetings(self) if op.group_peer != self.group_rank]

    _PipelineStageBase._get_init_p2p_neighbors_ops = to_other_ranks


def unit_costs(config, seq_length):
    """Forward FLOPs per token of each unit (the embedding, each layer, the norm with the head):
    include/meshtorch/models/llama/stage_costs.hpp, so that the default split is our binary's."""
    h, vocab = config["hidden_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config.get("num_key_value_heads") or config["num_attention_heads"]
    attention = h * (2 * q + 2 * kv * head_dim)
    mlp = 3 * h * config["intermediate_size"]
    layer = 2.0 * (attention + mlp) + 2.0 * seq_length * q
    return [float(h)] + [layer] * config["num_hidden_layers"] + [2.0 * h * vocab + 5.0 * vocab]


def balanced_units(costs, stages):
    """The contiguous split of costs into stages whose slowest is the fastest possible; among equal
    splits, the one with fewer units on earlier stages (pp::balanced_units, the same loop)."""
    units = len(costs)
    if not 1 <= stages <= units:
        raise SystemExit(f"{stages} stages over {units} units: every stage needs one")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    slowest = [[inf] * (units + 1) for _ in range(stages + 1)]
    cut = [[0] * (units + 1) for _ in range(stages + 1)]
    slowest[0][0] = 0.0
    for s in range(1, stages + 1):
        for u in range(s, units - (stages - s) + 1):
            for k in range(s - 1, u):
                value = max(slowest[s - 1][k], prefix[u] - prefix[k])
                if value < slowest[s][u] * (1 - 1e-12):
                    slowest[s][u], cut[s][u] = value, k
    split, u = [0] * stages, units
    for s in range(stages, 0, -1):
        split[s - 1] = u - cut[s][u]
        u = cut[s][u]
    return split


def stage_parts(units, layers):
    """Per stage: (embedding, first layer, end layer, head), unit 0 the embedding, units 1..L the
    layers, unit L + 1 the norm with the head."""
    parts, begin = [], 0
    for n in units:
        end = begin + n
        parts.append((begin == 0, min(max(begin - 1, 0), layers), min(max(end - 1, 0), layers), end == layers + 2))
        begin = end
    return parts


def describe(parts):
    """"embedding+layers 0-1 | layers 2-3+norm+head", as our binary logs its split."""
    text = []
    for embedding, first, end, head in parts:
        piece = ["embedding"] if embedding else []
        if end > first:
            piece.append(f"layer {first}" if end - first == 1 else f"layers {first}-{end - 1}")
        if head:
            piece.append("norm+head")
        text.append("+".join(piece))
    return " | ".join(text)


class LlamaStage(nn.Module):
    """One stage of a transformers LlamaForCausalLM: the decoder with only this stage's layers,
    the embedding where it starts the model, the norm and the head where it ends it. Its input is
    token ids (first stage) or the hidden states the stage before sent; its output the hidden
    states, or the logits on the last stage."""

    def __init__(self, model, embedding, head):
        super().__init__()
        self.model = model.model
        self.lm_head = model.lm_head if head else None
        self.embedding = embedding

    def forward(self, x):
        if self.embedding:
            hidden = self.model(input_ids=x).last_hidden_state
        else:
            hidden = self.model(inputs_embeds=x).last_hidden_state
        return self.lm_head(hidden) if self.lm_head is not None else hidden


def cut_stage(model, part):
    """A deep copy of the model without the units other stages hold (torchtitan's pipeline_llama)."""
    embedding, first, end, head = part
    if model.config.tie_word_embeddings and embedding != head:
        raise SystemExit("tied embeddings on a model whose embedding and head are on different stages: untie them")
    stage = copy.deepcopy(model)
    decoder = stage.model
    if not embedding:
        decoder.embed_tokens = None
    decoder.layers = nn.ModuleList(list(decoder.layers)[first:end])
    if not head:
        decoder.norm = nn.Identity()  # LlamaModel.forward always calls its norm
        stage.lm_head = None
    return LlamaStage(stage, embedding, head)


def train(args, schedule, holds_first, holds_last, pp_group, dp_group, params, optimizer, lr_scheduler, sampler,
          dataloader, device, rank, dp_size):
    """Chapter 6's loop (train_llm_ch6.train) with the schedule's step in place of forward and
    backward; returns rank 0's log lines."""
    metrics_path = None
    if args.experiment_name:
        exp_dir = Path(args.save_dir) / args.experiment_name
        if rank == 0:
            exp_dir.mkdir(parents=True, exist_ok=True)
            metrics_path = exp_dir / "metrics.jsonl"
            metrics_path.unlink(missing_ok=True)
        dist.barrier()

    state = {"epoch": 0, "global_step": 0, "epoch_step": 0, "running_loss": 0, "running_steps": 0}
    timers = {k: LocalTimer(device) for k in ["data", "pipeline", "update"]}
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
                input_ids = batch["input_ids"].to(device=device)

            with timers["pipeline"]:
                losses = []
                schedule.step(*([input_ids] if holds_first else []), target=input_ids if holds_last else None,
                              losses=losses, return_outputs=False)
                # The step's loss onto every rank of the pipeline, as our binary all-reduces it.
                loss = torch.stack(losses).mean().detach().float() if losses else torch.zeros((), device=device)
                dist.all_reduce(loss, group=pp_group)
                if dp_group is not None:  # the replicas' mean (Gloo has no AVG)
                    for t in [*(p.grad for p in params if p.grad is not None), loss]:
                        dist.all_reduce(t, group=dp_group)
                        t.div_(dp_size)

            with timers["update"]:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)

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
    parser.add_argument("--pp", default=2, type=int, help="pipeline ranks (divides the world); the rest is DP")
    parser.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES))
    parser.add_argument("--stages-per-rank", default=1, type=int,
                        help="stages each pipeline rank holds (2 or more for interleaved-1f1b; 2 for zbv)")
    parser.add_argument("--microbatches", default=0, type=int,
                        help="micro-batches each rank's batch (-b) is split into (default: the number of stages)")
    parser.add_argument("--units-per-stage", default=None, type=lambda s: [int(n) for n in s.split(",") if n],
                        help="units (the embedding, each layer, the norm with the head) per stage, comma-separated "
                             "(default: balanced by each unit's forward FLOPs, as our binary splits)")
    parser.add_argument("--skip-self-handshake", action="store_true",
                        help="leave out the first-step send and receive a rank would make to itself (ZBV on Gloo)")
    return parser


if __name__ == "__main__":
    main()
