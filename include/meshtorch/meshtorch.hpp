#pragma once
// The one header users include. The folders show the architecture: layout/ (compile time, no
// LibTorch), comm/ (process groups and collectives), models/ (Llama, no parallelism), data/ and
// train/ (the training loop's parts), io/ (files that are never half-written), checkpoint/ (the
// sharded checkpoint engine), parallel/ (the wrappers that join them).
//
// Left out, because few translation units need them and each adds to every one's compile time
// (docs/code-style.md#what-the-umbrella-header-includes): a program's flags and start-up
// (train/args.hpp, which pulls in CLI11; comm/init.hpp; parallel/launch.hpp), its training data
// (parallel/training_data.hpp, the tokenizers: link meshtorch::tokenizers), and the sharded
// checkpoint engine (checkpoint/; its box algebra, io/sharded_tensor.hpp, comes with
// parallelize.hpp).
#include <meshtorch/comm/comm.hpp>
#include <meshtorch/data/builtin_corpus.hpp>
#include <meshtorch/data/dataset.hpp>
#include <meshtorch/data/loader.hpp>
#include <meshtorch/data/sampler.hpp>
#include <meshtorch/data/tokenizer.hpp>
#include <meshtorch/diagnostics/error_file.hpp>
#include <meshtorch/error.hpp>
#include <meshtorch/io/atomic_file.hpp>
#include <meshtorch/io/file_digest.hpp>
#include <meshtorch/io/safetensors.hpp>
#include <meshtorch/io/safetensors_writer.hpp>
#include <meshtorch/layout/layout.hpp>
#include <meshtorch/models/llama/config.hpp>
#include <meshtorch/models/llama/config_json.hpp>
#include <meshtorch/models/llama/generate.hpp>
#include <meshtorch/models/llama/layers.hpp>
#include <meshtorch/models/llama/model.hpp>
#include <meshtorch/models/llama/weights.hpp>
#include <meshtorch/parallel/parallel.hpp>
#include <meshtorch/train/adamw.hpp>
#include <meshtorch/train/checkpoint.hpp>
#include <meshtorch/train/core_workers.hpp>
#include <meshtorch/train/device.hpp>
#include <meshtorch/train/experiment.hpp>
#include <meshtorch/train/log.hpp>
#include <meshtorch/train/lr_schedule.hpp>
#include <meshtorch/train/memory.hpp>
#include <meshtorch/train/metrics.hpp>
#include <meshtorch/train/rng.hpp>
#include <meshtorch/train/state.hpp>
#include <meshtorch/train/timers.hpp>
