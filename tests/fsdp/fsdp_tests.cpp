// FullyShardedDataParallel. Every test case is a rank body run on 2 ranks by launch.py (see
// CMakeLists.txt): each rank runs it and must pass. The reference is one full model per rank
// trained on the whole global batch; the sharded model sees its rank's half.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <thread>

#include <catch2/catch.hpp>

#include <meshtorch/comm/comm.hpp>
#include <meshtorch/comm/init.hpp>
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/parallel.hpp>
#include <meshtorch/train/caching_host_allocator.hpp>
#include <meshtorch/train/cpu_allocation_counter.hpp>

namespace mt = meshtorch;
using FsdpMesh = mt::Mesh<mt::FSDP<mt::dynamic>>;

namespace {

// An odd vocabulary, so the embedding and lm_head rows do not divide by 2 and need padding.
mt::llama::Config odd_tiny(bool tied = false) {
  auto config = mt::llama::presets::llama_tiny;
  config.vocab_size = 263;
  config.num_hidden_layers = 2;
  config.tie_word_embeddings = tied;
  return config;
}

mt::llama::LlamaForCausalLM full_llama(const mt::llama::Config& config) {
  mt::llama::LlamaForCausalLM model(config, torch::TensorOptions().device(torch::kMeta).dtype(torch::kFloat));
  mt::llama::materialize(model, torch::TensorOptions().dtype(torch::kFloat));
  return model;
}

struct Sharded {
  mt::llama::LlamaForCausalLM model;
  std::unique_ptr<mt::FullyShardedDataParallel> fsdp;
};

Sharded sharded_llama(const mt::llama::Config& config, const mt::comm::AxisGroup& group, mt::FsdpOptions options) {
  mt::llama::LlamaForCausalLM model(config, torch::TensorOptions().device(torch::kMeta).dtype(torch::kFloat));
  auto fsdp = std::make_unique<mt::FullyShardedDataParallel>(model, group, options, mt::llama_fsdp_adapter(config));
  for (auto& layer : model->model->decoder_layers) fsdp->fully_shard(layer);
  fsdp->fully_shard(model);
  fsdp->init_weights();
  return {model, std::move(fsdp)};
}

// max |a - b| / max(1, max |a|) over all weights, and where.
std::pair<double, std::string> largest_difference(mt::llama::LlamaForCausalLM& reference,
                                                  const mt::io::NamedTensors& gathered) {
  auto params = reference->named_parameters();
  REQUIRE(gathered.size() == params.size());
  double worst = 0;
  std::string where;
  for (const auto& [name, t] : gathered) {
    const auto* r = params.find(name);
    REQUIRE(r != nullptr);
    REQUIRE(r->sizes() == t.sizes());
    const double scale = std::max(1.0, r->abs().max().item<double>());
    const double diff = (*r - t).abs().max().item<double>() / scale;
    if (diff > worst) worst = diff, where = name;
  }
  return {worst, where};
}

// Every weight of two sharded models, gathered: equal bit for bit.
void check_same_weights(const Sharded& a, const Sharded& b) {
  const auto x = a.fsdp->full_state_dict(), y = b.fsdp->full_state_dict();
  REQUIRE(x.size() == y.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    INFO(x[i].first);
    CHECK(torch::equal(x[i].second, y[i].second));
  }
}

// Trains a reference and a sharded model side by side for 4 steps on the same global batches
// and checks every step's loss and the final parameters. The parameter tolerance is looser than
// the loss one: Adam divides by sqrt(v), which magnifies rounding in the smallest gradients.
void check_parity(mt::FsdpOptions options, int micro_batches, bool tied, double loss_rtol, double param_tol) {
  auto mesh = mt::comm::init<FsdpMesh>();
  const auto& group = mesh.group<mt::FSDP>();
  const auto config = odd_tiny(tied);
  torch::manual_seed(7);
  auto reference = full_llama(config);
  torch::manual_seed(7);
  auto sharded = sharded_llama(config, group, options);
  {
    const auto [diff, where] = largest_difference(reference, sharded.fsdp->full_state_dict());
    INFO("initial weights differ in " << where);
    CHECK(diff == 0.0);  // the same draws, row for row
  }
  mt::train::AdamW reference_optimizer(mt::train::named_trainable_parameters(*reference), {.lr = 1e-3});
  mt::train::AdamW optimizer(sharded.fsdp->named_parameters(), {.lr = 1e-3});

  torch::manual_seed(100);  // the same data on every rank
  double worst = 0;
  for (int step = 0; step < 4; ++step) {
    const auto ids = torch::randint(0, config.vocab_size, {4 * micro_batches, 32}, torch::kLong);
    double reference_loss = 0, local_loss = 0;
    for (int m = 0; m < micro_batches; ++m) {
      const auto micro = ids.narrow(0, 4 * m, 4);
      auto loss = reference->loss(micro, micro) / micro_batches;
      loss.backward();
      reference_loss += loss.item<double>();
      const auto local = micro.chunk(group.size(), 0)[group.rank()];
      auto sharded_loss = sharded.model->loss(local, local) / micro_batches;
      sharded_loss.backward();
      local_loss += sharded_loss.item<double>();
    }
    const double global_loss =
        mt::comm::all_reduce(group, torch::tensor({local_loss}, torch::kDouble), mt::comm::ReduceOp::avg)
            .item<double>();
    const double rel = std::abs(global_loss - reference_loss) / reference_loss;
    INFO("step " << step << ": reference " << reference_loss << ", sharded " << global_loss);
    CHECK(rel <= loss_rtol);
    worst = std::max(worst, rel);
    for (auto* opt : {&reference_optimizer, &optimizer}) {
      opt->step();
      opt->zero_grad();
    }
  }
  const auto [diff, where] = largest_difference(reference, sharded.fsdp->full_state_dict());
  INFO("largest loss difference " << worst << "; largest parameter difference " << diff << " in " << where);
  CHECK(diff <= param_tol);
}

}  // namespace

