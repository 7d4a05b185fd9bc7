// Context parallelism on the cuda device (docs/parallelism.md): a context-parallel prefill's
// steps over NCCL. Each rank holds its zigzag chunks' rows; the gathers (AllGatherRows) restore
// position order over the context-parallel group's communicator; the KDA layers summarize their
// chunks (KdaContextSummary) and compose the gathered summaries (kernels/cuda KdaContext.h), the
// attention layers make their rows' cache rows (MlaCacheRows) and append every rank's. Groups
// narrower than the world (tp x cp) get communicators of their own, split at load.
#include "cuda/CudaExecutorImpl.h"

#include "hybrid/kernels/cuda/Mla.h"

#include <algorithm>

namespace hybrid::cudadev {
namespace {

// MlaCacheRows' weight roles; the conv-history projections' KDA roles.
enum CacheRowsRole { CacheRowsKvA, CacheRowsNorm };
constexpr int kProjections[3] = {Q, Kp, V};

bool rotates(const fb::Rope *rope) { return rope && rope->kind() != fb::RopeKind::None; }

// Rows [begin, begin + count) of the step that rank `rank` sends in a gather: all its rows, or
// each chunk's last `tail` (the KDA conv's history of the next chunk).
struct RowRun {
  int64_t begin = 0, count = 0;
};
std::vector<RowRun> sentRuns(const cpu::ContextShard &s, int rank, int64_t tail) {
  std::vector<RowRun> runs;
  for (int64_t chunk : {int64_t(rank), 2 * int64_t(s.size) - 1 - rank}) {
    const int64_t end = s.chunkBegin(chunk + 1);
    const int64_t begin = tail == 0 ? s.chunkBegin(chunk) : std::max(s.chunkBegin(chunk), end - tail);
    runs.push_back({begin, end - begin});
  }
  return runs;
}

// Where step row `row` of this rank's chunks lies in its own rows (chunk rank, then its mirror).
int64_t ownIndex(const cpu::ContextShard &s, int64_t row) {
  const int64_t first = s.chunkBegin(s.rank), firstEnd = s.chunkBegin(s.rank + 1);
  if (row < firstEnd)
    return row - first;
  return (firstEnd - first) + row - s.chunkBegin(2 * int64_t(s.size) - 1 - s.rank);
}

// This rank's two chunks: their row counts.
std::pair<int64_t, int64_t> chunkRows(const cpu::ContextShard &s) {
  const int64_t mirror = 2 * int64_t(s.size) - 1 - s.rank;
  return {s.chunkBegin(s.rank + 1) - s.chunkBegin(s.rank),
          s.chunkBegin(mirror + 1) - s.chunkBegin(mirror)};
}

} // namespace

Status CudaExecutor::Impl::prepareContextParallel(const LoadOptions &options, int64_t maxRows) {
  const fb::Target &target = *plan->target();
  tensorParallel = std::max(1, target.tensor_parallel());
  contextParallel = std::max(1, target.context_parallel());
  if (contextParallel > 1) {
    CUDA_RETURN_IF_ERROR(cudaMalloc(&chunkCuSeqlens, 3 * sizeof(int32_t)), "chunk cu_seqlens");
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&pinnedChunkCuSeqlens, 3 * sizeof(int32_t)),
                         "chunk cu_seqlens");
    if (kvOnGpu) {
      CUDA_RETURN_IF_ERROR(cudaMalloc(&stepPositions, size_t(maxRows) * sizeof(int32_t)),
                           "step positions");
      CUDA_RETURN_IF_ERROR(cudaMallocHost(&pinnedStepPositions, size_t(maxRows) * sizeof(int32_t)),
                           "step positions");
    }
  }
  // Both groups narrower than the world: one communicator each, split by every rank in the same
  // order (the layout is the same on every rank, so are the calls). Host communicators serve
  // groups through the world on the cpu reference instead.
  comm::Communicator *world = options.communicator;
  if (!world || !world->deviceBuffers() || tensorParallel == 1 || contextParallel == 1)
    return Status::ok();
  const int rank = world->rank();
  HYBRID_ASSIGN_OR_RETURN(tensorGroup, world->split(rank / tensorParallel, rank % tensorParallel));
  HYBRID_ASSIGN_OR_RETURN(contextGroup, world->split(rank % tensorParallel, rank / tensorParallel));
  if (tensorGroup->worldSize() != tensorParallel || contextGroup->worldSize() != contextParallel)
    return Status::error("the split communicators hold " + std::to_string(tensorGroup->worldSize()) +
                         " and " + std::to_string(contextGroup->worldSize()) +
                         " ranks, the layout's groups " + std::to_string(tensorParallel) + " and " +
                         std::to_string(contextParallel));
  return Status::ok();
}

