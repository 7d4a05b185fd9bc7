// The on-disk store: POSIX calls for the atomic write (temporary file, fsync, rename, fsync of the
// folder) and for reading an entry back. Every failure becomes a Status naming the path.
#include "hybrid/cache/Store.h"
#include "hybrid/runtime/StatusHelpers.h"
#include "hybrid/runtime/UniqueFd.h"

#include "Buffer.h"

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <fcntl.h>
#include <filesystem>
#include <sys/stat.h>
#include <system_error>
#include <unistd.h>

namespace hybrid::cache {
namespace {

using Payload = std::vector<std::byte>;


Status errnoStatus(const std::string &path, std::string_view action, int error) {
  return Status::error(path + ": " + std::string(action) + ": " + errnoMessage(error));
}

// Removes a temporary file unless it was renamed into place.
class TemporaryFileGuard {
public:
  explicit TemporaryFileGuard(std::string path) : path_(std::move(path)) {}
  ~TemporaryFileGuard() {
    if (!committed_)
      ::unlink(path_.c_str());
  }
  TemporaryFileGuard(const TemporaryFileGuard &) = delete;
  TemporaryFileGuard &operator=(const TemporaryFileGuard &) = delete;

  void commit() { committed_ = true; }

private:
  std::string path_;
  bool committed_ = false;
};

Status writeAll(int fd, std::span<const std::byte> bytes, const std::string &path) {
  while (!bytes.empty()) {
    ssize_t written = ::write(fd, bytes.data(), bytes.size());
    if (written < 0) {
      if (errno == EINTR)
        continue;
      return errnoStatus(path, "cannot write", errno);
    }
    bytes = bytes.subspan(static_cast<size_t>(written));
  }
  return Status::ok();
}

Status readAll(int fd, std::span<std::byte> buffer, const std::string &path) {
  while (!buffer.empty()) {
    ssize_t got = ::read(fd, buffer.data(), buffer.size());
    if (got < 0) {
      if (errno == EINTR)
        continue;
      return errnoStatus(path, "cannot read", errno);
    }
    if (got == 0) // shrank since fstat: only an outside writer does that
      return Status::error(path + ": file shrank while being read");
    buffer = buffer.subspan(static_cast<size_t>(got));
  }
  return Status::ok();
}

// Makes a rename or a new folder entry durable: without it a crash may forget the name even
// though the file's data reached the disk.
Status syncDirectory(const std::string &path) {
  UniqueFd dir(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir.isOpen())
    return errnoStatus(path, "cannot open folder to sync it", errno);
  if (::fsync(dir.get()) != 0)
    return errnoStatus(path, "cannot sync folder", errno);
  return Status::ok();
}

// Creates `path` if missing (a concurrent creator is fine) and syncs its parent when it did.
Status ensureDirectory(const std::string &path, const std::string &parent) {
  if (::mkdir(path.c_str(), 0755) == 0)
    return syncDirectory(parent);
  if (errno != EEXIST)
    return errnoStatus(path, "cannot create folder", errno);
  struct stat info;
  if (::stat(path.c_str(), &info) != 0)
    return errnoStatus(path, "cannot stat", errno);
  if (!S_ISDIR(info.st_mode))
    return Status::error(path + ": exists but is not a folder");
  return Status::ok();
}

// Unique within the machine: the pid separates processes, the counter threads and calls.
std::string temporaryPathFor(const std::string &shardDir, const std::string &keyHex) {
  static std::atomic<uint64_t> counter{0};
  return shardDir + "/." + keyHex + "." + std::to_string(::getpid()) + "." +
         std::to_string(counter.fetch_add(1, std::memory_order_relaxed)) +
         std::string(kTemporaryFileExtension);
}

// What reading an entry file found: no file, a file that is unusable as an entry, or its bytes.
struct EntryFileRead {
  bool missing = false;
  std::string rejection;
  Payload bytes;
};

StatusOr<EntryFileRead> readEntryFile(const std::string &path) {
  EntryFileRead result;
  UniqueFd file(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!file.isOpen()) {
    if (errno == ENOENT || errno == ENOTDIR) {
      result.missing = true;
      return result;
    }
    return errnoStatus(path, "cannot open", errno);
  }
  struct stat info;
  if (::fstat(file.get(), &info) != 0)
    return errnoStatus(path, "cannot stat", errno);
  if (!S_ISREG(info.st_mode)) {
    result.rejection = "not a regular file";
    return result;
  }
  auto fileSize = static_cast<uint64_t>(info.st_size);
  if (fileSize > maxEntryFileSize()) {
    result.rejection = "file of " + std::to_string(fileSize) +
                       " bytes is larger than any valid entry (" +
                       std::to_string(maxEntryFileSize()) + " bytes)";
    return result;
  }
  HYBRID_RETURN_IF_ERROR(detail::resizeBuffer(result.bytes, fileSize, path));
  HYBRID_RETURN_IF_ERROR(readAll(file.get(), result.bytes, path));
  return result;
}

} // namespace

StatusOr<std::string> defaultCacheDir() {
  if (const char *dir = std::getenv("HYBRID_CACHE_DIR"); dir && *dir)
    return std::string(dir);
  if (const char *xdg = std::getenv("XDG_CACHE_HOME"); xdg && xdg[0] == '/')
    return std::string(xdg) + "/hybrid";
  if (const char *home = std::getenv("HOME"); home && *home)
    return std::string(home) + "/.cache/hybrid";
  return Status::error("no cache folder: set HYBRID_CACHE_DIR (HOME is unset and XDG_CACHE_HOME "
                       "is not an absolute path)");
}

StatusOr<CacheStore> CacheStore::open(std::string dir) {
  if (dir.empty())
    return Status::error("cache folder path is empty");
  while (dir.size() > 1 && dir.back() == '/')
    dir.pop_back();
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error)
    return Status::error(dir + ": cannot create cache folder: " + error.message());
  if (!std::filesystem::is_directory(dir, error))
    return Status::error(dir + ": cache path is not a folder");
  return CacheStore(std::move(dir));
}

