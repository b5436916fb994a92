#pragma once
// Rank-aware helpers of the guide's chapter 2: rank 0 first around downloads and preprocessing,
// the effective batch and the learning-rate scaling rules.
#include <cmath>
#include <cstdint>
#include <exception>
#include <string>
#include <type_traits>
#include <utility>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch {

// Rank 0 of the group runs `work` while the others wait at a barrier; then the others run it
// (typically finding rank 0's cached result on shared storage). If rank 0 fails, the others
// still pass the barrier and most likely fail the same way, with the same message, not a hang.
template <class Work>
decltype(auto) rank_zero_first(const comm::AxisGroup& group, Work&& work) {
  if (group.rank() != 0) {
    comm::barrier(group);
    return std::forward<Work>(work)();
  }
  try {
    if constexpr (std::is_void_v<std::invoke_result_t<Work>>) {
      std::forward<Work>(work)();
      comm::barrier(group);
      return;
    } else {
      decltype(auto) result = std::forward<Work>(work)();
      comm::barrier(group);
      return result;
    }
  } catch (const CommError&) {
    throw;
  } catch (...) {
    comm::barrier(group);
    throw;
  }
}

// How the learning rate follows the effective batch: `--lr` is tuned for one rank's batch, and
// the global batch is `factor` times larger (dp_size x grad_accum). Linear (Goyal et al.) suits
// SGD-like training and moderate factors; square root (Krizhevsky; Malladi et al. for Adam)
// is the safer rule for Adam at large factors; none keeps --lr as given.
enum class LrScaling { none, linear, sqrt };

MESHTORCH_DECL LrScaling parse_lr_scaling(const std::string& name);

inline double scaled_lr(double lr, LrScaling rule, std::int64_t factor) {
  switch (rule) {
    case LrScaling::linear:
      return lr * static_cast<double>(factor);
    case LrScaling::sqrt:
      return lr * std::sqrt(static_cast<double>(factor));
    case LrScaling::none:
      break;
  }
  return lr;
}

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <fmt/format.h>

namespace meshtorch {

MESHTORCH_DECL LrScaling parse_lr_scaling(const std::string& name) {
  if (name == "none") return LrScaling::none;
  if (name == "linear") return LrScaling::linear;
  if (name == "sqrt") return LrScaling::sqrt;
  throw ConfigError(fmt::format("--lr-scaling '{}': use none, linear or sqrt", name));
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
