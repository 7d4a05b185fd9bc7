// The cuda device's internals, shared by its source files (CudaExecutor.cpp: placement, GEMMs,
// KDA, decode graphs; CudaPrefillGraphs.cpp: prefill and verification graphs; CudaAttention.cpp:
// the MLA and DSA layers over the device KV pools). Internal to the runtime.
#pragma once

#include "cuda/CudaExecutor.h"

#include "hybrid/kernels/cuda/DsaCacheWrite.h"
#include "hybrid/kernels/KernelTuning.h"
#include "hybrid/kernels/cuda/DsaIndexer.h"
#include "hybrid/kernels/cuda/KdaContext.h"
#include "hybrid/kernels/cuda/KdaDecode.h"
#include "hybrid/kernels/cuda/KdaPrefill.h"
#include "hybrid/kernels/cuda/Activation.h"
#include "hybrid/kernels/cuda/Linear.h"
#include "hybrid/kernels/cuda/Mla.h"
#include "hybrid/kernels/cuda/Sampling.h"
#include "hybrid/kernels/cuda/SparseMla.h"
#include "hybrid/runtime/Communicator.h"
#include "hybrid/runtime/Memory.h"
#include "runtime/schema/kernel_signatures.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <compare>
#include <list>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <tuple>

namespace hybrid::cudadev {
namespace fb = plan::fb;
namespace kc = kernels::cuda;

// A gated MLP's activation as the plan gives it (MlpParams / MoeParams).
template <typename Params> kc::GatedActivation gatedActivationOf(const Params &p) {
  if (p.activation() == plan::fb::Activation::Situ)
    return {kc::GatedActivation::Kind::Situ, p.situ_beta(), p.situ_linear_beta()};
  return {};
}

// A step between ranks (a sharded plan's collective): its kernel takes CollectiveParams.
inline bool isCollective(const fb::Dispatch &d) {
  const plan::KernelSignature *signature = plan::kernelSignature(d.kernel());
  return d.params_type() == fb::KernelParams::CollectiveParams ||
         (signature && signature->params == fb::KernelParams::CollectiveParams);
}

inline std::string kernelName(fb::KernelId kernel) {
  const plan::KernelSignature *signature = plan::kernelSignature(kernel);
  return signature ? std::string(signature->name) : "kernel " + std::to_string(int(kernel));
}

inline Status cudaStatus(cudaError_t status, const std::string &what) {
  if (status == cudaSuccess)
    return Status::ok();
  return Status::error(what + ": cuda: " + cudaGetErrorName(status) + " (" +
                       cudaGetErrorString(status) + ")");
}

// A kernel launcher's int result (a cudaError_t, or a cuBLASLt status for GEMMs) as a Status.
inline Status launchStatus(int code, const char *what) {
  if (code == 0)
    return Status::ok();
  return Status::error(std::string(what) + ": " + kc::linearErrorText(code));
}

#define CUDA_RETURN_IF_ERROR(expr, what) HYBRID_RETURN_IF_ERROR(cudaStatus((expr), (what)))
#define LAUNCH_RETURN_IF_ERROR(expr, what) HYBRID_RETURN_IF_ERROR(launchStatus((expr), (what)))

// KDA weight roles (KdaParams in plan.fbs).
enum KdaRole { Q, Kp, V, QConv, KConv, VConv, FA, FB, ALog, DtBias, B, GA, GB, G, ONorm, O };

inline size_t alignUp(size_t bytes) { return (bytes + 255) / 256 * 256; }
// Floats rounded up to 256-byte multiples: the parts a kernel's scratch is carved into.
inline int64_t pad(int64_t floats) { return (floats + 63) / 64 * 64; }

// Weight `role` of a dispatch (its plan weight index), or -1 when it has none.
inline int32_t roleOf(const fb::Dispatch &d, int role) {
  return d.weights() && role < static_cast<int>(d.weights()->size()) ? d.weights()->Get(role) : -1;
}

// `values` in a new device allocation; `what` names it in errors.
inline Status uploadFloats(const std::vector<float> &values, float *&device,
                           const std::string &what) {
  CUDA_RETURN_IF_ERROR(cudaMalloc(&device, std::max<size_t>(1, values.size()) * sizeof(float)),
                       what);
  CUDA_RETURN_IF_ERROR(cudaMemcpy(device, values.data(), values.size() * sizeof(float),
                                  cudaMemcpyHostToDevice),
                       what);
  return Status::ok();
}

// Per stream: its own cuBLASLt workspace and scratch, so steps on different streams never share
// a buffer.
// The sizes of a stream's buffers: the largest any dispatch it runs asks for (CudaExecutor::load
// sizes each stream for its own dispatches: a side stream of small MLPs does not carry the
// attention's or KDA's gigabytes).
struct ScratchSizes {
  size_t xBf16Elements = 0, gemmOutputs = 0, scratchFloats = 0, kdaWorkspaceBytes = 0,
         fp8ScratchBytes = 0, attentionWorkspaceBytes = 0;
  void include(const ScratchSizes &other) {
    xBf16Elements = std::max(xBf16Elements, other.xBf16Elements);
    gemmOutputs = std::max(gemmOutputs, other.gemmOutputs);
    scratchFloats = std::max(scratchFloats, other.scratchFloats);
    kdaWorkspaceBytes = std::max(kdaWorkspaceBytes, other.kdaWorkspaceBytes);
    fp8ScratchBytes = std::max(fp8ScratchBytes, other.fp8ScratchBytes);
    attentionWorkspaceBytes = std::max(attentionWorkspaceBytes, other.attentionWorkspaceBytes);
  }
};

struct StreamResources {
  cudaStream_t stream = nullptr;
  ScratchSizes sizes; // of the buffers below
  kc::LinearContext linear;
  void *xBf16 = nullptr; // GEMM inputs in bf16 (both halves when split)
  float *splitOutput = nullptr; // the two halves' products of a split GEMM
  float *scratch = nullptr;
  void *kdaWorkspace = nullptr;
  void *fp8Scratch = nullptr; // an FP8 GEMM's quantized activations (linearFp8ScratchBytes)
  void *attentionWorkspace = nullptr; // the indexer's scores and select state, sparse MLA splits
};

// One KV layer (CacheSpec.kv slot) whose attention runs on the GPU: its pools in the kernels'
// formats (docs/dsa-cache-layout.md), addressed by the host PagedKvCache's page numbers.
struct DeviceKvLayer {
  bool onGpu = false;
  int32_t latentDim = 0, ropeDim = 0, indexDim = 0;
  kc::LatentCacheType latentType = kc::LatentCacheType::F32;
  kc::IndexKeyType keyType = kc::IndexKeyType::F32;
  bool mxfp8Queries = false;   // the layer's IndexerQuery rounds to MXFP8
  bool fp8HeadQueries = false; // or to FP8 with one scale a head (DeepSeek's own recipe)
  int64_t latentPageBytes = 0, indexPageBytes = 0;
  unsigned char *latentPages = nullptr, *indexPages = nullptr;
};

// Consecutive steps of a program that all run on the GPU, or all on the cpu reference:
// [begin, end) step indices. A GPU run is what one decode graph holds.
struct StepRun {
  size_t begin = 0, end = 0;
  bool gpu = true;
};

// The MLA latent-rows kernel's params (kv_a rows -> normalized latent and rotated rope) for
// `rows` rows of `kvA` with the dispatch's norm weight; `inverseFrequencies` null: no rotation.
kc::MlaLatentRowsParams mlaLatentRowsParams(const fb::MlaParams &p, int64_t rows, const float *kvA,
                                            const float *normWeight,
                                            const float *inverseFrequencies,
                                            const int32_t *positions, float *latent, float *rope);

struct CudaExecutor::Impl {
  const fb::Plan *plan = nullptr;
  std::vector<const fb::Program *> programs; // prefill, decode, then mtp where the plan has one
  static constexpr size_t kPrefill = 0, kDecode = 1, kMtp = 2;
  // `program`'s index in `programs` (its arena and runs); programs.size() for another plan's.
  size_t indexOf(const fb::Program &program) const {
    return static_cast<size_t>(std::find(programs.begin(), programs.end(), &program) -
                               programs.begin());
  }
  std::vector<std::vector<StepRun>> runs;     // per program
  unsigned char *weights = nullptr; // the archive's data region, at the plan's offsets
  std::vector<fb::DType> weightTypes;
  std::map<int32_t, float *> fp32Weights;          // small weights the kernels read as fp32
  // FP8 weights' block scales, each row padded to linearFp8WeightScaleStride (cuBLASLt's layout),
  // and how their GEMMs quantize activations (the plan's fp8_activation_scale).
  std::map<int32_t, float *> fp8WeightScales;
  kc::Fp8ActivationScale fp8ActivationScale = kc::Fp8ActivationScale::DeepSeekLinear;
  std::map<const fb::Dispatch *, float *> kdaConvTaps; // [3, P, W]: q, k, v taps together
  unsigned char *pool = nullptr;                   // the one allocation of everything else
  std::vector<unsigned char *> arenas;             // per program
  // Where `program`'s logits lie in its arena (rows x vocab floats after a run).
  const unsigned char *logitsOf(const fb::Program &program) const;
  // Where its final hidden state (the last layer_outputs value) lies, or null when it has none.
  float *finalHiddenOf(const fb::Program &program) const;
  // Device records of hidden rows (CudaExecutor::recordFinalHidden), grown on demand.
  struct HiddenRecord {
    float *rows = nullptr;
    int64_t capacity = 0; // rows
  };
  std::map<int32_t, HiddenRecord> hiddenRecords;
  int64_t hiddenWidth = 0; // the plan's hidden_size
  // Record `record` with room for `rows` rows, keeping its first `keep` rows when it grows.
  StatusOr<float *> recordRows(int32_t record, int64_t rows, int64_t keep);
  // The KDA layers' recurrent states on the device, per slot: every layer's state (fp32, or bf16
  // with LoadOptions::kdaBf16State) in one region, their conv states (fp32) in another. The host
  // RecurrentStatePool still checks slots; these are the device's own offsets.
  kc::KdaStateType stateType = kc::KdaStateType::F32;
  unsigned char *stateRegion = nullptr;
  float *convRegion = nullptr;
  uint64_t slotStateBytes = 0, slotConvFloats = 0;
  std::vector<uint64_t> layerStateBytes, layerConvFloats; // within a slot, per KdaParams.state_slot
  std::set<int32_t> gpuStateLayers; // state slots of the KDA dispatches that run on the GPU
  // Speculative verification's pre-pass copies of slots' states (CudaStateSnapshots.cpp): one
  // [slotStateBytes | slotConvFloats] entry per sequence of a pass, grown on demand.
  unsigned char *snapshots = nullptr;
  size_t snapshotCapacity = 0; // entries
  // Copies layer `layer`'s states of `slot` between the device and `pool` (Down: to the pool).
  enum class Direction { Down, Up };
  Status transferSlot(int32_t slot, RecurrentStatePool &pool, Direction direction);
  std::vector<std::unique_ptr<StreamResources>> streams;
  std::vector<cudaEvent_t> events;
  std::set<const fb::Dispatch *> onCpu;
  // While load prepares a dispatch: the scratch sizes it needs (the prepare functions raise
  // them; load resets them before each dispatch and folds them into its stream's sizes). At run
  // time a dispatch checks its stream's StreamResources::sizes instead.
  ScratchSizes prepared;
  bool splitGemmInputs = true;
  // LoadOptions::batchInvariant: a row's arithmetic never depends on the rows sharing its call.
  bool batchInvariant = false;
  // The row count whose cuBLASLt algorithm every call of a shape then takes.
  static constexpr int64_t kBatchInvariantReferenceRows = 64;
  // With batchInvariant: the layers whose GPU kernels still depend on the rows of a call (MoE
  // experts the grouped tensor-core form does not take: FP8, or widths not multiples of 64).
  std::set<int32_t> batchVariantLayers;
  kc::KdaPrefillPath kdaPrefillPath = kc::KdaPrefillPath::Auto;
  int64_t *pinnedTokens = nullptr; // token ids staged for an asynchronous upload
  // Decode steps that choose on the GPU: each row's sampling parameters (staged, then on the
  // device) and the chosen ids (on the device, then staged for the host).
  kc::SamplingRow *pinnedChoices = nullptr, *deviceChoices = nullptr;
  int64_t *deviceChosen = nullptr, *pinnedChosen = nullptr;
  // Chained decode steps (runChoosingChained): each step's ids, kept on the device until the
  // chain ends, and an event recorded once a queued step's staged inputs have been copied (the
  // host writes the next step's into the same pinned buffers only after it; every decode graph
  // records it after its copies).
  int64_t *chainChosen = nullptr;
  size_t chainChosenCapacity = 0; // ids
  cudaEvent_t uploadsIssued = nullptr;
  bool chainQueued = false; // a chained step's copies may still be pending
  // The token choice's argmax parts (kc::sampleRowsWorkspaceBytes), sized at load.
  void *sampleWorkspace = nullptr;
  size_t sampleWorkspaceBytes = 0;
  int32_t *pinnedSlots = nullptr;  // and each decode row's state slot
  int32_t *rowSlots = nullptr;     // the device copy the KDA decode kernels index states with
  // A prefill step's cu_seqlens, {0, rows} per segment (pairs: one KDA launch per segment).
  int32_t *pinnedCuSeqlens = nullptr, *cuSeqlens = nullptr;
  // Stream 0 forks the other streams at the start of a GPU run and joins them at its end, so a
  // run is ordered after the token upload and a captured run is one graph on stream 0.
  cudaEvent_t forkEvent = nullptr;
  std::vector<cudaEvent_t> joinEvents; // per stream
  // A GPU KDA layer's inputs in a logged step (logKdaInputs), for replayKdaLog.
  struct LoggedKda {
    const fb::Dispatch *dispatch = nullptr;
    float *inputs = nullptr; // one allocation: qkv [T, 3P], forget, beta, gate, then an output
    size_t capacity = 0;
    float *qkv = nullptr, *forget = nullptr, *beta = nullptr, *gate = nullptr, *out = nullptr;
  };
  // Decode graphs per (GPU run, rows): a batch bucket. Everything a captured step reads from the
  // host must be in this key or in device memory: the rows' state slots, positions and block
  // tables are (uploaded each step with the token ids), and the attention kernels' launch shapes
  // depend only on the rows and the block-table width.
  bool cudaGraphs = true;
  // A step's inputs staged in pinned memory (token ids, state slots, positions, block tables),
  // each copied to its device buffer before the step's kernels: issued one copy at a time, or,
  // in a decode graph, captured as its first nodes, so that a replayed step is one launch and
  // its copies run back to back instead of a host call apart (~8-12 us each, H200).
  // A chained step's token ids come from the device (the previous step's choice): its source is
  // a device buffer.
  struct StagedUpload {
    void *device = nullptr;
    const void *source = nullptr; // pinned host memory, or device memory
    size_t bytes = 0;
    const char *what = "";
    bool operator==(const StagedUpload &o) const {
      return device == o.device && source == o.source && bytes == o.bytes;
    }
  };
  std::vector<StagedUpload> stagedUploads; // this step's, not yet issued or captured
  void stageUpload(void *device, const void *source, size_t bytes, const char *what) {
    stagedUploads.push_back({device, source, bytes, what});
  }
  // The token choice over `program`'s logits of `rows` rows: the sampling rows, the ids and the
  // workspace in this device's buffers.
  StatusOr<kc::SampleRowsParams> tokenChoiceOf(const fb::Program &program, int64_t rows) const;
  // Token ids from the host against the embedding's vocabulary.
  Status checkTokenIds(const cpu::StepContext &host, std::span<const int64_t> tokens) const;
  // Issues (or, while capturing, records) the staged copies on `stream` and clears them; then,
  // with `markUploaded`, records `uploadsIssued` (the pinned buffers may be rewritten after it).
  Status issueStagedUploads(cudaStream_t stream, bool markUploaded, bool capturing);
  // A decode graph and the staged copies captured in it (its first run's: the same source and
  // device buffers and sizes every step of a batch bucket, checked at each replay). A bucket
  // keeps the graphs of both a plain step (ids from pinned memory) and a chained one (ids on the
  // device), so that alternating between them does not capture again each step.
  struct DecodeGraph {
    cudaGraphExec_t exec = nullptr;
    std::vector<StagedUpload> uploads;
  };
  static constexpr size_t kDecodeGraphsPerBucket = 2;
  std::map<std::tuple<size_t, int64_t>, std::vector<DecodeGraph>> decodeGraphs;

