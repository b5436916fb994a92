#pragma once
// LibTorch's CPU allocator with a cache for large blocks, as CUDA's caching allocator keeps device
// blocks: a freed block of at least 1 MiB is kept, and a request is served from the smallest cached
// block that holds it, split when larger (the rest stays cached); freed neighbours merge again. A
// training step allocates the same sizes at every step (a layer's gathered weights, the
// reduce-scatter buffers, gradients, activations), so after the first step they come from the cache.
//
// Large blocks are mapped from the kernel and unmapped when given back, not taken from glibc: its
// heap serves blocks of 1-32 MB once its dynamic mmap threshold has grown past them, and a heap
// whose blocks come and go fragments (chapter 7 at llama-100m held 1.16 GB per rank after 6 steps
// where its tensors never exceed 0.75 GB). Pages are the unit: a request is rounded up to whole
// pages, and the cache gives back any whole pages of a cached block, so what is resident of the
// large blocks is reserved_bytes(): those in tensors and those cached.
//
// What is cached is bounded by what the process has needed: when a block cannot be served from
// the cache, first the bytes cached longest are given back while the large blocks held would
// exceed the most ever in tensors at once and a thirty-second of it. The cache before served
// whole blocks only, of a request's size up to twice it, and its bound counted the blocks, not the
// requests: chapter 5 at llama-100m with checkpointing (2 ranks) peaked at 1.26 GB of RSS where
// its tensors never held more than 0.90 GB at once. Split and merged, the same run peaks at 1.02
// GB, at the same speed.
//
// Small blocks go straight to c10's allocation functions, as LibTorch's default allocator does.
// launch() and chapter 1 install it on CPU runs; MESHTORCH_HOST_ALLOCATOR=default keeps LibTorch's own.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Allocator.h>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::train {

class CachingHostAllocator final : public c10::Allocator {
 public:
  // Blocks of this size or more are cached; smaller ones are malloc's business (its bins reuse them well).
  static constexpr std::size_t min_cached_bytes = std::size_t{1} << 20;
  // What the cache may hold beyond this is given back when blocks are freed.
  static constexpr std::size_t max_cached_bytes = std::size_t{1} << 30;
  // What the cache may hold, with the blocks in tensors, beyond the most there have been in
  // tensors at once: a thirty-second of that peak. With exactly the peak, a request that no cached
  // piece could hold made the cache give back others, made again later (chapter 5 at llama-100m,
  // its allocations replayed: 82-378 MB mapped anew in later steps); with a thirty-second none.
  static constexpr std::size_t headroom_divisor = 32;

  // The process's allocator: blocks it hands out may be freed at any time up to exit, so it is
  // never destroyed.
  MESHTORCH_DECL static CachingHostAllocator& instance();

  // Makes it the allocator of every CPU tensor allocated from now on (earlier ones keep theirs).
  MESHTORCH_DECL static void install();

  MESHTORCH_DECL c10::DataPtr allocate(std::size_t nbytes) override;

  c10::DeleterFnPtr raw_deleter() const override { return &CachingHostAllocator::release; }

  void copy_data(void* destination, const void* source, std::size_t count) const override {
    default_copy_data(destination, source, count);
  }

  // Bytes held for reuse now, and bytes of every large block made and not given back (in
  // tensors or cached: CUDA's memory_reserved, for large blocks). Whole pages.
  std::size_t cached_bytes() const {
    std::lock_guard lock(mutex_);
    return cached_bytes_;
  }
  std::size_t reserved_bytes() const {
    std::lock_guard lock(mutex_);
    return live_bytes_ + cached_bytes_;
  }

