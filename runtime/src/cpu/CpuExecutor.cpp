#include "cpu/CpuExecutor.h"

#include "hybrid/kernels/ref/AttnRes.h"
#include "hybrid/kernels/ref/Dsa.h"
#include "hybrid/kernels/ref/Kda.h"
#include "hybrid/kernels/ref/Linear.h"
#include "hybrid/kernels/ref/Mla.h"
#include "hybrid/kernels/ref/Moe.h"
#include "hybrid/kernels/ref/Norm.h"
#include "hybrid/kernels/ref/Quant.h"
#include "hybrid/runtime/ContextParallel.h" // zigzagPositions, moeExpertParallel
#include "hybrid/runtime/WeightArchive.h"
#include "runtime/schema/kernel_signatures.h"

#include <algorithm>
#include <optional>
#include <cmath>
#include <string>

namespace hybrid::cpu {
namespace {

namespace fb = plan::fb;
namespace ref = kernels::ref;

std::string kernelName(fb::KernelId kernel) {
  const plan::KernelSignature *signature = plan::kernelSignature(kernel);
  return signature ? std::string(signature->name) : "kernel " + std::to_string(int(kernel));
}

// Rows of a value in this step (plan.fbs ValueRows): all the step's outside a context-parallel
// prefill.
int64_t rowsOf(const StepContext &context, const fb::Value &value) {
  if (!context.contextShard)
    return context.rows;
  const ContextShard &shard = *context.contextShard;
  switch (value.rows()) {
  case fb::ValueRows::ContextShard:
    return static_cast<int64_t>(shard.rows.size());
  case fb::ValueRows::ContextChunks:
    return 2;
  case fb::ValueRows::AllContextChunks:
    return 2 * int64_t(shard.size);
  default:
    return shard.stepRows;
  }
}

// The step's rows (every context rank's) that attention layers append to their caches.
int64_t stepRows(const StepContext &context) {
  return context.contextShard ? context.contextShard->stepRows : context.rows;
}

template <typename T>
StatusOr<std::span<T>> valueAs(const StepContext &context, int32_t index, fb::DType dtype) {
  const auto *values = context.program->values();
  if (!values || index < 0 || index >= static_cast<int32_t>(values->size()))
    return Status::error("value " + std::to_string(index) + " is not in the program");
  const fb::Value *value = values->Get(index);
  if (value->dtype() != dtype)
    return Status::error("value " + std::to_string(index) + " (" +
                         (value->name() ? value->name()->str() : std::string()) +
                         ") has dtype " + fb::EnumNameDType(value->dtype()) + ", expected " +
                         fb::EnumNameDType(dtype));
  return context.arena->viewAs<T>(value->arena_offset(),
                                  static_cast<uint64_t>(rowsOf(context, *value) *
                                                        value->row_elements()));
}

int64_t rowElements(const StepContext &context, int32_t index) {
  return context.program->values()->Get(index)->row_elements();
}

// A GEMM operand: the fp32 weight as stored (row-major or tiled) and its layout.
struct GemmWeight {
  std::span<const float> data;
  const WeightLayout *layout = nullptr;
};

// The dispatch's weights, resolved to fp32 spans (empty span for an absent optional weight).
struct Weights {
  std::vector<std::span<const float>> spans;
  std::vector<const WeightLayout *> layouts;
  // Row-major use (norm weights, conv taps, tables).
  std::span<const float> operator[](size_t role) const {
    return role < spans.size() ? spans[role] : std::span<const float>();
  }
  GemmWeight gemm(size_t role) const {
    return role < spans.size() ? GemmWeight{spans[role], layouts[role]} : GemmWeight{};
  }
  bool has(size_t role) const { return role < spans.size() && !spans[role].empty(); }
  // How an FP8 weight's GEMM quantizes its input; nullopt for other weights.
  std::optional<ref::Fp8ScaleRule> fp8Activations(size_t role) const {
    return role < layouts.size() && layouts[role] ? layouts[role]->fp8Activations : std::nullopt;
  }
};

Weights resolveWeights(const StepContext &context, const fb::Dispatch &dispatch) {
  Weights weights;
  if (!dispatch.weights())
    return weights;
  for (int32_t index : *dispatch.weights()) {
    weights.spans.push_back(index >= 0 ? std::span<const float>((*context.weights)[index])
                                       : std::span<const float>());
    weights.layouts.push_back(index >= 0 ? &(*context.weightLayouts)[index] : nullptr);
  }
  return weights;
}

// y = x Wᵀ reading W as the plan stores it: tiled weights go straight to the tiled GEMM.
void linear(std::span<const float> x, GemmWeight weight, std::span<float> y, int64_t rows,
            int64_t in, int64_t out) {
  if (weight.layout && weight.layout->fp8Activations) // FP8 weights are never tiled
    ref::linearFp8Activations(x, weight.data, y, rows, in, out, *weight.layout->fp8Activations);
  else if (weight.layout && weight.layout->tiled)
    ref::linearTiled(x, weight.data, y, rows, *weight.layout->tiled);
  else
    ref::linear(x, weight.data, y, rows, in, out);
}

std::vector<float> project(std::span<const float> x, GemmWeight weight, int64_t rows, int64_t in,
                           int64_t out) {
  std::vector<float> y(static_cast<size_t>(rows * out));
  linear(x, weight, y, rows, in, out);
  return y;
}

// Positions in the sequence of the dispatch's rows.
std::vector<int64_t> positions(const StepContext &context) {
  std::vector<int64_t> result(context.rows);
  for (int64_t t = 0; t < context.rows; ++t)
    result[t] = context.firstPosition +
                (context.rowOffsets.empty() ? t : context.rowOffsets[size_t(t)]);
  return result;
}

} // namespace

ref::RopeLayout ropeLayout(const fb::Rope *rope) {
  if (!rope || rope->kind() == fb::RopeKind::None)
    return ref::RopeLayout::None;
  return rope->pairing() == fb::RopePairing::HalfSplit ? ref::RopeLayout::HalfSplit
                                                       : ref::RopeLayout::Interleaved;
}

std::vector<float> ropeFrequencies(const fb::Rope *rope, int64_t rotaryDim) {
  if (!rope || rope->kind() == fb::RopeKind::None || rotaryDim == 0)
    return std::vector<float>(rotaryDim / 2, 0.0f);
  if (rope->kind() == fb::RopeKind::Yarn)
    return ref::yarnInverseFrequencies(
        rotaryDim, rope->theta(),
        ref::YarnConfig{rope->factor(), rope->original_max_position(), rope->beta_fast(),
                        rope->beta_slow(), rope->mscale(), rope->mscale_all_dim()});
  return ref::ropeInverseFrequencies(rotaryDim, rope->theta());
}

namespace {

// MXFP8 round trip of rows of `cols` values: the values a kernel reading the E4M3 elements and
// E8M0 scales sees, bit-exact to the definitions in kernels/ref/Quant.h.
Status roundTripMxfp8(std::span<float> values, int64_t rows, int64_t cols) {
  if (!ref::roundTripMxfp8(values, rows, cols, ref::MxScaleRule::RoundUp))
    return Status::error("MXFP8 needs rows of a multiple of 32 values, got " +
                         std::to_string(cols));
  return Status::ok();
}

// The indexer's activations rounded as the plan's `quantize` says, in rows of `cols` values (a
// query head, a key): MXFP8, or DeepSeek-V3.2's FP8 (E4M3, one ue8m0 power-of-two scale a row,
// MODEL_SPEC 4.3: what a kernel reading the codes and the scale sees).
Status roundIndexerActivation(fb::ActivationQuant quant, std::span<float> values, int64_t rows,
                              int64_t cols) {
  if (quant == fb::ActivationQuant::Mxfp8)
    return roundTripMxfp8(values, rows, cols);
  if (quant != fb::ActivationQuant::Fp8PerRow)
    return Status::ok();
  if (!ref::roundTripFp8Tiles(values, rows, cols, cols, ref::Fp8ScaleRule::DeepSeekUe8m0))
    return Status::error("FP8 rows of " + std::to_string(cols) + " values failed to quantize");
  return Status::ok();
}

// FP8 KV row round trip (FlashMLA V32 layout): the latent as E4M3 with a power-of-two scale per
// tile, the rope key as bf16.
Status roundTripFp8KvRow(std::span<float> latent, std::span<float> rope, int64_t tile) {
  std::vector<uint8_t> row(static_cast<size_t>(
      ref::kvRowBytes(static_cast<int64_t>(latent.size()), static_cast<int64_t>(rope.size()),
                      tile)));
  if (!ref::packFp8KvRow(latent, rope, row, tile) || !ref::unpackFp8KvRow(row, latent, rope, tile))
    return Status::error("cannot quantize a KV row of " + std::to_string(latent.size()) + "+" +
                         std::to_string(rope.size()) + " values in tiles of " +
                         std::to_string(tile));
  return Status::ok();
}

// Staged rows of a KV slot for this step: [rows, rowElements], zero-filled on first use.
std::span<float> staging(const StepContext &context, int32_t kvSlot) {
  const KvLayerShape &shape = context.kvCache->layerShape(kvSlot);
  std::vector<float> &rows = (*context.kvStaging)[kvSlot];
  rows.assign(static_cast<size_t>(stepRows(context) * shape.rowElements()), 0.0f);
  return rows;
}

// Past positions of a KV slot followed by this step's staged rows, one part of each row.
enum class KvPart { Latent, Rope, IndexKey };
StatusOr<std::vector<float>> pastAndCurrent(const StepContext &context, int32_t kvSlot,
                                            KvPart part, std::span<const float> staged) {
  const KvLayerShape &shape = context.kvCache->layerShape(kvSlot);
  const int64_t past = context.kvCache->length(kvSlot, context.kvSequence);
  const int64_t begin = part == KvPart::Latent ? 0
                        : part == KvPart::Rope ? shape.latentDim
                                               : shape.latentDim + shape.ropeDim;
  const int64_t width = part == KvPart::Latent ? shape.latentDim
                        : part == KvPart::Rope ? shape.ropeDim
                                               : shape.indexKeyDim;
  const int64_t current = static_cast<int64_t>(staged.size()) / shape.rowElements();
  std::vector<float> out(static_cast<size_t>((past + current) * width));
  if (past > 0) {
    HYBRID_ASSIGN_OR_RETURN(KvSequenceView view,
                            context.kvCache->view(kvSlot, context.kvSequence, past));
    std::span<float> head(out.data(), static_cast<size_t>(past * width));
    Status status = part == KvPart::Latent ? view.gatherLatents(head)
                    : part == KvPart::Rope ? view.gatherRopeKeys(head)
                                           : view.gatherIndexKeys(head);
    HYBRID_RETURN_IF_ERROR(status);
  }
  for (int64_t t = 0; t < current; ++t)
    std::copy_n(staged.data() + t * shape.rowElements() + begin, width,
                out.data() + (past + t) * width);
  return out;
}

Status runEmbed(const StepContext &c, const fb::Dispatch &d, const Weights &w) {
  HYBRID_ASSIGN_OR_RETURN(std::span<int64_t> ids, valueAs<int64_t>(c, d.inputs()->Get(0),
                                                                     fb::DType::I64));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> out, floatValue(c, d.outputs()->Get(0)));
  const int64_t width = rowElements(c, d.outputs()->Get(0));
  const int64_t vocab = static_cast<int64_t>(w[0].size()) / width;
  for (int64_t t = 0; t < c.rows; ++t) {
    if (ids[t] < 0 || ids[t] >= vocab)
      return Status::error("token id " + std::to_string(ids[t]) + " at position " +
                           std::to_string(positions(c)[size_t(t)]) +
                           " is outside the vocabulary [0, " +
                           std::to_string(vocab) + ")");
    std::copy_n(w[0].data() + ids[t] * width, width, out.data() + t * width);
  }
  return Status::ok();
}

enum KdaRole { Q, Kp, V, QConv, KConv, VConv, FA, FB, ALog, DtBias, B, GA, GB, G, ONorm, O };

// What the delta rule reads for T rows of x (the prolog every KDA kernel shares): the q, k, v
// projections before the conv, q, k, v after it (SiLU, q and k L2-normalized), the gate g and
// beta. `history` [3][W - 1, P] holds each projection's inputs of the W - 1 tokens before the rows
// and is replaced by those after them.
struct KdaProlog {
  std::vector<float> preQ, preK, preV, q, k, v, g, beta;
};

KdaProlog kdaProlog(const fb::KdaParams *p, const Weights &w, std::span<const float> x, int64_t T,
                    int64_t dModel, std::span<float> history) {
  const int64_t H = p->num_heads(), K = p->head_dim(), P = H * K, W = p->conv_kernel();
  const size_t span = static_cast<size_t>((W - 1) * P);
  KdaProlog r;
  r.q.resize(T * P);
  r.k.resize(T * P);
  r.v.resize(T * P);
  r.preQ = project(x, w.gemm(Q), T, dModel, P);
  r.preK = project(x, w.gemm(Kp), T, dModel, P);
  r.preV = project(x, w.gemm(V), T, dModel, P);
  ref::shortConvSilu(r.preQ, w[QConv], history.subspan(0, span), r.q, T, P, W);
  ref::shortConvSilu(r.preK, w[KConv], history.subspan(span, span), r.k, T, P, W);
  ref::shortConvSilu(r.preV, w[VConv], history.subspan(2 * span, span), r.v, T, P, W);
  ref::l2NormalizeRows(r.q, T * H, K);
  ref::l2NormalizeRows(r.k, T * H, K);

  const int64_t gateRank = w.gemm(FA).layout->rows;
  std::vector<float> f =
      project(project(x, w.gemm(FA), T, dModel, gateRank), w.gemm(FB), T, gateRank, P);
  r.g.resize(T * P);
  std::optional<float> lowerBound;
  if (p->gate() == fb::KdaGate::LowerBound)
    lowerBound = p->gate_lower_bound();
  ref::kdaGate(f, w[ALog], w[DtBias], r.g, T, H, K, lowerBound);
  r.beta = project(x, w.gemm(B), T, dModel, H);
  ref::kdaBeta(r.beta);
  return r;
}

ref::KdaParams kdaCore(const fb::KdaParams *p, int64_t T, KdaProlog &in, float *state, float *o) {
  const int64_t H = p->num_heads(), K = p->head_dim();
  return ref::KdaParams{T, H, K, K, 0.0f, in.q.data(), in.k.data(), in.v.data(),
                        in.g.data(), in.beta.data(), state, o};
}

// The delta rule's output o [T, P] through the gated RMSNorm and the output projection.
void kdaEpilog(const fb::KdaParams *p, const Weights &w, std::span<const float> x, int64_t T,
               int64_t dModel, std::vector<float> &o, std::span<float> out) {
  const int64_t P = p->num_heads() * p->head_dim();
  std::vector<float> gate;
  if (w.has(G)) {
    gate = project(x, w.gemm(G), T, dModel, P);
  } else {
    const int64_t outRank = w.gemm(GA).layout->rows;
    gate = project(project(x, w.gemm(GA), T, dModel, outRank), w.gemm(GB), T, outRank, P);
  }
  ref::gatedRmsNorm(o, gate, w[ONorm], o, T * p->num_heads(), p->head_dim(), p->norm_epsilon());
  linear(o, w.gemm(O), out, T, P, dModel);
}

// ---- Context-parallel KDA prefill: the state-passing scan over the step's 2N chunks.

// Each projection's inputs of the W - 1 tokens before step row `begin` ([3][W - 1, P], oldest
// first): rows of the step from the gathered chunk tails (`tails`: Step rows, every chunk's last
// W - 1 rows filled), earlier ones from the conv state before the step.
std::vector<float> kdaHistoryBefore(const fb::KdaParams *p, const Weights &w,
                                    std::span<const float> tails, int64_t dModel, int64_t begin,
                                    std::span<const float> convBefore) {
  const int64_t P = p->num_heads() * p->head_dim(), n = p->conv_kernel() - 1;
  std::vector<float> history(static_cast<size_t>(3 * n * P));
  if (n == 0)
    return history;
  std::vector<float> rows(static_cast<size_t>(n * dModel), 0.0f);
  for (int64_t j = 0; j < n; ++j)
    if (const int64_t position = begin - n + j; position >= 0)
      std::copy_n(tails.data() + position * dModel, dModel, rows.data() + j * dModel);
  for (int projection = 0; projection < 3; ++projection) {
    const std::vector<float> pre =
        project(rows, w.gemm(projection == 0 ? Q : projection == 1 ? Kp : V), n, dModel, P);
    float *to = history.data() + projection * n * P;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t position = begin - n + j;
      const float *from = position >= 0 ? pre.data() + j * P
                                        : convBefore.data() + projection * n * P + (n + position) * P;
      std::copy_n(from, P, to + j * P);
    }
  }
  return history;
}