std::string CacheStore::shardDirFor(const CacheKey &key) const {
  return dir_ + "/" + key.hex().substr(0, 2);
}

std::string CacheStore::pathFor(const CacheKey &key) const {
  return shardDirFor(key) + "/" + key.hex() + std::string(kEntryFileExtension);
}

StatusOr<std::optional<Payload>> CacheStore::get(const CacheKey &key, EntryKind kind,
                                                 std::string *whyRejected) {
  if (whyRejected)
    whyRejected->clear();
  std::string path = pathFor(key);
  HYBRID_ASSIGN_OR_RETURN(EntryFileRead file, readEntryFile(path));
  if (file.missing)
    return std::optional<Payload>();

  std::string rejection = std::move(file.rejection);
  if (rejection.empty()) {
    StatusOr<Payload> payload = decodeEntry(file.bytes, key, kind);
    if (payload.isOk())
      return std::optional<Payload>(std::move(payload).value());
    rejection = payload.status().message();
  }

  // A bad entry is never trusted and never kept: removing it lets the caller's recompile put a
  // good one. (If a writer renamed a fresh entry in since we read, that one goes too; the cost is
  // one more recompile, never a wrong payload.)
  rejection = path + ": " + rejection;
  int removeError = ::unlink(path.c_str()) == 0 ? 0 : errno;
  if (removeError != 0 && removeError != ENOENT)
    rejection += " (removing it failed: " + errnoMessage(removeError) + ")";
  else
    rejection += " (removed)";
  if (whyRejected)
    *whyRejected = std::move(rejection);
  return std::optional<Payload>();
}

Status CacheStore::put(const CacheKey &key, EntryKind kind, std::span<const std::byte> payload) {
  HYBRID_ASSIGN_OR_RETURN(Payload entry, encodeEntry(key, kind, payload, zstdLevel_));

  std::string shardDir = shardDirFor(key);
  HYBRID_RETURN_IF_ERROR(ensureDirectory(shardDir, dir_));

  std::string temporaryPath = temporaryPathFor(shardDir, key.hex());
  // O_EXCL: a name left by a crashed process with a recycled pid is never shared.
  UniqueFd file(::open(temporaryPath.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (!file.isOpen())
    return errnoStatus(temporaryPath, "cannot create", errno);
  TemporaryFileGuard removeUnlessRenamed(temporaryPath);

  HYBRID_RETURN_IF_ERROR(writeAll(file.get(), entry, temporaryPath));
  if (::fsync(file.get()) != 0)
    return errnoStatus(temporaryPath, "cannot sync", errno);
  if (file.closeNow() != 0)
    return errnoStatus(temporaryPath, "cannot close", errno);

  std::string path = pathFor(key);
  if (::rename(temporaryPath.c_str(), path.c_str()) != 0)
    return errnoStatus(path, "cannot rename the temporary file into place", errno);
  removeUnlessRenamed.commit();
  return syncDirectory(shardDir);
}

Status CacheStore::remove(const CacheKey &key) {
  std::string path = pathFor(key);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT)
    return errnoStatus(path, "cannot remove", errno);
  return Status::ok();
}

} // namespace hybrid::cache