  // Allocations of min_cached_bytes or more since reset_stats(), and how many the cache served.
  struct Stats {
    std::size_t large_allocations = 0;
    std::size_t served_from_cache = 0;
  };
  Stats stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }
  void reset_stats() {
    std::lock_guard lock(mutex_);
    stats_ = {};
  }

  // The most bytes of large blocks in tensors at once, in whole pages (since the last release_cached()).
  std::size_t peak_live_bytes() const {
    std::lock_guard lock(mutex_);
    return peak_live_bytes_;
  }

  // The size of a page, the unit of what is held: a request's size rounded up to it.
  MESHTORCH_DECL static std::size_t page_bytes();
  static std::size_t whole_pages(std::size_t bytes) { return (bytes + page_bytes() - 1) / page_bytes() * page_bytes(); }

  // Gives every cached block back to the system; the peak that bounds the cache starts again
  // from the blocks in tensors now (for a caller whose phase with a peak that will not recur,
  // such as a load, is over).
  MESHTORCH_DECL void release_cached();

 private:
  CachingHostAllocator() = default;

  // A block: whole pages at an address, in a tensor or cached. Cached blocks never touch: freed
  // neighbours merge.
  struct Block {
    std::size_t bytes = 0;
    // When it was cached (the count of frees, from 1), for giving back the oldest first; 0 in a tensor.
    std::uint64_t cached_since = 0;
    bool cached() const { return cached_since != 0; }
  };
  using Ranges = std::vector<std::pair<char*, std::size_t>>;  // (address, bytes), to unmap outside the lock

  // A cached block of at least `bytes`, the smallest, split to `bytes` and now in a tensor;
  // nullptr if there is none.
  MESHTORCH_DECL char* take_cached(std::size_t bytes);
  // A new block: first gives back the cached bytes that holding it would take past the bound.
  MESHTORCH_DECL char* make_block(std::size_t bytes);
  // The cached bytes to give back, oldest first (the end of a block when only part must go),
  // until the large blocks held, with `more` being made, are within `budget`.
  MESHTORCH_DECL Ranges evict_locked(std::size_t more, std::size_t budget);
  // The most bytes of large blocks held, in tensors and cached, before the cache gives some back:
  // the peak in tensors and headroom_divisor's share of it.
  std::size_t bound_locked() const { return peak_live_bytes_ + peak_live_bytes_ / headroom_divisor; }
  // Lists a block as in a tensor (may throw before changing anything).
  MESHTORCH_DECL void in_tensor_locked(char* data, std::size_t bytes);
  // Lists a block that was in a tensor as cached, merged with cached neighbours (may throw before
  // changing anything).
  MESHTORCH_DECL void cache_locked(std::map<char*, Block>::iterator block);
  // A cached block's new size and age, its list entries moved (without allocating).
  MESHTORCH_DECL void recache_locked(std::map<char*, Block>::iterator block, std::size_t bytes, std::uint64_t since);
  // Takes a cached block out of the cache's lists (its entry in blocks_ is the caller's).
  MESHTORCH_DECL void uncache_locked(std::map<char*, Block>::iterator block);
  // Every cached block, taken out of the cache.
  MESHTORCH_DECL Ranges take_all_cached_locked();

  MESHTORCH_DECL static void release(void* data);

  mutable std::mutex mutex_;
  std::map<char*, Block> blocks_;  // large blocks, in tensors and cached, by address
  // Cached blocks, smallest first, and of one size the one freed last first: its pages are the
  // likeliest still in the CPU's caches.
  struct SizeKey {
    std::size_t bytes;
    std::uint64_t newness;  // ~cached_since
    char* data;
    bool operator<(const SizeKey& other) const {  // std::less: a total order on pointers, which < is not
      if (bytes != other.bytes) return bytes < other.bytes;
      if (newness != other.newness) return newness < other.newness;
      return std::less<char*>{}(data, other.data);
    }
  };
  static SizeKey size_key(char* data, const Block& block) { return {block.bytes, ~block.cached_since, data}; }
  std::set<SizeKey> cached_by_size_;
  // Cached blocks, oldest first, by when they were cached: no two cached blocks share it (a split's
  // rest keeps it, the part taken leaves the cache; a merge takes a new one).
  std::map<std::uint64_t, char*> cached_by_age_;
  std::uint64_t frees_ = 0;
  std::size_t cached_bytes_ = 0;
  std::size_t live_bytes_ = 0;       // large blocks in tensors now
  std::size_t pending_bytes_ = 0;    // large blocks being made now (by other threads too)
  std::size_t peak_live_bytes_ = 0;  // the most there have been in tensors at once
  Stats stats_;
};

