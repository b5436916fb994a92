// meshtorch-generate: text from a model folder (config.json, safetensors weights, a tokenizer) or
// from a sharded checkpoint of any mesh, with a KV cache (models/llama/generate.hpp).
//
//   meshtorch-generate FOLDER --prompt "The capital of France is" --max-new-tokens 32
//   echo "Tell me a joke" | meshtorch-generate FOLDER --chat --temperature 0.7 --seed 1
//   echo "[1, 15043, 29892]" | meshtorch-generate FOLDER --ids --max-new-tokens 48
//   meshtorch-generate runs/llama --tokenizer models/llama --prompt "Once upon a time"
//
// Text prompts (--prompt, else one per stdin line) are encoded with the folder's tokenizer and the
// special tokens it adds by default (tokenizer.json's post-processor template), or rendered by its chat template as a
// user message
// (--chat); each is decoded on its own and its text streamed to stdout as it comes. With --ids each
// stdin line is a JSON list of prompt ids, taken as given; all lines are decoded as one batch and
// each output line is the JSON list of that prompt's new ids, up to and including the eos id where
// it stops there, as transformers' generate returns them. The eos ids are generation_config.json's,
// else config.json's, as transformers takes them.
#include <chrono>
#include <filesystem>
#include <iostream>
#include <map>
#include <span>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <meshtorch/data/byte_level.hpp>
#include <meshtorch/data/chat_template.hpp>
#include <meshtorch/data/folder_tokenizer.hpp>
#include <meshtorch/io/json_file.hpp>
#include <meshtorch/io/model_folder.hpp>
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/checkpointing.hpp>

namespace mt = meshtorch;

