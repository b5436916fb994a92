#pragma once
// ForwardHooks: functions run around a module's forward, set from outside, as PyTorch's forward
// pre-hooks and forward hooks are. They are how parallel/ changes what a module sees and returns
// (gathering a sharded sequence, all-gathering sharded weights, reducing partial sums) without
// the model knowing of parallelism. A module with no hooks pays one empty-vector check.
#include <functional>
#include <utility>
#include <vector>

#include <meshtorch/torch.hpp>

namespace meshtorch {

struct ForwardHooks {
  // input -> the input the module's body sees.
  using Pre = std::function<torch::Tensor(const torch::Tensor& input)>;
  // (the input as the caller passed it, the body's output) -> the output the caller sees.
  using Post = std::function<torch::Tensor(const torch::Tensor& input, const torch::Tensor& output)>;

  // (the input after the pre-hooks, the body) -> the body's output, computed as the wrapper
  // chooses: activation checkpointing runs the body without a graph and again in backward, so a
  // body that is wrapped must not refer to anything that ends with the forward call.
  using Body = std::function<torch::Tensor(const torch::Tensor& input)>;
  using Wrap = std::function<torch::Tensor(const torch::Tensor& input, Body body)>;

  std::vector<Pre> pre;
  std::vector<Post> post;
  Wrap wrap;

  torch::Tensor before(torch::Tensor input) const {
    for (const auto& hook : pre) input = hook(input);
    return input;
  }
  torch::Tensor after(const torch::Tensor& input, torch::Tensor output) const {
    for (const auto& hook : post) output = hook(input, output);
    return output;
  }
  // Runs body between the hooks: body(before(input)) (through wrap when set), then
  // after(input, that).
  template <class F>
  torch::Tensor around(const torch::Tensor& input, F&& body) const {
    if (empty()) return std::forward<F>(body)(input);
    auto inner = before(input);
    return after(input, wrap ? wrap(inner, Body(std::forward<F>(body))) : std::forward<F>(body)(inner));
  }
  bool empty() const { return pre.empty() && post.empty() && !wrap; }
};

}  // namespace meshtorch
