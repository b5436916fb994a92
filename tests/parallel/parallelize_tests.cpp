// parallelize() against one process, for every layout the mesh type can describe: DDP, FSDP,
// HSDP, TP, 2D and 3D. Every rank also trains the one-process reference on the whole global
// batch; the layout's loss (averaged over its data-parallel group) must equal the reference's
// step by step (fp32, Gloo), and its trained pieces must equal the reference's weights' pieces.
// The rank bodies are tagged and run by CTest on the mesh's rank count (see CMakeLists.txt).
#include <array>
#include <type_traits>
#include <utility>

#include <catch2/catch.hpp>
#include <torch/nn/utils/clip_grad.h>  // the reference norm

#include <meshtorch/comm/comm.hpp>
#include <meshtorch/comm/init.hpp>
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/parallelize.hpp>

#include "one_process_load.hpp"

namespace mt = meshtorch;
namespace llama = meshtorch::llama;

// parallelize<Plan> applies the plan type's styles, not the mesh's default ones: the plan a program
// names is the plan it logs (launch<Plan>) and the plan it builds.
using MegatronPlan =
    llama::Plan<mt::Mesh<mt::DP<mt::dynamic>, mt::TP<2>>, llama::detail::RunTimeConfig{}, llama::TensorParallelStyles>;
static_assert(std::is_same_v<decltype(mt::parallelize<MegatronPlan>(
                                 std::declval<llama::LlamaForCausalLM>(),
                                 std::declval<const mt::comm::DeviceMesh<MegatronPlan::mesh_type>&>())),
                             mt::ParallelLlama<MegatronPlan::mesh_type, llama::TensorParallelStyles>>);
static_assert(
    std::is_same_v<mt::ParallelLlama<MegatronPlan::mesh_type, llama::TensorParallelStyles>::plan, MegatronPlan>);

