// A file descriptor closed on every path out of a scope, and the best-effort folder sync that
// makes a rename durable. Shared by the runtime and cache libraries.
#pragma once

#include <fcntl.h>
#include <filesystem>
#include <string>
#include <unistd.h>

namespace hybrid {

class UniqueFd {
public:
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(const UniqueFd &) = delete;
  UniqueFd &operator=(const UniqueFd &) = delete;
  ~UniqueFd() {
    if (fd_ >= 0)
      ::close(fd_);
  }
  int get() const { return fd_; }
  bool isOpen() const { return fd_ >= 0; }
  // Closes now and reports the error, which for a written file may be a deferred write error.
  int closeNow() {
    int result = ::close(fd_);
    fd_ = -1;
    return result;
  }

private:
  int fd_;
};

// Makes a rename into `path`'s folder durable. Best effort: some file systems refuse fsync on
// folders.
inline void syncParentDirectory(const std::string &path) {
  std::filesystem::path parent = std::filesystem::path(path).parent_path();
  UniqueFd dir(::open(parent.empty() ? "." : parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.isOpen())
    ::fsync(dir.get());
}

} // namespace hybrid
