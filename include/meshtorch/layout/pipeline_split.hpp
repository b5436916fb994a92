#pragma once
// How a model is cut into pipeline stages. The embedding and the head count as units beside the
// decoder layers (torchtitan's input and output weights), so a model of L layers has L + 2 units:
// unit 0 the embedding, units 1..L the layers, unit L + 1 the final norm and the head. Stage s
// holds a contiguous run of units, and every stage holds at least one.
//
// The split either comes as a list (--units-per-stage 2,2,2) or is the contiguous split that
// makes the slowest stage as fast as it can be, given each unit's cost (the caller's cost model:
// for Llama, the forward FLOPs of each unit, llama::stage_unit_costs). Pure arithmetic, so that
// the planner prints the split the run time uses.
#include <algorithm>
#include <cstddef>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include <meshtorch/error.hpp>

namespace meshtorch::pp {

// What one stage holds, in the model's terms.
struct StageLayers {
  bool embedding = false;  // unit 0: the token embedding (the stage's input is token ids)
  int first_layer = 0;     // decoder layers [first_layer, end_layer)
  int end_layer = 0;
  bool head = false;  // unit L + 1: the final norm, the output projection and the loss

  int layers() const { return end_layer - first_layer; }
};

class StageSplit {
 public:
  StageSplit() = default;
  // `units_per_stage` must sum to layers + 2 with every entry at least 1 (checked).
  StageSplit(int layers, std::vector<int> units_per_stage) : layers_(layers), units_(std::move(units_per_stage)) {
    const int total = std::accumulate(units_.begin(), units_.end(), 0);
    if (units_.empty() || total != layers + 2 || std::ranges::any_of(units_, [](int n) { return n < 1; })) {
      std::string list;
      for (int n : units_) list += (list.empty() ? "" : ",") + std::to_string(n);
      throw ConfigError("--units-per-stage " + list + ": each of the " + std::to_string(units_.size()) +
                        " stages needs at least one unit, and the units must add up to the model's " +
                        std::to_string(layers) + " layers plus the embedding and the head (" +
                        std::to_string(layers + 2) + ")");
    }
  }

  int stages() const { return static_cast<int>(units_.size()); }
  int layers() const { return layers_; }
  const std::vector<int>& units_per_stage() const { return units_; }

  StageLayers stage(int s) const {
    const int begin = std::accumulate(units_.begin(), units_.begin() + s, 0);
    const int end = begin + units_.at(static_cast<std::size_t>(s));
    // Units 1..L are layers 0..L-1.
    return {.embedding = begin == 0,
            .first_layer = std::clamp(begin - 1, 0, layers_),
            .end_layer = std::clamp(end - 1, 0, layers_),
            .head = end == layers_ + 2};
  }

  // "embedding+layers 0-1": what stage s holds.
  std::string describe_stage(int s) const {
    const StageLayers st = stage(s);
    std::string part;
    if (st.embedding) part = "embedding";
    if (st.layers() > 0)
      part += (part.empty() ? "" : "+") + std::string(st.layers() == 1 ? "layer " : "layers ") +
              std::to_string(st.first_layer) + (st.layers() == 1 ? "" : "-" + std::to_string(st.end_layer - 1));
    if (st.head) part += (part.empty() ? "" : "+") + std::string("norm+head");
    return part;
  }

  // "embedding+layers 0-1 | layers 2-3 | norm+head": a line for logs.
  std::string describe() const {
    std::string text;
    for (int s = 0; s < stages(); ++s) text += (s ? " | " : "") + describe_stage(s);
    return text;
  }

 private:
  int layers_ = 0;
  std::vector<int> units_;
};

// The contiguous split of `costs` (one per unit, in order) into `stages` runs of at least one unit
// whose largest sum is the smallest possible; among equal splits, the one that puts fewer units on
// earlier stages (under 1F1B the first stages keep the most activations in flight).
// Dynamic programming over (stage, units so far): O(stages x units^2), microseconds for 128 layers.
inline std::vector<int> balanced_units(const std::vector<double>& costs, int stages) {
  const int units = static_cast<int>(costs.size());
  if (stages < 1 || stages > units)
    throw ConfigError("a pipeline of " + std::to_string(stages) + " stages over a model of " +
                      std::to_string(units - 2) + " layers (" + std::to_string(units) +
                      " units with the embedding and the head): every stage needs a unit; lower --pp or "
                      "--stages-per-rank to " +
                      std::to_string(units) + " stages or fewer");
  std::vector<double> prefix(static_cast<std::size_t>(units) + 1, 0.0);
  for (int u = 0; u < units; ++u) prefix[u + 1] = prefix[u] + costs[u];
  const double infinity = std::numeric_limits<double>::infinity();
  // slowest[s][u]: the smallest possible slowest stage when the first s stages hold units [0, u).
  std::vector<std::vector<double>> slowest(stages + 1, std::vector<double>(units + 1, infinity));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(units + 1, 0));
  slowest[0][0] = 0;
  for (int s = 1; s <= stages; ++s)
    for (int u = s; u <= units - (stages - s); ++u)
      for (int k = s - 1; k < u; ++k) {  // stage s holds [k, u): the first k found gives it the most units
        const double value = std::max(slowest[s - 1][k], prefix[u] - prefix[k]);
        if (value < slowest[s][u] * (1 - 1e-12)) {
          slowest[s][u] = value;
          cut[s][u] = k;
        }
      }
  std::vector<int> split(static_cast<std::size_t>(stages));
  for (int s = stages, u = units; s >= 1; --s) {
    split[s - 1] = u - cut[s][u];
    u = cut[s][u];
  }
  return split;
}

}  // namespace meshtorch::pp
