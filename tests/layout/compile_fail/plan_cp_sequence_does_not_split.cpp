// Llama-3.1-8B on FSDP 2 x CP 4: a sequence of 8190 positions does not split into 8 chunks, so the
// planned memory of that run is not a constant expression, and the compiler names the rule.
#include <meshtorch/models/llama/plan.hpp>
namespace mt = meshtorch;
using Plan = mt::llama::Plan<mt::Mesh<mt::FSDP<2>, mt::CP<4>>, mt::llama::presets::llama_3_1_8b>;
static_assert(Plan::splits_sequence(8192) && Plan::sequence_unit() == 8);
constexpr double peak = Plan::peak_bytes({.batch = 1, .seq = 8190});