struct KdaContextInputs {
  std::span<float> x;     // this rank's rows
  std::span<float> tails; // Step rows: every chunk's last W - 1 rows
  int64_t dModel = 0;
};

StatusOr<KdaContextInputs> kdaContextInputs(const StepContext &c, const fb::Dispatch &d) {
  if (!c.contextShard)
    return Status::error("a context-parallel KDA step outside a context-parallel prefill");
  KdaContextInputs in;
  HYBRID_ASSIGN_OR_RETURN(in.x, floatValue(c, d.inputs()->Get(0)));
  HYBRID_ASSIGN_OR_RETURN(in.tails, floatValue(c, d.inputs()->Get(1)));
  in.dModel = rowElements(c, d.inputs()->Get(0));
  if (rowElements(c, d.inputs()->Get(1)) != in.dModel ||
      static_cast<int64_t>(in.tails.size()) != c.contextShard->stepRows * in.dModel ||
      static_cast<int64_t>(in.x.size()) !=
          static_cast<int64_t>(c.contextShard->rows.size()) * in.dModel)
    return Status::error("inputs 0 and 1 must hold this rank's rows and the step's rows of " +
                         std::to_string(in.dModel) + " values");
  return in;
}

// This rank's chunks: [chunk, first row in its x, rows], in position order.
struct OwnChunk {
  int64_t chunk = 0, offset = 0, rows = 0;
};
std::vector<OwnChunk> ownChunks(const ContextShard &s) {
  std::vector<OwnChunk> chunks;
  int64_t offset = 0;
  for (int64_t chunk : {int64_t(s.rank), 2 * int64_t(s.size) - 1 - s.rank}) {
    const int64_t rows = s.chunkBegin(chunk + 1) - s.chunkBegin(chunk);
    chunks.push_back({chunk, offset, rows});
    offset += rows;
  }
  return chunks;
}

