// The rendezvous of a multi-process launch: the launch convention's environment variables, and a
// one-shot exchange over TCP. Rank 0 listens on MASTER_ADDR:MASTER_PORT; every other rank connects
// (retrying while rank 0 is not up yet) and sends [rank, length, bytes]; rank 0 answers each with
// all the blobs in rank order. Every read and write is bounded by the deadline.
#include "hybrid/runtime/Communicator.h"

#include "comm/Socket.h"
#include "hybrid/runtime/UniqueFd.h"

#include <arpa/inet.h>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string_view>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

namespace hybrid::comm {
namespace {

using socket::Clock;
using socket::millisecondsLeft;
using socket::receiveAll;
using socket::resolve;
using socket::sendAll;
using socket::waitFor;
constexpr uint32_t kMaxBlobBytes = 1u << 20;

StatusOr<long> integerVariable(const char *name, long low, long high, const long *fallback) {
  const char *text = std::getenv(name);
  if (!text || !*text) {
    if (fallback)
      return *fallback;
    return Status::error(std::string("rendezvous: environment variable ") + name + " is not set");
  }
  char *end = nullptr;
  errno = 0;
  const long value = std::strtol(text, &end, 10);
  if (errno != 0 || *end != '\0' || value < low || value > high)
    return Status::error(std::string("rendezvous: ") + name + "='" + text +
                         "' is not an integer in " + std::to_string(low) + ".." +
                         std::to_string(high));
  return value;
}

Status sendBlob(int fd, const std::string &blob, Clock::time_point deadline,
                const std::string &what) {
  const uint32_t length = htonl(uint32_t(blob.size()));
  HYBRID_RETURN_IF_ERROR(sendAll(fd, &length, sizeof length, deadline, what));
  return sendAll(fd, blob.data(), blob.size(), deadline, what);
}

StatusOr<std::string> receiveBlob(int fd, Clock::time_point deadline, const std::string &what) {
  uint32_t length = 0;
  HYBRID_RETURN_IF_ERROR(receiveAll(fd, &length, sizeof length, deadline, what));
  length = ntohl(length);
  if (length > kMaxBlobBytes)
    return Status::error("rendezvous: " + what + ": a blob of " + std::to_string(length) +
                         " bytes (at most " + std::to_string(kMaxBlobBytes) + ")");
  std::string blob(length, '\0');
  HYBRID_RETURN_IF_ERROR(receiveAll(fd, blob.data(), length, deadline, what));
  return blob;
}

StatusOr<std::vector<std::string>> serve(const RendezvousConfig &config, const std::string &blob,
                                         Clock::time_point deadline) {
  HYBRID_ASSIGN_OR_RETURN(addrinfo * found, resolve(config, true));
  UniqueFd listener(::socket(found->ai_family, found->ai_socktype | SOCK_CLOEXEC, 0));
  const int on = 1;
  const bool bound = listener.isOpen() &&
                     ::setsockopt(listener.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) == 0 &&
                     ::bind(listener.get(), found->ai_addr, found->ai_addrlen) == 0 &&
                     ::listen(listener.get(), config.worldSize) == 0;
  const int bindError = errno;
  ::freeaddrinfo(found);
  if (!bound)
    return Status::error("rendezvous: rank 0 cannot listen on " + config.masterAddress + ":" +
                         std::to_string(config.masterPort) + ": " + std::strerror(bindError));
  std::vector<std::string> blobs(size_t(config.worldSize));
  std::vector<bool> seen(size_t(config.worldSize), false);
  blobs[0] = blob;
  seen[0] = true;
  std::vector<std::unique_ptr<UniqueFd>> peers; // UniqueFd does not move
  for (int joined = 1; joined < config.worldSize; ++joined) {
    HYBRID_RETURN_IF_ERROR(waitFor(listener.get(), POLLIN, deadline,
                                   "waiting for rank " + std::to_string(joined) + " of " +
                                       std::to_string(config.worldSize) + " to connect"));
    auto &peer = *peers.emplace_back(
        std::make_unique<UniqueFd>(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC)));
    if (!peer.isOpen())
      return Status::error(std::string("rendezvous: accept: ") + std::strerror(errno));
    uint32_t rank = 0;
    HYBRID_RETURN_IF_ERROR(receiveAll(peer.get(), &rank, sizeof rank, deadline, "a peer's rank"));
    rank = ntohl(rank);
    if (rank == 0 || rank >= uint32_t(config.worldSize) || seen[rank])
      return Status::error("rendezvous: a peer claims rank " + std::to_string(rank) +
                           (rank != 0 && rank < uint32_t(config.worldSize) ? " twice"
                                                                            : " (WORLD_SIZE " +
                                                                                  std::to_string(config.worldSize) + ")"));
    HYBRID_ASSIGN_OR_RETURN(blobs[rank], receiveBlob(peer.get(), deadline,
                                                     "rank " + std::to_string(rank) + "'s blob"));
    seen[rank] = true;
  }
  for (const auto &peer : peers)
    for (const std::string &b : blobs)
      HYBRID_RETURN_IF_ERROR(sendBlob(peer->get(), b, deadline, "sending the blobs"));
  return blobs;
}

StatusOr<std::vector<std::string>> join(const RendezvousConfig &config, const std::string &blob,
                                        Clock::time_point deadline) {
  for (;;) { // rank 0 may not be listening yet
    HYBRID_ASSIGN_OR_RETURN(addrinfo * found, resolve(config, false));
    UniqueFd fd(::socket(found->ai_family, found->ai_socktype | SOCK_CLOEXEC, 0));
    const bool connected =
        fd.isOpen() && ::connect(fd.get(), found->ai_addr, found->ai_addrlen) == 0;
    const int connectError = errno;
    ::freeaddrinfo(found);
    if (!connected) {
      if (millisecondsLeft(deadline) == 0)
        return Status::error("rendezvous: rank " + std::to_string(config.rank) +
                             " could not reach rank 0 at " + config.masterAddress + ":" +
                             std::to_string(config.masterPort) + ": " +
                             std::strerror(connectError));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    const uint32_t rank = htonl(uint32_t(config.rank));
    HYBRID_RETURN_IF_ERROR(sendAll(fd.get(), &rank, sizeof rank, deadline, "sending the rank"));
    HYBRID_RETURN_IF_ERROR(sendBlob(fd.get(), blob, deadline, "sending the blob"));
    std::vector<std::string> blobs;
    for (int r = 0; r < config.worldSize; ++r) {
      HYBRID_ASSIGN_OR_RETURN(std::string b,
                              receiveBlob(fd.get(), deadline, "receiving the blobs from rank 0"));
      blobs.push_back(std::move(b));
    }
    return blobs;
  }
}

} // namespace

StatusOr<RendezvousConfig> rendezvousFromEnvironment() {
  RendezvousConfig config;
  HYBRID_ASSIGN_OR_RETURN(const long worldSize,
                          integerVariable("WORLD_SIZE", 1, 1 << 16, nullptr));
  HYBRID_ASSIGN_OR_RETURN(const long rank, integerVariable("RANK", 0, worldSize - 1, nullptr));
  HYBRID_ASSIGN_OR_RETURN(const long localRank, integerVariable("LOCAL_RANK", 0, 1 << 16, &rank));
  const long defaultPort = config.masterPort;
  HYBRID_ASSIGN_OR_RETURN(const long port, integerVariable("MASTER_PORT", 1, 65535, &defaultPort));
  config.worldSize = int(worldSize);
  config.rank = int(rank);
  config.localRank = int(localRank);
  config.masterPort = int(port);
  if (const char *address = std::getenv("MASTER_ADDR"); address && *address)
    config.masterAddress = address;
  else if (worldSize > 1)
    return Status::error("rendezvous: environment variable MASTER_ADDR is not set (WORLD_SIZE " +
                         std::to_string(worldSize) + ")");
  return config;
}

StatusOr<std::unique_ptr<Communicator>> connectFromEnvironment(const std::string &device) {
  const char *world = std::getenv("WORLD_SIZE");
  if (!world || std::string_view(world) == "1")
    return std::unique_ptr<Communicator>();
  if (device != "cpu" && device != "cuda")
    return Status::error("rendezvous: WORLD_SIZE=" + std::string(world) + " on device '" +
                         device + "': ranks connect over tcp (cpu) or nccl (cuda)");
  HYBRID_ASSIGN_OR_RETURN(const RendezvousConfig config, rendezvousFromEnvironment());
  auto connected = device == "cuda" ? connectNccl(config) : connectTcp(config);
  if (!connected)
    return Status::error("rank " + std::to_string(config.rank) + " of " +
                         std::to_string(config.worldSize) + ": " + connected.status().message());
  return connected;
}

StatusOr<std::vector<std::string>> exchangeAtRendezvous(const RendezvousConfig &config,
                                                        const std::string &blob) {
  if (config.worldSize < 1 || config.rank < 0 || config.rank >= config.worldSize)
    return Status::error("rendezvous: rank " + std::to_string(config.rank) +
                         " is outside a world of " + std::to_string(config.worldSize));
  if (blob.size() > kMaxBlobBytes)
    return Status::error("rendezvous: a blob of " + std::to_string(blob.size()) +
                         " bytes (at most " + std::to_string(kMaxBlobBytes) + ")");
  if (config.worldSize == 1)
    return std::vector<std::string>{blob};
  const Clock::time_point deadline = Clock::now() + config.timeout;
  return config.rank == 0 ? serve(config, blob, deadline) : join(config, blob, deadline);
}

} // namespace hybrid::comm
