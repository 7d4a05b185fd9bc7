// MoE layers on the cuda device (issue 7): the router (its GEMM, then the fused noaux_tc
// selection) and the routed experts: per (token, expert) on CUDA cores for up to 64 pairs (a
// decode step of up to 8 tokens: each pair streams its expert's rows; a tuned threshold per step
// shape where the grouped form could run, docs/autotune.md); beyond, bf16 experts are
// grouped by expert on the GPU and multiplied on tensor cores (kc::launchMoeExpertsGrouped, no
// host round trip, so decode graphs hold it too); other prefills group on the host around the
// GEMMs (the chosen experts come to the host, each expert runs once on its tokens). A
// context-parallel rank takes the form its step's pairs choose, not its own rows' (formRows).
// Experts in bf16 or FP8 with block scales (their inputs then rounded to E4M3 as the FP8 GEMMs do).
// An expert-parallel rank's experts held elsewhere are absent (-1 in the dispatch, null pointers
// for the kernels): every form skips their pairs, and the plan's all-reduce adds the other ranks'.
// A cp=N,ep=N prefill's all_to_all dispatch sends its rows to their experts' ranks first and runs
// the rows it receives in the step's form (CudaMoeAllToAll.cpp).
#include "cuda/CudaExecutorImpl.h"

#include "hybrid/kernels/cuda/Elementwise.h"
#include "hybrid/kernels/cuda/Moe.h"

#include <algorithm>

namespace hybrid::cudadev {
namespace {

// The rows whose (token, expert) pairs choose the form: the step's. A context-parallel rank holds
// part of the step's rows and runs them in the form an unsharded run of the same step takes, so
// that its rows get the same arithmetic: the forms differ by more than summation order (FP8
// experts: the host-grouped form's cuBLASLt GEMMs accumulate each 128-wide k block with about 14
// bits on sm_90, the per-token form in fp32, and the E4M3 rounding of the intermediate turns
// that into whole E4M3 steps; bf16 experts: the tensor-core form's x is bf16 hi + lo, the
// per-token form's fp32). With the rank's own rows, a 64-token step at cp=2 ran FP8 experts per
// token (32 rows, 64 pairs) where one GPU grouped them (128 pairs), and a synthetic FP8
// DeepSeek-V3.2's hidden states differed from one GPU's by 3.6e-2 after its first MoE layer.
int64_t formRows(const cpu::StepContext &host) {
  return host.contextShard ? host.contextShard->stepRows : host.rows;
}

// Experts the tensor-core form cannot take: above kc::kMoePerTokenMaxPairs (token, expert) pairs
// a prefill groups the tokens by expert on the host: each expert's weights are then read once,
// not once per token.
bool groupedForm(const cpu::StepContext &host, int64_t topK) {
  return !host.decode && formRows(host) * topK > kc::kMoePerTokenMaxPairs;
}

} // namespace

bool CudaExecutor::Impl::moeRunsOnGpu(const fb::Dispatch &d) const {
  const fb::MoeParams *p = d.params_as_MoeParams();
  if (!p || p->num_experts() <= 0 || p->top_k() <= 0 || p->top_k() > kc::kMoeMaxTopK ||
      p->top_k() > p->num_experts())
    return false;
  if (d.kernel() == fb::KernelId::RouterTopK)
    return p->num_experts() <= kc::kMoeMaxExperts && p->num_groups() >= 1 &&
           p->num_groups() <= 64 && p->num_experts() % p->num_groups() == 0 &&
           p->topk_groups() >= 1 && p->topk_groups() <= p->num_groups() &&
           gemmWeight(roleOf(d, 0));
  // Experts: row-major weights the GEMMs and the CUDA-core kernels both read, all bf16 or all
  // FP8 with block scales. An expert-parallel rank's experts held elsewhere are absent: all three
  // of an expert's matrices -1 (a partly present expert is not a layout any plan has).
  if (!d.weights() || static_cast<int64_t>(d.weights()->size()) < 3 * p->num_experts() ||
      p->intermediate_size() <= 0 || p->intermediate_size() > kc::kMoeMaxHidden ||
      p->intermediate_size() % 2 != 0)
    return false;
  return expertWeightType(d).has_value();
}

std::optional<fb::DType> CudaExecutor::Impl::expertWeightType(const fb::Dispatch &d) const {
  const int64_t E = d.params_as_MoeParams()->num_experts();
  std::optional<fb::DType> type;
  for (int64_t e = 0; e < E; ++e) {
    const int32_t gate = expertWeight(d, e, 0);
    if (gate < 0) {
      if (expertWeight(d, e, 1) >= 0 || expertWeight(d, e, 2) >= 0)
        return std::nullopt;
      continue;
    }
    if (!type)
      type = weightTypes[static_cast<size_t>(gate)];
    for (int m = 0; m < 3; ++m) {
      const int32_t index = expertWeight(d, e, m);
      if (!gemmWeight(index) || weightTypes[static_cast<size_t>(index)] != *type)
        return std::nullopt;
    }
  }
  if (!type) // holds no expert: every pair adds nothing, in any form
    return fb::DType::BF16;
  if (*type != fb::DType::BF16 && *type != fb::DType::F8_E4M3)
    return std::nullopt;
  return type;
}

Status CudaExecutor::Impl::prepareMoe(const fb::Dispatch &d, const fb::Program &program,
                                      int64_t rows, bool decodeProgram,
                                      const HostWeights &hostWeights,
                                      size_t &floats, size_t &xWidth, size_t &outWidth) {
  const fb::MoeParams *p = d.params_as_MoeParams();
  const int64_t E = p->num_experts(), K = p->top_k(), inner = p->intermediate_size();
  const int64_t hidden = valueOf(program, d.inputs()->Get(0)).row_elements();
  if (hidden > kc::kMoeMaxHidden || hidden % 2 != 0)
    return Status::error("MoE hidden size " + std::to_string(hidden) + " is not an even number "
                         "up to " + std::to_string(kc::kMoeMaxHidden));
  if (d.kernel() == fb::KernelId::RouterTopK) {
    const int32_t bias = roleOf(d, 1);
    if (bias >= 0) {
      HYBRID_ASSIGN_OR_RETURN(const std::vector<float> *values, hostWeights(bias));
      if (static_cast<int64_t>(values->size()) != E)
        return Status::error("router correction bias has " + std::to_string(values->size()) +
                             " values for " + std::to_string(E) + " experts");
      HYBRID_RETURN_IF_ERROR(uploadSmallWeight(bias, hostWeights));
    }
    floats = static_cast<size_t>(pad(rows * E));
    xWidth = static_cast<size_t>(hidden);
    outWidth = static_cast<size_t>(E);
    return Status::ok();
  }
  if (!expertPointers.count(&d)) {
    // gate, up, down, then (FP8 experts) their block scales: six arrays of E pointers, null for
    // an absent expert (the kernels' sign to skip it).
    std::vector<const void *> pointers(static_cast<size_t>(6 * E), nullptr);
    for (int64_t e = 0; e < E; ++e)
      for (int m = 0; m < 3; ++m) {
        const int32_t index = expertWeight(d, e, m);
        if (index < 0)
          continue;
        pointers[static_cast<size_t>(m * E + e)] = weight(index);
        if (fp8WeightScales.count(index)) // prepared with the dispatch's FP8 weights
          pointers[static_cast<size_t>((3 + m) * E + e)] = fp8WeightScales.at(index);
      }
    const void **&device = expertPointers[&d];
    CUDA_RETURN_IF_ERROR(cudaMalloc(&device, pointers.size() * sizeof(void *)),
                         "expert weight pointers");
    CUDA_RETURN_IF_ERROR(cudaMemcpy(device, pointers.data(), pointers.size() * sizeof(void *),
                                    cudaMemcpyHostToDevice),
                         "expert weight pointers");
  }
  // Per-token form: hidden and output rows per pair; grouped form (prefill): gathered rows, gate,
  // up, the expert's output. Where the tensor-core form can run, a tuned threshold may move the
  // per-token form up to kc::kMoeTunedMaxPairs pairs, or the tensor-core form down to 2 pairs:
  // sized for every threshold the moe-experts family admits, so a tuning cache read at run time
  // never needs more than this.
  const bool tensorCores = expertWeightType(d) == fb::DType::BF16 &&
                           kc::moeGroupedShape(kc::WeightType::BF16, hidden, inner);
  if (batchInvariant && !tensorCores) // their form is chosen by the step's pairs (moeForm)
    batchVariantLayers.insert(d.layer());
  const int64_t pairs =
      decodeProgram ? rows * K
                    : std::min<int64_t>(rows * K, tensorCores ? kc::kMoeTunedMaxPairs
                                                              : kc::kMoePerTokenMaxPairs);
  const int64_t perToken = pad(static_cast<int64_t>(
      kc::moeExpertsWorkspaceBytes(static_cast<int32_t>(pairs), 1, static_cast<int32_t>(hidden),
                                   static_cast<int32_t>(inner)) / sizeof(float)));
  const int64_t grouped = decodeProgram ? 0 : 2 * pad(rows * hidden) + 2 * pad(rows * inner);
  // The tensor-core grouped form (bf16 experts, more pairs than the per-token form takes).
  const int64_t tensorCore =
      tensorCores && rows * K > 1
          ? pad(static_cast<int64_t>(kc::moeGroupedWorkspaceBytes(
                    static_cast<int32_t>(rows), static_cast<int32_t>(K),
                    static_cast<int32_t>(hidden), static_cast<int32_t>(inner),
                    static_cast<int32_t>(E)) /
                sizeof(float)) + 1)
          : 0;
  floats = static_cast<size_t>(std::max({perToken, grouped, tensorCore}));
  xWidth = static_cast<size_t>(std::max(hidden, inner));
  outWidth = static_cast<size_t>(std::max(hidden, inner));
  // An all_to_all's host-grouped form takes a chunk of every rank's padded slots as its rows, one
  // choice each: N ceil(slots / 2) <= (rows + 2 N) K of them (slots: at most a rank's rows times
  // K, a rank's rows at most rows / N + 2).
  const size_t entries = static_cast<size_t>(
      p->all_to_all() ? (rows + 2 * int64_t(contextParallel)) * K : rows * K);
  if (!decodeProgram && entries > expertListCapacity) {
    releaseExpertLists();
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&pinnedExpertIds, entries * sizeof(int32_t)), "MoE lists");
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&pinnedExpertTokens, entries * sizeof(int32_t)),
                         "MoE lists");
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&pinnedExpertWeights, entries * sizeof(float)), "MoE lists");
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&pinnedListWeights, entries * sizeof(float)), "MoE lists");
    CUDA_RETURN_IF_ERROR(cudaMalloc(&expertTokens, entries * sizeof(int32_t)), "MoE lists");
    CUDA_RETURN_IF_ERROR(cudaMalloc(&expertListWeights, entries * sizeof(float)), "MoE lists");
    expertListCapacity = entries;
  }
  return Status::ok();
}

Status CudaExecutor::Impl::runRouter(const fb::Program &program, unsigned char *arena,
                                     const fb::Dispatch &d, StreamResources &r,
                                     const cpu::StepContext &host) {
  const fb::MoeParams *p = d.params_as_MoeParams();
  const fb::Value &in = valueOf(program, d.inputs()->Get(0));
  const int64_t T = host.rows, E = p->num_experts(), hidden = in.row_elements();
  if (static_cast<size_t>(pad(T * E)) > r.sizes.scratchFloats)
    return Status::error("router scratch larger than planned at load");
  float *logits = r.scratch;
  HYBRID_RETURN_IF_ERROR(gemm(r, reinterpret_cast<const float *>(arena + in.arena_offset()), hidden,
                              roleOf(d, 0), logits, E, T, hidden, E));
  kc::MoeRouterParams router;
  router.tokens = static_cast<int32_t>(T);
  router.experts = static_cast<int32_t>(E);
  router.topK = p->top_k();
  router.groups = p->num_groups();
  router.topKGroups = p->topk_groups();
  router.softmax = p->score_function() == fb::ScoreFunction::Softmax;
  router.logits = logits;
  router.correctionBias = roleOf(d, 1) >= 0 ? fp32Weights.at(roleOf(d, 1)) : nullptr;
  router.renormalize = p->renormalize();
  router.routedScalingFactor = p->routed_scaling_factor();
  router.ids = reinterpret_cast<int32_t *>(arena + valueOf(program, d.outputs()->Get(0)).arena_offset());
  router.weights = reinterpret_cast<float *>(arena + valueOf(program, d.outputs()->Get(1)).arena_offset());
  LAUNCH_RETURN_IF_ERROR(kc::launchMoeRouter(router, r.stream), "MoE router");
  return Status::ok();
}

