// Chapter 2: data-parallel training with DistributedDataParallel and ZeroRedundancyOptimizer.
//
// Chapter 1's loop, with: one process per device started by a launcher (meshrun, torchrun
// --no-python, srun, mpirun); a Mesh<DP<dynamic>> over all ranks; the model wrapped in
// DistributedDataParallel (rank 0's weights broadcast, gradients all-reduced in buckets while
// backward runs); AdamW state sharded by ZeroRedundancyOptimizer (--zero, the default); the
// data-parallel-invariant sampler, so each rank takes its part of the same global batch;
// gradient accumulation that skips the all-reduce on all micro-batches but the last; rank 0
// preparing data first, and alone writing the experiment folder, metrics and checkpoints.
#include <chrono>
#include <filesystem>
#include <variant>

#include <meshtorch/comm/comm.hpp>
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/parallel.hpp>

namespace mt = meshtorch;
using Dp = mt::Mesh<mt::DP<mt::dynamic>>;

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

  // What every rank must agree on; a rank started with other flags fails at init.
  std::string fingerprint() const {
    return "-m " + model_name + " -d " + dataset_name + " -s " + std::to_string(seq_length) + " -b " +
           std::to_string(batch_size) + " --grad-accum " + std::to_string(grad_accum) + " --seed " +
           std::to_string(seed) + " --zero " + std::to_string(zero) + " --dtype " + dtype;
  }
};

