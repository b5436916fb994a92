#pragma once
// Which vector instruction sets the CPU kernels of kernels/ may use here, chosen at run time.
//
// A header cannot choose compiler flags, so a kernel compiles its wide loops for AVX-512 or AVX2
// with FMA through function target attributes (`__attribute__((target("avx512f")))`) and calls
// them only where cpu_isa() says the CPU runs them. LibTorch's own switch, ATEN_CPU_CAPABILITY,
// caps the choice as it caps ATen's kernels. Elsewhere (another architecture, another compiler)
// MESHTORCH_X86_KERNELS is 0 and the kernels keep their portable loops.
#include <algorithm>
#include <cstdlib>
#include <string_view>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MESHTORCH_X86_KERNELS 1
#include <immintrin.h>
#else
#define MESHTORCH_X86_KERNELS 0
#endif

namespace meshtorch::kernels {

// In order: each runs the loops of those before it.
enum class Isa { none, avx2_fma, avx512 };

namespace isa_detail {
inline Isa detect() {
#if MESHTORCH_X86_KERNELS
  __builtin_cpu_init();
  auto best = __builtin_cpu_supports("avx512f")                                 ? Isa::avx512
              : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? Isa::avx2_fma
                                                                                : Isa::none;
  if (const char* allowed = std::getenv("ATEN_CPU_CAPABILITY")) {
    const std::string_view capability(allowed);
    if (capability == "default") best = Isa::none;
    if (capability == "avx2") best = std::min(best, Isa::avx2_fma);
  }
  return best;
#else
  return Isa::none;
#endif
}
}  // namespace isa_detail

// The best instruction set of the kernels' loops this CPU runs, read once.
inline Isa cpu_isa() {
  static const Isa isa = isa_detail::detect();
  return isa;
}

}  // namespace meshtorch::kernels
