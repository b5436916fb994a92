#pragma once
// A DeepSpeed JSON config (the guide's ds_config.json), read into what meshtorch::Engine
// (parallel/engine.hpp) builds from it. Every key is checked: a wrong type, an impossible value
// or combination is a ConfigError naming the file and the key path
// ("ds_config.json: zero_optimization.stage: expected an integer 0-3, got \"two\""), and a key
// meshtorch does not implement is refused, not ignored (docs/deepspeed.md lists the keys).
//
//   key                                      here
//   train_micro_batch_size_per_gpu           -b: sequences per rank and micro-batch
//   gradient_accumulation_steps              --grad-accum
//   train_batch_size                         micro x accumulation x data-parallel ranks (checked)
//   bf16.enabled / fp16.enabled              compute in bf16 / refused when true (no loss scaling)
//   optimizer {type AdamW|Adam, params}      train::AdamW (lr, betas, eps, weight_decay)
//   scheduler {WarmupCosineLR|WarmupDecayLR} train/lr_schedule.hpp
//   zero_optimization.stage 0-3              DDP, + ZeroRedundancyOptimizer, ZeroStage2, FSDP
//   zero_optimization.offload_param.device   cpu with stage 3 and offload_optimizer (FSDP's cpu_offload)
//   zero_optimization.offload_optimizer      cpu alone with stages 1-3: AdamW's state and step on the host
//                                            (train::AdamWOptions::offload; ZeRO-Offload)
//   zero_optimization.overlap_comm, contiguous_gradients, reduce_bucket_size
//   gradient_clipping                        clip by the global norm over the mesh
//   steps_per_print                          the metrics line's period (--log-freq wins)
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/adamw.hpp>
#include <meshtorch/train/lr_schedule.hpp>

namespace meshtorch::train {

struct DeepSpeedConfig {
  std::string file = "ds_config.json";  // how messages name it

  // Batch: any two of the three give the third; all three must agree.
  std::optional<std::int64_t> train_batch_size;
  std::optional<std::int64_t> micro_batch_per_gpu;
  std::optional<std::int64_t> gradient_accumulation_steps;

  bool bf16 = false;
  AdamWOptions optimizer{.lr = 1e-3};  // DeepSpeed's AdamW default lr
  // The scheduler as read, built into an LrSchedule once the optimizer's lr is known.
  std::string scheduler_type;  // empty: a constant rate
  WarmupCosineSchedule warmup_cosine{.base_lr = 0, .total_steps = 0};
  WarmupDecaySchedule warmup_decay{.base_lr = 0, .total_steps = 0};

  int zero_stage = 0;
  bool offload_optimizer = false;  // zero_optimization.offload_optimizer.device == "cpu"
  bool offload_param = false;      // zero_optimization.offload_param.device == "cpu"
  bool overlap_comm = true;
  std::optional<std::int64_t> reduce_bucket_size;  // elements, as DeepSpeed counts them
  double gradient_clipping = 0;
  std::int64_t steps_per_print = 10;

  // The whole file, canonical: what every rank must have read alike.
  std::string canonical;

  MESHTORCH_DECL static DeepSpeedConfig read(const std::filesystem::path& path);

  MESHTORCH_DECL static DeepSpeedConfig parse(const nlohmann::json& json, const std::string& file);

  // Fills in the batch sizes for `data_parallel` ranks (DeepSpeed's rules: any two give the
  // third, a missing accumulation is 1), refusing sizes that disagree.
  MESHTORCH_DECL void resolve_batch(std::int64_t data_parallel);

