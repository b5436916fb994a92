// The training loop's parts: data, sampler, loader, optimizer, schedule, checkpoints.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numbers>
#include <numeric>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>

#include <catch2/catch.hpp>
#include <google/protobuf/compiler/parser.h>
#include <google/protobuf/descriptor.pb.h>
#include <google/protobuf/dynamic_message.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/text_format.h>

// LibTorch's own AdamW and clipping, the references (not in the parts of LibTorch meshtorch includes).
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <meshtorch/meshtorch.hpp>
#include <meshtorch/models/llama/memory_plan.hpp>
#include <meshtorch/parallel/activation_checkpointing.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/train/caching_host_allocator.hpp>
#include <meshtorch/train/cpu_allocation_counter.hpp>
#include <meshtorch/train/evaluation.hpp>
#include <meshtorch/train/grad_clipping.hpp>
#include <meshtorch/train/profiler.hpp>
#include <meshtorch/train/tensorboard.hpp>

#include "test_support.hpp"

namespace mt = meshtorch;
namespace fs = std::filesystem;
using meshtorch::testing::fresh_dir;

namespace {

using PlainCheckpointing = mt::train::Checkpointing<mt::llama::LlamaForCausalLM>;

// A one-layer llama-tiny with initialised weights (from the current seed) and its AdamW: what
// the checkpoint tests save and restore.
mt::llama::LlamaForCausalLM initialised_one_layer_model() {
  auto config = mt::llama::presets::llama_tiny;
  config.num_hidden_layers = 1;
  mt::llama::LlamaForCausalLM model(config);
  mt::llama::init_weights(model);
  return model;
}

struct OneLayerTraining {
  mt::llama::LlamaForCausalLM model = initialised_one_layer_model();
  mt::train::AdamW optimizer{mt::train::named_trainable_parameters(*model), {}};
};

std::string error_of(const auto& body) {
  try {
    body();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("a global batch holds the same samples whatever the data-parallel split", "[sampler]") {
  const std::int64_t samples = 101;
  auto rows_of_step = [&](std::int64_t batch, std::int64_t dp, std::int64_t accum, std::int64_t step) {
    std::multiset<std::int64_t> rows;
    for (std::int64_t rank = 0; rank < dp; ++rank) {
      mt::data::DpInvariantSampler sampler({samples, batch, dp, rank, accum, /*seed=*/7});
      const auto perm = sampler.permutation(/*epoch=*/2);
      for (std::int64_t m = 0; m < accum; ++m)
        for (auto i : sampler.indices(perm, step, m)) rows.insert(i);
    }
    return rows;
  };
  for (std::int64_t step : {0, 5, 11}) {
    const auto single = rows_of_step(8, 1, 1, step);
    CHECK(single.size() == 8);
    CHECK(rows_of_step(2, 4, 1, step) == single);
    CHECK(rows_of_step(4, 2, 1, step) == single);
    CHECK(rows_of_step(2, 2, 2, step) == single);
    CHECK(rows_of_step(1, 1, 8, step) == single);
  }
  mt::data::DpInvariantSampler sampler({samples, 8, 1, 0, 1, 7});
  CHECK(sampler.steps_per_epoch() == 12);  // drop-last
}

TEST_CASE("each epoch is a seeded permutation without repeats", "[sampler]") {
  mt::data::DpInvariantSampler a({50, 5, 1, 0, 1, 1}), b({50, 5, 1, 0, 1, 2});
  const auto p0 = a.permutation(0), p1 = a.permutation(1);
  CHECK(std::set<std::int64_t>(p0.begin(), p0.end()).size() == 50);
  CHECK(p0 == a.permutation(0));
  CHECK(p0 != p1);
  CHECK(p0 != b.permutation(0));
  // Ranks of one step never share a row.
  std::set<std::int64_t> seen;
  for (std::int64_t rank = 0; rank < 5; ++rank) {
    mt::data::DpInvariantSampler r({50, 2, 5, rank, 1, 1});
    for (auto i : r.indices(r.permutation(0), 3, 0)) CHECK(seen.insert(i).second);
  }
}

TEST_CASE("sampler options that cannot work are refused with the flag's name", "[sampler]") {
  CHECK_THAT(error_of([] { mt::data::DpInvariantSampler({10, 8, 2, 0, 1, 0}); }), Catch::Contains("-b/--batch-size"));
  CHECK_THAT(error_of([] { mt::data::DpInvariantSampler({10, 0, 1, 0, 1, 0}); }), Catch::Contains("-b/--batch-size"));
  CHECK_THAT(error_of([] { mt::data::DpInvariantSampler({10, 1, 2, 2, 1, 0}); }), Catch::Contains("rank 2"));
}

TEST_CASE("documents are packed into full blocks and the remainder dropped", "[data]") {
  const auto dir = fresh_dir("data");
  std::ofstream(dir / "a.txt") << "hello\nworld\n\nsecond doc\n";
  auto blocks = mt::data::load_dataset((dir / "a.txt").string(), 4);
  // <bos> hello\nworld <eos> <bos> second doc <eos> = 2 + 11 + 2 + 10 = 25 tokens -> 6 blocks of 4
  CHECK(blocks.size() == 6);
  const auto first = blocks.gather({0, 1});
  CHECK(first[0][0].item<int64_t>() == mt::data::ByteTokenizer::bos_id);
  CHECK(first[0][1].item<int64_t>() == 'h');
  CHECK(first[1][0].item<int64_t>() == 'l');

  std::ofstream(dir / "b.jsonl") << R"({"text": "abc"})"
                                 << "\n"
                                 << R"({"instruction": "add", "input": "", "output": "4"})"
                                 << "\n";
  auto jsonl = mt::data::load_dataset((dir / "b.jsonl").string(), 2);
  const auto alpaca = mt::data::format_alpaca("add", "", "4");
  CHECK(jsonl.size() == static_cast<std::int64_t>((5 + alpaca.size() + 2) / 2));

  std::ofstream(dir / "bad.jsonl") << R"({"text": "ok"})"
                                   << "\n"
                                   << R"({"txt": "no"})"
                                   << "\n";
  CHECK_THAT(error_of([&] { mt::data::load_dataset((dir / "bad.jsonl").string(), 2); }),
             Catch::Contains("bad.jsonl:2") && Catch::Contains("'text'"));
  std::ofstream(dir / "broken.jsonl") << "{\"text\": \n";
  CHECK_THAT(error_of([&] { mt::data::load_dataset((dir / "broken.jsonl").string(), 2); }),
             Catch::Contains("broken.jsonl:1") && Catch::Contains("not valid JSON"));
  std::ofstream(dir / "x.bin") << "not tokens";
  CHECK_THAT(error_of([&] { mt::data::load_dataset((dir / "x.bin").string(), 2); }), Catch::Contains("magic number"));
  CHECK_THAT(error_of([&] { mt::data::load_dataset((dir / "missing.txt").string(), 2); }),
             Catch::Contains("neither 'builtin', an existing file or folder"));
  CHECK_THAT(error_of([&] { mt::data::load_dataset((dir / "a.txt").string(), 100); }),
             Catch::Contains("do not fill one block"));
  CHECK_THAT(error_of([&] { blocks.check_vocab(200); }), Catch::Contains("outside the model's vocab_size 200"));
  CHECK_THAT(error_of([&] { blocks.gather({6}); }), Catch::Contains("block 6 requested of 6"));
  fs::remove_all(dir);
}

TEST_CASE("the built-in corpus is deterministic and byte-tokenisable", "[data]") {
  const auto a = mt::data::builtin_corpus(20000), b = mt::data::builtin_corpus(20000);
  CHECK(a == b);
  std::size_t bytes = 0;
  for (const auto& doc : a) bytes += doc.size();
  CHECK(bytes >= 19000);
  CHECK(a[0].find("  ") == std::string::npos);
}

TEST_CASE("the prefetching loader yields the sampler's rows in order and rethrows errors", "[data]") {
  std::vector<std::int32_t> tokens(40 * 3);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>(i / 3);  // row r = r,r,r
  const mt::data::TokenBlocks blocks(tokens, 3, "test");
  const mt::data::DpInvariantSampler sampler({40, 2, 2, 1, 2, 5});
  mt::data::PrefetchingLoader loader(blocks, sampler, /*epoch=*/1, /*first_step=*/3, /*pin_memory=*/false);
  const auto perm = sampler.permutation(1);
  std::int64_t count = 0;
  for (std::int64_t step = 3; step < sampler.steps_per_epoch(); ++step)
    for (std::int64_t micro = 0; micro < 2; ++micro) {
      auto batch = loader.next();
      REQUIRE(batch);
      CHECK(batch->step == step);
      CHECK(batch->micro == micro);
      const auto expected = sampler.indices(perm, step, micro);
      for (std::size_t i = 0; i < expected.size(); ++i) CHECK(batch->input_ids[i][0].item<int64_t>() == expected[i]);
      ++count;
    }
  CHECK(count == (sampler.steps_per_epoch() - 3) * 2);
  CHECK_FALSE(loader.next());
}

TEST_CASE("held-out blocks: --eval-split keeps the last ones, and any rank count evaluates each once", "[data]") {
  std::vector<std::int32_t> tokens(10 * 4 + 2);  // 10 blocks of 4 (row r starts at 4r), 2 tokens dropped
  std::iota(tokens.begin(), tokens.end(), 0);
  mt::data::TokenBlocks blocks(tokens, 4, "test");
  CHECK(blocks.held_out() == nullptr);
  const auto& held = blocks.hold_out(0.3);
  CHECK(&held == blocks.held_out());  // what it returns is what it keeps
  CHECK(blocks.size() == 7);
  REQUIRE(held.size() == 3);
  REQUIRE(blocks.held_out() != nullptr);
  CHECK(blocks.held_out()->size() == 3);
  CHECK(held.gather({0, 1, 2})[2][3].item<std::int64_t>() == 39);  // the last block, whole
  CHECK(blocks.gather({6})[0][0].item<std::int64_t>() == 24);      // training keeps blocks 0-6
  CHECK_THROWS_WITH(blocks.gather({7}), Catch::Contains("block 7 requested of 7"));
  CHECK_THROWS_WITH(blocks.hold_out(0.1), Catch::Contains("already held out"));
  mt::data::TokenBlocks few(tokens, 20, "few");  // 2 blocks
  CHECK_THROWS_WITH(few.hold_out(0.8), Catch::Contains("few has 2 block(s) of 20 tokens, which would leave none"));
  CHECK_THROWS_WITH(few.hold_out(0), Catch::Contains("above 0 and below 1"));
  CHECK(mt::data::TokenBlocks(tokens, 4, "t").hold_out(0.001).size() == 1);  // at least one

  // A "loss" that is each row's first id: the mean over the held-out blocks is (28 + 32 + 36) / 3.
  const auto first_ids = [](const torch::Tensor& ids) { return ids.select(1, 0).to(torch::kDouble).mean(); };
  for (const std::int64_t ranks : {1, 2, 3}) {
    for (const std::int64_t batch : {1, 2, 5}) {
      double summed = 0;
      std::vector<int> forwards(static_cast<std::size_t>(ranks), 0);
      for (std::int64_t rank = 0; rank < ranks; ++rank) {
        const auto result = mt::train::evaluate_held_out(
            held, batch, ranks, rank, torch::kCPU,
            [&](const torch::Tensor& ids) {
              ++forwards[static_cast<std::size_t>(rank)];
              return first_ids(ids);
            },
            [&](torch::Tensor t) {
              summed += t.item<double>() / static_cast<double>(ranks);  // this rank's part of the mean
              return t;
            });
        CHECK(result.blocks == 3);
        CHECK(result.tokens == 3 * 3);
      }
      INFO(ranks << " ranks, batches of " << batch);
      CHECK(summed == Approx(32.0).epsilon(1e-12));
      CHECK(std::set<int>(forwards.begin(), forwards.end()).size() == 1);  // the same number of forwards on each
    }
  }
  CHECK_THROWS_WITH(
      mt::train::evaluate_held_out(held, 1, 4, 0, torch::kCPU, first_ids, [](torch::Tensor t) { return t; }),
      Catch::Contains("holds out 3 block(s), fewer than the 4 data-parallel ranks"));
}

TEST_CASE("deterministic mode: LibTorch's deterministic algorithms and cuBLAS's fixed workspace", "[optim]") {
  ::unsetenv("CUBLAS_WORKSPACE_CONFIG");
  mt::train::use_deterministic_algorithms(false);
  CHECK_FALSE(at::globalContext().deterministicAlgorithms());
  mt::train::use_deterministic_algorithms(true);
  CHECK(at::globalContext().deterministicAlgorithms());
  CHECK_FALSE(at::globalContext().deterministicAlgorithmsWarnOnly());
  CHECK_FALSE(at::globalContext().benchmarkCuDNN());
  REQUIRE(std::getenv("CUBLAS_WORKSPACE_CONFIG"));
  CHECK(std::string(std::getenv("CUBLAS_WORKSPACE_CONFIG")) == ":4096:8");
  at::globalContext().setDeterministicAlgorithms(false, false);
}

TEST_CASE("fused AdamW matches LibTorch's reference AdamW", "[optim]") {
  torch::manual_seed(0);
  auto w1 = torch::randn({6, 5}, torch::requires_grad());
  auto w2 = w1.detach().clone().requires_grad_(true);
  mt::train::AdamW ours({{"w", w1}}, {.lr = 1e-2});
  torch::optim::AdamW reference({w2}, torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  for (int step = 0; step < 5; ++step) {
    const auto target = torch::randn({6, 5});
    (w1 - target).pow(2).sum().backward();
    (w2 - target).pow(2).sum().backward();
    ours.step();
    ours.zero_grad();
    reference.step();
    reference.zero_grad();
    CHECK_FALSE(w1.grad().defined());
  }
  INFO("max difference " << (w1 - w2).abs().max().item<double>());
  CHECK(torch::allclose(w1, w2, 1e-6, 1e-6));
}

TEST_CASE("AdamW zero_grad without set_to_none keeps each gradient's memory and steps as set_to_none does", "[optim]") {
  torch::manual_seed(0);
  auto kept = torch::randn({4, 3}, torch::requires_grad());
  auto freed = kept.detach().clone().requires_grad_(true);
  mt::train::AdamW keeps({{"w", kept}}, {.lr = 1e-2});
  mt::train::AdamW frees({{"w", freed}}, {.lr = 1e-2});
  const void* first_buffer = nullptr;
  for (int step = 0; step < 3; ++step) {
    const auto target = torch::randn({4, 3});
    (kept - target).pow(2).sum().backward();
    (freed - target).pow(2).sum().backward();
    if (step == 0) first_buffer = kept.grad().data_ptr();
    CHECK(kept.grad().data_ptr() == first_buffer);  // accumulated into the zeroed buffer
    keeps.step();
    frees.step();
    keeps.zero_grad(/*set_to_none=*/false);
    frees.zero_grad();
    REQUIRE(kept.grad().defined());
    CHECK(kept.grad().abs().max().item<double>() == 0.0);
    CHECK_FALSE(freed.grad().defined());
  }
  CHECK(torch::equal(kept, freed));
}

TEST_CASE("AdamW with offload steps host copies and gives the weights and state of stepping in place, bit for bit",
          "[optim]") {
  torch::manual_seed(0);
  // Two weights that are views of one buffer, as an FSDP unit's shards are (one version counter).
  auto flat_in_place = torch::randn({6 * 5 + 4});
  auto flat_offloaded = flat_in_place.clone();
  auto views = [](const torch::Tensor& flat) {
    return std::vector<std::pair<std::string, torch::Tensor>>{
        {"a", flat.narrow(0, 0, 30).view({6, 5}).requires_grad_(true)},
        {"b", flat.narrow(0, 30, 4).requires_grad_(true)}};
  };
  auto in_place_params = views(flat_in_place);
  auto offloaded_params = views(flat_offloaded);
  mt::train::AdamW in_place(in_place_params, {.lr = 1e-2});
  mt::train::AdamW offloaded(offloaded_params, {.lr = 1e-2, .offload = true});
  auto a = offloaded_params[0].second;
  for (int step = 0; step < 6; ++step) {
    INFO("step " << step);
    const auto target_a = torch::randn({6, 5}), target_b = torch::randn({4});
    for (auto* params : {&in_place_params, &offloaded_params})
      ((*params)[0].second - target_a).pow(2).sum().add((*params)[1].second.sub(target_b).pow(3).sum()).backward();
    if (step == 2) {
      // Written by someone else between steps (a checkpoint loaded into the weights): the next
      // step starts from these values, not from the host copy.
      torch::NoGradGuard no_grad;
      const auto loaded = torch::randn({6, 5});
      in_place_params[0].second.copy_(loaded);
      a.copy_(loaded);
    }
    if (step == 4) {
      offloaded.step({a});  // a subset, as stepping in backward does; b keeps its gradient
      in_place.step({in_place_params[0].second});
      CHECK(offloaded_params[1].second.grad().defined());
    }
    in_place.step();
    offloaded.step();
    in_place.zero_grad();
    offloaded.zero_grad();
    CHECK(torch::equal(flat_in_place, flat_offloaded));
  }
  const auto expected = in_place.state(), got = offloaded.state();
  REQUIRE(expected.size() == got.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO(got[i].first);
    CHECK(expected[i].first == got[i].first);
    CHECK(torch::equal(expected[i].second, got[i].second));
  }
}

TEST_CASE(
    "the memory estimate's activations and loss are what autograd holds, with and without checkpointing, "
    "a chunked loss and the fused kernels",
    "[memory]") {
  auto& counter = mt::train::CpuAllocationCounter::install();
  auto config = mt::llama::presets::llama_tiny;
  config.vocab_size = 1024;
  const std::int64_t batch = 4, seq = 128;
  for (const std::int64_t every : {0, 1, 2}) {
    for (const auto [chunk, fused] : {std::pair<std::int64_t, bool>{0, true}, {100, true}, {0, false}}) {
      INFO("checkpoint every " << every << " layers, loss chunk " << chunk << ", fused kernels " << fused);
      torch::manual_seed(0);
      mt::llama::LlamaForCausalLM model(config, torch::TensorOptions().device(torch::kMeta).dtype(torch::kFloat));
      mt::llama::materialize(model, torch::TensorOptions().dtype(torch::kFloat));
      mt::llama::init_weights(model);
      mt::checkpoint_activations(model, {.every = every});
      model->loss_chunk = chunk;
      model->use_fused_kernels(fused);
      const auto ids = torch::randint(0, config.vocab_size, {batch, seq}, torch::kLong);
      const auto estimate =
          mt::llama::estimate_memory(config, {.data_parallel = mt::llama::DataParallelKind::ddp},
                                     {.batch = batch,
                                      .seq = seq,
                                      .compute_bytes = 4,
                                      .checkpoint_every = every,
                                      .loss_chunk = chunk,
                                      .fused_kernels = fused,
                                      .fused_loss = fused && mt::kernels::fused_cross_entropy_available()});

      const double before = static_cast<double>(counter.current());
      auto loss = model->loss(ids, ids);
      const double held = static_cast<double>(counter.current()) - before;
      // The timeline after the loss's forward, less what the step started with (the weights).
      const double expected = estimate.after_forward - estimate.start;
      INFO("held after forward " << held << " bytes, estimated " << expected);
      CHECK(std::abs(held - expected) <= 0.1 * expected);

      counter.reset_peak();
      loss.backward();
      const double peak = static_cast<double>(counter.peak()) - before;
      const double expected_peak = estimate.step_peak();
      INFO("peak in backward " << peak << " bytes, estimated " << expected_peak);
      CHECK(std::abs(peak - expected_peak) <= 0.1 * expected_peak);
    }
  }
}

// FSDP as parallelize applies it (the last layer kept gathered from forward to backward), on a
// group of one rank: its gathers and reduce-scatters are copies, and a reduce-scatter's send
// buffer lives until it is waited for, a unit later, as on a GPU (on the CPU with more ranks Gloo's
// callback frees it as soon as the sums arrive). What the step holds after forward and at its
// peak, against the memory timeline: the all-gather buffers beside the full weights, the
// prefetched layer, and a reduce-scatter's send buffer in flight while the next unit gathers.
TEST_CASE("the memory timeline's FSDP events are what one rank holds, with bf16 compute and checkpointing",
          "[memory]") {
  auto& counter = mt::train::CpuAllocationCounter::install();
  // oneDNN's bf16 kernels allocate with raw_allocate, which the counter does not serve: the
  // native ones allocate as everything else does.
  const bool mkldnn = at::globalContext().userEnabledMkldnn();
  at::globalContext().setUserEnabledMkldnn(false);
  struct Restore {
    bool mkldnn;
    ~Restore() { at::globalContext().setUserEnabledMkldnn(mkldnn); }
  } restore{mkldnn};
  // llama-tiny at 512 tokens, where activations make most of the peak, and with 8 layers at 16
  // tokens, where the peak is a layer of backward gathered (as at 405B): the gathered root, the
  // layer's full weights and their all-gather buffer, the next layer's prefetched all-gather, the
  // previous layer's send buffer in flight, and the gradients landed so far.
  struct Shape {
    std::int64_t vocab, layers, batch, seq;
  };
  for (const auto shape : {Shape{1024, 4, 4, 128}, Shape{264, 8, 1, 16}}) {
    for (const auto compute : {torch::kFloat, torch::kBFloat16}) {
      for (const std::int64_t every : {0, 1}) {
        // The whole loss, and chunks of a fifth of the positions.
        for (const std::int64_t chunk : {std::int64_t{0}, shape.batch * shape.seq / 5}) {
          auto config = mt::llama::presets::llama_tiny;
          config.vocab_size = shape.vocab;
          config.num_hidden_layers = shape.layers;
          const std::int64_t batch = shape.batch, seq = shape.seq;
          INFO(shape.layers << " layers, vocab " << shape.vocab << ", batch " << batch << " x " << seq << ", compute "
                            << c10::toString(compute) << ", checkpoint every " << every << " layers, loss chunk "
                            << chunk);
          torch::manual_seed(0);
          mt::llama::LlamaForCausalLM model(config, torch::TensorOptions().device(torch::kMeta).dtype(torch::kFloat));
          mt::checkpoint_activations(model, {.every = every});
          model->loss_chunk = chunk;
          mt::FullyShardedDataParallel fsdp(
              model, mt::comm::single_process_group(),
              {.mixed_precision = {.param_dtype = compute, .reduce_dtype = torch::kFloat}},
              mt::llama_fsdp_adapter(config));
          auto& layers = model->model->decoder_layers;
          for (std::size_t i = 0; i < layers.size(); ++i)
            fsdp.fully_shard(layers[i], i + 1 < layers.size() ? std::nullopt : std::optional<bool>(false));
          fsdp.fully_shard(model);
          fsdp.init_weights();
          const auto ids = torch::randint(0, config.vocab_size, {batch, seq}, torch::kLong);
          const auto estimate = mt::llama::estimate_memory(
              config, {.data_parallel = mt::llama::DataParallelKind::fsdp, .data_parallel_ranks = 1},
              {.batch = batch,
               .seq = seq,
               .compute_bytes = compute == torch::kFloat ? 4 : 2,
               .state_bytes = 4,
               .checkpoint_every = every,
               .loss_chunk = chunk,
               .fused_kernels = true,  // the CPU's
               .fused_loss = mt::kernels::fused_cross_entropy_available()});

          const double before = static_cast<double>(counter.current());
          counter.reset_peak();
          auto loss = model->loss(ids, ids);
          const double held = static_cast<double>(counter.current()) - before;
          const double expected = estimate.after_forward - estimate.start;
          INFO("held after forward " << held << " bytes, estimated " << expected);
          CHECK(std::abs(held - expected) <= 0.1 * expected);
          loss.backward();
          const double peak = static_cast<double>(counter.peak()) - before;
          const double expected_peak = estimate.step_peak();
          INFO("peak over the step " << peak << " bytes, estimated " << expected_peak << " after '"
                                     << estimate.at_peak.what << "' (layer " << estimate.at_peak.layer << ")");
          CHECK(std::abs(peak - expected_peak) <= 0.1 * expected_peak);
        }
      }
    }
  }
}

TEST_CASE("the cosine schedule follows CosineAnnealingLR(T_max=1000, eta_min=lr/100)", "[optim]") {
  const mt::train::CosineSchedule schedule(1e-3);
  CHECK(schedule.lr_at(0) == Approx(1e-3));
  CHECK(schedule.lr_at(500) == Approx((1e-3 + 1e-5) / 2));
  CHECK(schedule.lr_at(1000) == Approx(1e-5));
  CHECK(schedule.lr_at(250) == Approx(1e-5 + (1e-3 - 1e-5) * (1 + std::cos(std::numbers::pi / 4)) / 2));
}

TEST_CASE("the warmup schedules follow DeepSpeed's WarmupCosineLR and WarmupDecayLR", "[optim]") {
  // Expected values from DeepSpeed's formulas at last_batch_iteration = step (lr 1e-3, 100
  // total steps, 10 of warmup).
  using mt::train::WarmupType;
  const mt::train::LrSchedule cosine(mt::train::WarmupCosineSchedule{
      .base_lr = 1e-3, .total_steps = 100, .warmup_steps = 10, .warmup_type = WarmupType::linear});
  CHECK(cosine.lr_at(0) == 0.0);
  CHECK(cosine.lr_at(5) == Approx(5e-4));
  CHECK(cosine.lr_at(9) == Approx(9e-4));
  CHECK(cosine.lr_at(10) == Approx(0.000999695443968197));
  CHECK(cosine.lr_at(50) == Approx(0.0005696295918249848));
  CHECK(cosine.lr_at(99) == Approx(1e-7));
  CHECK(cosine.lr_at(150) == Approx(1e-7));  // held at the end (DeepSpeed's cosine would rise again)
  const mt::train::LrSchedule log_cosine(mt::train::WarmupCosineSchedule{
      .base_lr = 1e-3, .total_steps = 100, .warmup_steps = 10, .warmup_min_ratio = 0.1});
  CHECK(log_cosine.lr_at(0) == Approx(1e-4));
  CHECK(log_cosine.lr_at(5) == Approx(0.0008003361253452792));
  const mt::train::LrSchedule decay(
      mt::train::WarmupDecaySchedule{.base_lr = 1e-3, .total_steps = 100, .warmup_steps = 10});
  CHECK(decay.lr_at(0) == 0.0);
  CHECK(decay.lr_at(4) == Approx(0.0006989700043360188));
  CHECK(decay.lr_at(10) == Approx(1e-3));
  CHECK(decay.lr_at(55) == Approx(5e-4));
  CHECK(decay.lr_at(120) == 0.0);
  const mt::train::LrSchedule linear_decay(mt::train::WarmupDecaySchedule{.base_lr = 1e-3,
                                                                          .total_steps = 100,
                                                                          .warmup_steps = 10,
                                                                          .warmup_min_lr = 1e-5,
                                                                          .warmup_type = WarmupType::linear});
  CHECK(linear_decay.lr_at(4) == Approx(0.000406));
  CHECK(linear_decay.lr_at(100) == Approx(1e-5));

  // Settings that would give NaN or infinite rates are refused, naming where they came from.
  CHECK_THROWS_WITH(
      mt::train::LrSchedule(mt::train::WarmupCosineSchedule{.base_lr = 1e-3, .total_steps = 10, .warmup_steps = 10},
                            "--lr-schedule warmup-cosine"),
      Catch::Contains("--lr-schedule warmup-cosine: 10 total steps leave nothing after 10 warmup steps"));
  CHECK_THROWS_WITH(
      mt::train::LrSchedule(mt::train::WarmupDecaySchedule{.base_lr = 1e-3, .total_steps = 10, .warmup_steps = 1}),
      Catch::Contains("a log warmup needs at least 2 warmup steps"));
  mt::train::TrainArgs args;
  args.warmup_steps = 5;
  CHECK_THROWS_WITH(mt::train::lr_schedule(args, 100), Catch::Contains("--lr-schedule cosine has no warmup"));
  args.lr_schedule = "warmup-decay";
  args.max_steps = 40;
  CHECK(mt::train::lr_schedule(args, 100).lr_at(39) == Approx(args.lr * 1.0 / 35));  // decays until --max-steps
}

TEST_CASE("gradient clipping equals LibTorch's clip_grad_norm_, and counts each piece once", "[optim]") {
  auto make = [](int seed) {
    torch::manual_seed(seed);
    std::vector<torch::Tensor> parameters{torch::randn({4, 3}, torch::requires_grad()),
                                          torch::randn({7}, torch::requires_grad())};
    parameters[0].mutable_grad() = torch::randn({4, 3}) * 3;
    parameters[1].mutable_grad() = torch::randn({7}) * 3;
    return parameters;
  };
  auto ours = make(5);
  std::vector<torch::Tensor> reference;
  for (const auto& p : ours) {
    reference.push_back(p.detach().clone().requires_grad_());
    reference.back().mutable_grad() = p.grad().clone();
  }
  const double expected = torch::nn::utils::clip_grad_norm_(reference, 1.0);
  REQUIRE(expected > 1.0);  // it clips
  CHECK(mt::train::clip_grad_norm(ours, 1.0) == Approx(expected).epsilon(1e-6));
  for (std::size_t i = 0; i < ours.size(); ++i) CHECK(torch::allclose(ours[i].grad(), reference[i].grad(), 1e-6, 1e-7));

  // A replica that another rank counts adds nothing to the norm but is scaled like the rest.
  auto pieces = make(6);
  const double counted_once = mt::train::clip_grad_norm({{pieces[0], true}, {pieces[1], true}}, 1e9);
  pieces = make(6);
  const auto copy = pieces[1].grad().clone();
  const double norm = mt::train::clip_grad_norm({{pieces[0], true}, {pieces[1], false}}, 0.5);
  CHECK(norm == Approx(pieces[0].grad().norm().item<double>() / (0.5 / (norm + 1e-6))).epsilon(1e-5));
  CHECK(norm < counted_once);
  CHECK(torch::allclose(pieces[1].grad(), copy * (0.5 / (norm + 1e-6)), 1e-5, 1e-7));
  CHECK_THROWS_WITH(mt::train::clip_grad_norm(pieces, 0.0), Catch::Contains("max_norm 0 must be positive"));
}

TEST_CASE("activation checkpointing recomputes layers with the same gradients and random numbers", "[optim]") {
  auto config = mt::llama::presets::llama_tiny;
  config.num_hidden_layers = 3;
  auto gradients = [&](std::int64_t every) {
    torch::manual_seed(3);
    mt::llama::LlamaForCausalLM model(config);
    mt::llama::init_weights(model);
    const auto checkpointed = mt::checkpoint_activations(model, {.every = every});
    CHECK(checkpointed == (every == 0 ? 0 : (3 + every - 1) / every));
    const auto ids = torch::randint(0, config.vocab_size, {2, 16}, torch::kLong);
    auto loss = model->loss(ids, ids);
    loss.backward();
    std::vector<torch::Tensor> grads{loss.detach()};
    for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
    return grads;
  };
  const auto plain = gradients(0);
  for (std::int64_t every : {1, 2}) {
    const auto recomputed = gradients(every);
    REQUIRE(recomputed.size() == plain.size());
    for (std::size_t i = 0; i < plain.size(); ++i) CHECK(torch::allclose(plain[i], recomputed[i], 1e-5, 1e-7));
  }

  // A body that draws random numbers draws the same ones again in backward, and the generator
  // goes on afterwards as if nothing had been recomputed.
  auto x = torch::randn({5}, torch::requires_grad());
  torch::manual_seed(9);
  auto y = mt::checkpointed(x, [](const torch::Tensor& in) { return in * torch::rand_like(in); });
  const auto after_forward = torch::rand({1});
  torch::manual_seed(9);
  const auto drawn = torch::rand({5});
  torch::manual_seed(9);
  torch::rand({5});
  const auto expected_next = torch::rand({1});
  CHECK(torch::equal(after_forward, expected_next));
  torch::manual_seed(42);
  y.sum().backward();
  CHECK(torch::allclose(x.grad(), drawn));
  const auto next = torch::rand({1});  // as if the recomputation had drawn nothing
  torch::manual_seed(42);
  CHECK(torch::equal(next, torch::rand({1})));
  CHECK_THROWS_WITH(mt::parse_activation_checkpointing("0"), Catch::Contains("use none, full"));
  CHECK(mt::parse_activation_checkpointing("3").every == 3);
}

TEST_CASE("a checkpoint restores weights, optimizer state, RNG and train state", "[checkpoint]") {
  const auto dir = fresh_dir("ckpt");
  torch::manual_seed(11);
  auto [model, optimizer] = OneLayerTraining();
  const auto ids = torch::randint(0, 256, {2, 8}, torch::kLong);
  model->loss(ids, ids).backward();
  optimizer.step();
  const mt::train::TrainState state{
      .epoch = 1, .global_step = 20, .epoch_step = 3, .running_loss = 2.5, .running_steps = 1};
  const mt::train::RunIdentity identity{
      .seed = 4, .seq_length = 8, .global_batch = 2, .dataset = "builtin", .model = "m"};
  PlainCheckpointing::save(dir, model, optimizer, state, identity, 2);
  const auto rng_after_save = torch::rand({3});

  torch::manual_seed(99);
  auto [restored, restored_optimizer] = OneLayerTraining();
  const auto loaded = PlainCheckpointing::load(dir, restored, restored_optimizer, identity);
  REQUIRE(loaded);
  CHECK(loaded->global_step == 20);
  CHECK(loaded->epoch == 1);
  CHECK(loaded->epoch_step == 3);
  CHECK(loaded->running_loss == 2.5);
  CHECK(torch::equal(torch::rand({3}), rng_after_save));
  const auto a = model->named_parameters(), b = restored->named_parameters();
  for (const auto& item : a) CHECK(torch::equal(item.value(), b[item.key()]));
  const auto sa = optimizer.state(), sb = restored_optimizer.state();
  for (std::size_t i = 0; i < sa.size(); ++i) CHECK(torch::equal(sa[i].second, sb[i].second));

  // Later saves move the link; the newest two complete checkpoints stay (--keep-checkpoints 2).
  PlainCheckpointing::save(dir, model, optimizer, {.global_step = 40}, identity, 2);
  CHECK(fs::read_symlink(dir / "checkpoint") == "ckpt-00000040");
  CHECK(fs::exists(dir / "ckpt-00000020"));
  PlainCheckpointing::save(dir, model, optimizer, {.global_step = 60}, identity, 2);
  CHECK(fs::read_symlink(dir / "checkpoint") == "ckpt-00000060");
  CHECK_FALSE(fs::exists(dir / "ckpt-00000020"));
  CHECK(fs::exists(dir / "ckpt-00000040"));
  PlainCheckpointing::save(dir, model, optimizer, {.global_step = 80}, identity, 1);
  CHECK_FALSE(fs::exists(dir / "ckpt-00000040"));
  CHECK_FALSE(fs::exists(dir / "ckpt-00000060"));

  auto other = identity;
  other.seed = 5;
  CHECK_THAT(error_of([&] { PlainCheckpointing::load(dir, restored, restored_optimizer, other); }),
             Catch::Contains("seed = 4") && Catch::Contains("this run has 5"));
  fs::remove_all(dir);
}

TEST_CASE("a save that dies half-way leaves the previous checkpoint loadable", "[checkpoint]") {
  const auto dir = fresh_dir("ckpt-crash");
  auto [model, optimizer] = OneLayerTraining();
  const mt::train::RunIdentity identity{.seed = 0, .seq_length = 8, .global_batch = 2, .dataset = "d", .model = "m"};
  PlainCheckpointing::save(dir, model, optimizer, {.global_step = 10}, identity, 2);

  // A crash after the new folder's files were partly written: the folder stays ".partial"
  // and the link still names step 10.
  fs::create_directories(dir / "ckpt-00000020.partial");
  std::ofstream(dir / "ckpt-00000020.partial" / "rank0.safetensors") << "truncat";
  // A crash while a file was being written leaves only its temporary name.
  std::ofstream(dir / "ckpt-00000010" / "state.json.tmp.12345") << "{";

  auto [restored, restored_optimizer] = OneLayerTraining();
  const auto loaded = PlainCheckpointing::load(dir, restored, restored_optimizer, identity);
  REQUIRE(loaded);
  CHECK(loaded->global_step == 10);
  fs::remove_all(dir);
}

TEST_CASE("a checkpoint that lost a file or its link is an error, never a fresh start", "[checkpoint]") {
  const auto dir = fresh_dir("ckpt-damaged");
  auto [model, optimizer] = OneLayerTraining();
  const mt::train::RunIdentity identity{.seed = 0, .seq_length = 8, .global_batch = 2, .dataset = "d", .model = "m"};
  PlainCheckpointing::save(dir, model, optimizer, {.global_step = 10, .running_loss = 1.0}, identity, 2);

  // Without state.json (the defect: the next run started from step 1 and deleted this folder).
  fs::rename(dir / "ckpt-00000010" / "state.json", dir / "state.json.away");
  CHECK_THAT(error_of([&] { PlainCheckpointing::load(dir, model, optimizer, identity); }),
             Catch::Contains("state.json") && Catch::Contains("ckpt-00000010"));
  fs::rename(dir / "state.json.away", dir / "ckpt-00000010" / "state.json");

  // Copied without the link (rsync without -l): the folder is named, with the command to restore it.
  fs::remove(dir / "checkpoint");
  CHECK_THAT(error_of([&] { PlainCheckpointing::load(dir, model, optimizer, identity); }),
             Catch::Contains("ckpt-00000010") && Catch::Contains("ln -sfn"));
  fs::create_directory_symlink("ckpt-00000010", dir / "checkpoint");
  CHECK(PlainCheckpointing::load(dir, model, optimizer, identity)->global_step == 10);

  // A non-finite running loss is not saved: the step-10 checkpoint stays the latest.
  CHECK_THAT(error_of([&] {
               PlainCheckpointing::save(dir, model, optimizer,
                                        {.global_step = 20, .running_loss = std::nan(""), .running_steps = 1}, identity,
                                        2);
             }),
             Catch::Contains("global_step 20") && Catch::Contains("nan") && Catch::Contains("stays"));
  CHECK(fs::read_symlink(dir / "checkpoint") == "ckpt-00000010");

  // Nor weights a finite loss came with: steps of --lr 1e30 had finite losses and NaN weights,
  // were saved, and deleted the last good checkpoint.
  {
    torch::NoGradGuard no_grad;
    model->parameters()[1].view(-1)[3] = std::numeric_limits<float>::infinity();
  }
  CHECK_THAT(error_of([&] {
               PlainCheckpointing::save(dir, model, optimizer, {.global_step = 30, .running_loss = 1.0}, identity, 2);
             }),
             Catch::Contains("not saving global_step 30: rank 0's piece of '") &&
                 Catch::Contains("holds 1 non-finite value(s)") && Catch::Contains("the previous checkpoint stays"));
  CHECK(fs::read_symlink(dir / "checkpoint") == "ckpt-00000010");
  CHECK_FALSE(fs::exists(dir / "ckpt-00000030"));
  CHECK_FALSE(fs::exists(dir / "ckpt-00000030.partial"));
  fs::remove_all(dir);
}

TEST_CASE("a GPU rank's host threads share the CPUs it may run on among the node's ranks", "[device]") {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  REQUIRE(sched_getaffinity(0, sizeof allowed, &allowed) == 0);
  const int cpus = CPU_COUNT(&allowed);
  CHECK(mt::train::host_threads_per_rank(1) == cpus);
  CHECK(mt::train::host_threads_per_rank(0) == cpus);  // a missing LOCAL_WORLD_SIZE counts as one rank
  CHECK(mt::train::host_threads_per_rank(cpus) == 1);
  CHECK(mt::train::host_threads_per_rank(4 * cpus) == 1);  // never none
  if (cpus >= 2) CHECK(mt::train::host_threads_per_rank(2) == cpus / 2);
}

namespace {

// The records of a TFRecord file, each checked against its two masked CRC-32Cs.
std::vector<std::string> tfrecords(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<std::string> records;
  std::uint64_t length = 0;
  while (in.read(reinterpret_cast<char*>(&length), sizeof length)) {
    std::uint32_t length_crc = 0, data_crc = 0;
    in.read(reinterpret_cast<char*>(&length_crc), sizeof length_crc);
    REQUIRE(length_crc == mt::train::tensorboard_detail::masked_crc32c(&length, sizeof length));
    std::string data(length, '\0');
    in.read(data.data(), static_cast<std::streamsize>(length));
    in.read(reinterpret_cast<char*>(&data_crc), sizeof data_crc);
    REQUIRE(in);
    REQUIRE(data_crc == mt::train::tensorboard_detail::masked_crc32c(data.data(), data.size()));
    records.push_back(std::move(data));
  }
  return records;
}

// tensorflow.Event messages decoded by libprotobuf over the header's schema, as text format.
class EventDecoder {
 public:
  EventDecoder() {
    const auto schema = mt::train::tensorboard_detail::event_schema;
    google::protobuf::io::ArrayInputStream input(schema.data(), static_cast<int>(schema.size()));
    google::protobuf::io::Tokenizer tokenizer(&input, nullptr);
    google::protobuf::FileDescriptorProto file;
    REQUIRE(google::protobuf::compiler::Parser().Parse(&tokenizer, &file));
    file.set_name("event.proto");
    const auto* built = pool_.BuildFile(file);
    REQUIRE(built);
    event_ = factory_.GetPrototype(built->FindMessageTypeByName("Event"));
  }
  std::string decode(const std::string& data) {
    std::unique_ptr<google::protobuf::Message> event(event_->New());
    REQUIRE(event->ParseFromString(data));
    std::string text;
    google::protobuf::TextFormat::PrintToString(*event, &text);
    return text;
  }

 private:
  google::protobuf::DescriptorPool pool_;
  google::protobuf::DynamicMessageFactory factory_{&pool_};
  const google::protobuf::Message* event_ = nullptr;
};

}  // namespace

TEST_CASE("TensorBoard event files: TFRecord framing with masked CRC-32C, Event messages, the run folders",
          "[tensorboard]") {
  // CRC-32C's check value ("123456789" -> 0xE3069283), masked as TFRecord masks it.
  const std::uint32_t check = 0xE3069283u;
  CHECK(mt::train::tensorboard_detail::masked_crc32c("123456789", 9) == ((check >> 15) | (check << 17)) + 0xa282ead8u);

  const auto dir = fresh_dir("tensorboard");
  fs::path file;
  {
    mt::train::TensorBoardTracker tracker(dir / "run", "seed=3\nlr=0.001\n");
    REQUIRE(tracker.path());
    file = *tracker.path();
    tracker.on_start(20);
    nlohmann::ordered_json record{{"global_step", 30}, {"lr", 0.001}, {"running_loss", 2.5}, {"note", "text"}};
    tracker.on_metrics(record);
  }
  CHECK(file.parent_path() == dir / "run");
  CHECK_THAT(file.filename().string(), Catch::StartsWith("events.out.tfevents."));
  const auto records = tfrecords(file);
  REQUIRE(records.size() == 4);  // the file version, the flags, the session start, the scalars
  EventDecoder decoder;
  std::vector<std::string> events;
  for (const auto& data : records) events.push_back(decoder.decode(data));
  CHECK_THAT(events[0], Catch::Contains("file_version: \"brain.Event:2\"") && Catch::Contains("wall_time: "));
  CHECK_THAT(events[1], Catch::Contains("tag: \"flags\"") && Catch::Contains("plugin_name: \"text\"") &&
                            Catch::Contains("dtype: DT_STRING") && Catch::Contains("seed=3\\nlr=0.001"));
  CHECK_THAT(events[2], Catch::Contains("step: 20") && Catch::Contains("status: START"));
  CHECK_THAT(events[3], Catch::Contains("step: 30") && Catch::Contains("tag: \"lr\"") &&
                            Catch::Contains("simple_value: 0.001") && Catch::Contains("tag: \"running_loss\"") &&
                            Catch::Contains("simple_value: 2.5") && !Catch::Contains("note"));

  // The three modes' run folders on rank 3 of 4, two ranks per node.
  using mt::train::TrackingRanks;
  const fs::path exp = "runs/x";
  CHECK_FALSE(mt::train::tensorboard_run_dir(exp, TrackingRanks::rank0, 3, 1, 2));
  CHECK(*mt::train::tensorboard_run_dir(exp, TrackingRanks::rank0, 0, 0, 2) == exp / "tensorboard");
  CHECK_FALSE(mt::train::tensorboard_run_dir(exp, TrackingRanks::node, 3, 1, 2));
  CHECK(*mt::train::tensorboard_run_dir(exp, TrackingRanks::node, 2, 0, 2) == exp / "tensorboard" / "node-1");
  CHECK(*mt::train::tensorboard_run_dir(exp, TrackingRanks::all, 3, 1, 2) == exp / "tensorboard" / "rank-3");
  CHECK_THAT(error_of([] { mt::train::parse_tracking_ranks("some"); }), Catch::Contains("use rank0, node or all"));

  // --tensorboard without -e, and a program that forgets the tracker, are refused by name.
  mt::train::TrainArgs args;
  args.tensorboard = true;
  CHECK_THAT(error_of([&] { mt::train::tensorboard_tracker(args, 0); }), Catch::Contains("give -e"));
  CHECK_THAT(error_of([&] { mt::train::Experiment(args, 0, 8, torch::kCPU); }), Catch::Contains("without a tracker"));
  fs::remove_all(dir);
}

TEST_CASE("the caching host allocator hands a freed large block out again for its size", "[host-allocator]") {
  auto& cache = mt::train::CachingHostAllocator::instance();
  cache.release_cached();
  const std::size_t block = 3 << 20;
  void* where = nullptr;
  {
    auto big = cache.allocate(block);
    where = big.get();
    REQUIRE(where != nullptr);
  }
  CHECK(cache.cached_bytes() == block);
  auto again = cache.allocate(block);
  CHECK(again.get() == where);  // the same block, not a new one
  CHECK(cache.cached_bytes() == 0);
  auto other = cache.allocate(block + 64);
  CHECK(other.get() != where);  // another size is another block
  { auto small = cache.allocate(1000); }
  CHECK(cache.cached_bytes() == 0);  // small blocks are malloc's
  // raw_allocate/raw_deallocate (one deleter for every block, as the Allocator contract asks).
  void* raw = cache.raw_allocate(2 << 20);
  cache.raw_deallocate(raw);
  CHECK(cache.cached_bytes() == (2u << 20));
  // A size the cache cannot serve is a new block; the cached 2 MiB go back first, since holding
  // them too would exceed the most this process has had in tensors (the next test has more).
  {
    const auto before = cache.reserved_bytes();
    auto bigger = cache.allocate(5 << 20);
    CHECK(cache.cached_bytes() == 0);
    CHECK(cache.reserved_bytes() == before - (2u << 20) + (5u << 20));
  }
  CHECK(cache.cached_bytes() == (5u << 20));
  cache.release_cached();
  // Freed blocks beyond the cap go back to the system: 5 x 256 MiB (never touched, so never resident).
  const auto reserved = cache.reserved_bytes();
  {
    std::vector<c10::DataPtr> blocks;
    for (int i = 0; i < 5; ++i) blocks.push_back(cache.allocate(std::size_t{256} << 20));
    CHECK(cache.reserved_bytes() == reserved + 5 * (std::size_t{256} << 20));
  }
  CHECK(cache.cached_bytes() <= mt::train::CachingHostAllocator::max_cached_bytes);
  CHECK(cache.reserved_bytes() < reserved + 5 * (std::size_t{256} << 20));
  cache.release_cached();
  CHECK(cache.cached_bytes() == 0);

  // Installed, it serves LibTorch's CPU tensors.
  mt::train::CachingHostAllocator::install();
  void* tensor_data = nullptr;
  {
    auto t = torch::ones({1 << 20}, torch::kFloat);
    tensor_data = t.data_ptr();
  }
  CHECK(cache.cached_bytes() == (4u << 20));
  auto t = torch::empty({1 << 20}, torch::kFloat);
  CHECK(t.data_ptr() == tensor_data);

  // The environment's choice, and a wrong one named.
  ::setenv("MESHTORCH_HOST_ALLOCATOR", "default", 1);
  CHECK(mt::train::use_host_allocator_from_environment() == "default");
  ::setenv("MESHTORCH_HOST_ALLOCATOR", "jemalloc", 1);
  CHECK_THAT(error_of([] { mt::train::use_host_allocator_from_environment(); }),
             Catch::Contains("MESHTORCH_HOST_ALLOCATOR is 'jemalloc'") && Catch::Contains("'caching'"));
  ::unsetenv("MESHTORCH_HOST_ALLOCATOR");
  CHECK(mt::train::use_host_allocator_from_environment() == "caching");
}

TEST_CASE(
    "the caching host allocator serves a request from part of a cached block, merges freed neighbours, holds no more "
    "than the peak in tensors and a thirty-second, gives back the bytes cached longest, repeats a step from the cache "
    "and gives blocks back to the system",
    "[host-allocator]") {
  constexpr std::size_t mib = std::size_t{1} << 20;
  auto& cache = mt::train::CachingHostAllocator::instance();
  cache.release_cached();
  REQUIRE(cache.reserved_bytes() == 0);  // no large block of this process is in a tensor
  REQUIRE(cache.peak_live_bytes() == 0);
  const auto bound = [&] {
    return cache.peak_live_bytes() + cache.peak_live_bytes() / mt::train::CachingHostAllocator::headroom_divisor;
  };

  // A request is whole pages.
  { auto odd = cache.allocate(mib + 1); }
  CHECK(cache.cached_bytes() == mib + mt::train::CachingHostAllocator::page_bytes());
  cache.release_cached();

  // Split and merged: a cached 8 MiB block serves 3 MiB from its start and then the 5 after; freed,
  // the two are one block again, which serves 8 MiB.
  char* start = nullptr;
  {
    auto whole = cache.allocate(8 * mib);
    start = static_cast<char*>(whole.get());
  }
  CHECK(cache.cached_bytes() == 8 * mib);
  cache.reset_stats();
  {
    auto head = cache.allocate(3 * mib);
    CHECK(head.get() == start);
    CHECK(cache.cached_bytes() == 5 * mib);
    auto tail = cache.allocate(5 * mib);
    CHECK(tail.get() == start + 3 * mib);
    CHECK(cache.cached_bytes() == 0);
    CHECK(cache.reserved_bytes() == 8 * mib);
  }
  CHECK(cache.cached_bytes() == 8 * mib);
  {
    auto again = cache.allocate(8 * mib);
    CHECK(again.get() == start);
  }
  CHECK(cache.stats().served_from_cache == 3);
  CHECK(cache.stats().large_allocations == 3);
  cache.release_cached();

  // The bound, and the bytes cached longest given back first, only as many as it takes. A 32 MiB
  // block sets the peak (the bound: 33 MiB); its first 8, 8 and 4 MiB go to tensors, then the
  // first 8 is freed: cached, 8 MiB at the start (just freed) and the last 12 (freed long ago).
  {
    auto whole = cache.allocate(32 * mib);
    start = static_cast<char*>(whole.get());
  }
  CHECK(bound() == 33 * mib);
  auto first = cache.allocate(8 * mib);
  auto second = cache.allocate(8 * mib);
  auto third = cache.allocate(4 * mib);
  CHECK(first.get() == start);  // each from the start of what is left: the smallest cached block that holds it
  CHECK(second.get() == start + 8 * mib);
  CHECK(third.get() == start + 16 * mib);
  first.clear();
  // 16 MiB fits no cached block: a new one. Held with 12 in tensors and 20 cached, that would be
  // 48; the bound takes 15 back: the old 12 whole, then the last 3 of the recent 8.
  CHECK(cache.cached_bytes() == 20 * mib);
  {
    auto fresh = cache.allocate(16 * mib);
    CHECK(cache.cached_bytes() == 5 * mib);
    CHECK(cache.reserved_bytes() == 33 * mib);
    auto rest = cache.allocate(5 * mib);
    CHECK(rest.get() == start);  // what was kept of the recent block: its start
  }
  second.clear();
  third.clear();
  CHECK(cache.reserved_bytes() <= bound());
  cache.release_cached();

  // A step: forward holds four 8 MiB blocks at once; backward, after them, a 6, a 2 and an 8 MiB
  // block. What the cache holds never exceeds the bound, and from the second step on every block
  // comes from the cache, step after step, whether or not the kernel placed forward's blocks side
  // by side (merged, or not).
  const auto step = [&] {
    {
      std::vector<c10::DataPtr> forward;
      for (int i = 0; i < 4; ++i) forward.push_back(cache.allocate(8 * mib));
    }
    auto a = cache.allocate(6 * mib);
    auto b = cache.allocate(2 * mib);
    auto c = cache.allocate(8 * mib);
    CHECK(cache.reserved_bytes() <= bound());
  };
  step();
  cache.reset_stats();
  for (int i = 0; i < 4; ++i) step();
  CHECK(cache.stats().large_allocations == 4 * 7);
  CHECK(cache.stats().served_from_cache == 4 * 7);
  CHECK(cache.reserved_bytes() == 32 * mib);
  CHECK(cache.peak_live_bytes() == 32 * mib);

  // A block the system cannot give (a petabyte: more than the address space) is an out-of-memory
  // error naming the size; it counts as no block in a tensor, and does not raise the peak (the
  // cache gave its blocks back first, to make room).
  CHECK_THROWS_AS(cache.allocate(std::size_t{1} << 50), c10::OutOfMemoryError);
  CHECK_THAT(error_of([&] { cache.allocate(std::size_t{1} << 50); }),
             Catch::Contains("could not map a block of 1125899906842624 bytes"));
  CHECK(cache.peak_live_bytes() == 32 * mib);
  CHECK(cache.reserved_bytes() == cache.cached_bytes());

  // A block the system refuses while the cache holds blocks within the bound: every cached block
  // is given back and the block mapped again, as CUDA's allocator does when the device is full.
  // In a child process whose address space is capped just above what it holds now.
  cache.release_cached();
  {
    std::vector<c10::DataPtr> four;
    for (int i = 0; i < 4; ++i) four.push_back(cache.allocate(256 * mib));
  }
  REQUIRE(cache.cached_bytes() == 1024 * mib);  // within the bound (1056 MiB) and the cap: nothing given back
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // 1040 MiB fits no cached block (merged, they make 1024 at most): a new one, for which the
    // bound gives back 1008 of the 1024 cached. With the address space capped 24 MiB above what
    // it is now, that is 16 short; after the last 16 go too, it fits.
    const auto kib = mt::train::kib_field_from_proc_status("VmSize");
    const rlim_t limit = static_cast<rlim_t>(kib) * 1024 + 24 * mib;
    const rlimit cap{limit, limit};
    if (::setrlimit(RLIMIT_AS, &cap) != 0) ::_exit(2);
    try {
      auto block = cache.allocate(1040 * mib);
      ::_exit(block.get() != nullptr && cache.cached_bytes() == 0 ? 0 : 3);
    } catch (...) {
      ::_exit(4);
    }
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);  // 4: the retry was not made; 3: the block or the cache was wrong
  cache.release_cached();

  // Blocks given back leave the process's resident memory at once (they are unmapped, not
  // returned to a heap that keeps them).
  cache.release_cached();
  const auto rss_before = mt::train::rss_bytes();
  {
    std::vector<c10::DataPtr> touched;
    for (int i = 0; i < 8; ++i) {
      touched.push_back(cache.allocate(16 * mib));
      std::memset(touched.back().get(), 1, 16 * mib);
    }
  }
  const auto rss_cached = mt::train::rss_bytes();
  CHECK(rss_cached - rss_before >= static_cast<std::int64_t>(120 * mib));  // cached, still resident
  cache.release_cached();
  CHECK(rss_cached - mt::train::rss_bytes() >= static_cast<std::int64_t>(120 * mib));
}

TEST_CASE("the op profile nests intervals per thread: self times, phases, ops outside every phase", "[profile]") {
  using mt::train::ProfiledEvent;
  // Two steps. Thread 1: forward [0, 100) holding a matmul [10, 60) that holds a copy [20, 40),
  // and another matmul [70, 90); backward [100, 200) holding an add [120, 150). Thread 2: a copy
  // [0, 50) in no phase.
  const std::vector<ProfiledEvent> events{
      {"backward", 1, 100'000, 200'000, true}, {"aten::mm", 1, 10'000, 60'000, false},
      {"forward", 1, 0, 100'000, true},        {"aten::copy_", 1, 20'000, 40'000, false},
      {"aten::mm", 1, 70'000, 90'000, false},  {"aten::add", 1, 120'000, 150'000, false},
      {"aten::copy_", 2, 0, 50'000, false}};
  const auto phases = mt::train::op_profile(events, 2);
  REQUIRE(phases.count("forward") == 1);
  const auto& forward = phases.at("forward");
  CHECK(forward.time_us == Approx(50.0));  // 100 us over 2 steps
  CHECK(forward.ops.at("aten::mm").calls == Approx(1.0));
  CHECK(forward.ops.at("aten::mm").total_us == Approx(35.0));  // (50 + 20) / 2
  CHECK(forward.ops.at("aten::mm").self_us == Approx(25.0));   // less the copy's 20 us
  CHECK(forward.ops.at("aten::copy_").self_us == Approx(10.0));
  CHECK(phases.at("backward").ops.at("aten::add").self_us == Approx(15.0));
  CHECK(phases.at("backward").ops.count("aten::mm") == 0);
  const auto& other = phases.at(mt::train::outside_phases);
  CHECK(other.time_us == Approx(25.0));
  CHECK(other.ops.at("aten::copy_").calls == Approx(0.5));
}

TEST_CASE("a phase that several threads run at once counts its wall time once and every thread's ops", "[profile]") {
  using mt::train::ProfiledEvent;
  // One step: forward on thread 1 [0, 100) and on thread 3 [20, 110) (--cpu-batch-split's worker),
  // each with a matmul of 60 us; backward on thread 1 [200, 250) and thread 3 [260, 300).
  const std::vector<ProfiledEvent> events{
      {"forward", 1, 0, 100'000, true},        {"aten::mm", 1, 10'000, 70'000, false},
      {"forward", 3, 20'000, 110'000, true},   {"aten::mm", 3, 30'000, 90'000, false},
      {"backward", 1, 200'000, 250'000, true}, {"backward", 3, 260'000, 300'000, true}};
  const auto phases = mt::train::op_profile(events, 1);
  CHECK(phases.at("forward").time_us == Approx(110.0));  // the union [0, 110), not 100 + 90
  CHECK(phases.at("forward").ops.at("aten::mm").calls == Approx(2.0));
  CHECK(phases.at("forward").ops.at("aten::mm").self_us == Approx(120.0));
  CHECK(phases.at("backward").time_us == Approx(90.0));  // two scopes apart: 50 + 40
}

TEST_CASE("core workers run every part at once, each with the caller's autograd state and its share of the threads",
          "[core-workers]") {
  mt::train::CoreWorkers workers(3, 1);
  REQUIRE(workers.parts() == 3);
  const int threads_before = at::get_num_threads();
  std::vector<std::thread::id> ids(3);
  std::vector<int> threads(3, 0);
  std::vector<int> grad_mode(3, -1);
  std::atomic<int> arrived{0};
  std::vector<int> met(3, 0);
  {
    torch::NoGradGuard no_grad;  // the caller's state, which every part must see
    workers.run(
        [&](int part) {
          ids[part] = std::this_thread::get_id();
          threads[part] = at::get_num_threads();
          grad_mode[part] = torch::GradMode::is_enabled() ? 1 : 0;
          // All three must be running at once to pass this point (one at a time, each gives up after 5 s).
          ++arrived;
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
          while (arrived.load() < 3 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
          met[part] = arrived.load() == 3 ? 1 : 0;
        },
        "forward");
  }
  CHECK(ids[0] == std::this_thread::get_id());
  CHECK(std::set<std::thread::id>(ids.begin(), ids.end()).size() == 3);
  CHECK(threads == std::vector<int>{1, 1, 1});
  CHECK(grad_mode == std::vector<int>{0, 0, 0});
  CHECK(met == std::vector<int>{1, 1, 1});
  CHECK(at::get_num_threads() == threads_before);

  // Each part's backward adds into the shared leaf's .grad: 1 + 2 + 3.
  auto w = torch::ones({4}, torch::requires_grad());
  std::vector<torch::Tensor> losses(3);
  workers.run([&](int part) { losses[part] = (w * static_cast<double>(part + 1)).sum(); }, "forward");
  mt::train::CoreWorkers pairs(3, /*threads_per_part=*/2);
  pairs.run([&](int part) { losses[part].backward(); }, "backward");
  CHECK(torch::equal(w.grad(), torch::full({4}, 6.0)));
  pairs.run([&](int part) { threads[part] = at::get_num_threads(); }, "forward");
  CHECK(threads == std::vector<int>{2, 2, 2});
  CHECK(at::get_num_threads() == threads_before);
}

TEST_CASE("core workers rethrow the lowest failing part's error after every part has returned, and serve on",
          "[core-workers]") {
  mt::train::CoreWorkers workers(3, 1);
  std::atomic<int> returned{0};
  const int threads_before = at::get_num_threads();
  CHECK_THROWS_WITH(workers.run(
                        [&](int part) {
                          ++returned;
                          if (part == 2) throw std::runtime_error("part 2 failed");
                          if (part == 1) {
                            std::this_thread::sleep_for(std::chrono::milliseconds(50));  // finishes last
                            throw std::runtime_error("part 1 failed");
                          }
                        },
                        "forward"),
                    "part 1 failed");
  CHECK(returned.load() == 3);
  CHECK(at::get_num_threads() == threads_before);
  std::vector<int> ran(3, 0);
  workers.run([&](int part) { ran[part] = 1; }, "forward");
  CHECK(ran == std::vector<int>{1, 1, 1});
}

TEST_CASE("the batch split across cores takes two parts by default on a CPU with two threads and one micro-batch",
          "[core-workers]") {
  using mt::train::cpu_batch_split_parts;
  const torch::Device cpu(torch::kCPU), cuda(torch::kCUDA, 0);
  const auto parts = [&](const char* flag, mt::train::BatchSplitRun run) { return cpu_batch_split_parts(flag, run); };
  CHECK(parts("auto", {.intra_op_threads = 2, .rows = 8}) == 2);
  CHECK(parts("auto", {.intra_op_threads = 16, .rows = 8, .deterministic = true}) == 2);
  CHECK(parts("auto", {.intra_op_threads = 1, .rows = 8}) == 1);
  CHECK(parts("auto", {.intra_op_threads = 2, .rows = 1}) == 1);                   // one row: nothing to split
  CHECK(parts("auto", {.intra_op_threads = 2, .rows = 8, .grad_accum = 4}) == 1);  // summed already: order shows
  CHECK(parts("auto", {.device = cuda, .intra_op_threads = 2, .rows = 8}) == 1);
  CHECK(parts("off", {.intra_op_threads = 2, .rows = 8}) == 1);
  CHECK(parts("3", {.rows = 8, .grad_accum = 2}) == 3);
  CHECK(parts("4", {.rows = 4}) == 4);
  CHECK(parts("2", {.intra_op_threads = 2, .rows = 8, .deterministic = true}) == 2);
  CHECK_THROWS_WITH(parts("3", {.intra_op_threads = 4, .rows = 8, .deterministic = true}),
                    Catch::Contains("give at most 2"));
  CHECK_THROWS_WITH(parts("2", {.intra_op_threads = 2, .rows = 8, .grad_accum = 3, .deterministic = true}),
                    Catch::Contains("--grad-accum 3") && Catch::Contains("give off"));
  CHECK_THROWS_WITH(parts("2", {.device = cuda, .intra_op_threads = 2, .rows = 8}), Catch::Contains("on a CPU only"));
  // A count above the rows would start a thread for each part (a million, say) with nothing to run.
  CHECK_THROWS_WITH(parts("5", {.rows = 4}), Catch::Contains("more parts than a micro-batch's 4 rows"));
  CHECK_THROWS_WITH(parts("1000000", {.rows = 8}), Catch::Contains("give at most 8"));
  for (const char* bad : {"0", "-1", "two", "2x", "", "99999999999999999999"})
    CHECK_THROWS_WITH(parts(bad, {.rows = 8}), Catch::Contains("expected auto, off or a count of at least 1"));
}
