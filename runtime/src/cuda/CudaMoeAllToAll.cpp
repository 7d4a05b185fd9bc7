// Experts over the context ranks on the cuda device (cp=N,ep=N, tp=1; docs/parallelism.md): a
// context-parallel prefill's moe_experts with MoeParams.all_to_all runs parallel::
// moeExpertParallel's exchange on device buffers over the context group's communicator (NCCL):
//   1. the destination lists of this rank's (token, choice) pairs (one kernel) and every rank's
//      counts (an all-gather, read on the host: the exchange's padded size and its chunks must be
//      the same on every rank, and the communicator's counts are host values);
//   2. the slots split in two chunks, both packed as [expert id | x row] and sent in order on
//      the dispatch's (collective) stream;
//   3. on the expert stream, each chunk's rows run through this rank's experts as soon as the
//      chunk has arrived (each row one choice of weight 1, so a form's output row is its
//      expert's output exactly), in the form the step's pairs choose (an unsharded run's): chunk
//      1's exchange overlaps chunk 0's experts;
//   4. each chunk's results go back as soon as they are ready (chunk 0's return overlaps chunk
//      1's experts), then each token's returned rows are combined with its routing weights in
//      ascending expert order, as ref::moeExperts adds them.
#include "cuda/CudaExecutorImpl.h"
#include "hybrid/runtime/ContextParallel.h"
#include "hybrid/kernels/cuda/Moe.h"
#include "hybrid/kernels/cuda/MoeExchange.h"

#include <algorithm>

namespace hybrid::cudadev {

Status CudaExecutor::Impl::prepareMoeAllToAll(const fb::Dispatch &d, int64_t rows) {
  const fb::MoeParams *p = d.params_as_MoeParams();
  const int world = contextParallel;
  comm::Communicator *group = groupCommunicator(fb::CollectiveGroup::ContextParallel);
  if (tensorParallel != 1 || world < 2 || !group || group->worldSize() != world)
    return Status::error("all_to_all exchanges rows over the context_parallel group, which must "
                         "be the whole world (tensor_parallel 1; this plan: tensor_parallel " +
                         std::to_string(tensorParallel) + ", context_parallel " +
                         std::to_string(world) + ")");
  if (world > kc::kMoeExchangeMaxRanks)
    return Status::error("all_to_all over " + std::to_string(world) +
                         " context ranks: the cuda device exchanges over at most " +
                         std::to_string(kc::kMoeExchangeMaxRanks));
  const int64_t K = p->top_k();
  // The rows a rank receives are for the experts it holds: an expert missing here would drop them.
  HYBRID_RETURN_IF_ERROR(parallel::checkExpertsOfContextRank(
      p->num_experts(), group->rank(), world,
      [&](int64_t e) { return expertWeight(d, e, 0) >= 0; }));
  if (!pinnedAllCounts) {
    const size_t counts = static_cast<size_t>(world) * static_cast<size_t>(world);
    CUDA_RETURN_IF_ERROR(cudaMalloc(&exchangeCounts, static_cast<size_t>(world) * sizeof(float)),
                         "MoE exchange counts");
    CUDA_RETURN_IF_ERROR(cudaMalloc(&exchangeAllCounts, counts * sizeof(float)),
                         "MoE exchange counts");
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&pinnedAllCounts, counts * sizeof(float)),
                         "MoE exchange counts");
  }
  if (rows * K > exchangePairs) { // a rank's rows are at most the step's
    cudaFree(exchangeSlots);
    cudaFree(exchangePairLists);
    exchangeSlots = exchangePairLists = nullptr;
    exchangePairs = rows * K;
    CUDA_RETURN_IF_ERROR(
        cudaMalloc(&exchangeSlots, static_cast<size_t>(exchangePairs) * sizeof(int32_t)),
        "MoE exchange lists");
    CUDA_RETURN_IF_ERROR(cudaMalloc(&exchangePairLists, static_cast<size_t>(world) *
                                                            static_cast<size_t>(exchangePairs) *
                                                            sizeof(int32_t)),
                         "MoE exchange lists");
  }
  needsExpertStream = true;
  return Status::ok();
}

