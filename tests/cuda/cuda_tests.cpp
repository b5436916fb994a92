// The CUDA/NCCL code paths on a GPU (built with -DMESHTORCH_CUDA=ON; scripts/gpu-check runs it):
// NCCL groups bound to the rank's GPU, the device check, metadata over the CPU companion, CUDA RNG
// states in checkpoints, the CUDA memory figures, AdamW offloaded from a GPU, FSDP with CPU
// offload under gradient clipping, and the flight recorder's completion of a stream's wait.
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <meshtorch/comm/init.hpp>
#include <meshtorch/meshtorch.hpp>

namespace mt = meshtorch;
using namespace std::chrono_literals;

namespace {

mt::comm::InitOptions one_rank_cuda() {
  mt::comm::LaunchEnv env;
  env.master_port = 0;  // the store picks a free port; nobody else needs to find it
  mt::comm::InitOptions options;
  options.env = env;
  options.timeout = 60s;
  options.device = mt::comm::Device::cuda;
  return options;
}

}  // namespace

TEST_CASE("a CUDA mesh's groups are NCCL groups bound to the rank's GPU, with a CPU companion", "[cuda]") {
  REQUIRE(torch::cuda::is_available());
  auto mesh = mt::comm::init<mt::Mesh<mt::DP<mt::dynamic>, mt::TP<1>>>(one_rank_cuda());
  const auto& dp = mesh.group<mt::DP>();
  CHECK(dp.cuda_device() == mt::comm::local_cuda_device(0));
  CHECK(dp.backend()->getBoundDeviceId() ==
        torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(dp.cuda_device())));
  CHECK(dp.metadata().device() == mt::comm::Device::cpu);
  CHECK(mt::train::resolve_device("cuda", 0) ==
        torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(dp.cuda_device())));

  const torch::Device gpu(torch::kCUDA, static_cast<c10::DeviceIndex>(dp.cuda_device()));
  const auto reduced = mt::comm::all_reduce(dp, torch::full({4}, 3.0, torch::TensorOptions().device(gpu)));
  CHECK(reduced.device() == gpu);
  CHECK(torch::equal(reduced.cpu(), torch::full({4}, 3.0)));
  CHECK_THROWS_WITH(mt::comm::all_reduce(dp, torch::ones({2})),
                    Catch::Contains("it was handed a tensor on cpu but the group moves cuda:"));
  CHECK(mt::comm::broadcast_value(dp, 41, 0) == 41);
  CHECK(mt::comm::all_gather_object(dp, "gpu") == std::vector<std::string>{"gpu"});
  mt::comm::barrier(mesh.world());
}

TEST_CASE("CUDA RNG states are saved and restored beside the CPU one", "[cuda]") {
  REQUIRE(torch::cuda::is_available());
  const auto file = std::filesystem::temp_directory_path() / "meshtorch-cuda-rng.safetensors";
  const auto states = mt::train::capture_rng_states();
  REQUIRE(states.size() == 1 + torch::cuda::device_count());
  mt::io::save_safetensors(file, states);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA, 0);
  const auto first_gpu = torch::rand({8}, cuda).cpu();
  const auto first_cpu = torch::rand({8});
  mt::train::restore_rng_states(mt::io::load_safetensors(file), file);
  CHECK(torch::equal(torch::rand({8}, cuda).cpu(), first_gpu));
  CHECK(torch::equal(torch::rand({8}), first_cpu));

  // A checkpoint saved without GPUs cannot restore the GPU draws: an error, not the seed's numbers.
  mt::io::save_safetensors(file, {states.front()});
  CHECK_THROWS_WITH(mt::train::restore_rng_states(mt::io::load_safetensors(file), file),
                    Catch::Contains("'rng.cuda.0' is missing"));
  std::filesystem::remove(file);
}

TEST_CASE("CUDA memory figures follow the caching allocator, peaks since the last reset", "[cuda]") {
  REQUIRE(torch::cuda::is_available());
  const torch::Device gpu(torch::kCUDA, 0);
  constexpr double gib = 1024.0 * 1024.0 * 1024.0;
  mt::train::reset_peak_memory(gpu);
  const auto before = mt::train::memory_figures(gpu);
  {
    auto block =
        torch::empty({static_cast<std::int64_t>(gib / 2)}, torch::TensorOptions().device(gpu).dtype(torch::kUInt8));
    const auto during = mt::train::memory_figures(gpu);
    CHECK(during.at("curr_alloc_gb") - before.at("curr_alloc_gb") == Approx(0.5).margin(0.01));
    CHECK(during.at("curr_resv_gb") >= during.at("curr_alloc_gb"));
    CHECK(during.at("total_gb") > 1.0);
  }
  const auto after = mt::train::memory_figures(gpu);
  CHECK(after.at("peak_alloc_gb") >= before.at("curr_alloc_gb") + 0.49);
  mt::train::reset_peak_memory(gpu);
  CHECK(mt::train::memory_figures(gpu).at("peak_alloc_gb") < before.at("curr_alloc_gb") + 0.1);
}

