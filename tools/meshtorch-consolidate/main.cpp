// meshtorch-consolidate: turns a sharded checkpoint (any layout, any world size) into an HF folder
// (config.json + model.safetensors, or model-0000i-of-0000n.safetensors with an index) that
// 01-single-gpu, load_pretrained_weights and transformers' from_pretrained read.
//
//   meshtorch-consolidate runs/llama/checkpoint exported/llama
//
// Every file of the checkpoint is verified against its manifest first; one full tensor at a time
// is held in memory. Optimizer state is left out unless --include-optimizer.
#include <cstdint>
#include <exception>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <malloc.h>

#include <meshtorch/checkpoint/consolidate.hpp>
#include <meshtorch/train/memory.hpp>

namespace checkpoint = meshtorch::checkpoint;

int main(int argc, char** argv) {
  CLI::App app{"Consolidate a meshtorch sharded checkpoint into a Hugging Face model folder"};
  std::string checkpoint_dir, out_dir;
  checkpoint::ConsolidateOptions options;
  app.add_option("checkpoint_dir", checkpoint_dir, "ckpt-<step> folder (or the experiment's checkpoint link)")
      ->required()
      ->check(CLI::ExistingDirectory);
  app.add_option("out_dir", out_dir,
                 "HF folder to write (created if absent; outside any experiment folder); an earlier export's "
                 "weight files there are replaced")
      ->required();
  app.add_option("--max-shard-bytes", options.max_shard_bytes, "start a new model-*.safetensors file beyond this size")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_flag("--include-optimizer", options.include_optimizer, "also write the optimizer/ tensors (AdamW state)");
  CLI11_PARSE(app, argc, argv);
  // A fixed mmap threshold: glibc's moving one would keep freed piece buffers in the heap after
  // the first large tensor, so memory would hold several tensors' worth instead of one.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  try {
    const auto result = checkpoint::consolidate_sharded_checkpoint(checkpoint_dir, out_dir, options);
    std::cout << fmt::format("{} tensors, {:.3f} GB of weights, written to {}:\n", result.tensors,
                             static_cast<double>(result.bytes) / 1e9, out_dir);
    for (const auto& file : result.files) std::cout << "  " << file.filename().string() << "\n";
    for (const auto& file : result.removed)
      std::cout << "removed " << file.filename().string() << ", a weight file of an earlier export\n";
    std::cout << fmt::format("peak RSS {:.0f} MiB\n", meshtorch::train::kib_field_from_proc_status("VmHWM") / 1024);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "meshtorch-consolidate: " << e.what() << "\n";
    return 1;
  }
}
