// User-given integers that overflow where they are multiplied, DeepSpeed config messages that
// must keep what follows a NUL and print values as written, and a metrics file torn by a full
// disk. Each failed before its fix (SIGFPE, a message cut short or wrapped, two records on a line).
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <meshtorch/data/sampler.hpp>
#include <meshtorch/meshtorch.hpp>
#include <meshtorch/parallel/training_data.hpp>
#include <meshtorch/train/deepspeed_config.hpp>
#include <meshtorch/train/lr_schedule.hpp>
#include <meshtorch/train/metrics.hpp>

#include "input_support.hpp"

namespace mt = meshtorch;
namespace fs = std::filesystem;
using meshtorch::testing::error_of;
using meshtorch::testing::fresh_dir;
using meshtorch::testing::write_file;

namespace bounds_tests {

inline std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace bounds_tests

TEST_CASE("a global batch that overflows 64 bits is refused naming the flags, not a division by zero", "[bounds]") {
  // 4 x 2^62 wraps to 0, which the sampler divided by (SIGFPE).
  CHECK(error_of([] {
          mt::data::DpInvariantSampler({1000, 4, 1, 0, std::int64_t{1} << 62, 0});
        }) ==
        "the global batch -b/--batch-size 4 x 1 data-parallel rank(s) x --grad-accum 4611686018427387904 overflows a "
        "64-bit integer; it must be at most the dataset's 1000 blocks");
  CHECK_THAT(error_of([] {
               mt::data::DpInvariantSampler({1000, std::int64_t{1} << 62, 4, 0, 1, 0});
             }),
             Catch::Contains("-b/--batch-size 4611686018427387904 x 4 data-parallel rank(s) x --grad-accum 1 "
                             "overflows"));
  // Large but not overflowing: the data set's size is the bound.
  CHECK_THAT(error_of([] {
               mt::data::DpInvariantSampler({1000, 4, 1, 0, std::int64_t{1} << 40, 0});
             }),
             Catch::Contains("do not fill one global batch of 4398046511104"));

  // Chapter 8's DeepSpeed fields: the same product, named by its keys.
  auto config = mt::train::DeepSpeedConfig::parse(
      nlohmann::json::parse(
          R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4611686018427387904})"),
      "ds_config.json");
  CHECK(error_of([&] { config.resolve_batch(1); }) ==
        "ds_config.json: train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel ranks = 4 x "
        "4611686018427387904 x 1 overflows a 64-bit integer (at most 9223372036854775807); no data set holds that "
        "many samples");
  auto by_total = mt::train::DeepSpeedConfig::parse(
      nlohmann::json::parse(R"({"train_batch_size": 8, "gradient_accumulation_steps": 4611686018427387904})"),
      "ds_config.json");
  CHECK_THAT(error_of([&] { by_total.resolve_batch(4); }),
             Catch::Contains("gradient_accumulation_steps x data-parallel ranks = 4611686018427387904 x 4 overflows"));
  auto micro_only = mt::train::DeepSpeedConfig::parse(
      nlohmann::json::parse(R"({"train_micro_batch_size_per_gpu": 4611686018427387904})"), "ds_config.json");
  CHECK_THAT(error_of([&] { micro_only.resolve_batch(2); }),
             Catch::Contains("train_micro_batch_size_per_gpu x data-parallel ranks = 4611686018427387904 x 2 "
                             "overflows"));

  // Every epoch's steps saturate instead of wrapping negative; a step's tokens overflow by name.
  mt::train::TrainArgs args;
  args.lr_schedule = "warmup-cosine";
  args.num_epochs = std::int64_t{1} << 62;
  CHECK(error_of([&] { mt::train::lr_schedule(args, 100); }) == "no error");
  args.seq_length = 64;
  CHECK(error_of([&] { mt::train::Experiment(args, 0, std::int64_t{1} << 62, torch::kCPU); }) ==
        "a global batch of 4611686018427387904 sequences x -s/--seq-length 64 overflows a 64-bit integer (at most "
        "9223372036854775807 tokens per step)");
}

