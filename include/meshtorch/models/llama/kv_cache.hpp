#pragma once
// The keys and values of every layer for a batch of sequences being generated, preallocated once
// to the longest prompt plus the new tokens: a decoding step writes its positions in place and
// attends over the filled part, so nothing is reallocated or concatenated per token. Grouped-query
// attention keeps num_key_value_heads heads, not one per query head.
#include <cstdint>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/models/llama/config.hpp>

namespace meshtorch::llama {

// What one layer's attention is given in a decoding step: where this step's keys and values go in
// the cache, and which of the cached positions each of its queries attends.
struct CachedAttention {
  torch::Tensor keys, values;  // [B, Hkv, capacity, head_dim] of this layer
  std::int64_t start = 0;      // this step's first position in the cache
  // [B, 1, S, start + S] bool: true where a query attends a key. Undefined when no row is padded:
  // causal attention for the first step, every cached key for a one-position step after it.
  torch::Tensor mask;
};

class KvCache {
 public:
  KvCache(const Config& c, std::int64_t batch, std::int64_t capacity, const torch::TensorOptions& options) {
    const auto shape = std::vector<std::int64_t>{batch, c.num_key_value_heads, capacity, c.resolved_head_dim()};
    for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
      keys_.push_back(torch::empty(shape, options));
      values_.push_back(torch::empty(shape, options));
    }
  }

  // The bytes a cache of `capacity` positions for `batch` rows takes: what the constructor
  // allocates, and what a plan counts. In double, as the plans count: a figure for any request,
  // never an overflow.
  static constexpr double bytes(const Config& c, std::int64_t batch, std::int64_t capacity,
                                std::int64_t element_bytes) {
    return 2.0 * static_cast<double>(c.num_hidden_layers) * static_cast<double>(batch) *
           static_cast<double>(c.kv_size()) * static_cast<double>(capacity) * static_cast<double>(element_bytes);
  }

  std::int64_t capacity() const { return keys_.empty() ? 0 : keys_.front().size(2); }
  std::int64_t length() const { return length_; }  // positions filled so far

  // Layer `layer`'s view for a step of `steps` positions under `mask`; advance() after the step.
  CachedAttention step(std::size_t layer, const torch::Tensor& mask) const {
    return {keys_.at(layer), values_.at(layer), length_, mask};
  }
  void advance(std::int64_t steps) { length_ += steps; }

  std::int64_t allocated_bytes() const {
    std::int64_t total = 0;
    for (const auto& t : keys_) total += t.numel() * static_cast<std::int64_t>(t.element_size());
    for (const auto& t : values_) total += t.numel() * static_cast<std::int64_t>(t.element_size());
    return total;
  }

 private:
  std::int64_t length_ = 0;
  std::vector<torch::Tensor> keys_, values_;
};

}  // namespace meshtorch::llama
