#pragma once
// Module wrappers that join models to meshes: one header per technique.
#include <meshtorch/comm/process_group.hpp>
#include <meshtorch/models/llama/memory_plan.hpp>
#include <meshtorch/models/llama/plan.hpp>
#include <meshtorch/models/llama/stage_costs.hpp>
#include <meshtorch/parallel/ddp.hpp>
#include <meshtorch/parallel/fsdp.hpp>
#include <meshtorch/parallel/fsdp_llama.hpp>
#include <meshtorch/parallel/parallelize.hpp>
#include <meshtorch/parallel/pipeline_llama.hpp>
#include <meshtorch/parallel/pipeline_runtime.hpp>
#include <meshtorch/parallel/rank.hpp>
#include <meshtorch/parallel/split_backward.hpp>
#include <meshtorch/parallel/tensor_parallel.hpp>
#include <meshtorch/parallel/zero.hpp>
#include <meshtorch/parallel/zero_stage2.hpp>
