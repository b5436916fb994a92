#pragma once
// The guide's command-line flags, shared by every chapter's train_llm.cpp. A chapter adds its
// own flags (e.g. --cpu-offload, --tp) to the same CLI::App. Every flag, the chapter's too, is
// part of the fingerprint ranks compare at start-up, unless it is added to the per_rank_flags
// group: a rank started with other values fails at once instead of hanging later.
#include <cstdint>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>

namespace meshtorch::train {

// The CLI11 group of flags that may differ between ranks (they change no result).
inline constexpr const char* per_rank_flags = "Per-rank options";

// Every flag's value but the per-rank ones, one "name=value" per line, in the order the flags
// were added: what all ranks of a run must agree on.
inline std::string flags_fingerprint(const CLI::App& app) {
  std::string per_rank_names;
  for (const CLI::Option* option : app.get_options())
    if (option->get_group() == per_rank_flags) per_rank_names += "|" + option->get_single_name() + "=";
  std::istringstream all(app.config_to_str(/*default_also=*/true, /*write_description=*/false));
  std::string out, line;
  while (std::getline(all, line)) {
    const auto name = line.substr(0, line.find('=') + 1);
    if (per_rank_names.find("|" + name) == std::string::npos) out += line + "\n";
  }
  return out;
}

struct TrainArgs {
  std::string experiment_name;  // empty: no checkpoints, no metrics file
  std::string dataset_name = "builtin";
  std::string model_name = "llama-tiny";
  std::string save_dir = "runs";
  std::uint64_t seed = 0;
  std::int64_t num_epochs = 100;
  double lr = 3e-4;
  std::int64_t batch_size = 8;
  std::int64_t log_freq = 10;
  std::int64_t ckpt_freq = 500;
  std::int64_t seq_length = 256;
  std::int64_t max_steps = 0;  // 0: until num_epochs are done
  std::string device = "auto";
  std::string dtype = "auto";
  std::int64_t grad_accum = 1;
  int threads = 0;  // 0: LibTorch's default
  double timeout_s = 0;  // rendezvous and collectives; 0: MESHTORCH_TIMEOUT, else 600 s

  // The flags every rank must share (all that were parsed by the app these were added to).
  std::string fingerprint() const { return app_ ? flags_fingerprint(*app_) : std::string(); }

  void add_to(CLI::App& app) {
    app_ = &app;
    app.add_option("-e,--experiment-name", experiment_name,
                   "name of the run; checkpoints and metrics.jsonl go to <save-dir>/<name>, and a run with the "
                   "same name resumes");
    app.add_option("-d,--dataset-name", dataset_name, "'builtin' or a .txt, .jsonl or llm.c .bin file")
        ->capture_default_str();
    app.add_option("-m,--model-name", model_name,
                   "a preset (llama-tiny, llama-3.2-1b, llama-3.1-8b, llama-3.1-70b, llama-3.1-405b) or a "
                   "directory with an HF config.json (and optionally model.safetensors)")
        ->capture_default_str();
    app.add_option("--save-dir", save_dir, "where experiments are saved")->capture_default_str();
    app.add_option("--seed", seed, "seed for initialisation and data order")->capture_default_str();
    app.add_option("--num-epochs", num_epochs)->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--lr", lr, "peak learning rate")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("-b,--batch-size", batch_size, "samples per data-parallel rank and micro-batch")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    app.add_option("--log-freq", log_freq, "log every N optimizer steps")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--ckpt-freq", ckpt_freq, "checkpoint every N optimizer steps")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    app.add_option("-s,--seq-length", seq_length)->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--max-steps", max_steps, "stop when the global step reaches N (0: no limit)")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    app.add_option("--device", device, "cpu, cuda or auto (cuda when available)")
        ->capture_default_str()
        ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
    app.add_option("--dtype", dtype, "float32, bfloat16 or auto (bfloat16 on cuda, float32 on cpu)")
        ->capture_default_str()
        ->check(CLI::IsMember({"auto", "float32", "bfloat16"}));
    app.add_option("--grad-accum", grad_accum, "micro-batches per optimizer step")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    app.add_option("--timeout", timeout_s,
                   "seconds a rendezvous or collective may wait before the run ends naming the rank that did not "
                   "arrive (0: MESHTORCH_TIMEOUT, else 600)")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber)
        ->group(per_rank_flags);
    app.add_option("--threads", threads, "intra-op threads (0: LibTorch's default)")
        ->capture_default_str()
        ->group(per_rank_flags);
  }

 private:
  const CLI::App* app_ = nullptr;
};

}  // namespace meshtorch::train
