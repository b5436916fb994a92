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
#include <meshtorch/train/loop.hpp>
#include <meshtorch/train/run_main.hpp>

namespace mt = meshtorch;
using Mesh = mt::Mesh<mt::DP<mt::dynamic>, mt::FSDP<mt::dynamic>, mt::TP<mt::dynamic>>;
// The guide's plan: sequence parallel + loss parallel. launch<Plan> puts it in the fingerprint the
// ranks compare, and parallelize<Plan> applies it: one type for both.
using Plan = mt::llama::Plan<Mesh>;

struct Chapter7Args : mt::train::TrainArgs, mt::train::FsdpArgs {
  static constexpr auto description = "Chapter 7: 2D parallel: tensor parallel inside a node, FSDP across nodes";
  int tp = 2;
  int dp = 1;

  void add_to(CLI::App& app) {
    TrainArgs::add_to(app);
    mt::train::add_extent_flag(app, "--tp", tp, "tensor-parallel size (divides the world); the rest is FSDP");
    mt::train::add_extent_flag(app, "--dp", dp,
                               "replicas of the FSDP x TP model (HSDP: shard inside, all-reduce across)");
    add_fsdp_flags(app, /*with_cpu_offload=*/false);  // --reshard-after-forward, --prefetch-layers
  }
};

int train(const Chapter7Args& args) {
  auto [env, device, dtype, mesh, log] = mt::launch<Plan>(args, {args.dp, mt::from_world_size, args.tp});

  // The model on the meta device, then the parallel model the mesh type describes.
  const auto config = mt::llama::resolve_model(args.model_name);
  auto options = mt::parallelize_options(args, device);  // -m's weights, --activation-checkpointing, ...
  options.fsdp = mt::fsdp_options(args, dtype);
  auto model = mt::parallelize<Plan>(
      mt::llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta).dtype(dtype)), mesh, options);
  log.info(model.summary());

  // The data-parallel ranks (DP x FSDP) split the global batch; a TP group reads one batch.
  const auto [blocks, sampler] = mt::load_training_data(args, config, model);
  mt::train::AdamW optimizer(model.named_parameters(), {.lr = args.lr});

  mt::train::Loop loop(args, model, optimizer, blocks, sampler, mesh.rank(), device);
  for (auto state = loop.resume(); loop.next_step(state); loop.end_step(state)) {
    for (const auto& batch : loop.micro_batches())  // no DP all-reduce but on the last (FSDP reduce-scatters each)
      loop.backward(loop.timed("forward", [&] { return model.loss(batch.input_ids, /*labels=*/batch.input_ids); }));
    loop.timed("update", [&] { loop.update(state); });
  }
  return 0;
}

int main(int argc, char** argv) { return mt::train::run_main<Chapter7Args>(argc, argv, train); }
