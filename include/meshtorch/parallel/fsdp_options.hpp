#pragma once
// What FullyShardedDataParallel (parallel/fsdp.hpp) is asked to do: FSDP2's fully_shard options.
#include <cstdint>
#include <optional>

#include <meshtorch/torch.hpp>

namespace meshtorch {

// FSDP2's MixedPrecisionPolicy: the shards (and the optimizer) stay in the dtype the model was
// built with; the gathered weights are cast to param_dtype for forward and backward, and
// gradients are reduce-scattered in reduce_dtype.
struct MixedPrecision {
  std::optional<torch::ScalarType> param_dtype;   // unset: the shards' dtype
  std::optional<torch::ScalarType> reduce_dtype;  // unset: param_dtype
};

struct FsdpOptions {
  // Free every layer's full weights after its forward and all-gather them again for its
  // backward: less memory, one more all-gather per layer and step.
  bool reshard_after_forward = true;
  // Shards, gradients and optimizer state live in CPU memory and the optimizer steps there;
  // each gather copies the shard to `device`. Each reduce-scatter's mean is copied to pinned
  // host memory without blocking the host, and lands in .grad once the copies of
  // reduce_scatters_in_flight later units have started too, or when backward ends (at once with
  // reduce_scatters_in_flight 0). Optimizer offload alone, the shards staying on the device, is
  // train::AdamWOptions::offload.
  bool cpu_offload = false;
  MixedPrecision mixed_precision;
  // Where forward and backward compute.
  torch::Device device = torch::kCPU;
  // Units whose all-gather is issued ahead of their turn, in forward and in backward (FSDP2
  // prefetches one). Each costs one unit's gathered weights more memory. 0: a unit gathers
  // when it runs.
  std::int64_t prefetch_layers = 1;
  // Reduce-scatters left running while backward goes on (each holds one unit's gradients in
  // the reduce dtype; issuing one more waits for the oldest, as FSDP2 waits for the previous
  // one); 0: each waited for at once, its result handed to autograd (what a DDP Reducer over
  // the shards, HSDP, needs). Whatever the number, backward returns with every gradient in .grad.
  std::int64_t reduce_scatters_in_flight = 1;
};

}  // namespace meshtorch