  // ---- Prefill graphs (CudaPrefillGraphs.cpp) ----
  // Single-sequence prefill and verification calls of up to kPrefillGraphMaxRows rows (a
  // speculative pass: a token and its draft) replay graphs too. Their kernels bake in what the
  // decode graphs keep in device arrays: the KDA layers' state pointers (the slot) and the KDA
  // replay log's buffers, so a graph is keyed by those as well; the positions, block table,
  // cu_seqlens and token ids are uploaded into fixed buffers before every call.
  static constexpr int64_t kPrefillGraphMaxRows = 16;
  static constexpr size_t kPrefillGraphCapacity = 64; // least recently replayed ones destroyed
  bool prefillGraphs = true;
  struct PrefillGraphKey {
    size_t program = 0, run = 0;
    int64_t rows = 0;
    int32_t stateSlot = 0;
    bool decodeStep = false; // StepContext::decode: it picks the MoE experts' form
    bool logsKda = false;    // writes the KDA replay log (a verification pass)
    auto operator<=>(const PrefillGraphKey &) const = default;
  };
  struct PrefillGraph {
    cudaGraphExec_t exec = nullptr;
    std::list<PrefillGraphKey>::iterator recency;
    // The replay log's bookkeeping as the captured run left it (which dispatch each entry logs,
    // its buffers laid out for the rows): restored on replay, where no host code runs.
    std::vector<LoggedKda> logEntries;
  };
  std::map<PrefillGraphKey, PrefillGraph> prefillGraphExecs;
  std::list<PrefillGraphKey> prefillGraphRecency; // most recently replayed first
  // Keys run once, eagerly: that call allocates what the kernels need (the replay log,
  // cuBLASLt's algorithms, kernel attributes), so the second call can capture without allocating.
  std::set<PrefillGraphKey> warmedPrefillKeys;
  CudaGraphCounts graphCounts;
  // Whether this call of `program` can be captured and replayed: see CudaPrefillGraphs.cpp.
  bool prefillGraphSafe(const fb::Program &program, const cpu::StepContext &host,
                        const HiddenStates *hidden);
  // Runs GPU run `runIndex` of a graph-safe prefill call: eagerly on its key's first call,
  // captured on its second, replayed from then on.
  Status runPrefillGraph(const fb::Program &program, unsigned char *arena, size_t runIndex,
                         const cpu::StepContext &host);
  void destroyPrefillGraphs();

