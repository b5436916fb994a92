#pragma once
// Which vector instruction sets the CPU kernels of kernels/ may use here, chosen at run time.
//
// A header cannot choose compiler flags, so a kernel compiles its wide loops for AVX-512 or AVX2
// with FMA through function target attributes (`__attribute__((target("avx512f")))`) and calls
// them only where cpu_isa() says the CPU runs them. LibTorch's own switch, ATEN_CPU_CAPABILITY,
// caps the choice as it caps ATen's kernels. Elsewhere (another architecture, another compiler)
// MESHTORCH_X86_KERNELS is 0 and the kernels keep their portable loops.
#include <algorithm>
#include <cstdint>
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

#if MESHTORCH_X86_KERNELS
// The mask of the first `count` of 16 lanes (all 16 for count >= 16, none for 0): a loop's last,
// partial vector.
__attribute__((target("avx512f"), always_inline)) inline __mmask16 first_lanes(std::int64_t count) {
  return static_cast<__mmask16>(count >= 16 ? 0xFFFF : (1u << count) - 1u);
}
#endif

// Around loops that call _mm512_reduce_*_ps: GCC 12 expands them from _mm512_undefined_ps, which
// -Wall reports as maybe-uninitialized (GCC bug 105593) in every program that includes the kernel.
#if defined(__GNUC__) && !defined(__clang__)
#define MESHTORCH_REDUCE_WARNINGS_OFF                                                        \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"") \
      _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")
#define MESHTORCH_REDUCE_WARNINGS_ON _Pragma("GCC diagnostic pop")
#else
#define MESHTORCH_REDUCE_WARNINGS_OFF
#define MESHTORCH_REDUCE_WARNINGS_ON
#endif

}  // namespace meshtorch::kernels