TEST_CASE("AdamW offloaded from a GPU steps pinned host copies and copies them back, as AdamW on the GPU does",
          "[cuda]") {
  REQUIRE(torch::cuda::is_available());
  const auto gpu = torch::TensorOptions().device(torch::kCUDA, 0);
  torch::manual_seed(0);
  auto in_place_weight = torch::randn({64, 33}, gpu).requires_grad_(true);
  auto offloaded_weight = in_place_weight.detach().clone().requires_grad_(true);
  mt::train::AdamW in_place({{"w", in_place_weight}}, {.lr = 1e-2});
  mt::train::AdamW offloaded({{"w", offloaded_weight}}, {.lr = 1e-2, .offload = true});
  for (int step = 0; step < 5; ++step) {
    const auto target = torch::randn({64, 33}, gpu);
    (in_place_weight - target).pow(2).sum().backward();
    (offloaded_weight - target).pow(2).sum().backward();
    in_place.step();
    offloaded.step();
    in_place.zero_grad();
    offloaded.zero_grad();
  }
  CHECK(offloaded_weight.device().is_cuda());
  CHECK(offloaded.state().front().second.device().is_cpu());  // the moments live on the host
  // The CPU's fused kernel and the GPU's round differently: close, not equal.
  INFO("max difference " << (in_place_weight - offloaded_weight).abs().max().item<double>());
  CHECK(torch::allclose(in_place_weight.cpu(), offloaded_weight.cpu(), 1e-6, 1e-6));
}

TEST_CASE("FSDP with CPU offload on a GPU clips by the global norm, whose gradients are on the host", "[cuda]") {
  REQUIRE(torch::cuda::is_available());
  auto mesh = mt::comm::init<mt::Mesh<mt::FSDP<mt::dynamic>>>(one_rank_cuda());
  const torch::Device gpu(torch::kCUDA, static_cast<c10::DeviceIndex>(mesh.group<mt::FSDP>().cuda_device()));
  const auto config = mt::llama::presets::llama_tiny;
  torch::manual_seed(3);
  mt::llama::LlamaForCausalLM reference(config, torch::TensorOptions().device(torch::kMeta));
  mt::llama::materialize(reference, torch::TensorOptions());
  torch::manual_seed(3);
  mt::ParallelizeOptions options{.device = gpu};
  options.fsdp.cpu_offload = true;
  auto parallel =
      mt::parallelize(mt::llama::LlamaForCausalLM(config, torch::TensorOptions().device(torch::kMeta)), mesh, options);
  const auto ids = torch::randint(0, config.vocab_size, {2, 64}, torch::kLong);
  reference->loss(ids, ids).backward();
  const double expected = torch::nn::utils::clip_grad_norm_(reference->parameters(), /*max_norm=*/0.5);
  parallel.loss(ids.to(gpu), ids.to(gpu)).backward();
  const double norm = parallel.clip_grad_norm(0.5);  // the squares on the host, the sum over NCCL
  CHECK(norm == Approx(expected).epsilon(1e-4));
}

TEST_CASE("a collective the stream waits for is completed in the flight recorder once the GPU has run it", "[cuda]") {
  REQUIRE(torch::cuda::is_available());
  auto& recorder = mt::diagnostics::FlightRecorder::instance();
  REQUIRE(recorder.enabled());
  const mt::comm::AxisGroup group("FSDP", {0}, 0, {}, 10s, mt::comm::Device::cuda, {}, 0);
  int backend = 0;
  const auto id = recorder.record(&backend, "FSDP", {0}, "nccl", "all_gather", {}, "Float");
  recorder.waiting(id);
  // Work queued ahead on the stream, then the event behind it.
  const auto gpu = torch::TensorOptions().device(torch::kCUDA, 0);
  auto busy = torch::randn({4096, 4096}, gpu);
  for (int i = 0; i < 8; ++i) busy = busy.mm(busy).div_(busy.norm());
  mt::comm::detail::record_completion(id, group);
  torch::cuda::synchronize();
  CHECK(recorder.poll_device_completions() >= 1);
  bool completed = false;
  for (const auto& entry : recorder.entries())
    if (entry["id"] == id) completed = entry["state"] == "completed";
  CHECK(completed);
}
