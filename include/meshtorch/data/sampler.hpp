#pragma once
// The data-parallel-invariant sampler. Each epoch is a permutation of the blocks fixed by the
// seed; optimizer step s consumes the slice [s*G, (s+1)*G) of it, where G = batch * dp_size *
// grad_accum is the global batch. Data-parallel rank r takes the r-th of dp_size equal parts of
// that slice and micro-batch m the m-th batch-sized piece of its part. So the set of samples in
// a step does not depend on how it is split: 1 process with batch 8 and 4 ranks with batch 2
// train on the same data. Tensor-parallel ranks of one data-parallel coordinate pass the same
// dp_rank and get the same rows. The remainder of an epoch is dropped.
#include <cstdint>
#include <vector>

#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::data {

struct SamplerOptions {
  std::int64_t num_samples = 0;
  std::int64_t batch_size = 1;  // per data-parallel rank and micro-batch
  std::int64_t dp_size = 1;
  std::int64_t dp_rank = 0;
  std::int64_t grad_accum = 1;
  std::uint64_t seed = 0;
};

class DpInvariantSampler {
 public:
  MESHTORCH_DECL explicit DpInvariantSampler(const SamplerOptions& options);

  std::int64_t global_batch() const { return o_.batch_size * o_.dp_size * o_.grad_accum; }
  std::int64_t steps_per_epoch() const { return o_.num_samples / global_batch(); }
  std::int64_t micro_batches() const { return o_.grad_accum; }
  const SamplerOptions& options() const { return o_; }

  // A Fisher-Yates shuffle with splitmix64 and multiply-shift ranges, so the order is the
  // same with every standard library (std::shuffle's is not specified).
  MESHTORCH_DECL std::vector<std::int64_t> permutation(std::int64_t epoch) const;

  // The rows of micro-batch `micro` of step `step` for this rank, given the epoch's permutation.
  std::vector<std::int64_t> indices(const std::vector<std::int64_t>& permutation, std::int64_t step,
                                    std::int64_t micro) const {
    const std::int64_t begin = step * global_batch() + (o_.dp_rank * o_.grad_accum + micro) * o_.batch_size;
    return {permutation.begin() + begin, permutation.begin() + begin + o_.batch_size};
  }

 private:
  SamplerOptions o_;
};

}  // namespace meshtorch::data

#if MESHTORCH_DEFINES(core)
#include <numeric>

#include <fmt/format.h>

namespace meshtorch::data {

MESHTORCH_DECL DpInvariantSampler::DpInvariantSampler(const SamplerOptions& options) : o_(options) {
  if (o_.batch_size <= 0) throw ConfigError("-b/--batch-size must be positive");
  if (o_.grad_accum <= 0) throw ConfigError("--grad-accum must be positive");
  if (o_.dp_size <= 0 || o_.dp_rank < 0 || o_.dp_rank >= o_.dp_size)
    throw ConfigError(fmt::format("data-parallel rank {} is outside [0, {})", o_.dp_rank, o_.dp_size));
  // The global batch divides the data set below: a product that wraps (to 0 for 4 x 2^62) would
  // divide by zero. No data set holds 2^63 blocks, so an overflow is simply too large.
  std::int64_t global = 0;
  if (__builtin_mul_overflow(o_.batch_size, o_.dp_size, &global) ||
      __builtin_mul_overflow(global, o_.grad_accum, &global))
    throw ConfigError(
        fmt::format("the global batch -b/--batch-size {} x {} data-parallel rank(s) x --grad-accum {} "
                    "overflows a 64-bit integer; it must be at most the dataset's {} blocks",
                    o_.batch_size, o_.dp_size, o_.grad_accum, o_.num_samples));
  if (steps_per_epoch() == 0)
    throw ConfigError(
        fmt::format("the dataset's {} blocks do not fill one global batch of {} (batch x "
                    "data-parallel size x grad-accum); use a smaller -b/--batch-size or "
                    "-s/--seq-length",
                    o_.num_samples, global_batch()));
}

MESHTORCH_DECL std::vector<std::int64_t> DpInvariantSampler::permutation(std::int64_t epoch) const {
  std::vector<std::int64_t> order(static_cast<std::size_t>(o_.num_samples));
  std::iota(order.begin(), order.end(), 0);
  std::uint64_t state = o_.seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(epoch) + 1;
  auto next = [&state] {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  for (std::size_t i = order.size(); i > 1; --i) {
    const auto j = static_cast<std::size_t>((static_cast<unsigned __int128>(next()) * i) >> 64);
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

}  // namespace meshtorch::data
#endif  // MESHTORCH_DEFINES(core)
