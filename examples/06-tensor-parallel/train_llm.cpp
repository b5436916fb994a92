// Chapter 6: tensor parallel, with sequence parallel and loss parallel.
//
// Chapter 2's loop on a two-dimensional mesh, Mesh<DP<dynamic>, TP<N>> (TP innermost, so a TP
// group stays inside a node): every decoder layer's matrices are split over the N ranks of a TP
// group (q/k/v and gate/up by columns, o and down by rows), the norms run on a slice of the
// sequence, the embedding and lm_head are split over the vocabulary and the loss is computed
// without gathering the logits. The plan is a type, llama::Plan<Mesh>, checked at compile time;
// `--tp` picks among the TP sizes this binary is built for. Across TP groups, DDP averages the
// gradients as in chapter 2; all TP ranks of a DP coordinate read the same batch.
#include <chrono>
#include <filesystem>

#include <meshtorch/comm/comm.hpp>
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/parallel.hpp>

namespace mt = meshtorch;

struct Chapter6Args : mt::train::TrainArgs {
  int tp = 2;

  void add_to(CLI::App& app) {
    TrainArgs::add_to(app);
    app.add_option("--tp", tp, "tensor-parallel size: ranks that split each layer (1, 2, 4 or 8; divides the world)")
        ->capture_default_str();
  }

  std::string fingerprint() const {
    return "-m " + model_name + " -d " + dataset_name + " -s " + std::to_string(seq_length) + " -b " +
           std::to_string(batch_size) + " --grad-accum " + std::to_string(grad_accum) + " --seed " +
           std::to_string(seed) + " --dtype " + dtype;
  }
};

