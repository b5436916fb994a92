// Bad input gives a named error: each case here was found by feeding meshtorch malformed or
// hostile files (model folders, configs, state.json, datasets), and each failed before its fix.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <meshtorch/io/json_file.hpp>
#include <meshtorch/meshtorch.hpp>

#include "../core/test_support.hpp"
#include "input_support.hpp"

namespace mt = meshtorch;
namespace fs = std::filesystem;
using meshtorch::testing::error_of;
using meshtorch::testing::fresh_dir;
using meshtorch::testing::ShardedFolder;
using meshtorch::testing::write_file;
using meshtorch::testing::write_safetensors_with_header;

TEST_CASE("index entries that name a path outside the folder are refused before the file is opened", "[folder]") {
  ShardedFolder folder("outside");
  // A valid shard outside the folder, holding every tensor of the first shard: before the fix it
  // loaded through "../" and absolute entries.
  const auto outside_dir = folder.root / "outside";
  fs::create_directories(outside_dir);
  fs::copy_file(folder.dir / folder.shard_names[0], outside_dir / "stolen.safetensors");
  write_file(outside_dir / "passwd", "root:x:0:0:root:/root:/bin/bash\n");

  const std::string tensor = folder.shard_tensors[0].front();
  for (const std::string& entry : {std::string("../outside/stolen.safetensors"),
                                   (outside_dir / "stolen.safetensors").string(), (outside_dir / "passwd").string(),
                                   std::string("./") + folder.shard_names[0], std::string(".."), std::string("")}) {
    INFO(entry);
    folder.write_index([&](nlohmann::json& map) {
      for (const auto& name : folder.shard_tensors[0]) map[name] = entry;
    });
    const auto message = error_of([&] { folder.load(); });
    CHECK_THAT(message, Catch::Contains("model.safetensors.index.json: weight_map['" + tensor + "'] is '" + entry +
                                        "', not a plain file name"));
    CHECK_THAT(message, !Catch::Contains("root:x"));
  }
}

TEST_CASE("a link leading out of the model folder is refused, one inside it or into the HF cache loads", "[folder]") {
  ShardedFolder folder("links");
  const auto outside = folder.root / "elsewhere.safetensors";
  fs::rename(folder.dir / folder.shard_names[1], outside);
  fs::create_symlink(outside, folder.dir / folder.shard_names[1]);
  CHECK_THAT(error_of([&] { folder.load(); }),
             Catch::Contains("weight_map['" + folder.shard_tensors[1].front() + "'] is '" + folder.shard_names[1] +
                             "', a link to " + fs::canonical(outside).string() + ", outside the model folder"));

  // A link to a file inside the folder is the folder's own data.
  fs::remove(folder.dir / folder.shard_names[1]);
  fs::rename(outside, folder.dir / "blob.bin");
  fs::create_symlink("blob.bin", folder.dir / folder.shard_names[1]);
  CHECK(error_of([&] { folder.load(); }) == "no error");
  folder.check_weights_equal();

  // model.safetensors itself may not lead out either.
  const auto single = fresh_dir("single-link");
  const auto elsewhere = fresh_dir("single-link-target");
  mt::llama::save_pretrained(folder.saved, elsewhere);
  fs::copy_file(elsewhere / "config.json", single / "config.json");
  fs::create_symlink(elsewhere / "model.safetensors", single / "model.safetensors");
  mt::llama::LlamaForCausalLM model(folder.saved->config);
  CHECK_THAT(error_of([&] { mt::llama::load_pretrained_weights(model, single); }),
             Catch::Contains("the weights file is 'model.safetensors', a link to") &&
                 Catch::Contains("outside the model folder"));

  // huggingface_hub's cache: <repo>/snapshots/<revision>/model.safetensors -> ../../blobs/<hash>.
  const auto repo = fresh_dir("hf-cache") / "models--meta--tiny";
  fs::create_directories(repo / "blobs");
  fs::create_directories(repo / "snapshots" / "abc123");
  fs::copy_file(elsewhere / "model.safetensors", repo / "blobs" / "0f1e2d");
  fs::create_symlink("../../blobs/0f1e2d", repo / "snapshots" / "abc123" / "model.safetensors");
  CHECK(error_of([&] { mt::llama::load_pretrained_weights(model, repo / "snapshots" / "abc123"); }) == "no error");
  fs::remove_all(single);
  fs::remove_all(elsewhere);
  fs::remove_all(repo.parent_path());
}