  ~Impl() {
    for (auto &[key, graphs] : decodeGraphs)
      for (DecodeGraph &graph : graphs)
        cudaGraphExecDestroy(graph.exec);
    destroyPrefillGraphs();
    for (cudaEvent_t event : events)
      cudaEventDestroy(event);
    for (cudaEvent_t event : joinEvents)
      cudaEventDestroy(event);
    if (forkEvent)
      cudaEventDestroy(forkEvent);
    if (uploadsIssued)
      cudaEventDestroy(uploadsIssued);
    cudaFree(chainChosen);
    cudaFreeHost(pinnedTokens);
    cudaFreeHost(pinnedChoices);
    cudaFreeHost(pinnedChosen);
    cudaFree(deviceChoices);
    cudaFree(deviceChosen);
    cudaFree(sampleWorkspace);
    cudaFreeHost(pinnedSlots);
    cudaFreeHost(pinnedCuSeqlens);
    for (LoggedKda &entry : kdaLog)
      cudaFree(entry.inputs);
    cudaFree(snapshots);
    for (auto &[id, record] : hiddenRecords)
      cudaFree(record.rows);
    for (auto &resources : streams)
      if (resources->stream)
        cudaStreamDestroy(resources->stream);
    for (auto &[index, pointer] : fp32Weights)
      cudaFree(pointer);
    for (auto &[index, pointer] : fp8WeightScales)
      cudaFree(pointer);
    for (auto &[dispatch, pointer] : kdaConvTaps)
      cudaFree(pointer);
    for (auto &[dispatch, pointer] : ropeFrequencies)
      cudaFree(pointer);
    cudaFreeHost(pinnedPositions);
    cudaFreeHost(pinnedSequences);
    cudaFreeHost(pinnedTables);
    releaseExpertLists();
    releaseContextParallel();
    releaseMoeAllToAll();
    for (auto &[dispatch, pointers] : expertPointers)
      cudaFree(pointers);
    cudaFree(kvPool);
    cudaFree(pool);
    cudaFree(weights);
  }

