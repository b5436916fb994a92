#include <meshtorch/layout/pipeline_schedule.hpp>
// 4 stages, 2 micro-batches: PyTorch's Schedule1F1B refuses it (and torchtitan hung on it).
static_assert(meshtorch::pp::Schedule<meshtorch::pp::OneFOneB, 4, 1, 2>::valid);
