#pragma once
// What a training loop asks of an optimizer: the rate, a step, freeing the gradients, and the
// state a checkpoint saves and loads. AdamW and ZeroRedundancyOptimizer (parallel/zero.hpp) are
// both one.
//
// A small virtual base rather than a concept: chapter 2 and the engine choose between the two
// from a flag at run time, and one loop must call either through one type (a concept would leave
// them a std::variant and a visit around the whole loop). The calls are a few per optimizer step,
// beside a step that launches kernels over every parameter.
#include <string>

#include <meshtorch/io/safetensors.hpp>

namespace meshtorch::train {

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  virtual double lr() const = 0;
  virtual void set_lr(double lr) = 0;
  virtual void step() = 0;
  // Frees the gradients (set_to_none), so the next backward allocates them afresh; or zeroes
  // them in place, keeping their memory (the guide's zero_grad(set_to_none=False)).
  virtual void zero_grad(bool set_to_none = true) = 0;

  // "<param>.exp_avg", "<param>.exp_avg_sq", "<param>.step" for the parameters this rank steps.
  virtual io::NamedTensors state() const = 0;
  virtual void load_state(const io::SafetensorsFile& file, const std::string& source) = 0;

 protected:
  Optimizer() = default;
  Optimizer(const Optimizer&) = default;
  Optimizer(Optimizer&&) = default;
  Optimizer& operator=(const Optimizer&) = default;
  Optimizer& operator=(Optimizer&&) = default;
};

}  // namespace meshtorch::train
