// Tensor parallel against one process. Every rank builds the same model from one seed twice: a
// reference left whole, and a copy that the plan shards over the TP group; the sharded model's
// loss, gradients and trained parameters must match the reference's (fp32, Gloo). Tests tagged
// [single] run in one process; the others are rank bodies run on 2 ranks (see CMakeLists.txt).
#include <functional>

#include <catch2/catch.hpp>

#include <meshtorch/comm/comm.hpp>
#include <meshtorch/comm/init.hpp>
#include <meshtorch/diagnostics/flight_recorder.hpp>
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/tensor_parallel.hpp>

namespace mt = meshtorch;
namespace llama = meshtorch::llama;
using Tp2 = mt::Mesh<mt::DP<mt::dynamic>, mt::TP<2>>;

namespace {

llama::LlamaForCausalLM seeded_llama(const llama::Config& config, std::uint64_t seed) {
  torch::manual_seed(seed);
  llama::LlamaForCausalLM model(config, torch::TensorOptions().device(torch::kMeta).dtype(torch::kFloat));
  llama::materialize(model, torch::TensorOptions().dtype(torch::kFloat));
  return model;
}

// GQA (8 query heads over 2 key/value heads), llama3 rope scaling and a tied head.
llama::Config tied_gqa_config() {
  auto config = llama::presets::llama_tiny;
  config.num_key_value_heads = 2;
  config.tie_word_embeddings = true;
  config.rope_scaling = {.kind = llama::RopeScalingKind::llama3,
                         .factor = 8.0,
                         .low_freq_factor = 1.0,
                         .high_freq_factor = 4.0,
                         .original_max_position_embeddings = 64};
  return config;
}

double max_relative_error(const torch::Tensor& actual, const torch::Tensor& expected) {
  return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item<double>();
}

// Trains the reference and the TP model side by side for `steps` steps and checks loss, every
// gradient (the shard of the reference's) and every parameter after each step.
// `adjust` changes both models alike before the plan applies (adds layers' biases).
template <class Plan, class DeviceMesh>
void check_parity(DeviceMesh& mesh, const llama::Config& config, int steps, std::int64_t loss_chunk = 0,
                  const std::function<void(llama::LlamaForCausalLM&)>& adjust = {}) {
  const auto& tp = mesh.template group<mt::TP>();
  auto reference = seeded_llama(config, 7);
  auto model = seeded_llama(config, 7);
  if (adjust) {
    adjust(reference);
    adjust(model);
  }
  auto parallel = mt::apply_tensor_parallel<Plan>(model, tp);
  model->loss_chunk = loss_chunk;  // the reference computes all logits at once
  mt::train::AdamW reference_opt(mt::train::named_trainable_parameters(*reference), {.lr = 1e-3});
  mt::train::AdamW opt(mt::train::named_trainable_parameters(*model), {.lr = 1e-3});
  auto reference_params = reference->named_parameters();
  auto params = model->named_parameters();
  REQUIRE(params.size() == reference_params.size());
  // The plan really shards: a q_proj holds half the heads.
  CHECK(params["model.layers.0.self_attn.q_proj.weight"].size(0) == config.q_size() / 2);

  torch::manual_seed(11);  // the same batches on both ranks: TP ranks share their data
  for (int step = 0; step < steps; ++step) {
    const auto ids = torch::randint(0, config.vocab_size, {2, 32}, torch::kLong);
    auto expected = reference->loss(ids, ids);
    auto actual = parallel.loss(ids, ids);
    INFO("step " << step);
    CHECK(actual.template item<double>() == Approx(expected.template item<double>()).epsilon(1e-5));
    expected.backward();
    actual.backward();
    for (const auto& item : params) {
      const auto& name = item.key();
      INFO(name);
      const auto full_grad = reference_params[name].grad();
      REQUIRE(item.value().grad().defined());
      // Exact up to the order of fp32 sums at the first step; Adam's normalised updates then let
      // those rounding differences grow a little.
      CHECK(max_relative_error(item.value().grad(), parallel.shard_of(name, full_grad)) < (step == 0 ? 1e-4 : 2e-3));
    }
    reference_opt.step();
    reference_opt.zero_grad();
    opt.step();
    opt.zero_grad();
  }
  double max_error = 0;
  for (const auto& [name, full] : parallel.full_parameters()) {
    INFO(name);
    // Biases start at zero and move by about lr a step: relative to values that small, Adam's
    // normalised rounding differences look large, so they are compared in absolute terms.
    if (name.ends_with(".bias")) {
      CHECK((full - reference_params[name].detach()).abs().max().template item<double>() < 1e-5);
      continue;
    }
    // An element whose gradient is rounding noise moves by up to lr a step either way under Adam:
    // measured 4e-4 to 2.6e-3 over the families and plans after 2 steps, depending on which
    // attention kernel rounds (a mis-sharded weight differs by 1e-1 and more).
    const double error = max_relative_error(full, reference_params[name].detach());
    CHECK(error < 5e-3);
    max_error = std::max(max_error, error);
  }
  WARN("largest relative parameter difference after " << steps << " steps: " << max_error);
}

// One mesh per process: a second init would rendezvous on the same port while the first's store
// may still be shutting down on rank 0 (a rank that raced ahead then lost its connection).
template <class Plan>
void check_parity(const llama::Config& config, int steps, std::int64_t loss_chunk = 0) {
  auto mesh = mt::comm::init<Tp2>();
  check_parity<Plan>(mesh, config, steps, loss_chunk);
}

}  // namespace