  const void *weight(int32_t index) const {
    return weights + plan->weights()->Get(static_cast<flatbuffers::uoffset_t>(index))->offset();
  }
  // A weight the GEMMs take: bf16, or FP8 with 128x128 block scales in shapes cuBLASLt's FP8
  // kernels accept (in % 16, out % 4; LinearFp8Params); row-major either way.
  bool gemmWeight(int32_t index) const {
    if (index < 0 ||
        plan->weights()->Get(static_cast<flatbuffers::uoffset_t>(index))->layout() !=
            fb::Layout::RowMajor)
      return false;
    return weightTypes[static_cast<size_t>(index)] == fb::DType::BF16 || fp8GemmWeight(index);
  }
  // A block dimension may be the whole (shorter) dimension: one block of fewer than 128, whose
  // scales are laid out as a 128-block's.
  bool fp8GemmWeight(int32_t index) const {
    const fb::Weight *w = plan->weights()->Get(static_cast<flatbuffers::uoffset_t>(index));
    if (weightTypes[static_cast<size_t>(index)] != fb::DType::F8_E4M3 ||
        w->quant() != fb::QuantKind::Fp8Block || w->scale() < 0 || !w->shape() ||
        w->shape()->size() != 2 || !w->block() || w->block()->size() != 2)
      return false;
    auto blockFits = [&](flatbuffers::uoffset_t axis) {
      const int64_t block = w->block()->Get(axis), size = w->shape()->Get(axis);
      return block == kc::kFp8BlockSize || (block == size && size < kc::kFp8BlockSize);
    };
    return blockFits(0) && blockFits(1) && w->shape()->Get(1) % 16 == 0 &&
           w->shape()->Get(0) % 4 == 0;
  }
  int64_t weightRows(int32_t index) const {
    return plan->weights()->Get(static_cast<flatbuffers::uoffset_t>(index))->shape()->Get(0);
  }
  bool runsOnGpu(const fb::Dispatch &dispatch) const;
  // A sharded plan's rank (LoadOptions::communicator), null in a world of one. With device
  // buffers (NCCL) the collectives are GPU steps on the plan's collective stream, captured in
  // decode graphs like any other; with host buffers (loopback, TCP: ranks sharing a GPU as
  // threads) they run on the cpu reference, staged through the host like its other steps.
  comm::Communicator *communicator = nullptr;
  // At load: whether this executor can run collective `dispatch` with its communicator.
  Status checkCollective(const fb::Program &program, const fb::Dispatch &dispatch) const;
  Status runAllReduceSum(const fb::Program &program, unsigned char *arena,
                         const fb::Dispatch &dispatch, StreamResources &resources, int64_t rows);
  Status runOnGpu(const fb::Program &program, unsigned char *arena, const fb::Dispatch &dispatch,
                  StreamResources &resources, const cpu::StepContext &host);
  Status runOnCpu(const fb::Program &program, const fb::Dispatch &dispatch, unsigned char *arena,
                  const cpu::StepContext &host);
  Status runKda(const fb::Program &program, unsigned char *arena, const fb::Dispatch &dispatch,
                StreamResources &resources, const cpu::StepContext &host);
  // A linear dispatch's GEMM in chunks of gemmChunkRows rows: its bf16 operands and split
  // products stay within kGemmChunkOutputFloats per half however many rows a prefill has (the
  // LM head's 8192 x 163,840 outputs took 10.7 GB of stream scratch in one GEMM).
  static constexpr int64_t kGemmChunkOutputFloats = int64_t(64) << 20;
  static int64_t gemmChunkRows(int64_t rows, int64_t out) {
    return std::clamp<int64_t>(kGemmChunkOutputFloats / std::max<int64_t>(1, out), 1,
                               std::max<int64_t>(1, rows));
  }
  Status gemmInRowChunks(StreamResources &resources, const float *x, int64_t xStride,
                         int32_t weightIndex, float *y, int64_t yStride, int64_t rows,
                         int64_t in, int64_t out) {
    const int64_t chunk = gemmChunkRows(rows, out);
    for (int64_t first = 0; first < rows; first += chunk)
      HYBRID_RETURN_IF_ERROR(gemm(resources, x + first * xStride, xStride, weightIndex,
                                  y + first * yStride, yStride, std::min(chunk, rows - first),
                                  in, out));
    return Status::ok();
  }
  Status gemm(StreamResources &resources, const float *x, int64_t xStride, int32_t weightIndex,
              float *y, int64_t yStride, int64_t rows, int64_t in, int64_t out);
  // One GEMM of a group (gemm's arguments but the shared rows).
  struct GemmCall {
    const float *x;
    int64_t xStride;
    int32_t weightIndex;
    float *y;
    int64_t yStride, in, out;
  };
  // A layer's GEMMs that read nothing another one of them writes (its projections of one
  // input): at decode rows of bf16 weights one launch for all (LinearContext::runGroup; the
  // outputs bit-identical to gemm's), else gemm each in turn. A launch-level grouping inside
  // the dispatch: each launch costs a few microseconds of latency in a decode step.
  Status gemmGroup(StreamResources &resources, std::span<const GemmCall> calls, int64_t rows);
  // A bf16 call within the scratch planned at load: gemmGroup may launch it with others.
  bool groupable(const StreamResources &resources, const GemmCall &call, int64_t rows) const;
  // A call of `rows` as gemmGroup hands it to the linear context.
  kc::LinearParams linearParams(StreamResources &resources, const GemmCall &call,
                                int64_t rows) const;
  // Whether gemmGroup and gemm run the call on the decode GEMV (bf16 weight, decode rows, its
  // shapes): then a kernel that reproduces that kernel's sums may compute it instead.
  bool runsOnDecodeGemv(StreamResources &resources, const GemmCall &call, int64_t rows) const;
  // At load: a small weight's fp32 values on the device (fp32Weights), once; -1 is no weight.
  Status uploadSmallWeight(int32_t index, const HostWeights &hostWeights);
  // At load: an FP8 weight's scales in cuBLASLt's layout, and the scratch its GEMMs need.
  Status prepareFp8Weight(int32_t index, int64_t rows,
                          const HostWeights &hostWeights);
  // At load: an FP8 weight's scales in cuBLASLt's layout (fp8WeightScales), once.
  Status uploadFp8WeightScales(int32_t index, const HostWeights &hostWeights);
  StreamResources &streamOf(const fb::Dispatch &dispatch) {
    return *streams[static_cast<size_t>(std::max(0, dispatch.stream())) % streams.size()];
  }
  // Launches a GPU run's steps on the plan's streams. While `capturing`, waits on events that
  // were recorded before the run are dropped: the cpu step before it synchronized the device.
  Status launchRun(const fb::Program &program, unsigned char *arena, const StepRun &run,
                   const cpu::StepContext &host, HiddenStates *hidden, bool capturing);
  // cu_seqlens {0, tokens} of each segment's one-sequence KDA prefill (pair i at 2 i), from
  // pinned memory on stream 0 (the runs fork from it); the previous upload finished with its
  // step's synchronization.
  Status uploadCuSeqlens(std::span<const int64_t> segmentTokens) {
    for (size_t i = 0; i < segmentTokens.size(); ++i) {
      pinnedCuSeqlens[2 * i] = 0;
      pinnedCuSeqlens[2 * i + 1] = static_cast<int32_t>(segmentTokens[i]);
    }
    return cudaStatus(cudaMemcpyAsync(cuSeqlens, pinnedCuSeqlens,
                                      2 * segmentTokens.size() * sizeof(int32_t),
                                      cudaMemcpyHostToDevice, streams[0]->stream),
                      "cu_seqlens upload");
  }
  // A KDA layer's weights and `stateSlot`'s state pointers, for its kernels.
  kc::KdaLayerCall layerCall(const fb::Dispatch &dispatch, int32_t stateSlot) const;
  // Keeps copies of a KDA prefill's inputs (a logged step: Model::verifyDraft) for replayKdaLog.
  // Each entry holds at least kPrefillGraphMaxRows rows from its first use, so that the graphs
  // of verification passes, which write into it, stay valid as pass sizes vary.
  Status logKdaInputs(const fb::Dispatch &dispatch, const kc::KdaLayerCall &call, int64_t rows,
                      StreamResources &resources);
  std::vector<LoggedKda> kdaLog; // reused across logged steps
  size_t kdaLogUsed = 0;
  int64_t kdaLogRows = 0;
  // Replays the run's graph for this slot, capturing it the first time.
  Status replayRun(const fb::Program &program, unsigned char *arena, size_t runIndex,
                   const cpu::StepContext &host);

