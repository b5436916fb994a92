#pragma once
// Header-only by default; optionally compiled once per program, as Boost.Asio and the stb
// libraries offer it. A header whose functions are not templates declares them with
// MESHTORCH_DECL and defines them below its declarations, inside `#if MESHTORCH_DEFINES(part)`:
//
// - by default MESHTORCH_DECL is `inline` and every header defines its functions: nothing to link;
// - a program that defines MESHTORCH_SEPARATE_COMPILATION in every translation unit (the CMake
//   function meshtorch_compiled_library() does) sees only the declarations, and what those
//   definitions need (nlohmann-json's parser, most of fmt's formatting, minja, backward-cpp) is
//   never parsed; one source file per part includes <meshtorch/src/PART.hpp>, which defines
//   MESHTORCH_SOURCE and compiles that part's definitions.
//
// Why: each definition instantiates the templates it calls, and the functions a unit calls are
// compiled in it with everything they inline, so a translation unit that includes the umbrella
// header pays for the library again. Measured in docs/performance.md#compile-time.
//
// The parts follow the dependencies, so that a program compiles and links only those it has, and
// a build compiles them side by side:
//   core        the umbrella header's reach: <meshtorch/meshtorch.hpp>, and fmt's engine
//   programs    what a training program adds: flags, start-up, watchdog and stack dumps, the
//               checkpoint engine, the DeepSpeed config (CLI11, backward-cpp; no other library)
//   tokenizers  model folders' tokenizers, chat templates and training data (meshtorch::tokenizers:
//               PCRE2, libsentencepiece, minja)
//   tracking    TensorBoard event files and the engine that writes them (meshtorch::tracking: Boost)
#define MESHTORCH_PART_core 1
#define MESHTORCH_PART_programs 2
#define MESHTORCH_PART_tokenizers 4
#define MESHTORCH_PART_tracking 8

#if !defined(MESHTORCH_SEPARATE_COMPILATION)
#define MESHTORCH_DECL inline
#define MESHTORCH_DEFINES(part) 1
#elif defined(MESHTORCH_SOURCE)
#define MESHTORCH_DECL
#define MESHTORCH_DEFINES(part) ((MESHTORCH_SOURCE) == MESHTORCH_PART_##part)
#else
#define MESHTORCH_DECL
#define MESHTORCH_DEFINES(part) 0
#endif
