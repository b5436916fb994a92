// Chapter 7: 2D parallel: tensor parallel inside a node, FSDP across nodes.
//
// Chapter 6's tensor-parallel plan, then chapter 4's fully_shard over the data-parallel ranks:
// each rank keeps its TP piece of every matrix, and of that piece only its FSDP rows. The mesh
// is Mesh<DP, FSDP, TP> with every extent given at start-up: `--tp` ranks split each layer,
// `--dp` replicas each hold a full FSDP copy (HSDP), and the rest of the world is FSDP (the
// guide's mesh (world / tp, tp) is --dp 1). parallelize() reads the axes from the type and
// applies TP, then FSDP per layer and the root, then replication over DP; the model is built
// on the meta device, so no rank ever holds more than its pieces plus one full weight.
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/launch.hpp>
#include <meshtorch/parallel/training_data.hpp>
#include <meshtorch/train/args.hpp>
#include <meshtorch/train/tensorboard.hpp>

namespace mt = meshtorch;
using Mesh = mt::Mesh<mt::DP<mt::dynamic>, mt::FSDP<mt::dynamic>, mt::TP<mt::dynamic>>;

struct Chapter7Args : mt::train::TrainArgs, mt::train::FsdpArgs {
  int tp = 2;
  int dp = 1;

  void add_to(CLI::App& app) {
    TrainArgs::add_to(app);
    app.add_option("--tp", tp, "tensor-parallel size (divides the world); the rest is FSDP")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    app.add_option("--dp", dp, "replicas of the FSDP x TP model (HSDP: shard inside, all-reduce across)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    add_fsdp_flags(app, /*with_cpu_offload=*/false);  // --reshard-after-forward, --prefetch-layers
  }
};

int train(const Chapter7Args& args) {
  using Plan = mt::llama::Plan<Mesh>;  // the guide's plan: sequence parallel + loss parallel
  auto [env, device, dtype, mesh, log] =
      mt::launch<Mesh>(args, {args.dp, mt::from_world_size, args.tp}, Plan::describe());

  // The model on the meta device, then the parallel model the mesh type describes.
  const auto config = mt::llama::resolve_model(args.model_name);
  auto options = mt::parallelize_options(args, device);  // -m's weights, --activation-checkpointing, ...
  options.fsdp = mt::fsdp_options(args, dtype);
  auto model = mt::parallelize(
      mt::llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta).dtype(dtype)), mesh, options);
  log.info(model.summary());

  // The data-parallel ranks (DP x FSDP) split the global batch; a TP group reads one batch.
  const auto [blocks, sampler] = mt::load_training_data(args, config.vocab_size, model);
  mt::train::AdamW optimizer(model.named_parameters(), {.lr = args.lr});
  const auto schedule = mt::train::lr_schedule(args, sampler.steps_per_epoch());

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
        // All micro-batches but the last skip the DP all-reduce (FSDP still reduce-scatters).
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
}

int main(int argc, char** argv) {
  CLI::App app{"Chapter 7: 2D parallel: tensor parallel inside a node, FSDP across nodes"};
  Chapter7Args args;
  args.add_to(app);
  CLI11_PARSE(app, argc, argv);
  return mt::comm::run_recorded([&] { return train(args); });
}
