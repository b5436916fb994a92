#include <meshtorch/layout/pipeline_schedule.hpp>
// Interleaving needs several stages on a rank to interleave.
static_assert(meshtorch::pp::Schedule<meshtorch::pp::Interleaved1F1B, 4, 1, 8>::valid);
