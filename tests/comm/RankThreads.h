// One thread per rank of a loopback group, for the tests of what runs over a Communicator.
#pragma once

#include "hybrid/runtime/Communicator.h"

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

} // namespace hybrid::comm::rankthreads
