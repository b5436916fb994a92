#pragma once
// The guide's flags as plain values: what the library's training scaffolding (experiment folder,
// training data) reads. Parsing them is the program's business: train/args.hpp adds them to a
// CLI::App and defines add_to() and fingerprint(), so that this header does not pull in CLI11.
#include <cstdint>
#include <string>
#include <vector>

#include <meshtorch/separate_compilation.hpp>

namespace CLI {
class App;
}  // namespace CLI

namespace meshtorch::train {

struct TrainArgs {
  std::string experiment_name;  // empty: no checkpoints, no metrics file
  std::string resume_from;      // a checkpoint or experiment folder to start from instead of -e's
  bool no_resume = false;       // start at step 0 even when -e's folder holds a checkpoint
  std::string dataset_name = "builtin";
  std::string dataset_subset;  // a subfolder of the folder -d names (data/data_files.hpp)
  double eval_split = 0;       // the last fraction of -d's blocks, held out of training (TokenBlocks::hold_out)
  std::int64_t eval_freq = 0;  // evaluate on them every N steps (train/evaluation.hpp); 0: never
  bool tensorboard = false;    // event files under <save-dir>/<experiment>/tensorboard (train/tensorboard.hpp)
  std::string tracking_ranks = "rank0";  // which ranks write them: rank0, node or all
  std::string model_name = "llama-tiny";
  std::string save_dir = "runs";
  std::uint64_t seed = 0;
  std::int64_t num_epochs = 100;
  double lr = 3e-4;
  std::int64_t batch_size = 8;
  std::int64_t log_freq = 10;
  std::int64_t ckpt_freq = 500;
  int keep_checkpoints = 2;  // the newest complete checkpoints an experiment keeps
  std::int64_t seq_length = 256;
  std::int64_t max_steps = 0;  // 0: until num_epochs are done
  std::string device = "auto";
  std::string dtype = "auto";
  std::int64_t grad_accum = 1;
  std::int64_t global_batch_size = 0;  // 0: -b x data-parallel ranks x --grad-accum
  std::string lr_schedule = "cosine";  // train/lr_schedule.hpp
  std::int64_t warmup_steps = 0;
  std::string warmup_type = "linear";
  std::int64_t lr_decay_steps = 0;  // 0: --max-steps, else every epoch's steps
  double min_lr_ratio = 1e-4;
  double max_grad_norm = 0;      // 0: no clipping
  std::int64_t loss_chunk = -1;  // positions whose logits the loss computes at once; -1 automatic
  std::string fused = "on";      // on: kernels/'s fused CPU kernels; off: the composite ops
  std::string weights_read_by =
      "every-rank";  // who reads -m's weights: every-rank, rank0 or local-rank0 (parallel/parallelize.hpp)
  std::string activation_checkpointing = "none";  // none, full or k (parallel/activation_checkpointing.hpp)
  bool measure_waiting = false;  // time/waiting: a barrier after each step's data (multi-rank chapters)
  bool deterministic = false;    // deterministic algorithms only (train::use_deterministic_algorithms)
  int threads = 0;               // 0: LibTorch's default
  // Chapter 1 on a CPU: the parts each micro-batch's rows are split into, one thread each
  // (train/core_workers.hpp): "auto" (2 with 2 or more intra-op threads), "off", or a count.
  std::string cpu_batch_split = "auto";
  double timeout_s = 0;  // rendezvous and collectives; 0: MESHTORCH_TIMEOUT, else 600 s

  // --profile (train/profiler.hpp): steps recorded by LibTorch's profiler.
  std::string profile_dir;         // empty: no profile
  std::int64_t profile_from = 5;   // the run's first profiled step, after warm-up
  std::int64_t profile_steps = 3;  // steps profiled

  // Both defined in train/args.hpp.
  // The flags every rank must share (all that were parsed by the app these were added to).
  MESHTORCH_DECL std::string fingerprint() const;
  MESHTORCH_DECL void add_to(CLI::App& app);

 private:
  const CLI::App* app_ = nullptr;
};

// The flags of the chapters that shard with FSDP (4, 5, 7): fully_shard's options. A chapter's
// args derive from TrainArgs and this, and call add_fsdp_flags after TrainArgs::add_to.
struct FsdpArgs {
  bool reshard_after_forward = true;
  bool cpu_offload = false;
  std::int64_t prefetch_layers = 1;

  // Defined in train/args.hpp. Without --cpu-offload where the chapter's mesh cannot offload.
  MESHTORCH_DECL void add_fsdp_flags(CLI::App& app, bool with_cpu_offload = true);
};

// Chapter 11's pipeline flags (docs/pipeline.md): --pp, --schedule, --stages-per-rank,
// --microbatches, --units-per-stage.
struct PipelineArgs {
  int pp = 2;
  std::string schedule = "1f1b";
  int stages_per_rank = 1;
  int microbatches = 0;  // 0: as many as stages
  std::vector<int> units_per_stage;

  // Defined in train/args.hpp.
  MESHTORCH_DECL void add_pipeline_flags(CLI::App& app);
};

// Chapter 12's flags: the context-parallel ranks and how keys and values reach them.
struct ContextParallelArgs {
  int cp = 1;  // off; chapter 12 starts at 2
  std::string cp_rotate = "ring";

  // Defined in train/args.hpp.
  MESHTORCH_DECL void add_context_parallel_flags(CLI::App& app);
};

// A mesh axis's extent given at start-up (chapters 6 and 7's --tp and --dp): a positive integer,
// its default shown in --help. Defined in train/args.hpp.
MESHTORCH_DECL void add_extent_flag(CLI::App& app, const std::string& name, int& extent, const std::string& help);

}  // namespace meshtorch::train