void CudaExecutor::Impl::releaseContextParallel() {
  cudaFree(chunkCuSeqlens);
  cudaFreeHost(pinnedChunkCuSeqlens);
  cudaFree(stepPositions);
  cudaFreeHost(pinnedStepPositions);
  chunkCuSeqlens = pinnedChunkCuSeqlens = stepPositions = pinnedStepPositions = nullptr;
}

comm::Communicator *CudaExecutor::Impl::groupCommunicator(fb::CollectiveGroup group) const {
  const int size = groupSize(group);
  if (size <= 1 || !communicator)
    return nullptr;
  if (size == communicator->worldSize())
    return communicator;
  return group == fb::CollectiveGroup::ContextParallel ? contextGroup.get() : tensorGroup.get();
}

cpu::StepContext CudaExecutor::Impl::dispatchContext(const cpu::StepContext &host,
                                                     const fb::Program &program,
                                                     const fb::Dispatch &d) {
  cpu::StepContext local = host;
  if (host.contextShard && d.outputs() && d.outputs()->size() > 0)
    local.rows = cpu::valueRows(host, valueOf(program, d.outputs()->Get(0)));
  return local;
}

Status CudaExecutor::Impl::prepareContextStep(const cpu::StepContext &host,
                                              std::span<const int64_t> tokens,
                                              unsigned char *arena, const fb::Program &program) {
  const cpu::ContextShard &s = *host.contextShard;
  if (static_cast<int64_t>(tokens.size()) != s.stepRows)
    return Status::error("a context-parallel prefill of " + std::to_string(tokens.size()) +
                         " tokens, its shard is of " + std::to_string(s.stepRows));
  cudaStream_t stream = streams[0]->stream;
  for (size_t i = 0; i < s.rows.size(); ++i)
    pinnedTokens[i] = tokens[static_cast<size_t>(s.rows[i])];
  const fb::Value &ids = valueOf(program, program.token_ids());
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(arena + ids.arena_offset(), pinnedTokens,
                                       s.rows.size() * sizeof(int64_t), cudaMemcpyHostToDevice,
                                       stream),
                       "token ids upload");
  const auto [first, second] = chunkRows(s);
  pinnedChunkCuSeqlens[0] = 0;
  pinnedChunkCuSeqlens[1] = static_cast<int32_t>(first);
  pinnedChunkCuSeqlens[2] = static_cast<int32_t>(first + second);
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(chunkCuSeqlens, pinnedChunkCuSeqlens, 3 * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, stream),
                       "chunk cu_seqlens upload");
  return Status::ok();
}

// ---- Gathers.

Status CudaExecutor::Impl::gatherShardRows(comm::Communicator &group, const cpu::ContextShard &s,
                                           const float *mine, int64_t width, int64_t tail,
                                           float *out, float *scratch, cudaStream_t stream) {
  const int64_t slots = tail == 0 ? s.longest : 2 * tail;
  float *send = scratch, *received = scratch + pad(slots * width);
  const size_t rowBytes = static_cast<size_t>(width) * sizeof(float);
  auto copy = [&](float *to, const float *from, int64_t rows) -> Status {
    if (rows <= 0)
      return Status::ok();
    return cudaStatus(cudaMemcpyAsync(to, from, static_cast<size_t>(rows) * rowBytes,
                                      cudaMemcpyDeviceToDevice, stream),
                      "row gather");
  };
  // Every rank sends `slots` rows (its runs packed, then padding the others ignore).
  int64_t packed = 0;
  for (const RowRun &run : sentRuns(s, s.rank, tail)) {
    HYBRID_RETURN_IF_ERROR(copy(send + packed * width, mine + ownIndex(s, run.begin) * width,
                                run.count));
    packed += run.count;
  }
  HYBRID_RETURN_IF_ERROR(group.allGather(send, received, static_cast<size_t>(slots * width),
                                         stream));
  if (tail > 0) // only the tails travel; the other rows are zero, as on the cpu device
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(out, 0, static_cast<size_t>(s.stepRows) * rowBytes,
                                         stream),
                         "row gather");
  for (int r = 0; r < s.size; ++r) {
    int64_t at = 0;
    for (const RowRun &run : sentRuns(s, r, tail)) {
      HYBRID_RETURN_IF_ERROR(copy(out + run.begin * width,
                                  received + (int64_t(r) * slots + at) * width, run.count));
      at += run.count;
    }
  }
  if (tail > 0) // this rank's own rows whole
    for (const RowRun &run : sentRuns(s, s.rank, 0))
      HYBRID_RETURN_IF_ERROR(copy(out + run.begin * width, mine + ownIndex(s, run.begin) * width,
                                  run.count));
  return Status::ok();
}

