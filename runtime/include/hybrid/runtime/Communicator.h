// Collectives between the ranks of a sharded plan (issue 10): tensor parallelism sums partial
// projections (all-reduce, reduce-scatter), gathers shards (all-gather); expert parallelism sends
// tokens to the ranks holding their experts (all-to-all); context parallelism passes KDA state
// summaries. Two backends:
//   - loopback: the ranks are threads of one process sharing memory; host buffers. What the cpu
//     device and the tests use, so the whole sharded path runs without a GPU.
//   - TCP: one process per rank, host buffers, through rank 0 (the cpu device across processes).
//   - NCCL: one process per GPU, device buffers on the caller's stream (builds with CUDA and
//     NCCL), rendezvous by the usual RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT variables so a
//     multi-node launch works the same as a single-node one.
// Every rank calls the same collectives in the same order with the same counts. Sums add the
// ranks' contributions in rank order (loopback: always; NCCL: its own order), so a loopback run
// gives the same bits every time whatever the threads' timing.
#pragma once

#include "hybrid/runtime/Status.h"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace hybrid::comm {

class Communicator {
public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int worldSize() const = 0;
  virtual std::string backend() const = 0; // "loopback", "tcp" or "nccl"
  // Whether the collectives take device buffers on a CUDA stream (NCCL) or host buffers
  // (loopback, TCP): a device executor issues the former in its streams, stages the latter.
  virtual bool deviceBuffers() const { return false; }

  // In place: data[i] = sum over ranks of their data[i]. `stream`: the CUDA stream for device
  // buffers (NCCL), ignored by the loopback backend.
  virtual Status allReduceSum(float *data, size_t count, void *stream = nullptr) = 0;
  // all[r * count .. (r + 1) * count) = rank r's `mine` (all holds worldSize * count).
  virtual Status allGather(const float *mine, float *all, size_t count, void *stream = nullptr) = 0;
  // mine = the sum over ranks of their all[rank * count .. (rank + 1) * count).
  virtual Status reduceScatterSum(const float *all, float *mine, size_t count,
                                  void *stream = nullptr) = 0;
  // received[r * count ..) = rank r's sent[rank * count ..): each pair of ranks swaps a chunk.
  virtual Status allToAll(const float *sent, float *received, size_t count,
                          void *stream = nullptr) = 0;
  virtual Status barrier() = 0;
  // The ranks passing the same `color`, ranked by `key`, as a communicator of their own (a
  // tensor- or context-parallel group inside the world): a collective call of every rank, in the
  // same order. NCCL splits its communicator (ncclCommSplit); the host backends serve groups
  // through the world instead (the cpu device), so they say they cannot.
  virtual StatusOr<std::unique_ptr<Communicator>> split(int color, int key) {
    (void)color;
    (void)key;
    return Status::error("the " + backend() + " communicator cannot split into groups");
  }
};

// `worldSize` communicators of one loopback group, rank r at index r: hand each to its own thread.
// A collective waits for every rank (at most `timeout`: a rank that never arrives fails the others
// with an error naming the collective, instead of hanging them).
StatusOr<std::vector<std::unique_ptr<Communicator>>>
makeLoopbackGroup(int worldSize, std::chrono::milliseconds timeout = std::chrono::seconds(60));

// Where a rank finds the others: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (LOCAL_RANK picks
// the GPU; defaults to RANK).
struct RendezvousConfig {
  int rank = 0;
  int worldSize = 1;
  int localRank = 0;
  std::string masterAddress = "127.0.0.1";
  int masterPort = 29500;
  std::chrono::milliseconds timeout = std::chrono::seconds(120);
};
// From the environment; an error names the variable that is missing or malformed.
StatusOr<RendezvousConfig> rendezvousFromEnvironment();

// The rendezvous itself: rank 0 listens on masterAddress:masterPort, every rank sends its
// `blob`, and every rank receives all ranks' blobs in rank order (NCCL exchanges its unique id
// this way; tests exchange anything). Fails with a reason after `timeout`.
StatusOr<std::vector<std::string>> exchangeAtRendezvous(const RendezvousConfig &config,
                                                        const std::string &blob);

// TCP on host buffers, one process per rank (the cpu device's RANK / WORLD_SIZE launch): every
// rank connects to rank 0 at MASTER_ADDR:MASTER_PORT, which computes each collective from all
// ranks' inputs as the loopback backend does (the same bits) and sends the results back. Each
// collective is bounded by `config.timeout`; a mismatched call fails every rank, naming both calls.
StatusOr<std::unique_ptr<Communicator>> connectTcp(const RendezvousConfig &config);

// NCCL over the rendezvous (rank 0's ncclUniqueId to everyone), on GPU `localRank`. An error
// where the build has no NCCL.
StatusOr<std::unique_ptr<Communicator>> connectNccl(const RendezvousConfig &config);

// One rank of a multi-process launch, as the tools start it: null (a world of one) when
// WORLD_SIZE is unset or 1; otherwise this process's rank from the environment, connected over
// TCP for `device` "cpu" or over NCCL on GPU LOCAL_RANK for "cuda". An error names the variable,
// the device or the rank that failed.
StatusOr<std::unique_ptr<Communicator>> connectFromEnvironment(const std::string &device);

// Timing only: a communicator over `real` (which must outlive it) whose collectives return at
// once, leaving their buffers as they are (an all-reduce keeps this rank's partial, a gather the
// rows it had); rank, world size, buffer kind and splits are real's. A sharded step run with it
// costs its kernels without its communication: hybrid-bench e2e --skip-collectives measures the
// share of a step spent communicating. Its results are wrong by design.
std::unique_ptr<Communicator> skipCollectives(Communicator &real);

} // namespace hybrid::comm