  // The learning rate at each optimizer step: the scheduler's, from optimizer.params.lr.
  MESHTORCH_DECL LrSchedule schedule() const;
};

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(programs)
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <set>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/io/json_file.hpp>

namespace meshtorch::train {

namespace deepspeed_detail {

inline std::string type_of(const nlohmann::json& value) {
  if (value.is_string()) return "a string";
  if (value.is_boolean()) return "a boolean";
  if (value.is_number()) return "a number";
  if (value.is_object()) return "an object";
  if (value.is_array()) return "an array";
  return "null";
}

// JSON's own escapes (\u0000, \n, \") and U+FFFD for bytes that are not UTF-8: a message keeps
// what follows a NUL, and printing a key or value never throws.
inline std::string escaped(const nlohmann::json& value) {
  return value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

inline std::string quoted(const nlohmann::json& value) {
  const auto text = escaped(value);
  return text.size() > 60 ? text.substr(0, 57) + "..." : text;
}

// A key as messages print it: as written, or JSON-escaped (without quotes) if it holds a control
// character, a quote or a backslash.
inline std::string printable_key(const std::string& key) {
  const bool plain = std::ranges::none_of(
      key, [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f || c == '"' || c == '\\'; });
  if (plain) return key;
  const auto text = escaped(nlohmann::json(key));
  return text.substr(1, text.size() - 2);
}

// One JSON object of the config: typed reads by key, each error naming "<file>: <path>.<key>",
// and at the end a refusal of every key that was not read.
class ConfigObject {
 public:
  ConfigObject(const nlohmann::json& value, std::string path, std::string file)
      : value_(value), path_(std::move(path)), file_(std::move(file)) {
    if (!value_.is_object())
      throw ConfigError(
          fmt::format("{}: {}: expected an object, got {} ({})", file_, where(), type_of(value_), quoted(value_)));
  }

  std::string key_path(const std::string& key) const {
    return path_.empty() ? printable_key(key) : path_ + "." + printable_key(key);
  }
  bool has(const std::string& key) const { return value_.contains(key); }

  std::optional<std::int64_t> integer(const std::string& key, std::int64_t least, std::int64_t most) {
    const auto* value = take(key);
    if (!value) return std::nullopt;
    // DeepSpeed configs write sizes like 5e8: a whole number is an integer whatever its spelling.
    const bool whole = value->is_number_integer() || (value->is_number_float() && std::isfinite(value->get<double>()) &&
                                                      std::floor(value->get<double>()) == value->get<double>() &&
                                                      std::abs(value->get<double>()) < 9e15);
    if (!whole || value->is_boolean())
      throw ConfigError(fmt::format("{}: {}: expected an integer {}, got {} ({})", file_, key_path(key),
                                    range(least, most), quoted(*value), type_of(*value)));
    // Above 2^63 - 1 (nlohmann keeps it unsigned): print it as written, not wrapped to negative.
    if (value->is_number_unsigned() && value->get<std::uint64_t>() > static_cast<std::uint64_t>(most))
      throw ConfigError(fmt::format("{}: {}: {} is out of range; expected an integer {}", file_, key_path(key),
                                    value->get<std::uint64_t>(), range(least, most)));
    const auto n =
        value->is_number_integer() ? value->get<std::int64_t>() : static_cast<std::int64_t>(value->get<double>());
    if (n < least || n > most)
      throw ConfigError(fmt::format("{}: {}: {} is out of range; expected an integer {}", file_, key_path(key), n,
                                    range(least, most)));
    return n;
  }

  std::optional<double> number(const std::string& key, double least, double most) {
    const auto* value = take(key);
    if (!value) return std::nullopt;
    if (!value->is_number() || value->is_boolean())
      throw ConfigError(
          fmt::format("{}: {}: expected a number, got {} ({})", file_, key_path(key), quoted(*value), type_of(*value)));
    const auto x = value->get<double>();
    if (!(x >= least && x <= most))
      throw ConfigError(fmt::format("{}: {}: {} is out of range; expected a number in [{}, {}]", file_, key_path(key),
                                    x, least, most));
    return x;
  }

  std::optional<bool> boolean(const std::string& key) {
    const auto* value = take(key);
    if (!value) return std::nullopt;
    if (!value->is_boolean())
      throw ConfigError(fmt::format("{}: {}: expected true or false, got {} ({})", file_, key_path(key), quoted(*value),
                                    type_of(*value)));
    return value->get<bool>();
  }

  std::optional<std::string> choice(const std::string& key, const std::vector<std::string>& allowed) {
    const auto* value = take(key);
    if (!value) return std::nullopt;
    if (!value->is_string() || std::find(allowed.begin(), allowed.end(), value->get<std::string>()) == allowed.end())
      throw ConfigError(fmt::format("{}: {}: expected one of {}, got {}", file_, key_path(key),
                                    fmt::join(allowed, ", "), quoted(*value)));
    return value->get<std::string>();
  }

  std::optional<std::pair<double, double>> pair_of_numbers(const std::string& key, double least, double most) {
    const auto* value = take(key);
    if (!value) return std::nullopt;
    const bool ok = value->is_array() && value->size() == 2 && (*value)[0].is_number() && (*value)[1].is_number() &&
                    !(*value)[0].is_boolean() && !(*value)[1].is_boolean();
    if (!ok)
      throw ConfigError(
          fmt::format("{}: {}: expected two numbers [a, b], got {}", file_, key_path(key), quoted(*value)));
    const std::pair<double, double> p{(*value)[0].get<double>(), (*value)[1].get<double>()};
    for (const double x : {p.first, p.second})
      if (!(x >= least && x < most))
        throw ConfigError(fmt::format("{}: {}: {} is out of range; expected numbers in [{}, {})", file_, key_path(key),
                                      x, least, most));
    return p;
  }

  std::optional<ConfigObject> object(const std::string& key) {
    const auto* value = take(key);
    if (!value) return std::nullopt;
    return ConfigObject(*value, key_path(key), file_);
  }

  // Every key of this object that no read asked for is an error: nothing is silently ignored.
  void refuse_unread(const std::string& supported_note = "") const {
    for (const auto& [key, value] : value_.items())
      if (!read_.contains(key))
        throw ConfigError(fmt::format("{}: {}: not a key meshtorch implements; the keys read here are: {}{}{}", file_,
                                      key_path(key),
                                      read_.empty() ? std::string("none") : fmt::format("{}", fmt::join(read_, ", ")),
                                      supported_note.empty() ? "" : "; ", supported_note));
  }

  const std::string& file() const { return file_; }
  std::string where() const { return path_.empty() ? std::string("the top level") : path_; }

 private:
  const nlohmann::json* take(const std::string& key) {
    read_.insert(key);
    const auto it = value_.find(key);
    if (it == value_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  static std::string range(std::int64_t least, std::int64_t most) {
    if (most == std::numeric_limits<std::int64_t>::max()) return fmt::format(">= {}", least);
    return fmt::format("{}-{}", least, most);
  }

  const nlohmann::json& value_;
  std::string path_;
  std::string file_;
  std::set<std::string> read_;
};

}  // namespace deepspeed_detail

MESHTORCH_DECL DeepSpeedConfig DeepSpeedConfig::read(const std::filesystem::path& path) {
  return parse(io::read_json_file<ConfigError>(path, "the config"), path.filename().string());
}

MESHTORCH_DECL DeepSpeedConfig DeepSpeedConfig::parse(const nlohmann::json& json, const std::string& file) {
  using deepspeed_detail::ConfigObject;
  DeepSpeedConfig c;
  c.file = file;
  c.canonical = deepspeed_detail::escaped(json);
  ConfigObject top(json, "", file);
  constexpr auto any = std::numeric_limits<std::int64_t>::max();
  c.train_batch_size = top.integer("train_batch_size", 1, any);
  c.micro_batch_per_gpu = top.integer("train_micro_batch_size_per_gpu", 1, any);
  c.gradient_accumulation_steps = top.integer("gradient_accumulation_steps", 1, any);
  if (!c.train_batch_size && !c.micro_batch_per_gpu)
    throw ConfigError(fmt::format("{}: train_micro_batch_size_per_gpu (or train_batch_size) is required", file));

  if (auto bf16 = top.object("bf16")) {
    c.bf16 = bf16->boolean("enabled").value_or(false);
    bf16->refuse_unread();
  }
  if (auto fp16 = top.object("fp16")) {
    if (fp16->boolean("enabled").value_or(false))
      throw ConfigError(
          fmt::format("{}: fp16.enabled: fp16 with loss scaling is not implemented; use "
                      "\"bf16\": {{\"enabled\": true}}",
                      file));
    fp16->refuse_unread();
  }

  if (auto optimizer = top.object("optimizer")) {
    optimizer->choice("type", {"AdamW", "Adam"});
    if (auto params = optimizer->object("params")) {
      c.optimizer.lr = params->number("lr", 0, 10).value_or(c.optimizer.lr);
      if (auto betas = params->pair_of_numbers("betas", 0, 1)) {
        c.optimizer.beta1 = betas->first;
        c.optimizer.beta2 = betas->second;
      }
      c.optimizer.eps = params->number("eps", 0, 1).value_or(c.optimizer.eps);
      c.optimizer.weight_decay = params->number("weight_decay", 0, 10).value_or(c.optimizer.weight_decay);
      // DeepSpeed's Adam has decoupled decay by default (adam_w_mode): AdamW either way.
      if (auto decoupled = params->boolean("adam_w_mode"); decoupled && !*decoupled)
        throw ConfigError(
            fmt::format("{}: optimizer.params.adam_w_mode: false (L2 regularisation instead of "
                        "decoupled weight decay) is not implemented",
                        file));
      params->refuse_unread();
    }
    optimizer->refuse_unread();
  }

  if (auto scheduler = top.object("scheduler")) {
    const auto type = scheduler->choice("type", {"WarmupCosineLR", "WarmupDecayLR"});
    if (!type) throw ConfigError(fmt::format("{}: scheduler.type is required", file));
    c.scheduler_type = *type;
    auto params = scheduler->object("params");
    if (!params) throw ConfigError(fmt::format("{}: scheduler.params is required for {}", file, *type));
    const auto warmup_type = params->choice("warmup_type", {"log", "linear"}).value_or("log");
    const auto warmup_steps = params->integer("warmup_num_steps", 0, any).value_or(1000);
    if (*type == "WarmupCosineLR") {
      const auto total = params->integer("total_num_steps", 1, any);
      if (!total)
        throw ConfigError(fmt::format("{}: scheduler.params.total_num_steps is required for WarmupCosineLR", file));
      c.warmup_cosine = {.base_lr = 0,
                         .total_steps = *total,
                         .warmup_steps = warmup_steps,
                         .warmup_min_ratio = params->number("warmup_min_ratio", 0, 1).value_or(0),
                         .cos_min_ratio = params->number("cos_min_ratio", 0, 1).value_or(1e-4),
                         .warmup_type = parse_warmup_type(warmup_type, file + ": scheduler.params.warmup_type")};
    } else {
      const auto total = params->integer("total_num_steps", 1, any);
      if (!total)
        throw ConfigError(fmt::format("{}: scheduler.params.total_num_steps is required for WarmupDecayLR", file));
      // As DeepSpeed: the schedule's own peak (default 0.001) replaces the optimizer's lr.
      c.warmup_decay = {.base_lr = params->number("warmup_max_lr", 0, 10).value_or(1e-3),
                        .total_steps = *total,
                        .warmup_steps = warmup_steps,
                        .warmup_min_lr = params->number("warmup_min_lr", 0, 10).value_or(0),
                        .warmup_type = parse_warmup_type(warmup_type, file + ": scheduler.params.warmup_type")};
    }
    params->refuse_unread();
    scheduler->refuse_unread();
  }

  if (auto zero = top.object("zero_optimization")) {
    c.zero_stage = static_cast<int>(zero->integer("stage", 0, 3).value_or(0));
    auto offload = [&](const char* key) {
      auto o = zero->object(key);
      if (!o) return false;
      const auto device = o->choice("device", {"none", "cpu", "nvme"}).value_or("none");
      if (device == "nvme")
        throw ConfigError(
            fmt::format("{}: zero_optimization.{}.device: nvme offload is not implemented; use cpu", file, key));
      if (auto pin = o->boolean("pin_memory"); pin && !*pin)
        throw ConfigError(
            fmt::format("{}: zero_optimization.{}.pin_memory: false is not implemented; offloaded "
                        "shards are pinned on CUDA (and on the CPU there is nothing to pin)",
                        file, key));
      o->refuse_unread();
      return device == "cpu";
    };
    c.offload_optimizer = offload("offload_optimizer");
    c.offload_param = offload("offload_param");
    const auto overlap = zero->boolean("overlap_comm");
    c.overlap_comm = overlap.value_or(c.zero_stage == 2);
    if (overlap && c.zero_stage != 2)
      throw ConfigError(fmt::format(
          "{}: zero_optimization.overlap_comm applies to stage 2 here: stages 0 and 1 always overlap the gradient "
          "all-reduce with backward (DDP's buckets) and stage 3 runs its collectives in order; remove the key",
          file));
    if (auto contiguous = zero->boolean("contiguous_gradients"); contiguous && !*contiguous)
      throw ConfigError(
          fmt::format("{}: zero_optimization.contiguous_gradients: false is not implemented; "
                      "gradients always go into contiguous buckets",
                      file));
    c.reduce_bucket_size = zero->integer("reduce_bucket_size", 1, any);
    if (c.reduce_bucket_size && c.zero_stage == 3)
      throw ConfigError(
          fmt::format("{}: zero_optimization.reduce_bucket_size: stage 3 reduce-scatters one decoder "
                      "layer at a time; the key sizes buckets of stages 0-2",
                      file));
    if (auto scatter = zero->boolean("reduce_scatter"); scatter && !*scatter)
      throw ConfigError(
          fmt::format("{}: zero_optimization.reduce_scatter: false (reduce to each owner) is not "
                      "implemented; stage 2 reduce-scatters",
                      file));
    zero->refuse_unread();
    if (c.offload_param && c.zero_stage != 3)
      throw ConfigError(
          fmt::format("{}: zero_optimization.offload_param: parameters are offloaded with stage 3 "
                      "only (they are sharded there); stage is {}",
                      file, c.zero_stage));
    if (c.offload_optimizer && c.zero_stage == 0)
      throw ConfigError(
          fmt::format("{}: zero_optimization.offload_optimizer: optimizer offload needs ZeRO stage 1, "
                      "2 or 3, as in DeepSpeed; stage is 0",
                      file));
    if (c.offload_param && !c.offload_optimizer)
      throw ConfigError(
          fmt::format("{}: zero_optimization.offload_optimizer: offload_param without it is not "
                      "implemented (FSDP's cpu_offload steps AdamW where the shards are, on the "
                      "CPU); set offload_optimizer.device to cpu too",
                      file));
    // With the shards offloaded AdamW already steps on the host; alone, AdamW moves there.
    c.optimizer.offload = c.offload_optimizer && !c.offload_param;
  }

  c.gradient_clipping = top.number("gradient_clipping", 0, std::numeric_limits<double>::max()).value_or(0);
  c.steps_per_print = top.integer("steps_per_print", 1, any).value_or(10);
  top.refuse_unread("see docs/deepspeed.md for the keys meshtorch implements");
  return c;
}

MESHTORCH_DECL void DeepSpeedConfig::resolve_batch(std::int64_t data_parallel) {
  // Each field may be up to 2^63 - 1 on its own: a product that wrapped (to 0 for 4 x 2^62) would
  // be divided by below and by the sampler, so one that overflows is refused naming its factors.
  auto product = [&](std::initializer_list<std::int64_t> factors, const char* names) {
    std::int64_t out = 1;
    for (const auto factor : factors)
      if (__builtin_mul_overflow(out, factor, &out))
        throw ConfigError(
            fmt::format("{}: {} = {} overflows a 64-bit integer (at most {}); no data set holds that "
                        "many samples",
                        file, names, fmt::join(factors, " x "), std::numeric_limits<std::int64_t>::max()));
    return out;
  };
  if (micro_batch_per_gpu && gradient_accumulation_steps) {
    const auto total = product({*micro_batch_per_gpu, *gradient_accumulation_steps, data_parallel},
                               "train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel ranks");
    if (train_batch_size && *train_batch_size != total)
      throw ConfigError(fmt::format(
          "{}: train_batch_size {} is not train_micro_batch_size_per_gpu {} x "
          "gradient_accumulation_steps {} x {} data-parallel ranks = {}",
          file, *train_batch_size, *micro_batch_per_gpu, *gradient_accumulation_steps, data_parallel, total));
    train_batch_size = total;
  } else if (micro_batch_per_gpu && train_batch_size) {
    const auto per_step =
        product({*micro_batch_per_gpu, data_parallel}, "train_micro_batch_size_per_gpu x data-parallel ranks");
    if (*train_batch_size % per_step != 0)
      throw ConfigError(
          fmt::format("{}: train_batch_size {} is not a multiple of train_micro_batch_size_per_gpu {} "
                      "x {} data-parallel ranks = {}",
                      file, *train_batch_size, *micro_batch_per_gpu, data_parallel, per_step));
    gradient_accumulation_steps = *train_batch_size / per_step;
  } else if (micro_batch_per_gpu) {
    gradient_accumulation_steps = 1;
    train_batch_size =
        product({*micro_batch_per_gpu, data_parallel}, "train_micro_batch_size_per_gpu x data-parallel ranks");
  } else {
    const auto accumulation = gradient_accumulation_steps.value_or(1);
    const auto per_micro_batch =
        product({accumulation, data_parallel}, "gradient_accumulation_steps x data-parallel ranks");
    if (*train_batch_size % per_micro_batch != 0)
      throw ConfigError(
          fmt::format("{}: train_batch_size {} is not a multiple of gradient_accumulation_steps {} x "
                      "{} data-parallel ranks",
                      file, *train_batch_size, accumulation, data_parallel));
    gradient_accumulation_steps = accumulation;
    micro_batch_per_gpu = *train_batch_size / per_micro_batch;
  }
}

MESHTORCH_DECL LrSchedule DeepSpeedConfig::schedule() const {
  const std::string where = file + ": scheduler.params";
  if (scheduler_type == "WarmupCosineLR") {
    auto s = warmup_cosine;
    s.base_lr = optimizer.lr;
    return LrSchedule(s, where);
  }
  if (scheduler_type == "WarmupDecayLR") return LrSchedule(warmup_decay, where);
  return LrSchedule(ConstantSchedule{optimizer.lr}, file);
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(programs)
