// DistributedDataParallel and ZeroRedundancyOptimizer. Tests tagged [single] run in one process;
// the others are rank bodies run on 2 ranks by launch.py (see CMakeLists.txt): every rank runs
// the same test case and must pass.
#include <chrono>
#include <mutex>

#include <catch2/catch.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/nn/modules/linear.h>  // the tests' small models

#include <meshtorch/comm/comm.hpp>
#include <meshtorch/comm/init.hpp>
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/parallel.hpp>

namespace mt = meshtorch;
using Dp = mt::Mesh<mt::DP<mt::dynamic>>;
using Clock = std::chrono::steady_clock;

namespace {

mt::llama::LlamaForCausalLM tiny_llama(mt::llama::Config config = mt::llama::presets::llama_tiny) {
  mt::llama::LlamaForCausalLM model(config, torch::TensorOptions().device(torch::kMeta).dtype(torch::kFloat));
  mt::llama::materialize(model, torch::TensorOptions().dtype(torch::kFloat));
  return model;
}

// Records when each bucket's all-reduce is launched, then all-reduces it as DDP's default does
// (divide by the world size, sum).
class RecordingHook : public c10d::CommHookInterface {
 public:
  struct Log {
    std::mutex mutex;
    std::vector<std::pair<std::size_t, Clock::time_point>> launches;
  };
  RecordingHook(c10::intrusive_ptr<c10d::ProcessGroup> group, std::shared_ptr<Log> log)
      : group_(std::move(group)), log_(std::move(log)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    {
      std::lock_guard lock(log_->mutex);
      log_->launches.emplace_back(bucket.getIndex(), Clock::now());
    }
    std::vector<at::Tensor> tensors{bucket.getBufferRef()};
    tensors[0].div_(group_->getSize());
    return group_->allreduce(tensors)->getFuture();
  }
  at::Tensor parseHookResult(const c10::IValue& result) override {
    return c10d::detail::parseCppCommHookResult(result);
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::shared_ptr<Log> log_;
};

torch::Tensor gathered(const mt::comm::AxisGroup& group, const torch::Tensor& t) {
  return mt::comm::all_gather(group, t.detach().reshape({1, -1}).contiguous(), 0);
}

}  // namespace

TEST_CASE("ddp launches the first bucket's all-reduce before backward produces the last gradient", "[.][overlap]") {
  auto mesh = mt::comm::init<Dp>();
  torch::manual_seed(0);
  auto model = tiny_llama();
  // Small buckets, so the tiny model has several.
  mt::DistributedDataParallel ddp(model, mesh.group<mt::DP>(), {.bucket_cap_mb = 0.25, .first_bucket_cap_mb = 0.05});
  auto log = std::make_shared<RecordingHook::Log>();
  ddp.register_comm_hook(std::make_unique<RecordingHook>(ddp.process_group(), log));
  // The embedding is used first in forward, so its gradient is the last one backward produces.
  Clock::time_point last_gradient;
  model->named_parameters()["model.embed_tokens.weight"].register_hook([&](const torch::Tensor& grad) {
    last_gradient = Clock::now();
    return grad;
  });

  for (int step = 0; step < 3; ++step) {
    log->launches.clear();
    const auto ids = torch::randint(0, mt::llama::presets::llama_tiny.vocab_size, {2, 64}, torch::kLong);
    auto loss = ddp([&] { return model->loss(ids, ids); });
    loss.backward();
    const auto backward_done = Clock::now();
    const auto buckets = ddp.buckets().size();
    REQUIRE(buckets >= 3);
    REQUIRE(log->launches.size() == buckets);
    std::size_t before_last_gradient = 0;
    for (const auto& [index, when] : log->launches) before_last_gradient += when < last_gradient;
    const auto first_launch = log->launches.front().second;
    const double lead_us = std::chrono::duration<double, std::micro>(backward_done - first_launch).count();
    INFO("step " << step << ": " << buckets << " buckets, " << before_last_gradient
                 << " launched before the last gradient; first launch " << lead_us << " us before backward returned");
    CHECK(log->launches.front().first == 0);
    CHECK(first_launch < last_gradient);
    CHECK(before_last_gradient >= buckets - 1);
    for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
  }
}

TEST_CASE("ddp refuses ranks that hold different parameters, naming the first one", "[.][mismatch]") {
  auto mesh = mt::comm::init<Dp>();
  auto config = mt::llama::presets::llama_tiny;
  if (mesh.rank() == 1) config.intermediate_size = 256;
  auto model = tiny_llama(config);
  const auto start = Clock::now();
  try {
    mt::DistributedDataParallel ddp(model, mesh.group<mt::DP>());
    FAIL("no error");
  } catch (const mt::ConfigError& e) {
    const std::string message = e.what();
    INFO(message);
    CHECK_THAT(message, Catch::Contains("do not hold the same parameters"));
    CHECK_THAT(message, Catch::Contains("'model.layers.0.mlp.gate_proj.weight' [" +
                                        std::to_string(config.intermediate_size) + ", 128]"));
  }
  CHECK(Clock::now() - start < std::chrono::seconds(10));
}

TEST_CASE("ddp broadcasts rank 0's parameters at wrap and keeps replicas equal", "[.][broadcast]") {
  auto mesh = mt::comm::init<Dp>();
  const auto& dp = mesh.group<mt::DP>();
  torch::manual_seed(100 + mesh.rank());  // each rank initialises differently
  auto model = tiny_llama();
  const auto before =
      gathered(dp, model->named_parameters()["model.norm.weight"] + model->named_parameters()["lm_head.weight"].sum());
  mt::DistributedDataParallel ddp(model, dp);
  for (const auto& item : model->named_parameters()) {
    const auto all = gathered(dp, item.value());
    INFO(item.key());
    CHECK(torch::equal(all[0], all[1]));
  }
  CHECK(before.numel() > 0);
}

TEST_CASE("no_sync accumulates locally and the next synchronised backward averages the sum", "[.][no_sync]") {
  auto mesh = mt::comm::init<Dp>();
  const auto& dp = mesh.group<mt::DP>();
  torch::manual_seed(0);
  auto net = torch::nn::Linear(torch::nn::LinearOptions(4, 3));
  auto reference = torch::nn::Linear(torch::nn::LinearOptions(4, 3));
  {
    torch::NoGradGuard no_grad;
    reference->weight.copy_(net->weight);
    reference->bias.copy_(net->bias);
  }
  mt::DistributedDataParallel ddp(net, dp);
  auto input = [](int rank, int micro) { return torch::arange(8, torch::kFloat).view({2, 4}) * (rank + 1) + micro; };
  {
    auto guard = ddp.no_sync();
    CHECK_FALSE(ddp.require_sync());
    ddp([&] { return net->forward(input(dp.rank(), 0)).pow(2).sum(); }).backward();
  }
  CHECK(ddp.require_sync());
  // Not reduced yet: exactly this rank's gradient.
  auto local = reference->forward(input(dp.rank(), 0)).pow(2).sum();
  auto local_grad = torch::autograd::grad({local}, {reference->weight})[0];
  CHECK(torch::allclose(net->weight.grad(), local_grad));

  ddp([&] { return net->forward(input(dp.rank(), 1)).pow(2).sum(); }).backward();
  // Expected: the mean over ranks of both micro-batches' gradients.
  torch::Tensor expected = torch::zeros_like(reference->weight);
  for (int r = 0; r < dp.size(); ++r)
    for (int m = 0; m < 2; ++m)
      expected += torch::autograd::grad({reference->forward(input(r, m)).pow(2).sum()}, {reference->weight})[0];
  expected /= dp.size();
  INFO("got " << net->weight.grad() << "\nexpected " << expected);
  CHECK(torch::allclose(net->weight.grad(), expected, 1e-5, 1e-5));
  const auto all = gathered(dp, net->weight.grad());
  CHECK(torch::equal(all[0], all[1]));
}

TEST_CASE("ZeRO partitions parameters greedily by size, as PyTorch does", "[single]") {
  std::vector<torch::Tensor> params{torch::zeros({10}), torch::zeros({50}), torch::zeros({30}), torch::zeros({20}),
                                    torch::zeros({5})};
  // Sorted: 50 -> r0, 30 -> r1, 20 -> r1 (30 < 50), 10 -> r0 (50 = 50: the first), 5 -> r1 (60 > 55 ... )
  const auto owners = mt::partition_parameters_greedy(params, 2);
  CHECK(owners == std::vector<int>{0, 0, 1, 1, 1});
  const auto single = mt::partition_parameters_greedy(params, 1);
  CHECK(single == std::vector<int>(5, 0));
}

TEST_CASE("learning-rate scaling rules", "[single]") {
  CHECK(mt::scaled_lr(1e-3, mt::LrScaling::none, 16) == Approx(1e-3));
  CHECK(mt::scaled_lr(1e-3, mt::LrScaling::linear, 16) == Approx(16e-3));
  CHECK(mt::scaled_lr(1e-3, mt::LrScaling::sqrt, 16) == Approx(4e-3));
  CHECK_THROWS_WITH(mt::parse_lr_scaling("cubic"), Catch::Contains("none, linear or sqrt"));
}