  // ---- MLA and DSA layers (CudaAttention.cpp) ----
  // The KV pools of the layers whose attention runs on the GPU (all of a layer's MLA and indexer
  // dispatches have GPU kernels, or none runs there). The host PagedKvCache still hands out,
  // shares and copies pages and counts lengths; the rows live only here, its page copies are
  // repeated here (prepareKvStep) and its lengths advanced after each step (finishKvStep).
  std::vector<DeviceKvLayer> kvLayers; // per CacheSpec.kv slot
  bool kvOnGpu = false;
  unsigned char *kvPool = nullptr;
  int64_t pageTokens = 0;
  int32_t maxPages = 0; // block-table width: pages of the longest sequence (maxContextTokens)
  // Per row of a step: its token's position and block-table row; the tables [rows, maxPages]
  // (one row in a prefill). Device copies in `pool`, staged in pinned memory.
  int32_t *rowPositions = nullptr, *rowSequences = nullptr, *blockTables = nullptr;
  int32_t *pinnedPositions = nullptr, *pinnedSequences = nullptr, *pinnedTables = nullptr;
  // The positions of the rows a step writes to the pools: the rows' own (rowPositions), or in a
  // context-parallel prefill every rank's rows of the step (stepPositions, device and pinned;
  // rowPositions are then this rank's).
  int32_t *stepPositions = nullptr, *pinnedStepPositions = nullptr;
  const int32_t *writePositions = nullptr;
  // Where a step's `rows` tokens go in the pools: their positions and block-table rows.
  kc::PagedTokens stepTokens(int64_t rows) const {
    return {static_cast<int32_t>(rows), writePositions ? writePositions : rowPositions,
            rowSequences, blockTables, maxPages, static_cast<int32_t>(pageTokens)};
  }
  std::map<const fb::Dispatch *, float *> ropeFrequencies; // per dispatch that rotates
  // Kernel configurations tuned for this GPU, looked up per launch shape (CudaTuning.cpp).
  std::unique_ptr<kernels::tuning::TuningTable> tuning;
  // LoadOptions::tuningCache opened for this GPU.
  Status openTuning(const std::string &setting);
  // The tuned configuration of the launch's shape bucket set on `params`; none: its defaults.
  void applyTuning(kc::IndexerParams &params);
  void applyTuning(kc::SparseMlaDecodeParams &params);
  void applyTuning(kc::MoeExpertsParams &params);
  void applyTuning(kc::KdaDecodeParams &params);
  std::vector<std::vector<const fb::Dispatch *>> kvWriters; // per program: GPU MLA dispatches