TEST_CASE("fsdp losses and parameters equal one full model on the same global batch", "[.][parity]") {
  check_parity({.reshard_after_forward = true}, 1, /*tied=*/false, 1e-5, 1e-4);
}

TEST_CASE("fsdp without resharding after forward equals one full model, tied embeddings too",
          "[.][parity_no_reshard]") {
  check_parity({.reshard_after_forward = false}, 1, /*tied=*/true, 1e-5, 1e-4);
}

TEST_CASE("fsdp accumulates gradients over micro-batches as one full model does", "[.][grad_accum]") {
  check_parity({.reshard_after_forward = true}, 2, /*tied=*/false, 1e-5, 1e-4);
}

TEST_CASE("fsdp prefetching two units and two reduce-scatters in flight equals one full model, over micro-batches",
          "[.][prefetch]") {
  check_parity({.reshard_after_forward = true, .prefetch_layers = 2, .reduce_scatters_in_flight = 2}, 2,
               /*tied=*/true, 1e-5, 1e-4);
}

TEST_CASE("fsdp with no prefetch and every reduce-scatter waited for at once equals one full model",
          "[.][synchronous]") {
  check_parity({.reshard_after_forward = true, .prefetch_layers = 0, .reduce_scatters_in_flight = 0}, 2,
               /*tied=*/false, 1e-5, 1e-4);
}

TEST_CASE(
    "fsdp issues the next unit's all-gather before the current unit computes, and backward ends with every "
    "gradient in .grad",
    "[.][overlap]") {
  auto mesh = mt::comm::init<FsdpMesh>();
  const auto config = odd_tiny();
  for (const std::int64_t prefetch : {0, 1}) {
    INFO("prefetch_layers = " << prefetch);
    auto sharded = sharded_llama(config, mesh.group<mt::FSDP>(), {.prefetch_layers = prefetch});
    const auto& units = sharded.fsdp->units();
    auto& layers = sharded.model->model->decoder_layers;
    // What the second layer's unit is doing while the first layer computes, in forward, and
    // what the first's is doing while the second computes its backward.
    std::optional<bool> next_gathering_in_forward, previous_gathering_in_backward;
    layers[0]->mlp->hooks.pre.push_back([&](const torch::Tensor& x) {
      next_gathering_in_forward = units[1]->is_gathering();
      return x;
    });
    layers[1]->mlp->hooks.post.push_back([&](const torch::Tensor&, const torch::Tensor& y) {
      if (y.requires_grad())
        y.register_hook([&](const torch::Tensor& g) {
          previous_gathering_in_backward = units[0]->is_gathering();
          return g;
        });
      return y;
    });
    const auto ids = torch::randint(0, config.vocab_size, {2, 16}, torch::kLong);
    sharded.model->loss(ids, ids).backward();
    REQUIRE(next_gathering_in_forward.has_value());
    REQUIRE(previous_gathering_in_backward.has_value());
    CHECK(*next_gathering_in_forward == (prefetch > 0));
    CHECK(*previous_gathering_in_backward == (prefetch > 0));
    for (const auto& unit : units) {
      CHECK(!unit->is_gathering());
      CHECK(!unit->is_unsharded());
    }
    for (const auto& [name, shard] : sharded.fsdp->named_parameters()) {
      INFO(name);
      CHECK(shard.grad().defined());  // the last reduce-scatters were waited for when backward ended
    }
  }
}

