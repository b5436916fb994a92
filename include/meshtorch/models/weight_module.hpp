#pragma once
// WeightModule: a leaf layer holding one weight, the unit of every parallel wrapper's work
// (FSDP's shards, tensor parallel's splits). Its parameter can be created on the meta device
// (shapes only, no memory) and given real storage later, which LibTorch's own modules cannot do:
// set_data refuses to move a meta tensor. LibTorch C++ has no forward hooks on any module, so a
// leaf carries ForwardHooks that its forward runs around; any model family builds on it.
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/models/forward_hooks.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch {

class WeightModule : public torch::nn::Module {
 public:
  torch::Tensor weight;
  // Run around forward; empty unless a parallel plan set them.
  ForwardHooks hooks;
  // Functions of the weight that forward computes with instead of the weight itself, applied in
  // order (torch.nn.utils.parametrize): e.g. an identity whose backward all-reduces the
  // gradient, for a weight replicated over ranks that each see part of the data.
  std::vector<std::function<torch::Tensor(const torch::Tensor&)>> parametrizations;

  MESHTORCH_DECL torch::Tensor weight_in_use() const;

  // Gives the weight fresh, uninitialised storage with `options` (e.g. meta -> cuda/bf16);
  // the caller initialises it. Keeps the parameter's name and requires_grad.
  MESHTORCH_DECL void materialize(const torch::TensorOptions& options);

  // Replaces the weight by another tensor of the same shape (used by loaders and by
  // wrappers that keep parameters as views into flat buffers).
  MESHTORCH_DECL void replace_weight(const torch::Tensor& replacement);

  // Replaces the weight by a tensor of any shape (a plan's shard of it), keeping the name and
  // requires_grad.
  MESHTORCH_DECL void set_weight(const torch::Tensor& replacement);

 protected:
  MESHTORCH_DECL void create_weight(torch::IntArrayRef sizes, const torch::TensorOptions& options);
};

// Every WeightModule under `root` (itself included), with its path from `root`, in
// named_modules() order: the order a model's weights are initialised and saved in.
MESHTORCH_DECL std::vector<std::pair<std::string, WeightModule*>> weight_modules(torch::nn::Module& root);

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
namespace meshtorch {

MESHTORCH_DECL torch::Tensor WeightModule::weight_in_use() const {
  if (parametrizations.empty()) return weight;
  auto w = weight;
  for (const auto& p : parametrizations) w = p(w);
  return w;
}

MESHTORCH_DECL void WeightModule::materialize(const torch::TensorOptions& options) {
  auto fresh = torch::empty(weight.sizes(), options.requires_grad(false));
  fresh.set_requires_grad(weight.requires_grad());
  weight = fresh;
  parameters_["weight"] = weight;
}

MESHTORCH_DECL void WeightModule::replace_weight(const torch::Tensor& replacement) {
  TORCH_CHECK(replacement.sizes() == weight.sizes(), "replace_weight: shape ", replacement.sizes(), " differs from ",
              weight.sizes());
  weight = replacement;
  parameters_["weight"] = weight;
}

MESHTORCH_DECL void WeightModule::set_weight(const torch::Tensor& replacement) {
  auto fresh = replacement.detach();
  fresh.set_requires_grad(weight.requires_grad());
  weight = fresh;
  parameters_["weight"] = weight;
}

MESHTORCH_DECL void WeightModule::create_weight(torch::IntArrayRef sizes, const torch::TensorOptions& options) {
  weight = register_parameter("weight", torch::empty(sizes, options.requires_grad(false)));
}

MESHTORCH_DECL std::vector<std::pair<std::string, WeightModule*>> weight_modules(torch::nn::Module& root) {
  std::vector<std::pair<std::string, WeightModule*>> leaves;
  for (auto& item : root.named_modules())
    if (auto* leaf = dynamic_cast<WeightModule*>(item.value().get())) leaves.emplace_back(item.key(), leaf);
  return leaves;
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
