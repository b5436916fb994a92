#pragma once
// Point-to-point messages between two ranks of a group: what pipeline stages pass (activations
// forward, their gradients back). Both sides know the shape, so no shape is exchanged; a `tag`
// tells messages between the same two ranks apart (Gloo matches on it; NCCL matches in issue
// order, so a caller issues its sends and receives in an order both sides share).
//
// As for collectives (comm/work.hpp), each message is recorded in the flight recorder as
// "send to 3" or "recv from 1", and a wait past the group's timeout is a CommError naming the
// peer, which the watchdog reports like any stalled collective.
#include <string>

#include <meshtorch/torch.hpp>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/work.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::comm {

// Sends `tensor` to the group rank `peer`. The tensor must stay unchanged until wait() returns
// (it is the message's buffer); wait() returns it.
MESHTORCH_DECL Work<torch::Tensor> send_async(const AxisGroup& group, const torch::Tensor& tensor, int peer, int tag);

// Receives into `tensor` (contiguous, the sender's shape and dtype) from the group rank `peer`;
// wait() returns it filled.
MESHTORCH_DECL Work<torch::Tensor> receive_async(const AxisGroup& group, torch::Tensor tensor, int peer, int tag);

}  // namespace meshtorch::comm

#if MESHTORCH_DEFINES(core)
#include <vector>

#include <fmt/format.h>

#include <meshtorch/comm/collectives.hpp>

namespace meshtorch::comm {

namespace detail {

inline void check_peer(std::string_view what, const AxisGroup& group, int peer) {
  if (peer < 0 || peer >= group.size() || peer == group.rank())
    throw collective_error(what, group,
                           fmt::format("peer {} is not another rank of the group (0 to {}, this rank {})", peer,
                                       group.size() - 1, group.rank()));
}

}  // namespace detail

MESHTORCH_DECL Work<torch::Tensor> send_async(const AxisGroup& group, const torch::Tensor& tensor, int peer, int tag) {
  detail::check_peer("send", group, peer);
  const std::string what = fmt::format("{}{}", diagnostics::send_prefix, group.global_rank_of(peer));
  detail::check_device(what, group, tensor);
  torch::Tensor buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
  std::vector<torch::Tensor> buffers{buffer};
  auto work = detail::issue(
      what, group, buffer, [&] { return group.backend()->send(buffers, peer, tag); }, detail::Traffic::message);
  return {work, [buffer] { return buffer; }, what, group};
}

MESHTORCH_DECL Work<torch::Tensor> receive_async(const AxisGroup& group, torch::Tensor tensor, int peer, int tag) {
  detail::check_peer("recv", group, peer);
  const std::string what = fmt::format("{}{}", diagnostics::receive_prefix, group.global_rank_of(peer));
  detail::check_device(what, group, tensor);
  if (!tensor.is_contiguous()) throw detail::collective_error(what, group, "the receive buffer must be contiguous");
  std::vector<torch::Tensor> buffers{tensor};
  auto work = detail::issue(
      what, group, tensor, [&] { return group.backend()->recv(buffers, peer, tag); }, detail::Traffic::message);
  return {work, [tensor] { return tensor; }, what, group};
}

}  // namespace meshtorch::comm
#endif  // MESHTORCH_DEFINES(core)
