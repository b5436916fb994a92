#pragma once
// Learning-rate schedules, as closed forms of the optimizer step k (0 for the first update), so
// that a resumed run needs only the step count:
//   cosine         the guide's CosineAnnealingLR(T_max=1000, eta_min=lr*0.01), stepped once per
//                  optimizer step (PyTorch's recursive form gives the same values);
//   warmup-cosine  DeepSpeed's WarmupCosineLR: lr * ratio, the ratio rising from
//                  warmup_min_ratio over warmup_steps (log or linear), then a cosine from 1 to
//                  cos_min_ratio at total_steps, where it stays (DeepSpeed's would rise again);
//   warmup-decay   DeepSpeed's WarmupDecayLR: from warmup_min_lr to lr over warmup_steps (log or
//                  linear), then linearly to 0 at total_steps;
//   constant       lr throughout.
// DeepSpeed's value at last_batch_iteration k is ours at step k.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <variant>

#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/train_args.hpp>

namespace meshtorch::train {

class CosineSchedule {
 public:
  CosineSchedule(double base_lr, std::int64_t t_max = 1000, double eta_min_fraction = 0.01)
      : base_lr_(base_lr), eta_min_(base_lr * eta_min_fraction), t_max_(t_max) {}

  double lr_at(std::int64_t step) const {
    return eta_min_ + (base_lr_ - eta_min_) *
                          (1 + std::cos(std::numbers::pi * static_cast<double>(step) / static_cast<double>(t_max_))) /
                          2;
  }

 private:
  double base_lr_, eta_min_;
  std::int64_t t_max_;
};

enum class WarmupType { log, linear };

MESHTORCH_DECL WarmupType parse_warmup_type(const std::string& name, const std::string& where);

// The fraction of the warmup done at step k < warmup_steps: log(k + 1) / log(warmup_steps), or
// k / warmup_steps.
inline double warmup_fraction(WarmupType type, std::int64_t step, std::int64_t warmup_steps) {
  if (type == WarmupType::log)
    return std::log(static_cast<double>(step + 1)) / std::log(static_cast<double>(warmup_steps));
  return static_cast<double>(step) / static_cast<double>(warmup_steps);
}

struct WarmupCosineSchedule {
  double base_lr;
  std::int64_t total_steps;
  std::int64_t warmup_steps = 1000;
  double warmup_min_ratio = 0;
  double cos_min_ratio = 1e-4;
  WarmupType warmup_type = WarmupType::log;

  double lr_at(std::int64_t step) const {
    if (step < warmup_steps)
      return base_lr * (warmup_min_ratio + warmup_fraction(warmup_type, step, warmup_steps) * (1 - warmup_min_ratio));
    const double progress =
        std::min(1.0, static_cast<double>(step - warmup_steps + 1) / static_cast<double>(total_steps - warmup_steps));
    const double cosine = (1 + std::cos(std::numbers::pi * progress)) / 2;
    return base_lr * std::max(0.0, cos_min_ratio + (1 - cos_min_ratio) * cosine);
  }
};

struct WarmupDecaySchedule {
  double base_lr;  // DeepSpeed's warmup_max_lr
  std::int64_t total_steps;
  std::int64_t warmup_steps = 1000;
  double warmup_min_lr = 0;
  WarmupType warmup_type = WarmupType::log;

  double lr_at(std::int64_t step) const {
    double gamma;
    if (step < warmup_steps)
      gamma = warmup_fraction(warmup_type, step, warmup_steps);
    else
      gamma = std::max(0.0, static_cast<double>(total_steps - step) /
                                std::max(1.0, static_cast<double>(total_steps - warmup_steps)));
    return warmup_min_lr + (base_lr - warmup_min_lr) * gamma;
  }
};

struct ConstantSchedule {
  double base_lr;
  double lr_at(std::int64_t) const { return base_lr; }
};

// One of the schedules above, checked: impossible settings are ConfigErrors naming `where` (the
// flag or JSON key path) instead of NaN or infinite rates.
class LrSchedule {
 public:
  using Variant = std::variant<CosineSchedule, WarmupCosineSchedule, WarmupDecaySchedule, ConstantSchedule>;

  MESHTORCH_DECL LrSchedule(Variant schedule, const std::string& where = "the learning-rate schedule");

  double lr_at(std::int64_t step) const {
    return std::visit([step](const auto& s) { return s.lr_at(step); }, schedule_);
  }

