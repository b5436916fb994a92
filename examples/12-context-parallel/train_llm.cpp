// Chapter 12 (beyond the guide): context parallel.
//
// Every layer's sequence is split over the `--cp` ranks: the sequence is cut into 2 x CP chunks
// and each rank holds one early and one late chunk (so causal attention's work is the same on
// every rank), computes its chunks' queries, keys and values, and meets the other ranks' keys and
// values in attention: passed around a ring while it computes (--cp-rotate ring) or gathered once
// per layer (allgather). Activations then shrink with CP, which is what lets long sequences fit.
// The mesh is Mesh<DP, FSDP, CP, TP> with every extent from flags: `--tp` ranks split each layer
// (chapter 6), `--cp` ranks split the sequence, `--dp` replicas (HSDP), and FSDP takes the rest;
// FSDP shards over FSDP x CP, since the CP ranks of a replica hold different tokens of one batch.
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/launch.hpp>
#include <meshtorch/parallel/training_data.hpp>
#include <meshtorch/train/args.hpp>
#include <meshtorch/train/loop.hpp>
#include <meshtorch/train/run_main.hpp>

namespace mt = meshtorch;
using Mesh = mt::Mesh<mt::DP<mt::dynamic>, mt::FSDP<mt::dynamic>, mt::CP<mt::dynamic>, mt::TP<mt::dynamic>>;
// Chapter 6's plan inside every CP rank: launch<Plan> puts it in the fingerprint the ranks compare.
using Plan = mt::llama::Plan<Mesh>;

struct Chapter12Args : mt::train::TrainArgs, mt::train::FsdpArgs, mt::train::ContextParallelArgs {
  static constexpr auto description = "Chapter 12: context parallel (ring or all-gather attention)";
  int tp = 1;
  int dp = 1;
  Chapter12Args() { cp = 2; }

  void add_to(CLI::App& app) {
    TrainArgs::add_to(app);
    add_context_parallel_flags(app);  // --cp, --cp-rotate
    mt::train::add_extent_flag(app, "--tp", tp, "tensor-parallel size inside every CP rank (chapter 6's plan)");
    mt::train::add_extent_flag(app, "--dp", dp, "replicas of the FSDP x CP x TP model (HSDP)");
    add_fsdp_flags(app, /*with_cpu_offload=*/false);  // --reshard-after-forward, --prefetch-layers
  }
};

int train(const Chapter12Args& args) {
  auto [env, device, dtype, mesh, log] = mt::launch<Plan>(args, {args.dp, mt::from_world_size, args.cp, args.tp});

  // The model on the meta device, then the parallel model the mesh type describes.
  const auto config = mt::llama::resolve_model(args.model_name);
  auto options = mt::parallelize_options(args, device);  // -m's weights, --activation-checkpointing, ...
  options.fsdp = mt::fsdp_options(args, dtype);
  options.cp_rotate = *mt::cp::parse_rotate(args.cp_rotate);  // the flag's check allows only known names
  auto model = mt::parallelize<Plan>(
      mt::llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta).dtype(dtype)), mesh, options);
  log.info(model.summary());

  // The data-parallel ranks (DP x FSDP) split the global batch; the CP ranks of one read the same
  // batch (-s must split into 2 x CP chunks: refused here, before any step, if it does not).
  const auto [blocks, sampler] = mt::load_training_data(args, config.vocab_size, model);
  mt::train::AdamW optimizer(model.named_parameters(), {.lr = args.lr});

  mt::train::Loop loop(args, model, optimizer, blocks, sampler, mesh.rank(), device);
  for (auto state = loop.resume(); loop.next_step(state); loop.end_step(state)) {
    for (const auto& batch : loop.micro_batches())  // each rank computes the loss of its two chunks
      loop.backward(loop.timed("forward", [&] { return model.loss(batch.input_ids, /*labels=*/batch.input_ids); }));
    loop.timed("update", [&] { loop.update(state); });
  }
  return 0;
}

int main(int argc, char** argv) { return mt::train::run_main<Chapter12Args>(argc, argv, train); }
