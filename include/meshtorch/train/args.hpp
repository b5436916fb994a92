#pragma once
// The guide's command-line flags, shared by every chapter's train_llm.cpp. A chapter adds its
// own flags (e.g. --cpu-offload, --tp) to the same CLI::App. Every flag, the chapter's too, is
// part of the fingerprint ranks compare at start-up, unless it is added to the per_rank_flags
// group: a rank started with other values fails at once instead of hanging later.
// The programs' header: the library's own headers read TrainArgs from train/train_args.hpp,
// which does not pull in CLI11.
#include <string>

#include <CLI/CLI.hpp>

#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/train_args.hpp>

namespace meshtorch::train {

// The CLI11 group of flags that may differ between ranks (they change no result).
inline constexpr const char* per_rank_flags = "Per-rank options";

// Every flag's value but the per-rank ones, one "name=value" per line, in the order the flags
// were added: what all ranks of a run must agree on.
MESHTORCH_DECL std::string flags_fingerprint(const CLI::App& app);

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(programs)
#include <exception>
#include <limits>
#include <sstream>

#include <fmt/format.h>

#include <meshtorch/error.hpp>
#include <meshtorch/layout/context_split.hpp>
#include <meshtorch/layout/pipeline_action.hpp>
#include <meshtorch/train/core_workers.hpp>

namespace meshtorch::train {

MESHTORCH_DECL std::string flags_fingerprint(const CLI::App& app) {
  std::string per_rank_names;
  for (const CLI::Option* option : app.get_options())
    if (option->get_group() == per_rank_flags) per_rank_names += "|" + option->get_single_name() + "=";
  std::istringstream all(app.config_to_str(/*default_also=*/true, /*write_description=*/false));
  std::string out, line;
  while (std::getline(all, line)) {
    const auto name = line.substr(0, line.find('=') + 1);
    if (per_rank_names.find("|" + name) == std::string::npos) out += line + "\n";
  }
  return out;
}

MESHTORCH_DECL std::string TrainArgs::fingerprint() const { return app_ ? flags_fingerprint(*app_) : std::string(); }

MESHTORCH_DECL void TrainArgs::add_to(CLI::App& app) {
  app_ = &app;
  // A flag given twice takes its last value, as Python's argparse does: a launch script's
  // defaults come first and the caller's additions override them.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("-e,--experiment-name", experiment_name,
                 "name of the run; checkpoints and metrics.jsonl go to <save-dir>/<name>, and a run with the "
                 "same name resumes");
  auto* resume_from_flag =
      app.add_option("--resume-from", resume_from,
                     "start from this checkpoint (a ckpt-<step> folder, or an experiment folder whose 'checkpoint' "
                     "link names one) instead of -e's latest; later checkpoints go to -e's folder");
  app.add_flag("--no-resume", no_resume,
               "start at step 0 even when -e's folder holds a checkpoint (this run's first save replaces it)")
      ->excludes(resume_from_flag);
  app.add_option("-d,--dataset-name", dataset_name,
                 "'builtin', a .txt, .jsonl or llm.c .bin file, a folder of them or a pattern such as 'data/*.jsonl'; "
                 "tokenised once into <its folder>/.meshtorch-cache (or $MESHTORCH_DATA_CACHE)")
      ->capture_default_str();
  app.add_flag("--tensorboard", tensorboard,
               "write TensorBoard event files (every metric, the flags) under <save-dir>/<experiment>/tensorboard; "
               "W&B imports them with `wandb sync --sync-tensorboard`");
  app.add_option("--tracking-ranks", tracking_ranks,
                 "which ranks write them: rank0 (one run), node (local rank 0 of each node, a run per node) or all "
                 "(a run per rank)")
      ->capture_default_str()
      ->check(CLI::IsMember({"rank0", "node", "all"}));
  auto* eval_split_flag =
      app.add_option("--eval-split", eval_split,
                     "hold the last fraction of -d's blocks out of training, for evaluation (--eval-freq, "
                     "meshtorch-eval-loss --eval-split with the same -d, -s and fraction); 0: none")
          ->capture_default_str()
          ->check(CLI::Range(0.0, 1.0));
  app.add_option("--eval-freq", eval_freq,
                 "every N optimizer steps, the loss and perplexity on the held-out blocks (eval_loss, eval_perplexity "
                 "in metrics.jsonl and TensorBoard); needs --eval-split; 0: never")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber)
      ->needs(eval_split_flag);
  app.add_option("--dataset-subset", dataset_subset,
                 "the subfolder of -d's folder to train on (an HF data set's "
                 "configuration name)");
  app.add_option("-m,--model-name", model_name,
                 "a preset (llama-tiny, llama-3.2-1b, llama-3.1-8b, llama-3.1-70b, llama-3.1-405b) or a "
                 "directory with an HF config.json (and optionally model.safetensors)")
      ->capture_default_str();
  app.add_option("--save-dir", save_dir, "where experiments are saved")->capture_default_str();
  app.add_option("--seed", seed, "seed for initialisation and data order")->capture_default_str();
  app.add_option("--num-epochs", num_epochs)->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "peak learning rate")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("-b,--batch-size", batch_size, "samples per data-parallel rank and micro-batch")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--log-freq", log_freq, "log every N optimizer steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--ckpt-freq", ckpt_freq, "checkpoint every N optimizer steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--keep-checkpoints", keep_checkpoints,
                 "complete checkpoints kept, the newest (older ones are deleted once a newer one is saved)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("-s,--seq-length", seq_length)->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--max-steps", max_steps, "stop when the global step reaches N (0: no limit)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--device", device, "cpu, cuda or auto (cuda when available)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--dtype", dtype, "float32, bfloat16 or auto (bfloat16 on cuda, float32 on cpu)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "float32", "bfloat16"}));
  auto* grad_accum_flag = app.add_option("--grad-accum", grad_accum, "micro-batches per optimizer step")
                              ->capture_default_str()
                              ->check(CLI::PositiveNumber);
  app.add_option("--global-batch-size", global_batch_size,
                 "samples per optimizer step over all ranks, whatever their number: the micro-batches per step "
                 "follow (global / (-b x data-parallel ranks)), so a run resumed on fewer or more ranks (an elastic "
                 "restart) keeps its batch and data order (0: -b x ranks x --grad-accum)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber)
      ->excludes(grad_accum_flag);
  app.add_option("--lr-schedule", lr_schedule,
                 "cosine (the guide's: T_max 1000 steps, down to lr/100), warmup-cosine or warmup-decay (DeepSpeed's "
                 "WarmupCosineLR and WarmupDecayLR, warming up over --warmup-steps and decaying until "
                 "--lr-decay-steps), or constant")
      ->capture_default_str()
      ->check(CLI::IsMember({"cosine", "warmup-cosine", "warmup-decay", "constant"}));
  app.add_option("--warmup-steps", warmup_steps, "warmup-cosine, warmup-decay: steps rising from 0 to --lr")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--warmup-type", warmup_type, "warmup-cosine, warmup-decay: linear, or log as DeepSpeed's default")
      ->capture_default_str()
      ->check(CLI::IsMember({"linear", "log"}));
  app.add_option("--lr-decay-steps", lr_decay_steps,
                 "warmup-cosine, warmup-decay: the step where the decay ends (0: --max-steps, else all epochs' steps)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--min-lr-ratio", min_lr_ratio, "warmup-cosine: where the cosine ends, as a fraction of --lr")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--max-grad-norm", max_grad_norm,
                 "clip the gradients to this norm over the whole model, whatever the layout (0: no clipping); the "
                 "metrics then carry grad_norm, the norm before clipping")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--loss-chunk", loss_chunk,
                 "positions whose logits the loss computes at once, so the whole batch's never exist: -1 automatic "
                 "(chunks of 64 MiB of fp32 logits once the batch's would pass 256 MiB), 0 all at once")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{-1}, std::numeric_limits<std::int64_t>::max()));
  app.add_option("--fused", fused,
                 "on: the fused CPU kernels for RMSNorm with its residual add, SwiGLU and rotary embeddings "
                 "(kernels/); off: LibTorch's composite ops for the same maths, for comparison")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option(
         "--weights-read-by", weights_read_by,
         "who reads a model folder's weights (-m): every-rank (each reads only the rows of its pieces) or "
         "rank0 (rank 0 reads each weight and broadcasts it; for files only rank 0 sees) or local-rank0 (each node's "
         "local rank 0 reads and broadcasts over its node; for copies on each node's disk)")
      ->capture_default_str()
      ->check(CLI::IsMember({"every-rank", "rank0"}));
  app.add_option("--activation-checkpointing", activation_checkpointing,
                 "recompute decoder layers in backward instead of keeping their activations: none, full (every "
                 "layer) or k (every k-th layer)")
      ->capture_default_str();
  app.add_flag("--measure-waiting", measure_waiting,
               "time how long each step waits for the slowest rank: a barrier after the step's data, reported as "
               "time/waiting (costs the barrier; ranks that wait long point at a slow data loader or node)");
  app.add_flag("--deterministic", deterministic,
               "deterministic algorithms only: two runs with the same flags give bit-identical losses (an op "
               "without a deterministic kernel is an error)");
  app.add_option("--timeout", timeout_s,
                 "seconds a rendezvous or collective may wait before the run ends naming the rank that did not "
                 "arrive (0: MESHTORCH_TIMEOUT, else 600)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber)
      ->group(per_rank_flags);
  app.add_option("--threads", threads, "intra-op threads (0: LibTorch's default)")
      ->capture_default_str()
      ->group(per_rank_flags);
  app.add_option("--cpu-batch-split", cpu_batch_split,
                 "chapter 1 on a CPU: split each micro-batch's rows into parts, each part's forward and backward "
                 "on its own thread with its share of the intra-op threads (train/core_workers.hpp): auto (2 parts "
                 "with 2 or more threads and --grad-accum 1, so the bits never vary), off, or a count")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& value) -> std::string {
            try {  // the value's form; the run's rules (rows, --deterministic) when the loop starts
              cpu_batch_split_parts(value, {.rows = std::numeric_limits<std::int64_t>::max()});
              return {};
            } catch (const ConfigError& error) {
              return error.what();
            }
          },
          "auto|off|N"))
      ->group(per_rank_flags);
  // Profiling changes no result, so ranks may differ (profile one rank only, say).
  app.add_option("--profile", profile_dir,
                 "profile --profile-steps steps with LibTorch's profiler and write DIR/trace.json (a Chrome trace) "
                 "and DIR/ops.json (per phase, per op: calls, self and total time per step); empty: off")
      ->group(per_rank_flags);
  app.add_option("--profile-from", profile_from,
                 "the first profiled step, counted from this run's first step (the steps before it warm up)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::numeric_limits<std::int64_t>::max()))
      ->group(per_rank_flags);
  app.add_option("--profile-steps", profile_steps, "steps profiled")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::numeric_limits<std::int64_t>::max()))
      ->group(per_rank_flags);
}

