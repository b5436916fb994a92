#pragma once
// The definitions of the programs part (flags, start-up, watchdog and stack dumps, the checkpoint
// engine, the DeepSpeed config), for a program built with MESHTORCH_SEPARATE_COMPILATION: include
// this in exactly one of its source files, and nothing else there (see <meshtorch/src/core.hpp>).
// Every header whose definitions are marked MESHTORCH_DEFINES(programs) is listed here (the
// headers test checks it).
#if !defined(MESHTORCH_SEPARATE_COMPILATION)
#error "<meshtorch/src/programs.hpp> needs MESHTORCH_SEPARATE_COMPILATION; a header-only program adds no source file"
#endif
#if defined(MESHTORCH_SOURCE)
#error "one part of meshtorch per source file: <meshtorch/src/programs.hpp> found MESHTORCH_SOURCE already defined"
#endif
#define MESHTORCH_SOURCE MESHTORCH_PART_programs
#include <meshtorch/checkpoint/consolidate.hpp>
#include <meshtorch/checkpoint/load.hpp>
#include <meshtorch/checkpoint/manifest.hpp>
#include <meshtorch/checkpoint/save.hpp>
#include <meshtorch/comm/backend.hpp>
#include <meshtorch/comm/init.hpp>
#include <meshtorch/comm/rendezvous.hpp>
#include <meshtorch/comm/shared_memory_backend.hpp>
#include <meshtorch/comm/store_gate.hpp>
#include <meshtorch/data/text_tokenizer.hpp>
#include <meshtorch/data/token_cache.hpp>
#include <meshtorch/diagnostics/hang_analysis.hpp>
#include <meshtorch/diagnostics/stack_dump.hpp>
#include <meshtorch/diagnostics/watchdog.hpp>
#include <meshtorch/parallel/checkpointing.hpp>
#include <meshtorch/parallel/launch.hpp>
#include <meshtorch/train/args.hpp>
#include <meshtorch/train/caching_host_allocator.hpp>
#include <meshtorch/train/cpu_allocation_counter.hpp>
#include <meshtorch/train/deepspeed_config.hpp>
#include <meshtorch/train/profiler.hpp>
