#pragma once
// Activation checkpointing per decoder layer: a checkpointed layer keeps only its input during
// forward (its body runs without recording a graph) and runs the body again in backward, with
// the random-number state it had in forward, to get the activations it needs. Applied from
// outside, as torchtitan does: the layer's ForwardHooks get a `wrap` around its body, inside
// the hooks, so FSDP's gather (a pre-hook) is not repeated, while tensor parallel's collectives,
// which live in the body's modules, run again in the recomputation (every rank recomputes the
// same layers in the same order).
//
//   meshtorch::checkpoint_activations(model, {.every = 1});   // every decoder layer; 2: every other
#include <cstdint>
#include <functional>

#include <meshtorch/torch.hpp>

#include <meshtorch/models/llama/model.hpp>
#include <meshtorch/parallel/checkpoint_selection.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch {

namespace ac_detail {

using Body = std::function<torch::Tensor(const torch::Tensor&)>;

}  // namespace ac_detail

// Runs body(input) keeping only `input` for backward; the body runs again there.
MESHTORCH_DECL torch::Tensor checkpointed(const torch::Tensor& input, ac_detail::Body body);

// Checkpoints the decoder layers that `options` selects; returns how many.
MESHTORCH_DECL std::int64_t checkpoint_activations(llama::LlamaForCausalLM& model, ActivationCheckpointing options);

}  // namespace meshtorch

#if MESHTORCH_DEFINES(core)
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <meshtorch/error.hpp>

namespace meshtorch {

namespace ac_detail {

struct BodyCapsule : torch::CustomClassHolder {
  explicit BodyCapsule(Body b) : body(std::move(b)) {}
  Body body;
};

// The random-number state of the CPU generator and of the input's CUDA device, taken before the
// body runs in forward and put back for its recomputation, so that anything random in it (dropout)
// draws the same numbers.
struct RngState {
  torch::Tensor cpu, cuda;
  c10::Device device{torch::kCPU};

  static RngState take(const torch::Tensor& input) {
    RngState state;
    state.device = input.device();
    state.cpu = at::detail::getDefaultCPUGenerator().get_state();
    if (state.device.is_cuda()) state.cuda = at::globalContext().defaultGenerator(state.device).get_state();
    return state;
  }
  void put_back() const {
    auto cpu_generator = at::detail::getDefaultCPUGenerator();  // a handle: copies share the generator
    cpu_generator.set_state(cpu);
    if (cuda.defined()) {
      auto cuda_generator = at::globalContext().defaultGenerator(device);
      cuda_generator.set_state(cuda);
    }
  }
};

struct CheckpointedBody : torch::autograd::Function<CheckpointedBody> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& input, Body body) {
    auto rng = RngState::take(input);
    torch::Tensor output;
    {
      torch::NoGradGuard no_grad;
      output = body(input);
    }
    ctx->save_for_backward({input});
    ctx->saved_data["body"] = c10::IValue::make_capsule(c10::make_intrusive<BodyCapsule>(std::move(body)));
    ctx->saved_data["rng_cpu"] = rng.cpu;
    if (rng.cuda.defined()) ctx->saved_data["rng_cuda"] = rng.cuda;
    return output;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto input = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    const auto& body = static_cast<BodyCapsule*>(ctx->saved_data["body"].toCapsule().get())->body;
    // Recompute with forward's random numbers, then restore the generators' current state.
    const auto now = RngState::take(input);
    RngState then{ctx->saved_data["rng_cpu"].toTensor(),
                  ctx->saved_data.count("rng_cuda") ? ctx->saved_data["rng_cuda"].toTensor() : torch::Tensor(),
                  input.device()};
    then.put_back();
    torch::Tensor output;
    {
      torch::AutoGradMode enable(true);
      output = body(input);
    }
    now.put_back();
    // The weights' gradients accumulate where the recomputed graph leads (the parameters, or
    // FSDP's gather, whose backward reduce-scatters them); the input's comes back here.
    torch::autograd::backward({output}, {grads[0]});
    return {input.grad(), torch::Tensor()};
  }
};

}  // namespace ac_detail

MESHTORCH_DECL torch::Tensor checkpointed(const torch::Tensor& input, ac_detail::Body body) {
  if (!torch::GradMode::is_enabled() || !input.requires_grad()) return body(input);
  return ac_detail::CheckpointedBody::apply(input, std::move(body));
}

MESHTORCH_DECL std::int64_t checkpoint_activations(llama::LlamaForCausalLM& model, ActivationCheckpointing options) {
  if (options.every < 0) throw ConfigError(fmt::format("activation checkpointing every {} layers", options.every));
  if (options.every == 0) return 0;
  std::int64_t count = 0;
  auto& layers = model->model->decoder_layers;
  for (std::size_t i = 0; i < layers.size(); i += static_cast<std::size_t>(options.every)) {
    auto& hooks = layers[i]->hooks;
    if (hooks.wrap) throw ConfigError(fmt::format("decoder layer {} is already checkpointed", i));
    hooks.wrap = [](const torch::Tensor& input, ac_detail::Body body) { return checkpointed(input, std::move(body)); };
    ++count;
  }
  return count;
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(core)
