// Chapter 8: alternative frameworks. The guide's DeepSpeed chapter in C++: one JSON config
// (ds_config.json) says the micro batch per rank, the gradient accumulation, AdamW, the
// warmup-cosine schedule, bf16, clipping and the ZeRO stage, and an engine built from it takes
// the place of DDP + optimizer + scheduler:
//
//   stage 0  DDP: every rank holds weights, gradients and AdamW state whole
//   stage 1  + AdamW state sharded (ZeroRedundancyOptimizer)
//   stage 2  + gradients sharded: each bucket is reduce-scattered, not all-reduced (ZeroStage2)
//   stage 3  + weights sharded: FSDP per decoder layer, then the root
//
// The loop is DeepSpeed's: per micro-batch loss, backward, step; the engine knows when a step
// is an accumulation boundary. The config's micro batch, accumulation and optimizer take the
// place of -b, --grad-accum and --lr.
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/engine.hpp>
#include <meshtorch/parallel/training_data.hpp>
#include <meshtorch/train/args.hpp>
#include <meshtorch/train/deepspeed_config.hpp>
#include <meshtorch/train/epochs.hpp>

namespace mt = meshtorch;

struct Chapter8Args : mt::train::TrainArgs {
  std::string deepspeed_config;

  void add_to(CLI::App& app) {
    TrainArgs::add_to(app);
    // What the config decides is not also a flag: one fact, one place.
    for (const char* flag : {"-b", "--grad-accum", "--global-batch-size", "--lr", "--lr-schedule", "--warmup-steps",
                             "--warmup-type", "--lr-decay-steps", "--min-lr-ratio", "--max-grad-norm", "--dtype"})
      app.remove_option(app.get_option(flag));
    // The engine's loop does not evaluate (a DeepSpeed config has no evaluation); --eval-split still
    // holds blocks out, and meshtorch-eval-loss --eval-split evaluates the checkpoints on them.
    app.remove_option(app.get_option("--eval-freq"));
    app.add_option("--deepspeed-config", deepspeed_config,
                   "a DeepSpeed JSON config: micro batch, accumulation, optimizer, scheduler, bf16, ZeRO stage")
        ->required()
        ->check(CLI::ExistingFile);
  }
};

int main(int argc, char** argv) {
  CLI::App app{"Chapter 8: a DeepSpeed-style engine and JSON config (ZeRO stages 0-3)"};
  Chapter8Args args;
  args.add_to(app);
  CLI11_PARSE(app, argc, argv);

  return mt::diagnostics::run_recorded([&] {
    auto config = mt::train::DeepSpeedConfig::read(args.deepspeed_config);
    if (app.get_option("--log-freq")->count() == 0) args.log_freq = config.steps_per_print;

    // deepspeed.initialize: the mesh, the parallel model, AdamW and the schedule, from the config.
    return mt::initialize(args, config, [&](auto& engine) {
      const auto [blocks, sampler] =
          mt::load_training_data(engine.args(), engine.model().module()->config, engine.model());
      engine.set_steps_per_epoch(sampler.steps_per_epoch());

      // Epoch after epoch from the latest checkpoint of -e (or a fresh start), a micro-batch at a time.
      mt::train::Epochs epochs(engine.args(), blocks, sampler, engine.mesh().rank(), engine.device());
      for (auto state = engine.load_checkpoint(); epochs.next_step(state);) {
        const auto input_ids = engine.timers().timed("data", [&] { return epochs.next_batch(); });
        auto loss = engine.loss(input_ids, /*labels=*/input_ids);  // one micro-batch
        engine.backward(loss);                                     // gradients reduced as the stage says
        if (!engine.step(state, epochs.progress())) continue;      // not an accumulation boundary yet
        if (engine.checkpoint_due(state)) engine.save_checkpoint(state);
      }
      return 0;
    });
  });
}
