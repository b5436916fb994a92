#pragma once
// Backward in two steps, as zero-bubble schedules need it: the input gradient first (sent to the
// previous stage at once), the weight gradients later (where the rank would otherwise idle),
// without computing any part of the graph twice.
//
// How: the input step runs autograd.grad from the output to the input with the graph kept; the
// engine then runs only the nodes on the input's path, and in each only the outputs that lead to
// the input. A *weight node* is a node on that path with an edge leading off it to weights (a
// matrix product whose other operand is a weight, through its transpose; a norm's scaling). A
// pre-hook on each keeps the gradient it receives in the input step. The weight step runs each
// weight node again from that gradient, asking the engine only for the weights off its edges, so
// nothing on the input's path runs twice. This is what PyTorch's pipelining does in
// stage_backward_input / stage_backward_weight, on LibTorch's engine.
//
// Without an input gradient (the first stage, whose input is token ids) the weight step is one
// backward from the output limited to the weights. So it is when the caller asks for it
// (`repeat_input_path`): under FSDP the weights are behind one gather node per unit, whose backward
// (the reduce-scatter) must run once with all of the unit's gradients, not once per weight node;
// that backward repeats the input path's nodes.
#include <memory>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/separate_compilation.hpp>

namespace torch::autograd {
struct Node;
}

namespace meshtorch {

class SplitBackward {
 public:
  // `output`: what the stage computed (a scalar loss needs no `grad_output`); `input`: the
  // stage's input leaf, or undefined when it has no gradient (token ids); `weights`: the stage's
  // trained tensors; `repeat_input_path`: the weight step is one backward from the output (above).
  MESHTORCH_DECL SplitBackward(torch::Tensor output, torch::Tensor grad_output, torch::Tensor input,
                               std::vector<torch::Tensor> weights, bool repeat_input_path = false);

  // The gradient of the input (undefined without an input). Call once, before weight_gradients().
  MESHTORCH_DECL torch::Tensor input_gradient();

  // Accumulates the weights' gradients into their .grad and releases the graph.
  MESHTORCH_DECL void weight_gradients();

 private:
  struct Captured;  // a weight node, the gradients it received, and its weights' accumulators

  torch::Tensor output_, grad_output_, input_;
  std::vector<torch::Tensor> weights_;
  std::vector<std::shared_ptr<Captured>> captured_;
  bool input_done_ = false;
  bool one_weight_backward_ = false;  // the weight step is one backward from the output
};

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <algorithm>
#include <functional>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace meshtorch {

struct SplitBackward::Captured {
  std::shared_ptr<torch::autograd::Node> node;
  torch::autograd::edge_list accumulators;  // the weights' accumulators off this node's edges
  torch::autograd::variable_list grads;     // what the node received in the input step
  bool received = false;
};

namespace split_backward_detail {

// Keeps the gradients a node receives, the first time it runs (the input step).
class KeepGradients : public torch::autograd::FunctionPreHook {
 public:
  explicit KeepGradients(std::weak_ptr<void> captured, torch::autograd::variable_list* grads, bool* received)
      : captured_(std::move(captured)), grads_(grads), received_(received) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (const auto alive = captured_.lock(); alive && !*received_) {
      *grads_ = grads;
      *received_ = true;
    }
    return grads;
  }

 private:
  std::weak_ptr<void> captured_;  // the hook outlives its owner when the graph is kept elsewhere
  torch::autograd::variable_list* grads_;
  bool* received_;
};

}  // namespace split_backward_detail

