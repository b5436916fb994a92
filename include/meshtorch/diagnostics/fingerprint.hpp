#pragma once
// Ranks compare a fingerprint (mesh type, device, the caller's plan/flags string) through the
// store before creating any process group. A rank started with another binary or other flags
// would otherwise join collectives of the wrong shape and hang; here every rank gets an error
// naming both values instead.
//
// Rank 0 reads every rank's value and publishes a verdict; the others wait for the verdict. So
// the whole exchange is O(world size) store operations and every rank learns of any mismatch.
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::diagnostics {

namespace detail {

inline std::vector<uint8_t> to_bytes(const std::string& text) { return {text.begin(), text.end()}; }
inline std::string from_bytes(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }

// The first line on which two fingerprints differ ("lr=0.001" against "lr=0.0003"), so that a
// flag mismatch names the flag and both values, not two pages of flags.
MESHTORCH_DECL std::pair<std::string, std::string> first_differing_lines(const std::string& a, const std::string& b);

inline std::string fingerprint_key(int rank) { return "meshtorch/fingerprint/" + std::to_string(rank); }

}  // namespace detail

MESHTORCH_DECL void check_fingerprints(c10d::Store& store, int rank, int world_size, const std::string& fingerprint,
                                       std::chrono::milliseconds timeout);

}  // namespace meshtorch::diagnostics

#if MESHTORCH_DEFINES(core)
#include <algorithm>
#include <exception>

#include <fmt/format.h>

namespace meshtorch::diagnostics {

namespace detail {

MESHTORCH_DECL std::pair<std::string, std::string> first_differing_lines(const std::string& a, const std::string& b) {
  std::size_t start_a = 0, start_b = 0;
  while (start_a < a.size() || start_b < b.size()) {
    const auto end_a = std::min(a.find('\n', start_a), a.size());
    const auto end_b = std::min(b.find('\n', start_b), b.size());
    auto line_a = a.substr(start_a, end_a - start_a), line_b = b.substr(start_b, end_b - start_b);
    if (line_a != line_b) return {line_a, line_b};
    start_a = end_a + 1;
    start_b = end_b + 1;
  }
  return {a, b};
}

}  // namespace detail

MESHTORCH_DECL void check_fingerprints(c10d::Store& store, int rank, int world_size, const std::string& fingerprint,
                                       std::chrono::milliseconds timeout) {
  const std::string verdict_key = "meshtorch/fingerprint/verdict";
  const std::string readers_key = "meshtorch/fingerprint/readers";
  const std::string read_key = "meshtorch/fingerprint/read";
  store.setTimeout(timeout);
  store.set(detail::fingerprint_key(rank), detail::to_bytes(fingerprint));
  std::string verdict;
  if (rank == 0) {
    for (int other = 1; other < world_size && verdict.empty(); ++other) {
      try {
        const std::string theirs = detail::from_bytes(store.get(detail::fingerprint_key(other)));
        if (theirs != fingerprint) {
          const auto [their_line, our_line] = detail::first_differing_lines(theirs, fingerprint);
          verdict = fmt::format(
              "rank {} was started with '{}' but rank 0 with '{}'; start every rank with the same "
              "program, mesh and flags",
              other, their_line, our_line);
        }
      } catch (const std::exception&) {
        verdict = fmt::format(
            "rank {} did not report its fingerprint within {} ms; check that it started and did "
            "not fail",
            other, timeout.count());
      }
    }
    store.set(verdict_key, detail::to_bytes(verdict.empty() ? "ok" : verdict));
    // Rank 0 serves the store: it stays until every rank has read the verdict, else a rank that
    // fails right after init (or this one, now) would close the store under ranks still reading.
    bool all_read = true;
    try {
      if (world_size > 1) store.wait({read_key}, timeout);
    } catch (const std::exception&) {
      all_read = false;
    }
    if (!verdict.empty()) throw CommError(fmt::format("mesh init on rank 0: {}", verdict));
    if (!all_read)
      throw CommError(
          fmt::format("mesh init on rank 0: not every rank read the fingerprint verdict within {} ms; "
                      "check that no rank failed",
                      timeout.count()));
    return;
  }
  try {
    verdict = detail::from_bytes(store.get(verdict_key));
  } catch (const std::exception& e) {
    throw CommError(fmt::format("mesh init on rank {}: rank 0 gave no fingerprint verdict within {} ms: {}", rank,
                                timeout.count(), e.what()));
  }
  if (store.add(readers_key, 1) == world_size - 1) store.set(read_key, detail::to_bytes("1"));
  if (verdict != "ok") throw CommError(fmt::format("mesh init on rank {}: {}", rank, verdict));
}

}  // namespace meshtorch::diagnostics
#endif  // MESHTORCH_DEFINES(core)