namespace {

constexpr std::int64_t global_batch = 8;
constexpr std::int64_t seq_length = 32;
constexpr int steps = 30;

double relative_difference(double actual, double expected) { return std::abs(actual - expected) / std::abs(expected); }

// Trains the layout M and the reference side by side and compares losses and final weights.
// With micro_batches > 1 each rank's batch is split and its gradients accumulated (no_sync).
template <mt::MeshType M>
void check_layout_on(const mt::comm::DeviceMesh<M>& mesh, mt::ParallelizeOptions options = {}, int micro_batches = 1,
                     std::optional<mt::ZeroStage2Options> zero_stage2 = std::nullopt) {
  const auto config = llama::presets::llama_tiny;

  torch::manual_seed(7);
  llama::LlamaForCausalLM reference(config, torch::TensorOptions().device(torch::kMeta));
  llama::materialize(reference, torch::TensorOptions());
  torch::manual_seed(7);
  auto build = [&] {
    llama::LlamaForCausalLM model(config, torch::TensorOptions().device(torch::kMeta));
    if constexpr (M::template has<mt::DP> && !M::template has<mt::FSDP>)
      if (zero_stage2) return mt::parallelize(std::move(model), mesh, options, *zero_stage2);
    return mt::parallelize(std::move(model), mesh, options);
  };
  auto parallel = build();
  INFO(mesh.shape().to_string() << " on rank " << mesh.rank() << ": " << parallel.describe());

  mt::train::AdamW reference_optimizer(mt::train::named_trainable_parameters(*reference), {.lr = 1e-3});
  mt::train::AdamW optimizer(parallel.named_parameters(), {.lr = 1e-3});
  const std::int64_t local_batch = global_batch / parallel.data_parallel_size();
  REQUIRE(local_batch * parallel.data_parallel_size() == global_batch);

  torch::manual_seed(11);  // the same global batches on every rank
  double worst = 0;
  for (int step = 0; step < steps; ++step) {
    const auto ids = torch::randint(0, config.vocab_size, {global_batch, seq_length}, torch::kLong);
    auto expected = reference->loss(ids, ids);
    expected.backward();
    reference_optimizer.step();
    reference_optimizer.zero_grad();

    const auto local = ids.narrow(0, parallel.data_parallel_rank() * local_batch, local_batch);
    torch::Tensor loss = torch::zeros({});
    for (int micro = 0; micro < micro_batches; ++micro) {
      std::optional<decltype(parallel.no_sync())> no_sync;
      if (micro + 1 < micro_batches) no_sync.emplace(parallel.no_sync());
      const auto part = local.chunk(micro_batches, 0)[micro];
      auto micro_loss = parallel.loss(part, part) / static_cast<double>(micro_batches);
      micro_loss.backward();
      loss = loss + micro_loss.detach();
    }
    optimizer.step();
    optimizer.zero_grad();
    const double actual = parallel.mean_over_data_parallel(loss.detach()).template item<double>();
    INFO("step " << step << ": " << actual << " against one process's " << expected.template item<double>());
    CHECK(relative_difference(actual, expected.template item<double>()) < 1e-5);
    worst = std::max(worst, relative_difference(actual, expected.template item<double>()));
  }
  WARN(mesh.shape().to_string() << ": largest relative loss difference over " << steps << " steps: " << worst);

  // The trained pieces are the reference's weights' pieces, and together no more than the model.
  auto reference_weights = reference->named_parameters();
  std::int64_t held = 0;
  double worst_weight = 0;
  for (const auto& [name, piece] : parallel.named_parameters()) {
    INFO(name);
    held += piece.numel();
    const auto expected = parallel.piece_of(name, reference_weights[name].detach());
    REQUIRE(piece.sizes() == expected.sizes());
    if (piece.numel() == 0) continue;
    const double difference = ((piece.detach() - expected).abs().max() / expected.abs().max()).template item<double>();
    // Adam's normalised updates let fp32 rounding differences of the sums grow a little.
    CHECK(difference < 2e-3);
    worst_weight = std::max(worst_weight, difference);
  }
  WARN(mesh.shape().to_string() << ": largest relative weight difference after " << steps
                                << " steps: " << worst_weight);
  std::int64_t whole = 0;
  for (const auto& p : reference->parameters()) whole += p.numel();
  if (M::template has<mt::TP> || M::template has<mt::FSDP> || zero_stage2) {
    CHECK(held < whole);
  } else {
    CHECK(held == whole);
  }
  CHECK(held == parallel.local_numel());

  // Saved, each rank writes only its own pieces, straight from the tensors it trains: no rank
  // copies anything (the peak of elements held during the save is what training holds), and in
  // a sharded layout no rank writes a whole weight matrix.
  mt::testing::TemporaryCheckpoint checkpoint("parallelize", mesh.world(), mesh.env().master_port, parallel, optimizer,
                                              steps);
  CHECK(checkpoint.saved.written.largest_staging_numel == 0);
  for (const auto& piece : checkpoint.pieces) {
    const bool matrix = piece.global_shape.size() == 2 && piece.name.rfind("optimizer/", 0) != 0;
    if (!matrix || !piece.writer) continue;
    INFO(piece.name << " " << mt::io::to_string(piece.box));
    if (M::template has<mt::TP> || M::template has<mt::FSDP> || zero_stage2)
      CHECK(piece.local.numel() < piece.global_shape[0] * piece.global_shape[1]);
  }

  // Loaded into one process (a world of one, other boxes than were saved), the checkpoint is the
  // reference's weights and AdamW state.
  mt::testing::check_loads_as_reference(checkpoint.saved.folder, config, reference, reference_optimizer);
  checkpoint.remove();
}

template <mt::MeshType M>
void check_layout_against_one_process(std::vector<int> extents = {}, mt::ParallelizeOptions options = {},
                                      int micro_batches = 1) {
  check_layout_on(mt::comm::init<M>({.timeout = std::chrono::seconds(60), .extents = std::move(extents)}),
                  std::move(options), micro_batches);
}

}  // namespace

TEST_CASE("rank body: DDP built by parallelize", "[.][parallelize_ddp]") {
  check_layout_against_one_process<mt::Mesh<mt::DP<mt::dynamic>>>();
}

// Small buckets (several per step, some straddling a layer), one reduce-scatter in flight, and
// two micro-batches: each is reduce-scattered and summed into the shards.
TEST_CASE("rank body: ZeRO-2 built by parallelize", "[.][parallelize_zero2]") {
  // One mesh for both runs: a second comm::init in the same process would start a second store on
  // the master port while the first one may still serve a slower rank.
  const auto mesh = mt::comm::init<mt::Mesh<mt::DP<mt::dynamic>>>({.timeout = std::chrono::seconds(60)});
  check_layout_on(mesh, {}, 2, mt::ZeroStage2Options{.bucket_cap_mb = 0.05, .buckets_in_flight = 1});
  // And without overlap (DeepSpeed's overlap_comm false): each reduce-scatter waited for at once.
  check_layout_on(mesh, {}, 2, mt::ZeroStage2Options{.bucket_cap_mb = 0.05, .buckets_in_flight = 0});
}