TEST_CASE("sequence-parallel plan with loss parallel matches one process", "[.][tp_sp]") {
  check_parity<llama::Plan<Tp2, llama::presets::llama_tiny>>(llama::presets::llama_tiny, 3);
}

TEST_CASE("Megatron plan without sequence parallel matches one process", "[.][tp_megatron]") {
  check_parity<llama::Plan<Tp2, llama::presets::llama_tiny, llama::TensorParallelStyles>>(llama::presets::llama_tiny,
                                                                                          3);
}

TEST_CASE("GQA, llama3 rope and tied embeddings under sequence parallel match one process", "[.][tp_tied]") {
  check_parity<llama::Plan<Tp2>>(tied_gqa_config(), 2);
}

TEST_CASE("the chunked loss under TP (loss parallel, and Megatron's gathered logits) matches one process",
          "[.][tp_chunked]") {
  // 7 positions per chunk: 64 positions in 10 chunks, the last one short.
  auto mesh = mt::comm::init<Tp2>();
  check_parity<llama::Plan<Tp2>>(mesh, tied_gqa_config(), 2, 7);
  check_parity<llama::Plan<Tp2, llama::presets::llama_tiny, llama::TensorParallelStyles>>(
      mesh, llama::presets::llama_tiny, 2, 7);
}

// The families' own weights under both plans: Qwen3's per-head q/k norms (whole on every rank, their
// gradients summed over TP with or without sequence parallel) and Qwen2's q/k/v biases (split with
// the heads: each rank's gradient is its shard of the full one).
// Biases on the rowwise layers (o_proj, down_proj), drawn from one seed: no family has them, but
// a plan may put RowwiseParallel on a layer with a bias, which each rank must not add.
static void with_rowwise_biases(llama::LlamaForCausalLM& lm) {
  torch::manual_seed(5);
  torch::NoGradGuard no_grad;
  const auto biased_copy = [](const llama::Linear& linear) {
    llama::Linear biased(linear->weight.size(1), linear->weight.size(0), linear->weight.options(), /*with_bias=*/true);
    biased->replace_weight(linear->weight);
    biased->bias.normal_(0.0, 0.5);
    return biased;
  };
  for (auto& layer : lm->model->decoder_layers) {
    auto& attention = *layer->self_attn;
    attention.o_proj = llama::Linear(attention.replace_module("o_proj", biased_copy(attention.o_proj)));
    auto& mlp = *layer->mlp;
    mlp.down_proj = llama::Linear(mlp.replace_module("down_proj", biased_copy(mlp.down_proj)));
  }
}

TEST_CASE("RowwiseParallel layers with a bias add it once, and train it as one process does", "[.][tp_rowwise_bias]") {
  auto mesh = mt::comm::init<Tp2>();
  auto config = llama::presets::llama_tiny;
  config.family = llama::Family::qwen2;  // colwise biases too
  // The bias changes the loss: a model that dropped or doubled it would not match.
  {
    auto plain = seeded_llama(config, 7), biased = seeded_llama(config, 7);
    with_rowwise_biases(biased);
    const auto ids = torch::randint(0, config.vocab_size, {2, 16}, torch::kLong);
    torch::NoGradGuard no_grad;
    CHECK(std::abs(plain->loss(ids, ids).item<double>() - biased->loss(ids, ids).item<double>()) > 1e-3);
  }
  check_parity<llama::Plan<Tp2>>(mesh, config, 2, 0, with_rowwise_biases);
  check_parity<llama::Plan<Tp2, llama::presets::llama_tiny, llama::TensorParallelStyles>>(mesh, config, 2, 0,
                                                                                          with_rowwise_biases);
}