TEST_CASE("config.json is read only inside the model folder, as a regular file", "[folder]") {
  const auto dir = fresh_dir("config-links");
  const auto outside = fresh_dir("config-links-outside");
  const std::string config = R"({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "vocab_size": 300})";
  write_file(outside / "config.json", config);
  // A link to a config elsewhere is refused before it is read (it used to be followed anywhere).
  fs::create_symlink(outside / "config.json", dir / "config.json");
  CHECK_THAT(error_of([&] { mt::llama::resolve_model(dir.string()); }),
             Catch::Contains("the config file is 'config.json', a link to " +
                             fs::canonical(outside / "config.json").string() + ", outside the model folder"));
  // One inside the folder is the folder's own.
  fs::remove(dir / "config.json");
  write_file(dir / "real.json", config);
  fs::create_symlink("real.json", dir / "config.json");
  CHECK(mt::llama::resolve_model(dir.string()).hidden_size == 64);
  // A directory named config.json, and a number out of range, are named errors (they used to end
  // in a raw std::ios_base::failure and nlohmann::out_of_range).
  fs::remove(dir / "config.json");
  fs::create_directory(dir / "config.json");
  CHECK_THAT(error_of([&] { mt::llama::resolve_model(dir.string()); }),
             Catch::Contains("'config.json', which is not a regular file"));
  fs::remove(dir / "config.json");
  write_file(dir / "config.json", R"({"hidden_size": 1e999, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "vocab_size": 300})");
  CHECK_THAT(error_of([&] { mt::llama::resolve_model(dir.string()); }),
             Catch::StartsWith((dir / "config.json").string() + ":"));
  fs::remove_all(dir);
  fs::remove_all(outside);
}

TEST_CASE("weight_map is honoured: each tensor comes from the shard it names, nothing else is accepted", "[folder]") {
  ShardedFolder folder("weight-map");
  CHECK(error_of([&] { folder.load(); }) == "no error");
  folder.check_weights_equal();
  const std::string first = folder.shard_tensors[0].front();

  SECTION("a tensor held by two shards") {
    // Before the fix the later shard silently won; here the second shard holds different values.
    auto tensors = folder.shard_contents(1);
    tensors.emplace_back(first, torch::full_like(folder.saved->named_parameters()[first], 7.0));
    mt::io::save_safetensors(folder.dir / folder.shard_names[1], tensors);
    CHECK_THAT(error_of([&] { folder.load(); }),
               Catch::Contains(folder.shard_names[1] + ": holds tensor '" + first + "', which the weight_map of " +
                               (folder.dir / "model.safetensors.index.json").string() + " places in '" +
                               folder.shard_names[0] + "'"));
  }
  SECTION("weight_map names a shard that lacks the tensor") {
    folder.write_index([&](nlohmann::json& map) { map[first] = folder.shard_names[1]; });
    CHECK_THAT(error_of([&] { folder.load(); }), Catch::Contains("holds tensor '" + first + "'") &&
                                                     Catch::Contains("places in '" + folder.shard_names[1] + "'"));
  }
  SECTION("a shard holds a tensor weight_map does not list") {
    folder.write_index([&](nlohmann::json& map) { map.erase(first); });
    CHECK_THAT(
        error_of([&] { folder.load(); }),
        Catch::Contains("holds tensor '" + first + "', which the weight_map of") && Catch::Contains("does not list"));
  }
  SECTION("weight_map lists a tensor no shard holds") {
    folder.write_index([&](nlohmann::json& map) { map["model.extra.weight"] = folder.shard_names[0]; });
    CHECK_THAT(error_of([&] { folder.load(); }), Catch::Contains("weight_map places tensor 'model.extra.weight' in '" +
                                                                 folder.shard_names[0] + "', which does not hold it"));
  }
  SECTION("weight_map lists a tensor twice") {
    auto text = folder.index_json().dump();
    text.insert(text.find("\"weight_map\":{") + 14, "\"" + first + "\":\"" + folder.shard_names[1] + "\",");
    write_file(folder.dir / "model.safetensors.index.json", text);
    CHECK_THAT(error_of([&] { folder.load(); }),
               Catch::Contains("model.safetensors.index.json: 'weight_map' names '" + first + "' twice"));
  }
  SECTION("a weight_map entry that is not a file name") {
    folder.write_index([&](nlohmann::json& map) { map[first] = 3; });
    CHECK_THAT(error_of([&] { folder.load(); }),
               Catch::Contains("weight_map['" + first + "'] must be a shard's file name, got 3"));
  }
  SECTION("a directory or a missing file as a shard") {
    fs::remove(folder.dir / folder.shard_names[1]);
    CHECK_THAT(error_of([&] { folder.load(); }),
               Catch::Contains("is '" + folder.shard_names[1] + "', which does not exist in"));
    fs::create_directory(folder.dir / folder.shard_names[1]);
    CHECK_THAT(error_of([&] { folder.load(); }),
               Catch::Contains("is '" + folder.shard_names[1] + "', which is not a regular file"));
  }
}

