#pragma once
// WeightModule: a leaf layer holding one weight (and, for a Linear that has one, a bias), the
// unit of every parallel wrapper's work (FSDP's shards, tensor parallel's splits). Wrappers reach
// its tensors through leaf_tensors(): named as HF names them ("...q_proj.weight",
// "...q_proj.bias"), each with the slot it fills. Its parameters can be created on the meta device
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

// Which tensor of a leaf: every leaf has a weight; a Linear may have a bias.
enum class LeafSlot { weight, bias };

class WeightModule : public torch::nn::Module {
 public:
  torch::Tensor weight;
  torch::Tensor bias;  // undefined: none (Qwen2's q/k/v projections have one, added by the layer's forward)
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

  // The same for either slot (the bias's functions of it: bias_parametrizations).
  torch::Tensor& tensor(LeafSlot slot) { return slot == LeafSlot::weight ? weight : bias; }
  const torch::Tensor& tensor(LeafSlot slot) const { return slot == LeafSlot::weight ? weight : bias; }
  MESHTORCH_DECL void replace(LeafSlot slot, const torch::Tensor& replacement);
  MESHTORCH_DECL void set(LeafSlot slot, const torch::Tensor& replacement);
  std::vector<std::function<torch::Tensor(const torch::Tensor&)>> bias_parametrizations;
  // The bias forward adds (undefined when there is none).
  MESHTORCH_DECL torch::Tensor bias_in_use() const;

 protected:
  MESHTORCH_DECL void create_weight(torch::IntArrayRef sizes, const torch::TensorOptions& options);
  MESHTORCH_DECL void create_bias(std::int64_t size, const torch::TensorOptions& options);
};

// Every WeightModule under `root` (itself included), with its path from `root`, in
// named_modules() order: the order a model's weights are initialised and saved in.
MESHTORCH_DECL std::vector<std::pair<std::string, WeightModule*>> weight_modules(torch::nn::Module& root);

// One tensor of a leaf, with its full name from the root ("model.layers.0.self_attn.q_proj.bias").
struct LeafTensor {
  std::string name;
  WeightModule* leaf = nullptr;
  LeafSlot slot = LeafSlot::weight;

  torch::Tensor& tensor() const { return leaf->tensor(slot); }
  void replace(const torch::Tensor& replacement) const { leaf->replace(slot, replacement); }
  void set(const torch::Tensor& replacement) const { leaf->set(slot, replacement); }
};

// Every tensor of every leaf under `root`: each leaf's weight, then its bias if it has one, in
// named_modules() order (that of named_parameters(), which initialisation and saving follow).
MESHTORCH_DECL std::vector<LeafTensor> leaf_tensors(torch::nn::Module& root);

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
namespace meshtorch {

MESHTORCH_DECL torch::Tensor WeightModule::weight_in_use() const {
  if (parametrizations.empty()) return weight;
  auto w = weight;
  for (const auto& p : parametrizations) w = p(w);
  return w;
}

MESHTORCH_DECL torch::Tensor WeightModule::bias_in_use() const {
  auto b = bias;
  for (const auto& p : bias_parametrizations) b = p(b);
  return b;
}

namespace weight_module_detail {
inline const char* slot_name(LeafSlot slot) { return slot == LeafSlot::weight ? "weight" : "bias"; }
}  // namespace weight_module_detail

MESHTORCH_DECL void WeightModule::materialize(const torch::TensorOptions& options) {
  for (const auto slot : {LeafSlot::weight, LeafSlot::bias}) {
    if (!tensor(slot).defined()) continue;
    auto fresh = torch::empty(tensor(slot).sizes(), options.requires_grad(false));
    fresh.set_requires_grad(tensor(slot).requires_grad());
    tensor(slot) = fresh;
    parameters_[weight_module_detail::slot_name(slot)] = fresh;
  }
}

MESHTORCH_DECL void WeightModule::replace(LeafSlot slot, const torch::Tensor& replacement) {
  auto& current = tensor(slot);
  TORCH_CHECK(current.defined(), "replace: the leaf has no ", weight_module_detail::slot_name(slot));
  TORCH_CHECK(replacement.sizes() == current.sizes(), "replace: shape ", replacement.sizes(), " differs from ",
              current.sizes());
  current = replacement;
  parameters_[weight_module_detail::slot_name(slot)] = current;
}

MESHTORCH_DECL void WeightModule::set(LeafSlot slot, const torch::Tensor& replacement) {
  auto& current = tensor(slot);
  TORCH_CHECK(current.defined(), "set: the leaf has no ", weight_module_detail::slot_name(slot));
  auto fresh = replacement.detach();
  fresh.set_requires_grad(current.requires_grad());
  current = fresh;
  parameters_[weight_module_detail::slot_name(slot)] = current;
}

MESHTORCH_DECL void WeightModule::replace_weight(const torch::Tensor& replacement) {
  replace(LeafSlot::weight, replacement);
}

MESHTORCH_DECL void WeightModule::set_weight(const torch::Tensor& replacement) { set(LeafSlot::weight, replacement); }

MESHTORCH_DECL void WeightModule::create_weight(torch::IntArrayRef sizes, const torch::TensorOptions& options) {
  weight = register_parameter("weight", torch::empty(sizes, options.requires_grad(false)));
}

MESHTORCH_DECL void WeightModule::create_bias(std::int64_t size, const torch::TensorOptions& options) {
  bias = register_parameter("bias", torch::empty({size}, options.requires_grad(false)));
}

MESHTORCH_DECL std::vector<LeafTensor> leaf_tensors(torch::nn::Module& root) {
  std::vector<LeafTensor> tensors;
  for (auto& [path, leaf] : weight_modules(root)) {
    const auto prefix = path.empty() ? path : path + ".";
    tensors.push_back({prefix + "weight", leaf, LeafSlot::weight});
    if (leaf->bias.defined()) tensors.push_back({prefix + "bias", leaf, LeafSlot::bias});
  }
  return tensors;
}

MESHTORCH_DECL std::vector<std::pair<std::string, WeightModule*>> weight_modules(torch::nn::Module& root) {
  std::vector<std::pair<std::string, WeightModule*>> leaves;
  for (auto& item : root.named_modules())
    if (auto* leaf = dynamic_cast<WeightModule*>(item.value().get())) leaves.emplace_back(item.key(), leaf);
  return leaves;
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
