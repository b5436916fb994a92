// Chapter 2: data-parallel training with DistributedDataParallel and ZeroRedundancyOptimizer.
//
// Chapter 1's loop, with: one process per device started by a launcher (meshrun, torchrun
// --no-python, srun, mpirun); a Mesh<DP<dynamic>> over all ranks; the model replicated by
// parallelize() (rank 0's weights broadcast, gradients all-reduced in buckets while backward
// runs); AdamW state sharded by ZeroRedundancyOptimizer (--zero, the default); the
// data-parallel-invariant sampler, so each rank takes its part of the same global batch;
// gradient accumulation that skips the all-reduce on all micro-batches but the last; rank 0
// preparing data first, and alone writing the experiment folder, metrics and checkpoints.
#include <memory>

#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/launch.hpp>
#include <meshtorch/parallel/training_data.hpp>
#include <meshtorch/train/args.hpp>
#include <meshtorch/train/loop.hpp>
#include <meshtorch/train/run_main.hpp>

namespace mt = meshtorch;
using Mesh = mt::Mesh<mt::DP<mt::dynamic>>;

struct Chapter2Args : mt::train::TrainArgs {
  static constexpr auto description =
      "Chapter 2: data-parallel training with DistributedDataParallel and ZeroRedundancyOptimizer";
  bool zero = true;
  double bucket_cap_mb = 25;
  std::string lr_scaling = "none";

  void add_to(CLI::App& app) {
    TrainArgs::add_to(app);
    app.add_flag("--zero,!--no-zero", zero, "shard AdamW's state across ranks with ZeroRedundancyOptimizer")
        ->capture_default_str();
    app.add_option("--bucket-cap-mb", bucket_cap_mb, "DDP gradient bucket size in MiB")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    app.add_option("--lr-scaling", lr_scaling,
                   "scale --lr with the global batch over one rank's batch (ranks x grad-accum): none, linear, sqrt")
        ->capture_default_str()
        ->check(CLI::IsMember({"none", "linear", "sqrt"}));
  }
};

int train(const Chapter2Args& args) {
  auto [env, device, dtype, mesh, log] = mt::launch<Mesh>(args);

  // Every rank builds the model; DDP then broadcasts rank 0's weights so all replicas are equal.
  const auto config = mt::llama::resolve_model(args.model_name);
  auto options = mt::parallelize_options(args, device);  // -m's weights, --activation-checkpointing, ...
  options.ddp = {.bucket_cap_mb = args.bucket_cap_mb};
  auto model = mt::parallelize(
      mt::llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta).dtype(dtype)), mesh, options);
  const auto* ddp = model.data_parallel_replication();
  log.info(fmt::format("model {}: {} parameters, {}, {} gradient buckets", args.model_name, config.num_parameters(),
                       mt::llama::dtype_name(dtype), ddp ? ddp->buckets().size() : 0));

  // Rank 0 tokenises (or downloads) first; the others follow once it is done.
  const auto [blocks, sampler] = mt::load_training_data(args, config, model);
  log.info(fmt::format("{} blocks of {} tokens, {} steps per epoch, global batch {}", blocks.size(), args.seq_length,
                       sampler.steps_per_epoch(), sampler.global_batch()));

  const double lr =
      mt::scaled_lr(args.lr, mt::parse_lr_scaling(args.lr_scaling), sampler.global_batch() / args.batch_size);
  // AdamW, or AdamW whose state each rank holds for its share of the parameters (ZeRO-1).
  std::unique_ptr<mt::train::Optimizer> optimizer;
  if (args.zero) {
    auto zero = std::make_unique<mt::ZeroRedundancyOptimizer>(model.named_parameters(), mesh.group<mt::DP>(),
                                                              mt::train::AdamWOptions{.lr = lr});
    log.info(zero->summary());
    optimizer = std::move(zero);
  } else {
    optimizer = std::make_unique<mt::train::AdamW>(model.named_parameters(), mt::train::AdamWOptions{.lr = lr});
  }

  mt::train::Loop loop(args, model, *optimizer, blocks, sampler, mesh.rank(), device);
  for (auto state = loop.resume(); loop.next_step(state); loop.end_step(state)) {
    for (std::int64_t micro = 0; micro < sampler.micro_batches(); ++micro) {
      // All micro-batches but the last accumulate locally; the last one's backward all-reduces.
      std::optional<decltype(model.no_sync())> no_sync;
      if (micro + 1 < sampler.micro_batches()) no_sync.emplace(model.no_sync());
      const auto input_ids = loop.next_batch();
      loop.backward(loop.timed("forward", [&] { return model.loss(input_ids, /*labels=*/input_ids); }));
    }
    loop.timed("update", [&] { loop.update(state); });
  }
  return 0;
}

int main(int argc, char** argv) { return mt::train::run_main<Chapter2Args>(argc, argv, train); }
