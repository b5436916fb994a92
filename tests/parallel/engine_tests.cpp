// The DeepSpeed config (train/deepspeed_config.hpp) and the engine's start-up checks
// (parallel/engine.hpp), in one process: what each key becomes, and the key path of each refusal.
#include <catch2/catch.hpp>

#include <meshtorch/parallel/engine.hpp>
#include <meshtorch/train/deepspeed_config.hpp>

namespace mt = meshtorch;

namespace {

mt::train::DeepSpeedConfig parse(const std::string& text) {
  return mt::train::DeepSpeedConfig::parse(nlohmann::json::parse(text), "ds_config.json");
}

}  // namespace

TEST_CASE("a DeepSpeed config's keys become the engine's settings", "[single][deepspeed]") {
  auto c = parse(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                     "bf16": {"enabled": true},
                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                                                               "weight_decay": 0.1}},
                     "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10,
                                                                         "warmup_max_lr": 2e-4, "warmup_type": "linear"}},
                     "zero_optimization": {"stage": 2, "overlap_comm": false, "contiguous_gradients": true,
                                           "reduce_bucket_size": 5e8},
                     "gradient_clipping": 1.0, "steps_per_print": 7})");
  CHECK(c.bf16);
  CHECK(c.optimizer.lr == 1e-4);
  CHECK(c.optimizer.beta1 == 0.8);
  CHECK(c.optimizer.beta2 == 0.95);
  CHECK(c.optimizer.eps == 1e-6);
  CHECK(c.optimizer.weight_decay == 0.1);
  CHECK(c.zero_stage == 2);
  CHECK_FALSE(c.overlap_comm);
  CHECK(c.reduce_bucket_size == 500000000);  // 5e8 is a whole number: an integer
  CHECK(c.gradient_clipping == 1.0);
  CHECK(c.steps_per_print == 7);
  // Any two batch sizes give the third: 32 / (4 x 4 ranks) = 2 accumulation steps.
  c.resolve_batch(4);
  CHECK(c.gradient_accumulation_steps == 2);
  // WarmupDecayLR rises linearly to warmup_max_lr over 10 steps, then falls linearly to 0 at 100.
  const auto schedule = c.schedule();
  CHECK(schedule.lr_at(0) == Approx(0.0));
  CHECK(schedule.lr_at(5) == Approx(1e-4));
  CHECK(schedule.lr_at(10) == Approx(2e-4));
  CHECK(schedule.lr_at(55) == Approx(1e-4));
  CHECK(schedule.lr_at(100) == Approx(0.0));

  auto only_micro = parse(R"({"train_micro_batch_size_per_gpu": 3})");
  only_micro.resolve_batch(2);
  CHECK(only_micro.gradient_accumulation_steps == 1);
  CHECK(only_micro.train_batch_size == 6);
  CHECK(only_micro.zero_stage == 0);
  CHECK(only_micro.schedule().lr_at(50) == Approx(1e-3));  // no scheduler: the optimizer's rate throughout

  auto only_total = parse(R"({"train_batch_size": 16, "gradient_accumulation_steps": 4})");
  only_total.resolve_batch(2);
  CHECK(only_total.micro_batch_per_gpu == 2);

  // WarmupCosineLR: DeepSpeed's ratio of the optimizer's lr.
  auto cosine = parse(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                          "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_num_steps": 4,
                          "warmup_type": "linear", "warmup_min_ratio": 0.5, "cos_min_ratio": 0.1}}})");
  CHECK(cosine.schedule().lr_at(0) == Approx(5e-4));
  CHECK(cosine.schedule().lr_at(2) == Approx(7.5e-4));
  CHECK(cosine.schedule().lr_at(19) == Approx(1e-4));

  // Optimizer offload alone (ZeRO-Offload) moves AdamW to the host; with the parameters
  // offloaded too, FSDP's shards are host tensors and AdamW steps them where they are.
  CHECK_FALSE(c.optimizer.offload);
  auto zero_offload = parse(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2,
                                "offload_optimizer": {"device": "cpu", "pin_memory": true}}})");
  CHECK(zero_offload.offload_optimizer);
  CHECK_FALSE(zero_offload.offload_param);
  CHECK(zero_offload.optimizer.offload);
  auto both = parse(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
                        "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}})");
  CHECK(both.offload_param);
  CHECK_FALSE(both.optimizer.offload);
}