 private:
  Variant schedule_;
};

// The schedule the flags ask for (train/args.hpp), from `base_lr` (--lr, or chapter 2's scaled
// rate). The warmup schedules decay until --lr-decay-steps, else --max-steps, else the end of
// the last epoch.
MESHTORCH_DECL LrSchedule lr_schedule(const TrainArgs& args, std::int64_t steps_per_epoch, double base_lr);

inline LrSchedule lr_schedule(const TrainArgs& args, std::int64_t steps_per_epoch) {
  return lr_schedule(args, steps_per_epoch, args.lr);
}

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(core)
#include <limits>

#include <fmt/format.h>

namespace meshtorch::train {

MESHTORCH_DECL WarmupType parse_warmup_type(const std::string& name, const std::string& where) {
  if (name == "log") return WarmupType::log;
  if (name == "linear") return WarmupType::linear;
  throw ConfigError(fmt::format("{} '{}': use log or linear", where, name));
}

MESHTORCH_DECL LrSchedule::LrSchedule(Variant schedule, const std::string& where) : schedule_(std::move(schedule)) {
  auto check_warmup = [&](std::int64_t warmup_steps, WarmupType type, std::int64_t total_steps, bool needs_decay) {
    if (warmup_steps < 0) throw ConfigError(fmt::format("{}: warmup steps {} is negative", where, warmup_steps));
    if (type == WarmupType::log && warmup_steps == 1)
      throw ConfigError(fmt::format("{}: a log warmup needs at least 2 warmup steps (log(1) is 0); use linear", where));
    if (needs_decay && total_steps <= warmup_steps)
      throw ConfigError(
          fmt::format("{}: {} total steps leave nothing after {} warmup steps", where, total_steps, warmup_steps));
  };
  if (const auto* s = std::get_if<WarmupCosineSchedule>(&schedule_)) {
    check_warmup(s->warmup_steps, s->warmup_type, s->total_steps, /*needs_decay=*/true);
    if (s->cos_min_ratio < 0 || s->cos_min_ratio > 1 || s->warmup_min_ratio < 0 || s->warmup_min_ratio > 1)
      throw ConfigError(fmt::format("{}: cos_min_ratio and warmup_min_ratio must lie in [0, 1]", where));
  } else if (const auto* s = std::get_if<WarmupDecaySchedule>(&schedule_)) {
    check_warmup(s->warmup_steps, s->warmup_type, s->total_steps, /*needs_decay=*/false);
    if (s->total_steps <= 0) throw ConfigError(fmt::format("{}: total steps must be positive", where));
    if (s->warmup_min_lr < 0) throw ConfigError(fmt::format("{}: warmup_min_lr is negative", where));
  }
}

MESHTORCH_DECL LrSchedule lr_schedule(const TrainArgs& args, std::int64_t steps_per_epoch, double base_lr) {
  const std::string where = "--lr-schedule " + args.lr_schedule;
  const bool warmup = args.lr_schedule == "warmup-cosine" || args.lr_schedule == "warmup-decay";
  if (!warmup && (args.warmup_steps != 0 || args.lr_decay_steps != 0))
    throw ConfigError(
        fmt::format("--warmup-steps and --lr-decay-steps shape --lr-schedule warmup-cosine or "
                    "warmup-decay; {} has no warmup and no end",
                    where));
  // Every epoch's steps, saturated: --num-epochs 2^62 is a run that never ends, not a wrapped total.
  std::int64_t all_epochs = 0;
  if (__builtin_mul_overflow(steps_per_epoch, args.num_epochs, &all_epochs))
    all_epochs = std::numeric_limits<std::int64_t>::max();
  const std::int64_t total = args.lr_decay_steps > 0 ? args.lr_decay_steps
                             : args.max_steps > 0    ? args.max_steps
                                                     : all_epochs;
  const auto type = parse_warmup_type(args.warmup_type, "--warmup-type");
  if (args.lr_schedule == "cosine") return LrSchedule(CosineSchedule(base_lr), where);
  if (args.lr_schedule == "constant") return LrSchedule(ConstantSchedule{base_lr}, where);
  if (args.lr_schedule == "warmup-cosine")
    return LrSchedule(WarmupCosineSchedule{.base_lr = base_lr,
                                           .total_steps = total,
                                           .warmup_steps = args.warmup_steps,
                                           .warmup_min_ratio = 0,
                                           .cos_min_ratio = args.min_lr_ratio,
                                           .warmup_type = type},
                      where);
  if (args.lr_schedule == "warmup-decay")
    return LrSchedule(WarmupDecaySchedule{.base_lr = base_lr,
                                          .total_steps = total,
                                          .warmup_steps = args.warmup_steps,
                                          .warmup_min_lr = 0,
                                          .warmup_type = type},
                      where);
  throw ConfigError(
      fmt::format("--lr-schedule '{}': use cosine, warmup-cosine, warmup-decay or constant", args.lr_schedule));
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(core)