TEST_CASE("fsdp prefetch settings below zero are refused", "[.][bad_prefetch]") {
  auto mesh = mt::comm::init<FsdpMesh>();
  mt::llama::LlamaForCausalLM model(odd_tiny(), torch::TensorOptions().device(torch::kMeta).dtype(torch::kFloat));
  CHECK_THROWS_WITH(mt::FullyShardedDataParallel(model, mesh.group<mt::FSDP>(), {.prefetch_layers = -1}),
                    Catch::Contains("prefetch_layers -1 is negative"));
  CHECK_THROWS_WITH(mt::FullyShardedDataParallel(model, mesh.group<mt::FSDP>(), {.reduce_scatters_in_flight = -2}),
                    Catch::Contains("reduce_scatters_in_flight -2 is negative"));
  // Both refusals need no collective, so without this a rank could exit while its peer still
  // connects the world group ("Gloo connectFullMesh failed ... Connection closed by peer": seen
  // once under a loaded test run).
  mt::comm::barrier(mesh.world());
}

TEST_CASE("fsdp with bf16 compute and fp32 reduction keeps fp32 shards and tracks the fp32 model",
          "[.][mixed_precision]") {
  check_parity({.reshard_after_forward = true,
                .mixed_precision = {.param_dtype = torch::kBFloat16, .reduce_dtype = torch::kFloat}},
               1, /*tied=*/false, 2e-2, 2e-2);
}

TEST_CASE("fsdp frees each layer's full weights after forward and every unit's after backward", "[.][freed]") {
  auto mesh = mt::comm::init<FsdpMesh>();
  const auto& group = mesh.group<mt::FSDP>();
  const auto config = odd_tiny();
  for (const bool reshard : {true, false}) {
    INFO("reshard_after_forward = " << reshard);
    torch::manual_seed(1);
    auto sharded = sharded_llama(config, group, {.reshard_after_forward = reshard});
    const auto& units = sharded.fsdp->units();
    REQUIRE(units.size() == 3);  // two layers, then the root
    CHECK(units[0]->name() == "model.layers.0");
    CHECK(units[2]->is_root());

    // Each rank holds its rows only: 263 vocabulary rows split 132 + 131.
    auto named = sharded.fsdp->named_parameters();
    const auto embedding =
        std::find_if(named.begin(), named.end(), [](auto& p) { return p.first == "model.embed_tokens.weight"; });
    REQUIRE(embedding != named.end());
    CHECK(embedding->second.size(0) == (group.rank() == 0 ? 132 : 131));
    CHECK(embedding->second.is_leaf());
    CHECK(sharded.fsdp->local_numel() < sharded.fsdp->full_numel() / 2 + 1000);
    for (const auto& unit : units) CHECK(!unit->is_unsharded());  // nothing whole before forward

    const auto ids = torch::randint(0, config.vocab_size, {2, 16}, torch::kLong);
    auto loss = sharded.model->loss(ids, ids);
    auto& up_proj = sharded.model->model->decoder_layers[0]->mlp->up_proj->weight;
    CHECK(up_proj.sizes() == torch::IntArrayRef({config.intermediate_size, config.hidden_size}));
    if (reshard) {
      CHECK(units[0]->full_storage().nbytes() == 0);
      CHECK(units[1]->full_storage().nbytes() == 0);
      CHECK(up_proj.storage().nbytes() == 0);  // the tensor autograd saved, without memory
    } else {
      CHECK(units[0]->full_storage().nbytes() == static_cast<std::size_t>(units[0]->gathered_numel()) * 4);
    }
    CHECK(units[2]->is_unsharded());  // the root keeps its weights for backward
    loss.backward();
    for (const auto& unit : units) CHECK(!unit->is_unsharded());
    for (const auto& [name, shard] : named) {
      INFO(name);
      REQUIRE(shard.grad().defined());
      CHECK(shard.grad().sizes() == shard.sizes());
    }
  }
}

