#pragma once
// A file's size and XXH3-64 checksum, as a checkpoint manifest records them. XXH3 hashes far
// above disk speed (io/xxh3.hpp), so verifying a checkpoint costs one read of it and no CPU to
// speak of.
#include <cstdint>
#include <filesystem>
#include <string>

#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::io {

struct FileDigest {
  std::uint64_t bytes = 0;
  std::uint64_t xxh3 = 0;
  friend bool operator==(const FileDigest&, const FileDigest&) = default;
};

// The checksum as a manifest writes it: 16 lower-case hex digits.
MESHTORCH_DECL std::string checksum_hex(std::uint64_t value);

// Reads the whole file in 4 MiB blocks (never more in memory).
MESHTORCH_DECL FileDigest digest_file(const std::filesystem::path& path);

}  // namespace meshtorch::io

#if MESHTORCH_DEFINES(core)
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include <meshtorch/error.hpp>
#include <meshtorch/io/xxh3.hpp>

namespace meshtorch::io {

MESHTORCH_DECL std::string checksum_hex(std::uint64_t value) { return fmt::format("{:016x}", value); }

MESHTORCH_DECL FileDigest digest_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw DataError(fmt::format("{}: cannot open ({})", path.string(), std::strerror(errno)));
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  std::vector<char> block(std::size_t{4} << 20);
  FileDigest digest;
  for (;;) {
    const ssize_t n = ::read(fd, block.data(), block.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      ::close(fd);
      throw DataError(fmt::format("{}: read failed ({})", path.string(), std::strerror(error)));
    }
    if (n == 0) break;
    XXH3_64bits_update(&state, block.data(), static_cast<std::size_t>(n));
    digest.bytes += static_cast<std::uint64_t>(n);
  }
  ::close(fd);
  digest.xxh3 = XXH3_64bits_digest(&state);
  return digest;
}

}  // namespace meshtorch::io
#endif  // MESHTORCH_DEFINES(core)
