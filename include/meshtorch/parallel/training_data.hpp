#pragma once
// The data of a training run, as every chapter prepares it: the dataset of -d tokenised (with
// the tokenizer of the -m folder when it has one, else the byte tokenizer) once into a token
// cache that every rank maps (rank 0 writes it; a node that cannot see it writes its own), packed
// into -s blocks, checked against the model's vocabulary, and the
// data-parallel-invariant sampler that gives data-parallel rank r its part of each global batch
// (every TP rank of a data-parallel coordinate the same part). Needs meshtorch::tokenizers
// (PCRE2, sentencepiece), so the umbrella header leaves it out.
#include <cstdint>
#include <optional>
#include <string>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/comm/env.hpp>
#include <meshtorch/data/dataset.hpp>
#include <meshtorch/data/dataset_tokenizer.hpp>
#include <meshtorch/data/sampler.hpp>
#include <meshtorch/models/llama/config.hpp>
#include <meshtorch/parallel/rank.hpp>
#include <meshtorch/separate_compilation.hpp>
#include <meshtorch/train/log.hpp>
#include <meshtorch/train/train_args.hpp>

namespace meshtorch {

struct TrainingData {
  data::TokenBlocks blocks;
  data::DpInvariantSampler sampler;
};

struct DataParallelCoordinate {
  std::int64_t size = 1;
  std::int64_t rank = 0;
};

// Micro-batches per optimizer step: --grad-accum, or what --global-batch-size leaves for -b on
// `dp_size` ranks.
MESHTORCH_DECL std::int64_t micro_batches_per_step(const train::TrainArgs& args, std::int64_t dp_size);

// `world`: every rank of the job; nothing on one process. -d other than 'builtin' goes through its
// token cache (data/token_cache.hpp), written once and mapped by every rank. With --eval-split the
// last blocks are held out (TokenBlocks::held_out) and the sampler sees the rest. The blocks must fit
// the model: its vocabulary, and its sliding window (a longer sequence is refused before anything
// is read, as sliding-window attention is not implemented).
MESHTORCH_DECL TrainingData load_training_data(const train::TrainArgs& args, const llama::Config& model_config,
                                               DataParallelCoordinate data_parallel = {},
                                               const comm::AxisGroup* world = nullptr);

// For a model parallelize() built: its data-parallel group (DP and FSDP merged) splits the batch,
// and the sequence length must be one its layout can split.
template <class ParallelModel>
requires requires(const ParallelModel& m) {
  m.data_parallel_size();
  m.world();
  m.validate_sequence(1);
}
TrainingData load_training_data(const train::TrainArgs& args, const llama::Config& model_config,
                                const ParallelModel& model) {
  model.validate_sequence(args.seq_length);
  return load_training_data(args, model_config, {model.data_parallel_size(), model.data_parallel_rank()},
                            &model.world());
}

}  // namespace meshtorch

#if MESHTORCH_DEFINES(tokenizers)
#include <fmt/format.h>

namespace meshtorch {

MESHTORCH_DECL std::int64_t micro_batches_per_step(const train::TrainArgs& args, std::int64_t dp_size) {
  if (args.global_batch_size == 0) return args.grad_accum;
  std::int64_t per_micro_batch = 0;
  if (__builtin_mul_overflow(args.batch_size, dp_size, &per_micro_batch) || per_micro_batch <= 0)
    throw ConfigError(
        fmt::format("-b {} x {} data-parallel rank(s) overflows a 64-bit integer or is not positive; "
                    "--global-batch-size {} needs a micro-batch between 1 and itself",
                    args.batch_size, dp_size, args.global_batch_size));
  if (args.global_batch_size % per_micro_batch != 0)
    throw ConfigError(fmt::format(
        "--global-batch-size {} is not a multiple of -b {} x {} data-parallel rank(s) = {}: choose a -b that divides "
        "it on every number of ranks the run may have",
        args.global_batch_size, args.batch_size, dp_size, per_micro_batch));
  return args.global_batch_size / per_micro_batch;
}

namespace training_data_detail {

template <class Work>
std::string error_of(int rank, const Work& work) {
  try {
    work();
    return {};
  } catch (const CommError&) {
    throw;
  } catch (const std::exception& e) {
    return fmt::format("rank {}: {}", rank, e.what());
  }
}

// -d through its token cache on every rank of `world`: rank 0 tokenises (or finds the cache
// current); a node whose ranks cannot see rank 0's file (a cache folder on node-local disk, as the
// guide's $HF_HOME advice has it) has its lowest rank tokenise into its own; then every rank maps
// the file. `report` receives the data line.
inline data::TokenBlocks load_cached(const train::TrainArgs& args, const comm::AxisGroup& world, std::string& note) {
  const int rank = world.global_rank();
  std::optional<data::CachedDataset> dataset;
  comm::raise_first_error(world, error_of(rank, [&] {
                            dataset.emplace(data::DatasetRequest{
                                .name = args.dataset_name, .subset = args.dataset_subset, .model = args.model_name});
                          }));
  bool built = false;
  comm::raise_first_error(world, error_of(rank, [&] {
                            if (world.rank() == 0 && !dataset->open()) dataset->build(), built = true;
                          }));
  // Which nodes see rank 0's file: "host visible" from every rank.
  const bool visible = dataset->open().has_value();
  const auto views = comm::all_gather_object(world, fmt::format("{} {}", comm::host_name(), visible ? 1 : 0));
  bool lowest_blind_rank_on_host = !visible;
  for (int r = 0; r < world.rank() && lowest_blind_rank_on_host; ++r)
    lowest_blind_rank_on_host = views[static_cast<std::size_t>(r)] != fmt::format("{} 0", comm::host_name());
  comm::raise_first_error(world, error_of(rank, [&] {
                            if (lowest_blind_rank_on_host) dataset->build(), built = true;
                          }));
  std::string why;
  auto cached = dataset->open(&why);
  std::string error = cached ? std::string()
                             : fmt::format(
                                   "rank {} on {}: the token cache is not readable after rank 0 "
                                   "and this node's first rank wrote it: {}",
                                   rank, comm::host_name(), why);
  comm::raise_first_error(world, error);
  note = fmt::format("{}; {}", dataset->tokenizer_note(), dataset->report(*cached, args.seq_length, built));
  return data::blocks_of(*cached, args.seq_length, dataset->source_name());
}

}  // namespace training_data_detail

MESHTORCH_DECL TrainingData load_training_data(const train::TrainArgs& args, const llama::Config& model_config,
                                               DataParallelCoordinate data_parallel, const comm::AxisGroup* world) {
  if (model_config.sliding_window > 0 && args.seq_length > model_config.sliding_window)
    throw ConfigError(fmt::format(
        "-s/--seq-length {} is longer than the sliding_window of {} ({} positions); sliding-window attention is "
        "not implemented, so train with -s {} or less",
        args.seq_length, args.model_name, model_config.sliding_window, model_config.sliding_window));
  std::string note;
  auto blocks =
      world && args.dataset_name != "builtin"
          ? training_data_detail::load_cached(args, *world, note)
          : data::load_dataset(args.dataset_name, args.seq_length, args.model_name, &note, args.dataset_subset);
  const train::Logger log(world ? world->global_rank() : 0);
  const bool logs = !world || world->rank() == 0;
  if (logs) log.info(fmt::format("data: {}", note));
  blocks.check_vocab(model_config.vocab_size);  // every block, the held-out ones too
  if (args.eval_split > 0) {
    const auto& held_out = blocks.hold_out(args.eval_split);
    if (logs)
      log.info(fmt::format("data: the last {} of {} blocks held out for evaluation (--eval-split {})", held_out.size(),
                           held_out.size() + blocks.size(), args.eval_split));
  }
  data::DpInvariantSampler sampler({.num_samples = blocks.size(),
                                    .batch_size = args.batch_size,
                                    .dp_size = data_parallel.size,
                                    .dp_rank = data_parallel.rank,
                                    .grad_accum = micro_batches_per_step(args, data_parallel.size),
                                    .seed = args.seed});
  return {std::move(blocks), sampler};
}

}  // namespace meshtorch
#endif  // MESHTORCH_DEFINES(tokenizers)
