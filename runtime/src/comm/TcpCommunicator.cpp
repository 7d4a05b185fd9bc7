// The TCP backend: one process per rank on host buffers (the cpu device's multi-process launch).
// A star around rank 0: at connect time every other rank opens one connection to
// MASTER_ADDR:MASTER_PORT and says its rank; then for each collective every rank sends rank 0 a
// header (operation, count) and its input, rank 0 checks that the calls agree, computes every
// rank's result the way the loopback backend does (sums from zero in rank order, so a run gives
// the same bits as the loopback threads) and sends each rank its result or the reason the call
// failed. Meant for correctness on the cpu device, not bandwidth: rank 0 moves all the bytes.
#include "hybrid/runtime/Communicator.h"

#include "comm/Socket.h"
#include "hybrid/runtime/UniqueFd.h"

#include <arpa/inet.h>
#include <cerrno>
#include <cstring>
#include <memory>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <thread>

namespace hybrid::comm {
namespace {

using socket::Clock;
constexpr const char *kPrefix = "tcp";

enum class Operation : uint32_t { AllReduceSum = 1, AllGather, ReduceScatterSum, AllToAll, Barrier };

const char *nameOf(Operation operation) {
  switch (operation) {
  case Operation::AllReduceSum:
    return "allReduceSum";
  case Operation::AllGather:
    return "allGather";
  case Operation::ReduceScatterSum:
    return "reduceScatterSum";
  case Operation::AllToAll:
    return "allToAll";
  case Operation::Barrier:
    return "barrier";
  }
  return "an unknown collective";
}

// What every rank sends before its input: the call, which must be the same on every rank.
struct Header {
  uint32_t operation = 0;
  uint32_t pad = 0;
  uint64_t count = 0;
};

// Elements each rank sends and receives for a call of `count`.
size_t inputElements(Operation operation, size_t count, int worldSize) {
  return operation == Operation::ReduceScatterSum || operation == Operation::AllToAll
             ? count * size_t(worldSize)
         : operation == Operation::Barrier ? 0
                                           : count;
}
size_t outputElements(Operation operation, size_t count, int worldSize) {
  return operation == Operation::AllGather || operation == Operation::AllToAll
             ? count * size_t(worldSize)
         : operation == Operation::Barrier ? 0
                                           : count;
}

void noDelay(int fd) {
  const int on = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
}

class TcpCommunicator final : public Communicator {
public:
  TcpCommunicator(int rank, int worldSize, std::chrono::milliseconds timeout)
      : rank_(rank), worldSize_(worldSize), timeout_(timeout) {}

  int rank() const override { return rank_; }
  int worldSize() const override { return worldSize_; }
  std::string backend() const override { return "tcp"; }

  Status allReduceSum(float *data, size_t count, void *) override {
    return collective(Operation::AllReduceSum, data, count, data);
  }
  Status allGather(const float *mine, float *all, size_t count, void *) override {
    return collective(Operation::AllGather, mine, count, all);
  }
  Status reduceScatterSum(const float *all, float *mine, size_t count, void *) override {
    return collective(Operation::ReduceScatterSum, all, count, mine);
  }
  Status allToAll(const float *sent, float *received, size_t count, void *) override {
    return collective(Operation::AllToAll, sent, count, received);
  }
  Status barrier() override { return collective(Operation::Barrier, nullptr, 0, nullptr); }

  // Rank 0: accepts the other ranks on `listener`; the others: connect to rank 0.
  Status connect(const RendezvousConfig &config) {
    const Clock::time_point deadline = Clock::now() + config.timeout;
    return rank_ == 0 ? accept(config, deadline) : join(config, deadline);
  }

private:
  Status accept(const RendezvousConfig &config, Clock::time_point deadline) {
    HYBRID_ASSIGN_OR_RETURN(addrinfo * found, socket::resolve(config, true));
    UniqueFd listener(::socket(found->ai_family, found->ai_socktype | SOCK_CLOEXEC, 0));
    const int on = 1;
    const bool bound = listener.isOpen() &&
                       ::setsockopt(listener.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) == 0 &&
                       ::bind(listener.get(), found->ai_addr, found->ai_addrlen) == 0 &&
                       ::listen(listener.get(), worldSize_) == 0;
    const int bindError = errno;
    ::freeaddrinfo(found);
    if (!bound)
      return Status::error(std::string(kPrefix) + ": rank 0 cannot listen on " +
                           config.masterAddress + ":" + std::to_string(config.masterPort) + ": " +
                           std::strerror(bindError));
    peers_.resize(size_t(worldSize_));
    for (int joined = 1; joined < worldSize_; ++joined) {
      HYBRID_RETURN_IF_ERROR(socket::waitFor(listener.get(), POLLIN, deadline,
                                             "waiting for rank " + std::to_string(joined) +
                                                 " of " + std::to_string(worldSize_) +
                                                 " to connect",
                                             kPrefix));
      auto peer = std::make_unique<UniqueFd>(
          ::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!peer->isOpen())
        return Status::error(std::string(kPrefix) + ": accept: " + std::strerror(errno));
      uint32_t hello[2] = {0, 0}; // rank, world size
      HYBRID_RETURN_IF_ERROR(socket::receiveAll(peer->get(), hello, sizeof hello, deadline,
                                                "a peer's rank", kPrefix));
      const uint32_t rank = ntohl(hello[0]), world = ntohl(hello[1]);
      if (world != uint32_t(worldSize_) || rank == 0 || rank >= uint32_t(worldSize_) ||
          peers_[rank])
        return Status::error(std::string(kPrefix) + ": a peer says it is rank " +
                             std::to_string(rank) + " of " + std::to_string(world) +
                             "; rank 0 runs a world of " + std::to_string(worldSize_) +
                             (rank < uint32_t(worldSize_) && peers_[rank] ? " and has that rank"
                                                                          : ""));
      noDelay(peer->get());
      peers_[rank] = std::move(peer);
    }
    return Status::ok();
  }