// Per chunk this rank holds: the summary (M [H, K, K], B [H, K, V]) of its tokens alone, from
// the conv history the chunk really starts from.
Status runKdaContextSummary(const StepContext &c, const fb::Dispatch &d, const Weights &w) {
  const fb::KdaParams *p = d.params_as_KdaParams();
  HYBRID_ASSIGN_OR_RETURN(KdaContextInputs in, kdaContextInputs(c, d));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> summaries, floatValue(c, d.outputs()->Get(0)));
  const int64_t H = p->num_heads(), K = p->head_dim(), transition = H * K * K;
  if (rowElements(c, d.outputs()->Get(0)) != 2 * transition ||
      static_cast<int64_t>(summaries.size()) != 2 * 2 * transition)
    return Status::error("output value " + std::to_string(d.outputs()->Get(0)) +
                         " must hold a summary of " + std::to_string(2 * transition) +
                         " values for each of this rank's 2 chunks");
  HYBRID_ASSIGN_OR_RETURN(std::span<float> convState, c.states->convState(p->state_slot(),
                                                                          c.stateSlot));
  const std::vector<OwnChunk> chunks = ownChunks(*c.contextShard);
  for (size_t i = 0; i < chunks.size(); ++i) {
    const OwnChunk &chunk = chunks[i];
    float *row = summaries.data() + i * 2 * transition;
    std::vector<float> history =
        kdaHistoryBefore(p, w, in.tails, in.dModel, c.contextShard->chunkBegin(chunk.chunk),
                         convState);
    KdaProlog prolog = kdaProlog(p, w, in.x.subspan(chunk.offset * in.dModel, chunk.rows * in.dModel),
                                 chunk.rows, in.dModel, history);
    ref::kdaSegmentSummary(kdaCore(p, chunk.rows, prolog, nullptr, nullptr), row,
                           row + transition);
  }
  return Status::ok();
}

// This rank's outputs: each chunk from the state composed of the summaries before it; then the
// state after the step (all summaries) and its conv history, the same on every rank.
Status runKdaContext(const StepContext &c, const fb::Dispatch &d, const Weights &w) {
  const fb::KdaParams *p = d.params_as_KdaParams();
  HYBRID_ASSIGN_OR_RETURN(KdaContextInputs in, kdaContextInputs(c, d));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> summaries, floatValue(c, d.inputs()->Get(2)));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> out, floatValue(c, d.outputs()->Get(0)));
  const ContextShard &s = *c.contextShard;
  const int64_t H = p->num_heads(), K = p->head_dim(), P = H * K, transition = H * K * K;
  if (rowElements(c, d.inputs()->Get(2)) != 2 * transition ||
      static_cast<int64_t>(summaries.size()) != 2 * int64_t(s.size) * 2 * transition)
    return Status::error("input 2 must hold a summary of " + std::to_string(2 * transition) +
                         " values for each of the step's " + std::to_string(2 * s.size) +
                         " chunks");
  HYBRID_ASSIGN_OR_RETURN(std::span<float> convState, c.states->convState(p->state_slot(),
                                                                          c.stateSlot));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> state, c.states->state(p->state_slot(), c.stateSlot));
  const std::vector<float> convBefore(convState.begin(), convState.end());
  // before[k]: the state before chunk k, composed in chunk order from the state before the step.
  const int64_t chunks = 2 * int64_t(s.size);
  std::vector<std::vector<float>> before(size_t(chunks + 1));
  before[0].assign(state.begin(), state.end());
  for (int64_t k = 0; k < chunks; ++k) {
    before[size_t(k + 1)].resize(state.size());
    const float *summary = summaries.data() + k * 2 * transition;
    ref::kdaApplySummary(H, K, K, summary, summary + transition, before[size_t(k)].data(),
                         before[size_t(k + 1)].data());
  }
  for (const OwnChunk &chunk : ownChunks(s)) {
    if (chunk.rows == 0)
      continue;
    std::vector<float> history =
        kdaHistoryBefore(p, w, in.tails, in.dModel, s.chunkBegin(chunk.chunk), convBefore);
    std::span<const float> x = in.x.subspan(chunk.offset * in.dModel, chunk.rows * in.dModel);
    KdaProlog prolog = kdaProlog(p, w, x, chunk.rows, in.dModel, history);
    std::vector<float> chunkState = before[size_t(chunk.chunk)], o(chunk.rows * P);
    ref::kdaChunked(kdaCore(p, chunk.rows, prolog, chunkState.data(), o.data()), 64);
    kdaEpilog(p, w, x, chunk.rows, in.dModel, o,
              out.subspan(chunk.offset * in.dModel, chunk.rows * in.dModel));
  }
  std::copy(before.back().begin(), before.back().end(), state.begin());
  const std::vector<float> after =
      kdaHistoryBefore(p, w, in.tails, in.dModel, s.stepRows, convBefore);
  std::copy(after.begin(), after.end(), convState.begin());
  return Status::ok();
}

Status runKda(const StepContext &c, const fb::Dispatch &d, const Weights &w) {
  const fb::KdaParams *p = d.params_as_KdaParams();
  if (p->state_layout() != fb::StateLayout::KMajor)
    return Status::error("the cpu device keeps KDA state K-major; this plan asks for V-major");
  if (d.kernel() == fb::KernelId::KdaContextSummary)
    return runKdaContextSummary(c, d, w);
  if (d.inputs()->size() == 3) {
    if (c.kdaLog)
      return Status::error("a context-parallel prefill does not log KDA inputs for replay");
    return runKdaContext(c, d, w);
  }
  if (d.inputs()->size() != 1)
    return Status::error("takes [x] or, in a context-parallel prefill, [x, x_tails, summaries]; "
                         "the plan gives " + std::to_string(d.inputs()->size()) + " inputs");
  HYBRID_ASSIGN_OR_RETURN(std::span<float> x, floatValue(c, d.inputs()->Get(0)));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> out, floatValue(c, d.outputs()->Get(0)));
  const int64_t T = c.rows, dModel = rowElements(c, d.inputs()->Get(0));
  const int64_t H = p->num_heads(), K = p->head_dim(), P = H * K, W = p->conv_kernel();

  // The slot's conv state holds the q, k and v histories one after another, [W - 1, P] each.
  HYBRID_ASSIGN_OR_RETURN(std::span<float> convState, c.states->convState(p->state_slot(),
                                                                          c.stateSlot));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> state, c.states->state(p->state_slot(), c.stateSlot));
  KdaProlog in = kdaProlog(p, w, x, T, dModel, convState);

  if (c.kdaLog) {
    KdaReplayLog::Layer layer;
    layer.stateSlot = p->state_slot();
    layer.heads = H;
    layer.headDim = K;
    layer.convKernel = W;
    layer.preConv = in.preQ;
    layer.preConv.insert(layer.preConv.end(), in.preK.begin(), in.preK.end());
    layer.preConv.insert(layer.preConv.end(), in.preV.begin(), in.preV.end());
    layer.q = in.q;
    layer.k = in.k;
    layer.v = in.v;
    layer.g = in.g;
    layer.beta = in.beta;
    c.kdaLog->rows = T;
    c.kdaLog->layers.push_back(std::move(layer));
  }

  std::vector<float> o(T * P);
  const ref::KdaParams core = kdaCore(p, T, in, state.data(), o.data());
  if (d.kernel() == fb::KernelId::KdaRecurrentDecode)
    ref::kdaRecurrent(core);
  else
    ref::kdaChunked(core, 64);
  kdaEpilog(p, w, x, T, dModel, o, out);
  return Status::ok();
}

// The indexer's query heads: wq_b on the MLA query latent, rope on each head's leading dims.
Status runIndexerQuery(const StepContext &c, const fb::Dispatch &d, const Weights &w) {
  const fb::DsaIndexerParams *p = d.params_as_DsaIndexerParams();
  HYBRID_ASSIGN_OR_RETURN(std::span<float> latent, floatValue(c, d.inputs()->Get(0)));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> query, floatValue(c, d.outputs()->Get(0)));
  const int64_t T = c.rows, Hi = p->index_heads(), Di = p->index_head_dim();
  const int64_t dr = p->rope_head_dim(), rq = rowElements(c, d.inputs()->Get(0));
  linear(latent, w.gemm(0), query, T, rq, Hi * Di);
  const std::vector<float> frequencies = ropeFrequencies(p->rope(), dr);
  const ref::RopeLayout layout = ropeLayout(p->rope());
  const std::vector<int64_t> pos = positions(c);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < Hi; ++j)
      ref::applyRope({query.data() + (t * Hi + j) * Di, size_t(dr)}, pos[t], frequencies, layout);
  return roundIndexerActivation(p->quantize(), query, T * Hi, Di); // per head row
}

// The indexer's key of each token: wk, LayerNorm with bias, rope on the leading dims.
Status runIndexerKey(const StepContext &c, const fb::Dispatch &d, const Weights &w) {
  const fb::DsaIndexerParams *p = d.params_as_DsaIndexerParams();
  HYBRID_ASSIGN_OR_RETURN(std::span<float> x, floatValue(c, d.inputs()->Get(0)));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> key, floatValue(c, d.outputs()->Get(0)));
  const int64_t T = c.rows, Di = p->index_head_dim(), dr = p->rope_head_dim();
  linear(x, w.gemm(0), key, T, rowElements(c, d.inputs()->Get(0)), Di);
  ref::layerNorm(key, w[1], w[2], key, T, Di, p->norm_epsilon());
  const std::vector<float> frequencies = ropeFrequencies(p->rope(), dr);
  const std::vector<int64_t> pos = positions(c);
  for (int64_t t = 0; t < T; ++t)
    ref::applyRope({key.data() + t * Di, size_t(dr)}, pos[t], frequencies, ropeLayout(p->rope()));
  return roundIndexerActivation(p->quantize(), key, T, Di);
}

// Fused: stage the step's keys in the layer's index-key cache, score every causal position
// (ReLU(q·k) weighted per head), keep the top-k.
Status runDsaIndexer(const StepContext &c, const fb::Dispatch &d) {
  const fb::DsaIndexerParams *p = d.params_as_DsaIndexerParams();
  HYBRID_ASSIGN_OR_RETURN(std::span<float> queries, floatValue(c, d.inputs()->Get(0)));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> keys, floatValue(c, d.inputs()->Get(1)));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> headWeights, floatValue(c, d.inputs()->Get(2)));
  HYBRID_ASSIGN_OR_RETURN(std::span<int32_t> indices, valueAs<int32_t>(c, d.outputs()->Get(0),
                                                                       fb::DType::I32));
  const int64_t T = c.rows, Hi = p->index_heads(), Di = p->index_head_dim();
  const KvLayerShape &shape = c.kvCache->layerShape(p->kv_slot());
  if (shape.indexKeyDim != Di)
    return Status::error("KV slot " + std::to_string(p->kv_slot()) + " stores index keys of " +
                         std::to_string(shape.indexKeyDim) + " values, the indexer makes " +
                         std::to_string(Di));
  // The step's keys: this rank's queries' and, under context parallelism, every rank's
  // (gathered); all of them join the cache.
  if (static_cast<int64_t>(keys.size()) != stepRows(c) * Di)
    return Status::error("input 1 holds " + std::to_string(keys.size() / size_t(Di)) +
                         " keys, the step has " + std::to_string(stepRows(c)) +
                         " tokens (a context-parallel prefill gathers them first)");
  std::span<float> staged = staging(c, p->kv_slot());
  for (int64_t t = 0; t < stepRows(c); ++t)
    std::copy_n(keys.data() + t * Di, Di,
                staged.data() + t * shape.rowElements() + shape.latentDim + shape.ropeDim);
  HYBRID_ASSIGN_OR_RETURN(std::vector<float> allKeys,
                          pastAndCurrent(c, p->kv_slot(), KvPart::IndexKey, staged));
  const int64_t numKeys = static_cast<int64_t>(allKeys.size()) / Di;
  const std::vector<int64_t> pos = positions(c);
  std::vector<float> scores(static_cast<size_t>(T * numKeys));
  ref::indexerScores({T, numKeys, Hi, Di, queries.data(), allKeys.data(), headWeights.data(),
                      pos.data(), scores.data()});
  if (c.indexerPairs) { // the causal pairs: a query at position p scores keys 0..p
    uint64_t pairs = 0;
    for (int64_t position : pos)
      pairs += static_cast<uint64_t>(position + 1);
    c.indexerPairs->fetch_add(pairs, std::memory_order_relaxed);
  }
  ref::topKIndices(scores, T, numKeys, p->top_k(), indices);
  return Status::ok();
}

enum MlaRole { QProj, QBProj, KvA, KvALayerNorm, KvB, GateProj, OProj };

// The latent-cache rows of the dispatch's tokens: c = RMSNorm(kv_a latent part), then k_r rotated
// at the token's position (raw for NoPE), as the cache will hold them (FP8 round trip).
StatusOr<std::vector<float>> mlaCacheRows(const StepContext &c, const fb::MlaParams *p,
                                          std::span<const float> x, int64_t dModel,
                                          GemmWeight kvA, std::span<const float> latentNorm) {
  const int64_t T = c.rows, rkv = p->kv_lora_rank(), dr = p->qk_rope_head_dim();
  std::vector<float> rows = project(x, kvA, T, dModel, rkv + dr);
  const std::vector<float> frequencies = ropeFrequencies(p->rope(), dr);
  const ref::RopeLayout layout = ropeLayout(p->rope());
  const std::vector<int64_t> pos = positions(c);
  const fb::KvCacheLayer *quant =
      c.cacheSpec && c.cacheSpec->kv() && p->kv_slot() < int32_t(c.cacheSpec->kv()->size())
          ? c.cacheSpec->kv()->Get(p->kv_slot())
          : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    float *row = rows.data() + t * (rkv + dr);
    ref::rmsNorm({row, size_t(rkv)}, latentNorm, {row, size_t(rkv)}, 1, rkv,
                 p->latent_norm_epsilon());
    ref::applyRope({row + rkv, size_t(dr)}, pos[t], frequencies, layout);
    if (quant && quant->quant() == fb::KvQuant::Fp8Tiles) // what the cache will hold
      HYBRID_RETURN_IF_ERROR(roundTripFp8KvRow({row, size_t(rkv)}, {row + rkv, size_t(dr)},
                                               quant->quant_tile()));
  }
  return rows;
}

// A context-parallel prefill's first step of an attention layer: its tokens' cache rows, which
// an all-gather then hands every rank.
Status runMlaCacheRows(const StepContext &c, const fb::Dispatch &d, const Weights &w) {
  const fb::MlaParams *p = d.params_as_MlaParams();
  HYBRID_ASSIGN_OR_RETURN(std::span<float> x, floatValue(c, d.inputs()->Get(0)));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> out, floatValue(c, d.outputs()->Get(0)));
  if (rowElements(c, d.outputs()->Get(0)) != p->kv_lora_rank() + p->qk_rope_head_dim())
    return Status::error("output value " + std::to_string(d.outputs()->Get(0)) + " holds " +
                         std::to_string(rowElements(c, d.outputs()->Get(0))) +
                         " values per row, the cache rows are " +
                         std::to_string(p->kv_lora_rank() + p->qk_rope_head_dim()));
  HYBRID_ASSIGN_OR_RETURN(std::vector<float> rows,
                          mlaCacheRows(c, p, x, rowElements(c, d.inputs()->Get(0)), w.gemm(0),
                                       w[1]));
  std::copy(rows.begin(), rows.end(), out.begin());
  return Status::ok();
}

