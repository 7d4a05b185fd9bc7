// Socket reads and writes bounded by a deadline, shared by the rendezvous and the TCP backend.
#include "comm/Socket.h"

#include <cerrno>
#include <climits>
#include <cstring>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>

namespace hybrid::comm::socket {

int millisecondsLeft(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : int(std::min<long long>(left, INT_MAX));
}

// Waits for `events` on fd until the deadline.
Status waitFor(int fd, short events, Clock::time_point deadline, const std::string &what,
               const char *prefix) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int left = millisecondsLeft(deadline);
    if (left == 0)
      return Status::error(std::string(prefix) + ": timed out " + what);
    const int ready = ::poll(&p, 1, left);
    if (ready > 0)
      return Status::ok();
    if (ready < 0 && errno != EINTR)
      return Status::error(std::string(prefix) + ": " + what + ": " + std::strerror(errno));
  }
}

Status sendAll(int fd, const void *data, size_t size, Clock::time_point deadline,
               const std::string &what, const char *prefix) {
  const auto *bytes = static_cast<const char *>(data);
  while (size > 0) {
    HYBRID_RETURN_IF_ERROR(waitFor(fd, POLLOUT, deadline, what, prefix));
    const ssize_t n = ::send(fd, bytes, size, MSG_NOSIGNAL);
    if (n < 0 && (errno == EINTR || errno == EAGAIN))
      continue;
    if (n <= 0)
      return Status::error(std::string(prefix) + ": " + what + ": " + std::strerror(errno));
    bytes += n;
    size -= size_t(n);
  }
  return Status::ok();
}

Status receiveAll(int fd, void *data, size_t size, Clock::time_point deadline,
                  const std::string &what, const char *prefix) {
  auto *bytes = static_cast<char *>(data);
  while (size > 0) {
    HYBRID_RETURN_IF_ERROR(waitFor(fd, POLLIN, deadline, what, prefix));
    const ssize_t n = ::recv(fd, bytes, size, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN))
      continue;
    if (n == 0)
      return Status::error(std::string(prefix) + ": " + what + ": the peer closed the connection");
    if (n < 0)
      return Status::error(std::string(prefix) + ": " + what + ": " + std::strerror(errno));
    bytes += n;
    size -= size_t(n);
  }
  return Status::ok();
}

StatusOr<addrinfo *> resolve(const RendezvousConfig &config, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo *found = nullptr;
  const std::string port = std::to_string(config.masterPort);
  if (const int error = ::getaddrinfo(config.masterAddress.c_str(), port.c_str(), &hints, &found);
      error != 0)
    return Status::error("rendezvous: MASTER_ADDR '" + config.masterAddress +
                         "': " + ::gai_strerror(error));
  return found;
}

} // namespace hybrid::comm::socket