  Status join(const RendezvousConfig &config, Clock::time_point deadline) {
    for (;;) { // rank 0 may not be listening yet
      HYBRID_ASSIGN_OR_RETURN(addrinfo * found, socket::resolve(config, false));
      auto fd = std::make_unique<UniqueFd>(
          ::socket(found->ai_family, found->ai_socktype | SOCK_CLOEXEC, 0));
      const bool connected =
          fd->isOpen() && ::connect(fd->get(), found->ai_addr, found->ai_addrlen) == 0;
      const int connectError = errno;
      ::freeaddrinfo(found);
      if (!connected) {
        if (socket::millisecondsLeft(deadline) == 0)
          return Status::error(std::string(kPrefix) + ": rank " + std::to_string(rank_) +
                               " could not reach rank 0 at " + config.masterAddress + ":" +
                               std::to_string(config.masterPort) + ": " +
                               std::strerror(connectError));
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        continue;
      }
      noDelay(fd->get());
      const uint32_t hello[2] = {htonl(uint32_t(rank_)), htonl(uint32_t(worldSize_))};
      HYBRID_RETURN_IF_ERROR(
          socket::sendAll(fd->get(), hello, sizeof hello, deadline, "sending the rank", kPrefix));
      root_ = std::move(fd);
      return Status::ok();
    }
  }

  Status failed(const std::string &why) {
    broken_ = why;
    return Status::error(why);
  }

  Status collective(Operation operation, const float *input, size_t count, float *output) {
    if (!broken_.empty())
      return Status::error(broken_);
    const Clock::time_point deadline = Clock::now() + timeout_;
    const std::string what = std::string(nameOf(operation)) + " of " + std::to_string(count) +
                             " values on rank " + std::to_string(rank_);
    const size_t in = inputElements(operation, count, worldSize_);
    const size_t out = outputElements(operation, count, worldSize_);
    if (worldSize_ == 1) {
      if (out > 0)
        std::copy(input, input + out, output); // every collective of one rank is a copy
      return Status::ok();
    }
    return rank_ == 0 ? gather(operation, input, count, in, out, output, deadline, what)
                      : exchange(operation, input, count, in, out, output, deadline, what);
  }

  // A rank other than 0: header and input to rank 0, then [status, result or reason] back.
  Status exchange(Operation operation, const float *input, size_t count, size_t in, size_t out,
                  float *output, Clock::time_point deadline, const std::string &what) {
    const int fd = root_->get();
    const Header header{uint32_t(operation), 0, uint64_t(count)};
    Status sent = socket::sendAll(fd, &header, sizeof header, deadline, what, kPrefix);
    if (sent && in > 0)
      sent = socket::sendAll(fd, input, in * sizeof(float), deadline, what, kPrefix);
    if (!sent)
      return failed(sent.message());
    uint32_t status[2] = {0, 0}; // 0 = ok, else the reason's length
    if (Status got = socket::receiveAll(fd, status, sizeof status, deadline, what, kPrefix); !got)
      return failed(got.message());
    if (status[0] != 0) {
      std::string why(status[1], '\0');
      if (Status got = socket::receiveAll(fd, why.data(), why.size(), deadline, what, kPrefix);
          !got)
        return failed(got.message());
      return Status::error(why); // a mismatched call: the group stays usable, as on loopback
    }
    if (out > 0)
      if (Status got = socket::receiveAll(fd, output, out * sizeof(float), deadline, what, kPrefix);
          !got)
        return failed(got.message());
    return Status::ok();
  }