Status CudaExecutor::Impl::runAllGatherRows(const fb::Program &program, unsigned char *arena,
                                            const fb::Dispatch &d, StreamResources &r,
                                            const cpu::StepContext &host) {
  if (!host.contextShard)
    return Status::error("runs in a context-parallel prefill only");
  const cpu::ContextShard &s = *host.contextShard;
  const fb::CollectiveParams *p = d.params_as_CollectiveParams();
  comm::Communicator *group = groupCommunicator(fb::CollectiveGroup::ContextParallel);
  if (!p || p->group() != fb::CollectiveGroup::ContextParallel || !group ||
      group->worldSize() != s.size)
    return Status::error("gathers over the context_parallel group of " + std::to_string(s.size) +
                         " ranks");
  const fb::Value &input = valueOf(program, d.inputs()->Get(0));
  const int64_t width = input.row_elements();
  const auto *mine = reinterpret_cast<const float *>(arena + input.arena_offset());
  auto *out = reinterpret_cast<float *>(arena + valueOf(program, d.outputs()->Get(0)).arena_offset());
  const int64_t slots = input.rows() == fb::ValueRows::ContextChunks ? 2
                        : p->tail_rows() > 0                          ? 2 * int64_t(p->tail_rows())
                                                                      : s.longest;
  if (static_cast<size_t>(gatherScratchFloats(s.size, slots, width)) > r.sizes.scratchFloats)
    return Status::error("row gather scratch larger than planned at load");
  if (input.rows() == fb::ValueRows::ContextChunks) {
    // Each rank's two chunk rows (chunks rank and 2 cp - 1 - rank), into chunk order.
    float *received = r.scratch + pad(2 * width);
    const size_t rowBytes = static_cast<size_t>(width) * sizeof(float);
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r.scratch, mine, 2 * rowBytes, cudaMemcpyDeviceToDevice,
                                         r.stream),
                         "chunk gather");
    HYBRID_RETURN_IF_ERROR(group->allGather(r.scratch, received, static_cast<size_t>(2 * width),
                                            r.stream));
    for (int rank = 0; rank < s.size; ++rank)
      for (int i = 0; i < 2; ++i) {
        const int64_t chunk = i == 0 ? rank : 2 * int64_t(s.size) - 1 - rank;
        CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out + chunk * width,
                                             received + (int64_t(rank) * 2 + i) * width, rowBytes,
                                             cudaMemcpyDeviceToDevice, r.stream),
                             "chunk gather");
      }
    return Status::ok();
  }
  if (input.rows() != fb::ValueRows::ContextShard)
    return Status::error("gathers ContextShard or ContextChunks rows, input " +
                         std::to_string(d.inputs()->Get(0)) + " holds " +
                         fb::EnumNameValueRows(input.rows()));
  if (p->tail_rows() < 0)
    return Status::error("tail_rows " + std::to_string(p->tail_rows()) + " is negative");
  return gatherShardRows(*group, s, mine, width, p->tail_rows(), out, r.scratch, r.stream);
}