TEST_CASE(
    "fsdp stepping AdamW in backward as each unit's gradients arrive equals stepping after backward, "
    "bit for bit, and never holds two units' gradients",
    "[.][optimizer_in_backward]") {
  auto mesh = mt::comm::init<FsdpMesh>();
  const auto& group = mesh.group<mt::FSDP>();
  const auto config = odd_tiny(/*tied=*/true);
  // Prefetching and reduce-scatters in flight as chapter 5 runs them, and more.
  for (const std::int64_t in_flight : {1, 2}) {
    INFO("reduce_scatters_in_flight = " << in_flight);
    const mt::FsdpOptions options{.prefetch_layers = 1, .reduce_scatters_in_flight = in_flight};
    torch::manual_seed(3);
    auto after = sharded_llama(config, group, options);
    torch::manual_seed(3);
    auto during = sharded_llama(config, group, options);
    mt::train::AdamW after_optimizer(after.fsdp->named_parameters(), {.lr = 1e-3});
    mt::train::AdamW during_optimizer(during.fsdp->named_parameters(), {.lr = 1e-3});
    const auto shards = during.fsdp->named_parameters();
    auto shards_with_gradients = [&] {
      std::int64_t n = 0;
      for (const auto& [name, shard] : shards) n += shard.grad().defined();
      return n;
    };
    // At each call: how many shards of other units hold a gradient.
    std::vector<std::int64_t> held_at_each_call;
    during.fsdp->on_gradients_ready([&](const std::vector<torch::Tensor>& unit_shards) {
      held_at_each_call.push_back(shards_with_gradients() - static_cast<std::int64_t>(unit_shards.size()));
      for (const auto& shard : unit_shards) REQUIRE(shard.grad().defined());
      during_optimizer.step(unit_shards);
      for (const auto& shard : unit_shards) shard.mutable_grad() = torch::Tensor();
    });
    const auto units = static_cast<std::int64_t>(during.fsdp->units().size());
    torch::manual_seed(11);
    for (int step = 0; step < 3; ++step) {
      const auto ids = torch::randint(0, config.vocab_size, {2, 16}, torch::kLong);
      const double lr = 1e-3 * (step + 1);  // a schedule: set before backward, which steps
      after_optimizer.set_lr(lr);
      during_optimizer.set_lr(lr);
      auto after_loss = after.model->loss(ids, ids);
      after_loss.backward();
      after_optimizer.step();
      after_optimizer.zero_grad();
      held_at_each_call.clear();
      auto during_loss = during.model->loss(ids, ids);
      during_loss.backward();
      CHECK(during_loss.item<double>() == after_loss.item<double>());
      // Every unit stepped once, each while it alone held gradients; none left after backward.
      REQUIRE(static_cast<std::int64_t>(held_at_each_call.size()) == units);
      CHECK(held_at_each_call == std::vector<std::int64_t>(units, 0));
      CHECK(shards_with_gradients() == 0);
    }
    check_same_weights(after, during);
  }
  // Stepping a tensor the optimizer was not built with, and a hook nothing would call.
  mt::train::AdamW optimizer({{"w", torch::zeros({2}, torch::requires_grad())}}, {});
  CHECK_THROWS_WITH(optimizer.step({torch::zeros({3})}),
                    Catch::Contains("a tensor of shape [3] is not one of the 1 parameters"));
  auto synchronous = sharded_llama(config, group, {.reduce_scatters_in_flight = 0});
  CHECK_THROWS_WITH(synchronous.fsdp->on_gradients_ready([](const std::vector<torch::Tensor>&) {}),
                    Catch::Contains("reduce_scatters_in_flight is 0") &&
                        Catch::Contains("rank " + std::to_string(group.global_rank())));
}