TEST_CASE("a DeepSpeed config refuses wrong types, unknown keys and impossible combinations by key path",
          "[single][deepspeed]") {
  const auto fails = [](const std::string& text, const std::string& message) {
    INFO(text);
    CHECK_THROWS_WITH(parse(text), Catch::Contains(message));
  };
  fails(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 4}})",
        "ds_config.json: zero_optimization.stage: 4 is out of range; expected an integer 0-3");
  fails(R"({"train_micro_batch_size_per_gpu": 2.5})",
        "train_micro_batch_size_per_gpu: expected an integer >= 1, got 2.5 (a number)");
  fails(R"({"train_micro_batch_size_per_gpu": true})", "train_micro_batch_size_per_gpu: expected an integer");
  fails(R"({"train_micro_batch_size_per_gpu": 2, "bf16": true})", "bf16: expected an object, got a boolean");
  fails(
      R"({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "amsgrad": true}}})",
      "optimizer.params.amsgrad: not a key meshtorch implements");
  fails(R"({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}})",
        "optimizer.params.betas: expected two numbers [a, b], got [0.9]");
  fails(
      R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})",
      "zero_optimization.offload_optimizer: offload_param without it is not implemented");
  fails(
      R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})",
      "zero_optimization.offload_optimizer: optimizer offload needs ZeRO stage 1, 2 or 3, as in DeepSpeed; stage is 0");
  fails(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1, "overlap_comm": true}})",
        "zero_optimization.overlap_comm applies to stage 2 here");
  fails(R"({"train_micro_batch_size_per_gpu": 2, "scheduler": {"type": "WarmupCosineLR", "params": {}}})",
        "scheduler.params.total_num_steps is required for WarmupCosineLR");
  fails(R"({"gradient_accumulation_steps": 2})", "train_micro_batch_size_per_gpu (or train_batch_size) is required");
  fails(
      R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})",
      "zero_optimization.offload_optimizer.device: nvme offload is not implemented");

  auto inconsistent =
      parse(R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})");
  CHECK_THROWS_WITH(inconsistent.resolve_batch(2),
                    Catch::Contains("train_batch_size 10 is not train_micro_batch_size_per_gpu 2 x "
                                    "gradient_accumulation_steps 2 x 2 data-parallel ranks = 8"));
  auto indivisible = parse(R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})");
  CHECK_THROWS_WITH(indivisible.resolve_batch(2), Catch::Contains("train_batch_size 10 is not a multiple of"));
}

TEST_CASE("an engine refuses a stage its mesh cannot hold, before anything starts", "[single][deepspeed]") {
  mt::train::TrainArgs args;
  // Stage 3 with parameter offload on a mesh without FSDP: nothing to shard the weights over.
  auto offloaded = parse(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
                             "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}})");
  CHECK_THROWS_WITH((mt::Engine<mt::Mesh<mt::DP<mt::dynamic>>>(args, offloaded)),
                    Catch::Contains("zero_optimization.stage: 3 shards the weights, which needs a mesh with an FSDP "
                                    "axis; this engine's mesh is Mesh<DP") &&
                        Catch::Contains("zero_optimization.offload_param offloads those shards"));
  auto stage2 = parse(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})");
  CHECK_THROWS_WITH((mt::Engine<mt::Mesh<mt::FSDP<mt::dynamic>>>(args, stage2)),
                    Catch::Contains("zero_optimization.stage: 2 keeps whole weights on every rank"));
}
