// Socket reads and writes bounded by a deadline (internal to hybrid_comm): the rendezvous and the
// TCP backend. Errors start with `prefix` ("rendezvous", "tcp") and say what was being done.
#pragma once

#include "hybrid/runtime/Communicator.h"
#include "hybrid/runtime/Status.h"

#include <chrono>
#include <cstddef>
#include <netdb.h>
#include <string>

namespace hybrid::comm::socket {

using Clock = std::chrono::steady_clock;

// Milliseconds until `deadline`, 0 once it has passed.
int millisecondsLeft(Clock::time_point deadline);
// Waits for `events` (POLLIN, POLLOUT) on fd until the deadline.
Status waitFor(int fd, short events, Clock::time_point deadline, const std::string &what,
               const char *prefix = "rendezvous");
Status sendAll(int fd, const void *data, size_t size, Clock::time_point deadline,
               const std::string &what, const char *prefix = "rendezvous");
Status receiveAll(int fd, void *data, size_t size, Clock::time_point deadline,
                  const std::string &what, const char *prefix = "rendezvous");

// MASTER_ADDR:MASTER_PORT of `config` (passive: to listen on); freeaddrinfo the result.
StatusOr<addrinfo *> resolve(const RendezvousConfig &config, bool passive);

} // namespace hybrid::comm::socket
