#pragma once
// The definitions of the tokenizers part (model folders' tokenizers, chat templates and training
// data; link meshtorch::tokenizers), for a program built with MESHTORCH_SEPARATE_COMPILATION:
// include this in exactly one of its source files, and nothing else there (see
// <meshtorch/src/core.hpp>). Every header whose definitions are marked
// MESHTORCH_DEFINES(tokenizers) is listed here (the headers test checks it).
#if !defined(MESHTORCH_SEPARATE_COMPILATION)
#error "<meshtorch/src/tokenizers.hpp> needs MESHTORCH_SEPARATE_COMPILATION; a header-only program adds no source file"
#endif
#if defined(MESHTORCH_SOURCE)
#error "one part of meshtorch per source file: <meshtorch/src/tokenizers.hpp> found MESHTORCH_SOURCE already defined"
#endif
#define MESHTORCH_SOURCE MESHTORCH_PART_tokenizers
#include <meshtorch/data/bpe_tokenizer.hpp>
#include <meshtorch/data/cached_dataset.hpp>
#include <meshtorch/data/chat_template.hpp>
#include <meshtorch/data/dataset_tokenizer.hpp>
#include <meshtorch/data/folder_tokenizer.hpp>
#include <meshtorch/data/sentencepiece_tokenizer.hpp>
#include <meshtorch/parallel/training_data.hpp>
