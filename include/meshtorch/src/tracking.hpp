#pragma once
// The definitions of the tracking part (TensorBoard event files and the engine that writes them;
// link meshtorch::tracking), for a program built with MESHTORCH_SEPARATE_COMPILATION: include this
// in exactly one of its source files, and nothing else there (see <meshtorch/src/core.hpp>). Every
// header whose definitions are marked MESHTORCH_DEFINES(tracking) is listed here (the headers test
// checks it).
#if !defined(MESHTORCH_SEPARATE_COMPILATION)
#error "<meshtorch/src/tracking.hpp> needs MESHTORCH_SEPARATE_COMPILATION; a header-only program adds no source file"
#endif
#if defined(MESHTORCH_SOURCE)
#error "one part of meshtorch per source file: <meshtorch/src/tracking.hpp> found MESHTORCH_SOURCE already defined"
#endif
#define MESHTORCH_SOURCE MESHTORCH_PART_tracking
#include <meshtorch/parallel/engine.hpp>
#include <meshtorch/train/tensorboard.hpp>