TEST_CASE("a safetensors header naming one tensor twice is refused", "[safetensors]") {
  const auto dir = fresh_dir("duplicate-tensor");
  const auto path = dir / "x.safetensors";
  write_safetensors_with_header(path,
                                R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                    "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                                8);
  CHECK_THAT(error_of([&] { mt::io::load_safetensors(path); }),
             Catch::Contains(path.string() + ": the header names 'w' twice"));
  // The same name nested inside a tensor's entry is not a repeat.
  write_safetensors_with_header(path,
                                R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "v": )"
                                R"({"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                                8);
  CHECK(mt::io::load_safetensors(path).tensors.size() == 2);
  fs::remove_all(dir);
}

TEST_CASE("safetensors shapes are checked before allocation, without overflow", "[safetensors]") {
  const auto dir = fresh_dir("huge-shape");
  const auto path = dir / "x.safetensors";
  // 2^62 x 4 float32 = 2^66 bytes wraps to 0 in 64 bits: before the fix the empty data range
  // matched and LibTorch was asked for the tensor.
  write_safetensors_with_header(path,
                                R"({"w": {"dtype": "F32", "shape": [4611686018427387904, 4], )"
                                R"("data_offsets": [0, 0]}})",
                                0);
  CHECK_THAT(error_of([&] { mt::io::load_safetensors(path); }),
             Catch::Contains("tensor 'w': shape [4611686018427387904,4] holds more than 2^64 bytes"));
  write_safetensors_with_header(path,
                                R"({"w": {"dtype": "U8", "shape": [18446744073709551615, 0], )"
                                R"("data_offsets": [0, 0]}})",
                                0);
  CHECK_THAT(error_of([&] { mt::io::load_safetensors(path); }),
             Catch::Contains("must be a list of non-negative 64-bit integers"));
  // No bytes, but strides of 2^124: LibTorch threw its own error (found by the longer fuzz run).
  write_safetensors_with_header(path,
                                R"({"w": {"dtype": "F32", "shape": [0, 4611686018427387904, )"
                                R"(4611686018427387904], "data_offsets": [0, 0]}})",
                                0);
  CHECK_THAT(error_of([&] { mt::io::load_safetensors(path); }),
             Catch::Contains("tensor 'w': shape [0,4611686018427387904,4611686018427387904] is too large: its strides "
                             "overflow 64 bits"));
  write_safetensors_with_header(path,
                                R"({"w": {"dtype": "F32", "shape": [0, 4611686018427387904], )"
                                R"("data_offsets": [0, 0]}})",
                                0);
  CHECK(mt::io::load_safetensors(path).tensors.at(0).second.size(1) == 4611686018427387904);
  // A directory where a file belongs names the path (before: a raw filesystem_error).
  fs::create_directory(dir / "d.safetensors");
  CHECK(error_of([&] { mt::io::load_safetensors(dir / "d.safetensors"); }) ==
        (dir / "d.safetensors").string() + ": not a regular file (a directory, device or pipe)");
  fs::remove_all(dir);
}