  // Rank 0: every rank's header and input, the calls compared, every rank's result computed and
  // sent (or the mismatch sent to all).
  Status gather(Operation operation, const float *input, size_t count, size_t in, size_t out,
                float *output, Clock::time_point deadline, const std::string &what) {
    std::vector<std::vector<float>> inputs(static_cast<size_t>(worldSize_));
    if (in > 0)
      inputs[0].assign(input, input + in);
    std::string mismatch;
    for (int r = 1; r < worldSize_; ++r) {
      const int fd = peers_[size_t(r)]->get();
      Header header;
      if (Status got = socket::receiveAll(fd, &header, sizeof header, deadline,
                                          what + " (waiting for rank " + std::to_string(r) + ")",
                                          kPrefix);
          !got)
        return failed(got.message());
      const Operation theirs = Operation(header.operation);
      const size_t theirIn = inputElements(theirs, size_t(header.count), worldSize_);
      if (theirIn > (size_t(1) << 32))
        return failed(std::string(kPrefix) + ": rank " + std::to_string(r) + " sends " +
                      std::to_string(theirIn) + " values");
      inputs[size_t(r)].resize(theirIn);
      if (theirIn > 0)
        if (Status got = socket::receiveAll(fd, inputs[size_t(r)].data(), theirIn * sizeof(float),
                                            deadline, what, kPrefix);
            !got)
          return failed(got.message());
      if ((theirs != operation || header.count != count) && mismatch.empty())
        mismatch = std::string(kPrefix) + " " + what + ": rank " + std::to_string(r) +
                   " called " + nameOf(theirs) + " of " + std::to_string(header.count);
    }
    if (!mismatch.empty()) {
      for (int r = 1; r < worldSize_; ++r) {
        const uint32_t status[2] = {1, uint32_t(mismatch.size())};
        const int fd = peers_[size_t(r)]->get();
        Status sent = socket::sendAll(fd, status, sizeof status, deadline, what, kPrefix);
        if (sent)
          sent = socket::sendAll(fd, mismatch.data(), mismatch.size(), deadline, what, kPrefix);
        if (!sent)
          return failed(sent.message());
      }
      return Status::error(mismatch);
    }

    std::vector<float> result(out);
    for (int r = 0; r < worldSize_; ++r) {
      compute(operation, inputs, count, r, result);
      if (r == 0) {
        if (out > 0)
          std::copy(result.begin(), result.end(), output);
        continue;
      }
      const int fd = peers_[size_t(r)]->get();
      const uint32_t status[2] = {0, 0};
      Status sent = socket::sendAll(fd, status, sizeof status, deadline, what, kPrefix);
      if (sent && out > 0)
        sent = socket::sendAll(fd, result.data(), out * sizeof(float), deadline, what, kPrefix);
      if (!sent)
        return failed(sent.message());
    }
    return Status::ok();
  }

  // Rank `rank`'s result from every rank's input, as the loopback backend computes it.
  void compute(Operation operation, const std::vector<std::vector<float>> &inputs, size_t count,
               int rank, std::vector<float> &result) const {
    switch (operation) {
    case Operation::AllReduceSum:
    case Operation::ReduceScatterSum: {
      const size_t offset = operation == Operation::ReduceScatterSum ? size_t(rank) * count : 0;
      std::fill(result.begin(), result.end(), 0.0f);
      for (int r = 0; r < worldSize_; ++r) // rank order: the same bits every run
        for (size_t i = 0; i < count; ++i)
          result[i] += inputs[size_t(r)][offset + i];
      break;
    }
    case Operation::AllGather:
      for (int r = 0; r < worldSize_; ++r)
        std::copy(inputs[size_t(r)].begin(), inputs[size_t(r)].end(),
                  result.begin() + long(size_t(r) * count));
      break;
    case Operation::AllToAll:
      for (int r = 0; r < worldSize_; ++r)
        std::copy(inputs[size_t(r)].begin() + long(size_t(rank) * count),
                  inputs[size_t(r)].begin() + long(size_t(rank + 1) * count),
                  result.begin() + long(size_t(r) * count));
      break;
    case Operation::Barrier:
      break;
    }
  }

  int rank_;
  int worldSize_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<UniqueFd> root_;               // ranks > 0: the connection to rank 0
  std::vector<std::unique_ptr<UniqueFd>> peers_; // rank 0: rank r's connection at index r
  std::string broken_; // set once a connection failed: every later collective fails with it
};

} // namespace

StatusOr<std::unique_ptr<Communicator>> connectTcp(const RendezvousConfig &config) {
  if (config.worldSize < 1 || config.rank < 0 || config.rank >= config.worldSize)
    return Status::error(std::string(kPrefix) + ": rank " + std::to_string(config.rank) +
                         " is outside a world of " + std::to_string(config.worldSize));
  auto communicator =
      std::make_unique<TcpCommunicator>(config.rank, config.worldSize, config.timeout);
  if (config.worldSize > 1)
    HYBRID_RETURN_IF_ERROR(communicator->connect(config));
  return std::unique_ptr<Communicator>(std::move(communicator));
}

} // namespace hybrid::comm