Status runMla(const StepContext &c, const fb::Dispatch &d, const Weights &w) {
  const fb::MlaParams *p = d.params_as_MlaParams();
  const bool sparse = d.kernel() == fb::KernelId::SparseMlaPrefill ||
                      d.kernel() == fb::KernelId::SparseMlaDecode;
  const auto *inputs = d.inputs();
  HYBRID_ASSIGN_OR_RETURN(std::span<float> x, floatValue(c, inputs->Get(0)));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> out, floatValue(c, d.outputs()->Get(0)));
  const int64_t T = c.rows, dModel = rowElements(c, inputs->Get(0));
  const int64_t H = p->num_heads(), dn = p->qk_nope_head_dim(), dr = p->qk_rope_head_dim();
  const int64_t dv = p->v_head_dim(), rkv = p->kv_lora_rank(), qkDim = dn + dr;

  std::vector<float> queries;
  if (p->q_lora_rank() > 0) {
    const int32_t latentIndex = inputs->Get(sparse ? 2 : 1);
    HYBRID_ASSIGN_OR_RETURN(std::span<float> latent, floatValue(c, latentIndex));
    queries = project(latent, w.gemm(QBProj), T, p->q_lora_rank(), H * qkDim);
  } else {
    queries = project(x, w.gemm(QProj), T, dModel, H * qkDim);
  }

  const std::vector<float> frequencies = ropeFrequencies(p->rope(), dr);
  const ref::RopeLayout layout = ropeLayout(p->rope());
  const std::vector<int64_t> pos = positions(c);
  const KvLayerShape &shape = c.kvCache->layerShape(p->kv_slot());
  if (shape.latentDim != rkv || shape.ropeDim != dr)
    return Status::error("KV slot " + std::to_string(p->kv_slot()) + " holds " +
                         std::to_string(shape.latentDim) + "+" + std::to_string(shape.ropeDim) +
                         " values per token, the attention makes " + std::to_string(rkv) + "+" +
                         std::to_string(dr));
  // The step's cache rows: this step's tokens' own, or in a context-parallel prefill every
  // rank's, gathered (the input after the others).
  const int32_t ownInputs = (sparse ? 2 : 1) + (p->q_lora_rank() > 0 ? 1 : 0);
  std::vector<float> ownRows;
  std::span<const float> stepCacheRows;
  if (static_cast<int32_t>(inputs->size()) == ownInputs + 1) {
    if (!c.contextShard)
      return Status::error("input " + std::to_string(ownInputs) + " (gathered cache rows) is " +
                           "for a context-parallel prefill only");
    if (rowElements(c, inputs->Get(ownInputs)) != rkv + dr)
      return Status::error("gathered cache rows of " +
                           std::to_string(rowElements(c, inputs->Get(ownInputs))) +
                           " values, the attention makes " + std::to_string(rkv + dr));
    HYBRID_ASSIGN_OR_RETURN(std::span<float> gathered, floatValue(c, inputs->Get(ownInputs)));
    if (static_cast<int64_t>(gathered.size()) != stepRows(c) * (rkv + dr))
      return Status::error("input " + std::to_string(ownInputs) + " holds " +
                           std::to_string(gathered.size() / size_t(rkv + dr)) +
                           " cache rows, the step has " + std::to_string(stepRows(c)) + " tokens");
    stepCacheRows = gathered;
  } else {
    HYBRID_ASSIGN_OR_RETURN(ownRows,
                            mlaCacheRows(c, p, x, dModel, w.gemm(KvA), w[KvALayerNorm]));
    stepCacheRows = ownRows;
  }
  std::vector<float> &stagedRows = (*c.kvStaging)[p->kv_slot()];
  std::span<float> staged =
      stagedRows.size() == size_t(stepRows(c) * shape.rowElements())
          ? std::span<float>(stagedRows) // the indexer staged its keys
          : staging(c, p->kv_slot());
  for (int64_t t = 0; t < stepRows(c); ++t)
    std::copy_n(stepCacheRows.data() + t * (rkv + dr), rkv + dr,
                staged.data() + t * shape.rowElements());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      ref::applyRope({queries.data() + (t * H + h) * qkDim + dn, size_t(dr)}, pos[t], frequencies,
                     layout);
  HYBRID_ASSIGN_OR_RETURN(std::vector<float> latents,
                          pastAndCurrent(c, p->kv_slot(), KvPart::Latent, staged));
  HYBRID_ASSIGN_OR_RETURN(std::vector<float> ropeKeys,
                          pastAndCurrent(c, p->kv_slot(), KvPart::Rope, staged));

  ref::MlaAttentionParams attention;
  attention.numQueries = T;
  attention.numKeys = static_cast<int64_t>(latents.size()) / rkv;
  attention.numHeads = H;
  attention.nopeDim = dn;
  attention.ropeDim = dr;
  attention.valueDim = dv;
  attention.latentDim = rkv;
  attention.softmaxScale = p->softmax_scale();
  attention.queries = queries.data();
  attention.queryPositions = pos.data();
  attention.latents = latents.data();
  attention.ropeKeys = ropeKeys.data();
  attention.kvBProj = w[KvB].data();
  if (sparse) {
    const int32_t indicesValue = inputs->Get(1);
    HYBRID_ASSIGN_OR_RETURN(std::span<int32_t> indices,
                            valueAs<int32_t>(c, indicesValue, fb::DType::I32));
    attention.sparseIndices = indices.data();
    attention.topK = rowElements(c, indicesValue);
  }
  std::vector<float> heads(static_cast<size_t>(T * H * dv));
  attention.out = heads.data();
  ref::mlaAttention(attention);
  if (w.has(GateProj)) { // output gate: heads ⊙ σ(g_proj x)
    std::vector<float> gate = project(x, w.gemm(GateProj), T, dModel, H * dv);
    for (size_t i = 0; i < heads.size(); ++i)
      heads[i] *= 1.0f / (1.0f + std::exp(-gate[i]));
  }
  linear(heads, w.gemm(OProj), out, T, H * dv, dModel);

  // The step's rows join the cache only now, so every reader above saw past + current.
  HYBRID_RETURN_IF_ERROR(c.kvCache->append(p->kv_slot(), c.kvSequence, staged));
  stagedRows.clear();
  return Status::ok();
}

Status runAttnRes(const StepContext &c, const fb::Dispatch &d, const Weights &w) {
  const fb::AttnResParams *p = d.params_as_AttnResParams();
  HYBRID_ASSIGN_OR_RETURN(std::span<float> out, floatValue(c, d.outputs()->Get(0)));
  const bool withNorm = d.kernel() == fb::KernelId::AttnResRmsNorm;
  const int64_t width = rowElements(c, d.outputs()->Get(0));
  // Plan order: partial first, then the completed blocks; the kernel wants blocks, then partial.
  std::vector<const float *> candidates;
  for (size_t i = 1; i < d.inputs()->size(); ++i) {
    HYBRID_ASSIGN_OR_RETURN(std::span<float> block, floatValue(c, d.inputs()->Get(i)));
    candidates.push_back(block.data());
  }
  HYBRID_ASSIGN_OR_RETURN(std::span<float> partial, floatValue(c, d.inputs()->Get(0)));
  candidates.push_back(partial.data());
  ref::attnResMix(candidates, c.rows, width, w[0], w[1], p->epsilon(), out);
  if (withNorm) { // fused: the RMSNorm that reads the mix, while it is hot
    HYBRID_ASSIGN_OR_RETURN(std::span<float> normed, floatValue(c, d.outputs()->Get(1)));
    ref::rmsNorm(out, w[2], normed, c.rows, width, p->output_norm_epsilon());
  }
  return Status::ok();
}

// Fused router: logits, scores, grouped top-k, renormalized and scaled weights.
Status runRouterTopK(const StepContext &c, const fb::Dispatch &d, const Weights &w) {
  const fb::MoeParams *p = d.params_as_MoeParams();
  HYBRID_ASSIGN_OR_RETURN(std::span<float> x, floatValue(c, d.inputs()->Get(0)));
  HYBRID_ASSIGN_OR_RETURN(std::span<int32_t> ids, valueAs<int32_t>(c, d.outputs()->Get(0),
                                                                   fb::DType::I32));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> weights, floatValue(c, d.outputs()->Get(1)));
  const int64_t T = c.rows, dModel = rowElements(c, d.inputs()->Get(0)), E = p->num_experts();
  std::vector<float> logits = project(x, w.gemm(0), T, dModel, E);
  ref::RouterParams router;
  router.numExperts = E;
  router.topK = p->top_k();
  router.numGroups = p->num_groups();
  router.topKGroups = p->topk_groups();
  router.scoring = p->score_function() == fb::ScoreFunction::Softmax
                       ? ref::RouterScoring::Softmax
                       : ref::RouterScoring::Sigmoid;
  router.correctionBias = w[1];
  router.renormalize = p->renormalize();
  router.routedScalingFactor = p->routed_scaling_factor();
  ref::routeTokens(logits, T, router, ids, weights);
  return Status::ok();
}

ref::GatedActivation gatedActivation(fb::Activation activation, float beta, float linearBeta) {
  if (activation == fb::Activation::Situ)
    return {ref::GatedActivation::Kind::Situ, beta, linearBeta};
  return {};
}

// ---- Collectives. A group (plan.fbs CollectiveGroup) is the world or part of it; a part's
// collectives go through the world communicator (an all-gather, of which each rank keeps its
// group's pieces) so that every backend serves them: a correctness path, as the cpu device is.

std::vector<int> groupMembers(const StepContext &c, fb::CollectiveGroup group) {
  const int world = c.communicator->worldSize(), rank = c.communicator->rank();
  const int tp = std::max(1, c.layout.tensorParallel);
  std::vector<int> members;
  if (group == fb::CollectiveGroup::ContextParallel) {
    for (int r = rank % tp; r < world; r += tp)
      members.push_back(r);
  } else { // tensor- and expert-parallel: the ranks of this context rank
    for (int r = rank / tp * tp; r < std::min(world, rank / tp * tp + tp); ++r)
      members.push_back(r);
  }
  return members;
}

Status needCommunicator(const StepContext &c) {
  if (!c.communicator)
    return Status::error("a sharded plan's collective needs a communicator "
                         "(LoadOptions::communicator, hybrid-run --world-size)");
  return Status::ok();
}

// MoeParams.all_to_all: the routed experts of a context-parallel prefill whose experts are
// spread over the context ranks (expert_parallel = context_parallel, tensor_parallel 1). This
// rank's rows go to the ranks holding their experts and come back (parallel::moeExpertParallel
// over the context group, which is the world); the output is their whole routed sum, added in
// ascending expert order as ref::moeExperts adds it.
Status runMoeAllToAll(const StepContext &c, const fb::MoeParams *p, std::span<const float> x,
                      int64_t dModel, std::span<const int32_t> ids,
                      std::span<const float> weights, std::span<float> out,
                      std::span<const ref::SwiGluWeights> experts) {
  HYBRID_RETURN_IF_ERROR(needCommunicator(c));
  if (!c.contextShard)
    return Status::error("all_to_all runs in a context-parallel prefill only");
  const int world = c.communicator->worldSize(), rank = c.communicator->rank();
  if (static_cast<int>(groupMembers(c, fb::CollectiveGroup::ContextParallel).size()) != world)
    return Status::error("all_to_all exchanges rows over the context_parallel group, which must "
                         "be the whole world of " + std::to_string(world) +
                         " ranks (tensor_parallel 1)");
  const int64_t numExperts = p->num_experts();
  HYBRID_RETURN_IF_ERROR(parallel::checkExpertsOfContextRank(
      numExperts, rank, world, [&](int64_t e) { return !experts[size_t(e)].gateProj.empty(); }));
  const int64_t perRank = numExperts / world;
  parallel::ExpertParallelShard shard;
  shard.tokens = c.rows;
  shard.hidden = dModel;
  shard.topK = p->top_k();
  shard.numExperts = numExperts;
  shard.x = x.data();
  shard.expertIds = ids.data();
  shard.expertWeights = weights.data();
  shard.localExperts = experts.subspan(size_t(rank * perRank), size_t(perRank));
  shard.out = out.data();
  return parallel::moeExpertParallel(*c.communicator, shard);
}

// The routed experts: Σ_k weight_k · SwiGLU_{id_k}(x) per token (the shared expert is its own
// dispatch).
Status runMoeExperts(const StepContext &c, const fb::Dispatch &d, const Weights &w) {
  const fb::MoeParams *p = d.params_as_MoeParams();
  HYBRID_ASSIGN_OR_RETURN(std::span<float> x, floatValue(c, d.inputs()->Get(0)));
  HYBRID_ASSIGN_OR_RETURN(std::span<int32_t> ids, valueAs<int32_t>(c, d.inputs()->Get(1),
                                                                   fb::DType::I32));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> weights, floatValue(c, d.inputs()->Get(2)));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> out, floatValue(c, d.outputs()->Get(0)));
  const int64_t dModel = rowElements(c, d.inputs()->Get(0)), width = p->intermediate_size();
  std::vector<ref::SwiGluWeights> experts;
  for (int64_t e = 0; e < p->num_experts(); ++e)
    experts.push_back({w[3 * e], w[3 * e + 1], w[3 * e + 2], dModel, width,
                       w.fp8Activations(3 * e),
                       gatedActivation(p->activation(), p->situ_beta(), p->situ_linear_beta())});
  if (p->all_to_all())
    return runMoeAllToAll(c, p, x, dModel, ids, weights, out, experts);
  // Expert parallelism: experts held by other ranks have no weights here; their choices are
  // skipped (-1), so the output is this rank's part of the sum an all-reduce completes.
  std::vector<int32_t> heldIds;
  std::span<const int32_t> chosen = ids;
  if (!std::all_of(experts.begin(), experts.end(),
                   [](const ref::SwiGluWeights &e) { return !e.gateProj.empty(); })) {
    heldIds.assign(ids.begin(), ids.begin() + c.rows * p->top_k());
    for (int32_t &id : heldIds)
      if (id >= 0 && id < p->num_experts() && experts[static_cast<size_t>(id)].gateProj.empty())
        id = -1;
    chosen = heldIds;
  }
  ref::moeExperts(x, c.rows, dModel, chosen, weights, p->top_k(), experts, {}, out);
  return Status::ok();
}

// Every member's `count` floats, in member order. `count` must be the same on every rank of the
// world, not only of the group.
Status groupAllGather(const StepContext &c, const std::vector<int> &members, const float *mine,
                      size_t count, std::vector<float> &out) {
  const int world = c.communicator->worldSize();
  if (static_cast<int>(members.size()) == world) {
    out.resize(size_t(world) * count);
    return c.communicator->allGather(mine, out.data(), count);
  }
  std::vector<float> all(size_t(world) * count);
  HYBRID_RETURN_IF_ERROR(c.communicator->allGather(mine, all.data(), count));
  out.resize(members.size() * count);
  for (size_t m = 0; m < members.size(); ++m)
    std::copy_n(all.data() + size_t(members[m]) * count, count, out.data() + m * count);
  return Status::ok();
}

// The sum over the group of each rank's partial output (a sharded plan's explicit collective):
// a rank without a part (no input) adds zeros.
Status runAllReduceSum(const StepContext &c, const fb::Dispatch &d) {
  HYBRID_ASSIGN_OR_RETURN(std::span<float> out, floatValue(c, d.outputs()->Get(0)));
  const int64_t width = rowElements(c, d.outputs()->Get(0));
  const size_t count = static_cast<size_t>(c.rows * width);
  if (d.inputs()->size() == 1) {
    HYBRID_ASSIGN_OR_RETURN(std::span<float> partial, floatValue(c, d.inputs()->Get(0)));
    std::copy_n(partial.data(), count, out.data());
  } else {
    std::fill_n(out.data(), count, 0.0f);
  }
  HYBRID_RETURN_IF_ERROR(needCommunicator(c));
  const std::vector<int> members = groupMembers(c, d.params_as_CollectiveParams()->group());
  if (static_cast<int>(members.size()) == c.communicator->worldSize())
    return c.communicator->allReduceSum(out.data(), count);
  // Part of the world: every rank contributes the same count (context ranks hold different row
  // counts: pad to the longest), and each sums its group's from zero in rank order, as the
  // backends' all-reduce does.
  const size_t padded = c.contextShard && c.rows == int64_t(c.contextShard->rows.size())
                            ? static_cast<size_t>(c.contextShard->longest * width)
                            : count;
  std::vector<float> mine(padded, 0.0f), all;
  std::copy_n(out.data(), count, mine.data());
  HYBRID_RETURN_IF_ERROR(groupAllGather(c, members, mine.data(), padded, all));
  std::fill_n(out.data(), count, 0.0f);
  for (size_t m = 0; m < members.size(); ++m)
    for (size_t i = 0; i < count; ++i)
      out[i] += all[m * padded + i];
  return Status::ok();
}

// Every context rank's rows of a ContextShard value at their positions (Step rows), or with
// tail_rows only each chunk's last tail_rows rows (the rest zero); or every rank's chunk rows
// (ContextChunks) in chunk order.
Status runAllGatherRows(const StepContext &c, const fb::Dispatch &d) {
  HYBRID_RETURN_IF_ERROR(needCommunicator(c));
  if (!c.contextShard)
    return Status::error("runs in a context-parallel prefill only");
  const ContextShard &s = *c.contextShard;
  const fb::CollectiveParams *p = d.params_as_CollectiveParams();
  const fb::Value &input = *c.program->values()->Get(d.inputs()->Get(0));
  const int64_t width = input.row_elements();
  HYBRID_ASSIGN_OR_RETURN(std::span<float> mine, floatValue(c, d.inputs()->Get(0)));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> out, floatValue(c, d.outputs()->Get(0)));
  const std::vector<int> members = groupMembers(c, p->group());
  if (p->group() != fb::CollectiveGroup::ContextParallel ||
      static_cast<int>(members.size()) != s.size)
    return Status::error("gathers over the context_parallel group of " + std::to_string(s.size) +
                         " ranks, the plan names group " +
                         fb::EnumNameCollectiveGroup(p->group()));
  const int64_t chunks = 2 * int64_t(s.size);
  std::vector<float> all;
  if (input.rows() == fb::ValueRows::ContextChunks) {
    HYBRID_RETURN_IF_ERROR(groupAllGather(c, members, mine.data(), mine.size(), all));
    for (int r = 0; r < s.size; ++r)
      for (int i = 0; i < 2; ++i) {
        const int64_t chunk = i == 0 ? r : chunks - 1 - r;
        std::copy_n(all.data() + (size_t(r) * 2 + size_t(i)) * size_t(width), width,
                    out.data() + chunk * width);
      }
    return Status::ok();
  }
  if (input.rows() != fb::ValueRows::ContextShard)
    return Status::error("gathers ContextShard or ContextChunks rows, input " +
                         std::to_string(d.inputs()->Get(0)) + " holds " +
                         fb::EnumNameValueRows(input.rows()));
  const int64_t tail = p->tail_rows();
  if (tail < 0)
    return Status::error("tail_rows " + std::to_string(tail) + " is negative");
  // Rows of `r` sent: all (padded to the longest rank's) or each chunk's last `tail` (padded).
  auto sent = [&](int r) {
    std::vector<int64_t> rows;
    const std::vector<int64_t> held = s.rowsOf(r);
    if (tail == 0)
      return held;
    for (int64_t chunk : {int64_t(r), chunks - 1 - r})
      for (int64_t row = std::max(s.chunkBegin(chunk), s.chunkBegin(chunk + 1) - tail);
           row < s.chunkBegin(chunk + 1); ++row)
        rows.push_back(row);
    return rows;
  };
  const int64_t slots = tail == 0 ? s.longest : 2 * tail;
  std::vector<float> send(size_t(slots * width), 0.0f);
  const std::vector<int64_t> mineSent = sent(s.rank);
  for (size_t i = 0; i < mineSent.size(); ++i) {
    const auto at = std::lower_bound(s.rows.begin(), s.rows.end(), mineSent[i]) - s.rows.begin();
    std::copy_n(mine.data() + at * width, width, send.data() + i * size_t(width));
  }
  HYBRID_RETURN_IF_ERROR(groupAllGather(c, members, send.data(), send.size(), all));
  std::fill(out.begin(), out.end(), 0.0f);
  for (size_t i = 0; i < s.rows.size(); ++i) // this rank's own rows, whole
    std::copy_n(mine.data() + i * size_t(width), width, out.data() + s.rows[i] * width);
  for (int r = 0; r < s.size; ++r) {
    const std::vector<int64_t> rows = sent(r);
    for (size_t i = 0; i < rows.size(); ++i)
      std::copy_n(all.data() + (size_t(r) * size_t(slots) + i) * size_t(width), width,
                  out.data() + rows[i] * width);
  }
  return Status::ok();
}

} // namespace

int64_t valueRows(const StepContext &context, const fb::Value &value) {
  return rowsOf(context, value);
}

StatusOr<std::span<float>> floatValue(const StepContext &context, int32_t index) {
  return valueAs<float>(context, index, fb::DType::F32);
}

ContextShard ContextShard::of(int rank, int size, int64_t stepRows) {
  ContextShard shard;
  shard.rank = rank;
  shard.size = size;
  shard.stepRows = stepRows;
  shard.rows = shard.rowsOf(rank);
  for (int r = 0; r < size; ++r)
    shard.longest = std::max<int64_t>(shard.longest, int64_t(shard.rowsOf(r).size()));
  return shard;
}

std::vector<int64_t> ContextShard::rowsOf(int r) const {
  return parallel::zigzagPositions(stepRows, r, size);
}

StatusOr<std::vector<float>> gatherContextRows(const StepContext &context,
                                               std::span<const float> rows, int64_t width) {
  HYBRID_RETURN_IF_ERROR(needCommunicator(context));
  if (!context.contextShard)
    return Status::error("gathering rows outside a context-parallel prefill");
  const ContextShard &s = *context.contextShard;
  std::vector<float> mine(size_t(s.longest * width), 0.0f), all;
  std::copy(rows.begin(), rows.end(), mine.begin());
  HYBRID_RETURN_IF_ERROR(groupAllGather(
      context, groupMembers(context, fb::CollectiveGroup::ContextParallel), mine.data(),
      mine.size(), all));
  std::vector<float> out(size_t(s.stepRows * width));
  for (int r = 0; r < s.size; ++r) {
    const std::vector<int64_t> held = s.rowsOf(r);
    for (size_t i = 0; i < held.size(); ++i)
      std::copy_n(all.data() + (size_t(r) * size_t(s.longest) + i) * size_t(width), width,
                  out.data() + held[i] * width);
  }
  return out;
}

Status replayKda(RecurrentStatePool &states, int32_t slot, const KdaReplayLog &log,
                 int64_t tokens) {
  if (log.layers.empty())
    return Status::ok(); // no recurrent layer
  if (tokens < 0 || tokens > log.rows)
    return Status::error("KDA replay of " + std::to_string(tokens) + " tokens from a step of " +
                         std::to_string(log.rows));
  if (tokens == 0)
    return Status::ok();
  for (const KdaReplayLog::Layer &layer : log.layers) {
    const int64_t H = layer.heads, K = layer.headDim, P = H * K, W = layer.convKernel;
    HYBRID_ASSIGN_OR_RETURN(std::span<float> convState, states.convState(layer.stateSlot, slot));
    HYBRID_ASSIGN_OR_RETURN(std::span<float> state, states.state(layer.stateSlot, slot));
    // The token recurrence a decode step runs, over the accepted tokens' logged inputs.
    std::vector<float> o(static_cast<size_t>(tokens * P));
    ref::KdaParams core{tokens, H, K, K, 0.0f, layer.q.data(), layer.k.data(), layer.v.data(),
                        layer.g.data(), layer.beta.data(), state.data(), o.data()};
    ref::kdaRecurrent(core);
    // Each conv history: its last W - 1 inputs after the accepted tokens.
    const int64_t history = W - 1;
    for (int projection = 0; projection < 3; ++projection) {
      std::span<float> past = convState.subspan(static_cast<size_t>(projection * history * P),
                                                static_cast<size_t>(history * P));
      const float *inputs = layer.preConv.data() + projection * log.rows * P;
      std::vector<float> all(past.begin(), past.end()); // [history + tokens, P]
      all.insert(all.end(), inputs, inputs + tokens * P);
      std::copy(all.end() - history * P, all.end(), past.begin());
    }
  }
  return Status::ok();
}