TEST_CASE("configs too large for any run are refused up front, naming the field", "[config]") {
  auto config = mt::llama::presets::llama_tiny;
  config.hidden_size = 1'000'000'000'000;  // 10^12
  CHECK_THAT(error_of([&] { mt::llama::validate(config, "config.json"); }),
             Catch::Matches("config\\.json: hidden_size 1000000000000 makes a model of 1\\.2e\\+25 parameters, which "
                            "needs 48\\.0 YB of float32 weights; meshtorch refuses configs over 10\\^13 "
                            "parameters \\(40\\.0 TB in float32\\), more than any run can hold"));
  config = mt::llama::presets::llama_tiny;
  config.num_hidden_layers = 1'000'000'000;  // 10^9 layers of llama-tiny: 2e14 parameters, 790 TB
  CHECK_THAT(error_of([&] { mt::llama::validate(config, "config.json"); }),
             Catch::Contains("num_hidden_layers 1000000000 makes a model of 2e+14 parameters, which needs 787.5 TB"));
  // Building the model checks first: nothing is allocated (before the fix: bad_alloc after minutes).
  CHECK_THAT(error_of([&] { mt::llama::LlamaForCausalLM model(config); }), Catch::Contains("num_hidden_layers"));

  // 2^31 overflowed the products (and meshtorch-plan): the overflow itself is caught.
  config = mt::llama::presets::llama_tiny;
  config.hidden_size = std::int64_t{1} << 31;
  CHECK_FALSE(config.parameter_counts());
  CHECK_THAT(error_of([&] { mt::llama::validate(config, "c"); }), Catch::StartsWith("c: hidden_size 2147483648 makes"));
  config.hidden_size = std::int64_t{1} << 62;
  config.head_dim = 2;
  CHECK_THAT(error_of([&] { mt::llama::validate(config, "c"); }),
             Catch::StartsWith("c: hidden_size 4611686018427387904"));

  // The largest real model and one just under the bound pass, with exact counts.
  CHECK(mt::llama::presets::llama_3_1_405b.num_parameters() == 405'853'388'800);
  CHECK_FALSE(mt::llama::first_invalid_field(mt::llama::presets::llama_3_1_405b));
  auto large = mt::llama::presets::llama_3_1_405b;
  large.num_hidden_layers = 3000;  // 9.56e12 parameters
  CHECK(large.num_parameters() < mt::llama::max_parameters);
  CHECK_FALSE(mt::llama::first_invalid_field(large));
  large.num_hidden_layers = 3200;  // 1.02e13
  CHECK(mt::llama::first_invalid_field(large) == mt::llama::too_many_parameters);

  // Through config.json, as a user meets it.
  const auto dir = fresh_dir("huge-config");
  write_file(dir / "config.json", R"({"hidden_size": 1000000000000, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 8, "vocab_size": 300})");
  CHECK_THAT(error_of([&] { mt::llama::resolve_model(dir.string()); }),
             Catch::StartsWith((dir / "config.json").string() + ": hidden_size 1000000000000 makes a model of"));
  fs::remove_all(dir);
}

TEST_CASE("a state.json field of the wrong type names the file and the field", "[state]") {
  const auto dir = fresh_dir("state-types");
  const mt::train::RunIdentity identity{.seed = 4, .seq_length = 8, .global_batch = 2, .dataset = "d", .model = "m"};
  const auto state_json = [&] {
    return mt::train::to_json(mt::train::TrainState{.epoch = 1, .global_step = 20}, identity);
  };
  const auto path = (dir / "state.json").string();
  auto error_with = [&](const auto& change) {
    auto j = state_json();
    change(j);
    write_file(dir / "state.json", j.dump());
    return error_of([&] { mt::train::read_train_state(dir, identity); });
  };
  CHECK(error_with([](auto&) {}) == "no error");
  CHECK(error_with([](auto& j) { j["epoch"] = "1"; }) ==
        path + ": field 'epoch' must be a non-negative integer, got \"1\"");
  CHECK(error_with([](auto& j) { j["global_step"] = -5; }) ==
        path + ": field 'global_step' must be a non-negative integer, got -5");
  CHECK(error_with([](auto& j) { j["running_loss"] = nullptr; }) ==
        path + ": field 'running_loss' must be a number, got null");
  CHECK(error_with([](auto& j) { j["run"] = 3; }) == path + ": field 'run' must be an object, got 3");
  CHECK(error_with([](auto& j) { j["run"]["seed"] = -4; }) ==
        path + ": field 'run.seed' must be a non-negative integer, got -4");
  CHECK(error_with([](auto& j) { j["run"]["dataset"] = 1; }) == path + ": field 'run.dataset' must be a string, got 1");
  CHECK(error_with([](auto& j) { j["run"]["seq_length"] = 8.5; }) ==
        path + ": field 'run.seq_length' must be a non-negative integer, got 8.5");
  CHECK(error_with([](auto& j) { j = nlohmann::ordered_json::array(); }) ==
        path + ": expected a JSON object at the top level");
  fs::remove(dir / "state.json");
  fs::create_directory(dir / "state.json");
  CHECK(error_of([&] { mt::train::read_train_state(dir, identity); }) ==
        path + ": not a regular file (a directory, device or pipe)");
  fs::remove_all(dir);
}

TEST_CASE("a damaged llm.c .bin dataset names the file and what is wrong", "[data]") {
  const auto dir = fresh_dir("bin");
  const auto path = dir / "tokens.bin";
  auto write_bin = [&](std::int32_t count, std::size_t tokens_written, std::size_t header_bytes = 1024) {
    std::int32_t header[256] = {20240520, 1, count};
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(header), static_cast<std::streamsize>(header_bytes));
    const std::vector<std::uint16_t> tokens(tokens_written, 7);
    out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
  };
  auto error = [&] { return error_of([&] { mt::data::load_dataset(path.string(), 4); }); };
  write_bin(16, 16);
  CHECK(error() == "no error");
  write_bin(-3, 16);
  CHECK(error() == path.string() + ": the header's token count is negative (-3)");
  write_bin(16, 10);
  CHECK(error() ==
        path.string() +
            ": the header says 16 tokens (32 bytes) but the file holds 20 bytes after the header (truncated?)");
  // Cut inside the header: the magic number is right, the file is short (before: "magic number
  // 20240520, expected 20240520").
  write_bin(16, 0, 100);
  CHECK(error() ==
        path.string() + ": 100 bytes, shorter than the 1024-byte header of an llm.c token file (truncated?)");
  // A folder is a data set of its files; one with none is refused by name.
  fs::remove(path);
  fs::create_directory(path);
  CHECK(error() == "-d/--dataset-name '" + path.string() + "': the folder holds no .txt, .jsonl, .json or .bin file");
  fs::remove_all(dir);
}

TEST_CASE("JSON nested 100,000 deep or with a repeated key is refused by name, not a stack overflow", "[json]") {
  const auto dir = fresh_dir("deep-json");
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  write_safetensors_with_header(dir / "x.safetensors",
                                R"({"w": {"dtype": "F32", "shape": )" + deep + R"(, "data_offsets": [0, 4]}})", 4);
  CHECK(error_of([&] { mt::io::load_safetensors(dir / "x.safetensors"); }) ==
        (dir / "x.safetensors").string() + ": nested deeper than 64 levels");
  write_file(dir / "state.json", R"({"epoch": )" + deep + "}");
  CHECK(error_of([&] { mt::train::read_train_state(dir, {}); }) ==
        (dir / "state.json").string() + ": nested deeper than 64 levels");
  CHECK(error_of([] { mt::io::parse_json(R"({"a": [{"b": 1, "b": 2}]})", "f.json"); }) ==
        "f.json: an element of 'a' names 'b' twice");
  CHECK(error_of([] { mt::io::parse_json(R"({"a": {"b": 1}, "c": {"b": 2}})", "f.json"); }) == "no error");
  fs::remove_all(dir);
}