  // At load, before placement: which KV layers run on the GPU, and their pools.
  Status planKvLayers(const fb::Plan &plan, PagedKvCache &kvCache, const LoadOptions &options,
                      int64_t maxRows);
  bool attentionRunsOnGpu(const fb::Dispatch &dispatch) const;
  bool indexerPrologFits(const fb::Dispatch &dispatch) const; // IndexerQuery / IndexerKey
  // At load, for a GPU attention dispatch: its small weights, RoPE frequencies and kv_b_proj on
  // the device, and the scratch it needs (floats per stream, GEMM input / output widths).
  Status prepareAttention(const fb::Dispatch &dispatch, const fb::Program &program, int64_t rows,
                          const HostWeights &hostWeights, size_t &floats,
                          size_t &xWidth, size_t &outWidth);
  Status runAttention(const fb::Program &program, unsigned char *arena, const fb::Dispatch &dispatch,
                      StreamResources &resources, const cpu::StepContext &host);
  Status runMla(const fb::Program &program, unsigned char *arena, const fb::Dispatch &dispatch,
                StreamResources &resources, const cpu::StepContext &host);
  Status runDsaIndexer(const fb::Program &program, unsigned char *arena,
                       const fb::Dispatch &dispatch, StreamResources &resources,
                       const cpu::StepContext &host);
  // Per step, before any launch: the rows' pages made writable (their copies repeated on the
  // pools), positions and block tables uploaded. After the step: the host lengths advanced.
  Status prepareKvStep(const cpu::StepContext &host);
  // Repeats the host cache's page copies since the last call on the pools, in order (stream 0).
  Status flushPageCopies(PagedKvCache &cache);
  Status finishKvStep(size_t programIndex, const cpu::StepContext &host);