MESHTORCH_DECL void FsdpArgs::add_fsdp_flags(CLI::App& app, bool with_cpu_offload) {
  app.add_flag("--reshard-after-forward,!--no-reshard-after-forward", reshard_after_forward,
               "free each layer's gathered weights after its forward and gather them again for backward")
      ->capture_default_str();
  if (with_cpu_offload)
    app.add_flag("--cpu-offload", cpu_offload, "keep shards, gradients and optimizer state in CPU memory")
        ->capture_default_str();
  app.add_option("--prefetch-layers", prefetch_layers,
                 "layers whose all-gather is issued while the one before computes, in forward and backward (0: "
                 "each gathers when it runs); each costs one layer's gathered weights of memory")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
}

MESHTORCH_DECL void PipelineArgs::add_pipeline_flags(CLI::App& app) {
  // -b keeps its meaning (the batch of a data-parallel rank per step): the pipeline cuts it.
  if (auto* batch = app.get_option_no_throw("--batch-size"))
    batch->description("samples per data-parallel rank and step, split into --microbatches micro-batches");
  // A pipeline's step runs forward and backward together: no forward alone to evaluate with. Refused
  // as the flags are parsed, before any weight or data is read.
  if (auto* eval_freq = app.get_option_no_throw("--eval-freq"))
    eval_freq->check(CLI::Validator(
        [](const std::string& value) {
          return value == "0" ? std::string()
                              : std::string(
                                    "a pipeline runs forward and backward together, so it cannot evaluate "
                                    "between steps; evaluate its checkpoints with meshtorch-eval-loss "
                                    "--eval-split instead");
        },
        "", "no evaluation in a pipeline"));
  add_extent_flag(app, "--pp", pp, "pipeline stages' ranks (divides the world)");
  std::vector<std::string> schedules;
  for (const auto& [kind, name] : pp::schedule_flag_names) schedules.emplace_back(name);
  app.add_option("--schedule", schedule, "pipeline schedule: gpipe, 1f1b, interleaved-1f1b or zbv")
      ->capture_default_str()
      ->check(CLI::IsMember(schedules));
  app.add_option("--stages-per-rank", stages_per_rank,
                 "stages each pipeline rank holds (2 or more for interleaved-1f1b; 2 for zbv)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--microbatches", microbatches,
                 "micro-batches each rank's batch (-b) is split into for the schedule (default: the number of stages)")
      ->check(CLI::PositiveNumber);
  app.add_option("--units-per-stage", units_per_stage,
                 "units (the embedding, each layer, the norm with the head) per stage, comma-separated (default: "
                 "balanced by each unit's FLOPs)")
      ->delimiter(',');
}

MESHTORCH_DECL void ContextParallelArgs::add_context_parallel_flags(CLI::App& app) {
  add_extent_flag(app, "--cp", cp,
                  "context-parallel ranks: each holds 2 of the sequence's 2 x CP chunks (-s divides by 2 x CP)");
  std::vector<std::string> methods;
  for (const auto& [rotate, name] : cp::rotate_names) methods.emplace_back(name);
  app.add_option("--cp-rotate", cp_rotate,
                 "how keys and values reach every CP rank: ring (passed on while the current block computes) or "
                 "allgather (gathered once per layer)")
      ->capture_default_str()
      ->check(CLI::IsMember(methods));
}

MESHTORCH_DECL void add_extent_flag(CLI::App& app, const std::string& name, int& extent, const std::string& help) {
  app.add_option(name, extent, help)->capture_default_str()->check(CLI::PositiveNumber);
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(programs)
