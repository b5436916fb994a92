#pragma once
// XXH3-64 from libxxhash (Debian libxxhash-dev), used header-only (XXH_INLINE_ALL), so that the
// header-only library needs no link step. It hashes at tens of GB/s: checksums of checkpoint files
// and the keys of token caches cost no CPU to speak of. A translation unit that defined
// XXH_INLINE_ALL itself keeps its definition.
#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#define MESHTORCH_UNDEF_XXH_INLINE_ALL
#endif
#include <xxhash.h>
#ifdef MESHTORCH_UNDEF_XXH_INLINE_ALL
#undef XXH_INLINE_ALL
#undef MESHTORCH_UNDEF_XXH_INLINE_ALL
#endif