TEST_CASE(
    "fsdp with cpu_offload, whose gradients land in .grad after later units' reduce-scatters, gives the "
    "gradients and weights of shards on the device bit for bit, over micro-batches and into kept gradients",
    "[.][offload]") {
  auto mesh = mt::comm::init<FsdpMesh>();
  const auto& group = mesh.group<mt::FSDP>();
  const auto config = odd_tiny(/*tied=*/true);
  for (const std::int64_t in_flight : {1, 2}) {
    INFO("reduce_scatters_in_flight = " << in_flight);
    const mt::FsdpOptions on_device{.prefetch_layers = 1, .reduce_scatters_in_flight = in_flight};
    auto offloaded_options = on_device;
    offloaded_options.cpu_offload = true;
    torch::manual_seed(5);
    auto device = sharded_llama(config, group, on_device);
    torch::manual_seed(5);
    auto offloaded = sharded_llama(config, group, offloaded_options);
    mt::train::AdamW device_optimizer(device.fsdp->named_parameters(), {.lr = 1e-3});
    mt::train::AdamW offloaded_optimizer(offloaded.fsdp->named_parameters(), {.lr = 1e-3});
    const auto device_shards = device.fsdp->named_parameters(), offloaded_shards = offloaded.fsdp->named_parameters();
    torch::manual_seed(13);
    for (int step = 0; step < 3; ++step) {
      const auto ids = torch::randint(0, config.vocab_size, {4, 16}, torch::kLong);
      for (int micro = 0; micro < 2; ++micro) {
        const auto batch = ids.narrow(0, 2 * micro, 2);
        (device.model->loss(batch, batch) / 2).backward();
        (offloaded.model->loss(batch, batch) / 2).backward();
        // Backward's end lands every unit's gradients, the first micro-batch's set, the
        // second's added (and after the first step, added to the zeroed gradients kept).
        for (std::size_t i = 0; i < device_shards.size(); ++i) {
          INFO("step " << step << ", micro-batch " << micro << ": " << device_shards[i].first);
          REQUIRE(offloaded_shards[i].second.grad().defined());
          CHECK(torch::equal(device_shards[i].second.grad(), offloaded_shards[i].second.grad()));
        }
      }
      device_optimizer.step();
      offloaded_optimizer.step();
      device_optimizer.zero_grad();
      offloaded_optimizer.zero_grad(/*set_to_none=*/false);  // the guide's choice when offloading
    }
    check_same_weights(device, offloaded);
  }
}

TEST_CASE("fsdp misuse is a clear error naming the module, tensor or rank", "[.][bad_input]") {
  auto mesh = mt::comm::init<FsdpMesh>();
  const auto& group = mesh.group<mt::FSDP>();
  const auto config = odd_tiny();
  mt::llama::LlamaForCausalLM model(config, torch::TensorOptions().device(torch::kMeta).dtype(torch::kFloat));
  mt::FullyShardedDataParallel fsdp(model, group, {}, mt::llama_fsdp_adapter(config));
  fsdp.fully_shard(model->model->decoder_layers[0]);
  CHECK_THROWS_WITH(fsdp.fully_shard(model->model->decoder_layers[0]),
                    Catch::Contains("fully_shard('model.layers.0')") && Catch::Contains("no weight"));
  CHECK_THROWS_WITH(fsdp.init_weights(), Catch::Contains("call fully_shard on the layers and then on the root") &&
                                             Catch::Contains("rank " + std::to_string(group.global_rank())));
  fsdp.fully_shard(model->model->decoder_layers[1]);
  fsdp.fully_shard(model);
  CHECK_THROWS_WITH(fsdp.fully_shard(model->model->norm), Catch::Contains("the root is already sharded"));

  auto full = full_llama(config);
  mt::io::NamedTensors tensors;
  for (const auto& item : full->named_parameters()) tensors.emplace_back(item.key(), item.value());
  fsdp.load_full_state_dict(tensors, "good.safetensors");
  tensors[3].second = torch::zeros({5, 5});
  CHECK_THROWS_WITH(fsdp.load_full_state_dict(tensors, "bad.safetensors"),
                    Catch::Contains("bad.safetensors: tensor '" + tensors[3].first + "' has shape [5, 5]"));
  tensors.erase(tensors.begin() + 3);
  CHECK_THROWS_WITH(fsdp.load_full_state_dict(tensors, "short.safetensors"),
                    Catch::Contains("short.safetensors: weight '") && Catch::Contains("' is missing"));
}

