#pragma once
// AdamW on ATen's fused multi-tensor kernel (_fused_adamw_, what torch.optim.AdamW(fused=True)
// calls), one kernel launch per device and dtype group. LibTorch's torch::optim::AdamW loops
// over parameters one op at a time. State is named after the parameters, so it can be saved
// to safetensors and loaded by name.
//
// With `offload` (DeepSpeed's offload_optimizer; ZeRO-Offload) the moments, the step counts and a
// copy of each parameter live in host memory and the fused kernel runs on the CPU there: a step
// copies the gradients to the host (non_blocking, into pinned buffers kept from step to step),
// waits for them, steps the host copies and copies them back to the parameters (non_blocking).
// The parameters themselves stay where they are, so forward and backward are unchanged; what
// the device no longer holds is the moments (two parameters' worth). Parameter offload is
// FSDP's cpu_offload, where the parameters are already host tensors and this is not needed.
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/optimizer.hpp>

namespace meshtorch::train {

struct AdamWOptions {
  double lr = 3e-4;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;  // torch.optim.AdamW's default, as the guide uses it
  // The state and the update in host memory (see above). On a CPU device it runs the same
  // copies between host tensors, costing a copy of the parameters and gradients and saving
  // nothing: it is there to check the path.
  bool offload = false;
};

MESHTORCH_DECL std::vector<std::pair<std::string, torch::Tensor>> named_trainable_parameters(torch::nn::Module& module);

// Frees the gradients of `parameters` (set_to_none) or zeroes them in place: the body of AdamW's
// and ZeRO-1's zero_grad.
MESHTORCH_DECL void zero_gradients(const std::vector<std::pair<std::string, torch::Tensor>>& parameters,
                                   bool set_to_none);

class AdamW : public Optimizer {
 public:
  MESHTORCH_DECL AdamW(std::vector<std::pair<std::string, torch::Tensor>> named_parameters, AdamWOptions options);

  double lr() const override { return options_.lr; }
  void set_lr(double lr) override { options_.lr = lr; }
  const std::vector<std::pair<std::string, torch::Tensor>>& parameters() const { return params_; }

  // Frees the gradients (set_to_none), so the next backward allocates them afresh; or zeroes
  // them in place, keeping their memory: with CPU offload they are host buffers worth keeping
  // (the guide's zero_grad(set_to_none=False)). Either way the next backward's gradients are
  // what .grad holds after it.
  MESHTORCH_DECL void zero_grad(bool set_to_none = true) override;

  MESHTORCH_DECL void step() override;

  // Steps only these parameters (of those given at construction; each must be one of them),
  // those with a gradient: what stepping in backward does for one FSDP unit at a time. Each
  // element's update is the one step() would make.
  MESHTORCH_DECL void step(const std::vector<torch::Tensor>& subset);

  // "<param>.exp_avg", "<param>.exp_avg_sq", "<param>.step" for every parameter (host tensors
  // with offload).
  MESHTORCH_DECL io::NamedTensors state() const override;

  MESHTORCH_DECL void load_state(const io::SafetensorsFile& file, const std::string& source) override;

 private:
  // These parameters (those with a gradient), on the device or through their host copies.
  MESHTORCH_DECL void step_indices(const std::vector<std::size_t>& indices);
  // One fused kernel per (device, dtype) group of params[i], grads[i] for i in `indices`.
  MESHTORCH_DECL void fused_step(const std::vector<std::size_t>& indices, const std::vector<torch::Tensor>& params,
                                 const std::vector<torch::Tensor>& grads);

  AdamWOptions options_;
  std::vector<std::pair<std::string, torch::Tensor>> params_;
  std::vector<torch::Tensor> exp_avg_, exp_avg_sq_, steps_;
  std::unordered_map<const c10::TensorImpl*, std::size_t> index_of_;  // for step(subset)
  // With offload: each parameter's host copy (what the kernel steps), its gradient's host buffer,
  // and the parameter's version when the two last agreed. Anything else writing the parameter
  // (loading a checkpoint, a gather into it) changes its version, and the next step first
  // copies it to the host again.
  std::vector<torch::Tensor> host_params_, host_grads_;
  std::vector<std::int64_t> host_param_versions_;
};

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(core)
#include <map>
#include <numeric>
#include <set>

#include <fmt/format.h>

#include <meshtorch/train/copy_in_flight.hpp>

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
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : params_) {
    if (options_.offload) {
      const auto host = host_options_for(p.device(), p.scalar_type());
      host_params_.push_back(torch::empty(p.sizes(), host));
      host_grads_.push_back(torch::Tensor());  // allocated at the first step with a gradient
      host_param_versions_.push_back(-1);      // copied from the parameter at its first step
      exp_avg_.push_back(torch::zeros(p.sizes(), host.pinned_memory(false)));
      exp_avg_sq_.push_back(torch::zeros(p.sizes(), host.pinned_memory(false)));
      steps_.push_back(torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat)));
    } else {
      exp_avg_.push_back(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      exp_avg_sq_.push_back(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      // The fused kernel wants the step as a float tensor on the parameter's device.
      steps_.push_back(torch::zeros({}, p.options().dtype(torch::kFloat)));
    }
    index_of_.emplace(p.unsafeGetTensorImpl(), index_of_.size());
  }
}

