// Experiment::save with only the umbrella header: the checkpoint engine is
// parallel/checkpointing.hpp, and the error must say to include it.
#include <meshtorch/meshtorch.hpp>

namespace mt = meshtorch;

void save(mt::train::Experiment& experiment, mt::llama::LlamaForCausalLM& model, mt::train::AdamW& optimizer) {
  experiment.save(mt::train::TrainState{}, model, optimizer);
}
