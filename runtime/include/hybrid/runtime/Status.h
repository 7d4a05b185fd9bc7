// Error values for code that must not throw across library boundaries (the compiler is built
// without exceptions). A Status carries one human-readable line naming the file, field or tensor.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <utility>

namespace hybrid {

class [[nodiscard]] Status {
public:
  Status() = default;
  static Status ok() { return Status(); }
  static Status error(std::string message) {
    Status s;
    s.message_ = std::move(message);
    s.failed_ = true;
    return s;
  }
  // A capacity ran out (the KV cache's pages): the same request may succeed once others free
  // theirs, so a scheduler preempts and retries rather than failing it. Context keeps the kind.
  static Status exhausted(std::string message) {
    Status s = error(std::move(message));
    s.exhausted_ = true;
    return s;
  }

  bool isOk() const { return !failed_; }
  bool isExhausted() const { return exhausted_; }
  explicit operator bool() const { return !failed_; }
  const std::string &message() const { return message_; }

  // Prefixes context ("file.safetensors: ") to a failure; no-op on success.
  Status withContext(const std::string &context) && {
    if (failed_)
      message_ = context + ": " + message_;
    return std::move(*this);
  }

private:
  std::string message_;
  bool failed_ = false;
  bool exhausted_ = false;
};

template <typename T> class [[nodiscard]] StatusOr {
public:
  StatusOr(T value) : value_(std::move(value)) {}
  StatusOr(Status status) : status_(std::move(status)) { assert(!status_.isOk()); }

  bool isOk() const { return value_.has_value(); }
  explicit operator bool() const { return isOk(); }
  const Status &status() const { return status_; }
  T &value() & {
    assert(isOk());
    return *value_;
  }
  const T &value() const & {
    assert(isOk());
    return *value_;
  }
  T &&value() && {
    assert(isOk());
    return std::move(*value_);
  }
  T *operator->() { return &value(); }
  const T *operator->() const { return &value(); }
  T &operator*() & { return value(); }
  const T &operator*() const & { return value(); }

private:
  std::optional<T> value_;
  Status status_;
};

} // namespace hybrid

// Early-return helpers for functions returning Status or StatusOr.
#define HYBRID_CONCAT_INNER(a, b) a##b
#define HYBRID_CONCAT(a, b) HYBRID_CONCAT_INNER(a, b)
#define HYBRID_RETURN_IF_ERROR(expr)                                                              \
  do {                                                                                            \
    ::hybrid::Status hybrid_status_ = (expr);                                                     \
    if (!hybrid_status_.isOk())                                                                   \
      return hybrid_status_;                                                                      \
  } while (0)
#define HYBRID_ASSIGN_OR_RETURN(lhs, expr)                                                        \
  auto HYBRID_CONCAT(hybrid_result_, __LINE__) = (expr);                                          \
  if (!HYBRID_CONCAT(hybrid_result_, __LINE__).isOk())                                            \
    return HYBRID_CONCAT(hybrid_result_, __LINE__).status();                                      \
  lhs = std::move(HYBRID_CONCAT(hybrid_result_, __LINE__)).value()