  // ---- Context parallelism (CudaContextParallel.cpp, docs/parallelism.md) ----
  int tensorParallel = 1, contextParallel = 1; // the plan's layout
  // Communicators of the groups narrower than the world, split from it at load (the groups this
  // rank is in); a group spanning the world uses `communicator` itself.
  std::unique_ptr<comm::Communicator> tensorGroup, contextGroup;
  // cu_seqlens {0, n0, n0 + n1} of this rank's two chunks in a context-parallel prefill (the KDA
  // kernels' two-sequence form), device and pinned.
  int32_t *chunkCuSeqlens = nullptr, *pinnedChunkCuSeqlens = nullptr;
  // At load: the layout, the group communicators, the buffers above.
  Status prepareContextParallel(const LoadOptions &options, int64_t maxRows);
  void releaseContextParallel();
  int groupSize(fb::CollectiveGroup group) const {
    return group == fb::CollectiveGroup::ContextParallel ? contextParallel : tensorParallel;
  }
  // The communicator of `group` (null for a group of one rank, which needs none).
  comm::Communicator *groupCommunicator(fb::CollectiveGroup group) const;
  // Per context-parallel prefill step, on stream 0 before its runs: this rank's token ids (the
  // ids value holds this rank's rows) and its chunks' cu_seqlens.
  Status prepareContextStep(const cpu::StepContext &host, std::span<const int64_t> tokens,
                            unsigned char *arena, const fb::Program &program);
  // A dispatch's own context: in a context-parallel prefill its rows are those of its first
  // output (plan.fbs ValueRows), as on the cpu device.
  static cpu::StepContext dispatchContext(const cpu::StepContext &host, const fb::Program &program,
                                          const fb::Dispatch &dispatch);
  Status runAllGatherRows(const fb::Program &program, unsigned char *arena,
                          const fb::Dispatch &dispatch, StreamResources &resources,
                          const cpu::StepContext &host);
  // Every context rank's rows of `mine` (this rank's, `width` floats each) into `out` at their
  // positions in the step, or with `tail` > 0 only each chunk's last `tail` rows (the rest
  // zero; this rank's own rows whole). `scratch`: gatherScratchFloats of device memory.
  Status gatherShardRows(comm::Communicator &group, const cpu::ContextShard &shard,
                         const float *mine, int64_t width, int64_t tail, float *out,
                         float *scratch, cudaStream_t stream);
  // A gather's scratch: the `slots` rows each rank sends, then every rank's.
  static int64_t gatherScratchFloats(int contextParallel, int64_t slots, int64_t width) {
    return pad(slots * width) + pad(int64_t(contextParallel) * slots * width);
  }
  // A hidden-state dump's rows of this rank, gathered into the step's order (host).
  StatusOr<std::vector<float>> gatherHiddenRows(const cpu::StepContext &host, const float *mine,
                                                int64_t width);
  // The q/k/v, forget, beta and gate projections of `rows` rows of a KDA layer's input into
  // the stream's scratch (qkv [rows, 3P], forget [rows, P], beta [rows, H], gate [rows, P]),
  // room for o [rows, P]; `next`: the scratch after them.
  struct KdaProjections {
    float *qkv = nullptr, *forget = nullptr, *beta = nullptr, *gate = nullptr, *o = nullptr;
    float *next = nullptr;
  };
  StatusOr<KdaProjections> projectKda(const fb::Dispatch &dispatch, StreamResources &resources,
                                      const float *x, int64_t dModel, int64_t rows);
  // KdaContextSummary and the context-parallel KdaChunkPrefill (inputs x, x_tails, summaries).
  Status runKdaContext(const fb::Program &program, unsigned char *arena,
                       const fb::Dispatch &dispatch, StreamResources &resources,
                       const cpu::StepContext &host);
  // Scratch floats and KDA workspace bytes of those two over `rows` rows.
  void kdaContextScratch(const fb::Dispatch &dispatch, int64_t rows, size_t &floats,
                         size_t &workspaceBytes) const;
  Status runMlaCacheRows(const fb::Program &program, unsigned char *arena,
                         const fb::Dispatch &dispatch, StreamResources &resources,
                         const cpu::StepContext &host);
  // The conv history a KDA chunk starting at step row `begin` starts from ([3, W - 1, P]): the
  // projections of the gathered tails before it, for positions before the step the slot's
  // history before the step (`convBefore`).
  Status kdaHistory(const fb::Dispatch &dispatch, StreamResources &resources, const float *tails,
                    int64_t dModel, int64_t begin, const float *convBefore, float *history);

