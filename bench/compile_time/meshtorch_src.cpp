// The separately compiled functions: what a program built with MESHTORCH_SEPARATE_COMPILATION
// compiles once, in one of its files.
#include <meshtorch/src/core.hpp>
