// The core part's separately compiled functions (the umbrella header's reach and fmt's engine):
// what a program built with MESHTORCH_SEPARATE_COMPILATION compiles once, in one of its files.
#include <meshtorch/src/core.hpp>