// launch()'s choice for CPU runs: the caching allocator unless MESHTORCH_HOST_ALLOCATOR says
// `default` (LibTorch's own, e.g. to measure with jemalloc preloaded). Returns which is in use.
MESHTORCH_DECL std::string use_host_allocator_from_environment();

}  // namespace meshtorch::train

#if MESHTORCH_DEFINES(programs)
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <meshtorch/error.hpp>

namespace meshtorch::train {

namespace host_allocator_detail {

// A large block straight from the kernel (page-aligned, so also c10's 64-byte alignment): given
// back with unmap_range, its pages return to the system at once.
inline char* map_block(std::size_t nbytes) {
  void* data = ::mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED)
    C10_THROW_ERROR(OutOfMemoryError,
                    fmt::format("CachingHostAllocator: could not map a block of {} bytes: {} (out of memory, or of "
                                "the process's mappings: see vm.max_map_count)",
                                nbytes, std::strerror(errno)));
  return static_cast<char*>(data);
}

// Any whole pages of what was mapped, across mappings too: merged neighbours may come from two.
inline void unmap_range(char* data, std::size_t nbytes) { ::munmap(data, nbytes); }

inline void unmap_all(const std::vector<std::pair<char*, std::size_t>>& ranges) {
  for (const auto& [data, bytes] : ranges) unmap_range(data, bytes);
}

}  // namespace host_allocator_detail

MESHTORCH_DECL CachingHostAllocator& CachingHostAllocator::instance() {
  static auto* allocator = new CachingHostAllocator();
  return *allocator;
}

MESHTORCH_DECL void CachingHostAllocator::install() { c10::SetCPUAllocator(&instance(), /*priority=*/1); }

MESHTORCH_DECL std::size_t CachingHostAllocator::page_bytes() {
  static const auto bytes = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return bytes;
}

MESHTORCH_DECL c10::DataPtr CachingHostAllocator::allocate(std::size_t nbytes) {
  void* data = nullptr;
  if (nbytes >= min_cached_bytes) {
    const std::size_t bytes = whole_pages(nbytes);
    data = take_cached(bytes);
    if (!data) data = make_block(bytes);
  } else if (nbytes > 0) {
    data = c10::alloc_cpu(nbytes);
  }
  return {data, data, &CachingHostAllocator::release, c10::Device(c10::kCPU)};
}

MESHTORCH_DECL char* CachingHostAllocator::take_cached(std::size_t bytes) {
  std::lock_guard lock(mutex_);
  ++stats_.large_allocations;
  const auto smallest = cached_by_size_.lower_bound(SizeKey{bytes, 0, nullptr});
  if (smallest == cached_by_size_.end()) return nullptr;
  char* data = smallest->data;
  const auto block = blocks_.find(data);
  const std::size_t rest = block->second.bytes - bytes;
  const std::uint64_t since = block->second.cached_since;
  if (rest > 0) {
    // The rest stays cached, as old as it was: the block's list entries move to it (no
    // allocation), after the one step that may throw, before anything has changed.
    blocks_.emplace_hint(std::next(block), data + bytes, Block{rest, since});
    auto by_size = cached_by_size_.extract(smallest);
    by_size.value() = SizeKey{rest, ~since, data + bytes};
    cached_by_size_.insert(std::move(by_size));
    cached_by_age_.find(since)->second = data + bytes;
  } else {
    cached_by_size_.erase(smallest);
    cached_by_age_.erase(since);
  }
  block->second = Block{bytes, 0};
  cached_bytes_ -= bytes;
  live_bytes_ += bytes;
  peak_live_bytes_ = std::max(peak_live_bytes_, live_bytes_);
  ++stats_.served_from_cache;
  return data;
}

