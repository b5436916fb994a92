// Chapter 2: data-parallel training with DistributedDataParallel and ZeroRedundancyOptimizer.
//
// Chapter 1's loop, with: one process per device started by a launcher (meshrun, torchrun
// --no-python, srun, mpirun); a Mesh<DP<dynamic>> over all ranks; the model replicated by
// parallelize() (rank 0's weights broadcast, gradients all-reduced in buckets while backward
// runs); AdamW state sharded by ZeroRedundancyOptimizer (--zero, the default); the
// data-parallel-invariant sampler, so each rank takes its part of the same global batch;
// gradient accumulation that skips the all-reduce on all micro-batches but the last; rank 0
// preparing data first, and alone writing the experiment folder, metrics and checkpoints.
#include <variant>

#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/launch.hpp>
#include <meshtorch/parallel/training_data.hpp>
#include <meshtorch/train/args.hpp>
#include <meshtorch/train/tensorboard.hpp>

namespace mt = meshtorch;
using Mesh = mt::Mesh<mt::DP<mt::dynamic>>;

struct Chapter2Args : mt::train::TrainArgs {
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
  const auto [blocks, sampler] = mt::load_training_data(args, config.vocab_size, model);
  log.info(fmt::format("{} blocks of {} tokens, {} steps per epoch, global batch {}", blocks.size(), args.seq_length,
                       sampler.steps_per_epoch(), sampler.global_batch()));

  const double lr =
      mt::scaled_lr(args.lr, mt::parse_lr_scaling(args.lr_scaling), sampler.global_batch() / args.batch_size);
  const auto schedule = mt::train::lr_schedule(args, sampler.steps_per_epoch(), lr);
  using Optimizer = std::variant<mt::train::AdamW, mt::ZeroRedundancyOptimizer>;
  const auto named = model.named_parameters();
  Optimizer optimizer = args.zero
                            ? Optimizer(std::in_place_type<mt::ZeroRedundancyOptimizer>, named, mesh.group<mt::DP>(),
                                        mt::train::AdamWOptions{.lr = lr})
                            : Optimizer(std::in_place_type<mt::train::AdamW>, named, mt::train::AdamWOptions{.lr = lr});

  return std::visit(
      [&](auto& optimizer) {
        if constexpr (std::is_same_v<std::decay_t<decltype(optimizer)>, mt::ZeroRedundancyOptimizer>)
          log.info(
              fmt::format("ZeroRedundancyOptimizer: this rank holds {} elements of optimizer state for {} of {} "
                          "parameters",
                          optimizer.state_numel(), optimizer.owned_parameters().size(), named.size()));

        mt::train::Experiment experiment(args, mesh.rank(), sampler.global_batch(), device,
                                         mt::train::tensorboard_tracker(args, mesh.rank()));
        auto state = experiment.resume(model, optimizer);
        mt::train::PhaseTimers timers(device);

        for (; state.epoch < args.num_epochs; ++state.epoch, state.epoch_step = 0) {
          mt::data::PrefetchingLoader loader(blocks, sampler, state.epoch, state.epoch_step, device.is_cuda());
          mt::train::ProgressBar progress(sampler.steps_per_epoch(), /*enabled=*/mesh.rank() == 0);
          while (state.epoch_step < sampler.steps_per_epoch()) {
            if (args.max_steps > 0 && state.global_step >= args.max_steps) return 0;

            torch::Tensor step_loss = torch::zeros({}, torch::TensorOptions().device(device).dtype(torch::kDouble));
            for (std::int64_t micro = 0; micro < sampler.micro_batches(); ++micro) {
              // All micro-batches but the last accumulate locally; the last one's backward
              // all-reduces the accumulated sum.
              std::optional<decltype(model.no_sync())> no_sync;
              if (micro + 1 < sampler.micro_batches()) no_sync.emplace(model.no_sync());
              torch::Tensor input_ids;
              {
                auto timer = timers.time("data");
                input_ids = loader.next()->input_ids.to(device, /*non_blocking=*/true);
              }
              if (args.measure_waiting && micro == 0) model.wait_for_slowest(timers);  // the guide's waiting time
              torch::Tensor loss;
              {
                auto timer = timers.time("forward");
                loss = model.loss(input_ids, /*labels=*/input_ids) / static_cast<double>(sampler.micro_batches());
              }
              {
                auto timer = timers.time("backward");
                loss.backward();
              }
              step_loss += loss.detach().to(torch::kDouble);
            }
            {
              auto timer = timers.time("update");
              if (args.max_grad_norm > 0) state.grad_norm = model.clip_grad_norm(args.max_grad_norm);
              optimizer.set_lr(schedule.lr_at(state.global_step));
              optimizer.step();
              optimizer.zero_grad();
            }
            experiment.end_step(state, model.mean_over_data_parallel(step_loss).item<double>(), progress);
            if (state.global_step % args.log_freq == 0)
              experiment.log_metrics(state, sampler.steps_per_epoch(), schedule.lr_at(state.global_step), timers);
            if (experiment.checkpoint_due(state, sampler.steps_per_epoch())) experiment.save(state, model, optimizer);
          }
        }
        return 0;
      },
      optimizer);
}

int main(int argc, char** argv) {
  CLI::App app{"Chapter 2: data-parallel training with DistributedDataParallel and ZeroRedundancyOptimizer"};
  Chapter2Args args;
  args.add_to(app);
  CLI11_PARSE(app, argc, argv);
  return mt::comm::run_recorded([&] { return train(args); });
}
