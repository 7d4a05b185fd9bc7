#include "cuda/CudaExecutorImpl.h"

#include "hybrid/kernels/cuda/AttnRes.h"
#include "hybrid/kernels/cuda/Elementwise.h"
#include "hybrid/kernels/cuda/Norm.h"
#include "hybrid/kernels/cuda/SyntheticWeights.h"
#include "hybrid/kernels/ref/Quant.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <optional>
#include <vector>

namespace hybrid::cudadev {

bool CudaExecutor::Impl::runsOnGpu(const fb::Dispatch &d) const {
  switch (d.kernel()) {
  case fb::KernelId::Embed: {
    const int32_t table = roleOf(d, 0);
    return table >= 0 && (weightTypes[table] == fb::DType::BF16 ||
                          weightTypes[table] == fb::DType::F32);
  }
  case fb::KernelId::RmsNorm:
  case fb::KernelId::AddRmsNorm:
  case fb::KernelId::Add:
    return true;
  case fb::KernelId::Linear:
  case fb::KernelId::LmHead: // one input, or two whose row-wise concatenation is projected
    return d.inputs() && d.inputs()->size() >= 1 && d.inputs()->size() <= 2 &&
           gemmWeight(roleOf(d, 0));
  case fb::KernelId::Mlp: // SiLU or Kimi K3's SiTU (kc::GatedActivation)
    return d.params_as_MlpParams() &&
           kc::gatedActivationValid(gatedActivationOf(*d.params_as_MlpParams())) &&
           gemmWeight(roleOf(d, 0)) && gemmWeight(roleOf(d, 1)) && gemmWeight(roleOf(d, 2));
  case fb::KernelId::KdaChunkPrefill:
  case fb::KernelId::KdaContextSummary: // the same layer's weights and state
  case fb::KernelId::KdaRecurrentDecode: {
    const fb::KdaParams *p = d.params_as_KdaParams();
    if (!p || p->state_layout() != fb::StateLayout::KMajor || p->conv_kernel() < 1 ||
        p->conv_kernel() > kc::kKdaMaxConvKernel || (p->head_dim() != 64 && p->head_dim() != 128) ||
        (kdaPrefillPath == kc::KdaPrefillPath::Chunked && p->head_dim() != 128))
      return false;
    for (int role : {Q, Kp, V, FA, FB, B, O})
      if (!gemmWeight(roleOf(d, role)))
        return false;
    if (roleOf(d, G) >= 0)
      return gemmWeight(roleOf(d, G));
    return gemmWeight(roleOf(d, GA)) && gemmWeight(roleOf(d, GB));
  }
  case fb::KernelId::RouterTopK:
    return moeRunsOnGpu(d);
  case fb::KernelId::AllReduceSum: // NCCL on device buffers; a host communicator is staged
  case fb::KernelId::AllGatherRows:
    return communicator && communicator->deviceBuffers();
  case fb::KernelId::MlaCacheRows: { // with its layer's attention (the pools' rows)
    const fb::MlaParams *p = d.params_as_MlaParams();
    return p && p->kv_slot() >= 0 && p->kv_slot() < static_cast<int32_t>(kvLayers.size()) &&
           kvLayers[static_cast<size_t>(p->kv_slot())].onGpu && gemmWeight(roleOf(d, 0)) &&
           roleOf(d, 1) >= 0;
  }
  case fb::KernelId::MoeExperts:
    // An all_to_all exchange runs on the GPU over a device-buffer communicator (NCCL); with a
    // host one (ranks sharing a GPU as threads) the cpu reference stages it, as the gathers.
    return d.params_as_MoeParams() &&
           kc::gatedActivationValid(gatedActivationOf(*d.params_as_MoeParams())) &&
           moeRunsOnGpu(d) &&
           (!d.params_as_MoeParams()->all_to_all() ||
            (communicator && communicator->deviceBuffers()));
  case fb::KernelId::AttnRes:
  case fb::KernelId::AttnResRmsNorm: { // inputs: the partial sum, then the completed blocks
    const size_t roles = d.kernel() == fb::KernelId::AttnResRmsNorm ? 3 : 2;
    if (!d.params_as_AttnResParams() || !d.inputs() || d.inputs()->size() < 1 ||
        d.inputs()->size() > kc::kAttnResMaxCandidates || !d.weights() ||
        d.weights()->size() < roles)
      return false;
    for (size_t i = 0; i < roles; ++i)
      if (roleOf(d, static_cast<int>(i)) < 0)
        return false;
    return true;
  }
  default: // MLA and DSA where their layer's kernels fit
    return attentionRunsOnGpu(d);
  }
}

Status CudaExecutor::Impl::gemm(StreamResources &r, const float *x, int64_t xStride,
                                int32_t weightIndex, float *y, int64_t yStride, int64_t rows,
                                int64_t in, int64_t out) {
  kc::LinearParams p;
  p.rows = rows;
  p.in = in;
  p.out = out;
  p.x = x;
  p.xStride = xStride;
  p.weight = weight(weightIndex);
  p.y = y;
  p.yStride = yStride;
  p.xScratch = r.xBf16;
  p.splitInput = splitGemmInputs;
  p.splitOutput = r.splitOutput;
  const fb::Weight *w = plan->weights()->Get(static_cast<flatbuffers::uoffset_t>(weightIndex));
  if (weightTypes[static_cast<size_t>(weightIndex)] == fb::DType::F8_E4M3) {
    kc::LinearFp8Params q;
    q.rows = rows;
    q.in = in;
    q.out = out;
    q.x = x;
    q.xStride = xStride;
    q.weight = p.weight;
    q.weightScale = fp8WeightScales.at(weightIndex);
    q.y = y;
    q.yStride = yStride;
    q.activationScale = fp8ActivationScale;
    q.scratch = r.fp8Scratch;
    if (kc::linearFp8ScratchBytes(rows, in, out) > r.sizes.fp8ScratchBytes)
      return Status::error("FP8 GEMM of " + std::to_string(rows) + "x" + std::to_string(in) +
                           "x" + std::to_string(out) + " is larger than the scratch planned at load");
    LAUNCH_RETURN_IF_ERROR(r.linear.runFp8(q, r.stream),
                           ("FP8 GEMM with '" + w->name()->str() + "'").c_str());
    return Status::ok();
  }
  if (static_cast<size_t>(rows * in) > r.sizes.xBf16Elements ||
      static_cast<size_t>(rows * out) > r.sizes.gemmOutputs)
    return Status::error("GEMM of " + std::to_string(rows) + "x" + std::to_string(in) + "x" +
                         std::to_string(out) + " is larger than the scratch planned at load");
  LAUNCH_RETURN_IF_ERROR(r.linear.run(p, r.stream), ("GEMM with '" + w->name()->str() + "'").c_str());
  return Status::ok();
}

kc::LinearParams CudaExecutor::Impl::linearParams(StreamResources &r, const GemmCall &c,
                                                  int64_t rows) const {
  kc::LinearParams p;
  p.rows = rows;
  p.in = c.in;
  p.out = c.out;
  p.x = c.x;
  p.xStride = c.xStride;
  p.weight = weight(c.weightIndex);
  p.y = c.y;
  p.yStride = c.yStride;
  p.xScratch = r.xBf16;
  p.splitInput = splitGemmInputs;
  p.splitOutput = r.splitOutput;
  return p;
}

bool CudaExecutor::Impl::groupable(const StreamResources &r, const GemmCall &c,
                                   int64_t rows) const {
  return weightTypes[static_cast<size_t>(c.weightIndex)] == fb::DType::BF16 &&
         static_cast<size_t>(rows * c.in) <= r.sizes.xBf16Elements &&
         static_cast<size_t>(rows * c.out) <= r.sizes.gemmOutputs;
}

bool CudaExecutor::Impl::runsOnDecodeGemv(StreamResources &r, const GemmCall &c,
                                          int64_t rows) const {
  return groupable(r, c, rows) && r.linear.runsDecodeKernel(linearParams(r, c, rows));
}

Status CudaExecutor::Impl::gemmGroup(StreamResources &r, std::span<const GemmCall> calls,
                                     int64_t rows) {
  bool grouped = calls.size() <= static_cast<size_t>(kc::kLinearMaxGroup);
  kc::LinearParams members[kc::kLinearMaxGroup];
  for (size_t i = 0; i < calls.size() && grouped; ++i) {
    const GemmCall &c = calls[i];
    grouped = groupable(r, c, rows);
    members[i] = linearParams(r, c, rows);
  }
  if (calls.empty())
    return Status::ok();
  if (grouped) {
    LAUNCH_RETURN_IF_ERROR(
        r.linear.runGroup(members, static_cast<int>(calls.size()), r.stream),
        ("GEMM group with '" +
         plan->weights()->Get(static_cast<flatbuffers::uoffset_t>(calls[0].weightIndex))
             ->name()->str() + "'").c_str());
    return Status::ok();
  }
  for (const GemmCall &c : calls) // FP8 weights, or larger than the scratch (gemm says so)
    HYBRID_RETURN_IF_ERROR(gemm(r, c.x, c.xStride, c.weightIndex, c.y, c.yStride, rows, c.in,
                                c.out));
  return Status::ok();
}

Status CudaExecutor::Impl::uploadSmallWeight(int32_t index, const HostWeights &hostWeights) {
  if (index < 0 || fp32Weights.count(index))
    return Status::ok();
  HYBRID_ASSIGN_OR_RETURN(const std::vector<float> *values, hostWeights(index));
  return uploadFloats(*values, fp32Weights[index],
                      "upload of '" +
                          plan->weights()->Get(static_cast<flatbuffers::uoffset_t>(index))
                              ->name()->str() + "'");
}

Status CudaExecutor::Impl::prepareFp8Weight(int32_t index, int64_t rows,
                                            const HostWeights &hostWeights) {
  const fb::Weight *w = plan->weights()->Get(static_cast<flatbuffers::uoffset_t>(index));
  const int64_t out = w->shape()->Get(0), in = w->shape()->Get(1);
  prepared.fp8ScratchBytes =
      std::max(prepared.fp8ScratchBytes, kc::linearFp8MaxScratchBytes(rows, in, out));
  return uploadFp8WeightScales(index, hostWeights);
}

Status CudaExecutor::Impl::uploadFp8WeightScales(int32_t index, const HostWeights &hostWeights) {
  if (fp8WeightScales.count(index))
    return Status::ok();
  const fb::Weight *w = plan->weights()->Get(static_cast<flatbuffers::uoffset_t>(index));
  const int64_t out = w->shape()->Get(0), in = w->shape()->Get(1);
  const int64_t blockRows = (out + kc::kFp8BlockSize - 1) / kc::kFp8BlockSize;
  const int64_t blockCols = (in + kc::kFp8BlockSize - 1) / kc::kFp8BlockSize;
  const int64_t stride = kc::linearFp8WeightScaleStride(in);
  HYBRID_ASSIGN_OR_RETURN(const std::vector<float> *converted, hostWeights(w->scale()));
  const std::vector<float> &scales = *converted;
  if (static_cast<int64_t>(scales.size()) != blockRows * blockCols)
    return Status::error("fp8 weight '" + w->name()->str() + "': " +
                         std::to_string(scales.size()) + " block scales, expected " +
                         std::to_string(blockRows) + "x" + std::to_string(blockCols));
  std::vector<float> padded(static_cast<size_t>(blockRows * stride), 0.0f);
  for (int64_t i = 0; i < blockRows; ++i)
    std::copy_n(scales.begin() + i * blockCols, blockCols, padded.begin() + i * stride);
  float *&device = fp8WeightScales[index];
  CUDA_RETURN_IF_ERROR(cudaMalloc(&device, padded.size() * sizeof(float)), "fp8 weight scales");
  CUDA_RETURN_IF_ERROR(cudaMemcpy(device, padded.data(), padded.size() * sizeof(float),
                                  cudaMemcpyHostToDevice),
                       "fp8 weight scales");
  return Status::ok();
}

kc::KdaLayerCall CudaExecutor::Impl::layerCall(const fb::Dispatch &d, int32_t stateSlot) const {
  const fb::KdaParams *p = d.params_as_KdaParams();
  auto role = [&](int index) { return d.weights()->Get(index); };
  const uint64_t slot = static_cast<uint64_t>(stateSlot);
  const size_t layer = static_cast<size_t>(p->state_slot());
  kc::KdaLayerCall call;
  call.heads = p->num_heads();
  call.headDim = p->head_dim();
  call.convKernel = p->conv_kernel();
  call.weights.convWeight = kdaConvTaps.at(&d);
  call.weights.aLog = fp32Weights.at(role(ALog));
  call.weights.dtBias = fp32Weights.at(role(DtBias));
  call.weights.normWeight = fp32Weights.at(role(ONorm));
  call.weights.normEpsilon = p->norm_epsilon();
  call.weights.lowerBoundGate = p->gate() == fb::KdaGate::LowerBound;
  call.weights.lowerBound = p->gate_lower_bound();
  call.convState = convRegion + slot * slotConvFloats + layerConvFloats[layer];
  call.state = stateRegion + slot * slotStateBytes + layerStateBytes[layer];
  call.stateType = stateType;
  return call;
}

Status CudaExecutor::Impl::logKdaInputs(const fb::Dispatch &d, const kc::KdaLayerCall &call,
                                        int64_t rows, StreamResources &r) {
  const int64_t P = int64_t(call.heads) * call.headDim, H = call.heads;
  const int64_t rowFloats = 3 * P + P + H + P + P;
  const size_t floats = static_cast<size_t>(rows * rowFloats);
  if (kdaLogUsed == kdaLog.size())
    kdaLog.emplace_back();
  LoggedKda &entry = kdaLog[kdaLogUsed++];
  if (entry.capacity < floats) {
    // Never below a graph-replayed pass's rows: a captured pass writes into this allocation, and
    // one that moved would leave its graph writing to freed memory (runPrefillGraph checks).
    const size_t capacity = static_cast<size_t>(
        std::max(rows, Impl::kPrefillGraphMaxRows) * rowFloats);
    cudaFree(entry.inputs);
    entry.inputs = nullptr;
    entry.capacity = 0;
    CUDA_RETURN_IF_ERROR(cudaMalloc(&entry.inputs, capacity * sizeof(float)), "KDA replay log");
    entry.capacity = capacity;
  }
  entry.dispatch = &d;
  entry.qkv = entry.inputs;
  entry.forget = entry.qkv + rows * 3 * P;
  entry.beta = entry.forget + rows * P;
  entry.gate = entry.beta + rows * H;
  entry.out = entry.gate + rows * P;
  const std::pair<float *, const float *> copies[4] = {
      {entry.qkv, call.qkv}, {entry.forget, call.forget}, {entry.beta, call.betaLogits},
      {entry.gate, call.outputGate}};
  const int64_t widths[4] = {3 * P, P, H, P};
  for (int i = 0; i < 4; ++i)
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(copies[i].first, copies[i].second,
                                         static_cast<size_t>(rows * widths[i]) * sizeof(float),
                                         cudaMemcpyDeviceToDevice, r.stream),
                         "KDA replay log");
  return Status::ok();
}

Status CudaExecutor::Impl::runKda(const fb::Program &program, unsigned char *arena,
                                  const fb::Dispatch &d, StreamResources &r,
                                  const cpu::StepContext &host) {
  const fb::KdaParams *p = d.params_as_KdaParams();
  const int64_t T = host.rows;
  const fb::Value &in = valueOf(program, d.inputs()->Get(0));
  const float *x = reinterpret_cast<const float *>(arena + in.arena_offset());
  float *out = reinterpret_cast<float *>(
      arena + valueOf(program, d.outputs()->Get(0)).arena_offset());
  const int64_t dModel = in.row_elements(), H = p->num_heads(), K = p->head_dim(), P = H * K;
  auto role = [&](int index) { return d.weights()->Get(index); };
  const int64_t rankF = weightRows(role(FA));
  const int64_t rankG = role(G) >= 0 ? 0 : weightRows(role(GA));

  // Scratch, each 256-byte aligned: qkv [T, 3P], forget [T, P], beta [T, H], gate [T, P],
  // o [T, P], low-rank [T, r].
  float *next = r.scratch;
  auto carve = [&](int64_t floats) {
    float *start = next;
    next += (floats + 63) / 64 * 64;
    return start;
  };
  float *qkv = carve(T * 3 * P), *forget = carve(T * P), *beta = carve(T * H);
  float *gate = carve(T * P), *o = carve(T * P), *lowRankF = carve(T * rankF);
  float *lowRankG = next;
  // The projections of x in one group, then the two low-rank ones' second halves in another.
  std::vector<GemmCall> ofX = {{x, dModel, role(Q), qkv, 3 * P, dModel, P},
                               {x, dModel, role(Kp), qkv + P, 3 * P, dModel, P},
                               {x, dModel, role(V), qkv + 2 * P, 3 * P, dModel, P},
                               {x, dModel, role(FA), lowRankF, rankF, dModel, rankF},
                               {x, dModel, role(B), beta, H, dModel, H}};
  std::vector<GemmCall> ofLowRank = {{lowRankF, rankF, role(FB), forget, P, rankF, P}};
  if (role(G) >= 0) {
    ofX.push_back({x, dModel, role(G), gate, P, dModel, P});
  } else {
    ofX.push_back({x, dModel, role(GA), lowRankG, rankG, dModel, rankG});
    ofLowRank.push_back({lowRankG, rankG, role(GB), gate, P, rankG, P});
  }
  HYBRID_RETURN_IF_ERROR(gemmGroup(r, ofX, T));
  const bool decode = d.kernel() == fb::KernelId::KdaRecurrentDecode;
  if (!decode) // a decode step's run below, where the fused kernel takes none of them
    HYBRID_RETURN_IF_ERROR(gemmGroup(r, ofLowRank, T));

  // RecurrentStatePool (host) checks the layer and slot; the device regions have their layout.
  HYBRID_RETURN_IF_ERROR(host.states->stateOffset(p->state_slot(), host.stateSlot).status());
  for (const cpu::BatchRow &segment : host.batch)
    HYBRID_RETURN_IF_ERROR(host.states->stateOffset(p->state_slot(), segment.stateSlot).status());
  const size_t layer = static_cast<size_t>(p->state_slot());
  kc::KdaLayerCall call = layerCall(d, host.stateSlot);
  call.qkv = qkv;
  call.forget = forget;
  call.betaLogits = beta;
  call.outputGate = gate;
  call.out = o;
  if (host.kdaLog && d.kernel() == fb::KernelId::KdaChunkPrefill)
    HYBRID_RETURN_IF_ERROR(logKdaInputs(d, call, T, r));
  if (decode) {
    if (T != 1 && static_cast<int64_t>(host.batch.size()) != T)
      return Status::error("the decode kernel runs one token per sequence, this step has " +
                           std::to_string(T) + " tokens of one sequence");
    kc::KdaDecodeParams step;
    static_cast<kc::KdaLayerCall &>(step) = call;
    // Row r's states in slot rowSlots[r] of the layer's part of every slot.
    step.batch = static_cast<int32_t>(T);
    step.state = stateRegion + layerStateBytes[layer];
    step.stateStride = static_cast<int64_t>(slotStateBytes /
                                            (stateType == kc::KdaStateType::BF16 ? 2 : 4));
    step.convState = convRegion + layerConvFloats[layer];
    step.convStateStride = static_cast<int64_t>(slotConvFloats);
    step.stateIndices = rowSlots;
    step.workspace = r.kdaWorkspace;
    if (batchInvariant) // the path the verification passes' recurrent kernel sums like
      step.path = kc::KdaDecodePath::Fused;
    else
      applyTuning(step); // the fused or split path tuned for this batch, if any
    // The fused kernel computes a low-rank gate's second half itself where the decode GEMV
    // would (its sums, so the same bits as the launch it saves: one a gate, a layer).
    const bool fused = !kc::kdaDecodeUsesSplit(step.path, step.batch, step.heads, step.headDim);
    std::vector<GemmCall> unfused;
    for (const GemmCall &c : ofLowRank) {
      if (fused && c.in <= kc::kKdaDecodeMaxLowRank && c.in % 8 == 0 && runsOnDecodeGemv(r, c, T)) {
        kc::KdaLowRankGate &gate = c.y == forget ? step.forgetLowRank : step.gateLowRank;
        gate = {c.x, c.xStride, weight(c.weightIndex), c.in, static_cast<int32_t>(c.in)};
      } else {
        unfused.push_back(c);
      }
    }
    step.lowRankRoundInputToBf16 = !splitGemmInputs; // the GEMV's bf16(x) (LinearContext)
    HYBRID_RETURN_IF_ERROR(gemmGroup(r, unfused, T));
    if (kc::kdaDecodeWorkspaceBytes(step) > r.sizes.kdaWorkspaceBytes)
      return Status::error("KDA decode workspace larger than planned at load");
    LAUNCH_RETURN_IF_ERROR(kc::launchKdaFusedDecode(step, r.stream), "KDA decode step");
  } else {
    // One launch per segment of a batched prefill, each on its own slot's state and conv
    // history: the kernels' cu_seqlens form takes packed states, the pool's slots are strided.
    const cpu::BatchRow whole{.stateSlot = host.stateSlot, .rows = T};
    const std::span<const cpu::BatchRow> segments =
        host.batch.empty() ? std::span(&whole, 1) : host.batch;
    int64_t first = 0;
    for (size_t i = 0; i < segments.size(); ++i) {
      kc::KdaPrefillParams prefill;
      static_cast<kc::KdaLayerCall &>(prefill) = call;
      if (segments[i].stateSlot != host.stateSlot) {
        const kc::KdaLayerCall own = layerCall(d, segments[i].stateSlot);
        prefill.state = own.state;
        prefill.convState = own.convState;
      }
      prefill.qkv = qkv + first * 3 * P;
      prefill.forget = forget + first * P;
      prefill.betaLogits = beta + first * H;
      prefill.outputGate = gate + first * P;
      prefill.out = o + first * P;
      prefill.sequences = 1;
      prefill.cuSeqlens = cuSeqlens + 2 * i; // uploaded with the token ids
      prefill.tokens = static_cast<int32_t>(segments[i].rows);
      prefill.workspace = r.kdaWorkspace;
      prefill.path = kdaPrefillPath;
      if (kc::kdaPrefillWorkspaceBytes(prefill) > r.sizes.kdaWorkspaceBytes)
        return Status::error("KDA prefill workspace larger than planned at load");
      LAUNCH_RETURN_IF_ERROR(kc::launchKdaPrefill(prefill, r.stream), "KDA prefill");
      first += segments[i].rows;
    }
    if (first != T)
      return Status::error("a batched prefill's segments hold " + std::to_string(first) +
                           " rows, the step " + std::to_string(T));
  }
  return gemm(r, o, P, role(O), out, dModel, T, P, dModel);
}

Status CudaExecutor::Impl::checkCollective(const fb::Program &program,
                                           const fb::Dispatch &d) const {
  if (!communicator)
    return Status::error("a sharded plan's collective needs a communicator "
                         "(LoadOptions::communicator; hybrid-run under RANK / WORLD_SIZE)");
  for (int32_t value : *d.outputs())
    if (valueOf(program, value).dtype() != fb::DType::F32)
      return Status::error("collective output value " + std::to_string(value) +
                           " is not F32, the communicator sums fp32");
  if (!communicator->deviceBuffers())
    return Status::ok(); // the cpu reference runs it (and refuses kinds it does not know)
  switch (d.kernel()) {
  case fb::KernelId::AllReduceSum:
  case fb::KernelId::AllGatherRows:
    break;
  default: // a newer collective kind: never handed to the cpu reference with device buffers
    return Status::error("the cuda device has no " + communicator->backend() +
                         " path for collective '" + kernelName(d.kernel()) + "'");
  }
  // A group spanning the world runs on its communicator, a narrower one on the communicator
  // split for it at load (prepareContextParallel), a group of one rank on none.
  const fb::CollectiveParams *params = d.params_as_CollectiveParams();
  const fb::CollectiveGroup group = params ? params->group() : fb::CollectiveGroup::TensorParallel;
  const int size = groupSize(group);
  comm::Communicator *groupComm = groupCommunicator(group);
  if (size > 1 && (!groupComm || groupComm->worldSize() != size))
    return Status::error("collective over the " + std::string(fb::EnumNameCollectiveGroup(group)) +
                         " group of " + std::to_string(size) + " ranks in a world of " +
                         std::to_string(communicator->worldSize()) +
                         ": no communicator for the group");
  if (d.kernel() == fb::KernelId::AllGatherRows && group != fb::CollectiveGroup::ContextParallel)
    return Status::error("all_gather_rows over the " +
                         std::string(fb::EnumNameCollectiveGroup(group)) +
                         " group: it gathers over the context_parallel group");
  return Status::ok();
}

// The sum over the ranks of each rank's partial (a rank without one adds zeros), in place in the
// output on the step's stream: capturable, so a decode graph holds its all-reduces.
Status CudaExecutor::Impl::runAllReduceSum(const fb::Program &program, unsigned char *arena,
                                           const fb::Dispatch &d, StreamResources &r,
                                           int64_t rows) {
  const fb::Value &out = valueOf(program, d.outputs()->Get(0));
  float *sum = reinterpret_cast<float *>(arena + out.arena_offset());
  const size_t count = static_cast<size_t>(rows * out.row_elements());
  if (d.inputs()->size() == 1) {
    const fb::Value &partial = valueOf(program, d.inputs()->Get(0));
    if (partial.arena_offset() != out.arena_offset())
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sum, arena + partial.arena_offset(),
                                           count * sizeof(float), cudaMemcpyDeviceToDevice,
                                           r.stream),
                           "all-reduce input");
  } else {
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(sum, 0, count * sizeof(float), r.stream),
                         "all-reduce zeros");
  }
  const fb::CollectiveParams *params = d.params_as_CollectiveParams();
  comm::Communicator *group =
      groupCommunicator(params ? params->group() : fb::CollectiveGroup::TensorParallel);
  return group ? group->allReduceSum(sum, count, r.stream) : Status::ok(); // one rank: the copy
}

Status CudaExecutor::Impl::runOnGpu(const fb::Program &program, unsigned char *arena,
                                    const fb::Dispatch &d, StreamResources &r,
                                    const cpu::StepContext &host) {
  const int64_t rows = host.rows;
  auto input = [&](int position) {
    return reinterpret_cast<float *>(arena + valueOf(program, d.inputs()->Get(position)).arena_offset());
  };
  auto output = [&](int position) {
    return reinterpret_cast<float *>(arena + valueOf(program, d.outputs()->Get(position)).arena_offset());
  };
  auto width = [&](int32_t value) { return valueOf(program, value).row_elements(); };
  auto role = [&](int index) { return roleOf(d, index); };
  auto normWeight = [&]() -> const float * {
    return role(0) >= 0 ? fp32Weights.at(role(0)) : nullptr;
  };
  switch (d.kernel()) {
  case fb::KernelId::Embed: {
    const int32_t table = role(0);
    const int64_t vocab = weightRows(table), dim = width(d.outputs()->Get(0));
    const auto *ids = reinterpret_cast<const int64_t *>(
        arena + valueOf(program, d.inputs()->Get(0)).arena_offset());
    LAUNCH_RETURN_IF_ERROR(kc::launchEmbed(ids, rows, weight(table),
                                           weightTypes[table] == fb::DType::BF16
                                               ? kc::TableType::BF16
                                               : kc::TableType::F32,
                                           vocab, dim, output(0), r.stream),
                           "embedding gather");
    return Status::ok();
  }
  case fb::KernelId::RmsNorm:
  case fb::KernelId::AddRmsNorm: {
    const bool add = d.kernel() == fb::KernelId::AddRmsNorm;
    kc::RmsNormParams p;
    p.rows = rows;
    p.dim = width(d.inputs()->Get(0));
    p.epsilon = d.params_as_RmsNormParams()->epsilon();
    p.x = input(0);
    p.addend = add ? input(1) : nullptr;
    p.secondAddend = add && d.inputs()->size() == 3 ? input(2) : nullptr;
    p.sum = add ? output(0) : nullptr;
    p.weight = normWeight();
    p.y = add ? output(1) : output(0);
    LAUNCH_RETURN_IF_ERROR(kc::launchRmsNorm(p, r.stream), "RMSNorm");
    return Status::ok();
  }
  case fb::KernelId::Add:
    LAUNCH_RETURN_IF_ERROR(kc::launchAdd(input(0), input(1), output(0),
                                         rows * width(d.outputs()->Get(0)), r.stream),
                           "add");
    return Status::ok();
  case fb::KernelId::Linear:
  case fb::KernelId::LmHead: {
    const int64_t in = width(d.inputs()->Get(0)), out = width(d.outputs()->Get(0));
    if (d.inputs()->size() == 1)
      return gemmInRowChunks(r, input(0), in, role(0), output(0), out, rows, in, out);
    // W [a | b] over rows [a | b] gathered into scratch: one GEMM whatever the weight's dtype
    // (FP8 block scales could not be split at an arbitrary column).
    const int64_t inB = width(d.inputs()->Get(1)), joined = in + inB;
    CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(r.scratch, joined * sizeof(float), input(0),
                                           in * sizeof(float), in * sizeof(float), rows,
                                           cudaMemcpyDeviceToDevice, r.stream),
                         "two-input linear gather");
    CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(r.scratch + in, joined * sizeof(float), input(1),
                                           inB * sizeof(float), inB * sizeof(float), rows,
                                           cudaMemcpyDeviceToDevice, r.stream),
                         "two-input linear gather");
    return gemmInRowChunks(r, r.scratch, joined, role(0), output(0), out, rows, joined, out);
  }
  case fb::KernelId::Mlp: {
    const int64_t dModel = width(d.inputs()->Get(0)), inner = weightRows(role(0));
    float *gateUp = r.scratch, *hidden = gateUp + (rows * 2 * inner + 63) / 64 * 64;
    const GemmCall gateAndUp[2] = {{input(0), dModel, role(0), gateUp, 2 * inner, dModel, inner},
                                   {input(0), dModel, role(1), gateUp + inner, 2 * inner, dModel,
                                    inner}};
    HYBRID_RETURN_IF_ERROR(gemmGroup(r, gateAndUp, rows));
    LAUNCH_RETURN_IF_ERROR(kc::launchGatedActivation(gateUp, gateUp + inner, rows, inner, 2 * inner,
                                                     hidden,
                                                     gatedActivationOf(*d.params_as_MlpParams()),
                                                     r.stream),
                           "gated activation");
    return gemm(r, hidden, inner, role(2), output(0), dModel, rows, inner, dModel);
  }
  case fb::KernelId::KdaChunkPrefill:
  case fb::KernelId::KdaRecurrentDecode:
    if (d.inputs()->size() == 3) // a context-parallel prefill's: [x, x_tails, summaries]
      return runKdaContext(program, arena, d, r, host);
    return runKda(program, arena, d, r, host);
  case fb::KernelId::KdaContextSummary:
    return runKdaContext(program, arena, d, r, host);
  case fb::KernelId::MlaCacheRows:
    return runMlaCacheRows(program, arena, d, r, host);
  case fb::KernelId::AllGatherRows:
    return runAllGatherRows(program, arena, d, r, host);
  case fb::KernelId::AttnRes:
  case fb::KernelId::AttnResRmsNorm: {
    // The plan lists the partial sum first; the mix takes the completed blocks, then the partial.
    const fb::AttnResParams *p = d.params_as_AttnResParams();
    kc::AttnResParams mix;
    mix.tokens = static_cast<int32_t>(rows);
    mix.dim = static_cast<int32_t>(width(d.outputs()->Get(0)));
    mix.candidates = static_cast<int32_t>(d.inputs()->size());
    for (int m = 1; m < mix.candidates; ++m)
      mix.values[m - 1] = input(m);
    mix.values[mix.candidates - 1] = input(0);
    mix.normWeight = fp32Weights.at(role(0));
    mix.projWeight = fp32Weights.at(role(1));
    mix.epsilon = p->epsilon();
    mix.mixed = output(0);
    if (d.kernel() == fb::KernelId::AttnResRmsNorm) {
      mix.outputNormWeight = fp32Weights.at(role(2));
      mix.outputEpsilon = p->output_norm_epsilon();
      mix.normed = output(1);
    }
    LAUNCH_RETURN_IF_ERROR(kc::launchAttnResMix(mix, r.stream), "AttnRes mix");
    return Status::ok();
  }
  case fb::KernelId::RouterTopK:
    return runRouter(program, arena, d, r, host);
  case fb::KernelId::MoeExperts:
    return runMoeExperts(program, arena, d, r, host);
  case fb::KernelId::AllReduceSum:
    return runAllReduceSum(program, arena, d, r, rows);
  default:
    if (attentionRunsOnGpu(d))
      return runAttention(program, arena, d, r, host);
    return Status::error("no GPU kernel (placement error)");
  }
}

Status CudaExecutor::Impl::runOnCpu(const fb::Program &program, const fb::Dispatch &d,
                                    unsigned char *arena, const cpu::StepContext &host) {
  // Everything before this step has finished; its inputs go down, its outputs come back up.
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "before a cpu step");
  HYBRID_ASSIGN_OR_RETURN(std::span<std::byte> hostArena,
                          host.arena->view(0, program.arena_bytes()));
  for (int32_t index : *d.inputs()) {
    const fb::Value &value = valueOf(program, index);
    CUDA_RETURN_IF_ERROR(cudaMemcpy(hostArena.data() + value.arena_offset(),
                                    arena + value.arena_offset(),
                                    valueBytes(value, cpu::valueRows(host, value)),
                                    cudaMemcpyDeviceToHost),
                         "download of a cpu step's input");
  }
  HYBRID_RETURN_IF_ERROR(cpu::runStepDispatch(host, d)); // row by row in a batched step
  for (int32_t index : *d.outputs()) {
    const fb::Value &value = valueOf(program, index);
    CUDA_RETURN_IF_ERROR(cudaMemcpy(arena + value.arena_offset(),
                                    hostArena.data() + value.arena_offset(),
                                    valueBytes(value, cpu::valueRows(host, value)),
                                    cudaMemcpyHostToDevice),
                         "upload of a cpu step's output");
  }
  // A pageable upload may return before its DMA lands, and the plan's streams do not wait on the
  // legacy stream that carried it.
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "after a cpu step");
  return Status::ok();
}

StatusOr<std::unique_ptr<CudaExecutor>>
CudaExecutor::create(const std::string &dir, const fb::Plan &plan, const WeightArchive &archive,
                     const HostWeights &hostWeights, const RecurrentStatePool &states,
                     PagedKvCache &kvCache, const LoadOptions &options, LoadTimings &timings) {
  // Each lap adds the time since the previous one to a phase (LoadTimings).
  auto lapStart = std::chrono::steady_clock::now();
  auto lap = [&lapStart](double &phase) {
    const auto now = std::chrono::steady_clock::now();
    phase += std::chrono::duration<double>(now - lapStart).count();
    lapStart = now;
  };
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    return Status::error("no CUDA device");
  // The runtime creates the context on the first call that needs one: here, so that its cost
  // is a phase of its own rather than part of the first allocation's.
  CUDA_RETURN_IF_ERROR(cudaFree(nullptr), "context creation");
  lap(timings.cudaInitSeconds);
  auto impl = std::make_unique<Impl>();
  impl->plan = &plan;
  impl->splitGemmInputs = !options.bf16GemmInputs;
  impl->batchInvariant = options.batchInvariant;
  impl->communicator = options.communicator;
  // Collectives staged through the host synchronize the device mid-step: ranks sharing a GPU as
  // threads would do so while another rank's decode graph is being captured. Their decode steps
  // run eagerly; NCCL's collectives are captured with the rest.
  impl->cudaGraphs = options.cudaGraphs &&
                     !(options.communicator && !options.communicator->deviceBuffers());
  impl->prefillGraphs = impl->cudaGraphs && options.prefillGraphs;
  impl->fp8ActivationScale = plan.fp8_activation_scale() == fb::Fp8ActivationScale::Ue8m0
                                 ? kc::Fp8ActivationScale::DeepSeekUe8m0
                                 : kc::Fp8ActivationScale::DeepSeekLinear;
  if (options.kdaPrefill == "recurrent")
    impl->kdaPrefillPath = kc::KdaPrefillPath::Recurrent;
  else if (options.kdaPrefill == "chunked")
    impl->kdaPrefillPath = kc::KdaPrefillPath::Chunked;
  else if (options.kdaPrefill != "auto")
    return Status::error("kdaPrefill '" + options.kdaPrefill +
                         "' is not one of auto, chunked, recurrent");
  HYBRID_RETURN_IF_ERROR(impl->openTuning(options.tuningCache));
  for (const char *name : {"prefill", "decode", "mtp"}) {
    const fb::Program *program = nullptr;
    for (const fb::Program *candidate : *plan.programs())
      if (candidate->name()->string_view() == name)
        program = candidate;
    if (program)
      impl->programs.push_back(program);
    else if (impl->programs.size() < Impl::kMtp) // the mtp program is optional
      return Status::error(dir + "/plan.hyplan: no '" + name + "' program");
  }
  impl->hiddenWidth = plan.hidden_size();

  // Weights: the archive's entries at the plan's offsets, as stored; a synthetic archive's are
  // generated in place (no host copy).
  const auto *weights = plan.weights();
  const size_t numWeights = weights ? weights->size() : 0;
  lap(timings.kernelSetupSeconds);
  CUDA_RETURN_IF_ERROR(cudaMalloc(&impl->weights, std::max<uint64_t>(1, plan.weight_archive_bytes())),
                       "weights (" + std::to_string(plan.weight_archive_bytes()) + " bytes)");
  lap(timings.weightBufferSeconds);
  const auto generationStart = std::chrono::steady_clock::now();
  WeightGeneration generation;
  for (size_t i = 0; i < numWeights; ++i) {
    const fb::Weight *weight = weights->Get(static_cast<flatbuffers::uoffset_t>(i));
    const WeightArchiveEntry *entry = archive.find(weight->name()->string_view());
    if (!entry)
      return Status::error("weight '" + weight->name()->str() + "' is not in the archive");
    if (weight->offset() + entry->size > plan.weight_archive_bytes())
      return Status::error("weight '" + weight->name()->str() + "' ends past the archive");
    impl->weightTypes.push_back(entry->dtype);
    if (entry->synthetic) {
      LAUNCH_RETURN_IF_ERROR(
          kc::launchSyntheticFill(syntheticFill(*entry), impl->weights + weight->offset(), nullptr),
          ("generating '" + weight->name()->str() + "'").c_str());
      generation.deviceBytes += entry->size;
      continue;
    }
    std::span<const std::byte> bytes = archive.bytes(*entry);
    CUDA_RETURN_IF_ERROR(cudaMemcpy(impl->weights + weight->offset(), bytes.data(), bytes.size(),
                                    cudaMemcpyHostToDevice),
                         "upload of '" + weight->name()->str() + "'");
  }
  if (generation.deviceBytes > 0) {
    CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "generating synthetic weights");
    generation.deviceSeconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - generationStart).count();
  }
  lap(timings.weightsSeconds);

  // Placement, scratch sizes and fp32 copies of the small weights the GPU kernels read.
  std::vector<int32_t> cpuStepWeights;
  int32_t maxStreams = 1, maxEvents = 0;
  int64_t maxRows = 1;
  for (const fb::Program *program : impl->programs)
    maxRows = std::max<int64_t>(maxRows, program->max_tokens());
  HYBRID_RETURN_IF_ERROR(impl->planKvLayers(plan, kvCache, options, maxRows));
  HYBRID_RETURN_IF_ERROR(impl->prepareContextParallel(options, maxRows).withContext(
      dir + ": context parallelism"));
  lap(timings.kvPoolsSeconds);
  std::string report;
  std::map<int32_t, ScratchSizes> streamNeeds; // by the plan's stream index
  ScratchSizes streamZeroNeeds, expertStreamNeeds;
  for (const fb::Program *program : impl->programs) {
    const int64_t rows = std::max<int64_t>(1, program->max_tokens());
    std::vector<const fb::Dispatch *> &kvWriters = impl->kvWriters.emplace_back();
    maxStreams = std::max(maxStreams, program->num_streams());
    maxEvents = std::max(maxEvents, program->num_events());
    std::map<std::string, int> gpu, cpuKernels;
    for (const fb::Step *step : *program->steps()) {
      const fb::Dispatch *d = step->op_as_Dispatch();
      if (!d)
        return Status::error(dir + "/plan.hyplan: program '" + program->name()->str() +
                             "' has a step the cuda device does not run");
      auto width = [&](int32_t value) { return valueOf(*program, value).row_elements(); };
      if (isCollective(*d))
        HYBRID_RETURN_IF_ERROR(impl->checkCollective(*program, *d).withContext(
            dir + ": program '" + program->name()->str() + "', " + kernelName(d->kernel()) +
            " (layer " + std::to_string(d->layer()) + ")"));
      if (!impl->runsOnGpu(*d)) {
        // The cpu reference exchanges host buffers: an all_to_all whose experts the GPU forms
        // cannot run has no path with a device-buffer communicator.
        if (const fb::MoeParams *moe = d->params_as_MoeParams();
            moe && moe->all_to_all() && options.communicator &&
            options.communicator->deviceBuffers()) {
          const fb::Target *target = plan.target();
          return Status::error(
              dir + ": cp=" + std::to_string(target ? target->context_parallel() : 0) + ",ep=" +
              std::to_string(target ? target->expert_parallel() : 0) + ": program '" +
              program->name()->str() + "', moe_experts (layer " + std::to_string(d->layer()) +
              "): the expert all-to-all over " + options.communicator->backend() +
              " runs on the GPU MoE forms only (bf16 or FP8 block-scaled row-major experts, "
              "SiLU or SiTU), which these experts do not fit");
        }
        impl->onCpu.insert(d);
        ++cpuKernels[kernelName(d->kernel())];
        if (d->weights())
          for (int32_t index : *d->weights())
            if (index >= 0)
              cpuStepWeights.push_back(index);
        continue;
      }
      ++gpu[kernelName(d->kernel())];
      impl->prepared = {}; // this dispatch's needs, folded into its stream's below
      if (d->weights())
        for (int32_t index : *d->weights())
          if (index >= 0 && impl->fp8GemmWeight(index))
            HYBRID_RETURN_IF_ERROR(impl->prepareFp8Weight(index, rows, hostWeights));
      if (d->kernel() == fb::KernelId::KdaChunkPrefill ||
          d->kernel() == fb::KernelId::KdaContextSummary ||
          d->kernel() == fb::KernelId::KdaRecurrentDecode)
        impl->gpuStateLayers.insert(d->params_as_KdaParams()->state_slot());
      auto role = [&](int index) { return d->weights()->Get(index); };
      size_t floats = 0, xWidth = 0, outWidth = 0;
      int64_t gemmRows = rows; // the rows of the dispatch's largest GEMM
      switch (d->kernel()) {
      case fb::KernelId::RmsNorm:
      case fb::KernelId::AddRmsNorm:
        HYBRID_RETURN_IF_ERROR(impl->uploadSmallWeight(roleOf(*d, 0), hostWeights));
        break;
      case fb::KernelId::Linear:
      case fb::KernelId::LmHead:
        xWidth = width(d->inputs()->Get(0));
        outWidth = width(d->outputs()->Get(0));
        gemmRows = Impl::gemmChunkRows(rows, static_cast<int64_t>(outWidth));
        if (d->inputs()->size() == 2) { // gathered into scratch first
          xWidth += width(d->inputs()->Get(1));
          floats = static_cast<size_t>(rows) * xWidth;
        }
        break;
      case fb::KernelId::Mlp: {
        const int64_t inner = impl->weightRows(role(0));
        floats = static_cast<size_t>(rows * 3 * inner + 64);
        xWidth = outWidth = std::max<size_t>(width(d->inputs()->Get(0)), inner);
        break;
      }
      case fb::KernelId::KdaChunkPrefill:
      case fb::KernelId::KdaContextSummary:
      case fb::KernelId::KdaRecurrentDecode: {
        const fb::KdaParams *p = d->params_as_KdaParams();
        const int64_t H = p->num_heads(), P = H * p->head_dim(), W = p->conv_kernel();
        const int64_t rankF = impl->weightRows(role(FA));
        const int64_t rankG = role(G) >= 0 ? 0 : impl->weightRows(role(GA));
        floats = static_cast<size_t>(rows * (3 * P + P + H + P + P + rankF + rankG) +
                                     7 * 64); // each part 256-byte aligned
        xWidth = outWidth = std::max<size_t>({static_cast<size_t>(width(d->inputs()->Get(0))),
                                              static_cast<size_t>(P), static_cast<size_t>(rankF),
                                              static_cast<size_t>(rankG)});
        for (int small : {ALog, DtBias, ONorm})
          HYBRID_RETURN_IF_ERROR(impl->uploadSmallWeight(role(small), hostWeights));
        std::vector<float> taps;
        for (int conv : {QConv, KConv, VConv}) {
          HYBRID_ASSIGN_OR_RETURN(const std::vector<float> *converted, hostWeights(role(conv)));
          const std::vector<float> &source = *converted;
          if (static_cast<int64_t>(source.size()) != P * W)
            return Status::error("weight '" +
                                 plan.weights()->Get(role(conv))->name()->str() + "' has " +
                                 std::to_string(source.size()) + " values, expected " +
                                 std::to_string(P * W) + " conv taps");
          taps.insert(taps.end(), source.begin(), source.end());
        }
        HYBRID_RETURN_IF_ERROR(uploadFloats(taps, impl->kdaConvTaps[d], "KDA conv taps"));
        kc::KdaPrefillParams prefill;
        prefill.sequences = 1;
        prefill.heads = static_cast<int32_t>(H);
        prefill.headDim = p->head_dim();
        prefill.tokens = static_cast<int32_t>(rows);
        prefill.path = impl->kdaPrefillPath;
        kc::KdaDecodeParams step;
        step.batch = static_cast<int32_t>(rows);
        step.heads = static_cast<int32_t>(H);
        step.headDim = p->head_dim();
        // A decode step may run the split path at any batch (a tuned kda-decode path, looked
        // up at run time): its workspace, which is at least the Auto choice's.
        if (d->kernel() == fb::KernelId::KdaRecurrentDecode)
          step.path = kc::KdaDecodePath::Split;
        impl->prepared.kdaWorkspaceBytes =
            std::max({impl->prepared.kdaWorkspaceBytes, kc::kdaPrefillWorkspaceBytes(prefill),
                      kc::kdaDecodeWorkspaceBytes(step)});
        if (d->kernel() == fb::KernelId::KdaContextSummary || d->inputs()->size() == 3)
          impl->kdaContextScratch(*d, rows, floats, impl->prepared.kdaWorkspaceBytes);
        break;
      }
      case fb::KernelId::AllGatherRows: { // this rank's rows out, every context rank's in
        const fb::Value &input = valueOf(*program, d->inputs()->Get(0));
        const fb::CollectiveParams *params = d->params_as_CollectiveParams();
        const int cp = impl->contextParallel;
        const int64_t slots = input.rows() == fb::ValueRows::ContextChunks ? 2
                              : params && params->tail_rows() > 0
                                  ? 2 * int64_t(params->tail_rows())
                                  : 2 * ((rows + 2 * cp - 1) / (2 * cp)); // two chunks' rows
        floats = static_cast<size_t>(
            Impl::gatherScratchFloats(cp, slots, input.row_elements()));
        break;
      }
      case fb::KernelId::MlaCacheRows: {
        const fb::MlaParams *p = d->params_as_MlaParams();
        const int64_t rkv = p->kv_lora_rank(), dr = p->qk_rope_head_dim();
        HYBRID_RETURN_IF_ERROR(impl->uploadSmallWeight(roleOf(*d, 1), hostWeights));
        if (p->rope() && p->rope()->kind() != fb::RopeKind::None && dr > 0 &&
            !impl->ropeFrequencies.count(d))
          HYBRID_RETURN_IF_ERROR(uploadFloats(cpu::ropeFrequencies(p->rope(), dr),
                                              impl->ropeFrequencies[d], "RoPE frequencies"));
        floats = static_cast<size_t>(pad(rows * (rkv + dr)) + pad(rows * rkv) + pad(rows * dr));
        xWidth = width(d->inputs()->Get(0));
        outWidth = static_cast<size_t>(rkv + dr);
        break;
      }
      case fb::KernelId::AttnRes:
      case fb::KernelId::AttnResRmsNorm:
        for (int32_t index : *d->weights())
          HYBRID_RETURN_IF_ERROR(impl->uploadSmallWeight(index, hostWeights));
        break;
      case fb::KernelId::RouterTopK:
      case fb::KernelId::MoeExperts:
        HYBRID_RETURN_IF_ERROR(
            impl->prepareMoe(*d, *program, rows, program == impl->programs[Impl::kDecode],
                             hostWeights, floats, xWidth, outWidth)
                .withContext(kernelName(d->kernel()) + " (layer " + std::to_string(d->layer()) +
                             ")"));
        if (d->kernel() == fb::KernelId::MoeExperts && d->params_as_MoeParams()->all_to_all())
          HYBRID_RETURN_IF_ERROR(impl->prepareMoeAllToAll(*d, rows).withContext(
              dir + ": program '" + program->name()->str() + "', moe_experts (layer " +
              std::to_string(d->layer()) + ")"));
        break;
      default:
        if (!impl->attentionRunsOnGpu(*d))
          break; // Embed, Add: nothing to prepare
        HYBRID_RETURN_IF_ERROR(
            impl->prepareAttention(*d, *program, rows, hostWeights, floats, xWidth, outWidth)
                .withContext(kernelName(d->kernel()) + " (layer " + std::to_string(d->layer()) +
                             ")"));
        if (d->params_as_MlaParams())
          kvWriters.push_back(d);
        break;
      }
      ScratchSizes &needs = impl->prepared;
      needs.scratchFloats = std::max(needs.scratchFloats, floats);
      needs.xBf16Elements = std::max(needs.xBf16Elements, static_cast<size_t>(gemmRows) * xWidth);
      needs.gemmOutputs = std::max(needs.gemmOutputs, static_cast<size_t>(gemmRows) * outWidth);
      streamNeeds[std::max(0, d->stream())].include(needs);
      // A rollback replays KDA prefills on stream 0 (replayKdaLog); an expert exchange runs
      // its chunks' experts on the expert stream (CudaMoeAllToAll.cpp).
      if (d->kernel() == fb::KernelId::KdaChunkPrefill ||
          d->kernel() == fb::KernelId::KdaContextSummary ||
          d->kernel() == fb::KernelId::KdaRecurrentDecode)
        streamZeroNeeds.include(needs);
      if (d->kernel() == fb::KernelId::MoeExperts && d->params_as_MoeParams()->all_to_all())
        expertStreamNeeds.include(needs);
    }
    std::vector<StepRun> &runs = impl->runs.emplace_back();
    for (size_t i = 0; i < program->steps()->size(); ++i) {
      const bool gpu = !impl->onCpu.count(
          program->steps()->Get(static_cast<flatbuffers::uoffset_t>(i))->op_as_Dispatch());
      if (runs.empty() || runs.back().gpu != gpu)
        runs.push_back({i, i, gpu});
      runs.back().end = i + 1;
    }
    auto list = [](const std::map<std::string, int> &kernels) {
      std::string text;
      for (const auto &[name, count] : kernels)
        text += (text.empty() ? "" : ", ") + name + " x" + std::to_string(count);
      return text.empty() ? std::string("none") : text;
    };
    report += "cuda " + program->name()->str() + ": GPU: " + list(gpu) +
              "; cpu reference: " + list(cpuKernels) + "\n";
  }
  if (impl->batchInvariant) {
    std::string layers;
    for (int32_t layer : impl->batchVariantLayers)
      layers += (layers.empty() ? "" : ", ") + std::to_string(layer);
    report += layers.empty() ? "cuda batch invariance: every layer\n"
                             : "cuda batch invariance: not the MoE experts of layers " + layers +
                                   " (FP8 or not multiples of 64: their form follows the step's "
                                   "(token, expert) pairs)\n";
  }

  lap(timings.kernelSetupSeconds);

  // One allocation: the arenas, the state mirror, then per stream its scratch.
  size_t bytes = 0;
  std::vector<size_t> arenaOffsets;
  for (const fb::Program *program : impl->programs) {
    arenaOffsets.push_back(bytes);
    bytes += alignUp(std::max<uint64_t>(1, program->arena_bytes()));
  }
  impl->stateType = options.kdaBf16State ? kc::KdaStateType::BF16 : kc::KdaStateType::F32;
  const uint64_t stateElementBytes = options.kdaBf16State ? 2 : sizeof(float);
  for (int32_t layer = 0; layer < states.numLayers(); ++layer) {
    const RecurrentLayerShape &shape = states.layerShape(layer);
    impl->layerStateBytes.push_back(impl->slotStateBytes);
    impl->slotStateBytes += alignUp(static_cast<uint64_t>(shape.stateElements()) * stateElementBytes);
    impl->layerConvFloats.push_back(impl->slotConvFloats);
    impl->slotConvFloats += alignUp(static_cast<uint64_t>(shape.convStateElements()) * 4) / 4;
  }
  const uint64_t numSlots = static_cast<uint64_t>(states.numSlots());
  const size_t stateRegionOffset = bytes;
  bytes += alignUp(std::max<uint64_t>(1, impl->slotStateBytes * numSlots));
  const size_t convRegionOffset = bytes;
  bytes += alignUp(std::max<uint64_t>(1, impl->slotConvFloats * numSlots) * sizeof(float));
  const size_t rowSlotsOffset = bytes;
  bytes += alignUp(static_cast<size_t>(maxRows) * sizeof(int32_t));
  const size_t cuSeqlensOffset = bytes; // a pair per segment: at most one segment per row
  bytes += alignUp(2 * static_cast<size_t>(maxRows) * sizeof(int32_t));
  const size_t halves = impl->splitGemmInputs ? 2 : 1;
  // Each stream's region holds what its own dispatches need (streamOf: the plan's index modulo
  // the streams), then the expert stream of an all_to_all exchange (CudaMoeAllToAll.cpp).
  const size_t poolStreams = static_cast<size_t>(maxStreams) + (impl->needsExpertStream ? 1 : 0);
  std::vector<ScratchSizes> streamSizes(poolStreams);
  for (const auto &[stream, needs] : streamNeeds)
    streamSizes[static_cast<size_t>(stream % maxStreams)].include(needs);
  streamSizes[0].include(streamZeroNeeds);
  if (impl->needsExpertStream)
    streamSizes.back().include(expertStreamNeeds);
  // A stream region's parts in order, each 256-byte aligned: bf16 GEMM operands, split
  // products, scratch, KDA workspace, FP8 scratch, attention workspace (sized and carved alike).
  auto regionParts = [halves](const ScratchSizes &z) {
    return std::array<size_t, 6>{alignUp(std::max<size_t>(1, z.xBf16Elements) * 2 * halves),
                                 alignUp(std::max<size_t>(1, z.gemmOutputs) * 4 * halves),
                                 alignUp(std::max<size_t>(1, z.scratchFloats) * sizeof(float)),
                                 alignUp(std::max<size_t>(1, z.kdaWorkspaceBytes)),
                                 alignUp(std::max<size_t>(1, z.fp8ScratchBytes)),
                                 alignUp(std::max<size_t>(1, z.attentionWorkspaceBytes))};
  };
  auto regionBytes = [&](const ScratchSizes &z) {
    const std::array<size_t, 6> parts = regionParts(z);
    return std::accumulate(parts.begin(), parts.end(), size_t{0});
  };
  const size_t streamsOffset = bytes;
  std::vector<size_t> streamOffsets;
  for (const ScratchSizes &z : streamSizes) {
    streamOffsets.push_back(bytes);
    bytes += regionBytes(z);
  }
  // What the bytes are, so that an out-of-memory error says which part grew.
  auto gb = [](size_t part) {
    char text[32];
    std::snprintf(text, sizeof text, "%.2f GB", double(part) / 1e9);
    return std::string(text);
  };
  std::string poolParts = std::to_string(bytes) + " bytes: arenas " + gb(stateRegionOffset) +
                          ", recurrent states " + gb(streamsOffset - stateRegionOffset);
  for (size_t s = 0; s < poolStreams; ++s) {
    const std::array<size_t, 6> parts = regionParts(streamSizes[s]);
    poolParts += ", " +
                 std::string(s == static_cast<size_t>(maxStreams) ? "expert stream " : "stream ") +
                 (s == static_cast<size_t>(maxStreams) ? "" : std::to_string(s) + " ") +
                 gb(regionBytes(streamSizes[s])) + " (gemm operands " + gb(parts[0] + parts[1]) +
                 ", scratch " + gb(parts[2]) + ", KDA workspace " + gb(parts[3]) +
                 ", FP8 scratch " + gb(parts[4]) + ", attention workspace " + gb(parts[5]) + ")";
  }
  CUDA_RETURN_IF_ERROR(cudaMalloc(&impl->pool, bytes), "device pools (" + poolParts + ")");
  report += "cuda device pools: " + poolParts + "\n";
  CUDA_RETURN_IF_ERROR(cudaMemset(impl->pool, 0, bytes), "device pools");
  for (size_t offset : arenaOffsets)
    impl->arenas.push_back(impl->pool + offset);
  impl->stateRegion = impl->pool + stateRegionOffset;
  impl->convRegion = reinterpret_cast<float *>(impl->pool + convRegionOffset);
  impl->rowSlots = reinterpret_cast<int32_t *>(impl->pool + rowSlotsOffset);
  impl->cuSeqlens = reinterpret_cast<int32_t *>(impl->pool + cuSeqlensOffset);
  lap(timings.devicePoolsSeconds);

  for (size_t s = 0; s < poolStreams; ++s) {
    const bool expertStream = s == static_cast<size_t>(maxStreams);
    auto resources = std::make_unique<StreamResources>();
    StreamResources &r = *resources;
    if (expertStream)
      impl->expertStream = std::move(resources);
    else
      impl->streams.push_back(std::move(resources));
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking), "streams");
    LAUNCH_RETURN_IF_ERROR(r.linear.init(), "cuBLASLt");
    if (impl->batchInvariant) {
      r.linear.setBatchInvariantRows(Impl::kBatchInvariantReferenceRows);
      r.linear.setDecodeKernel(false);
    }
    r.sizes = streamSizes[s];
    const std::array<size_t, 6> parts = regionParts(r.sizes);
    unsigned char *part[6];
    part[0] = impl->pool + streamOffsets[s];
    for (size_t i = 1; i < parts.size(); ++i)
      part[i] = part[i - 1] + parts[i - 1];
    r.xBf16 = part[0];
    r.splitOutput = reinterpret_cast<float *>(part[1]);
    r.scratch = reinterpret_cast<float *>(part[2]);
    r.kdaWorkspace = part[3];
    r.fp8Scratch = part[4];
    r.attentionWorkspace = part[5];
  }
  impl->events.resize(static_cast<size_t>(maxEvents));
  impl->joinEvents.resize(static_cast<size_t>(maxStreams));
  for (cudaEvent_t &event : impl->events)
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "events");
  for (cudaEvent_t &event : impl->joinEvents)
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "events");
  if (impl->needsExpertStream)
    for (cudaEvent_t *event : {&impl->chunkReceived[0], &impl->chunkReceived[1],
                               &impl->chunkComputed[0], &impl->chunkComputed[1]})
      CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(event, cudaEventDisableTiming), "events");
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&impl->forkEvent, cudaEventDisableTiming),
                       "events");
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&impl->uploadsIssued, cudaEventDisableTiming),
                       "events");
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&impl->pinnedTokens,
                                      static_cast<size_t>(maxRows) * sizeof(int64_t)),
                       "pinned token buffer");
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&impl->pinnedCuSeqlens,
                                      2 * static_cast<size_t>(maxRows) * sizeof(int32_t)),
                       "pinned cu_seqlens");
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&impl->pinnedSlots,
                                      static_cast<size_t>(maxRows) * sizeof(int32_t)),
                       "pinned slot buffer");
  const size_t choiceRows = static_cast<size_t>(std::max<int64_t>(1, maxRows));
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&impl->pinnedChoices, choiceRows * sizeof(kc::SamplingRow)),
                       "token choice buffers");
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&impl->pinnedChosen, choiceRows * sizeof(int64_t)),
                       "token choice buffers");
  CUDA_RETURN_IF_ERROR(cudaMalloc(&impl->deviceChoices, choiceRows * sizeof(kc::SamplingRow)),
                       "token choice buffers");
  CUDA_RETURN_IF_ERROR(cudaMalloc(&impl->deviceChosen, choiceRows * sizeof(int64_t)),
                       "token choice buffers");
  // The argmax parts of the widest logits a choosing run (decode or prefill) may read.
  int64_t logitsWidth = 0;
  for (const size_t index : {Impl::kPrefill, Impl::kDecode}) {
    const fb::Program &program = *impl->programs[index];
    logitsWidth = std::max(logitsWidth, valueOf(program, program.logits()).row_elements());
  }
  impl->sampleWorkspaceBytes =
      kc::sampleRowsWorkspaceBytes(static_cast<int64_t>(choiceRows), logitsWidth);
  CUDA_RETURN_IF_ERROR(cudaMalloc(&impl->sampleWorkspace, impl->sampleWorkspaceBytes),
                       "token choice buffers");
  lap(timings.streamsSeconds);
  auto executor = std::unique_ptr<CudaExecutor>(new CudaExecutor(std::move(impl)));
  executor->report_ = std::move(report);
  std::sort(cpuStepWeights.begin(), cpuStepWeights.end());
  cpuStepWeights.erase(std::unique(cpuStepWeights.begin(), cpuStepWeights.end()),
                       cpuStepWeights.end());
  executor->cpuStepWeights_ = std::move(cpuStepWeights);
  executor->generation_ = generation;
  return executor;
}

CudaExecutor::CudaExecutor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaExecutor::~CudaExecutor() = default;

Status CudaExecutor::resetSlot(int32_t slot) {
  const uint64_t index = static_cast<uint64_t>(slot);
  CUDA_RETURN_IF_ERROR(cudaMemset(impl_->stateRegion + index * impl_->slotStateBytes, 0,
                                  impl_->slotStateBytes),
                       "recurrent state reset");
  CUDA_RETURN_IF_ERROR(cudaMemset(impl_->convRegion + index * impl_->slotConvFloats, 0,
                                  impl_->slotConvFloats * sizeof(float)),
                       "conv state reset");
  return Status::ok();
}

Status CudaExecutor::Impl::launchRun(const fb::Program &program, unsigned char *arena,
                                     const StepRun &run, const cpu::StepContext &host,
                                     HiddenStates *hidden, bool capturing) {
  cudaStream_t origin = streams[0]->stream;
  CUDA_RETURN_IF_ERROR(cudaEventRecord(forkEvent, origin), "stream fork");
  for (size_t s = 1; s < streams.size(); ++s)
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(streams[s]->stream, forkEvent, 0), "stream fork");
  auto launchSteps = [&]() -> Status {
    std::set<int32_t> recorded;
    const auto *layerOutputs = program.layer_outputs();
    for (size_t i = run.begin; i < run.end; ++i) {
      const fb::Dispatch &d = *program.steps()->Get(static_cast<flatbuffers::uoffset_t>(i))->op_as_Dispatch();
      const std::string where =
          kernelName(d.kernel()) + " (layer " + std::to_string(d.layer()) + ")";
      StreamResources &r = streamOf(d);
      if (d.wait_events())
        for (int32_t event : *d.wait_events())
          if (!capturing || recorded.count(event))
            CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(r.stream, events.at(event), 0), where);
      // A context-parallel prefill: the dispatch's rows are its first output's. A rank without
      // rows (a prompt shorter than the chunks) skips its row-wise steps; the attention and KDA
      // steps still take the other ranks' rows into the caches and state.
      std::optional<cpu::StepContext> own;
      if (host.contextShard)
        own = dispatchContext(host, program, d);
      const cpu::StepContext &c = own ? *own : host;
      // An expert exchange needs every rank, rows or not (the others' rows may be for its
      // experts).
      const bool takesOthersRows = d.kernel() == fb::KernelId::KdaChunkPrefill ||
                                   d.kernel() == fb::KernelId::MlaPrefill ||
                                   d.kernel() == fb::KernelId::SparseMlaPrefill ||
                                   d.kernel() == fb::KernelId::DsaIndexer ||
                                   (d.kernel() == fb::KernelId::MoeExperts &&
                                    d.params_as_MoeParams()->all_to_all());
      if (c.rows > 0 || takesOthersRows)
        HYBRID_RETURN_IF_ERROR(runOnGpu(program, arena, d, r, c).withContext(where));
      if (d.signal_event() >= 0) {
        CUDA_RETURN_IF_ERROR(cudaEventRecord(events.at(d.signal_event()), r.stream), where);
        recorded.insert(d.signal_event());
      }
      if (cudaError_t status = cudaPeekAtLastError(); status != cudaSuccess)
        return cudaStatus(status, where);
      if (!hidden || !layerOutputs)
        continue;
      // The residual stream, right after the step that makes it (its slot is reused later).
      for (int32_t output : *d.outputs())
        for (size_t layer = 0; layer < layerOutputs->size(); ++layer) {
          if (layerOutputs->Get(layer) != output)
            continue;
          CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), where);
          const fb::Value &value = valueOf(program, output);
          if (host.contextShard) { // this rank's rows: every rank's, in position order
            HYBRID_ASSIGN_OR_RETURN(
                std::vector<float> all,
                gatherHiddenRows(host, reinterpret_cast<const float *>(arena + value.arena_offset()),
                                 value.row_elements()));
            hidden->layers[layer].insert(hidden->layers[layer].end(), all.begin(), all.end());
            continue;
          }
          std::vector<float> values(static_cast<size_t>(host.rows * value.row_elements()));
          CUDA_RETURN_IF_ERROR(cudaMemcpy(values.data(), arena + value.arena_offset(),
                                          values.size() * sizeof(float), cudaMemcpyDeviceToHost),
                               where);
          hidden->layers[layer].insert(hidden->layers[layer].end(), values.begin(), values.end());
        }
    }
    return Status::ok();
  };
  Status launched = launchSteps();
  // Joined even after a failure: a capture cannot end while a forked stream is left out.
  for (size_t s = 1; s < streams.size(); ++s) {
    CUDA_RETURN_IF_ERROR(cudaEventRecord(joinEvents[s], streams[s]->stream), "stream join");
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(origin, joinEvents[s], 0), "stream join");
  }
  return launched;
}

StatusOr<kc::SampleRowsParams> CudaExecutor::Impl::tokenChoiceOf(const fb::Program &program,
                                                                int64_t rows) const {
  kc::SampleRowsParams sample;
  sample.rows = static_cast<int32_t>(rows);
  sample.vocab = valueOf(program, program.logits()).row_elements();
  sample.logits = reinterpret_cast<const float *>(logitsOf(program));
  sample.samplingRows = deviceChoices;
  sample.tokens = deviceChosen;
  if (kc::sampleRowsWorkspaceBytes(rows, sample.vocab) > sampleWorkspaceBytes)
    return Status::error("token choice workspace larger than planned at load");
  sample.workspace = sampleWorkspace;
  return sample;
}

Status CudaExecutor::Impl::checkTokenIds(const cpu::StepContext &host,
                                         std::span<const int64_t> tokens) const {
  // The ids are on the host: checked here, with the cpu device's words.
  for (const fb::Step *step : *host.program->steps()) {
    const fb::Dispatch &d = *step->op_as_Dispatch();
    if (d.kernel() != fb::KernelId::Embed)
      continue;
    const int64_t vocab = weightRows(d.weights()->Get(0));
    for (size_t t = 0; t < tokens.size(); ++t)
      if (tokens[t] < 0 || tokens[t] >= vocab)
        return Status::error(kernelName(d.kernel()) + " (layer " + std::to_string(d.layer()) +
                             "): token id " + std::to_string(tokens[t]) + " at position " +
                             std::to_string(host.firstPosition + t) +
                             " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  }
  return Status::ok();
}

Status CudaExecutor::Impl::issueStagedUploads(cudaStream_t stream, bool markUploaded,
                                              bool capturing) {
  std::vector<StagedUpload> uploads = std::exchange(stagedUploads, {});
  for (const StagedUpload &u : uploads)
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(u.device, u.source, u.bytes, cudaMemcpyDefault, stream),
                         u.what);
  // Captured, an event the host can wait on is an external record node (a plain record inside a
  // capture only orders the graph's own streams).
  if (markUploaded)
    CUDA_RETURN_IF_ERROR(cudaEventRecordWithFlags(uploadsIssued, stream,
                                                  capturing ? cudaEventRecordExternal
                                                            : cudaEventRecordDefault),
                         "staged uploads");
  return Status::ok();
}

Status CudaExecutor::Impl::replayRun(const fb::Program &program, unsigned char *arena,
                                     size_t runIndex, const cpu::StepContext &host) {
  cudaStream_t origin = streams[0]->stream;
  std::vector<DecodeGraph> &bucket = decodeGraphs[std::make_tuple(runIndex, host.rows)];
  // A graph copies the staged inputs it was captured with (none past the first run): the same
  // buffers and sizes, or another graph is captured.
  auto found = std::find_if(bucket.begin(), bucket.end(), [&](const DecodeGraph &graph) {
    return graph.uploads == stagedUploads;
  });
  if (found == bucket.end()) {
    if (bucket.size() == kDecodeGraphsPerBucket) { // the oldest gives way
      cudaGraphExecDestroy(bucket.front().exec);
      bucket.erase(bucket.begin());
    }
    CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(origin, cudaStreamCaptureModeThreadLocal),
                         "decode graph capture");
    DecodeGraph captured{.exec = nullptr, .uploads = stagedUploads};
    // The first run's graph marks its copies done, for a chained step (runChoosingChained).
    Status launched = issueStagedUploads(origin, /*markUploaded=*/runIndex == 0, /*capturing=*/true);
    if (launched.ok())
      launched =
          launchRun(program, arena, runs[kDecode][runIndex], host, nullptr, /*capturing=*/true);
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(origin, &graph);
    if (!launched.ok()) {
      if (graph)
        cudaGraphDestroy(graph);
      return std::move(launched).withContext("while capturing a decode graph");
    }
    CUDA_RETURN_IF_ERROR(ended, "decode graph capture");
    const cudaError_t made = cudaGraphInstantiate(&captured.exec, graph, 0);
    cudaGraphDestroy(graph);
    CUDA_RETURN_IF_ERROR(made, "decode graph instantiation");
    bucket.push_back(std::move(captured));
    ++graphCounts.decodeCaptures;
    found = std::prev(bucket.end());
  }
  stagedUploads.clear(); // copied by the graph's first nodes
  CUDA_RETURN_IF_ERROR(cudaGraphLaunch(found->exec, origin), "decode graph launch");
  return Status::ok();
}

Status CudaExecutor::Impl::transferSlot(int32_t slot, RecurrentStatePool &pool,
                                        Direction direction) {
  if (!pool.isAllocated(slot))
    return Status::error("state slot " + std::to_string(slot) + " is not allocated");
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "before a state transfer");
  const bool bf16 = stateType == kc::KdaStateType::BF16;
  const uint64_t index = static_cast<uint64_t>(slot);
  for (int32_t layer : gpuStateLayers) {
    HYBRID_ASSIGN_OR_RETURN(std::span<float> state, pool.state(layer, slot));
    HYBRID_ASSIGN_OR_RETURN(std::span<float> conv, pool.convState(layer, slot));
    unsigned char *deviceState = stateRegion + index * slotStateBytes +
                                 layerStateBytes[static_cast<size_t>(layer)];
    float *deviceConv = convRegion + index * slotConvFloats + layerConvFloats[static_cast<size_t>(layer)];
    const bool down = direction == Direction::Down;
    auto transfer = [&](void *device, void *host, size_t bytes, const char *what) {
      return cudaStatus(down ? cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost)
                             : cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice),
                        what);
    };
    HYBRID_RETURN_IF_ERROR(transfer(deviceConv, conv.data(), conv.size_bytes(),
                                    down ? "conv state download" : "conv state upload"));
    if (!bf16) {
      HYBRID_RETURN_IF_ERROR(transfer(deviceState, state.data(), state.size_bytes(),
                                      down ? "state download" : "state upload"));
      continue;
    }
    // bf16 on the device: widened exactly on the way down, rounded to nearest even on the way up.
    std::vector<uint16_t> bits(state.size());
    if (!down)
      std::transform(state.begin(), state.end(), bits.begin(), kernels::ref::floatToBf16);
    HYBRID_RETURN_IF_ERROR(transfer(deviceState, bits.data(), bits.size() * sizeof(uint16_t),
                                    down ? "state download" : "state upload"));
    if (down)
      std::transform(bits.begin(), bits.end(), state.begin(), kernels::ref::bf16ToFloat);
  }
  return Status::ok();
}