StatusOr<std::vector<float>> CudaExecutor::Impl::gatherHiddenRows(const cpu::StepContext &host,
                                                                  const float *mine,
                                                                  int64_t width) {
  const cpu::ContextShard &s = *host.contextShard;
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "hidden-state gather");
  std::vector<float> own(s.rows.size() * static_cast<size_t>(width));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(own.data(), mine, own.size() * sizeof(float),
                                  cudaMemcpyDeviceToHost),
                       "hidden-state gather");
  if (!communicator || !communicator->deviceBuffers())
    return cpu::gatherContextRows(host, own, width); // host buffers: the cpu device's gather
  comm::Communicator *group = groupCommunicator(fb::CollectiveGroup::ContextParallel);
  if (!group)
    return Status::error("no context-parallel communicator for the hidden-state gather");
  // A debugging path (--dump-hidden): buffers of its own.
  const size_t scratch = static_cast<size_t>(gatherScratchFloats(s.size, s.longest, width));
  const size_t all = static_cast<size_t>(s.stepRows * width);
  float *device = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&device, (scratch + all) * sizeof(float)),
                       "hidden-state gather");
  cudaStream_t stream = streams[0]->stream;
  Status gathered = gatherShardRows(*group, s, mine, width, 0, device + scratch, device, stream);
  std::vector<float> out(all);
  if (gathered)
    gathered = cudaStatus(cudaMemcpyAsync(out.data(), device + scratch, all * sizeof(float),
                                          cudaMemcpyDeviceToHost, stream),
                          "hidden-state gather");
  if (gathered)
    gathered = cudaStatus(cudaStreamSynchronize(stream), "hidden-state gather");
  cudaFree(device);
  if (!gathered)
    return gathered;
  return out;
}

// ---- KDA: the state-passing scan over the step's 2 cp chunks.

Status CudaExecutor::Impl::kdaHistory(const fb::Dispatch &d, StreamResources &r,
                                      const float *tails, int64_t dModel, int64_t begin,
                                      const float *convBefore, float *history) {
  const fb::KdaParams *p = d.params_as_KdaParams();
  const int64_t P = int64_t(p->num_heads()) * p->head_dim(), n = p->conv_kernel() - 1;
  if (n == 0)
    return Status::ok();
  // Positions begin - n .. begin - 1: those before the step from the slot's history, the others
  // projected from the gathered tails (each within its chunk's last n rows).
  const int64_t first = std::max<int64_t>(0, begin - n), fromTails = begin - first;
  const int64_t fromSlot = n - fromTails;
  for (int projection = 0; projection < 3; ++projection) {
    float *to = history + int64_t(projection) * n * P;
    if (fromSlot > 0)
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(to, convBefore + (int64_t(projection) * n + begin) * P,
                                           static_cast<size_t>(fromSlot * P) * sizeof(float),
                                           cudaMemcpyDeviceToDevice, r.stream),
                           "KDA conv history");
    if (fromTails > 0)
      HYBRID_RETURN_IF_ERROR(gemm(r, tails + first * dModel, dModel,
                                  roleOf(d, kProjections[projection]), to + fromSlot * P, P,
                                  fromTails, dModel, P));
  }
  return Status::ok();
}

void CudaExecutor::Impl::kdaContextScratch(const fb::Dispatch &d, int64_t rows, size_t &floats,
                                           size_t &workspaceBytes) const {
  const fb::KdaParams *p = d.params_as_KdaParams();
  const int64_t H = p->num_heads(), K = p->head_dim(), P = H * K, n = p->conv_kernel() - 1;
  // The projections (projectKda), two chunks' conv histories and the one after the step
  // ([3, n, P] each), two fp32 chunk states.
  const int64_t rankF = weightRows(roleOf(d, FA));
  const int64_t rankG = roleOf(d, G) >= 0 ? 0 : weightRows(roleOf(d, GA));
  floats = std::max(floats, static_cast<size_t>(pad(rows * 3 * P) + 3 * pad(rows * P) +
                                                pad(rows * H) + pad(rows * std::max(rankF, rankG)) +
                                                pad(2 * 3 * n * P) + pad(3 * n * P) +
                                                2 * pad(H * K * K)));
  kc::KdaSegmentSummaryParams summary;
  summary.heads = static_cast<int32_t>(H);
  summary.headDim = static_cast<int32_t>(K);
  summary.convKernel = p->conv_kernel();
  summary.sequences = 2;
  summary.tokens = static_cast<int32_t>(rows);
  summary.path = kdaPrefillPath;
  kc::KdaPrefillParams prefill;
  prefill.heads = summary.heads;
  prefill.headDim = summary.headDim;
  prefill.sequences = 2;
  prefill.tokens = summary.tokens;
  prefill.path = kdaPrefillPath;
  workspaceBytes = std::max({workspaceBytes, kc::kdaSegmentSummaryWorkspaceBytes(summary),
                             kc::kdaPrefillWorkspaceBytes(prefill)});
}