kc::MoeExpertsParams CudaExecutor::Impl::moeExpertsParams(const fb::Dispatch &d,
                                                           int64_t hidden) const {
  const fb::MoeParams *p = d.params_as_MoeParams();
  const int64_t E = p->num_experts(), inner = p->intermediate_size();
  const void **pointers = expertPointers.at(&d);
  // The held experts' type (all alike, checked at load by expertWeightType): the first held one's.
  fb::DType type = fb::DType::BF16;
  for (int64_t e = 0; e < E; ++e)
    if (const int32_t gate = expertWeight(d, e, 0); gate >= 0) {
      type = weightTypes[static_cast<size_t>(gate)];
      break;
    }
  kc::MoeExpertsParams m;
  m.hidden = static_cast<int32_t>(hidden);
  m.intermediate = static_cast<int32_t>(inner);
  m.experts = static_cast<int32_t>(E);
  m.gate = pointers;
  m.up = pointers + E;
  m.down = pointers + 2 * E;
  m.type = kc::WeightType::BF16;
  if (type == fb::DType::F8_E4M3) {
    kc::setFp8Experts(m, reinterpret_cast<const float *const *>(pointers + 3 * E),
                      reinterpret_cast<const float *const *>(pointers + 4 * E),
                      reinterpret_cast<const float *const *>(pointers + 5 * E));
    m.activationScale = fp8ActivationScale;
  }
  m.activation = gatedActivationOf(*p);
  return m;
}

CudaExecutor::Impl::MoeForm CudaExecutor::Impl::moeForm(const kc::MoeExpertsParams &m,
                                                        const cpu::StepContext &host,
                                                        int32_t &perTokenMaxPairs) {
  // Where the tensor-core form can run (bf16 experts), it or the per-token form by the step's
  // pairs (formRows): above 64, or the threshold tuned for the step's shape, as
  // kc::moeLaunchesGrouped decides for the step's tokens.
  kc::MoeExpertsParams step = m;
  step.tokens = static_cast<int32_t>(formRows(host));
  if (kc::moeGroupedSupports(step)) {
    if (batchInvariant) { // one form whatever the pairs: a token's sums never depend on them
      perTokenMaxPairs = 0;
      return MoeForm::TensorCores;
    }
    applyTuning(step);
    perTokenMaxPairs = step.perTokenMaxPairs;
    return kc::moeLaunchesGrouped(step) ? MoeForm::TensorCores : MoeForm::PerToken;
  }
  return groupedForm(host, m.topK) ? MoeForm::HostGrouped : MoeForm::PerToken;
}