MESHTORCH_DECL SplitBackward::SplitBackward(torch::Tensor output, torch::Tensor grad_output, torch::Tensor input,
                                            std::vector<torch::Tensor> weights, bool repeat_input_path)
    : output_(std::move(output)),
      grad_output_(std::move(grad_output)),
      input_(std::move(input)),
      weights_(std::move(weights)),
      one_weight_backward_(repeat_input_path || !input_.defined()) {
  if (one_weight_backward_) return;
  using torch::autograd::Node;
  std::unordered_map<const Node*, std::shared_ptr<Node>> weight_accumulators;
  for (const auto& weight : weights_)
    if (weight.requires_grad()) {
      auto accumulator = torch::autograd::impl::grad_accumulator(weight);
      weight_accumulators.emplace(accumulator.get(), accumulator);
    }
  const Node* input_accumulator = torch::autograd::impl::grad_accumulator(input_).get();

  // Which nodes lead to the input: the input step runs exactly these.
  std::unordered_map<const Node*, bool> leads_to_input;
  const std::function<bool(const std::shared_ptr<Node>&)> on_path = [&](const std::shared_ptr<Node>& node) -> bool {
    if (!node) return false;
    if (node.get() == input_accumulator) return true;
    if (const auto known = leads_to_input.find(node.get()); known != leads_to_input.end()) return known->second;
    leads_to_input[node.get()] = false;  // a graph has no cycles; this only stops a revisit
    bool leads = false;
    for (const auto& edge : node->next_edges()) leads = on_path(edge.function) || leads;
    return leads_to_input[node.get()] = leads;
  };
  // The weights reachable from `node` off the input's path.
  const auto weights_off_path = [&](const std::shared_ptr<Node>& start) {
    torch::autograd::edge_list found;
    std::vector<std::shared_ptr<Node>> pending{start};
    std::unordered_set<const Node*> seen;
    while (!pending.empty()) {
      auto node = std::move(pending.back());
      pending.pop_back();
      if (!node || !seen.insert(node.get()).second) continue;
      if (const auto weight = weight_accumulators.find(node.get()); weight != weight_accumulators.end()) {
        found.emplace_back(weight->second, 0);
        continue;
      }
      for (const auto& edge : node->next_edges())
        if (edge.function && !on_path(edge.function)) pending.push_back(edge.function);
    }
    return found;
  };
  if (!on_path(output_.grad_fn())) {  // the output does not depend on the input
    one_weight_backward_ = true;
    return;
  }
  std::vector<std::shared_ptr<Node>> pending{output_.grad_fn()};
  std::unordered_set<const Node*> seen;
  while (!pending.empty()) {
    auto node = std::move(pending.back());
    pending.pop_back();
    if (!node || !seen.insert(node.get()).second) continue;
    torch::autograd::edge_list accumulators;
    for (const auto& edge : node->next_edges()) {
      if (!edge.function) continue;
      if (on_path(edge.function)) {
        pending.push_back(edge.function);
      } else {
        for (auto& found : weights_off_path(edge.function)) accumulators.push_back(std::move(found));
      }
    }
    if (accumulators.empty()) continue;
    auto captured = std::make_shared<Captured>(Captured{node, std::move(accumulators), {}, false});
    node->add_pre_hook(
        std::make_unique<split_backward_detail::KeepGradients>(captured, &captured->grads, &captured->received));
    captured_.push_back(std::move(captured));
  }
}

MESHTORCH_DECL torch::Tensor SplitBackward::input_gradient() {
  if (input_done_) throw std::logic_error("SplitBackward: input_gradient() called twice");
  input_done_ = true;
  if (!input_.defined()) return {};
  const std::vector<torch::Tensor> grad_outputs{grad_output_};
  return torch::autograd::grad({output_}, {input_}, grad_outputs, /*retain_graph=*/true)[0];
}

MESHTORCH_DECL void SplitBackward::weight_gradients() {
  if (!input_done_) throw std::logic_error("SplitBackward: weight_gradients() before input_gradient()");
  const bool every_node_kept_its_gradient =
      std::all_of(captured_.begin(), captured_.end(), [](const auto& captured) { return captured->received; });
  if (one_weight_backward_ || !every_node_kept_its_gradient) {
    // One backward from the output, for the weights only (the graph was kept by the input step).
    std::vector<torch::Tensor> trained;
    for (const auto& weight : weights_)
      if (weight.requires_grad()) trained.push_back(weight);
    const std::vector<torch::Tensor> grad_outputs{grad_output_};
    torch::autograd::backward({output_}, grad_outputs, /*retain_graph=*/false, /*create_graph=*/false, trained);
  } else {
    auto& engine = torch::autograd::Engine::get_default_engine();
    for (const auto& captured : captured_) {
      torch::autograd::edge_list roots;
      torch::autograd::variable_list grads;
      for (std::size_t i = 0; i < captured->grads.size(); ++i)
        if (captured->grads[i].defined()) {
          roots.emplace_back(captured->node, static_cast<std::uint32_t>(i));
          grads.push_back(captured->grads[i]);
        }
      // Only the weights off this node's edges: the engine runs the node for them alone, and
      // nothing on the input's path.
      if (!roots.empty())
        engine.execute(roots, grads, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/true,
                       captured->accumulators);
    }
  }
  captured_.clear();
  output_ = grad_output_ = input_ = torch::Tensor();
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
