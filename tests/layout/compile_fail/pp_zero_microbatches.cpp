#include <meshtorch/layout/pipeline_schedule.hpp>
// A step of no micro-batches has nothing to schedule.
static_assert(meshtorch::pp::Schedule<meshtorch::pp::GPipe, 4, 1, 0>::valid);