namespace {

// A weight that is neither Linear, Embedding nor a norm: one scale per feature.
class ScaleImpl : public mt::WeightModule {
 public:
  ScaleImpl(std::int64_t features, const torch::TensorOptions& options) { create_weight({features}, options); }
  torch::Tensor forward(const torch::Tensor& x) {
    return hooks.around(x, [&](const torch::Tensor& in) { return in * weight_in_use(); });
  }
};
TORCH_MODULE(Scale);

// A tree FSDP has never seen: up -> relu -> scale -> down, the root running its body through
// its own hooks as a model that FSDP may shard must.
class TwoLayerMlpImpl : public torch::nn::Module {
 public:
  TwoLayerMlpImpl(std::int64_t in, std::int64_t hidden, std::int64_t out, const torch::TensorOptions& options)
      : up(register_module("up", mt::llama::Linear(in, hidden, options))),
        scale(register_module("scale", Scale(hidden, options))),
        down(register_module("down", mt::llama::Linear(hidden, out, options))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return hooks.around(x, [&](const torch::Tensor& in) { return down(scale(torch::relu(up(in)))); });
  }
  mt::llama::Linear up;
  Scale scale;
  mt::llama::Linear down;
  mt::ForwardHooks hooks;
};
TORCH_MODULE(TwoLayerMlp);

// This tree's own initialisation, used by the reference directly and by FSDP through the adapter.
void init_mlp_weight(const mt::WeightModule& leaf, torch::Tensor& weight) {
  torch::NoGradGuard no_grad;
  if (dynamic_cast<const ScaleImpl*>(&leaf))
    weight.uniform_(0.5, 1.5);
  else
    weight.normal_(0.0, 0.3);
}

TwoLayerMlp mlp(const torch::TensorOptions& options) { return TwoLayerMlp(6, 7, 5, options); }  // 7 rows: padded

}  // namespace

TEST_CASE(
    "fsdp shards a module tree that is not Llama, units named by the caller, and trains it to one process's "
    "losses",
    "[.][any_module]") {
  auto mesh = mt::comm::init<FsdpMesh>();
  const auto& group = mesh.group<mt::FSDP>();
  torch::manual_seed(11);
  auto reference = mlp(torch::TensorOptions().dtype(torch::kFloat));
  for (auto& [name, leaf] : mt::weight_modules(*reference)) init_mlp_weight(*leaf, leaf->weight);

  torch::manual_seed(11);
  auto sharded = mlp(torch::TensorOptions().device(torch::kMeta).dtype(torch::kFloat));
  mt::FullyShardedDataParallel fsdp(
      sharded, group, {},
      {.initialise = [](const mt::LeafTensor& tensor, torch::Tensor& full) { init_mlp_weight(*tensor.leaf, full); }});
  fsdp.fully_shard(sharded->up);
  fsdp.fully_shard(sharded->down);
  fsdp.fully_shard(sharded);  // the root takes the rest: scale
  fsdp.init_weights();
  REQUIRE(fsdp.units().size() == 3);
  CHECK(fsdp.units()[2]->parameters().size() == 1);
  CHECK(fsdp.units()[2]->parameters()[0].name == "scale.weight");
  {
    const auto gathered = fsdp.full_state_dict();
    REQUIRE(gathered.size() == 3);
    for (const auto& [name, full] : gathered) {
      INFO(name);
      CHECK(torch::equal(full, reference->named_parameters()[name]));  // the same draws, row for row
    }
  }

  mt::train::AdamW reference_optimizer(mt::train::named_trainable_parameters(*reference), {.lr = 1e-2});
  mt::train::AdamW optimizer(fsdp.named_parameters(), {.lr = 1e-2});
  torch::manual_seed(100);  // the same data on every rank
  for (int step = 0; step < 4; ++step) {
    const auto x = torch::randn({8, 6});
    const auto target = torch::randn({8, 5});
    auto reference_loss = torch::mse_loss(reference(x), target);
    reference_loss.backward();
    const auto local = x.chunk(group.size(), 0)[group.rank()];
    const auto local_target = target.chunk(group.size(), 0)[group.rank()];
    auto loss = torch::mse_loss(sharded(local), local_target);
    loss.backward();
    const double global_loss =
        mt::comm::all_reduce(group, loss.detach().to(torch::kDouble).reshape({1}), mt::comm::ReduceOp::avg)
            .item<double>();
    INFO("step " << step << ": one process " << reference_loss.item<double>() << ", 2 ranks " << global_loss);
    CHECK(std::abs(global_loss - reference_loss.item<double>()) <= 1e-5 * reference_loss.item<double>());
    for (auto* opt : {&reference_optimizer, &optimizer}) {
      opt->step();
      opt->zero_grad();
    }
  }
  for (const auto& [name, full] : fsdp.full_state_dict()) {
    const auto diff = (full - reference->named_parameters()[name]).abs().max().item<double>();
    INFO(name << " differs by " << diff);
    CHECK(diff <= 1e-5);
  }

  // Without an adapter nothing says how a weight starts: init_weights refuses, naming the fix.
  auto bare = mlp(torch::TensorOptions().device(torch::kMeta).dtype(torch::kFloat));
  mt::FullyShardedDataParallel unadapted(bare, group);
  unadapted.fully_shard(bare);
  CHECK_THROWS_WITH(unadapted.init_weights(), Catch::Contains("has no `initialise`"));
}