template <std::size_t Tp>
int train(const Chapter6Args& args) {
  using Mesh = mt::Mesh<mt::DP<mt::dynamic>, mt::TP<Tp>>;
  using Plan = mt::llama::Plan<Mesh>;  // the guide's plan: sequence parallel + loss parallel

  if (args.threads > 0) torch::set_num_threads(args.threads);
  const auto env = mt::comm::launch_env();
  const auto device = mt::train::resolve_device(args.device, env.local_rank);
  const auto dtype = mt::train::resolve_dtype(args.dtype, device);
  // The plan is part of what every rank must agree on.
  auto mesh = mt::comm::init<Mesh>({.device = device.is_cuda() ? mt::comm::Device::cuda : mt::comm::Device::cpu,
                                    .fingerprint = args.fingerprint() + " | " + Plan::describe(),
                                    .env = env});
  const mt::comm::AxisGroup& dp = mesh.template group<mt::DP>();
  const mt::comm::AxisGroup& tp = mesh.template group<mt::TP>();
  const mt::comm::AxisGroup& world = mesh.world();
  mt::train::Logger log(mesh.rank());
  log.info("rank " + std::to_string(mesh.rank()) + " of " + std::to_string(mesh.world_size()) + " on " +
           device.str() + ": DP " + std::to_string(dp.rank()) + " of " + std::to_string(dp.size()) + ", TP " +
           std::to_string(tp.rank()) + " of " + std::to_string(tp.size()));
  torch::manual_seed(args.seed);

  // Every rank builds the whole model from the same seed, then keeps its piece of each matrix.
  const auto config = mt::llama::resolve_model(args.model_name);
  Plan::validate(config, tp.size(), args.model_name);
  Plan::validate_sequence(args.seq_length, tp.size());
  mt::llama::LlamaForCausalLM model(config, torch::TensorOptions().device(torch::kMeta).dtype(dtype));
  mt::llama::materialize(model, torch::TensorOptions().device(device).dtype(dtype));
  mt::llama::load_pretrained_weights_if_present(model, args.model_name);
  auto tensor_parallel = mt::parallelize<Plan>(model, tp);
  mt::DistributedDataParallel ddp(model, dp);
  log.info("plan " + Plan::describe());
  std::int64_t local_parameters = 0;
  for (const auto& p : model->parameters()) local_parameters += p.numel();
  log.info("model " + args.model_name + ": " + std::to_string(config.num_parameters()) + " parameters, " +
           std::to_string(local_parameters) + " on this rank, " + mt::llama::dtype_name(dtype));

  // All TP ranks of a DP coordinate take the same samples: the sampler sees only the DP axis.
  const auto blocks = mt::rank_zero_first(world, [&] { return mt::data::load_dataset(args.dataset_name, args.seq_length); });
  blocks.check_vocab(config.vocab_size);
  const mt::data::DpInvariantSampler sampler({.num_samples = blocks.size(), .batch_size = args.batch_size,
                                               .dp_size = dp.size(), .dp_rank = dp.rank(),
                                               .grad_accum = args.grad_accum, .seed = args.seed});
  const mt::train::CosineSchedule schedule(args.lr);
  mt::train::AdamW optimizer(mt::train::named_trainable_parameters(*model), {.lr = args.lr});

  mt::train::TrainState state;
  const mt::train::RunIdentity identity{args.seed, args.seq_length, sampler.global_batch(), args.dataset_name,
                                        args.model_name};
  const std::filesystem::path exp_dir = std::filesystem::path(args.save_dir) / args.experiment_name;
  mt::train::MetricsFile metrics;
  if (!args.experiment_name.empty()) {
    mt::on_rank_zero(world, [&] { std::filesystem::create_directories(exp_dir); });
    if (auto resumed = mt::parallel::load_checkpoint(exp_dir, tensor_parallel, model, optimizer, identity, world)) {
      state = *resumed;
      log.info("resumed from " + (exp_dir / "checkpoint").string() + " at global_step " +
               std::to_string(state.global_step));
    }
    if (mesh.rank() == 0) metrics = mt::train::MetricsFile(exp_dir / "metrics.jsonl");
  }

  mt::train::PhaseTimers timers(device);
  // Tokens of the global batch: dp_size x batch x grad-accum x seq (TP ranks share theirs).
  mt::train::LogWindow window(device, /*tokens_per_step=*/sampler.global_batch() * args.seq_length);

  for (; state.epoch < args.num_epochs; ++state.epoch, state.epoch_step = 0) {
    mt::data::PrefetchingLoader loader(blocks, sampler, state.epoch, state.epoch_step, device.is_cuda());
    mt::train::ProgressBar progress(sampler.steps_per_epoch(), /*enabled=*/mesh.rank() == 0);
    while (state.epoch_step < sampler.steps_per_epoch()) {
      if (args.max_steps > 0 && state.global_step >= args.max_steps) return 0;

      torch::Tensor step_loss = torch::zeros({}, torch::TensorOptions().device(device).dtype(torch::kDouble));
      for (std::int64_t micro = 0; micro < sampler.micro_batches(); ++micro) {
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
          // Logits stay split over the vocabulary; the loss is reduced across the TP group.
          loss = ddp([&] { return tensor_parallel.loss(input_ids, /*labels=*/input_ids); }) /
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
      // Every TP rank holds the same loss; the global batch's is the mean over DP.
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
        mt::parallel::save_checkpoint(exp_dir, tensor_parallel, model, optimizer, state, identity, world, dp.rank());
        log.info("saved checkpoint at global_step " + std::to_string(state.global_step));
        window.exclude(std::chrono::steady_clock::now() - save_start);
      }
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"Chapter 6: tensor parallel with sequence parallel and loss parallel"};
  Chapter6Args args;
  args.add_to(app);
  CLI11_PARSE(app, argc, argv);
  return mt::comm::run_recorded([&] {
    // Each TP size is its own mesh type, so its plan is checked when this compiles.
    switch (args.tp) {
      case 1: return train<1>(args);
      case 2: return train<2>(args);
      case 4: return train<4>(args);
      case 8: return train<8>(args);
    }
    throw mt::ConfigError("--tp " + std::to_string(args.tp) + ": this binary is built for TP sizes 1, 2, 4 and 8");
  });
}