TEST_CASE("rank body: ZeRO-2 with gradient clipping equals one process", "[.][zero2_clipping]") {
  auto mesh = mt::comm::init<mt::Mesh<mt::DP<mt::dynamic>>>({.timeout = std::chrono::seconds(60)});
  const auto config = llama::presets::llama_tiny;
  torch::manual_seed(7);
  llama::LlamaForCausalLM reference(config, torch::TensorOptions().device(torch::kMeta));
  llama::materialize(reference, torch::TensorOptions());
  torch::manual_seed(7);
  auto parallel = mt::parallelize(llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta)), mesh,
                                  {}, mt::ZeroStage2Options{});
  REQUIRE(parallel.zero_stage2() != nullptr);
  CHECK(parallel.zero_stage2()->bucket_count() > 0);
  mt::train::AdamW reference_optimizer(mt::train::named_trainable_parameters(*reference), {.lr = 1e-3});
  mt::train::AdamW optimizer(parallel.named_parameters(), {.lr = 1e-3});
  const std::int64_t local_batch = global_batch / parallel.data_parallel_size();
  torch::manual_seed(11);
  for (int step = 0; step < 10; ++step) {
    const auto ids = torch::randint(0, config.vocab_size, {global_batch, seq_length}, torch::kLong);
    auto expected = reference->loss(ids, ids);
    expected.backward();
    // The reference's norm over the whole gradient; the layout's over its reduced shards.
    const double expected_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), /*max_norm=*/0.5);
    reference_optimizer.step();
    reference_optimizer.zero_grad();
    const auto local = ids.narrow(0, parallel.data_parallel_rank() * local_batch, local_batch);
    auto loss = parallel.loss(local, local);
    loss.backward();
    const double norm = parallel.clip_grad_norm(0.5);
    optimizer.step();
    optimizer.zero_grad();
    INFO("step " << step);
    CHECK(relative_difference(norm, expected_norm) < 1e-5);
    CHECK(relative_difference(parallel.mean_over_data_parallel(loss.detach()).item<double>(), expected.item<double>()) <
          1e-5);
  }
  // Gradients of a step live only in this rank's shards: half the model's elements or fewer.
  std::int64_t whole = 0;
  for (const auto& p : reference->parameters()) whole += p.numel();
  auto ids = torch::randint(0, config.vocab_size, {local_batch, seq_length}, torch::kLong);
  parallel.loss(ids, ids).backward();
  std::int64_t block = 0;  // this rank's rows of every weight, padded to ceil(rows / 2)
  for (const auto& p : parallel.zero_stage2()->parameters()) block += p.block.rows_per_rank * p.row_numel;
  CHECK(parallel.zero_stage2()->gradient_numel() == block);
  CHECK(block < whole / 2 + whole / 50);
  for (const auto& item : parallel.module()->named_parameters()) CHECK_FALSE(item.value().grad().defined());
  // Stepping in backward is FSDP's alone (ZeRO-2's buckets are reduced after their gradients): on
  // this mesh a compile error (parallel.compile_fail.step_in_backward_without_fsdp).
}

TEST_CASE("rank body: FSDP built by parallelize", "[.][parallelize_fsdp]") {
  check_layout_against_one_process<mt::Mesh<mt::FSDP<mt::dynamic>>>();
}

TEST_CASE("rank body: HSDP (DP x FSDP) built by parallelize", "[.][parallelize_hsdp]") {
  check_layout_against_one_process<mt::Mesh<mt::DP<2>, mt::FSDP<2>>>();
}

TEST_CASE("rank body: TP built by parallelize", "[.][parallelize_tp]") {
  check_layout_against_one_process<mt::Mesh<mt::TP<mt::dynamic>>>();
}

TEST_CASE("rank body: 2D (FSDP x TP) built by parallelize", "[.][parallelize_2d]") {
  check_layout_against_one_process<mt::Mesh<mt::FSDP<mt::dynamic>, mt::TP<mt::dynamic>>>({mt::from_world_size, 2});
}

TEST_CASE("rank body: 3D (DP x FSDP x TP) built by parallelize", "[.][parallelize_3d]") {
  check_layout_against_one_process<mt::Mesh<mt::DP<2>, mt::FSDP<2>, mt::TP<2>>>();
}

