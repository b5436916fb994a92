// Llama-3.1-405B without activation checkpointing on 64 ranks of FSDP: the estimate of one rank's
// device memory passes 80 GiB, and the note under the failed assertion says by how much
// ("the comparison reduces to '(<estimate> <= <budget>)'").
#include <meshtorch/models/llama/plan.hpp>
namespace mt = meshtorch;
using Plan = mt::llama::Plan<mt::Mesh<mt::FSDP<64>>, mt::llama::presets::llama_3_1_405b>;
constexpr double peak = Plan::peak_bytes({.batch = 1, .seq = 4096, .compute_bytes = 2, .cpu_offload = true});
static_assert(peak <= 80 * mt::llama::GiB,
              "the run does not fit an 80 GiB GPU: turn on activation checkpointing or shard further");
