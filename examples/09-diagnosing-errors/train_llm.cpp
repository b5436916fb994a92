// Chapter 9: diagnosing errors. Chapter 2's data-parallel loop with one failure caused on purpose
// (--fault, on rank --fault-rank at step --fault-step), so that what meshtorch reports for each
// can be seen, and tested, before a real run meets it: hang (the rank stops making progress in its
// own code), desync (it issues a collective the others do not), crash (SIGSEGV), nan (its loss,
// and so every rank's averaged gradients, turn NaN), slow (100 ms more per step from then on;
// --measure-waiting shows it). What reports each (the flag check, the watchdog, the flight
// recorder, stack dumps, error files) is the library's; the README shows it.
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <thread>

#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/launch.hpp>
#include <meshtorch/parallel/training_data.hpp>
#include <meshtorch/train/args.hpp>
#include <meshtorch/train/loop.hpp>
#include <meshtorch/train/run_main.hpp>

namespace mt = meshtorch;
using Mesh = mt::Mesh<mt::DP<mt::dynamic>>;

struct Chapter9Args : mt::train::TrainArgs {
  static constexpr auto description = "Chapter 9: diagnosing errors: chapter 2's loop with a failure caused on purpose";
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

// Called by every rank at the start of each step; the chosen rank fails there, in the first attempt
// only: restarted by meshrun --max-restarts (TORCHELASTIC_RESTART_COUNT > 0), the run goes on from
// its last checkpoint. Returns the factor the rank's loss is multiplied by (NaN for the nan fault).
double cause_fault(const Chapter9Args& args, const mt::comm::DeviceMesh<Mesh>& mesh, std::int64_t step,
                   const mt::train::Logger& log) {
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const bool first_attempt = !restarts || std::string(restarts) == "0";
  if (args.fault == "none" || !first_attempt || mesh.rank() != args.fault_rank || step < args.fault_step) return 1.0;
  if (args.fault == "slow") {  // a slow data loader or node, every step from --fault-step on
    if (step == args.fault_step) log.warning(fmt::format("causing the 'slow' fault from step {} on", step));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (args.fault == "slow" || step != args.fault_step) return 1.0;
  log.warning(fmt::format("causing the '{}' fault at step {}", args.fault, step));
  if (args.fault == "hang")
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  if (args.fault == "desync")
    mt::comm::all_reduce(mesh.group<mt::DP>(), torch::ones({1}, torch::Device(mesh.group<mt::DP>().device_name())));
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
  const auto [blocks, sampler] = mt::load_training_data(args, config, model);
  mt::train::AdamW optimizer(model.named_parameters(), {.lr = args.lr});

  mt::train::Loop loop(args, model, optimizer, blocks, sampler, mesh.rank(), device);
  for (auto state = loop.resume(); loop.next_step(state); loop.end_step(state)) {
    const double factor = cause_fault(args, mesh, state.global_step + 1, log);
    const auto input_ids = loop.next_batch();
    loop.backward(loop.timed("forward", [&] { return model.loss(input_ids, /*labels=*/input_ids) * factor; }));
    loop.timed("update", [&] { loop.update(state); });
  }
  return 0;
}

int main(int argc, char** argv) { return mt::train::run_main<Chapter9Args>(argc, argv, train); }
