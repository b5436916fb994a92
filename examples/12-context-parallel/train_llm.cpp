// Chapter 12 (beyond the guide): context parallel.
//
// Every layer's sequence is split over the `--cp` ranks: the sequence is cut into 2 x CP chunks
// and each rank holds one early and one late chunk (so causal attention's work is the same on
// every rank), computes its chunks' queries, keys and values, and meets the other ranks' keys and
// values in attention: passed around a ring while it computes (--cp-rotate ring) or gathered once
// per layer (allgather). Activations then shrink with CP, which is what lets long sequences fit.
// The mesh is the five axes of Llama 3's training, Mesh<DP, FSDP, PP, CP, TP>, with every extent
// from flags: `--tp` ranks split each layer (chapter 6), `--cp` ranks split the sequence, `--pp`
// ranks hold the stages of the model under chapter 11's schedules (default 1: one stage), `--dp`
// replicas (HSDP), and FSDP takes the rest; FSDP shards over FSDP x CP, since the CP ranks of a
// replica hold different tokens of one batch.
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/launch.hpp>
#include <meshtorch/parallel/training_data.hpp>
#include <meshtorch/train/args.hpp>
#include <meshtorch/train/loop.hpp>
#include <meshtorch/train/run_main.hpp>

namespace mt = meshtorch;
using Mesh =
    mt::Mesh<mt::DP<mt::dynamic>, mt::FSDP<mt::dynamic>, mt::PP<mt::dynamic>, mt::CP<mt::dynamic>, mt::TP<mt::dynamic>>;
// Chapter 6's plan inside every stage: launch<Plan> puts it in the fingerprint the ranks compare.
using Plan = mt::llama::Plan<Mesh>;

struct Chapter12Args : mt::train::TrainArgs,
                       mt::train::FsdpArgs,
                       mt::train::PipelineArgs,
                       mt::train::ContextParallelArgs {
  static constexpr auto description = "Chapter 12: context parallel (ring or all-gather attention) in five axes";
  int tp = 1;
  int dp = 1;
  Chapter12Args() {
    cp = 2;
    pp = 1;
  }

  void add_to(CLI::App& app) {
    TrainArgs::add_to(app);
    add_context_parallel_flags(app);  // --cp, --cp-rotate
    add_pipeline_flags(app);          // --pp, --schedule, --stages-per-rank, --microbatches (chapter 11)
    mt::train::add_extent_flag(app, "--tp", tp, "tensor-parallel size inside every CP rank (chapter 6's plan)");
    mt::train::add_extent_flag(app, "--dp", dp, "replicas of the FSDP x CP x TP model (HSDP)");
    add_fsdp_flags(app, /*with_cpu_offload=*/false);  // --reshard-after-forward, --prefetch-layers
  }
};

int train(const Chapter12Args& args) {
  if (args.grad_accum != 1)
    throw mt::ConfigError("--grad-accum: a pipeline accumulates over its micro-batches; use --microbatches");
  auto [env, device, dtype, mesh, log] =
      mt::launch<Plan>(args, {args.dp, mt::from_world_size, args.pp, args.cp, args.tp});

  // The model on the meta device, then the parallel model the mesh type describes.
  const auto config = mt::llama::resolve_model(args.model_name);
  auto options = mt::parallelize_options(args, device);  // -m's weights, --activation-checkpointing, ...
  options.fsdp = mt::fsdp_options(args, dtype);
  options.cp_rotate = *mt::cp::parse_rotate(args.cp_rotate);  // the flag's check allows only known names
  options.pipeline = mt::pipeline_options(args, args.seq_length);
  auto model = mt::parallelize(
      mt::llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta).dtype(dtype)), mesh, options);
  log.info(model.summary());
  log.info("the pipeline's schedule (F forward, B backward, I/W its input and weight parts):\n" +
           model.schedule_grid());

  // The data-parallel ranks (DP x FSDP) split the global batch; the CP ranks of one read the same
  // batch (-s must split into 2 x CP chunks: refused here, before any step, if it does not).
  const auto [blocks, sampler] = mt::load_training_data(args, config, model);
  mt::train::AdamW optimizer(model.named_parameters(), {.lr = args.lr});

  mt::train::Loop loop(args, model, optimizer, blocks, sampler, mesh.rank(), device);
  for (auto state = loop.resume(); loop.next_step(state); loop.end_step(state)) {
    const auto input_ids = loop.next_batch();
    // Every micro-batch through this rank's stages; in each, this rank computes its two chunks.
    loop.add_loss(loop.timed("pipeline", [&] { return model.step(input_ids, /*labels=*/input_ids); }));
    loop.timed("update", [&] { loop.update(state); });
  }
  if (const auto balance = model.stage_balance(); !balance.empty()) log.info(balance);
  return 0;
}

int main(int argc, char** argv) { return mt::train::run_main<Chapter12Args>(argc, argv, train); }
