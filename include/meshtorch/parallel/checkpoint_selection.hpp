#pragma once
// Which decoder layers activation checkpointing recomputes (parallel/activation_checkpointing.hpp
// does the recomputing): the --activation-checkpointing values. No LibTorch, so that
// meshtorch-plan's memory estimate reads the same flag the same way.
#include <cstdint>
#include <exception>
#include <string>

#include <fmt/format.h>

#include <meshtorch/error.hpp>
#include <meshtorch/train/train_args.hpp>

namespace meshtorch {

struct ActivationCheckpointing {
  // 0: none; 1: every decoder layer; k: layers 0, k, 2k, ... (torchtitan's selective layer AC).
  std::int64_t every = 0;
};

// "none", "full" or a positive k (every k-th layer): the --activation-checkpointing values.
inline ActivationCheckpointing parse_activation_checkpointing(const std::string& text) {
  if (text == "none") return {0};
  if (text == "full") return {1};
  std::size_t used = 0;
  long long every = 0;
  try {
    every = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || every < 1)
    throw ConfigError(
        fmt::format("--activation-checkpointing '{}': use none, full (every decoder layer) or a "
                    "positive k (every k-th layer)",
                    text));
  return {every};
}

// --activation-checkpointing, parsed.
inline ActivationCheckpointing activation_checkpointing(const train::TrainArgs& args) {
  return parse_activation_checkpointing(args.activation_checkpointing);
}

}  // namespace meshtorch
