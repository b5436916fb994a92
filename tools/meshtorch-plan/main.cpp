// meshtorch-plan: what a Llama model costs each rank of a mesh, before launching anything.
//
//   meshtorch-plan -m llama-3.1-70b --world 64 --tp 8 --data-parallel fsdp --dtype bfloat16
//   meshtorch-plan -m llama-3.1-405b --world 64 --dtype float32 --compute-dtype bfloat16 \
//       --seq-length 4096 --activation-checkpointing full --cpu-offload --timeline
//
// Prints the tensor-parallel plan (chapter 6's), whether the model splits over the TP size
// (the same check the examples run at start-up), and per rank: parameters, and bytes of weights,
// gradients and AdamW state under DDP, ZeRO-1/2 or FSDP over the data-parallel ranks, the
// largest unit that is gathered whole, and the device memory over one step
// (models/llama/memory_plan.hpp: the trained state, gathered units, reductions in flight,
// activations, the loss), each part at its largest and at the step's peak, the most the device
// holds at one moment of the step's timeline; --timeline prints that timeline, one line per event
// (the layers between each pass's first and last two collapsed). --json prints the same figures
// as one JSON object (with --timeline, every event). No LibTorch: it is arithmetic on the config.
//
//   meshtorch-plan --pp 4 --schedule interleaved-1f1b --stages-per-rank 2 --microbatches 8 --show-schedule
//
// prints a pipeline schedule instead (layout/pipeline_schedule.hpp): checked as the run would
// check it at start-up, its bubble (the idle share of the table) and, with --show-schedule, the
// grid of actions per rank and tick, and the memory of each stage and rank (models/llama/stage_memory.hpp).
//
//   meshtorch-plan -m llama-3.1-8b --world 8 --cp 4 --seq-length 131072 --cp-rotate ring
//
// splits every sequence over 4 context-parallel ranks: the activations are those of 1/4 of the
// positions (FSDP shards over the FSDP x CP ranks), and it prints what each method sends per layer
// (models/llama/context_exchange.hpp).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/layout/context_split.hpp>
#include <meshtorch/layout/pipeline_schedule.hpp>
#include <meshtorch/layout/pipeline_split.hpp>
#include <meshtorch/models/llama/config_json.hpp>
#include <meshtorch/models/llama/context_exchange.hpp>
#include <meshtorch/models/llama/memory_plan.hpp>
#include <meshtorch/models/llama/plan.hpp>
#include <meshtorch/models/llama/stage_costs.hpp>
#include <meshtorch/models/llama/stage_memory.hpp>
#include <meshtorch/parallel/checkpoint_selection.hpp>

namespace mt = meshtorch;
namespace llama = meshtorch::llama;

