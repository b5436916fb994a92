// Chapter 9: diagnosing errors. Chapter 2's data-parallel loop with one failure caused on purpose
// (--fault, on rank --fault-rank at step --fault-step), so that what meshtorch reports for each
// can be seen, and tested, before a real run meets it:
//
//   hang    the rank stops making progress in its own code (a deadlock, a dead file system);
//   desync  the rank issues a collective the others do not (a metric only one rank reduces);
//   crash   the rank dies of a signal (SIGSEGV);
//   nan     the rank's loss turns NaN, and with it every rank's averaged gradients;
//   slow    the rank takes 100 ms longer per step from then on (a slow data loader or node):
//           with --measure-waiting the others' time/waiting shows it.
//
// A flag that differs between ranks needs no fault: start the ranks with different flags (see
// the README). The rest is the library's: the start-up flag check, --timeout and the watchdog
// naming the culprit, the flight recorder and meshtorch-diagnose, stack dumps (meshrun
// --dump-stacks), error files, and meshtorch-doctor's checklist.
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <thread>

#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/launch.hpp>
#include <meshtorch/parallel/training_data.hpp>
#include <meshtorch/train/args.hpp>
#include <meshtorch/train/tensorboard.hpp>

namespace mt = meshtorch;
using Mesh = mt::Mesh<mt::DP<mt::dynamic>>;

struct Chapter9Args : mt::train::TrainArgs {
  std::string fault = "none";
  int fault_rank = 1;
  std::int64_t fault_step = 5;

  void add_to(CLI::App& app) {
    TrainArgs::add_to(app);
    app.add_option("--fault", fault, "the failure to cause: none, hang, desync, crash, nan, slow")
        ->capture_default_str()
        ->check(CLI::IsMember({"none", "hang", "desync", "crash", "nan", "slow"}));
    app.add_option("--fault-rank", fault_rank, "the rank that fails")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    app.add_option("--fault-step", fault_step, "the optimizer step at which it fails")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
  }
};

// Called by every rank at the start of each step; the chosen rank fails there, in the first
// attempt only: restarted by meshrun --max-restarts (TORCHELASTIC_RESTART_COUNT > 0), the run
// goes on from its last checkpoint, as after a transient fault. Returns the factor the rank's
// loss is multiplied by (NaN for the nan fault).
double cause_fault(const Chapter9Args& args, const mt::comm::DeviceMesh<Mesh>& mesh, std::int64_t step,
                   const mt::train::Logger& log) {
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const bool first_attempt = !restarts || std::string(restarts) == "0";
  if (args.fault == "none" || !first_attempt || mesh.rank() != args.fault_rank || step < args.fault_step) return 1.0;
  if (args.fault == "slow") {
    if (step == args.fault_step) log.warning(fmt::format("causing the 'slow' fault from step {} on", step));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // a slow data loader or node, every step
    return 1.0;
  }
  if (step != args.fault_step) return 1.0;
  log.warning(fmt::format("causing the '{}' fault at step {}", args.fault, step));
  if (args.fault == "hang")
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  if (args.fault == "desync") {
    const auto& group = mesh.group<mt::DP>();
    mt::comm::all_reduce(group, torch::ones({1}, torch::Device(group.device_name())));
  }
  if (args.fault == "crash") std::raise(SIGSEGV);
  return args.fault == "nan" ? std::nan("") : 1.0;
}

int train(const Chapter9Args& args) {
  auto [env, device, dtype, mesh, log] = mt::launch<Mesh>(args);
  if (args.grad_accum != 1 || args.global_batch_size != 0)
    throw mt::ConfigError(
        "--grad-accum / --global-batch-size: chapter 9 runs one micro-batch per step (chapter 2 shows accumulation)");
  if (args.fault_rank >= mesh.world_size())
    throw mt::ConfigError(
        fmt::format("--fault-rank {} is not a rank of this {}-rank run", args.fault_rank, mesh.world_size()));
  const auto config = mt::llama::resolve_model(args.model_name);
  auto model =
      mt::parallelize(mt::llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta).dtype(dtype)),
                      mesh, mt::parallelize_options(args, device));
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
      const double factor = cause_fault(args, mesh, state.global_step + 1, log);

      torch::Tensor input_ids;
      {
        auto timer = timers.time("data");
        input_ids = loader.next()->input_ids.to(device, /*non_blocking=*/true);
      }
      if (args.measure_waiting) model.wait_for_slowest(timers);  // the guide's waiting time
      torch::Tensor loss;
      {
        auto timer = timers.time("forward");
        loss = model.loss(input_ids, /*labels=*/input_ids) * factor;
      }
      {
        auto timer = timers.time("backward");
        loss.backward();
      }
      {
        auto timer = timers.time("update");
        if (args.max_grad_norm > 0) state.grad_norm = model.clip_grad_norm(args.max_grad_norm);
        optimizer.set_lr(schedule.lr_at(state.global_step));
        optimizer.step();
        optimizer.zero_grad();
      }
      experiment.end_step(state, model.mean_over_data_parallel(loss.detach().to(torch::kDouble)).item<double>(),
                          progress);
      if (state.global_step % args.log_freq == 0)
        experiment.log_metrics(state, sampler.steps_per_epoch(), schedule.lr_at(state.global_step), timers);
      if (experiment.checkpoint_due(state, sampler.steps_per_epoch())) experiment.save(state, model, optimizer);
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app{"Chapter 9: diagnosing errors: chapter 2's loop with a failure caused on purpose"};
  Chapter9Args args;
  args.add_to(app);
  CLI11_PARSE(app, argc, argv);
  return mt::comm::run_recorded([&] { return train(args); });
}
