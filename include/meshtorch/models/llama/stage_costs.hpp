#pragma once
// The cost of each pipeline unit of a Llama (the embedding, each decoder layer, the final norm
// with the head), in forward FLOPs per token: what pp::balanced_units splits so that the slowest
// stage is as fast as it can be. Backward costs about twice its forward for every unit, so the
// forward alone ranks splits the same way.
#include <cstdint>
#include <vector>

#include <meshtorch/models/llama/config.hpp>

namespace meshtorch::llama {

// Units in order: embedding, num_hidden_layers decoder layers, norm + head. `seq_length` sizes
// attention's share (the scores and the weighted sum: about 2 * seq_length * q_size per token
// under the causal mask).
inline std::vector<double> stage_unit_costs(const Config& config, std::int64_t seq_length) {
  const auto counts = config.parameter_counts();
  const double hidden = static_cast<double>(config.hidden_size);
  const double vocab = static_cast<double>(config.vocab_size);
  const double q_size = static_cast<double>(config.num_attention_heads * config.resolved_head_dim());
  const double layer = counts ? 2.0 * static_cast<double>(counts->attention + counts->mlp) +
                                    2.0 * static_cast<double>(seq_length) * q_size
                              : 0.0;
  std::vector<double> costs;
  costs.push_back(hidden);  // a row gather: next to nothing, but not free
  for (std::int64_t i = 0; i < config.num_hidden_layers; ++i) costs.push_back(layer);
  // The output projection, then the softmax and its loss over the vocabulary.
  costs.push_back(2.0 * hidden * vocab + 5.0 * vocab);
  return costs;
}

}  // namespace meshtorch::llama