TEST_CASE("Qwen3 and Qwen2 under both TP plans match one process", "[.][tp_families]") {
  auto mesh = mt::comm::init<Tp2>();
  for (const auto family : {llama::Family::qwen3, llama::Family::qwen2}) {
    auto config = llama::presets::llama_tiny;
    config.family = family;
    INFO(llama::traits(family).model_type);
    check_parity<llama::Plan<Tp2>>(mesh, config, 2);
    check_parity<llama::Plan<Tp2, llama::presets::llama_tiny, llama::TensorParallelStyles>>(mesh, config, 2);
  }
}

// What one backward of the sequence-parallel plan issues over TP as all-reduces: the flight
// recorder's entries after `last_id`.
std::vector<nlohmann::json> all_reduces_after(std::uint64_t last_id) {
  std::vector<nlohmann::json> found;
  for (const auto& entry : mt::diagnostics::FlightRecorder::instance().entries())
    if (entry["id"].get<std::uint64_t>() > last_id && entry["op"] == "all_reduce") found.push_back(entry);
  return found;
}

std::uint64_t last_recorded_id() {
  const auto entries = mt::diagnostics::FlightRecorder::instance().entries();
  return entries.empty() ? 0 : entries.back()["id"].get<std::uint64_t>();
}

TEST_CASE("sequence-parallel norm gradients are summed over TP in one all-reduce per backward",
          "[.][tp_sp_coalesced]") {
  auto mesh = mt::comm::init<Tp2>();
  const auto config = llama::presets::llama_tiny;
  auto model = seeded_llama(config, 7);
  auto parallel = mt::apply_tensor_parallel<llama::Plan<Tp2, llama::presets::llama_tiny>>(model, mesh.group<mt::TP>());
  torch::manual_seed(11);
  const auto ids = torch::randint(0, config.vocab_size, {2, 32}, torch::kLong);
  for (int micro = 0; micro < 2; ++micro) {  // the second accumulates into the first's gradients
    auto loss = parallel.loss(ids, ids);
    const auto before = last_recorded_id();
    loss.backward();
    const auto reduces = all_reduces_after(before);
    REQUIRE(reduces.size() == 1);  // not one per norm: 2 per layer and the final norm
    CHECK(reduces[0]["shape"] == std::vector<std::int64_t>{(2 * config.num_hidden_layers + 1) * config.hidden_size});
  }
  // The norms' gradients are twice one micro-batch's, summed over the ranks: the same on both.
  const auto norm = model->named_parameters()["model.layers.1.post_attention_layernorm.weight"].grad();
  const auto gathered = mt::comm::all_gather(mesh.group<mt::TP>(), norm.unsqueeze(0), 0);
  CHECK(torch::equal(gathered[0], gathered[1]));

  // A backward that does not start at TensorParallel::loss would leave the partial sums: refused
  // at the first norm it reaches, the final one.
  model->zero_grad();
  auto plain = model->loss(ids, ids);
  CHECK_THROWS_WITH(plain.backward(),
                    Catch::Contains("did not start at TensorParallel::loss") && Catch::Contains("'model.norm.weight'"));
}

TEST_CASE("vocab-parallel cross entropy equals cross entropy over the whole vocabulary", "[.][tp_loss]") {
  auto mesh = mt::comm::init<Tp2>();
  const auto& tp = mesh.group<mt::TP>();
  torch::manual_seed(3);
  auto logits = torch::randn({2, 16, 264}, torch::requires_grad());
  auto labels = torch::randint(0, 264, {2, 16}, torch::kLong);
  auto expected = llama::LlamaForCausalLMImpl::causal_lm_loss(logits, labels);
  expected.backward();
  auto local = logits.detach().chunk(2, -1)[tp.rank()].clone().requires_grad_(true);
  const auto targets = llama::LlamaForCausalLMImpl::next_token_targets(labels).reshape({-1});
  auto actual =
      mt::TensorParallel<llama::Plan<Tp2>>::vocab_parallel_cross_entropy_sum(local.reshape({-1, 132}), targets, tp) /
      targets.ne(-100).sum();
  actual.backward();
  CHECK(actual.item<double>() == Approx(expected.item<double>()).epsilon(1e-6));
  CHECK(max_relative_error(local.grad(), logits.grad().chunk(2, -1)[tp.rank()]) < 1e-5);
}

TEST_CASE("a TP size that does not divide the model is refused before anything is sharded", "[single]") {
  auto config = llama::presets::llama_tiny;
  config.num_key_value_heads = 1;
  config.num_attention_heads = 8;
  CHECK_THROWS_WITH(llama::Plan<Tp2>::validate(config, 2, "my-model/config.json"),
                    Catch::Contains("my-model/config.json: num_key_value_heads is not divisible by the TP size (2)"));
}
