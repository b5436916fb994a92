#pragma once
// ForwardHooks: functions run around a module's forward, set from outside, as PyTorch's forward
// pre-hooks and forward hooks are. They are how parallel/ changes what a module sees and returns
// (gathering a sharded sequence, all-gathering sharded weights, reducing partial sums) without
// the model knowing of parallelism. A module with no hooks pays one empty-vector check.
#include <functional>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace meshtorch {

struct ForwardHooks {
  // input -> the input the module's body sees.
  using Pre = std::function<torch::Tensor(const torch::Tensor& input)>;
  // (the input as the caller passed it, the body's output) -> the output the caller sees.
  using Post = std::function<torch::Tensor(const torch::Tensor& input, const torch::Tensor& output)>;

  std::vector<Pre> pre;
  std::vector<Post> post;

  torch::Tensor before(torch::Tensor input) const {
    for (const auto& hook : pre) input = hook(input);
    return input;
  }
  torch::Tensor after(const torch::Tensor& input, torch::Tensor output) const {
    for (const auto& hook : post) output = hook(input, output);
    return output;
  }
  // Runs body between the hooks: body(before(input)), then after(input, that).
  template <class Body>
  torch::Tensor around(const torch::Tensor& input, Body&& body) const {
    if (pre.empty() && post.empty()) return std::forward<Body>(body)(input);
    return after(input, std::forward<Body>(body)(before(input)));
  }
  bool empty() const { return pre.empty() && post.empty(); }
};

}  // namespace meshtorch