bool CudaExecutor::Impl::moeGroupsOnHost(const fb::Program &program, const fb::Dispatch &d,
                                         const cpu::StepContext &host) {
  kc::MoeExpertsParams m = moeExpertsParams(d, valueOf(program, d.inputs()->Get(0)).row_elements());
  m.tokens = static_cast<int32_t>(host.rows);
  m.topK = static_cast<int32_t>(d.params_as_MoeParams()->top_k());
  int32_t perTokenMaxPairs = 0;
  return moeForm(m, host, perTokenMaxPairs) == MoeForm::HostGrouped;
}

Status CudaExecutor::Impl::launchMoeForm(const fb::Dispatch &d, const kc::MoeExpertsParams &m,
                                         MoeForm form, size_t workspaceBytes,
                                         StreamResources &r) {
  if (form == MoeForm::HostGrouped)
    return runHostGroupedExperts(d, m, r);
  const bool grouped = form == MoeForm::TensorCores;
  const size_t bytes =
      grouped ? kc::moeGroupedWorkspaceBytes(m.tokens, m.topK, m.hidden, m.intermediate, m.experts)
              : kc::moeExpertsWorkspaceBytes(m.tokens, m.topK, m.hidden, m.intermediate);
  if (bytes > workspaceBytes)
    return Status::error(grouped ? "MoE grouped workspace larger than planned at load"
                                 : "MoE workspace larger than planned at load");
  LAUNCH_RETURN_IF_ERROR(grouped ? kc::launchMoeExpertsGrouped(m, splitGemmInputs, r.stream)
                                 : kc::launchMoeExpertsPerToken(m, r.stream),
                         grouped ? "MoE experts (grouped)" : "MoE experts");
  return Status::ok();
}

Status CudaExecutor::Impl::runMoeExperts(const fb::Program &program, unsigned char *arena,
                                         const fb::Dispatch &d, StreamResources &r,
                                         const cpu::StepContext &host) {
  const fb::MoeParams *p = d.params_as_MoeParams();
  if (p->all_to_all()) // experts over the context ranks (CudaMoeAllToAll.cpp)
    return runMoeAllToAll(program, arena, d, r, host);
  auto value = [&](int position) { return arena + valueOf(program, d.inputs()->Get(position)).arena_offset(); };
  const int64_t hidden = valueOf(program, d.inputs()->Get(0)).row_elements();
  // What every form takes: the step's rows, the experts' pointers and activation (bf16, or
  // FP8 codes with their block scales).
  kc::MoeExpertsParams m = moeExpertsParams(d, hidden);
  m.tokens = static_cast<int32_t>(host.rows);
  m.topK = static_cast<int32_t>(p->top_k());
  m.x = reinterpret_cast<const float *>(value(0));
  m.ids = reinterpret_cast<const int32_t *>(value(1));
  m.weights = reinterpret_cast<const float *>(value(2));
  m.out = reinterpret_cast<float *>(arena + valueOf(program, d.outputs()->Get(0)).arena_offset());
  m.workspace = r.scratch;
  const MoeForm form = moeForm(m, host, m.perTokenMaxPairs);
  return launchMoeForm(d, m, form, r.sizes.scratchFloats * sizeof(float), r);
}

