#pragma once
// Files for the bad-input tests: a sharded model folder whose index and shards a test can
// change, and raw safetensors files with a hand-written header.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <meshtorch/meshtorch.hpp>

#include "../core/test_support.hpp"

namespace meshtorch::testing {

inline void write_file(const fs::path& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// The message of what `body` throws, or "no error".
inline std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

// An 8-byte little-endian length, the header text as given, then `data_bytes` zero bytes.
inline void write_safetensors_with_header(const fs::path& path, const std::string& header, std::size_t data_bytes) {
  std::ofstream out(path, std::ios::binary);
  const std::uint64_t length = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(length >> (8 * i)));
  out << header << std::string(data_bytes, '\0');
}

inline llama::Config tiny_config() {
  auto c = llama::presets::llama_tiny;
  c.hidden_size = 16;
  c.intermediate_size = 32;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 32;
  return c;
}

// <root>/model/: config.json, two shards and model.safetensors.index.json, as HF writes a
// sharded checkpoint. The parameters, in name order, are split between the shards.
struct ShardedFolder {
  fs::path root, dir;
  llama::LlamaForCausalLM saved{tiny_config()};
  llama::LlamaForCausalLM loaded{tiny_config()};
  std::vector<std::string> shard_names{"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
  std::vector<std::vector<std::string>> shard_tensors{2};  // each in name order

  explicit ShardedFolder(const std::string& name) : root(fresh_dir(name)), dir(root / "model") {
    fs::create_directories(dir);
    torch::manual_seed(5);
    llama::init_weights(saved);
    std::vector<std::string> names;
    for (const auto& item : saved->named_parameters()) names.push_back(item.key());
    std::sort(names.begin(), names.end());
    for (std::size_t i = 0; i < names.size(); ++i) shard_tensors[2 * i / names.size()].push_back(names[i]);
    for (std::size_t shard = 0; shard < 2; ++shard)
      io::save_safetensors(dir / shard_names[shard], shard_contents(shard));
    io::write_file_atomically(dir / "config.json", llama::config_to_json(saved->config).dump());
    write_index([](nlohmann::json&) {});
  }
  ~ShardedFolder() {
    std::error_code ignored;
    fs::remove_all(root, ignored);
  }

  io::NamedTensors shard_contents(std::size_t shard) const {
    io::NamedTensors tensors;
    const auto params = saved->named_parameters();
    for (const auto& name : shard_tensors[shard]) tensors.emplace_back(name, params[name]);
    return tensors;
  }

  nlohmann::json index_json() const {
    nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
    for (std::size_t shard = 0; shard < 2; ++shard)
      for (const auto& name : shard_tensors[shard]) index["weight_map"][name] = shard_names[shard];
    return index;
  }

  // Writes the index after `change` has edited its weight_map.
  void write_index(const std::function<void(nlohmann::json& weight_map)>& change) const {
    auto index = index_json();
    change(index["weight_map"]);
    write_file(dir / "model.safetensors.index.json", index.dump(2));
  }

  void load() { llama::load_pretrained_weights(loaded, dir); }

  void check_weights_equal() const {
    const auto a = saved->named_parameters(), b = loaded->named_parameters();
    for (const auto& item : a) {
      INFO(item.key());
      CHECK(torch::equal(item.value(), b[item.key()]));
    }
  }
};

}  // namespace meshtorch::testing