  // ---- MoE (CudaMoe.cpp) ----
  // Per MoeExperts dispatch: device arrays of its experts' gate, up and down weight pointers.
  std::map<const fb::Dispatch *, const void **> expertPointers;
  // The grouped form's host round trip: each row's experts and weights down, per-expert token
  // lists and weights up (pinned, and their device copies in `pool`).
  int32_t *pinnedExpertIds = nullptr, *pinnedExpertTokens = nullptr;
  float *pinnedExpertWeights = nullptr, *pinnedListWeights = nullptr;
  int32_t *expertTokens = nullptr;
  float *expertListWeights = nullptr;
  size_t expertListCapacity = 0; // entries (rows x top-k) the buffers above hold
  void releaseExpertLists() {
    cudaFreeHost(pinnedExpertIds);
    cudaFreeHost(pinnedExpertTokens);
    cudaFreeHost(pinnedExpertWeights);
    cudaFreeHost(pinnedListWeights);
    cudaFree(expertTokens);
    cudaFree(expertListWeights);
    pinnedExpertIds = pinnedExpertTokens = expertTokens = nullptr;
    pinnedExpertWeights = pinnedListWeights = expertListWeights = nullptr;
    expertListCapacity = 0;
  }
  bool moeRunsOnGpu(const fb::Dispatch &dispatch) const;
  // Whether this step of `dispatch` groups its tokens by expert on the host: the router's
  // choices come down mid-step, so no graph can hold it.
  bool moeGroupsOnHost(const fb::Program &program, const fb::Dispatch &dispatch,
                       const cpu::StepContext &host);
  // A moe_experts dispatch's weight index of expert e's matrix m (0 gate, 1 up, 2 down); -1 for
  // an expert another expert-parallel rank holds.
  static int32_t expertWeight(const fb::Dispatch &dispatch, int64_t e, int m) {
    return dispatch.weights()->Get(static_cast<flatbuffers::uoffset_t>(3 * e + m));
  }
  // The type of the experts this rank holds (bf16 or FP8 with block scales, all alike, each
  // expert whole or absent), BF16 when it holds none; nullopt when the GPU forms cannot run them.
  std::optional<fb::DType> expertWeightType(const fb::Dispatch &dispatch) const;
  Status prepareMoe(const fb::Dispatch &dispatch, const fb::Program &program, int64_t rows,
                    bool decodeProgram, const HostWeights &hostWeights,
                    size_t &floats, size_t &xWidth, size_t &outWidth);
  Status runRouter(const fb::Program &program, unsigned char *arena, const fb::Dispatch &dispatch,
                   StreamResources &resources, const cpu::StepContext &host);
  Status runMoeExperts(const fb::Program &program, unsigned char *arena,
                       const fb::Dispatch &dispatch, StreamResources &resources,
                       const cpu::StepContext &host);
  // How routed experts run: per (token, expert) pair on CUDA cores, grouped by expert on tensor
  // cores (bf16), or grouped on the host around the GEMMs.
  enum class MoeForm { PerToken, TensorCores, HostGrouped };
  // What every form takes from the dispatch: shapes, the experts' pointers, type and activation.
  kc::MoeExpertsParams moeExpertsParams(const fb::Dispatch &dispatch, int64_t hidden) const;
  // The form the step's (token, expert) pairs choose for experts of `params` (its topK the
  // step's): an unsharded run's, whatever rows this rank holds. Sets `perTokenMaxPairs` to a
  // tuned threshold where one applies.
  MoeForm moeForm(const kc::MoeExpertsParams &params, const cpu::StepContext &host,
                  int32_t &perTokenMaxPairs);
  // `params`' rows in `form` on `resources`' stream; the per-token and tensor-core forms'
  // workspace is params.workspace, `workspaceBytes` of it (the host-grouped form uses the
  // stream's scratch).
  Status launchMoeForm(const fb::Dispatch &dispatch, const kc::MoeExpertsParams &params,
                       MoeForm form, size_t workspaceBytes, StreamResources &resources);
  Status runHostGroupedExperts(const fb::Dispatch &dispatch, const kc::MoeExpertsParams &params,
                               StreamResources &resources);

  // ---- Experts over the context ranks (CudaMoeAllToAll.cpp, docs/parallelism.md) ----
  // A cp=N,ep=N prefill's moe_experts (MoeParams.all_to_all): this rank's rows go to the ranks
  // holding their experts and come back over the context group's communicator, in two chunks
  // whose exchanges overlap the other chunk's experts. The experts run on `expertStream` (a
  // stream of the executor's own, with its own scratch), the exchanges on the dispatch's.
  std::unique_ptr<StreamResources> expertStream;
  bool needsExpertStream = false; // set by prepareMoeAllToAll, read when the pool is allocated
  // Per chunk: its rows arrived (exchange stream), its experts' results are ready (expert stream).
  cudaEvent_t chunkReceived[2] = {}, chunkComputed[2] = {};
  // The destination lists of this rank's pairs (kc::MoeRouteToRanksParams) for up to
  // `exchangePairs` pairs, the ranks' counts gathered (device and pinned).
  int32_t *exchangeSlots = nullptr, *exchangePairLists = nullptr;
  float *exchangeCounts = nullptr, *exchangeAllCounts = nullptr, *pinnedAllCounts = nullptr;
  int64_t exchangePairs = 0;
  // The exchange buffers, grown on demand: their size depends on how the router spreads the rows.
  unsigned char *exchangeBuffers = nullptr;
  size_t exchangeBytes = 0;
  // At load, for an all_to_all dispatch on the GPU: the layout and the experts this rank holds
  // checked, the buffers above for `rows` rows per step.
  Status prepareMoeAllToAll(const fb::Dispatch &dispatch, int64_t rows);
  Status createExpertStream(unsigned char *scratchBase);
  Status runMoeAllToAll(const fb::Program &program, unsigned char *arena,
                        const fb::Dispatch &dispatch, StreamResources &resources,
                        const cpu::StepContext &host);
  void releaseMoeAllToAll();
};

inline const fb::Value &valueOf(const fb::Program &program, int32_t index) {
  return *program.values()->Get(static_cast<flatbuffers::uoffset_t>(index));
}

inline uint64_t valueBytes(const fb::Value &value, int64_t rows) {
  return static_cast<uint64_t>(rows * value.row_elements()) * dtypeByteSize(value.dtype());
}


} // namespace hybrid::cudadev
