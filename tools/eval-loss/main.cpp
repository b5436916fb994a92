// meshtorch-eval-loss: the loss of a saved model folder on a fixed token batch, written as JSON
// ({"tokens": [[...]], "loss": x}) so that another implementation (transformers) can be checked
// against ours on exactly the same input.
#include <fstream>
#include <iostream>

#include <CLI/CLI.hpp>

#include <meshtorch/meshtorch.hpp>

namespace mt = meshtorch;

int main(int argc, char** argv) {
  CLI::App app{"Loss of a saved Llama folder (config.json + model.safetensors) on a seeded token batch"};
  std::string model_dir, output;
  std::int64_t batch = 2, seq = 32;
  std::uint64_t seed = 0;
  app.add_option("model_dir", model_dir, "folder with config.json and model.safetensors")->required();
  app.add_option("output", output, "JSON file to write")->required();
  app.add_option("-b,--batch-size", batch)->capture_default_str();
  app.add_option("-s,--seq-length", seq)->capture_default_str();
  app.add_option("--seed", seed)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  return mt::diagnostics::run_recorded([&] {
    mt::llama::LlamaForCausalLM model(mt::llama::resolve_model(model_dir));
    mt::llama::load_pretrained_weights(model, model_dir);
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
    nlohmann::json record{
        {"loss", loss}, {"tokens", nlohmann::json::array()}, {"token_losses", nlohmann::json::array()}};
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
  });
}
