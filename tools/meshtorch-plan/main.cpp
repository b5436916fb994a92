// meshtorch-plan: what a Llama model costs each rank of a mesh, before launching anything.
//
//   meshtorch-plan -m llama-3.1-70b --world 64 --tp 8 --data-parallel fsdp --dtype bfloat16
//
// Prints the tensor-parallel plan (chapter 6's), whether the model splits over the TP size
// (the same check the examples run at start-up), and per rank: parameters, and bytes of weights,
// gradients and AdamW state under DDP, ZeRO-1 or FSDP over the data-parallel ranks, plus, for
// FSDP, the largest unit that is gathered whole (a decoder layer's TP piece, or the root). No
// LibTorch: it is arithmetic on the config.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/models/llama/config_json.hpp>
#include <meshtorch/parallel/llama_plan.hpp>

namespace mt = meshtorch;
namespace llama = meshtorch::llama;

namespace {

struct Sizes {
  std::int64_t layer = 0;      // one decoder layer's parameters on a TP rank
  std::int64_t embedding = 0;  // embed_tokens on a TP rank
  std::int64_t head = 0;       // lm_head on a TP rank (0 when tied)
  std::int64_t final_norm = 0;
  std::int64_t total(std::int64_t layers) const { return layers * layer + embedding + head + final_norm; }
};

// Parameters one TP rank holds under the sequence-parallel plan: q/k/v/o, gate/up/down,
// embedding and head split by tp; norms whole. The counts come from the config's overflow-safe
// arithmetic, after validate() has refused any config whose counts leave int64.
Sizes tp_rank_sizes(const llama::Config& c, std::int64_t tp) {
  const auto counts = c.parameter_counts();
  if (!counts) throw mt::ConfigError("the model's parameter count overflows 64 bits");
  Sizes s;
  s.layer = counts->attention / tp + counts->mlp / tp + counts->layer_norms;
  s.embedding = counts->embedding / tp;
  s.head = counts->head / tp;
  s.final_norm = counts->final_norm;
  return s;
}

std::string human(double value, const char* unit) {
  const char* prefixes[] = {"", " K", " M", " G", " T"};
  int i = 0;
  while (value >= 1000 && i < 4) value /= 1000, ++i;
  char out[64];
  std::snprintf(out, sizeof out, "%.3g%s%s", value, prefixes[i], unit);
  return out;
}

std::string gigabytes(double bytes) {
  char out[32];
  std::snprintf(out, sizeof out, "%.2f GB", bytes / 1e9);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"meshtorch-plan: a Llama model's parameters and memory per rank of a mesh"};
  std::string model = "llama-tiny";
  int world = 1, tp = 1;
  std::string data_parallel = "fsdp", dtype = "bfloat16";
  app.add_option("-m,--model-name", model, "a preset (llama-tiny, llama-3.1-8b, ...) or a folder with config.json")
      ->capture_default_str();
  app.add_option("--world", world, "ranks in the job")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--tp", tp, "tensor-parallel size (divides --world)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--data-parallel", data_parallel,
                 "what the other world/tp ranks do: ddp (ZeRO stage 0), zero (stage 1: AdamW state sharded), zero2 "
                 "(stage 2: gradients too) or fsdp (stage 3: weights too)")
      ->capture_default_str()
      ->check(CLI::IsMember({"ddp", "zero", "zero2", "fsdp"}));
  app.add_option("--dtype", dtype, "parameter dtype: float32 or bfloat16")
      ->capture_default_str()
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  CLI11_PARSE(app, argc, argv);

  try {
    if (world % tp != 0)
      throw mt::ConfigError("--world " + std::to_string(world) + " is not a multiple of --tp " + std::to_string(tp));
    const auto config = llama::resolve_model(model);
    llama::validate(config, model);
    if (auto problem = llama::first_tp_problem<llama::SequenceParallelStyles>(config, tp))
      throw mt::ConfigError(model + ": " + std::string(*problem) + " (" + std::to_string(tp) + ")");
    const std::int64_t dp = world / tp;
    const double bytes = dtype == "bfloat16" ? 2 : 4;

    std::printf("model %s: %s parameters (hidden %lld, %lld layers, %lld heads / %lld key-value heads, vocab %lld%s)\n",
                model.c_str(), human(static_cast<double>(config.num_parameters()), "").c_str(),
                static_cast<long long>(config.hidden_size), static_cast<long long>(config.num_hidden_layers),
                static_cast<long long>(config.num_attention_heads), static_cast<long long>(config.num_key_value_heads),
                static_cast<long long>(config.vocab_size), config.tie_word_embeddings ? ", tied head" : "");
    std::printf("mesh: %d ranks = %lld %s x %d TP\n", world, static_cast<long long>(dp),
                data_parallel == "fsdp" ? "FSDP" : "DP", tp);
    if (tp > 1)
      std::printf("plan: %s\n", llama::Plan<mt::Mesh<mt::TP<2>>>::describe_styles().c_str());

    const auto sizes = tp_rank_sizes(config, tp);
    const double tp_params = static_cast<double>(sizes.total(config.num_hidden_layers));
    // Weights and gradients in the parameter dtype; AdamW's two moments in it too, as torch's
    // AdamW keeps them.
    double weights = tp_params, grads = tp_params, moments = 2 * tp_params;
    if (data_parallel == "zero") moments /= static_cast<double>(dp);
    if (data_parallel == "zero2") {
      grads /= static_cast<double>(dp);
      moments /= static_cast<double>(dp);
    }
    if (data_parallel == "fsdp") {
      weights /= static_cast<double>(dp);
      grads /= static_cast<double>(dp);
      moments /= static_cast<double>(dp);
    }
    std::printf("\nper rank (%s):\n", dtype.c_str());
    std::printf("  %-22s %14s\n", "parameters held", human(weights, "").c_str());
    std::printf("  %-22s %14s\n", "weights", gigabytes(weights * bytes).c_str());
    std::printf("  %-22s %14s\n", "gradients", gigabytes(grads * bytes).c_str());
    std::printf("  %-22s %14s\n", "AdamW state", gigabytes(moments * bytes).c_str());
    std::printf("  %-22s %14s\n", "total", gigabytes((weights + grads + moments) * bytes).c_str());
    if (data_parallel == "fsdp" && dp > 1) {
      const double root = static_cast<double>(sizes.embedding + sizes.head + sizes.final_norm);
      const double largest = std::max(static_cast<double>(sizes.layer), root);
      std::printf("  %-22s %14s  (%s, whole over FSDP: its weights and their gradients)\n", "largest gathered unit",
                  gigabytes(2 * largest * bytes).c_str(), largest == root ? "the root" : "one decoder layer");
    }
    std::printf("\nActivations come on top: they grow with batch x sequence and fall with activation checkpointing and,\n"
                "between layers, with TP's sequence parallel.\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshtorch-plan: %s\n", e.what());
    return 2;
  }
}
