#pragma once
// Gradient clipping by the global norm, as torch.nn.utils.clip_grad_norm_ computes it for the
// whole model, in any layout: the norm of all gradients of the (unsharded) model. Each rank sums
// the squared norms of the gradient pieces it counts (each distinct piece counted by exactly one
// rank: ParallelLlama passes the checkpoint writer's rule, so DP replicas and weights TP leaves
// whole count once), one all-reduce over the world adds them, and every rank scales all its
// gradients, replicas too, by min(1, max_norm / (norm + 1e-6)).
#include <functional>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::train {

// A trained tensor whose gradient is clipped; `counted`: this rank adds its gradient's norm
// (false for a copy another rank counts).
struct ClippedTensor {
  torch::Tensor tensor;
  bool counted = true;
};

// The norm of the gradients before clipping. `sum_over_ranks` adds every rank's part of the
// squared norm (a one-element fp64 tensor); none: one process. Taking it as a function keeps
// the collectives out of one-process programs.
MESHTORCH_DECL double clip_grad_norm(const std::vector<ClippedTensor>& pieces, double max_norm,
                                     const std::function<torch::Tensor(torch::Tensor)>& sum_over_ranks = {});

// One process: every parameter counts.
inline double clip_grad_norm(const std::vector<torch::Tensor>& parameters, double max_norm) {
  std::vector<ClippedTensor> pieces;
  for (const auto& parameter : parameters) pieces.push_back({parameter, true});
  return clip_grad_norm(pieces, max_norm);
}

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(core)
#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace meshtorch::train {

MESHTORCH_DECL double clip_grad_norm(const std::vector<ClippedTensor>& pieces, double max_norm,
                                     const std::function<torch::Tensor(torch::Tensor)>& sum_over_ranks) {
  if (!(max_norm > 0)) throw ConfigError(fmt::format("clip_grad_norm: max_norm {} must be positive", max_norm));
  std::vector<torch::Tensor> grads;
  torch::Tensor squares;
  for (const auto& piece : pieces) {
    const torch::Tensor grad = piece.tensor.grad();
    if (!grad.defined()) continue;
    grads.push_back(grad);
    if (!piece.counted) continue;
    // Each piece's norm in fp32 (as PyTorch does), squared and summed in fp64.
    auto square = at::linalg_vector_norm(grad, 2, {}, false, torch::kFloat).to(torch::kDouble).square();
    squares = squares.defined() ? squares + square : square;
  }
  if (!squares.defined()) {
    const auto device = pieces.empty() ? torch::Device(torch::kCPU) : pieces.front().tensor.device();
    squares = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(device));
  }
  if (sum_over_ranks) squares = sum_over_ranks(squares.reshape({1}));
  const double norm = std::sqrt(squares.item<double>());
  const double scale = std::min(1.0, max_norm / (norm + 1e-6));
  torch::NoGradGuard no_grad;
  for (auto& grad : grads) grad.mul_(scale);
  return norm;
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(core)