namespace {

// The overflow-safe counts: validate() has refused any config whose counts leave int64.
mt::llama::TpRankParameters tp_rank_sizes(const llama::Config& c, std::int64_t tp) {
  const auto counts = c.parameter_counts();
  if (!counts) throw mt::ConfigError("the model's parameter count overflows 64 bits");
  return mt::llama::tp_rank_parameters(*counts, tp);
}

std::string human(double value, const char* unit) {
  const char* prefixes[] = {"", " K", " M", " G", " T"};
  int i = 0;
  while (value >= 1000 && i < 4) value /= 1000, ++i;
  char out[64];
  std::snprintf(out, sizeof out, "%.3g%s%s", value, prefixes[i], unit);
  return out;
}

// -m's config, checked as a run checks it, with a TP split the plan can make.
llama::Config checked_config(const std::string& model, int tp) {
  auto config = llama::resolve_model(model);
  llama::validate(config, model);
  if (auto problem = llama::first_tp_problem<llama::SequenceParallelStyles>(config, tp))
    throw mt::ConfigError(model + ": " + std::string(*problem) + " (" + std::to_string(tp) + ")");
  return config;
}

// The run's dtypes (--dtype, --compute-dtype) and --activation-checkpointing into its shape.
void set_dtypes_and_checkpointing(mt::llama::RunShape& run, const std::string& dtype, const std::string& compute_dtype,
                                  const std::string& checkpointing) {
  run.state_bytes = dtype == "bfloat16" ? 2 : 4;
  run.compute_bytes = (compute_dtype.empty() ? dtype : compute_dtype) == "bfloat16" ? 2 : 4;
  run.checkpoint_every = mt::parse_activation_checkpointing(checkpointing).every;
}

std::string gigabytes(double bytes) {
  char out[32];
  std::snprintf(out, sizeof out, "%.2f GB", bytes / 1e9);
  return out;
}

// An event as the timeline prints it: "backward, layer 12: its reduce-scatter issued".
std::string event_label(const mt::llama::MemoryEvent& e) {
  std::string what(e.what);
  if (e.layer < 0) return what;
  const auto colon = what.find(": ");
  if (colon == std::string::npos) return what + " (layer " + std::to_string(e.layer) + ")";
  return what.substr(0, colon) + ", layer " + std::to_string(e.layer) + what.substr(colon);
}

// The timeline, one line per event, in GB. Each run of consecutive layers (forward's 0, 1, ...;
// backward's from the last down) prints its first two and last two layers whole and the ones
// between as one line, unless the peak is among them: that layer prints whole too.
void print_timeline(const std::vector<mt::llama::MemoryEvent>& events, std::size_t peak) {
  std::printf(
      "\ndevice memory after each event of the step (the layers between the first and last two of\n"
      "each pass collapsed; the peak marked):\n");
  const auto line = [&](std::size_t i) {
    std::printf("  %-80s %10s%s\n", event_label(events[i]).c_str(), gigabytes(events[i].live()).c_str(),
                i == peak ? "  <- peak" : "");
  };
  std::size_t i = 0;
  while (i < events.size()) {
    if (events[i].layer < 0) {
      line(i++);
      continue;
    }
    // The blocks of one pass: [begin, end) of each layer's consecutive events.
    std::vector<std::pair<std::size_t, std::size_t>> blocks;
    while (i < events.size() && events[i].layer >= 0) {
      const std::size_t begin = i;
      while (i < events.size() && events[i].layer == events[begin].layer) ++i;
      blocks.emplace_back(begin, i);
    }
    for (std::size_t k = 0; k < blocks.size();) {
      const auto whole = [&](std::size_t block) {
        return block < 2 || block + 2 >= blocks.size() || (peak >= blocks[block].first && peak < blocks[block].second);
      };
      if (whole(k)) {
        for (std::size_t e = blocks[k].first; e < blocks[k].second; ++e) line(e);
        ++k;
        continue;
      }
      const std::size_t first = k;
      double low = events[blocks[k].first].live(), high = low;
      for (; k < blocks.size() && !whole(k); ++k)
        for (std::size_t e = blocks[k].first; e < blocks[k].second; ++e)
          low = std::min(low, events[e].live()), high = std::max(high, events[e].live());
      const auto layer = [&](std::size_t block) { return events[blocks[block].first].layer; };
      std::printf("  %-80s %s to %s\n",
                  ("... layers " + std::to_string(layer(first)) + " to " + std::to_string(layer(k - 1)) + " (" +
                   std::to_string(k - first) + "), each as the layers around them")
                      .c_str(),
                  gigabytes(low).c_str(), gigabytes(high).c_str());
    }
  }
}

// The --schedule spellings, from the one list of them.
std::vector<std::string> schedule_names() {
  std::vector<std::string> names;
  for (const auto& [kind, name] : meshtorch::pp::schedule_flag_names) names.emplace_back(name);
  return names;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"meshtorch-plan: a Llama model's parameters and memory per rank of a mesh"};
  std::string model = "llama-tiny";
  int world = 1, tp = 1, cp = 1;
  std::string cp_rotate = "ring";
  std::string data_parallel = "fsdp", dtype = "bfloat16", compute_dtype, checkpointing = "none";
  mt::llama::RunShape run;
  bool json = false;
  app.add_option("-m,--model-name", model, "a preset (llama-tiny, llama-3.1-8b, ...) or a folder with config.json")
      ->capture_default_str();
  app.add_option("--world", world, "ranks in the job")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--tp", tp, "tensor-parallel size (divides --world)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--cp", cp, "context-parallel ranks each sequence is split over (divides --world / --tp)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  std::vector<std::string> rotations;
  for (const auto& [rotate, name] : mt::cp::rotate_names) rotations.emplace_back(name);
  app.add_option("--cp-rotate", cp_rotate, "--cp: keys and values passed around a ring, or gathered (allgather)")
      ->capture_default_str()
      ->check(CLI::IsMember(rotations));
  app.add_option(
         "--data-parallel", data_parallel,
         "what the other world/(tp x cp) ranks do: ddp (ZeRO stage 0), zero (stage 1: AdamW state sharded), zero2 "
         "(stage 2: gradients too) or fsdp (stage 3: weights too)")
      ->capture_default_str()
      ->check(CLI::IsMember({"ddp", "zero", "zero2", "fsdp"}));
  app.add_option("--dtype", dtype, "parameter dtype: float32 or bfloat16")
      ->capture_default_str()
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  app.add_option("--compute-dtype", compute_dtype, "forward and backward dtype (default: --dtype)")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  app.add_option("-s,--seq-length", run.seq, "positions per sequence")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("-b,--batch-size", run.batch, "sequences per data-parallel rank and micro-batch")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--activation-checkpointing", checkpointing, "none, full or k (every k-th decoder layer)")
      ->capture_default_str();
  app.add_flag("--cpu-offload", run.cpu_offload, "FSDP: weights, gradients and AdamW state in host memory");
  app.add_option("--prefetch-layers", run.prefetch_layers, "FSDP: layers gathered ahead of their turn")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_flag("!--no-reshard-after-forward", run.reshard_after_forward,
               "FSDP: keep every layer gathered from its forward to its backward");
  app.add_flag("--optimizer-offload", run.optimizer_offload,
               "AdamW's state and step in host memory, the weights and gradients on the device")
      ->excludes("--cpu-offload");
  app.add_flag("--optimizer-in-backward", run.optimizer_in_backward,
               "FSDP: AdamW steps each layer as its gradients arrive, so one layer's gradients are held, not all");
  app.add_option("--loss-chunk", run.loss_chunk, "positions per loss chunk: -1 automatic, 0 all at once")
      ->capture_default_str();
  app.add_flag("--json", json, "print the figures as one JSON object (bytes)");
  bool timeline = false;
  app.add_flag("--timeline", timeline,
               "print the device memory after each event of one step (with --json: every event, in bytes)");
  int pp = 1, stages_per_rank = 1, microbatches = 0;
  std::string schedule;
  bool show_schedule = false;
  app.add_option("--schedule", schedule,
                 "print this pipeline schedule instead of the memory figures: gpipe, 1f1b, interleaved-1f1b or zbv")
      ->check(CLI::IsMember(schedule_names()));
  app.add_option("--pp", pp, "--schedule: pipeline ranks")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--stages-per-rank", stages_per_rank, "--schedule: stages each pipeline rank holds")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--microbatches", microbatches, "--schedule: micro-batches per step (default: --pp)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--show-schedule", show_schedule, "--schedule: print the grid of actions per rank and tick");
  CLI11_PARSE(app, argc, argv);

  if (!schedule.empty()) {
    try {
      namespace pp_ = meshtorch::pp;
      const auto kind = *pp_::parse_schedule_flag(schedule);
      // The ranks beside the pipeline's and TP's: FSDP inside the stages (--layout fsdp, gathering a
      // stage at a time under --no-reshard-after-forward, as the run's table then does) or DDP's
      // replicas. Without --world, one pipeline.
      const bool world_given = app.count("--world") > 0;
      if (world_given && world % (pp * tp) != 0)
        throw mt::ConfigError("--world " + std::to_string(world) + " is not a multiple of --pp " + std::to_string(pp) +
                              " x --tp " + std::to_string(tp));
      const std::int64_t data_parallel_ranks = world_given ? world / (pp * tp) : 1;
      if (data_parallel != "fsdp" && data_parallel != "ddp")
        throw mt::ConfigError("--data-parallel " + data_parallel +
                              " has no pipeline form: the stages are sharded (fsdp) or replicated (ddp)");
      const bool fsdp_stages = data_parallel == "fsdp" && data_parallel_ranks > 1;
      const auto table = pp_::make_schedule(kind, pp, stages_per_rank, microbatches > 0 ? microbatches : pp,
                                            fsdp_stages && !run.reshard_after_forward);
      const double bubble = pp_::bubble_fraction(table);
      // The stages of -m as the run cuts them (by FLOPs at -s), and what each keeps in flight.
      const auto config = checked_config(model, tp);
      const int layers = static_cast<int>(config.num_hidden_layers);
      const auto in_flight = pp_::microbatches_in_flight(table);
      const auto counts = *config.parameter_counts();
      // Memory per stage: a micro-batch of -b sequences, weights and AdamW in --dtype, TP inside.
      set_dtypes_and_checkpointing(run, dtype, compute_dtype, checkpointing);
      const mt::llama::LayoutSizes stage_layout{
          .data_parallel = fsdp_stages ? mt::llama::DataParallelKind::fsdp : mt::llama::DataParallelKind::ddp,
          .data_parallel_ranks = data_parallel_ranks,
          .tp = tp};
      std::vector<mt::llama::StageMemory> memory;
      nlohmann::json stages = nlohmann::json::array();
      std::string split_problem;  // a schedule of more stages than -m has units still prints
      pp_::StageSplit split;
      try {
        split = pp_::StageSplit(layers,
                                pp_::balanced_units(llama::stage_unit_costs(config, run.seq), table.shape.stages()));
      } catch (const mt::ConfigError& e) {
        split_problem = model + ": " + e.what();
      }
      for (int s = 0; s < split.stages(); ++s) {
        const auto part = split.stage(s);
        const std::int64_t parameters = mt::llama::stage_parameters(mt::llama::tp_rank_parameters(counts, 1), part);
        memory.push_back(
            mt::llama::stage_memory(config, stage_layout, run, part, in_flight[static_cast<std::size_t>(s)]));
        stages.push_back({{"stage", s},
                          {"rank", table.shape.rank_of_stage(s)},
                          {"holds", split.describe_stage(s)},
                          {"parameters", parameters},
                          {"microbatches_in_flight", in_flight[static_cast<std::size_t>(s)]},
                          {"trained_state_bytes", memory.back().trained_state},
                          {"stage_gathered_bytes", memory.back().stage_gathered},
                          {"activation_bytes_per_microbatch", memory.back().activations},
                          {"peak_bytes", memory.back().peak()}});
      }
      // A rank's stages together, as its program holds them at once.
      nlohmann::json ranks = nlohmann::json::array();
      if (split_problem.empty())
        for (int r = 0; r < pp; ++r)
          ranks.push_back({{"rank", r}, {"peak_bytes", mt::llama::rank_peak(table, r, memory)}});
      if (json) {
        std::printf("%s\n", nlohmann::json{{"schedule", std::string(pp_::to_string(kind))},
                                           {"pp", pp},
                                           {"stages_per_rank", table.shape.stages_per_rank},
                                           {"microbatches", table.shape.microbatches},
                                           {"ticks", table.ticks},
                                           {"bubble_fraction", bubble},
                                           {"stages", split_problem.empty() ? stages : nlohmann::json(nullptr)},
                                           {"ranks", split_problem.empty() ? ranks : nlohmann::json(nullptr)},
                                           {"stages_problem", split_problem}}
                                .dump()
                                .c_str());
      } else {
        std::printf("pipeline schedule %s: %d ranks x %d stage(s) each, %d micro-batches, %d ticks; bubble %.3f\n",
                    std::string(pp_::to_string(kind)).c_str(), pp, table.shape.stages_per_rank,
                    table.shape.microbatches, table.ticks, bubble);
        if (!split_problem.empty())
          std::printf("no stages of %s: %s\n", model.c_str(), split_problem.c_str());
        else
          std::printf(
              "stages of %s (split by FLOPs at sequence %lld; memory per TP rank of %d, micro-batches of %lld "
              "sequence%s, %s; %s):\n",
              model.c_str(), static_cast<long long>(run.seq), tp, static_cast<long long>(run.batch),
              run.batch == 1 ? "" : "s", dtype.c_str(),
              !fsdp_stages ? "DDP inside the stages"
              : run.reshard_after_forward
                  ? ("FSDP over " + std::to_string(data_parallel_ranks) +
                     " ranks in each stage, a layer gathered at a time")
                        .c_str()
                  : ("FSDP over " + std::to_string(data_parallel_ranks) +
                     " ranks in each stage, each stage gathered from its UNSHARD to its RESHARD")
                        .c_str());
        for (const auto& stage : stages)
          std::printf(
              "  stage %d on rank %d: %s, %lld parameters, %d %s activations at once: %s state + %d x %s "
              "activations, peak %s\n",
              stage["stage"].get<int>(), stage["rank"].get<int>(), stage["holds"].get<std::string>().c_str(),
              stage["parameters"].get<long long>(), stage["microbatches_in_flight"].get<int>(),
              stage["microbatches_in_flight"].get<int>() == 1 ? "micro-batch's" : "micro-batches'",
              human(stage["trained_state_bytes"].get<double>(), "B").c_str(),
              stage["microbatches_in_flight"].get<int>(),
              human(stage["activation_bytes_per_microbatch"].get<double>(), "B").c_str(),
              human(stage["peak_bytes"].get<double>(), "B").c_str());
        for (const auto& rank : ranks)
          std::printf("  rank %d: peak %s (its stages' state, the activations its program holds at once)\n",
                      rank["rank"].get<int>(), human(rank["peak_bytes"].get<double>(), "B").c_str());
        if (show_schedule) std::printf("%s", pp_::format_grid(table).c_str());
      }
      return 0;
    } catch (const mt::ConfigError& e) {
      std::fprintf(stderr, "meshtorch-plan: %s\n", e.what());
      return 1;
    }
  }

  try {
    if (world % (tp * cp) != 0)
      throw mt::ConfigError("--world " + std::to_string(world) + " is not a multiple of --tp " + std::to_string(tp) +
                            " x --cp " + std::to_string(cp));
    if (cp > 1)
      if (const auto problem = mt::cp::sequence_split_problem(run.seq, cp, tp); !problem.empty())
        throw mt::ConfigError(problem);
    const auto config = checked_config(model, tp);
    const std::int64_t dp = world / (tp * cp);
    const auto kind = data_parallel == "ddp"     ? mt::llama::DataParallelKind::ddp
                      : data_parallel == "zero"  ? mt::llama::DataParallelKind::zero1
                      : data_parallel == "zero2" ? mt::llama::DataParallelKind::zero2
                                                 : mt::llama::DataParallelKind::fsdp;
    if (run.cpu_offload && kind != mt::llama::DataParallelKind::fsdp)
      throw mt::ConfigError("--cpu-offload needs --data-parallel fsdp (FSDP's offload of its shards)");
    if (run.optimizer_in_backward && kind != mt::llama::DataParallelKind::fsdp)
      throw mt::ConfigError("--optimizer-in-backward needs --data-parallel fsdp (FSDP steps each unit in backward)");
    set_dtypes_and_checkpointing(run, dtype, compute_dtype, checkpointing);
    const double bytes = static_cast<double>(run.state_bytes);
    // The CP ranks of a replica hold different tokens: the data-parallel wrappers span them too.
    const mt::llama::LayoutSizes layout{.data_parallel = kind,
                                        .data_parallel_ranks = dp * cp,
                                        .tp = tp,
                                        .cp = cp,
                                        .cp_gathers_kv = mt::cp::parse_rotate(cp_rotate) == mt::cp::Rotate::allgather};
    const auto exchange = mt::llama::context_exchange_bytes(config, layout, run);
    const auto estimate = mt::llama::estimate_memory(config, layout, run);
    const auto events = mt::llama::memory_timeline(config, layout, run);
    // The peak's event: the first with the most bytes, as estimate_memory picks it.
    std::size_t peak_index = 0;
    for (std::size_t i = 1; i < events.size(); ++i)
      if (events[i].live() > events[peak_index].live()) peak_index = i;
    const auto parts_json = [](const mt::llama::MemoryEvent& e) {
      // MemoryPart's order.
      constexpr const char* keys[] = {"trained_state", "gathered", "reductions", "activations", "loss", "working"};
      static_assert(std::size(keys) == mt::llama::memory_part_count);
      nlohmann::json parts;
      for (std::size_t p = 0; p < mt::llama::memory_part_count; ++p) parts[keys[p]] = e.parts[p];
      return parts;
    };
    const auto sizes = tp_rank_sizes(config, tp);
    const double root = static_cast<double>(sizes.root());
    const double largest = std::max(static_cast<double>(sizes.layer), root);
    // The trained state wherever it lives: the same amounts on the host with --cpu-offload.
    auto on_device = run;
    on_device.cpu_offload = on_device.optimizer_offload = false;
    const auto state = mt::llama::estimate_memory(config, layout, on_device);
    const double held = state.weights / bytes;

    if (json) {
      nlohmann::json out = {{"model", model},
                            {"world", world},
                            {"tp", tp},
                            {"cp", cp},
                            {"cp_rotate", cp_rotate},
                            {"cp_exchange_forward_bytes_per_layer", exchange.forward},
                            {"cp_exchange_backward_bytes_per_layer", exchange.backward},
                            {"data_parallel", data_parallel},
                            {"parameters_held", held},
                            {"weights_bytes", estimate.weights},
                            {"gradients_bytes", estimate.gradients},
                            {"optimizer_bytes", estimate.optimizer},
                            {"host_bytes", estimate.host},
                            {"gathered_bytes", estimate.gathered},
                            {"reductions_bytes", estimate.reductions},
                            {"activations_bytes", estimate.activations},
                            {"loss_bytes", estimate.loss},
                            {"backward_peak_bytes", estimate.backward_peak},
                            {"start_bytes", estimate.start},
                            {"peak_bytes", estimate.peak()},
                            {"peak_event",
                             {{"what", std::string(estimate.at_peak.what)},
                              {"layer", estimate.at_peak.layer},
                              {"parts_bytes", parts_json(estimate.at_peak)}}}};
      if (timeline) {
        nlohmann::json list = nlohmann::json::array();
        for (const auto& e : events)
          list.push_back({{"what", std::string(e.what)}, {"layer", e.layer}, {"live_bytes", e.live()}});
        out["timeline"] = std::move(list);
      }
      std::printf("%s\n", out.dump(2).c_str());
      return 0;
    }

    std::printf("model %s: %s parameters (hidden %lld, %lld layers, %lld heads / %lld key-value heads, vocab %lld%s)\n",
                model.c_str(), human(static_cast<double>(config.num_parameters()), "").c_str(),
                static_cast<long long>(config.hidden_size), static_cast<long long>(config.num_hidden_layers),
                static_cast<long long>(config.num_attention_heads), static_cast<long long>(config.num_key_value_heads),
                static_cast<long long>(config.vocab_size), config.tie_word_embeddings ? ", tied head" : "");
    std::printf("mesh: %d ranks = %lld %s x %s%d TP\n", world, static_cast<long long>(dp),
                data_parallel == "fsdp" ? "FSDP" : "DP", cp > 1 ? (std::to_string(cp) + " CP x ").c_str() : "", tp);
    if (cp > 1)
      std::printf(
          "context parallel (%s): each rank computes %lld of every sequence's %lld positions; per layer it sends "
          "%s in forward and %s in backward%s (and receives as much)\n",
          cp_rotate.c_str(), static_cast<long long>(run.seq / cp), static_cast<long long>(run.seq),
          human(exchange.forward, "B").c_str(), human(exchange.backward, "B").c_str(),
          run.checkpoint_every > 0 ? ", its recomputed forward's included" : "");
    if (tp > 1) std::printf("plan: %s\n", llama::Plan<mt::Mesh<mt::TP<2>>>::describe_styles().c_str());

    // The trained state, wherever it lives (the host with --cpu-offload).
    const double weights = state.weights, grads = state.gradients, moments = state.optimizer;
    std::printf("\nper rank (%s%s):\n", dtype.c_str(), run.cpu_offload ? ", in host memory" : "");
    std::printf("  %-22s %14s\n", "parameters held", human(held, "").c_str());
    std::printf("  %-22s %14s\n", "weights", gigabytes(weights).c_str());
    std::printf("  %-22s %14s\n", "gradients", gigabytes(grads).c_str());
    std::printf(
        "  %-22s %14s%s\n", "AdamW state", gigabytes(moments).c_str(),
        run.optimizer_offload ? "  (in host memory, with a copy of the weights and gradients: twice this)" : "");
    std::printf("  %-22s %14s\n", "total", gigabytes(weights + grads + moments).c_str());
    if (data_parallel == "fsdp" && dp > 1)
      std::printf("  %-22s %14s  (%s, whole over FSDP: its weights and their gradients)\n", "largest gathered unit",
                  gigabytes(2 * largest * bytes).c_str(), largest == root ? "the root" : "one decoder layer");

    std::printf("\ndevice memory per rank over one step (batch %lld x sequence %lld, compute %s, checkpointing %s):\n",
                static_cast<long long>(run.batch), static_cast<long long>(run.seq),
                run.compute_bytes == 2 ? "bfloat16" : "float32", checkpointing.c_str());
    // Each part at its largest, and what the device holds of it at the step's peak (the
    // timeline's event with the most bytes): the second column adds up to the peak.
    std::printf("  %-28s %14s %14s\n", "", "largest", "at the peak");
    using Part = mt::llama::MemoryPart;
    const auto part = [&](Part p, double largest) {
      std::printf("  %-28s %14s %14s\n", std::string(mt::llama::memory_part_names[static_cast<std::size_t>(p)]).c_str(),
                  gigabytes(largest).c_str(), gigabytes(estimate.at_peak[p]).c_str());
    };
    part(Part::trained_state, estimate.trained_state());
    if (kind == mt::llama::DataParallelKind::fsdp) {
      part(Part::gathered, estimate.gathered);
      part(Part::reductions, estimate.reductions);
    }
    part(Part::activations, estimate.activations);
    part(Part::loss, estimate.loss);
    part(Part::working, estimate.backward_peak);
    std::printf("  %-28s %14s %14s  (%s)\n", "peak", "", gigabytes(estimate.peak()).c_str(),
                event_label(estimate.at_peak).c_str());
    if (timeline) print_timeline(events, peak_index);
    std::printf(
        "\nNot counted: the allocator's rounding and caching (reserved beyond allocated), communication\n"
        "staging, LibTorch's workspace.\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshtorch-plan: %s\n", e.what());
    return 2;
  }
}
