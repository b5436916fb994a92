#pragma once
// AdamW on ATen's fused multi-tensor kernel (_fused_adamw_, what torch.optim.AdamW(fused=True)
// calls), one kernel launch per device and dtype group. LibTorch's torch::optim::AdamW loops
// over parameters one op at a time. State is named after the parameters, so it can be saved
// to safetensors and loaded by name.
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <meshtorch/error.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::train {

struct AdamWOptions {
  double lr = 3e-4;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;  // torch.optim.AdamW's default, as the guide uses it
};

MESHTORCH_DECL std::vector<std::pair<std::string, torch::Tensor>> named_trainable_parameters(torch::nn::Module& module);

class AdamW {
 public:
  MESHTORCH_DECL AdamW(std::vector<std::pair<std::string, torch::Tensor>> named_parameters, AdamWOptions options);

  double lr() const { return options_.lr; }
  void set_lr(double lr) { options_.lr = lr; }
  const std::vector<std::pair<std::string, torch::Tensor>>& parameters() const { return params_; }

  // Frees the gradients (set_to_none), so the next backward allocates them afresh; or zeroes
  // them in place, keeping their memory: with CPU offload they are host buffers worth keeping
  // (the guide's zero_grad(set_to_none=False)). Either way the next backward's gradients are
  // what .grad holds after it.
  MESHTORCH_DECL void zero_grad(bool set_to_none = true);

  MESHTORCH_DECL void step();

  // Steps only these parameters (of those given at construction; each must be one of them),
  // those with a gradient: what stepping in backward does for one FSDP unit at a time. Each
  // element's update is the one step() would make.
  MESHTORCH_DECL void step(const std::vector<torch::Tensor>& subset);

  // "<param>.exp_avg", "<param>.exp_avg_sq", "<param>.step" for every parameter.
  MESHTORCH_DECL io::NamedTensors state() const;

  MESHTORCH_DECL void load_state(const io::SafetensorsFile& file, const std::string& source);

 private:
  // One fused kernel per (device, dtype) group of these parameters (those with a gradient).
  MESHTORCH_DECL void step_indices(const std::vector<std::size_t>& indices);

  AdamWOptions options_;
  std::vector<std::pair<std::string, torch::Tensor>> params_;
  std::vector<torch::Tensor> exp_avg_, exp_avg_sq_, steps_;
  std::unordered_map<const c10::TensorImpl*, std::size_t> index_of_;  // for step(subset)
};

}  // namespace meshtorch::train

#if MESHTORCH_DEFINITIONS
#include <map>

#include <fmt/format.h>

namespace meshtorch::train {

MESHTORCH_DECL std::vector<std::pair<std::string, torch::Tensor>> named_trainable_parameters(
    torch::nn::Module& module) {
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& item : module.named_parameters())
    if (item.value().requires_grad()) named.emplace_back(item.key(), item.value());
  return named;
}

MESHTORCH_DECL AdamW::AdamW(std::vector<std::pair<std::string, torch::Tensor>> named_parameters, AdamWOptions options)
    : options_(options), params_(std::move(named_parameters)) {
  for (auto& [name, p] : params_) {
    exp_avg_.push_back(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    exp_avg_sq_.push_back(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    // The fused kernel wants the step as a float tensor on the parameter's device.
    steps_.push_back(torch::zeros({}, p.options().dtype(torch::kFloat)));
    index_of_.emplace(p.unsafeGetTensorImpl(), index_of_.size());
  }
}

MESHTORCH_DECL void AdamW::zero_grad(bool set_to_none) {
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : params_) {
    if (set_to_none)
      p.mutable_grad() = torch::Tensor();
    else if (p.grad().defined())
      p.mutable_grad().zero_();
  }
}

MESHTORCH_DECL void AdamW::step() {
  std::vector<std::size_t> all(params_.size());
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
  step_indices(all);
}

MESHTORCH_DECL void AdamW::step(const std::vector<torch::Tensor>& subset) {
  std::vector<std::size_t> indices;
  for (const auto& p : subset) {
    const auto it = index_of_.find(p.unsafeGetTensorImpl());
    if (it == index_of_.end())
      throw ConfigError(fmt::format("AdamW::step: a tensor of shape {} is not one of the {} parameters this "
                                    "optimizer was built with",
                                    c10::str(p.sizes()), params_.size()));
    indices.push_back(it->second);
  }
  step_indices(indices);
}

MESHTORCH_DECL void AdamW::step_indices(const std::vector<std::size_t>& indices) {
  torch::NoGradGuard no_grad;
  // Group by (device, dtype): the fused kernel takes same-device, same-dtype lists.
  std::map<std::pair<std::string, int>, std::vector<std::size_t>> groups;
  for (const auto i : indices) {
    const auto& p = params_[i].second;
    if (!p.grad().defined()) continue;
    groups[{p.device().str(), static_cast<int>(p.scalar_type())}].push_back(i);
  }
  for (const auto& [key, members] : groups) {
    std::vector<torch::Tensor> p, g, m, v, s;
    for (auto i : members) {
      p.push_back(params_[i].second);
      g.push_back(params_[i].second.grad());
      m.push_back(exp_avg_[i]);
      v.push_back(exp_avg_sq_[i]);
      s.push_back(steps_[i]);
    }
    at::_foreach_add_(s, 1);
    at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, s, options_.lr, options_.beta1, options_.beta2,
                      options_.weight_decay, options_.eps, /*amsgrad=*/false, /*maximize=*/false);
  }
}

MESHTORCH_DECL io::NamedTensors AdamW::state() const {
  io::NamedTensors out;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back(params_[i].first + ".exp_avg", exp_avg_[i]);
    out.emplace_back(params_[i].first + ".exp_avg_sq", exp_avg_sq_[i]);
    out.emplace_back(params_[i].first + ".step", steps_[i]);
  }
  return out;
}

MESHTORCH_DECL void AdamW::load_state(const io::SafetensorsFile& file, const std::string& source) {
  torch::NoGradGuard no_grad;
  auto load = [&](const std::string& name, torch::Tensor& into) {
    const auto* t = file.find(name);
    if (!t) throw DataError(fmt::format("{}: optimizer state '{}' is missing", source, name));
    if (t->sizes() != into.sizes())
      throw DataError(fmt::format("{}: optimizer state '{}' has shape {}, the model needs {}",
                                  source, name, c10::str(t->sizes()), c10::str(into.sizes())));
    into.copy_(*t);
  };
  for (std::size_t i = 0; i < params_.size(); ++i) {
    load(params_[i].first + ".exp_avg", exp_avg_[i]);
    load(params_[i].first + ".exp_avg_sq", exp_avg_sq_[i]);
    load(params_[i].first + ".step", steps_[i]);
  }
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINITIONS
