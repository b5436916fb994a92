#pragma once
// The data of a training run, as every chapter prepares it: the dataset of -d tokenised (with
// the tokenizer of the -m folder when it has one, else the byte tokenizer) and packed into -s
// blocks (rank 0 of the job first, so that a download or a tokeniser cache is made once on
// shared storage), checked against the model's vocabulary, and the
// data-parallel-invariant sampler that gives data-parallel rank r its part of each global batch
// (every TP rank of a data-parallel coordinate the same part). Needs meshtorch::tokenizers
// (PCRE2, sentencepiece), so the umbrella header leaves it out.
#include <cstdint>

#include <fmt/format.h>

#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/data/dataset.hpp>
#include <meshtorch/data/dataset_tokenizer.hpp>
#include <meshtorch/data/sampler.hpp>
#include <meshtorch/parallel/rank.hpp>
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
inline std::int64_t micro_batches_per_step(const train::TrainArgs& args, std::int64_t dp_size) {
  if (args.global_batch_size == 0) return args.grad_accum;
  const std::int64_t per_micro_batch = args.batch_size * dp_size;
  if (args.global_batch_size % per_micro_batch != 0)
    throw ConfigError(fmt::format(
        "--global-batch-size {} is not a multiple of -b {} x {} data-parallel rank(s) = {}: choose a -b that divides "
        "it on every number of ranks the run may have",
        args.global_batch_size, args.batch_size, dp_size, per_micro_batch));
  return args.global_batch_size / per_micro_batch;
}

// `world`: every rank of the job (rank 0 loads first); nothing on one process.
inline TrainingData load_training_data(const train::TrainArgs& args, std::int64_t vocab_size,
                                       DataParallelCoordinate data_parallel = {},
                                       const comm::AxisGroup* world = nullptr) {
  std::string tokenizer_note;
  auto load = [&] { return data::load_dataset(args.dataset_name, args.seq_length, args.model_name, &tokenizer_note); };
  auto blocks = world ? rank_zero_first(*world, load) : load();
  if (!tokenizer_note.empty() && (!world || world->rank() == 0))
    train::Logger(world ? world->global_rank() : 0).info(fmt::format("tokenizer: {}", tokenizer_note));
  blocks.check_vocab(vocab_size);
  data::DpInvariantSampler sampler({.num_samples = blocks.size(),
                                    .batch_size = args.batch_size,
                                    .dp_size = data_parallel.size,
                                    .dp_rank = data_parallel.rank,
                                    .grad_accum = micro_batches_per_step(args, data_parallel.size),
                                    .seed = args.seed});
  return {std::move(blocks), sampler};
}

// For a model parallelize() built: its data-parallel group (DP and FSDP merged) splits the batch,
// and the sequence length must be one its layout can split.
template <class ParallelModel>
  requires requires(const ParallelModel& m) { m.data_parallel_size(); m.world(); m.validate_sequence(1); }
TrainingData load_training_data(const train::TrainArgs& args, std::int64_t vocab_size, const ParallelModel& model) {
  model.validate_sequence(args.seq_length);
  return load_training_data(args, vocab_size, {model.data_parallel_size(), model.data_parallel_rank()}, &model.world());
}

}  // namespace meshtorch