// One test case per tag: each initialises the mesh once, and a second init in the same process
// races the first one's store.
TEST_CASE(
    "fsdp's collectives on the CPU allocate no buffer of the unit's size: the reduce-scatter sums "
    "each rank's block in the send buffer and gives it back when the sums arrive, the all-gather "
    "writes each rank's block straight into the output",
    "[.][collectives_in_place]") {
  auto mesh = mt::comm::init<FsdpMesh>();
  const auto& group = mesh.group<mt::FSDP>();
  auto& counter = mt::train::CpuAllocationCounter::install();
  const std::int64_t block = std::int64_t{1} << 20;

  // Gloo's own _reduce_scatter_base clones its input and all-reduces the clone, so a unit's
  // gradients were held twice until waited for; FSDP all-reduces its send buffer in place.
  // Rank r sends position + r + 1 at each position of the buffer.
  auto send = torch::arange(group.size() * block, torch::kFloat) + (group.rank() + 1);
  auto output = torch::empty({block}, torch::kFloat);
  const auto before = counter.current();
  counter.reset_peak();
  const auto send_bytes = static_cast<std::int64_t>(send.nbytes());
  auto work = mt::fsdp_detail::start_reduce_scatter_sum_flat(group, output, send, "test reduce_scatter");
  // The buffer's memory is given back when the sums arrive, before anyone waits: FSDP waits a
  // layer later. Polled, since only Gloo's thread knows when that is.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (counter.current() > before - send_bytes && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(counter.current() <= before - send_bytes);
  work.wait();
  CHECK(send.storage().nbytes() == 0);
  INFO("allocated while the collective ran: " << counter.peak() - before << " bytes; the send buffer was "
                                              << send_bytes);
  CHECK(counter.peak() - before < send_bytes / 8);
  // Over ranks: size x position + (1 + 2 + ... + size), on this rank's block of positions.
  const auto positions = torch::arange(group.rank() * block, (group.rank() + 1) * block, torch::kFloat);
  CHECK(torch::equal(output, positions * group.size() + group.size() * (group.size() + 1) / 2));

  // Gloo's own all-gather receives into a fresh buffer of the whole output and copies it out, so
  // a gather in flight held its unit twice; FSDP broadcasts each rank's block into its place.
  // Rank r holds positions r x block ... (r + 1) x block - 1.
  auto input = torch::arange(group.rank() * block, (group.rank() + 1) * block, torch::kFloat);
  auto gathered = torch::empty({group.size() * block}, torch::kFloat);
  const auto before_gather = counter.current();
  counter.reset_peak();
  mt::fsdp_detail::start_all_gather_flat(group, gathered, input, "test all_gather").wait();
  const auto gathered_bytes = static_cast<std::int64_t>(gathered.nbytes());
  INFO("allocated while the all-gather ran: " << counter.peak() - before_gather << " bytes; the output is "
                                              << gathered_bytes);
  CHECK(counter.peak() - before_gather < gathered_bytes / 8);
  CHECK(torch::equal(gathered, torch::arange(group.size() * block, torch::kFloat)));
  // Gloo's own call, counted the same way, allocates the output's size on its thread: what the
  // check above would see if FSDP still went through it.
  counter.reset_peak();
  c10d::AllgatherOptions options;
  options.timeout = group.timeout();
  group.backend()->_allgather_base(gathered, input, options)->wait(group.timeout());
  CHECK(counter.peak() - before_gather >= gathered_bytes);
}

