// Chapter 11 (beyond the guide): pipeline parallel.
//
// The model is cut into stages (the embedding, the decoder layers and the norm with the head
// counted as units, split so that the slowest stage is as fast as it can be), and each rank of
// the PP axis holds only its stages' weights. Each rank's batch (-b) is split into --microbatches
// micro-batches that flow through the stages under a schedule: GPipe (every forward, then every
// backward), 1F1B (one forward, one backward in the steady state: fewer activations in flight),
// Interleaved 1F1B (several stages per rank: a smaller bubble) or ZBV (backward split into the
// input gradient, sent on at once, and the weight gradient, run where the rank would idle). The
// schedule is a table checked before the first step, and printed. The mesh is Mesh<DP, FSDP, PP, TP>:
// `--tp` ranks split every layer of a stage as chapter 6 does (default 1), `--pp` ranks hold the
// stages of one model, `--dp` replicas average their gradients after the schedule (default 1), and
// the rest of the world shards every stage's weights as chapter 4 does (FSDP: a unit per layer,
// gathered and reduce-scattered micro-batch by micro-batch). Chapter 12 adds CP to this mesh.
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/launch.hpp>
#include <meshtorch/parallel/training_data.hpp>
#include <meshtorch/train/args.hpp>
#include <meshtorch/train/loop.hpp>
#include <meshtorch/train/run_main.hpp>

namespace mt = meshtorch;
using Mesh = mt::Mesh<mt::DP<mt::dynamic>, mt::FSDP<mt::dynamic>, mt::PP<mt::dynamic>, mt::TP<mt::dynamic>>;
// Chapter 6's plan inside every stage: launch<Plan> puts it in the fingerprint the ranks compare.
using Plan = mt::llama::Plan<Mesh>;

struct Chapter11Args : mt::train::TrainArgs, mt::train::PipelineArgs, mt::train::FsdpArgs {
  static constexpr auto description = "Chapter 11: pipeline parallel (GPipe, 1F1B, Interleaved 1F1B, ZBV)";
  int tp = 1;
  int dp = 1;

  void add_to(CLI::App& app) {
    TrainArgs::add_to(app);
    add_pipeline_flags(app);  // --pp, --schedule, --stages-per-rank, --microbatches, --units-per-stage
    mt::train::add_extent_flag(app, "--tp", tp, "tensor-parallel size inside every stage (chapter 6's plan)");
    mt::train::add_extent_flag(app, "--dp", dp, "replicas of the pipeline (the rest of the world is FSDP)");
    add_fsdp_flags(app, /*with_cpu_offload=*/false);  // --reshard-after-forward, --prefetch-layers
  }
};

int train(const Chapter11Args& args) {
  if (args.grad_accum != 1)
    throw mt::ConfigError("--grad-accum: a pipeline accumulates over its micro-batches; use --microbatches");
  auto [env, device, dtype, mesh, log] = mt::launch<Plan>(args, {args.dp, mt::from_world_size, args.pp, args.tp});

  // The model on the meta device; each rank keeps only the weights of its stages.
  const auto config = mt::llama::resolve_model(args.model_name);
  auto options = mt::parallelize_options(args, device);  // -m's weights, --activation-checkpointing, ...
  options.pipeline = mt::pipeline_options(args, args.seq_length);
  options.fsdp = mt::fsdp_options(args, dtype);
  auto model = mt::parallelize(
      mt::llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta).dtype(dtype)), mesh, options);
  log.info(model.summary());
  log.info("the schedule, a column per tick (F forward, B backward, I/W its input and weight parts):\n" +
           model.schedule_grid());

  // The DP x FSDP ranks split the global batch; the ranks of a pipeline (and their TP ranks) read the same batch.
  const auto [blocks, sampler] = mt::load_training_data(args, config, model);
  mt::train::AdamW optimizer(model.named_parameters(), {.lr = args.lr});

  mt::train::Loop loop(args, model, optimizer, blocks, sampler, mesh.rank(), device);
  for (auto state = loop.resume(); loop.next_step(state); loop.end_step(state)) {
    const auto input_ids = loop.next_batch();
    // Forward and backward of every micro-batch through this rank's stages, as the table says.
    loop.add_loss(loop.timed("pipeline", [&] { return model.step(input_ids, /*labels=*/input_ids); }));
    loop.timed("update", [&] { loop.update(state); });
  }
  // How balanced the stages were and how long each rank waited, measured (every rank takes part).
  if (const auto balance = model.stage_balance(); !balance.empty()) log.info(balance);
  return 0;
}

int main(int argc, char** argv) { return mt::train::run_main<Chapter11Args>(argc, argv, train); }
