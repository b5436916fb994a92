#include <meshtorch/models/llama/plan.hpp>
// HSDP has no TP axis, so the sequence-parallel styles cannot apply.
using Hsdp = meshtorch::Mesh<meshtorch::DP<2>, meshtorch::FSDP<2>>;
static_assert(meshtorch::llama::check_parallelizable<Hsdp, meshtorch::llama::SequenceParallelStyles>());