int train(const Chapter2Args& args) {
  if (args.threads > 0) torch::set_num_threads(args.threads);
  const auto env = mt::comm::launch_env();
  const auto device = mt::train::resolve_device(args.device, env.local_rank);
  const auto dtype = mt::train::resolve_dtype(args.dtype, device);
  auto mesh = mt::comm::init<Dp>({.device = device.is_cuda() ? mt::comm::Device::cuda : mt::comm::Device::cpu,
                                  .fingerprint = args.fingerprint(),
                                  .env = env});
  const auto& dp = mesh.group<mt::DP>();
  const auto& world = mesh.world();
  mt::train::Logger log(mesh.rank());
  log.info("rank " + std::to_string(mesh.rank()) + " of " + std::to_string(mesh.world_size()) + " on " +
           device.str() + ", DP coordinate " + std::to_string(dp.rank()) + " of " + std::to_string(dp.size()));
  torch::manual_seed(args.seed);

  // Every rank builds the model; DDP then broadcasts rank 0's weights so all replicas are equal.
  const auto config = mt::llama::resolve_model(args.model_name);
  mt::llama::LlamaForCausalLM model(config, torch::TensorOptions().device(torch::kMeta).dtype(dtype));
  mt::llama::materialize(model, torch::TensorOptions().device(device).dtype(dtype));
  mt::llama::load_pretrained_weights_if_present(model, args.model_name);
  mt::DistributedDataParallel ddp(model, dp, {.bucket_cap_mb = args.bucket_cap_mb});
  log.info("model " + args.model_name + ": " + std::to_string(config.num_parameters()) + " parameters, " +
           mt::llama::dtype_name(dtype) + ", " + std::to_string(ddp.buckets().size()) + " gradient buckets");

  // Rank 0 tokenises (or downloads) first; the others follow once it is done.
  const auto blocks = mt::rank_zero_first(world, [&] { return mt::data::load_dataset(args.dataset_name, args.seq_length); });
  blocks.check_vocab(config.vocab_size);
  const mt::data::DpInvariantSampler sampler({.num_samples = blocks.size(), .batch_size = args.batch_size,
                                               .dp_size = dp.size(), .dp_rank = dp.rank(),
                                               .grad_accum = args.grad_accum, .seed = args.seed});
  log.info(std::to_string(blocks.size()) + " blocks of " + std::to_string(args.seq_length) + " tokens, " +
           std::to_string(sampler.steps_per_epoch()) + " steps per epoch, global batch " +
           std::to_string(sampler.global_batch()));

  const double lr = mt::scaled_lr(args.lr, mt::parse_lr_scaling(args.lr_scaling), sampler.global_batch() / args.batch_size);
  const mt::train::CosineSchedule schedule(lr);
  using Optimizer = std::variant<mt::train::AdamW, mt::ZeroRedundancyOptimizer>;
  auto named = mt::train::named_trainable_parameters(*model);
  Optimizer optimizer = args.zero ? Optimizer(std::in_place_type<mt::ZeroRedundancyOptimizer>, named, dp,
                                              mt::train::AdamWOptions{.lr = lr})
                                  : Optimizer(std::in_place_type<mt::train::AdamW>, named, mt::train::AdamWOptions{.lr = lr});

  return std::visit([&](auto& optimizer) {
    if constexpr (std::is_same_v<std::decay_t<decltype(optimizer)>, mt::ZeroRedundancyOptimizer>)
      log.info("ZeroRedundancyOptimizer: this rank holds " + std::to_string(optimizer.state_numel()) +
               " elements of optimizer state for " + std::to_string(optimizer.owned_parameters().size()) + " of " +
               std::to_string(named.size()) + " parameters");

    // The experiment folder: rank 0 creates it; every rank resumes from its checkpoint.
    mt::train::TrainState state;
    const mt::train::RunIdentity identity{args.seed, args.seq_length, sampler.global_batch(), args.dataset_name,
                                          args.model_name};
    const std::filesystem::path exp_dir = std::filesystem::path(args.save_dir) / args.experiment_name;
    mt::train::MetricsFile metrics;
    if (!args.experiment_name.empty()) {
      mt::on_rank_zero(world, [&] { std::filesystem::create_directories(exp_dir); });
      if (auto resumed = mt::parallel::load_checkpoint(exp_dir, model, optimizer, identity, world)) {
        state = *resumed;
        log.info("resumed from " + (exp_dir / "checkpoint").string() + " at global_step " +
                 std::to_string(state.global_step));
      }
      if (mesh.rank() == 0) metrics = mt::train::MetricsFile(exp_dir / "metrics.jsonl");
    }

    mt::train::PhaseTimers timers(device);
    // The whole job's tokens: world x batch x grad-accum x seq.
    mt::train::LogWindow window(device, /*tokens_per_step=*/sampler.global_batch() * args.seq_length);

    for (; state.epoch < args.num_epochs; ++state.epoch, state.epoch_step = 0) {
      mt::data::PrefetchingLoader loader(blocks, sampler, state.epoch, state.epoch_step, device.is_cuda());
      mt::train::ProgressBar progress(sampler.steps_per_epoch(), /*enabled=*/mesh.rank() == 0);
      while (state.epoch_step < sampler.steps_per_epoch()) {
        if (args.max_steps > 0 && state.global_step >= args.max_steps) return 0;

        torch::Tensor step_loss = torch::zeros({}, torch::TensorOptions().device(device).dtype(torch::kDouble));
        for (std::int64_t micro = 0; micro < sampler.micro_batches(); ++micro) {
          // All micro-batches but the last accumulate locally; the last one's backward
          // all-reduces the accumulated sum.
          std::optional<mt::DistributedDataParallel::NoSync> no_sync;
          if (micro + 1 < sampler.micro_batches()) no_sync.emplace(ddp.no_sync());
          torch::Tensor input_ids;
          {
            auto timer = timers.time("data");
            input_ids = loader.next()->input_ids.to(device, /*non_blocking=*/true);
          }
          torch::Tensor loss;
          {
            auto timer = timers.time("forward");
            loss = ddp([&] { return model->loss(input_ids, /*labels=*/input_ids); }) /
                   static_cast<double>(sampler.micro_batches());
          }
          {
            auto timer = timers.time("backward");
            loss.backward();
          }
          step_loss += loss.detach().to(torch::kDouble);
        }
        {
          auto timer = timers.time("update");
          optimizer.set_lr(schedule.lr_at(state.global_step));
          optimizer.step();
          optimizer.zero_grad();
        }
        // The loss of the global batch: the mean over the data-parallel ranks.
        const double global_loss = mt::comm::all_reduce(dp, step_loss, mt::comm::ReduceOp::avg).item<double>();
        ++state.global_step;
        ++state.epoch_step;
        state.running_loss += global_loss;
        ++state.running_steps;
        progress.update(state.epoch_step, "loss=" + std::to_string(global_loss));

        if (state.global_step % args.log_freq == 0) {
          const auto record = window.record(state, sampler.steps_per_epoch(), schedule.lr_at(state.global_step), timers);
          if (mesh.rank() == 0) {
            log.info(mt::train::format_metrics(record));
            metrics.append(record);
          }
          window.close(state, timers);
        }
        if (!args.experiment_name.empty() && state.global_step % args.ckpt_freq == 0) {
          const auto save_start = std::chrono::steady_clock::now();
          mt::parallel::save_checkpoint(exp_dir, model, optimizer, state, identity, world);
          log.info("saved checkpoint at global_step " + std::to_string(state.global_step));
          window.exclude(std::chrono::steady_clock::now() - save_start);  // saving is not training
        }
      }
    }
    return 0;
  }, optimizer);
}

int main(int argc, char** argv) {
  CLI::App app{"Chapter 2: data-parallel training with DistributedDataParallel and ZeroRedundancyOptimizer"};
  Chapter2Args args;
  args.add_to(app);
  CLI11_PARSE(app, argc, argv);
  return mt::comm::run_recorded([&] { return train(args); });
}
