#pragma once
// The guide's schedule: CosineAnnealingLR(T_max=1000, eta_min=lr*0.01), stepped once per
// optimizer step. The closed form equals PyTorch's recursive one, and a resumed run needs only
// the step count.
#include <cmath>
#include <cstdint>
#include <numbers>

namespace meshtorch::train {

class CosineSchedule {
 public:
  CosineSchedule(double base_lr, std::int64_t t_max = 1000, double eta_min_fraction = 0.01)
      : base_lr_(base_lr), eta_min_(base_lr * eta_min_fraction), t_max_(t_max) {}

  double lr_at(std::int64_t step) const {
    return eta_min_ + (base_lr_ - eta_min_) * (1 + std::cos(std::numbers::pi * static_cast<double>(step) /
                                                            static_cast<double>(t_max_))) / 2;
  }

 private:
  double base_lr_, eta_min_;
  std::int64_t t_max_;
};

}  // namespace meshtorch::train
