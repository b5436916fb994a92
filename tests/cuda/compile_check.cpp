// Instantiates meshtorch's CUDA-only code so that it is compiled in CI (see CMakeLists.txt).
#include <meshtorch/meshtorch.hpp>

namespace mt = meshtorch;

// Never called; taking the addresses forces the CUDA branches to be compiled.
[[maybe_unused]] void cuda_code_paths() {
  const torch::Device gpu(torch::kCUDA, 0);
  (void)mt::train::memory_figures(gpu);
  mt::train::reset_peak_memory(gpu);
  mt::train::PhaseTimers timers(gpu);
  { auto scope = timers.time("forward"); }
}