// The host-grouped form: the chosen experts come to the host, each expert runs once on its
// tokens (its GEMMs on the rows gathered for it), its weighted rows scatter-added into the
// output in expert order.
Status CudaExecutor::Impl::runHostGroupedExperts(const fb::Dispatch &d,
                                                 const kc::MoeExpertsParams &m,
                                                 StreamResources &r) {
  const fb::MoeParams *p = d.params_as_MoeParams();
  const int64_t T = m.tokens, E = m.experts, K = m.topK, hidden = m.hidden, inner = m.intermediate;
  const float *x = m.x;
  const int32_t *ids = m.ids;
  const float *weights = m.weights;
  float *out = m.out;
  const size_t pairs = static_cast<size_t>(T * K);
  if (pairs > expertListCapacity)
    return Status::error("MoE step of " + std::to_string(pairs) +
                         " (token, expert) pairs is larger than planned at load");
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pinnedExpertIds, ids, pairs * sizeof(int32_t),
                                       cudaMemcpyDeviceToHost, r.stream),
                       "MoE expert ids download");
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pinnedExpertWeights, weights, pairs * sizeof(float),
                                       cudaMemcpyDeviceToHost, r.stream),
                       "MoE expert weights download");
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(r.stream), "MoE expert ids download");
  std::vector<int64_t> starts(static_cast<size_t>(E) + 1, 0);
  for (size_t i = 0; i < pairs; ++i) {
    const int32_t expert = pinnedExpertIds[i];
    if (expert == -1) // no choice: an exchange's padding row
      continue;
    if (expert < 0 || expert >= E)
      return Status::error("router chose expert " + std::to_string(expert) + " of " +
                           std::to_string(E));
    ++starts[static_cast<size_t>(expert) + 1];
  }
  int64_t most = 0; // the most rows one expert takes: what the scratch below holds
  for (int64_t e = 0; e < E; ++e) {
    most = std::max(most, starts[static_cast<size_t>(e) + 1]);
    starts[static_cast<size_t>(e) + 1] += starts[static_cast<size_t>(e)];
  }
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  const size_t listed = static_cast<size_t>(starts.back());
  for (size_t i = 0; i < pairs; ++i) { // tokens in ascending order within each expert
    if (pinnedExpertIds[i] < 0)
      continue;
    const int64_t slot = next[static_cast<size_t>(pinnedExpertIds[i])]++;
    pinnedExpertTokens[slot] = static_cast<int32_t>(i / static_cast<size_t>(K));
    pinnedListWeights[slot] = pinnedExpertWeights[i];
  }
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(expertTokens, pinnedExpertTokens, listed * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, r.stream),
                       "MoE token lists upload");
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(expertListWeights, pinnedListWeights, listed * sizeof(float),
                                       cudaMemcpyHostToDevice, r.stream),
                       "MoE token lists upload");
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(out, 0, static_cast<size_t>(T * hidden) * sizeof(float),
                                       r.stream),
                       "MoE output");
  if (static_cast<size_t>(2 * pad(most * hidden) + 2 * pad(most * inner)) > r.sizes.scratchFloats)
    return Status::error("MoE scratch larger than planned at load");
  float *gathered = r.scratch, *gate = gathered + pad(most * hidden), *up = gate + pad(most * inner);
  float *result = up + pad(most * inner);
  for (int64_t e = 0; e < E; ++e) { // in expert order: each token's sum is in that order too
    const int64_t begin = starts[static_cast<size_t>(e)], n = starts[static_cast<size_t>(e) + 1] - begin;
    if (n == 0 || expertWeight(d, e, 0) < 0) // none of its tokens, or held by another rank
      continue;
    const int32_t count = static_cast<int32_t>(n);
    LAUNCH_RETURN_IF_ERROR(kc::launchGatherRows(x, hidden, expertTokens + begin, count, gathered,
                                                r.stream),
                           "MoE token gather");
    HYBRID_RETURN_IF_ERROR(gemm(r, gathered, hidden, expertWeight(d, e, 0), gate, inner, n,
                                hidden, inner));
    HYBRID_RETURN_IF_ERROR(gemm(r, gathered, hidden, expertWeight(d, e, 1), up, inner, n, hidden,
                                inner));
    LAUNCH_RETURN_IF_ERROR(kc::launchGatedActivation(gate, up, n, inner, inner, gate,
                                                     gatedActivationOf(*p), r.stream),
                           "MoE gated activation");
    HYBRID_RETURN_IF_ERROR(gemm(r, gate, inner, expertWeight(d, e, 2), result, hidden, n, inner,
                                hidden));
    LAUNCH_RETURN_IF_ERROR(kc::launchScatterAddRows(result, hidden, expertTokens + begin,
                                                    expertListWeights + begin, count, out,
                                                    r.stream),
                           "MoE weighted scatter-add");
  }
  return Status::ok();
}

} // namespace hybrid::cudadev
