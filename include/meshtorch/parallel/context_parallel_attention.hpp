#pragma once
// Context parallel's attention: every rank of the CP group holds its head-tail chunks of the
// sequence (layout/context_split.hpp) and attends with its own queries over every rank's keys and
// values, block by block (parallel/blockwise_attention.hpp), by one of two methods (--cp-rotate):
//
//   allgather  the keys and values gathered once per layer (as Llama 3 trained long sequences);
//              backward reduce-scatters their gradients back to the ranks that hold them.
//   ring       the keys and values passed to the next rank while the current block computes, N-1
//              times; no rank ever holds more than two ranks' keys and values. Backward passes
//              them around again, each with the sum of its gradients so far, which arrives home
//              after the N-th pass.
#include <array>
#include <cstdint>
#include <optional>
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

// The same attention with the keys and values passed around the group's ring (rank r sends to
// r+1 and receives from r-1), each pass overlapped with the blocks of the keys and values at hand.
MESHTORCH_DECL torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                            const comm::AxisGroup& group, double scale);

// Causal attention by the method `rotate` names.
MESHTORCH_DECL torch::Tensor split_attention(Rotate rotate, const torch::Tensor& q, const torch::Tensor& k,
                                             const torch::Tensor& v, const comm::AxisGroup& group, double scale);

}  // namespace meshtorch::cp

#if MESHTORCH_DEFINES(core)
#include <stdexcept>
#include <string>

#include <meshtorch/comm/point_to_point.hpp>

