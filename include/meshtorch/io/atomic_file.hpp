#pragma once
// Files that are never half-written: write to a temporary name beside the target, fsync,
// rename over the target, fsync the directory. A crash leaves either the old file or the new.
#include <cstddef>
#include <filesystem>
#include <string>
#include <string_view>

#include <meshtorch/error.hpp>
#include <meshtorch/separate_compilation.hpp>

namespace meshtorch::io {

MESHTORCH_DECL void fsync_path(const std::filesystem::path& path);

class AtomicFile {
 public:
  MESHTORCH_DECL explicit AtomicFile(std::filesystem::path target);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  MESHTORCH_DECL ~AtomicFile();

  MESHTORCH_DECL void write(const void* data, std::size_t size);
  void write(std::string_view text) { write(text.data(), text.size()); }

  MESHTORCH_DECL void commit();

 private:
  std::filesystem::path target_, temporary_;
  int fd_ = -1;
};

inline void write_file_atomically(const std::filesystem::path& path, std::string_view contents) {
  AtomicFile file(path);
  file.write(contents);
  file.commit();
}

}  // namespace meshtorch::io

#if MESHTORCH_DEFINES(core)
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>
#include <utility>

#include <fmt/format.h>

namespace meshtorch::io {

MESHTORCH_DECL void fsync_path(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;  // best effort for directories on file systems that refuse it
  ::fsync(fd);
  ::close(fd);
}

MESHTORCH_DECL AtomicFile::AtomicFile(std::filesystem::path target)
    : target_(std::move(target)), temporary_(fmt::format("{}.tmp.{}", target_.string(), ::getpid())) {
  fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd_ < 0) throw DataError(fmt::format("{}: cannot create ({})", temporary_.string(), std::strerror(errno)));
}

MESHTORCH_DECL AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {  // not committed: leave the target as it was
    ::close(fd_);
    std::error_code ignored;
    std::filesystem::remove(temporary_, ignored);
  }
}

MESHTORCH_DECL void AtomicFile::write(const void* data, std::size_t size) {
  const char* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_, bytes, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw DataError(fmt::format("{}: write failed ({})", temporary_.string(), std::strerror(errno)));
    }
    bytes += n;
    size -= static_cast<std::size_t>(n);
  }
}

MESHTORCH_DECL void AtomicFile::commit() {
  if (::fsync(fd_) != 0)
    throw DataError(fmt::format("{}: fsync failed ({})", temporary_.string(), std::strerror(errno)));
  ::close(fd_);
  fd_ = -1;
  std::filesystem::rename(temporary_, target_);
  fsync_path(target_.parent_path().empty() ? std::filesystem::path(".") : target_.parent_path());
}

}  // namespace meshtorch::io
#endif  // MESHTORCH_DEFINES(core)