MESHTORCH_DECL void zero_gradients(const std::vector<std::pair<std::string, torch::Tensor>>& parameters,
                                   bool set_to_none) {
  torch::NoGradGuard no_grad;
  for (const auto& [name, p] : parameters) {
    if (set_to_none)
      p.mutable_grad() = torch::Tensor();
    else if (p.grad().defined())
      p.mutable_grad().zero_();
  }
}

MESHTORCH_DECL void AdamW::zero_grad(bool set_to_none) { zero_gradients(params_, set_to_none); }

MESHTORCH_DECL void AdamW::step() {
  std::vector<std::size_t> all(params_.size());
  std::iota(all.begin(), all.end(), std::size_t{0});
  step_indices(all);
}

MESHTORCH_DECL void AdamW::step(const std::vector<torch::Tensor>& subset) {
  std::vector<std::size_t> indices;
  for (const auto& p : subset) {
    const auto it = index_of_.find(p.unsafeGetTensorImpl());
    if (it == index_of_.end())
      throw ConfigError(
          fmt::format("AdamW::step: a tensor of shape {} is not one of the {} parameters this "
                      "optimizer was built with",
                      c10::str(p.sizes()), params_.size()));
    indices.push_back(it->second);
  }
  step_indices(indices);
}

MESHTORCH_DECL void AdamW::step_indices(const std::vector<std::size_t>& indices) {
  torch::NoGradGuard no_grad;
  std::vector<std::size_t> with_grad;
  for (const auto i : indices)
    if (params_[i].second.grad().defined()) with_grad.push_back(i);
  std::vector<torch::Tensor> params(params_.size()), grads(params_.size());
  if (!options_.offload) {
    for (const auto i : with_grad) {
      params[i] = params_[i].second;
      grads[i] = params_[i].second.grad();
    }
    fused_step(with_grad, params, grads);
    return;
  }
  std::set<std::string> devices;  // the devices whose streams run copies to the host
  for (const auto i : with_grad) {
    const auto& p = params_[i].second;
    if (p._version() != host_param_versions_[i]) host_params_[i].copy_(p);  // written since the last step
    const auto& grad = p.grad();
    if (!host_grads_[i].defined() || host_grads_[i].scalar_type() != grad.scalar_type())
      host_grads_[i] = torch::empty(p.sizes(), host_options_for(p.device(), grad.scalar_type()));
    host_grads_[i].copy_(grad, /*non_blocking=*/true);
    devices.insert(p.device().str());
    params[i] = host_params_[i];
    grads[i] = host_grads_[i];
  }
  for (const auto& device : devices) CopyInFlight::after_copies_on(torch::Device(device)).wait();
  fused_step(with_grad, params, grads);
  // Host memory is pinned for a GPU parameter, so these copies run on its stream; the host
  // copies are next written by the next step, after that step's wait for the stream.
  for (const auto i : with_grad) params_[i].second.copy_(host_params_[i], /*non_blocking=*/true);
  // After all of them: parameters that are views of one buffer (an FSDP unit's shards) share
  // one version counter, which each copy moves on.
  for (const auto i : with_grad) host_param_versions_[i] = params_[i].second._version();
}

MESHTORCH_DECL void AdamW::fused_step(const std::vector<std::size_t>& indices, const std::vector<torch::Tensor>& params,
                                      const std::vector<torch::Tensor>& grads) {
  // Group by (device, dtype): the fused kernel takes same-device, same-dtype lists.
  std::map<std::pair<std::string, int>, std::vector<std::size_t>> groups;
  for (const auto i : indices)
    groups[{params[i].device().str(), static_cast<int>(params[i].scalar_type())}].push_back(i);
  for (const auto& [key, members] : groups) {
    std::vector<torch::Tensor> p, g, m, v, s;
    for (auto i : members) {
      p.push_back(params[i]);
      g.push_back(grads[i]);
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
      throw DataError(fmt::format("{}: optimizer state '{}' has shape {}, the model needs {}", source, name,
                                  c10::str(t->sizes()), c10::str(into.sizes())));
    into.copy_(*t);
  };
  for (std::size_t i = 0; i < params_.size(); ++i) {
    load(params_[i].first + ".exp_avg", exp_avg_[i]);
    load(params_[i].first + ".exp_avg_sq", exp_avg_sq_[i]);
    load(params_[i].first + ".step", steps_[i]);
  }
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(core)
