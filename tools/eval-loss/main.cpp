// meshtorch-eval-loss: the loss of a model, from an HF folder or a sharded checkpoint of any mesh.
//
//   meshtorch-eval-loss runs/llama -d data/ --eval-split 0.05         # perplexity on the held-out blocks
//   meshtorch-eval-loss models/llama out.json -b 2 -s 32 --seed 0       # a seeded random batch, as JSON
//
// With --eval-split, the blocks a training run with the same -d, --dataset-subset, -s and
// --eval-split held out (data::TokenBlocks::hold_out), tokenised as that run did (-m: the
// folder's own tokenizer, or the -m a checkpoint's run was trained with). Without it, a seeded
// random batch ({"tokens": [[...]], "loss": x, "token_losses": [[...]]}), so that another
// implementation (transformers) can be checked against ours on exactly the same input.
#include <fstream>
#include <iostream>
#include <optional>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <meshtorch/data/dataset_tokenizer.hpp>
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/train/evaluation.hpp>

namespace mt = meshtorch;

namespace {

// A checkpoint's state.json records its run's -s, -m and the data it held blocks out of (-d,
// --dataset-subset, --eval-split, as run_identity writes them): the held-out blocks are the same
// only with the same -s and data. -s and the tokenizer's -m are taken from it when not given; a
// different -s or data is refused.
void match_checkpoint_run(const mt::train::RunIdentity& run, const std::filesystem::path& checkpoint,
                          mt::train::TrainArgs& args, bool seq_length_given) {
  if (!seq_length_given) args.seq_length = run.seq_length;
  if (args.seq_length != run.seq_length)
    throw mt::ConfigError(
        fmt::format("-s {}: the run of {} trained with -s {}, and its held-out blocks are those of "
                    "that length; give -s {}",
                    args.seq_length, checkpoint.string(), run.seq_length, run.seq_length));
  const auto asked = mt::train::run_identity(args, 0).dataset;
  if (run.dataset != asked)
    throw mt::ConfigError(
        fmt::format("the run of {} read '{}', this evaluation '{}': give the run's -d, "
                    "--dataset-subset and --eval-split, so that the blocks it held out are evaluated",
                    checkpoint.string(), run.dataset, asked));
  if (args.model_name.empty()) args.model_name = run.model;
}

int held_out_loss(mt::WholeModel& whole, mt::train::TrainArgs& args, bool seq_length_given, const std::string& output) {
  if (whole.from_checkpoint) {
    const auto state = whole.folder / "state.json";
    match_checkpoint_run(mt::train::read_run_identity(mt::io::read_json_file<mt::DataError>(state), state.string()),
                         whole.folder, args, seq_length_given);
  }
  // -d is tokenised with the -m given, else the run's (above), else the folder's own tokenizer.
  if (args.model_name.empty()) args.model_name = whole.folder.string();
  std::string note;
  auto blocks = mt::data::load_dataset(args.dataset_name, args.seq_length, args.model_name, &note, args.dataset_subset);
  std::cout << "data: " << note << "\n";
  blocks.check_vocab(whole.model->config.vocab_size);
  const auto& held_out = blocks.hold_out(args.eval_split);
  const auto result = mt::train::evaluate_held_out(
      held_out, args.batch_size, /*dp_size=*/1, /*dp_rank=*/0, torch::kCPU,
      [&](const torch::Tensor& ids) { return whole.model->loss(ids, /*labels=*/ids); },
      [](torch::Tensor sum) { return sum; });
  const nlohmann::ordered_json record{{"eval_loss", result.loss},
                                      {"eval_perplexity", result.perplexity()},
                                      {"eval_tokens", result.tokens},
                                      {"eval_blocks", result.blocks},
                                      {"eval_s", result.seconds}};
  std::cout << mt::train::format_metrics(record) << "\n";
  if (!output.empty()) mt::io::write_file_atomically(output, record.dump() + "\n");
  return 0;
}

int random_batch_loss(mt::WholeModel& whole, std::int64_t batch, std::int64_t seq, std::uint64_t seed,
                      const std::string& output) {
  auto& model = whole.model;
  torch::NoGradGuard no_grad;
  torch::manual_seed(seed);
  const auto ids = torch::randint(0, model->config.vocab_size, {batch, seq}, torch::kLong);
  const auto logits = model->forward(ids);
  const double loss = mt::llama::LlamaForCausalLMImpl::causal_lm_loss(logits, ids).item<double>();
  // Each position's next-token loss too: a mean can hide errors that cancel.
  const auto token_losses = torch::nn::functional::cross_entropy(
                                logits.narrow(1, 0, seq - 1).to(torch::kFloat).reshape({-1, logits.size(-1)}),
                                ids.narrow(1, 1, seq - 1).reshape({-1}),
                                torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone))
                                .view({batch, seq - 1})
                                .to(torch::kDouble)
                                .contiguous();
  nlohmann::json record{{"loss", loss}, {"tokens", nlohmann::json::array()}, {"token_losses", nlohmann::json::array()}};
  for (std::int64_t b = 0; b < batch; ++b) {
    const auto row = ids[b].contiguous();
    record["tokens"].push_back(
        std::vector<std::int64_t>(row.data_ptr<std::int64_t>(), row.data_ptr<std::int64_t>() + seq));
    const auto losses = token_losses[b];
    record["token_losses"].push_back(
        std::vector<double>(losses.data_ptr<double>(), losses.data_ptr<double>() + (seq - 1)));
  }
  mt::io::write_file_atomically(output, record.dump() + "\n");
  std::cout << "loss " << loss << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Loss of a model folder or checkpoint: on the blocks --eval-split held out, or on a seeded batch"};
  std::string model_dir, output;
  std::uint64_t seed = 0;
  int threads = 0;
  mt::train::TrainArgs args;
  args.model_name.clear();
  args.batch_size = 2;
  args.seq_length = 32;
  app.add_option("model_dir", model_dir,
                 "model folder (config.json and safetensors weights), ckpt-<step> checkpoint of any mesh, or "
                 "experiment folder (its latest checkpoint)")
      ->required();
  app.add_option("output", output, "JSON file to write (required without --eval-split)");
  auto* split = app.add_option("--eval-split", args.eval_split,
                               "evaluate the last fraction of -d's blocks, as a run with this --eval-split held out")
                    ->check(CLI::Range(0.0, 1.0));
  app.add_option("-d,--dataset-name", args.dataset_name, "with --eval-split: the run's -d")
      ->capture_default_str()
      ->needs(split);
  app.add_option("--dataset-subset", args.dataset_subset, "with --eval-split: the run's --dataset-subset")
      ->needs(split);
  app.add_option("-m,--model-name", args.model_name,
                 "with --eval-split: whose tokenizer encodes -d (default: the model folder, or the -m a checkpoint's "
                 "run trained with)")
      ->needs(split);
  app.add_option("-b,--batch-size", args.batch_size)->capture_default_str()->check(CLI::PositiveNumber);
  auto* seq_flag = app.add_option("-s,--seq-length", args.seq_length,
                                  "the sequence length (with --eval-split from a checkpoint: the run's by default)")
                       ->capture_default_str()
                       ->check(CLI::PositiveNumber);
  app.add_option("--seed", seed, "without --eval-split: the random batch's seed")
      ->capture_default_str()
      ->excludes(split);
  app.add_option("--threads", threads, "intra-op threads (0: LibTorch's default)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (args.eval_split == 0 && output.empty()) {
    std::cerr << "meshtorch-eval-loss: give an output file, or --eval-split to evaluate held-out data\n";
    return 2;
  }
  return mt::diagnostics::run_recorded([&] {
    if (threads > 0) torch::set_num_threads(threads);
    auto whole = mt::load_whole_model(model_dir, torch::kFloat);  // fp32, as transformers' reference runs
    return args.eval_split > 0 ? held_out_loss(whole, args, seq_flag->count() > 0, output)
                               : random_batch_loss(whole, args.batch_size, args.seq_length, seed, output);
  });
}
