#include <fmt/format.h>

#include <meshtorch/meshtorch.hpp>
#include <meshtorch/train/args.hpp>

int main(int argc, char** argv) {
  namespace mt = meshtorch;
  // The program's flags: CLI11 comes with meshtorch::meshtorch, like fmt and nlohmann_json.
  CLI::App app{"consumer"};
  mt::train::TrainArgs args;
  args.add_to(app);
  CLI11_PARSE(app, argc, argv);
  auto config = mt::llama::presets::llama_tiny;
  config.num_hidden_layers = 1;
  mt::llama::LlamaForCausalLM model(config);
  mt::llama::init_weights(model);
  torch::manual_seed(args.seed);
  const auto ids = torch::randint(0, 256, {1, 8}, torch::kLong);
  const double loss = model->loss(ids, ids).item<double>();
  fmt::print("consumer loss {:.5f} ({})\n", loss, args.model_name);
  return loss > 4.5 && loss < 7.0 ? 0 : 1;  // near ln(264) = 5.58 at initialisation
}