MESHTORCH_DECL char* CachingHostAllocator::make_block(std::size_t bytes) {
  Ranges evicted;
  {
    std::lock_guard lock(mutex_);
    evicted = evict_locked(bytes, std::max(bound_locked(), live_bytes_ + pending_bytes_ + bytes));
    pending_bytes_ += bytes;
  }
  host_allocator_detail::unmap_all(evicted);  // outside the lock: unmapping may take the kernel's time
  const auto not_made = [&] {
    std::lock_guard lock(mutex_);
    pending_bytes_ -= bytes;
  };
  char* data = nullptr;
  try {
    data = host_allocator_detail::map_block(bytes);
  } catch (const c10::OutOfMemoryError&) {
    // As CUDA's caching allocator does when the device is full: give back every cached block and
    // try once more.
    Ranges cached;
    {
      std::lock_guard lock(mutex_);
      cached = take_all_cached_locked();
    }
    host_allocator_detail::unmap_all(cached);
    try {
      data = host_allocator_detail::map_block(bytes);
    } catch (...) {
      not_made();
      throw;
    }
  }
  try {
    std::lock_guard lock(mutex_);
    in_tensor_locked(data, bytes);
    pending_bytes_ -= bytes;
  } catch (...) {
    host_allocator_detail::unmap_range(data, bytes);
    not_made();
    throw;
  }
  return data;
}

MESHTORCH_DECL void CachingHostAllocator::in_tensor_locked(char* data, std::size_t bytes) {
  blocks_.emplace(data, Block{bytes, 0});
  live_bytes_ += bytes;
  peak_live_bytes_ = std::max(peak_live_bytes_, live_bytes_);
}

MESHTORCH_DECL void CachingHostAllocator::uncache_locked(std::map<char*, Block>::iterator block) {
  cached_by_size_.erase(size_key(block->first, block->second));
  cached_by_age_.erase(block->second.cached_since);
  cached_bytes_ -= block->second.bytes;
}

MESHTORCH_DECL void CachingHostAllocator::recache_locked(std::map<char*, Block>::iterator block, std::size_t bytes,
                                                         std::uint64_t since) {
  auto by_size = cached_by_size_.extract(size_key(block->first, block->second));
  by_size.value() = SizeKey{bytes, ~since, block->first};
  cached_by_size_.insert(std::move(by_size));
  auto by_age = cached_by_age_.extract(block->second.cached_since);
  by_age.key() = since;
  cached_by_age_.insert(std::move(by_age));
  cached_bytes_ = cached_bytes_ - block->second.bytes + bytes;
  block->second.bytes = bytes;
  block->second.cached_since = since;
}

MESHTORCH_DECL void CachingHostAllocator::cache_locked(std::map<char*, Block>::iterator block) {
  // The lists' entries first, the only steps that may throw: if one does, nothing has changed.
  // Merging after moves entries, without allocating.
  char* const data = block->first;
  const std::size_t bytes = block->second.bytes;
  const std::uint64_t since = frees_ + 1;  // a merged block takes the newest age: it was just in use
  const auto by_size = cached_by_size_.insert(SizeKey{bytes, ~since, data}).first;
  try {
    cached_by_age_.emplace(since, data);
  } catch (...) {
    cached_by_size_.erase(by_size);
    throw;
  }
  frees_ = since;
  block->second = Block{bytes, since};
  cached_bytes_ += bytes;
  const auto next = std::next(block);
  if (next != blocks_.end() && next->second.cached() && next->first == data + bytes) {
    const std::size_t next_bytes = next->second.bytes;
    uncache_locked(next);
    blocks_.erase(next);
    recache_locked(block, bytes + next_bytes, since);
  }
  if (block != blocks_.begin()) {
    const auto previous = std::prev(block);
    if (previous->second.cached() && previous->first + previous->second.bytes == data) {
      const std::size_t merged = previous->second.bytes + block->second.bytes;
      uncache_locked(block);
      blocks_.erase(block);
      recache_locked(previous, merged, since);
    }
  }
}

