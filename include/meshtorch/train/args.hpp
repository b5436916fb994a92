#pragma once
// The guide's command-line flags, shared by every chapter's train_llm.cpp. A chapter adds its
// own flags (e.g. --cpu-offload, --tp) to the same CLI::App.
#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>

namespace meshtorch::train {

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

  void add_to(CLI::App& app) {
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
    app.add_option("--threads", threads, "intra-op threads (0: LibTorch's default)")->capture_default_str();
  }
};

}  // namespace meshtorch::train