Status CudaExecutor::replayKdaLog(int32_t slot, int64_t tokens, int64_t firstRow) {
  Impl &impl = *impl_;
  if (tokens < 0 || firstRow < 0 || firstRow + tokens > impl.kdaLogRows)
    return Status::error("KDA replay of rows [" + std::to_string(firstRow) + ", " +
                         std::to_string(firstRow + tokens) + ") from a step of " +
                         std::to_string(impl.kdaLogRows));
  if (tokens == 0 || impl.kdaLogUsed == 0)
    return Status::ok();
  StreamResources &r = *impl.streams[0];
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "before a KDA replay");
  const int64_t segment[1] = {tokens};
  HYBRID_RETURN_IF_ERROR(impl.uploadCuSeqlens(segment));
  for (size_t i = 0; i < impl.kdaLogUsed; ++i) {
    const Impl::LoggedKda &entry = impl.kdaLog[i];
    const fb::KdaParams *p = entry.dispatch->params_as_KdaParams();
    const int64_t H = p->num_heads(), P = H * p->head_dim();
    kc::KdaPrefillParams prefill;
    static_cast<kc::KdaLayerCall &>(prefill) = impl.layerCall(*entry.dispatch, slot);
    // Rows are contiguous: a segment's first `tokens` rows are one run of each input.
    prefill.qkv = entry.qkv + firstRow * 3 * P;
    prefill.forget = entry.forget + firstRow * P;
    prefill.betaLogits = entry.beta + firstRow * H;
    prefill.outputGate = entry.gate + firstRow * P;
    prefill.out = entry.out + firstRow * P;
    prefill.sequences = 1;
    prefill.cuSeqlens = impl.cuSeqlens;
    prefill.tokens = static_cast<int32_t>(tokens);
    prefill.workspace = r.kdaWorkspace;
    prefill.path = impl.kdaPrefillPath;
    if (kc::kdaPrefillWorkspaceBytes(prefill) > r.sizes.kdaWorkspaceBytes)
      return Status::error("KDA replay workspace larger than planned at load");
    LAUNCH_RETURN_IF_ERROR(kc::launchKdaPrefill(prefill, r.stream), "KDA replay");
  }
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "KDA replay");
  return Status::ok();
}

Status CudaExecutor::downloadSlot(int32_t slot, RecurrentStatePool &pool) {
  return impl_->transferSlot(slot, pool, Impl::Direction::Down);
}

Status CudaExecutor::uploadSlot(int32_t slot, RecurrentStatePool &pool) {
  return impl_->transferSlot(slot, pool, Impl::Direction::Up);
}

const unsigned char *CudaExecutor::Impl::logitsOf(const fb::Program &program) const {
  return arenas[indexOf(program)] + valueOf(program, program.logits()).arena_offset();
}

float *CudaExecutor::Impl::finalHiddenOf(const fb::Program &program) const {
  const auto *outputs = program.layer_outputs();
  const size_t index = indexOf(program);
  if (!outputs || outputs->size() == 0 || index >= arenas.size())
    return nullptr;
  return reinterpret_cast<float *>(
      arenas[index] + valueOf(program, outputs->Get(outputs->size() - 1)).arena_offset());
}

StatusOr<float *> CudaExecutor::Impl::recordRows(int32_t record, int64_t rows, int64_t keep) {
  HiddenRecord &entry = hiddenRecords[record];
  if (rows <= entry.capacity)
    return entry.rows;
  // Grown geometrically: a record holds a prompt's rows at most, then a few per step.
  const int64_t capacity = std::max({rows, 2 * entry.capacity, int64_t{64}});
  float *grown = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&grown, static_cast<size_t>(capacity * hiddenWidth) *
                                              sizeof(float)),
                       "hidden-state record (" + std::to_string(capacity) + " rows)");
  if (keep > 0)
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(grown, entry.rows,
                                         static_cast<size_t>(keep * hiddenWidth) * sizeof(float),
                                         cudaMemcpyDeviceToDevice, streams[0]->stream),
                         "hidden-state record");
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(streams[0]->stream), "hidden-state record");
  cudaFree(entry.rows);
  entry.rows = grown;
  entry.capacity = capacity;
  return grown;
}

Status CudaExecutor::recordFinalHidden(const fb::Program &program, int64_t srcRow, int64_t rows,
                                       int32_t record, int64_t destRow) {
  Impl &impl = *impl_;
  const float *source = impl.finalHiddenOf(program);
  if (!source)
    return Status::error("cuda device: program '" + program.name()->str() +
                         "' has no final hidden state to record");
  if (srcRow < 0 || rows < 0 || destRow < 0 || srcRow + rows > std::max<int64_t>(1, program.max_tokens()))
    return Status::error("cuda device: rows [" + std::to_string(srcRow) + ", " +
                         std::to_string(srcRow + rows) + ") of program '" +
                         program.name()->str() + "' do not exist");
  HYBRID_ASSIGN_OR_RETURN(float *rowsOut, impl.recordRows(record, destRow + rows, destRow));
  const auto width = static_cast<size_t>(impl.hiddenWidth);
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(rowsOut + static_cast<size_t>(destRow) * width,
                                       source + static_cast<size_t>(srcRow) * width,
                                       static_cast<size_t>(rows) * width * sizeof(float),
                                       cudaMemcpyDeviceToDevice, impl.streams[0]->stream),
                       "hidden-state record");
  return Status::ok();
}

namespace {

// The hidden_input slot of `program` in `arena`, checked for `rows` rows.
StatusOr<float *> hiddenInputSlot(const fb::Program &program, unsigned char *arena,
                                  int64_t rows) {
  if (program.hidden_input() < 0)
    return Status::error("cuda device: program '" + program.name()->str() +
                         "' has no hidden_input");
  if (rows < 1 || rows > std::max<int64_t>(1, program.max_tokens()))
    return Status::error("cuda device: " + std::to_string(rows) + " hidden rows for program '" +
                         program.name()->str() + "', it takes 1 to " +
                         std::to_string(program.max_tokens()));
  return reinterpret_cast<float *>(arena +
                                   valueOf(program, program.hidden_input()).arena_offset());
}

} // namespace

Status CudaExecutor::setHiddenInput(const fb::Program &program, int32_t record, int64_t first,
                                    int64_t rows) {
  Impl &impl = *impl_;
  const size_t index = impl.indexOf(program);
  if (index >= impl.arenas.size())
    return Status::error("cuda device: program '" + program.name()->str() + "' is not loaded");
  HYBRID_ASSIGN_OR_RETURN(float *slot, hiddenInputSlot(program, impl.arenas[index], rows));
  const auto found = impl.hiddenRecords.find(record);
  if (found == impl.hiddenRecords.end() || first < 0 || first + rows > found->second.capacity)
    return Status::error("cuda device: hidden-state record " + std::to_string(record) +
                         " holds no rows [" + std::to_string(first) + ", " +
                         std::to_string(first + rows) + ")");
  const auto width = static_cast<size_t>(impl.hiddenWidth);
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot, found->second.rows + static_cast<size_t>(first) * width,
                                       static_cast<size_t>(rows) * width * sizeof(float),
                                       cudaMemcpyDeviceToDevice, impl.streams[0]->stream),
                       "hidden input");
  return Status::ok();
}

Status CudaExecutor::setHiddenInput(const fb::Program &program, const float *hostRows,
                                    int64_t rows) {
  Impl &impl = *impl_;
  const size_t index = impl.indexOf(program);
  if (index >= impl.arenas.size())
    return Status::error("cuda device: program '" + program.name()->str() + "' is not loaded");
  HYBRID_ASSIGN_OR_RETURN(float *slot, hiddenInputSlot(program, impl.arenas[index], rows));
  // Waited for: the host rows need not outlive the call, and a pageable copy on the legacy
  // stream could still be landing when the plan's (non-blocking) streams read the slot.
  cudaStream_t stream = impl.streams[0]->stream;
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot, hostRows,
                                       static_cast<size_t>(rows * impl.hiddenWidth) * sizeof(float),
                                       cudaMemcpyHostToDevice, stream),
                       "hidden input upload");
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "hidden input upload");
  return Status::ok();
}

Status CudaExecutor::downloadRecord(int32_t record, int64_t first, int64_t rows, float *out) {
  Impl &impl = *impl_;
  const auto found = impl.hiddenRecords.find(record);
  if (rows == 0)
    return Status::ok();
  if (found == impl.hiddenRecords.end() || first < 0 || rows < 0 ||
      first + rows > found->second.capacity)
    return Status::error("cuda device: hidden-state record " + std::to_string(record) +
                         " holds no rows [" + std::to_string(first) + ", " +
                         std::to_string(first + rows) + ")");
  const auto width = static_cast<size_t>(impl.hiddenWidth);
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(impl.streams[0]->stream), "hidden-state record");
  CUDA_RETURN_IF_ERROR(cudaMemcpy(out, found->second.rows + static_cast<size_t>(first) * width,
                                  static_cast<size_t>(rows) * width * sizeof(float),
                                  cudaMemcpyDeviceToHost),
                       "hidden-state record download");
  return Status::ok();
}

Status CudaExecutor::downloadFinalHidden(const fb::Program &program, int64_t rows, float *out) {
  const float *source = impl_->finalHiddenOf(program);
  if (!source)
    return Status::error("cuda device: program '" + program.name()->str() +
                         "' has no final hidden state");
  CUDA_RETURN_IF_ERROR(cudaMemcpy(out, source,
                                  static_cast<size_t>(rows * impl_->hiddenWidth) * sizeof(float),
                                  cudaMemcpyDeviceToHost),
                       "final hidden state download");
  return Status::ok();
}

Status CudaExecutor::run(const cpu::StepContext &host, std::span<const int64_t> tokens,
                         float *logitsOut, HiddenStates *hidden,
                         std::span<const int64_t> logitRows) {
  HYBRID_RETURN_IF_ERROR(runProgram(host, tokens, hidden));
  const fb::Program &program = *host.program;
  const fb::Value &logits = valueOf(program, program.logits());
  // A context-parallel prefill's logits are every rank's rows (gathered before the LM head).
  const int64_t rows = cpu::valueRows(host, logits);
  const size_t rowBytes = valueBytes(logits, 1);
  if (logitRows.empty()) {
    CUDA_RETURN_IF_ERROR(cudaMemcpy(logitsOut, impl_->logitsOf(program), valueBytes(logits, rows),
                                    cudaMemcpyDeviceToHost),
                         "logits download");
    return Status::ok();
  }
  // Rows apart (each segment's last of a batched prefill): one strided copy.
  for (size_t i = 1; i < logitRows.size(); ++i)
    if (logitRows[i] <= logitRows[i - 1] || logitRows[i] >= rows)
      return Status::error("logits rows must ascend within the step's " + std::to_string(rows));
  for (size_t i = 0; i < logitRows.size(); ++i)
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(reinterpret_cast<unsigned char *>(logitsOut) + i * rowBytes,
                                         impl_->logitsOf(program) + logitRows[i] * rowBytes,
                                         rowBytes, cudaMemcpyDeviceToHost,
                                         impl_->streams[0]->stream),
                         "logits download");
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(impl_->streams[0]->stream), "logits download");
  return Status::ok();
}

Status CudaExecutor::runChoosing(const cpu::StepContext &host, std::span<const int64_t> tokens,
                                 std::span<const TokenChoice> choices, int64_t *chosen) {
  Impl &impl = *impl_;
  const fb::Program &program = *host.program;
  const int64_t rows = host.rows;
  const size_t programIndex = impl.indexOf(program);
  if (static_cast<int64_t>(choices.size()) != rows || host.contextShard ||
      (programIndex != Impl::kDecode && programIndex != Impl::kPrefill))
    return Status::error("cuda device: a choosing run is a decode step or a prefill (not context "
                         "parallel) with one choice per row (" +
                         std::to_string(choices.size()) + " choices for " + std::to_string(rows) +
                         " rows of program '" + program.name()->str() + "')");
  HYBRID_ASSIGN_OR_RETURN(const kc::SampleRowsParams sample, impl.tokenChoiceOf(program, rows));
  // Queued behind the step on stream 0 (where each GPU run joins its streams), so the choice
  // starts as the LM head ends: one host round trip a step, not two.
  HYBRID_RETURN_IF_ERROR(enqueueProgram(host, tokens, nullptr));
  for (size_t i = 0; i < choices.size(); ++i)
    impl.pinnedChoices[i] = {choices[i].params.temperature, choices[i].params.topK,
                             choices[i].params.topP, choices[i].uniform};
  const cudaStream_t stream = impl.streams[0]->stream;
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(impl.deviceChoices, impl.pinnedChoices,
                                       choices.size() * sizeof(kc::SamplingRow),
                                       cudaMemcpyHostToDevice, stream),
                       "sampling parameters upload");
  LAUNCH_RETURN_IF_ERROR(kc::launchSampleRows(sample, stream), "token choice");
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(impl.pinnedChosen, impl.deviceChosen,
                                       static_cast<size_t>(rows) * sizeof(int64_t),
                                       cudaMemcpyDeviceToHost, stream),
                       "chosen tokens download");
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(),
                       program.name()->str() + " program and its token choice");
  HYBRID_RETURN_IF_ERROR(impl.finishKvStep(programIndex, host));
  std::copy_n(impl.pinnedChosen, rows, chosen);
  return Status::ok();
}

Status CudaExecutor::beginChain(int64_t steps, int64_t rows) {
  Impl &impl = *impl_;
  const size_t ids = static_cast<size_t>(steps * rows);
  if (steps < 1 || rows < 1)
    return Status::error("cuda device: a chain of " + std::to_string(steps) + " steps of " +
                         std::to_string(rows) + " rows");
  if (ids > impl.chainChosenCapacity) {
    cudaFree(impl.chainChosen);
    impl.chainChosen = nullptr;
    impl.chainChosenCapacity = 0;
    CUDA_RETURN_IF_ERROR(cudaMalloc(&impl.chainChosen, ids * sizeof(int64_t)), "chain ids");
    impl.chainChosenCapacity = ids;
  }
  impl.chainQueued = false;
  return Status::ok();
}

Status CudaExecutor::runChoosingChained(const cpu::StepContext &host,
                                        std::span<const int64_t> tokens,
                                        std::span<const TokenChoice> choices, int64_t step) {
  Impl &impl = *impl_;
  const fb::Program &program = *host.program;
  const int64_t rows = host.rows;
  const size_t programIndex = impl.indexOf(program);
  if (static_cast<int64_t>(choices.size()) != rows || host.contextShard ||
      programIndex != Impl::kDecode || step < 0 ||
      static_cast<size_t>((step + 1) * rows) > impl.chainChosenCapacity)
    return Status::error("cuda device: chained step " + std::to_string(step) + " of " +
                         std::to_string(rows) + " rows does not fit its chain");
  HYBRID_ASSIGN_OR_RETURN(const kc::SampleRowsParams sample, impl.tokenChoiceOf(program, rows));
  auto give_up = [&](Status status) {
    cudaDeviceSynchronize(); // nothing of the chain left running
    cudaGetLastError();      // nor its error, for the next launch's check to find
    impl.chainQueued = false;
    return status;
  };
  // The pinned buffers hold the previous step's inputs until its copies have run (at that step's
  // start on the GPU, while the one before it may still run).
  if (impl.chainQueued)
    if (const cudaError_t waited = cudaEventSynchronize(impl.uploadsIssued); waited != cudaSuccess)
      return give_up(cudaStatus(waited, "chained step"));
  const cudaStream_t stream = impl.streams[0]->stream;
  for (size_t i = 0; i < choices.size(); ++i)
    impl.pinnedChoices[i] = {choices[i].params.temperature, choices[i].params.topK,
                             choices[i].params.topP, choices[i].uniform};
  if (const cudaError_t copied =
          cudaMemcpyAsync(impl.deviceChoices, impl.pinnedChoices,
                          choices.size() * sizeof(kc::SamplingRow), cudaMemcpyHostToDevice, stream);
      copied != cudaSuccess)
    return give_up(cudaStatus(copied, "sampling parameters upload"));
  // Every step reads its ids from the device (step 0's copied there first), so that all steps
  // of a chain replay one decode graph.
  if (step == 0) {
    if (tokens.size() != static_cast<size_t>(rows))
      return give_up(Status::error("cuda device: chained step 0 has " +
                                   std::to_string(tokens.size()) + " token ids for " +
                                   std::to_string(rows) + " rows"));
    if (Status checked = impl.checkTokenIds(host, tokens); !checked)
      return give_up(std::move(checked));
    std::copy(tokens.begin(), tokens.end(), impl.pinnedTokens);
    if (const cudaError_t copied =
            cudaMemcpyAsync(impl.deviceChosen, impl.pinnedTokens, tokens.size() * sizeof(int64_t),
                            cudaMemcpyHostToDevice, stream);
        copied != cudaSuccess)
      return give_up(cudaStatus(copied, "chained token ids"));
  }
  if (Status queued = enqueueProgram(host, tokens, nullptr, impl.deviceChosen, /*markUploaded=*/true);
      !queued)
    return give_up(std::move(queued));
  if (Status launched = launchStatus(kc::launchSampleRows(sample, stream), "token choice");
      !launched)
    return give_up(std::move(launched));
  if (const cudaError_t copied = cudaMemcpyAsync(impl.chainChosen + step * rows, impl.deviceChosen,
                                                 static_cast<size_t>(rows) * sizeof(int64_t),
                                                 cudaMemcpyDeviceToDevice, stream);
      copied != cudaSuccess)
    return give_up(cudaStatus(copied, "chained ids"));
  impl.chainQueued = true;
  return impl.finishKvStep(programIndex, host);
}

Status CudaExecutor::endChain(int64_t steps, int64_t rows, int64_t *chosen) {
  Impl &impl = *impl_;
  impl.chainQueued = false;
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "chained decode steps");
  if (!chosen)
    return Status::ok();
  CUDA_RETURN_IF_ERROR(cudaMemcpy(chosen, impl.chainChosen,
                                  static_cast<size_t>(steps * rows) * sizeof(int64_t),
                                  cudaMemcpyDeviceToHost),
                       "chained ids download");
  return Status::ok();
}

Status CudaExecutor::runProgram(const cpu::StepContext &host, std::span<const int64_t> tokens,
                                HiddenStates *hidden) {
  HYBRID_RETURN_IF_ERROR(enqueueProgram(host, tokens, hidden));
  const fb::Program &program = *host.program;
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), program.name()->str() + " program");
  return impl_->finishKvStep(impl_->indexOf(program), host);
}

Status CudaExecutor::enqueueProgram(const cpu::StepContext &host, std::span<const int64_t> tokens,
                                    HiddenStates *hidden, const int64_t *deviceTokens,
                                    bool markUploaded) {
  Impl &impl = *impl_;
  const fb::Program &program = *host.program;
  const size_t programIndex = impl.indexOf(program);
  if (programIndex >= impl.arenas.size())
    return Status::error("cuda device: program '" + program.name()->str() + "' is not loaded");
  // The prefill and mtp programs take rows of one sequence, or segments of several (batched
  // prefill); a decode step one row per sequence.
  const bool prefill = programIndex != Impl::kDecode;
  unsigned char *arena = impl.arenas[programIndex];
  const int64_t rows = host.rows;
  if (tokens.size() > static_cast<size_t>(std::max<int64_t>(1, program.max_tokens())))
    return Status::error(program.name()->str() + " program: " + std::to_string(tokens.size()) +
                         " tokens, it takes at most " + std::to_string(program.max_tokens()));

  // Ids on the device are the token choice's (a chained step's, step 0's checked before they
  // were copied there), always in the vocabulary.
  if (!deviceTokens)
    HYBRID_RETURN_IF_ERROR(impl.checkTokenIds(host, tokens));
  if (host.kdaLog) { // a logged step: its GPU KDA layers' inputs are kept for replayKdaLog
    impl.kdaLogUsed = 0;
    impl.kdaLogRows = rows;
  }
  impl.stagedUploads.clear(); // a failed step's, never issued
  // Staged in pinned memory (the previous call's copy finished with its synchronization, or for
  // a chained step, its uploads event), or copied from the device (a chained step's ids). A
  // context-parallel prefill's ids are this rank's rows (prepareContextStep).
  if (host.contextShard && !deviceTokens) {
    HYBRID_RETURN_IF_ERROR(impl.prepareContextStep(host, tokens, arena, program));
  } else {
    if (!deviceTokens)
      std::copy(tokens.begin(), tokens.end(), impl.pinnedTokens);
    const fb::Value &ids = valueOf(program, program.token_ids());
    impl.stageUpload(arena + ids.arena_offset(), deviceTokens ? deviceTokens : impl.pinnedTokens,
                     tokens.size() * sizeof(int64_t),
                     deviceTokens ? "chained token ids" : "token ids upload");
  }

  if (prefill) { // per segment (one sequence, or a batched prefill's), for the KDA prefill kernels
    std::vector<int64_t> segmentRows;
    for (const cpu::BatchRow &segment : host.batch)
      segmentRows.push_back(segment.rows);
    if (segmentRows.empty())
      segmentRows.push_back(rows);
    HYBRID_RETURN_IF_ERROR(impl.uploadCuSeqlens(segmentRows));
  } else { // each row's state slot, for the KDA decode kernels
    for (int64_t row = 0; row < rows; ++row) {
      const int32_t slot = host.batch.empty() ? host.stateSlot
                                              : host.batch[static_cast<size_t>(row)].stateSlot;
      if (!host.states->isAllocated(slot))
        return Status::error("decode row " + std::to_string(row) + ": state slot " +
                             std::to_string(slot) + " is not allocated");
      impl.pinnedSlots[row] = slot;
    }
    impl.stageUpload(impl.rowSlots, impl.pinnedSlots, static_cast<size_t>(rows) * sizeof(int32_t),
                     "state slots upload");
  }
  HYBRID_RETURN_IF_ERROR(impl.prepareKvStep(host));
  const bool graphs = impl.cudaGraphs && !prefill && !hidden;
  const std::vector<StepRun> &runs = impl.runs[programIndex];
  // A replayed decode step's first GPU run holds the staged copies (replayRun); otherwise they go
  // now, ahead of everything the step launches.
  if (!graphs || runs.empty() || !runs.front().gpu)
    HYBRID_RETURN_IF_ERROR(
        impl.issueStagedUploads(impl.streams[0]->stream, markUploaded, /*capturing=*/false));
  // A replayed prefill graph reads what the uploads above put in fixed buffers (runPrefillGraph).
  const bool prefillGraph = prefill && impl.prefillGraphSafe(program, host, hidden);
  if (prefill && !prefillGraph)
    ++impl.graphCounts.prefillEager;
  for (size_t index = 0; index < runs.size(); ++index) {
    const StepRun &run = runs[index];
    if (!run.gpu) {
      for (size_t i = run.begin; i < run.end; ++i) {
        const fb::Dispatch &d = *program.steps()->Get(static_cast<flatbuffers::uoffset_t>(i))->op_as_Dispatch();
        const std::string where =
            kernelName(d.kernel()) + " (layer " + std::to_string(d.layer()) + ")";
        HYBRID_RETURN_IF_ERROR(
            impl.runOnCpu(program, d, arena, host).withContext(where + " on the cpu reference"));
      }
      continue;
    }
    if (graphs)
      HYBRID_RETURN_IF_ERROR(impl.replayRun(program, arena, index, host));
    else if (prefillGraph)
      HYBRID_RETURN_IF_ERROR(impl.runPrefillGraph(program, arena, index, host));
    else
      HYBRID_RETURN_IF_ERROR(impl.launchRun(program, arena, run, host, hidden, false));
  }
  return Status::ok();
}

} // namespace hybrid::cudadev