void CudaExecutor::Impl::releaseMoeAllToAll() {
  for (int c = 0; c < 2; ++c) {
    if (chunkReceived[c])
      cudaEventDestroy(chunkReceived[c]);
    if (chunkComputed[c])
      cudaEventDestroy(chunkComputed[c]);
    chunkReceived[c] = chunkComputed[c] = nullptr;
  }
  if (expertStream && expertStream->stream)
    cudaStreamDestroy(expertStream->stream);
  expertStream.reset();
  cudaFree(exchangeSlots);
  cudaFree(exchangePairLists);
  cudaFree(exchangeCounts);
  cudaFree(exchangeAllCounts);
  cudaFreeHost(pinnedAllCounts);
  cudaFree(exchangeBuffers);
  exchangeSlots = exchangePairLists = nullptr;
  exchangeCounts = exchangeAllCounts = pinnedAllCounts = nullptr;
  exchangeBuffers = nullptr;
  exchangeBytes = 0;
  exchangePairs = 0;
}

Status CudaExecutor::Impl::runMoeAllToAll(const fb::Program &program, unsigned char *arena,
                                          const fb::Dispatch &d, StreamResources &r,
                                          const cpu::StepContext &host) {
  if (!host.contextShard || host.decode)
    return Status::error("all_to_all runs in a context-parallel prefill only");
  comm::Communicator *group = groupCommunicator(fb::CollectiveGroup::ContextParallel);
  if (!group || !expertStream || !pinnedAllCounts)
    return Status::error("all_to_all: the exchange was not prepared at load");
  const fb::MoeParams *p = d.params_as_MoeParams();
  const int world = group->worldSize();
  const int64_t T = host.rows, K = p->top_k(), E = p->num_experts();
  const int64_t hidden = valueOf(program, d.inputs()->Get(0)).row_elements();
  if (T * K > exchangePairs)
    return Status::error("all_to_all of " + std::to_string(T) +
                         " rows is larger than planned at load");
  auto input = [&](int position) {
    return arena + valueOf(program, d.inputs()->Get(position)).arena_offset();
  };
  const auto *x = reinterpret_cast<const float *>(input(0));
  const auto *ids = reinterpret_cast<const int32_t *>(input(1));
  const auto *weights = reinterpret_cast<const float *>(input(2));
  auto *out =
      reinterpret_cast<float *>(arena + valueOf(program, d.outputs()->Get(0)).arena_offset());
  const cudaStream_t stream = r.stream;

  // 1. Where this rank's pairs go, and how many every rank sends every rank.
  kc::MoeRouteToRanksParams route;
  route.tokens = static_cast<int32_t>(T);
  route.topK = static_cast<int32_t>(K);
  route.experts = static_cast<int32_t>(E);
  route.ranks = world;
  route.ids = ids;
  route.slots = exchangeSlots;
  route.pairs = exchangePairLists;
  route.counts = exchangeCounts;
  LAUNCH_RETURN_IF_ERROR(kc::launchMoeRouteToRanks(route, stream), "MoE exchange lists");
  // Every rank's row first holds this rank's counts: what a communicator that skips its
  // collectives (hybrid-bench e2e --skip-collectives, timing only) leaves, so that such a rank
  // still runs its experts on as many rows as it sends. The all-gather overwrites them.
  const size_t countBytes = static_cast<size_t>(world) * sizeof(float);
  for (int source = 0; source < world; ++source)
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(exchangeAllCounts + int64_t(source) * world,
                                         exchangeCounts, countBytes, cudaMemcpyDeviceToDevice,
                                         stream),
                         "MoE exchange counts");
  HYBRID_RETURN_IF_ERROR(
      group->allGather(exchangeCounts, exchangeAllCounts, static_cast<size_t>(world), stream));
  const size_t countEntries = static_cast<size_t>(world) * static_cast<size_t>(world);
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pinnedAllCounts, exchangeAllCounts,
                                       countEntries * sizeof(float), cudaMemcpyDeviceToHost,
                                       stream),
                       "MoE exchange counts");
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "MoE exchange counts");
  // A count is a number of pairs of one rank's step: at most its rows times top-k, which the
  // plan bounds the same on every rank.
  for (size_t i = 0; i < countEntries; ++i)
    if (!(pinnedAllCounts[i] >= 0.0f && pinnedAllCounts[i] <= float(exchangePairs)) ||
        pinnedAllCounts[i] != float(int64_t(pinnedAllCounts[i])))
      return Status::error("all_to_all: rank " + std::to_string(i / size_t(world)) + " sends " +
                           std::to_string(pinnedAllCounts[i]) + " rows to rank " +
                           std::to_string(i % size_t(world)) + ", not a count of 0 to " +
                           std::to_string(exchangePairs));
  const int64_t slots =
      static_cast<int64_t>(*std::max_element(pinnedAllCounts, pinnedAllCounts + countEntries));
  if (slots == 0) { // no rank chose any expert: the routed sum is zero
    if (T > 0)
      CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(out, 0, static_cast<size_t>(T * hidden) * sizeof(float), stream),
          "MoE output");
    return Status::ok();
  }

  // 2. Two chunks of slots (one when there is a single slot), each with buffers of its own:
  // they are in flight at the same time.
  const int64_t chunkSlots[2] = {(slots + 1) / 2, slots / 2};
  const int64_t chunkBegin[2] = {0, chunkSlots[0]};
  const int chunks = chunkSlots[1] > 0 ? 2 : 1;
  kc::MoeExpertsParams step = moeExpertsParams(d, hidden);
  step.topK = static_cast<int32_t>(K);
  const MoeForm form = moeForm(step, host, step.perTokenMaxPairs);
  struct Chunk {
    int64_t rows = 0; // every rank's slots of the chunk
    float *sent = nullptr, *received = nullptr, *x = nullptr, *weights = nullptr;
    float *results = nullptr, *returned = nullptr;
    int32_t *ids = nullptr;
    void *workspace = nullptr;
    size_t workspaceBytes = 0;
  } chunk[2];
  size_t bytes = 0;
  size_t offsets[2][8] = {};
  for (int c = 0; c < chunks; ++c) {
    Chunk &piece = chunk[c];
    piece.rows = int64_t(world) * chunkSlots[c];
    const size_t n = static_cast<size_t>(piece.rows), h = static_cast<size_t>(hidden);
    // sent, received, x, weights, results, returned, ids, the form's workspace
    piece.workspaceBytes =
        form == MoeForm::TensorCores ? kc::moeGroupedWorkspaceBytes(int32_t(n), 1, step.hidden,
                                                                    step.intermediate, step.experts)
        : form == MoeForm::PerToken
            ? kc::moeExpertsWorkspaceBytes(int32_t(n), 1, step.hidden, step.intermediate)
            : 0;
    const size_t sizes[8] = {n * (h + 1) * sizeof(float), n * (h + 1) * sizeof(float),
                             n * h * sizeof(float),       n * sizeof(float),
                             n * h * sizeof(float),       n * h * sizeof(float),
                             n * sizeof(int32_t),         piece.workspaceBytes};
    for (int part = 0; part < 8; ++part) {
      offsets[c][part] = bytes;
      bytes += alignUp(std::max<size_t>(1, sizes[part]));
    }
  }
  if (bytes > exchangeBytes) { // the previous step's exchange has finished (the wait above)
    cudaFree(exchangeBuffers);
    exchangeBuffers = nullptr;
    exchangeBytes = 0;
    const size_t grown = bytes + bytes / 4; // headroom: the next steps' routing differs
    CUDA_RETURN_IF_ERROR(cudaMalloc(&exchangeBuffers, grown),
                         "MoE exchange buffers (" + std::to_string(grown) + " bytes)");
    // Zeros, not leftovers, where a skipping communicator leaves the received rows as they are.
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(exchangeBuffers, 0, grown, stream),
                         "MoE exchange buffers");
    exchangeBytes = grown;
  }
  for (int c = 0; c < chunks; ++c) {
    Chunk &piece = chunk[c];
    auto at = [&](int part) { return exchangeBuffers + offsets[c][part]; };
    piece.sent = reinterpret_cast<float *>(at(0));
    piece.received = reinterpret_cast<float *>(at(1));
    piece.x = reinterpret_cast<float *>(at(2));
    piece.weights = reinterpret_cast<float *>(at(3));
    piece.results = reinterpret_cast<float *>(at(4));
    piece.returned = reinterpret_cast<float *>(at(5));
    piece.ids = reinterpret_cast<int32_t *>(at(6));
    piece.workspace = at(7);
  }

  // Both chunks packed and sent, in the same order on every rank.
  for (int c = 0; c < chunks; ++c) {
    kc::MoePackRowsParams pack;
    pack.tokens = static_cast<int32_t>(T);
    pack.topK = static_cast<int32_t>(K);
    pack.hidden = static_cast<int32_t>(hidden);
    pack.ranks = world;
    pack.firstSlot = static_cast<int32_t>(chunkBegin[c]);
    pack.chunkSlots = static_cast<int32_t>(chunkSlots[c]);
    pack.x = x;
    pack.ids = ids;
    pack.pairs = exchangePairLists;
    pack.counts = exchangeCounts;
    pack.sent = chunk[c].sent;
    LAUNCH_RETURN_IF_ERROR(kc::launchMoePackRows(pack, stream), "MoE exchange packing");
  }
  for (int c = 0; c < chunks; ++c) {
    HYBRID_RETURN_IF_ERROR(group->allToAll(chunk[c].sent, chunk[c].received,
                                           static_cast<size_t>(chunkSlots[c] * (hidden + 1)),
                                           stream));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(chunkReceived[c], stream), "MoE exchange");
  }

  // 3. Each chunk's experts on the expert stream once it arrived: the next chunk's exchange
  // runs meanwhile.
  StreamResources &onExperts = *expertStream;
  for (int c = 0; c < chunks; ++c) {
    Chunk &piece = chunk[c];
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(onExperts.stream, chunkReceived[c], 0),
                         "MoE exchange");
    kc::MoeUnpackRowsParams unpack;
    unpack.rows = static_cast<int32_t>(piece.rows);
    unpack.hidden = static_cast<int32_t>(hidden);
    unpack.received = piece.received;
    unpack.x = piece.x;
    unpack.ids = piece.ids;
    unpack.weights = piece.weights;
    LAUNCH_RETURN_IF_ERROR(kc::launchMoeUnpackRows(unpack, onExperts.stream),
                           "MoE exchange unpacking");
    kc::MoeExpertsParams m = step;
    m.tokens = static_cast<int32_t>(piece.rows);
    m.topK = 1;
    m.x = piece.x;
    m.ids = piece.ids;
    m.weights = piece.weights;
    m.out = piece.results;
    m.workspace = piece.workspace;
    HYBRID_RETURN_IF_ERROR(launchMoeForm(d, m, form, piece.workspaceBytes, onExperts)
                               .withContext("the experts of exchange chunk " + std::to_string(c)));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(chunkComputed[c], onExperts.stream), "MoE exchange");
  }

  // 4. Each chunk's results back once computed, then the weighted combine.
  for (int c = 0; c < chunks; ++c) {
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, chunkComputed[c], 0), "MoE exchange");
    HYBRID_RETURN_IF_ERROR(group->allToAll(chunk[c].results, chunk[c].returned,
                                           static_cast<size_t>(chunkSlots[c] * hidden), stream));
  }
  kc::MoeCombineReturnedParams combine;
  combine.tokens = static_cast<int32_t>(T);
  combine.topK = static_cast<int32_t>(K);
  combine.hidden = static_cast<int32_t>(hidden);
  combine.expertsPerRank = static_cast<int32_t>(E / world);
  combine.ids = ids;
  combine.weights = weights;
  combine.slots = exchangeSlots;
  combine.chunks = chunks;
  for (int c = 0; c < chunks; ++c) {
    combine.returned[c] = chunk[c].returned;
    combine.chunkBegin[c] = static_cast<int32_t>(chunkBegin[c]);
    combine.chunkSlots[c] = static_cast<int32_t>(chunkSlots[c]);
  }
  combine.out = out;
  LAUNCH_RETURN_IF_ERROR(kc::launchMoeCombineReturned(combine, stream), "MoE exchange combine");
  return Status::ok();
}

} // namespace hybrid::cudadev
