#pragma once
// Context parallel's attention with the keys and values gathered once per layer
// (--cp-rotate allgather, as Llama 3 trained long sequences): every rank of the CP group holds
// its head-tail chunks of the sequence (layout/context_split.hpp), gathers every rank's keys and
// values, and attends with its own queries over all of them block by block
// (parallel/blockwise_attention.hpp). Backward reduce-scatters the keys' and values' gradients
// back to the ranks that hold them, summed over every rank's queries.
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/differentiable.hpp>
#include <meshtorch/layout/context_split.hpp>
#include <meshtorch/parallel/blockwise_attention.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::cp {

// Causal attention of this rank's queries over the whole sequence. q [B, H, 2c, D] and k, v
// [B, Hkv, 2c, D] hold the sequence's chunks r and 2N-1-r, in that order, for rank r of the
// group's N; the result is the attention output of those positions, in the same layout.
MESHTORCH_DECL torch::Tensor allgather_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                                 const comm::AxisGroup& group, double scale);

}  // namespace meshtorch::cp

#if MESHTORCH_DEFINES(core)
#include <stdexcept>
#include <string>

namespace meshtorch::cp {

MESHTORCH_DECL torch::Tensor allgather_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                                 const comm::AxisGroup& group, double scale) {
  const int ranks = group.size(), rank = group.rank();
  if (q.size(2) % 2 != 0 || k.size(2) != q.size(2) || v.size(2) != q.size(2))
    throw std::invalid_argument("cp::allgather_attention: q, k and v hold two chunks of the same length each; got " +
                                std::to_string(q.size(2)) + ", " + std::to_string(k.size(2)) + " and " +
                                std::to_string(v.size(2)) + " positions");
  const std::int64_t chunk = q.size(2) / 2;
  // Gathered in rank order: rank i's two chunks, i and 2N-1-i, at places 2i and 2i+1.
  const auto keys = comm::gather_from_sequence_parallel_region<2>(k.contiguous(), group).split(chunk, 2);
  const auto values = comm::gather_from_sequence_parallel_region<2>(v.contiguous(), group).split(chunk, 2);
  std::vector<int> kv_chunks;
  for (int i = 0; i < ranks; ++i)
    for (int c : chunks_of(i, ranks)) kv_chunks.push_back(c);
  const auto held = chunks_of(rank, ranks);
  return attend_chunks({q.narrow(2, 0, chunk), q.narrow(2, chunk, chunk)}, {held[0], held[1]},
                       std::vector<torch::Tensor>(keys.begin(), keys.end()),
                       std::vector<torch::Tensor>(values.begin(), values.end()), kv_chunks, scale);
}

}  // namespace meshtorch::cp
#endif  // MESHTORCH_DEFINES(core)