Status CudaExecutor::Impl::runKdaContext(const fb::Program &program, unsigned char *arena,
                                         const fb::Dispatch &d, StreamResources &r,
                                         const cpu::StepContext &host) {
  if (!host.contextShard)
    return Status::error("a context-parallel KDA step outside a context-parallel prefill");
  if (host.kdaLog)
    return Status::error("a context-parallel prefill does not log KDA inputs for replay");
  const cpu::ContextShard &s = *host.contextShard;
  const fb::KdaParams *p = d.params_as_KdaParams();
  const bool summary = d.kernel() == fb::KernelId::KdaContextSummary;
  auto value = [&](int position, bool output) -> const fb::Value & {
    return valueOf(program, output ? d.outputs()->Get(position) : d.inputs()->Get(position));
  };
  auto at = [&](const fb::Value &v) { return reinterpret_cast<float *>(arena + v.arena_offset()); };
  const fb::Value &xValue = value(0, false), &tailsValue = value(1, false);
  const int64_t dModel = xValue.row_elements(), T = static_cast<int64_t>(s.rows.size());
  const int64_t H = p->num_heads(), K = p->head_dim(), P = H * K, n = p->conv_kernel() - 1;
  const int64_t transition = H * K * K;
  if (tailsValue.row_elements() != dModel || tailsValue.rows() != fb::ValueRows::Step ||
      xValue.rows() != fb::ValueRows::ContextShard)
    return Status::error("inputs 0 and 1 must hold this rank's rows and the step's rows of " +
                         std::to_string(dModel) + " values");
  const fb::Value &summaries = summary ? value(0, true) : value(2, false);
  if (summaries.row_elements() != 2 * transition ||
      summaries.rows() != (summary ? fb::ValueRows::ContextChunks
                                   : fb::ValueRows::AllContextChunks))
    return Status::error(std::string(summary ? "output 0" : "input 2") + " must hold a summary of " +
                         std::to_string(2 * transition) + " values per chunk");
  const float *x = at(xValue), *tails = at(tailsValue);
  HYBRID_RETURN_IF_ERROR(host.states->stateOffset(p->state_slot(), host.stateSlot).status());
  size_t floats = 0, workspaceBytes = 0;
  kdaContextScratch(d, T, floats, workspaceBytes);
  if (workspaceBytes > r.sizes.kdaWorkspaceBytes)
    return Status::error("KDA context workspace larger than planned at load");

  // The projections of this rank's rows (runKda's), then the chunks' conv histories.
  HYBRID_ASSIGN_OR_RETURN(KdaProjections projected, projectKda(d, r, x, dModel, T));
  // The two chunks' histories packed, as the kernels' [sequences, 3, n, P].
  float *histories = projected.next, *afterHistory = histories + pad(2 * 3 * n * P);
  float *chunkStates = afterHistory + pad(3 * n * P);
  if (static_cast<size_t>(chunkStates + 2 * pad(transition) - r.scratch) > r.sizes.scratchFloats)
    return Status::error("KDA context scratch larger than planned at load");
  kc::KdaLayerCall call = layerCall(d, host.stateSlot);
  const float *convBefore = call.convState; // the slot's history before the step
  const int64_t chunks[2] = {s.rank, 2 * int64_t(s.size) - 1 - s.rank};
  for (int i = 0; i < 2; ++i)
    HYBRID_RETURN_IF_ERROR(kdaHistory(d, r, tails, dModel, s.chunkBegin(chunks[i]), convBefore,
                                      histories + i * 3 * n * P));
  call.qkv = projected.qkv;
  call.forget = projected.forget;
  call.betaLogits = projected.beta;
  call.outputGate = projected.gate;
  call.convState = histories;

  if (summary) { // per own chunk, (M, B) of its tokens alone
    kc::KdaSegmentSummaryParams params;
    static_cast<kc::KdaLayerCall &>(params) = call;
    params.sequences = 2;
    params.cuSeqlens = chunkCuSeqlens;
    params.tokens = static_cast<int32_t>(T);
    params.summaries = at(summaries);
    params.summaryStride = 2 * transition;
    params.workspace = r.kdaWorkspace;
    params.path = kdaPrefillPath;
    LAUNCH_RETURN_IF_ERROR(kc::launchKdaSegmentSummary(params, r.stream), "KDA chunk summaries");
    return Status::ok();
  }

  // Each own chunk from the state the summaries before it make of the state before the step.
  const float *allSummaries = at(summaries);
  kc::KdaComposeParams compose;
  compose.heads = static_cast<int32_t>(H);
  compose.headDim = static_cast<int32_t>(K);
  compose.summaries = allSummaries;
  compose.summaryStride = 2 * transition;
  compose.stateBefore = call.state;
  compose.beforeType = stateType;
  compose.afterType = kc::KdaStateType::F32;
  for (int i = 0; i < 2; ++i) {
    compose.count = static_cast<int32_t>(chunks[i]);
    compose.stateAfter = chunkStates + i * transition; // packed: the kernels' [sequences, H, K, V]
    LAUNCH_RETURN_IF_ERROR(kc::launchKdaComposeSummaries(compose, r.stream), "KDA chunk states");
  }
  if (T > 0) {
    kc::KdaPrefillParams prefill;
    static_cast<kc::KdaLayerCall &>(prefill) = call;
    prefill.state = chunkStates;
    prefill.stateType = kc::KdaStateType::F32;
    prefill.out = projected.o;
    prefill.sequences = 2;
    prefill.cuSeqlens = chunkCuSeqlens;
    prefill.tokens = static_cast<int32_t>(T);
    prefill.workspace = r.kdaWorkspace;
    prefill.path = kdaPrefillPath;
    LAUNCH_RETURN_IF_ERROR(kc::launchKdaPrefill(prefill, r.stream), "KDA chunk prefill");
  }
  // The state after the step (every chunk's summary, in place: the same bits on every rank) and
  // its conv history (the step's last rows), into the slot.
  compose.count = static_cast<int32_t>(2 * s.size);
  compose.stateAfter = layerCall(d, host.stateSlot).state;
  compose.afterType = stateType;
  LAUNCH_RETURN_IF_ERROR(kc::launchKdaComposeSummaries(compose, r.stream), "KDA state after");
  if (n > 0) {
    HYBRID_RETURN_IF_ERROR(kdaHistory(d, r, tails, dModel, s.stepRows, convBefore, afterHistory));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(layerCall(d, host.stateSlot).convState, afterHistory,
                                         static_cast<size_t>(3 * n * P) * sizeof(float),
                                         cudaMemcpyDeviceToDevice, r.stream),
                         "KDA conv state after");
  }
  if (T == 0)
    return Status::ok();
  float *out = at(value(0, true));
  return gemm(r, projected.o, P, roleOf(d, O), out, dModel, T, P, dModel);
}