MESHTORCH_DECL CachingHostAllocator::Ranges CachingHostAllocator::take_all_cached_locked() {
  Ranges ranges;
  ranges.reserve(cached_by_age_.size());
  for (const auto& [since, data] : cached_by_age_) {
    const auto block = blocks_.find(data);
    ranges.emplace_back(data, block->second.bytes);
    blocks_.erase(block);
  }
  cached_by_size_.clear();
  cached_by_age_.clear();
  cached_bytes_ = 0;
  return ranges;
}

MESHTORCH_DECL void CachingHostAllocator::release_cached() {
  Ranges ranges;
  {
    std::lock_guard lock(mutex_);
    ranges = take_all_cached_locked();
    peak_live_bytes_ = live_bytes_;
  }
  host_allocator_detail::unmap_all(ranges);
}

MESHTORCH_DECL CachingHostAllocator::Ranges CachingHostAllocator::evict_locked(std::size_t more, std::size_t budget) {
  Ranges evicted;
  const std::size_t held = live_bytes_ + pending_bytes_ + more;
  if (held + cached_bytes_ <= budget) return evicted;
  evicted.reserve(cached_by_age_.size());  // first: if it throws, nothing has changed
  // Whole pages: unmapping starts at a page (the bound's headroom need not be whole pages).
  std::size_t excess = whole_pages(held + cached_bytes_ - budget);
  while (excess > 0 && !cached_by_age_.empty()) {
    const auto block = blocks_.find(cached_by_age_.begin()->second);
    const std::size_t bytes = block->second.bytes;
    if (bytes > excess) {  // only its end goes: the rest stays cached, as old as it was (no allocation)
      const std::size_t kept = bytes - excess;
      recache_locked(block, kept, block->second.cached_since);
      evicted.emplace_back(block->first + kept, excess);
      break;
    }
    uncache_locked(block);
    evicted.emplace_back(block->first, bytes);
    blocks_.erase(block);
    excess -= bytes;
  }
  return evicted;
}

MESHTORCH_DECL void CachingHostAllocator::release(void* pointer) {
  if (!pointer) return;
  auto& self = instance();
  auto* data = static_cast<char*>(pointer);
  Ranges evicted;
  std::size_t unlisted_bytes = 0;  // a block that could not be cached: given back whole
  bool large = false;
  {
    std::lock_guard lock(self.mutex_);
    const auto block = self.blocks_.find(data);
    if (block != self.blocks_.end() && !block->second.cached()) {
      large = true;
      const std::size_t bytes = block->second.bytes;
      self.live_bytes_ -= bytes;
      bool cached = false;
      try {  // a deleter must not throw
        self.cache_locked(block);
        cached = true;
        // Within the cap and the bound: a block being made on another thread may have counted on
        // this one's bytes being in use, not cached.
        const std::size_t in_use = self.live_bytes_ + self.pending_bytes_;
        evicted = self.evict_locked(0, std::min(in_use + max_cached_bytes, std::max(self.bound_locked(), in_use)));
      } catch (...) {
      }
      if (!cached) {
        self.blocks_.erase(block);
        unlisted_bytes = bytes;
      }
    }
  }
  if (!large) return c10::free_cpu(pointer);
  host_allocator_detail::unmap_all(evicted);
  if (unlisted_bytes > 0) host_allocator_detail::unmap_range(data, unlisted_bytes);
}

MESHTORCH_DECL std::string use_host_allocator_from_environment() {
  const char* choice = std::getenv("MESHTORCH_HOST_ALLOCATOR");
  const std::string value = choice ? choice : "caching";
  if (value == "default") return value;
  if (value != "caching")
    throw ConfigError(
        fmt::format("MESHTORCH_HOST_ALLOCATOR is '{}': expected 'caching' (the default) or 'default' "
                    "(LibTorch's own CPU allocator)",
                    value));
  CachingHostAllocator::install();
  return value;
}

}  // namespace meshtorch::train
#endif  // MESHTORCH_DEFINES(programs)
