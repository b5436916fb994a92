// Helper of the HF parity test: loads a checkpoint folder written by our binaries (config.json +
// model.safetensors) and writes {"tokens": [[...]], "loss": x, "token_losses": [[...]]}: our fp32
// loss on a fixed batch of the built-in corpus, and each position's next-token loss (far more
// sensitive than the mean), for bench/reference/hf_loss.py to recompute with transformers.
//
//   hf_parity_eval_loss CHECKPOINT_DIR OUT_JSON
#include <fstream>
#include <iostream>

#include <meshtorch/meshtorch.hpp>

namespace mt = meshtorch;

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " CHECKPOINT_DIR OUT_JSON\n";
    return 2;
  }
  try {
    const std::string dir = argv[1];
    torch::manual_seed(0);
    const auto config = mt::llama::resolve_model(dir);
    mt::llama::LlamaForCausalLM model(config, torch::TensorOptions().dtype(torch::kFloat));
    mt::llama::load_pretrained_weights(model, dir);
    model->eval();

    // Rows that cross document boundaries (<eos><bos> inside a block) and start mid-document.
    const auto blocks = mt::data::load_dataset("builtin", /*seq_length=*/128);
    blocks.check_vocab(config.vocab_size);
    const auto tokens = blocks.gather({0, 7, 19, 42});

    torch::NoGradGuard no_grad;
    const double loss = model->loss(tokens, tokens).item<double>();
    const auto seq = tokens.size(1);
    const auto logits = model->forward(tokens).narrow(1, 0, seq - 1).to(torch::kFloat);
    const auto token_losses = torch::nn::functional::cross_entropy(
        logits.reshape({-1, logits.size(-1)}), tokens.narrow(1, 1, seq - 1).reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone)).view({tokens.size(0), seq - 1})
        .to(torch::kDouble).contiguous();

    nlohmann::json rows = nlohmann::json::array(), losses = nlohmann::json::array();
    for (std::int64_t r = 0; r < tokens.size(0); ++r) {
      const auto row = tokens[r].contiguous();
      rows.push_back(std::vector<std::int64_t>(row.data_ptr<std::int64_t>(), row.data_ptr<std::int64_t>() + row.numel()));
      const auto lr = token_losses[r].contiguous();
      losses.push_back(std::vector<double>(lr.data_ptr<double>(), lr.data_ptr<double>() + lr.numel()));
    }
    std::ofstream out(argv[2]);
    out << nlohmann::json{{"tokens", rows}, {"loss", loss}, {"token_losses", losses}}.dump() << "\n";
    if (!out) throw std::runtime_error(std::string(argv[2]) + ": cannot write");
    std::cout << "our loss " << loss << " on " << tokens.size(0) << "x" << tokens.size(1) << " tokens\n";
  } catch (const std::exception& e) {
    std::cerr << argv[1] << ": " << e.what() << "\n";
    return 1;
  }
  return 0;
}
