#pragma once
// The exceptions meshtorch throws. Each message names the file, field, variable or rank at fault.
#include <stdexcept>
#include <string>

namespace meshtorch {

// A model config (config.json, a preset, a flag) that cannot work; the message names the field.
struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A launch environment (torchrun, Slurm, OpenMPI, meshrun variables) that is missing or contradictory.
struct EnvError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Input data or a file on disk (dataset, tokenizer, safetensors, checkpoint) that cannot be read.
struct DataError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Ranks that disagree (mesh type, plan fingerprint, parameter set) or a collective that failed.
struct CommError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace meshtorch
