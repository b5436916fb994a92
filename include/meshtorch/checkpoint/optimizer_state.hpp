#pragma once
// Optimizer state as checkpoint pieces with the weights' boxes, so that it reshards like them.
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <meshtorch/torch.hpp>

#include <meshtorch/checkpoint/manifest.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/io/sharded_tensor.hpp>

namespace meshtorch::checkpoint {

// AdamW's state for `parameters` as pieces with the same boxes, so optimizer state reshards like
// the weights: "optimizer/<name>.exp_avg" and ".exp_avg_sq" share the parameter's box, and
// ".step" is a replicated scalar written by the rank holding the parameter's first element. The
// tensors alias the optimizer's own, so a load fills the optimizer in place. Any optimizer whose
// state() names AdamW's state so (AdamW, ZeroRedundancyOptimizer for the parameters it owns).
template <class Optimizer>
std::vector<io::ShardedTensor> adamw_state_tensors(const Optimizer& optimizer,
                                                   const std::vector<io::ShardedTensor>& parameters) {
  const auto state = optimizer.state();
  std::map<std::string, torch::Tensor> by_name(state.begin(), state.end());
  auto take = [&](const std::string& name) {
    const auto it = by_name.find(name);
    if (it == by_name.end())
      throw ConfigError(
          fmt::format("adamw_state_tensors: the optimizer has no state '{}' (is it built on the same "
                      "parameter names as the pieces?)",
                      name));
    return it->second;
  };
  std::vector<io::ShardedTensor> out;
  for (const auto& p : parameters) {
    const std::string prefix = fmt::format("{}{}", optimizer_prefix, p.name);
    out.push_back(io::sharded(prefix + ".exp_avg", take(p.name + ".exp_avg"), p.global_shape, p.box, p.writer));
    out.push_back(io::sharded(prefix + ".exp_avg_sq", take(p.name + ".exp_avg_sq"), p.global_shape, p.box, p.writer));
    const bool holds_origin = !p.box.empty() && std::all_of(p.box.offsets.begin(), p.box.offsets.end(),
                                                            [](std::int64_t o) { return o == 0; });
    out.push_back(io::replicated(prefix + ".step", take(p.name + ".step"), p.writer && holds_origin));
  }
  return out;
}

}  // namespace meshtorch::checkpoint