namespace meshtorch::cp {

namespace ring_detail {

inline void check_chunks(std::string_view who, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  if (q.size(2) % 2 != 0 || k.size(2) != q.size(2) || v.size(2) != q.size(2))
    throw std::invalid_argument(std::string(who) + ": q, k and v hold two chunks of the same length each; got " +
                                std::to_string(q.size(2)) + ", " + std::to_string(k.size(2)) + " and " +
                                std::to_string(v.size(2)) + " positions");
}

// The group rides in the autograd context as a capsule: IValue has no slot for our own types.
struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(comm::AxisGroup g) : group(std::move(g)) {}
  comm::AxisGroup group;
};

// One message around the ring: sent to the next rank, received from the previous one.
struct RingPass {
  comm::Work<torch::Tensor> sent, received;
  torch::Tensor wait() {
    sent.wait();
    return received.wait();
  }
};

inline RingPass pass_on(const comm::AxisGroup& group, const torch::Tensor& tensor, int tag) {
  const int ranks = group.size(), rank = group.rank();
  auto buffer = torch::empty_like(tensor, at::MemoryFormat::Contiguous);
  // Receive first: a backend that runs sends eagerly then finds the buffer posted.
  auto received = comm::receive_async(group, buffer, (rank + ranks - 1) % ranks, tag);
  return {comm::send_async(group, tensor, (rank + 1) % ranks, tag), std::move(received)};
}

// Keys and values of one rank's two chunks, stacked [2 (k, v), B, Hkv, 2c, D]: one message a pass.
struct KeyValueChunks {
  torch::Tensor stacked;
  std::int64_t chunk;
  torch::Tensor key(int i) const { return stacked[0].narrow(2, i * chunk, chunk); }
  torch::Tensor value(int i) const { return stacked[1].narrow(2, i * chunk, chunk); }
};

struct RingAttention : torch::autograd::Function<RingAttention> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const comm::AxisGroup& group, double scale) {
    const int ranks = group.size(), rank = group.rank();
    const std::int64_t chunk = q.size(2) / 2;
    const auto held = chunks_of(rank, ranks);
    const std::array<torch::Tensor, 2> queries{q.narrow(2, 0, chunk), q.narrow(2, chunk, chunk)};
    std::array<PartialAttention, 2> totals;
    KeyValueChunks at_hand{torch::stack({k, v}).contiguous(), chunk};
    for (int step = 0; step < ranks; ++step) {
      std::optional<RingPass> next;
      if (step + 1 < ranks) next = pass_on(group, at_hand.stacked, step);
      const auto source = chunks_of((rank - step + ranks) % ranks, ranks);
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j)
          if (const auto seen = visibility(held[i], source[j]); seen != ChunkVisibility::none)
            merge_into(totals[i], attend(queries[i], at_hand.key(j), at_hand.value(j), seen, scale));
      if (next) at_hand.stacked = next->wait();
    }
    ctx->save_for_backward({q, k, v, totals[0].out, totals[0].lse, totals[1].out, totals[1].lse});
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(group));
    ctx->saved_data["scale"] = scale;
    return torch::cat({totals[0].out, totals[1].out}, 2).to(q.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& group = static_cast<GroupCapsule*>(ctx->saved_data["group"].toCapsule().get())->group;
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto &q = saved[0], &k = saved[1], &v = saved[2];
    const std::array<PartialAttention, 2> totals{PartialAttention{saved[3], saved[4]},
                                                 PartialAttention{saved[5], saved[6]}};
    const int ranks = group.size(), rank = group.rank();
    const std::int64_t chunk = q.size(2) / 2;
    const auto held = chunks_of(rank, ranks);
    const std::array<torch::Tensor, 2> queries{q.narrow(2, 0, chunk), q.narrow(2, chunk, chunk)};
    const auto grads = grad_outputs[0].split(chunk, 2);
    std::array<torch::Tensor, 2> dq;
    KeyValueChunks at_hand{torch::stack({k, v}).contiguous(), chunk};
    // The gradient of the keys and values at hand, summed over the ranks they have visited (fp32):
    // it travels with them and, after the last pass, is home.
    std::optional<RingPass> gradient_in;
    for (int step = 0; step < ranks; ++step) {
      std::optional<RingPass> next;
      if (step + 1 < ranks) next = pass_on(group, at_hand.stacked, step);
      const auto source = chunks_of((rank - step + ranks) % ranks, ranks);
      auto gradient = torch::zeros(at_hand.stacked.sizes(), at_hand.stacked.options().dtype(torch::kFloat));
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) {
          const auto seen = visibility(held[i], source[j]);
          if (seen == ChunkVisibility::none) continue;
          auto [q_grad, k_grad, v_grad] =
              attend_backward(grads[i], queries[i], at_hand.key(j), at_hand.value(j), totals[i], seen, scale);
          dq[i] = dq[i].defined() ? dq[i] + q_grad.to(torch::kFloat) : q_grad.to(torch::kFloat);
          gradient[0].narrow(2, j * chunk, chunk).add_(k_grad);
          gradient[1].narrow(2, j * chunk, chunk).add_(v_grad);
        }
      if (gradient_in) gradient.add_(gradient_in->wait());
      gradient_in = pass_on(group, gradient, ranks + step);
      if (next) at_hand.stacked = next->wait();
    }
    const auto own = gradient_in->wait();  // every rank's share of this rank's keys and values
    // Every query chunk sees itself, so both dq are defined.
    return {torch::cat({dq[0], dq[1]}, 2).to(q.scalar_type()), own[0].to(k.scalar_type()), own[1].to(v.scalar_type()),
            torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace ring_detail

MESHTORCH_DECL torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                            const comm::AxisGroup& group, double scale) {
  ring_detail::check_chunks("cp::ring_attention", q, k, v);
  if (group.size() == 1) return attend_chunks({q}, {0}, {k}, {v}, {0}, scale);
  return ring_detail::RingAttention::apply(q, k, v, group, scale);
}

MESHTORCH_DECL torch::Tensor split_attention(Rotate rotate, const torch::Tensor& q, const torch::Tensor& k,
                                             const torch::Tensor& v, const comm::AxisGroup& group, double scale) {
  return rotate == Rotate::ring ? ring_attention(q, k, v, group, scale) : allgather_attention(q, k, v, group, scale);
}

MESHTORCH_DECL torch::Tensor allgather_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                                 const comm::AxisGroup& group, double scale) {
  const int ranks = group.size(), rank = group.rank();
  ring_detail::check_chunks("cp::allgather_attention", q, k, v);
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