TEST_CASE("fsdp's all-gather on the CPU that a rank never joins fails within the group's timeout, naming it",
          "[.][gather_timeout]") {
  // The gather is one broadcast per rank: the wait bounds them all by one timeout.
  mt::comm::InitOptions options;
  options.timeout = std::chrono::seconds(4);  // also bounds how long the group's teardown waits
  auto mesh = mt::comm::init<FsdpMesh>(options);
  if (mesh.rank() == 0) {
    const auto group = mesh.group<mt::FSDP>().with_timeout(std::chrono::seconds(1));
    auto input = torch::ones({1024});
    auto output = torch::empty({group.size() * 1024});
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(
        mt::fsdp_detail::start_all_gather_flat(group, output, input, "FSDP all_gather of 'layers.0'").wait(),
        Catch::Contains("FSDP all_gather of 'layers.0' over the FSDP group [0, 1] on rank 0 failed") &&
            Catch::Contains("timeout 1000 ms"));
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(3));
  } else {
    std::this_thread::sleep_for(std::chrono::seconds(2));
  }
}

TEST_CASE("fsdp steps after the first take their large host blocks from the caching allocator", "[.][host_cache]") {
  // What launch() installs on CPU runs: a freed block of 1 MiB or more is kept for its size. An
  // FSDP step allocates the same sizes every time (a unit's gathered weights, the
  // reduce-scatter buffers, gradients), so after the first steps they come
  // from the cache: resident memory stops growing, where glibc's heap kept fragmenting (chapter 7).
  mt::train::CachingHostAllocator::install();
  auto& cache = mt::train::CachingHostAllocator::instance();
  auto mesh = mt::comm::init<FsdpMesh>();
  const auto& group = mesh.group<mt::FSDP>();
  auto config = odd_tiny();
  config.hidden_size = 256;  // layers of about 1.5 MB on each rank: large blocks
  config.intermediate_size = 512;
  torch::manual_seed(1);
  auto sharded = sharded_llama(config, group, {});
  mt::train::AdamW optimizer(sharded.fsdp->named_parameters(), {.lr = 1e-3});
  auto step = [&] {
    const auto ids = torch::randint(0, config.vocab_size, {2, 64}, torch::kLong);
    sharded.model->loss(ids, ids).backward();
    optimizer.step();
    optimizer.zero_grad();
  };
  step();
  step();  // AdamW's state is made in the first step
  const auto reserved = cache.reserved_bytes();
  CHECK(reserved > 0);
  CHECK(cache.cached_bytes() > 0);  // the step's buffers, given back to the cache when it ended
  cache.reset_stats();
  for (int i = 0; i < 4; ++i) step();
  // Most large blocks of later steps are ones given back before (48 of 48 here; 40 when the cache
  // held no more than the rank's peak in tensors, exact sizes only, which made it give back at
  // forward's peak blocks that backward then made again; 32 when a block it could not serve made
  // it give back as many bytes, oldest first). The total does not grow. It may differ by one
  // unit-sized block between two runs: the transport's thread gives a reduce-scatter's send buffer
  // back when the sums arrive, before or after the next unit asks for a block of that size.
  std::size_t largest_unit_bytes = 0;
  for (const auto& unit : sharded.fsdp->units())
    largest_unit_bytes = std::max(largest_unit_bytes, static_cast<std::size_t>(unit->gathered_numel()) * 4);
  const auto stats = cache.stats();
  INFO(stats.served_from_cache << " of " << stats.large_allocations << " large allocations from the cache; reserved "
                               << reserved << " -> " << cache.reserved_bytes() << " bytes");
  // Each of the 4 steps allocates, for each of the 3 units, at least its gathered buffer, its full
  // weights and its reduce-scatter's send buffer.
  CHECK(stats.large_allocations >= 4 * 3 * 3);
  CHECK(stats.served_from_cache >= stats.large_allocations * 7 / 8);
  CHECK(cache.reserved_bytes() <= reserved + largest_unit_bytes);
  CHECK(cache.reserved_bytes() <=
        cache.peak_live_bytes() + cache.peak_live_bytes() / mt::train::CachingHostAllocator::headroom_divisor);
}
