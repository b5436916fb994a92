#pragma once
// Text generation with a KV cache: prompts of different lengths decoded together, greedy or
// sampled, as transformers' `generate` does it.
//
//   llama::GenerateOptions options{.max_new_tokens = 48};     // temperature 0: greedy
//   auto new_ids = llama::generate(lm, {{1, 15043, 29892}, {1, 306}}, options);
//
// The prompts are taken as given (no <bos> is added). The batch is left-padded to its longest
// prompt: each row's positions count its own tokens only (a padded row's first token is at
// position 0), and no query attends a padding position, so a row's tokens are the ones it gets
// alone, up to rounding. The cache holds the longest prompt plus max_new_tokens positions
// (KvCache::bytes). A row ends at the first of `eos_ids` it produces, which its output includes.
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include <meshtorch/torch.hpp>

#include <meshtorch/kernels/few_rows_linear.hpp>
#include <meshtorch/models/llama/kv_cache.hpp>
#include <meshtorch/models/llama/model.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::llama {

struct GenerateOptions {
  std::int64_t max_new_tokens = 128;
  double temperature = 0.0;           // 0: greedy (the most likely token); else the logits are divided by it
  std::int64_t top_k = 0;             // sample among the k most likely tokens; 0: all
  double top_p = 1.0;                 // ... among the fewest whose probabilities reach p; 1: all
  std::uint64_t seed = 0;             // the sampling generator's seed: the same seed, the same tokens
  std::vector<std::int64_t> eos_ids;  // a row stops at the first of these it produces
};

// Called with (row, token) as each new token is chosen (for streaming); returning true ends that
// row there (a stop string its text now holds). It runs in generate's inference mode: a tensor it
// makes is an inference tensor.
using TokenCallback = std::function<bool(std::size_t row, std::int64_t token)>;

// The new tokens of each prompt. Runs without gradients, on the model's device and dtype.
MESHTORCH_DECL std::vector<std::vector<std::int64_t>> generate(LlamaForCausalLM& lm,
                                                               const std::vector<std::vector<std::int64_t>>& prompts,
                                                               const GenerateOptions& options,
                                                               const TokenCallback& on_token = {});

// The next token of each row from its last logits [B, vocab] (fp32): argmax at temperature 0,
// else a draw after temperature, top-k and top-p, in transformers' order.
MESHTORCH_DECL torch::Tensor choose_next_tokens(torch::Tensor logits, const GenerateOptions& options,
                                                at::Generator& generator);

}  // namespace meshtorch::llama

#if MESHTORCH_DEFINES(core)
#include <algorithm>
#include <limits>

#include <fmt/format.h>

#include <meshtorch/error.hpp>
#include <meshtorch/io/host_memory.hpp>

namespace meshtorch::llama {

MESHTORCH_DECL torch::Tensor choose_next_tokens(torch::Tensor logits, const GenerateOptions& options,
                                                at::Generator& generator) {
  if (options.temperature == 0.0) return logits.argmax(-1);
  logits = logits / options.temperature;
  const auto vocab = logits.size(-1);
  const auto lowest = -std::numeric_limits<float>::infinity();
  if (options.top_k > 0 && options.top_k < vocab) {
    const auto kth = std::get<0>(logits.topk(options.top_k, -1)).narrow(-1, options.top_k - 1, 1);
    logits = logits.masked_fill(logits < kth, lowest);
  }
  if (options.top_p < 1.0) {
    // Ascending: drop the tokens whose cumulative probability stays within 1 - p, keeping the
    // most likely one always.
    auto [sorted, order] = logits.sort(-1, /*descending=*/false);
    auto cumulative = sorted.softmax(-1).cumsum(-1);
    auto drop_sorted = cumulative <= (1.0 - options.top_p);
    drop_sorted.narrow(-1, vocab - 1, 1).fill_(false);
    logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), lowest);
  }
  return at::multinomial(logits.softmax(-1), 1, /*replacement=*/false, generator).squeeze(-1);
}