TEST_CASE("DeepSpeed config messages keep what follows a NUL and print numbers as written", "[bounds]") {
  const auto dir = fresh_dir("bounds-deepspeed");
  write_file(dir / "ds_config.json", "{\"train_micro_batch_size_per_gpu\": 2, \"a\\u0000b\": 1}");
  CHECK_THAT(error_of([&] { mt::train::DeepSpeedConfig::read(dir / "ds_config.json"); }),
             Catch::StartsWith("ds_config.json: a\\u0000b: not a key meshtorch implements; the keys read here are: "));
  write_file(dir / "ds_config.json",
             "{\"train_micro_batch_size_per_gpu\": 2, \"bf16\": {\"enabled\": true, \"x\\ny\\u0000z\": 1}}");
  CHECK_THAT(error_of([&] { mt::train::DeepSpeedConfig::read(dir / "ds_config.json"); }),
             Catch::StartsWith("ds_config.json: bf16.x\\ny\\u0000z: not a key meshtorch implements"));

  // 2^64 - 1 was printed wrapped, as -1.
  CHECK(error_of([] {
          mt::train::DeepSpeedConfig::parse(
              nlohmann::json::parse(
                  R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 18446744073709551615}})"),
              "ds_config.json");
        }) == "ds_config.json: zero_optimization.stage: 18446744073709551615 is out of range; expected an integer 0-3");
  CHECK(error_of([] {
          mt::train::DeepSpeedConfig::parse(
              nlohmann::json::parse(R"({"train_micro_batch_size_per_gpu": 9223372036854775808})"), "ds_config.json");
        }) ==
        "ds_config.json: train_micro_batch_size_per_gpu: 9223372036854775808 is out of range; expected an "
        "integer >= 1");
  // A value that is not UTF-8 is printed with U+FFFD, not a raw nlohmann exception.
  CHECK_THAT(error_of([] {
               mt::train::DeepSpeedConfig::parse(
                   nlohmann::json{{"train_micro_batch_size_per_gpu", 2}, {"bf16", {{"enabled", "\xff\xfe"}}}},
                   "ds_config.json");
             }),
             Catch::Contains("ds_config.json: bf16.enabled: expected true or false, got \"\xef\xbf\xbd\xef\xbf\xbd\""));
}

TEST_CASE("a metrics line torn by a full disk is completed before the next record is appended", "[bounds]") {
  const auto dir = fresh_dir("bounds-metrics");
  const auto path = dir / "metrics.jsonl";
  const std::string first = R"({"global_step":1,"lr":0.1})";
  const auto next = nlohmann::ordered_json{{"global_step", 3}, {"lr", 0.3}};

  // A torn record: cut from the file, set aside in metrics.discarded.jsonl, the next on its own line.
  write_file(path, first + "\n" + R"({"global_step":2,"l)");
  {
    mt::train::MetricsFile metrics(path);
    metrics.append(next);
  }
  CHECK(bounds_tests::read_text(path) == first + "\n" + next.dump() + "\n");
  CHECK(bounds_tests::read_text(dir / "metrics.discarded.jsonl") == R"({"global_step":2,"l)"
                                                                    "\n");

  // A whole record that only lost its newline is kept.
  fs::remove(dir / "metrics.discarded.jsonl");
  write_file(path, first + "\n" + R"({"global_step":2})");
  {
    mt::train::MetricsFile metrics(path);
    metrics.append(next);
  }
  CHECK(bounds_tests::read_text(path) == first + "\n" +
                                             R"({"global_step":2})"
                                             "\n" +
                                             next.dump() + "\n");
  CHECK(!fs::exists(dir / "metrics.discarded.jsonl"));

  // No newline at all, longer than the 64 KiB block read back at a time.
  const std::string long_torn = "{\"x\":\"" + std::string(200'000, 'a');
  write_file(path, long_torn);
  {
    mt::train::MetricsFile metrics(path);
    metrics.append(next);
  }
  CHECK(bounds_tests::read_text(path) == next.dump() + "\n");
  CHECK(bounds_tests::read_text(dir / "metrics.discarded.jsonl") == long_torn + "\n");
}

TEST_CASE("a --global-batch-size whose micro-batch overflows 64 bits is refused, not divided by", "[bounds]") {
  mt::train::TrainArgs args;
  args.global_batch_size = 8;
  args.batch_size = std::int64_t{1} << 62;  // x 4 ranks wraps to 0, which the step's micro-batches divided by
  CHECK(error_of([&] { mt::micro_batches_per_step(args, 4); }) ==
        "-b 4611686018427387904 x 4 data-parallel rank(s) overflows a 64-bit integer or is not positive; "
        "--global-batch-size 8 needs a micro-batch between 1 and itself");
  args.batch_size = 2;
  CHECK(mt::micro_batches_per_step(args, 4) == 1);
}
