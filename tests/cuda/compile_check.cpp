// Instantiates meshtorch's CUDA-only code so that it is compiled in CI (see CMakeLists.txt).
#include <meshtorch/comm/init.hpp>
#include <meshtorch/meshtorch.hpp>

namespace mt = meshtorch;

// Mesh init with NCCL groups (backend.hpp's NCCL branch).
template mt::comm::DeviceMesh<mt::Mesh<mt::DP<mt::dynamic>, mt::TP<2>>> mt::comm::init(mt::comm::InitOptions);

// Never called; referencing them forces the CUDA branches to be compiled.
[[maybe_unused]] void cuda_code_paths() {
  const torch::Device gpu(torch::kCUDA, 0);
  (void)mt::train::memory_figures(gpu);
  mt::train::reset_peak_memory(gpu);
  mt::train::PhaseTimers timers(gpu);
  { auto scope = timers.time("forward"); }
}