StatusOr<CudaExecutor::Impl::KdaProjections>
CudaExecutor::Impl::projectKda(const fb::Dispatch &d, StreamResources &r, const float *x,
                               int64_t dModel, int64_t rows) {
  const fb::KdaParams *p = d.params_as_KdaParams();
  const int64_t H = p->num_heads(), P = H * p->head_dim();
  auto role = [&](int index) { return roleOf(d, index); };
  const int64_t rankF = weightRows(role(FA));
  const int64_t rankG = role(G) >= 0 ? 0 : weightRows(role(GA));
  KdaProjections out;
  float *next = r.scratch;
  auto carve = [&](int64_t floats) {
    float *start = next;
    next += pad(floats);
    return start;
  };
  out.qkv = carve(rows * 3 * P);
  out.forget = carve(rows * P);
  out.beta = carve(rows * H);
  out.gate = carve(rows * P);
  out.o = carve(rows * P);
  float *lowRank = carve(rows * std::max(rankF, rankG));
  out.next = next;
  if (rows == 0)
    return out;
  HYBRID_RETURN_IF_ERROR(gemm(r, x, dModel, role(Q), out.qkv, 3 * P, rows, dModel, P));
  HYBRID_RETURN_IF_ERROR(gemm(r, x, dModel, role(Kp), out.qkv + P, 3 * P, rows, dModel, P));
  HYBRID_RETURN_IF_ERROR(gemm(r, x, dModel, role(V), out.qkv + 2 * P, 3 * P, rows, dModel, P));
  HYBRID_RETURN_IF_ERROR(gemm(r, x, dModel, role(FA), lowRank, rankF, rows, dModel, rankF));
  HYBRID_RETURN_IF_ERROR(gemm(r, lowRank, rankF, role(FB), out.forget, P, rows, rankF, P));
  HYBRID_RETURN_IF_ERROR(gemm(r, x, dModel, role(B), out.beta, H, rows, dModel, H));
  if (role(G) >= 0)
    HYBRID_RETURN_IF_ERROR(gemm(r, x, dModel, role(G), out.gate, P, rows, dModel, P));
  else {
    HYBRID_RETURN_IF_ERROR(gemm(r, x, dModel, role(GA), lowRank, rankG, rows, dModel, rankG));
    HYBRID_RETURN_IF_ERROR(gemm(r, lowRank, rankG, role(GB), out.gate, P, rows, rankG, P));
  }
  return out;
}

