// One thread per rank of a loopback group, for the tests of what runs over a Communicator; and a
// free TCP port for the tests of the TCP / NCCL rendezvous.
#pragma once

#include "hybrid/runtime/Communicator.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <functional>
#include <thread>
#include <vector>

namespace hybrid::comm::rankthreads {

// Runs body(rank, its communicator) on one thread per rank of `ranks`; each rank's status.
inline std::vector<Status> onEveryRank(std::vector<std::unique_ptr<Communicator>> &ranks,
                                       const std::function<Status(int, Communicator &)> &body) {
  std::vector<Status> statuses(ranks.size(), Status::ok());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ranks.size(); ++r)
    threads.emplace_back([&, r] { statuses[r] = body(int(r), *ranks[r]); });
  for (std::thread &t : threads)
    t.join();
  return statuses;
}

// The same on a fresh loopback group of `worldSize` ranks (a failed group: one error).
inline std::vector<Status> onEveryRank(int worldSize,
                                       const std::function<Status(int, Communicator &)> &body) {
  auto group = makeLoopbackGroup(worldSize);
  if (!group)
    return {group.status()};
  return onEveryRank(*group, body);
}

// A port nobody listens on right now (the kernel's pick for port 0).
inline int freePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr *>(&address), sizeof address) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr *>(&address), &length) == 0)
    port = ntohs(address.sin_port);
  ::close(fd);
  return port;
}

} // namespace hybrid::comm::rankthreads