Status runDispatch(const StepContext &context, const fb::Dispatch &d) {
  // A context-parallel prefill: the dispatch works on the rows of its first output (this rank's,
  // the step's or chunks), at their positions.
  StepContext local;
  if (context.contextShard && d.outputs() && d.outputs()->size() > 0 &&
      d.outputs()->Get(0) >= 0 && d.outputs()->Get(0) < int32_t(context.program->values()->size())) {
    local = context;
    const fb::Value &output = *context.program->values()->Get(d.outputs()->Get(0));
    local.rows = rowsOf(context, output);
    local.rowOffsets = output.rows() == fb::ValueRows::ContextShard
                           ? std::span<const int64_t>(context.contextShard->rows)
                           : std::span<const int64_t>();
  }
  const StepContext &c = context.contextShard ? local : context;
  const Weights w = resolveWeights(c, d);
  auto single = [&](int position) { return floatValue(c, d.inputs()->Get(position)); };
  Status status = Status::ok();
  switch (d.kernel()) {
  case fb::KernelId::Embed:
    status = runEmbed(c, d, w);
    break;
  case fb::KernelId::RmsNorm: {
    HYBRID_ASSIGN_OR_RETURN(std::span<float> x, single(0));
    HYBRID_ASSIGN_OR_RETURN(std::span<float> y, floatValue(c, d.outputs()->Get(0)));
    ref::rmsNorm(x, w[0], y, c.rows, rowElements(c, d.inputs()->Get(0)),
                 d.params_as_RmsNormParams()->epsilon());
    break;
  }
  case fb::KernelId::Linear:
  case fb::KernelId::LmHead: {
    HYBRID_ASSIGN_OR_RETURN(std::span<float> x, single(0));
    HYBRID_ASSIGN_OR_RETURN(std::span<float> y, floatValue(c, d.outputs()->Get(0)));
    const int64_t out = rowElements(c, d.outputs()->Get(0));
    if (d.inputs()->size() == 1) {
      linear(x, w.gemm(0), y, c.rows, rowElements(c, d.inputs()->Get(0)), out);
      break;
    }
    // Two inputs: the projection of each row's concatenation [a | b].
    HYBRID_ASSIGN_OR_RETURN(std::span<float> b, single(1));
    const int64_t widthA = rowElements(c, d.inputs()->Get(0));
    const int64_t widthB = rowElements(c, d.inputs()->Get(1));
    std::vector<float> joined(static_cast<size_t>(c.rows * (widthA + widthB)));
    for (int64_t r = 0; r < c.rows; ++r) {
      std::copy_n(x.begin() + r * widthA, widthA, joined.begin() + r * (widthA + widthB));
      std::copy_n(b.begin() + r * widthB, widthB, joined.begin() + r * (widthA + widthB) + widthA);
    }
    linear(joined, w.gemm(0), y, c.rows, widthA + widthB, out);
    break;
  }
  case fb::KernelId::Add: {
    HYBRID_ASSIGN_OR_RETURN(std::span<float> a, single(0));
    HYBRID_ASSIGN_OR_RETURN(std::span<float> b, single(1));
    HYBRID_ASSIGN_OR_RETURN(std::span<float> y, floatValue(c, d.outputs()->Get(0)));
    for (size_t i = 0; i < y.size(); ++i)
      y[i] = a[i] + b[i];
    break;
  }
  case fb::KernelId::KdaChunkPrefill:
  case fb::KernelId::KdaRecurrentDecode:
  case fb::KernelId::KdaContextSummary:
    status = runKda(c, d, w);
    break;
  case fb::KernelId::MlaCacheRows:
    status = runMlaCacheRows(c, d, w);
    break;
  case fb::KernelId::AllGatherRows:
    status = runAllGatherRows(c, d);
    break;
  case fb::KernelId::MlaPrefill:
  case fb::KernelId::MlaDecode:
  case fb::KernelId::SparseMlaPrefill:
  case fb::KernelId::SparseMlaDecode:
    status = runMla(c, d, w);
    break;
  case fb::KernelId::IndexerQuery:
    status = runIndexerQuery(c, d, w);
    break;
  case fb::KernelId::IndexerKey:
    status = runIndexerKey(c, d, w);
    break;
  case fb::KernelId::DsaIndexer:
    status = runDsaIndexer(c, d);
    break;
  case fb::KernelId::AttnRes:
  case fb::KernelId::AttnResRmsNorm:
    status = runAttnRes(c, d, w);
    break;
  case fb::KernelId::AddRmsNorm: { // fused: the sum and its RMSNorm in one pass
    HYBRID_ASSIGN_OR_RETURN(std::span<float> a, single(0));
    HYBRID_ASSIGN_OR_RETURN(std::span<float> b, single(1));
    HYBRID_ASSIGN_OR_RETURN(std::span<float> sum, floatValue(c, d.outputs()->Get(0)));
    HYBRID_ASSIGN_OR_RETURN(std::span<float> normed, floatValue(c, d.outputs()->Get(1)));
    if (d.inputs()->size() == 3) { // a + (b + c): the folded add's sum first, as it was
      HYBRID_ASSIGN_OR_RETURN(std::span<float> third, single(2));
      for (size_t i = 0; i < sum.size(); ++i)
        sum[i] = a[i] + (b[i] + third[i]);
    } else {
      for (size_t i = 0; i < sum.size(); ++i)
        sum[i] = a[i] + b[i];
    }
    ref::rmsNorm(sum, w[0], normed, c.rows, rowElements(c, d.outputs()->Get(0)),
                 d.params_as_RmsNormParams()->epsilon());
    break;
  }
  case fb::KernelId::Mlp: {
    HYBRID_ASSIGN_OR_RETURN(std::span<float> x, single(0));
    HYBRID_ASSIGN_OR_RETURN(std::span<float> y, floatValue(c, d.outputs()->Get(0)));
    const int64_t dModel = rowElements(c, d.inputs()->Get(0));
    const int64_t width = static_cast<int64_t>(w[0].size()) / dModel;
    const fb::MlpParams *p = d.params_as_MlpParams();
    ref::swiGluMlp(x, c.rows,
                   {w[0], w[1], w[2], dModel, width, w.fp8Activations(0),
                    gatedActivation(p->activation(), p->situ_beta(), p->situ_linear_beta())},
                   y);
    break;
  }
  case fb::KernelId::RouterTopK:
    status = runRouterTopK(c, d, w);
    break;
  case fb::KernelId::MoeExperts:
    status = runMoeExperts(c, d, w);
    break;
  case fb::KernelId::AllReduceSum:
    status = runAllReduceSum(c, d);
    break;
  }
  if (!status)
    return Status(status).withContext(kernelName(d.kernel()) + " (layer " +
                                      std::to_string(d.layer()) + ")");
  return status;
}

bool perSequenceKernel(fb::KernelId kernel) {
  switch (kernel) {
  case fb::KernelId::KdaChunkPrefill:
  case fb::KernelId::KdaRecurrentDecode:
  case fb::KernelId::KdaContextSummary:
  case fb::KernelId::MlaCacheRows:
  case fb::KernelId::MlaPrefill:
  case fb::KernelId::MlaDecode:
  case fb::KernelId::SparseMlaPrefill:
  case fb::KernelId::SparseMlaDecode:
  case fb::KernelId::IndexerQuery:
  case fb::KernelId::IndexerKey:
  case fb::KernelId::DsaIndexer:
    return true;
  default:
    return false;
  }
}

Status runStepDispatch(const StepContext &context, const fb::Dispatch &dispatch) {
  if (context.batch.empty() || !perSequenceKernel(dispatch.kernel()))
    return runDispatch(context, dispatch);
  const std::span<const BatchRow> batch = context.batch;
  BatchScratch &scratch = *context.batchScratch;
  const fb::Program &program = *context.program;
  auto copyRows = [&](Arena &from, Arena &to, int32_t index, uint64_t fromRow, uint64_t toRow,
                      uint64_t count) {
    const fb::Value &value = *program.values()->Get(static_cast<flatbuffers::uoffset_t>(index));
    const uint64_t bytes =
        static_cast<uint64_t>(value.row_elements()) * dtypeByteSize(value.dtype());
    auto source = from.view(value.arena_offset() + fromRow * bytes, count * bytes);
    auto target = to.view(value.arena_offset() + toRow * bytes, count * bytes);
    if (!source.isOk())
      return source.status();
    if (!target.isOk())
      return target.status();
    std::copy(source->begin(), source->end(), target->begin());
    return Status::ok();
  };
  uint64_t first = 0; // the segment's first row in the step
  for (size_t segment = 0; segment < batch.size(); ++segment) {
    const auto count = static_cast<uint64_t>(batch[segment].rows);
    StepContext one = context;
    one.arena = &scratch.rowArena;
    one.rows = batch[segment].rows;
    one.kvSequence = batch[segment].kvSequence;
    one.stateSlot = batch[segment].stateSlot;
    one.firstPosition = batch[segment].position;
    one.kvStaging = &scratch.staging[segment];
    one.kdaLog = batch[segment].kdaLog;
    one.batch = {};
    for (int32_t input : *dispatch.inputs())
      HYBRID_RETURN_IF_ERROR(copyRows(*context.arena, scratch.rowArena, input, first, 0, count));
    HYBRID_RETURN_IF_ERROR(runDispatch(one, dispatch).withContext(
        "segment " + std::to_string(segment) + " (rows " + std::to_string(first) + " to " +
        std::to_string(first + count - 1) + ") of a batched step"));
    for (int32_t output : *dispatch.outputs())
      HYBRID_RETURN_IF_ERROR(copyRows(scratch.rowArena, *context.arena, output, 0, first, count));
    first += count;
  }
  return Status::ok();
}

} // namespace hybrid::cpu
