#include <meshtorch/layout/pipeline_schedule.hpp>
// The V places exactly two stages on each rank.
static_assert(meshtorch::pp::Schedule<meshtorch::pp::ZeroBubbleV, 4, 3, 8>::valid);