namespace {

// generation_config.json's eos_token_id, else config.json's: an id, a list of ids, or null (none).
std::vector<std::int64_t> eos_ids_of(const std::filesystem::path& dir) {
  for (const char* name : {"generation_config.json", "config.json"}) {
    if (!mt::io::present_in_folder(dir / name)) continue;
    const auto json = mt::io::read_json_file<mt::ConfigError>(mt::io::model_file(dir, name, dir.string()), name);
    if (const auto it = json.find("eos_token_id"); it != json.end())
      return mt::llama::token_ids(*it, fmt::format("{}: field 'eos_token_id'", (dir / name).string()));
  }
  return {};
}

// One --ids line, through the project's bounded JSON parser (a line nested 100,000 deep is an
// error, not a stack overflow).
std::vector<std::int64_t> ids_of_line(const std::string& line, std::size_t number) {
  const auto where = fmt::format("--ids: stdin line {}", number);
  const auto json = mt::io::parse_json<mt::ConfigError>(line, where, "the line");
  if (!json.is_array() || json.empty())
    throw mt::ConfigError(fmt::format("{} is not a non-empty JSON list of token ids: {}", where, line.substr(0, 80)));
  return mt::llama::token_ids(json, where);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Generate text from a model folder with a KV cache"};
  std::string folder, tokenizer_dir, dtype = "float32";
  std::vector<std::string> prompts, stops;
  bool ids_mode = false, chat = false, ignore_eos = false;
  int threads = 0;
  mt::llama::GenerateOptions options;
  app.add_option("folder", folder,
                 "model folder (config.json, safetensors weights and, for text, a tokenizer), a ckpt-<step> "
                 "checkpoint saved on any mesh, or an experiment folder (its latest checkpoint)")
      ->required();
  app.add_option("--tokenizer", tokenizer_dir,
                 "folder whose tokenizer encodes and decodes text (default: the model folder)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--prompt", prompts, "a text prompt (repeatable); default: one per stdin line");
  app.add_flag("--ids", ids_mode, "stdin lines are JSON lists of prompt ids, decoded as one batch; prints new ids");
  app.add_flag("--chat", chat, "render each prompt as a user message with the folder's chat template");
  app.add_option("--max-new-tokens", options.max_new_tokens)->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--temperature", options.temperature, "0 is greedy")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--top-k", options.top_k, "0: every token")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--top-p", options.top_p)->capture_default_str()->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", options.seed)->capture_default_str();
  app.add_option("--stop", stops, "end a prompt's text where it holds this string (repeatable; text prompts)");
  app.add_flag("--ignore-eos", ignore_eos, "always produce --max-new-tokens tokens (for timing)");
  app.add_option("--dtype", dtype)->capture_default_str()->check(CLI::IsMember({"float32", "bfloat16", "auto"}));
  app.add_option("--threads", threads, "intra-op threads (0: LibTorch's default)")->capture_default_str();
  std::string fused = "on";
  app.add_option("--fused", fused,
                 "on: the fused CPU kernels (RMSNorm, SwiGLU, rotary, and the few-rows product of a decoding "
                 "step); off: LibTorch's composite ops and GEMM, for comparison")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off"}));
  CLI11_PARSE(app, argc, argv);
  if (ids_mode && (chat || !prompts.empty() || !stops.empty())) {
    std::cerr << "meshtorch-generate: --ids takes prompts from stdin as ids; it does not combine with --chat, "
                 "--prompt or --stop\n";
    return 2;
  }
  return mt::diagnostics::run_recorded([&] {
    if (threads > 0) torch::set_num_threads(threads);
    const auto type = dtype == "auto"       ? std::nullopt
                      : dtype == "bfloat16" ? std::optional(torch::kBFloat16)
                                            : std::optional(torch::kFloat);
    auto whole = mt::load_whole_model(folder, type);
    auto& model = whole.model;
    const auto& dir = whole.folder;
    model->eval();
    model->use_fused_kernels(fused == "on");
    if (!ignore_eos) options.eos_ids = eos_ids_of(dir);
    // What generation took, without loading: on stderr, so that stdout holds only the output.
    const auto timed = [](auto&& generate_batch) {
      const auto start = std::chrono::steady_clock::now();
      const auto rows = generate_batch();
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::size_t tokens = 0;
      for (const auto& row : rows) tokens += row.size();
      std::cerr << fmt::format("meshtorch-generate: {} new tokens for {} prompt(s) in {:.3f} s ({:.1f} tokens/s)\n",
                               tokens, rows.size(), seconds, static_cast<double>(tokens) / seconds);
      return rows;
    };

    if (ids_mode) {
      std::vector<std::vector<std::int64_t>> batch;
      std::size_t number = 0;
      for (std::string line; std::getline(std::cin, line);)
        if (++number, line.find_first_not_of(" \t\r") != std::string::npos) batch.push_back(ids_of_line(line, number));
      for (const auto& row : timed([&] { return mt::llama::generate(model, batch, options); }))
        std::cout << nlohmann::json(row).dump() << "\n";
      return 0;
    }

    // A checkpoint holds the weights and config.json, not the tokenizer: that stays in the folder
    // the run was trained from.
    if (tokenizer_dir.empty() && whole.from_checkpoint)
      throw mt::ConfigError(fmt::format(
          "{} is a checkpoint, which holds no tokenizer: pass --tokenizer with the model folder it was trained "
          "from (its -m), or prompts as ids (--ids)",
          folder));
    const std::filesystem::path text_dir = tokenizer_dir.empty() ? dir : std::filesystem::path(tokenizer_dir);
    const auto tokenizer = mt::data::load_tokenizer(text_dir);
    const auto chat_template = chat ? mt::data::ChatTemplate::from_folder(text_dir) : std::nullopt;
    if (chat && !chat_template)
      throw mt::ConfigError(
          fmt::format("--chat: {} has no chat template (tokenizer_config.json's chat_template, or "
                      "chat_template.jinja)",
                      text_dir.string()));
    if (prompts.empty())
      for (std::string line; std::getline(std::cin, line);) prompts.push_back(line);
    for (const auto& prompt : prompts) {
      std::vector<std::int32_t> encoded;
      if (chat_template) {
        const nlohmann::ordered_json messages =
            nlohmann::ordered_json::array({{{"role", "user"}, {"content", prompt}}});
        encoded = tokenizer->encode(chat_template->render(messages, nullptr, /*add_generation_prompt=*/true, "--chat"));
      } else {
        encoded = tokenizer->encode_with_special_tokens(prompt);
      }
      // The text so far is decoded whole each token, and what is new printed as valid UTF-8 (as
      // transformers' decode makes it), holding back a character whose bytes have not all come.
      std::vector<std::int32_t> produced;
      std::size_t printed = 0;  // bytes of the decoded text printed so far
      const auto print_new = [&](const std::string& text, bool last) {
        if (printed >= text.size()) return;  // a stop string cut what was already printed
        std::string valid;
        printed += mt::data::byte_level::append_utf8_lossy(std::string_view(text).substr(printed), valid, last);
        std::cout << valid << std::flush;
      };
      std::string text;
      std::map<std::int32_t, bool> known;
      const auto on_token = [&](std::size_t, std::int64_t token) {
        if (std::find(options.eos_ids.begin(), options.eos_ids.end(), token) != options.eos_ids.end()) return false;
        // An id the model has and the tokenizer does not (an embedding padded past the vocabulary)
        // has no text: transformers' decode leaves it out, and so does this.
        const auto id = static_cast<std::int32_t>(token);
        if (!known.count(id)) {
          try {
            tokenizer->decode(std::span(&id, 1));
            known[id] = true;
          } catch (const mt::DataError&) {
            known[id] = false;
          }
        }
        if (!known[id]) return false;
        produced.push_back(id);
        text = tokenizer->decode(produced);
        for (const auto& stop : stops)
          if (const auto at = text.find(stop); !stop.empty() && at != std::string::npos) {
            text.resize(at);
            print_new(text, /*last=*/true);
            return true;
          }
        print_new(text, /*last=*/false);
        return false;
      };
      timed([&] {
        return mt::llama::generate(model, {std::vector<std::int64_t>(encoded.begin(), encoded.end())}, options,
                                   on_token);
      });
      if (printed < text.size()) print_new(text, /*last=*/true);
      std::cout << "\n" << std::flush;
    }
    return 0;
  });
}
