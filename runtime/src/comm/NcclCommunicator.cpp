// The NCCL backend: device buffers, the caller's stream. Rank 0's ncclUniqueId reaches the others
// through the TCP rendezvous; every rank then joins the communicator on GPU `localRank`. Built
// where CUDA and NCCL are found (HYBRID_HAS_NCCL); elsewhere connectNccl says so.
#include "hybrid/runtime/Communicator.h"

#ifdef HYBRID_HAS_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace hybrid::comm {

#ifdef HYBRID_HAS_NCCL
namespace {

Status ncclStatus(ncclResult_t result, const std::string &what) {
  if (result == ncclSuccess)
    return Status::ok();
  return Status::error("nccl " + what + ": " + ncclGetErrorString(result));
}

class NcclCommunicator final : public Communicator {
public:
  NcclCommunicator(ncclComm_t comm, int rank, int worldSize)
      : comm_(comm), rank_(rank), worldSize_(worldSize) {}
  ~NcclCommunicator() override { ncclCommDestroy(comm_); }
  int rank() const override { return rank_; }
  int worldSize() const override { return worldSize_; }
  std::string backend() const override { return "nccl"; }
  bool deviceBuffers() const override { return true; }

  Status allReduceSum(float *data, size_t count, void *stream) override {
    return ncclStatus(ncclAllReduce(data, data, count, ncclFloat, ncclSum, comm_,
                                    static_cast<cudaStream_t>(stream)),
                      "allReduceSum");
  }
  Status allGather(const float *mine, float *all, size_t count, void *stream) override {
    return ncclStatus(
        ncclAllGather(mine, all, count, ncclFloat, comm_, static_cast<cudaStream_t>(stream)),
        "allGather");
  }
  Status reduceScatterSum(const float *all, float *mine, size_t count, void *stream) override {
    return ncclStatus(ncclReduceScatter(all, mine, count, ncclFloat, ncclSum, comm_,
                                        static_cast<cudaStream_t>(stream)),
                      "reduceScatterSum");
  }
  Status allToAll(const float *sent, float *received, size_t count, void *stream) override {
    const auto s = static_cast<cudaStream_t>(stream);
    HYBRID_RETURN_IF_ERROR(ncclStatus(ncclGroupStart(), "allToAll"));
    for (int r = 0; r < worldSize_; ++r) {
      HYBRID_RETURN_IF_ERROR(
          ncclStatus(ncclSend(sent + size_t(r) * count, count, ncclFloat, r, comm_, s), "allToAll"));
      HYBRID_RETURN_IF_ERROR(ncclStatus(
          ncclRecv(received + size_t(r) * count, count, ncclFloat, r, comm_, s), "allToAll"));
    }
    return ncclStatus(ncclGroupEnd(), "allToAll");
  }
  // Every rank's earlier work on the default stream done, then a one-value all-reduce.
  Status barrier() override {
    float *one = nullptr;
    if (cudaMalloc(&one, sizeof(float)) != cudaSuccess)
      return Status::error("nccl barrier: cudaMalloc failed");
    Status status = ncclStatus(ncclAllReduce(one, one, 1, ncclFloat, ncclSum, comm_, nullptr),
                               "barrier");
    if (status && cudaStreamSynchronize(nullptr) != cudaSuccess)
      status = Status::error("nccl barrier: cudaStreamSynchronize failed");
    cudaFree(one);
    return status;
  }

  StatusOr<std::unique_ptr<Communicator>> split(int color, int key) override {
    ncclComm_t group = nullptr;
    HYBRID_RETURN_IF_ERROR(ncclStatus(ncclCommSplit(comm_, color, key, &group, nullptr),
                                      "split (color " + std::to_string(color) + ")"));
    int rank = 0, size = 0;
    Status status = ncclStatus(ncclCommUserRank(group, &rank), "split rank");
    if (status)
      status = ncclStatus(ncclCommCount(group, &size), "split size");
    if (!status) {
      ncclCommDestroy(group);
      return status;
    }
    return std::unique_ptr<Communicator>(std::make_unique<NcclCommunicator>(group, rank, size));
  }

private:
  ncclComm_t comm_;
  int rank_, worldSize_;
};

} // namespace

StatusOr<std::unique_ptr<Communicator>> connectNccl(const RendezvousConfig &config) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    return Status::error("nccl: no CUDA device on this host");
  if (config.localRank >= devices)
    return Status::error("nccl: LOCAL_RANK " + std::to_string(config.localRank) + " but only " +
                         std::to_string(devices) + " GPUs on this host");
  if (cudaSetDevice(config.localRank) != cudaSuccess)
    return Status::error("nccl: cannot select GPU " + std::to_string(config.localRank));
  std::string id;
  if (config.rank == 0) {
    ncclUniqueId unique;
    HYBRID_RETURN_IF_ERROR(ncclStatus(ncclGetUniqueId(&unique), "unique id"));
    id.assign(reinterpret_cast<const char *>(&unique), sizeof unique);
  }
  HYBRID_ASSIGN_OR_RETURN(const std::vector<std::string> blobs, exchangeAtRendezvous(config, id));
  if (blobs.empty() || blobs[0].size() != sizeof(ncclUniqueId))
    return Status::error("nccl: rank 0 sent a unique id of " +
                         std::to_string(blobs.empty() ? 0 : blobs[0].size()) + " bytes, not " +
                         std::to_string(sizeof(ncclUniqueId)));
  ncclUniqueId unique;
  std::copy(blobs[0].begin(), blobs[0].end(), reinterpret_cast<char *>(&unique));
  ncclComm_t comm = nullptr;
  HYBRID_RETURN_IF_ERROR(
      ncclStatus(ncclCommInitRank(&comm, config.worldSize, unique, config.rank), "init"));
  return std::unique_ptr<Communicator>(
      std::make_unique<NcclCommunicator>(comm, config.rank, config.worldSize));
}
#else
StatusOr<std::unique_ptr<Communicator>> connectNccl(const RendezvousConfig &) {
  return Status::error("nccl: this build has no NCCL (configure with the CUDA toolkit and NCCL)");
}
#endif

} // namespace hybrid::comm