MESHTORCH_DECL std::vector<std::vector<std::int64_t>> generate(LlamaForCausalLM& lm,
                                                               const std::vector<std::vector<std::int64_t>>& prompts,
                                                               const GenerateOptions& options,
                                                               const TokenCallback& on_token) {
  if (prompts.empty()) return {};
  if (options.max_new_tokens < 0) throw ConfigError("generate: max_new_tokens must not be negative");
  if (options.temperature < 0) throw ConfigError("generate: temperature must not be negative");
  if (!(options.top_p > 0 && options.top_p <= 1)) throw ConfigError("generate: top_p must lie in (0, 1]");
  if (options.top_k < 0) throw ConfigError("generate: top_k must not be negative");
  const auto& config = lm->config;
  std::int64_t longest = 0;
  for (std::size_t row = 0; row < prompts.size(); ++row) {
    if (prompts[row].empty()) throw ConfigError(fmt::format("generate: prompt {} is empty", row));
    for (const auto id : prompts[row])
      if (id < 0 || id >= config.vocab_size)
        throw ConfigError(fmt::format("generate: prompt {} holds token id {}, outside the vocabulary [0, {})", row, id,
                                      config.vocab_size));
    longest = std::max<std::int64_t>(longest, static_cast<std::int64_t>(prompts[row].size()));
  }
  const auto batch = static_cast<std::int64_t>(prompts.size());
  const auto capacity = longest + options.max_new_tokens;
  if (config.sliding_window > 0 && capacity > config.sliding_window)
    throw ConfigError(
        fmt::format("generate: the longest prompt ({}) and max_new_tokens ({}) pass the model's sliding_window ({}); "
                    "sliding-window attention is not implemented",
                    longest, options.max_new_tokens, config.sliding_window));

  // Inference mode, not only no gradients: the dispatcher then skips autograd's and view
  // tracking's keys on every op, which a decoding step, some 2,000 small ops a token besides its
  // matrix products, feels (2-3% of llama-100m's tokens/s at batch 1).
  c10::InferenceMode inference;
  const auto weight = lm->output_weight();
  const auto device = weight.device();
  const auto on_device = torch::TensorOptions().device(device);
  const double cache_bytes = KvCache::bytes(config, batch, capacity, static_cast<std::int64_t>(weight.element_size()));
  if (const auto memory = io::available_host_memory();
      device.is_cpu() && memory && cache_bytes > static_cast<double>(memory->available_bytes))
    throw ConfigError(
        fmt::format("generate: the KV cache of {} prompt(s) x {} positions (the longest prompt, {}, and "
                    "max_new_tokens, {}) needs {:.3g} GB, and this process may take {:.3g} GB ({}); "
                    "ask for fewer new tokens or fewer prompts at once",
                    batch, capacity, longest, options.max_new_tokens, cache_bytes / 1e9,
                    static_cast<double>(memory->available_bytes) / 1e9, memory->source));
  KvCache cache(config, batch, capacity, on_device.dtype(weight.scalar_type()));

  // Left padding: row r's prompt fills the last positions of the first `longest`.
  auto ids = torch::zeros({batch, longest}, torch::kLong);
  auto filled = torch::zeros({batch, capacity}, torch::kBool);  // positions holding a real token
  for (std::int64_t row = 0; row < batch; ++row) {
    const auto& prompt = prompts[static_cast<std::size_t>(row)];
    const auto pad = longest - static_cast<std::int64_t>(prompt.size());
    ids[row]
        .narrow(0, pad, static_cast<std::int64_t>(prompt.size()))
        .copy_(torch::tensor(std::vector<std::int64_t>(prompt.begin(), prompt.end()), torch::kLong));
    filled[row].narrow(0, pad, static_cast<std::int64_t>(prompt.size())).fill_(true);
  }
  ids = ids.to(device);
  filled = filled.to(device);
  // Each real token's position is the count of real tokens before it in its row (transformers'
  // attention_mask.cumsum(-1) - 1); padding takes position 1, as there, and is never attended.
  auto positions_of = [&](std::int64_t start, std::int64_t steps) {
    const auto counts = filled.narrow(1, 0, start + steps).to(torch::kLong).cumsum(-1) - 1;
    return counts.narrow(1, start, steps).masked_fill(filled.narrow(1, start, steps).logical_not(), 1);
  };
  // Query s (cache position start + s) attends the real keys at or before it, and itself (a padding
  // query, whose output nobody reads, so that no row of the softmax is empty).
  auto mask_of = [&](std::int64_t start, std::int64_t steps) {
    const auto keys = torch::arange(start + steps, on_device.dtype(torch::kLong));
    const auto queries = torch::arange(start, start + steps, on_device.dtype(torch::kLong)).unsqueeze(-1);
    const auto causal = keys.unsqueeze(0) <= queries;                   // [S, L]
    const auto real = filled.narrow(1, 0, start + steps).unsqueeze(1);  // [B, 1, L]
    return (causal.unsqueeze(0).logical_and(real)).logical_or(keys.unsqueeze(0) == queries).unsqueeze(1);
  };

  // Prompts of one length need no mask (the flash kernel then runs, not the masked one).
  const bool padded = std::any_of(prompts.begin(), prompts.end(), [&](const auto& prompt) {
    return static_cast<std::int64_t>(prompt.size()) != longest;
  });
  auto generator = at::detail::createCPUGenerator(options.seed);
  std::vector<std::vector<std::int64_t>> out(prompts.size());
  std::vector<bool> done(prompts.size(), false);
  auto step_ids = ids;
  for (std::int64_t produced = 0; produced < options.max_new_tokens; ++produced) {
    const auto start = cache.length(), steps = step_ids.size(1);
    const auto positions =
        padded ? positions_of(start, steps)
               : torch::arange(start, start + steps, on_device.dtype(torch::kLong)).unsqueeze(0).expand({batch, steps});
    const auto hidden =
        lm->model->forward_cached(step_ids, positions, cache, padded ? mask_of(start, steps) : torch::Tensor());
    cache.advance(steps);
    const auto last = hidden.select(1, steps - 1);
    const auto logits =
        (lm->fused_kernels ? kernels::linear(last, weight) : at::linear(last, weight)).to(torch::kFloat).cpu();
    const auto next = choose_next_tokens(logits, options, generator);
    const auto* chosen = next.const_data_ptr<std::int64_t>();
    bool all_done = true;
    for (std::size_t row = 0; row < prompts.size(); ++row) {
      if (done[row]) continue;
      out[row].push_back(chosen[row]);
      const bool stopped = on_token && on_token(row, chosen[row]);
      done[row] =
          stopped || std::find(options.eos_ids.begin(), options.eos_ids.end(), chosen[row]) != options.eos_ids.end();
      all_done = all_done && done[row];
    }
    if (all_done) break;
    filled.narrow(1, cache.length(), 1).fill_(true);
    step_ids = next.to(device).unsqueeze(-1);
  }
  return out;
}

}  // namespace meshtorch::llama
#endif  // MESHTORCH_DEFINES(core)