// ---- MLA: this rank's tokens' cache rows [RMSNorm(latent) | rotated rope key].

Status CudaExecutor::Impl::runMlaCacheRows(const fb::Program &program, unsigned char *arena,
                                           const fb::Dispatch &d, StreamResources &r,
                                           const cpu::StepContext &host) {
  const fb::MlaParams *p = d.params_as_MlaParams();
  const int64_t T = host.rows, rkv = p->kv_lora_rank(), dr = p->qk_rope_head_dim();
  const fb::Value &in = valueOf(program, d.inputs()->Get(0));
  const fb::Value &outValue = valueOf(program, d.outputs()->Get(0));
  if (outValue.row_elements() != rkv + dr)
    return Status::error("output value " + std::to_string(d.outputs()->Get(0)) + " holds " +
                         std::to_string(outValue.row_elements()) +
                         " values per row, the cache rows are " + std::to_string(rkv + dr));
  if (T == 0)
    return Status::ok();
  if (static_cast<size_t>(pad(T * (rkv + dr)) + pad(T * rkv) + pad(T * dr)) > r.sizes.scratchFloats)
    return Status::error("MLA cache-row scratch larger than planned at load");
  float *kvA = r.scratch, *latent = kvA + pad(T * (rkv + dr)), *rope = latent + pad(T * rkv);
  const int64_t dModel = in.row_elements();
  HYBRID_RETURN_IF_ERROR(gemm(r, reinterpret_cast<const float *>(arena + in.arena_offset()),
                              dModel, roleOf(d, CacheRowsKvA), kvA, rkv + dr, T, dModel, rkv + dr));
  const kc::MlaLatentRowsParams rows = mlaLatentRowsParams(
      *p, T, kvA, fp32Weights.at(roleOf(d, CacheRowsNorm)),
      rotates(p->rope()) && dr > 0 ? ropeFrequencies.at(&d) : nullptr,
      rowPositions /* this rank's rows' positions */, latent, rope);
  LAUNCH_RETURN_IF_ERROR(kc::launchMlaLatentRows(rows, r.stream), "MLA cache rows");
  // [latent | rope] per row, as the gather hands them to every rank's attention.
  auto *out = reinterpret_cast<float *>(arena + outValue.arena_offset());
  const size_t pitch = static_cast<size_t>(rkv + dr) * sizeof(float);
  CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(out, pitch, latent, static_cast<size_t>(rkv) * sizeof(float),
                                         static_cast<size_t>(rkv) * sizeof(float),
                                         static_cast<size_t>(T), cudaMemcpyDeviceToDevice,
                                         r.stream),
                       "MLA cache rows");
  if (dr > 0)
    CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(out + rkv, pitch, rope,
                                           static_cast<size_t>(dr) * sizeof(float),
                                           static_cast<size_t>(dr) * sizeof(float),
                                           static_cast<size_t>(T), cudaMemcpyDeviceToDevice,
                                           r.stream),
                         "MLA cache rows");
  return Status::ok();
}

} // namespace hybrid::cudadev