namespace {

// A bf16 model folder in two files with an index, loaded into 2D (FSDP x TP) fp32 pieces: every
// piece equals the reference weight's piece (bf16 -> fp32 exactly). Read by every rank, each
// reads from disk only the rows its pieces lie in: about a quarter of the model, with the whole
// rows of the weights TP cuts along dim 1. Read by rank 0, rank 0 reads the model once and the
// others nothing. Read by local rank 0 on 4 ranks told they are 2 nodes of 2, ranks 0 and 2
// read the model once each and their node's other rank nothing.
void check_folder_load(mt::WeightsReadBy read_by) {
  using M = mt::Mesh<mt::FSDP<mt::dynamic>, mt::TP<mt::dynamic>>;
  auto env = mt::comm::launch_env();
  if (read_by == mt::WeightsReadBy::local_rank0) {
    REQUIRE(env.world_size == 4);
    env.local_world_size = 2;
    env.local_rank = env.rank % 2;
  }
  auto mesh = mt::comm::init<M>({.timeout = std::chrono::seconds(60), .env = env, .extents = {mt::from_world_size, 2}});
  const int first_of_node = read_by == mt::WeightsReadBy::local_rank0 ? mesh.rank() - mesh.rank() % 2 : 0;
  CHECK(mesh.node().ranks() == (read_by == mt::WeightsReadBy::local_rank0
                                    ? std::vector<int>{first_of_node, first_of_node + 1}
                                    : mesh.world().ranks()));
  const auto config = llama::presets::llama_tiny;
  torch::manual_seed(5);
  llama::LlamaForCausalLM reference(config, torch::TensorOptions().device(torch::kMeta));
  llama::materialize(reference, torch::TensorOptions());
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("meshtorch-load-{}", mesh.env().master_port);
  if (mesh.rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    std::array<mt::io::NamedTensors, 2> files;
    nlohmann::json weight_map;
    int i = 0;
    for (const auto& item : reference->named_parameters()) {
      const int file = i++ % 2;
      files[file].emplace_back(item.key(), item.value().detach().to(torch::kBFloat16));
      weight_map[item.key()] = fmt::format("model-0000{}-of-00002.safetensors", file + 1);
    }
    for (int file = 0; file < 2; ++file)
      mt::io::save_safetensors(dir / fmt::format("model-0000{}-of-00002.safetensors", file + 1), files[file],
                               {{"format", "pt"}});
    mt::io::write_file_atomically(
        dir / "model.safetensors.index.json",
        nlohmann::json{{"metadata", nlohmann::json::object()}, {"weight_map", weight_map}}.dump());
    mt::io::write_file_atomically(dir / "config.json", llama::config_to_json(config, "bfloat16").dump(2));
  }
  mt::comm::barrier(mesh.world());

  auto parallel = mt::parallelize(llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta)), mesh,
                                  {.weights_from = dir, .weights_read_by = read_by});
  auto reference_weights = reference->named_parameters();
  for (const auto& [name, piece] : parallel.named_parameters()) {
    INFO(name);
    const auto expected =
        parallel.piece_of(name, reference_weights[name].detach().to(torch::kBFloat16).to(torch::kFloat));
    REQUIRE(piece.sizes() == expected.sizes());
    CHECK(torch::equal(piece.detach(), expected));
  }
  std::int64_t whole = 0;
  for (const auto& p : reference->parameters()) whole += p.numel();
  const double fraction = static_cast<double>(parallel.elements_read_from_folder()) / static_cast<double>(whole);
  WARN("rank " << mesh.rank() << " read " << parallel.elements_read_from_folder() << " of the model's " << whole
               << " elements (" << fraction << ")");
  if (read_by == mt::WeightsReadBy::every_rank) {
    CHECK(fraction > 0.25);
    CHECK(fraction < 0.45);
  } else {
    CHECK(fraction == (mesh.rank() == first_of_node ? 1.0 : 0.0));
  }
  mt::comm::barrier(mesh.world());
  if (mesh.rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace

TEST_CASE("rank body: 2D loads a bf16 model folder, every rank reading only its rows", "[.][parallelize_load]") {
  check_folder_load(mt::WeightsReadBy::every_rank);
}

TEST_CASE("rank body: 2D loads a bf16 model folder read by rank 0 and broadcast", "[.][parallelize_load_rank0]") {
  check_folder_load(mt::WeightsReadBy::rank0);
}

TEST_CASE("rank body: 2D on two nodes loads a bf16 model folder read by each node's local rank 0",
          "[.][parallelize_load_local_rank0]") {
  check_folder_load(mt::WeightsReadBy::local_rank0);
}

TEST_CASE("parallelize refuses a model that is not on the meta device", "[single][parallelize]") {
  mt::comm::LaunchEnv alone;
  alone.master_port = 0;  // the store picks a free port
  auto mesh = mt::comm::init<mt::Mesh<mt::DP<1>>>({.timeout = std::chrono::seconds(10), .env = alone});
  llama::LlamaForCausalLM model(llama::presets::llama_tiny);
  CHECK_THROWS_WITH(mt::parallelize(model, mesh),
                    Catch::Contains("'model.embed_tokens.weight' is not on the meta device"));
}
