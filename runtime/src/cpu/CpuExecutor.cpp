#include "cpu/CpuExecutor.h"

#include "hybrid/kernels/ref/AttnRes.h"
#include "hybrid/kernels/ref/Dsa.h"
#include "hybrid/kernels/ref/Kda.h"
#include "hybrid/kernels/ref/Linear.h"
#include "hybrid/kernels/ref/Mla.h"
#include "hybrid/kernels/ref/Moe.h"
#include "hybrid/kernels/ref/Norm.h"
#include "hybrid/kernels/ref/Quant.h"
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
                                  static_cast<uint64_t>(context.rows * value->row_elements()));
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

std::vector<int64_t> positions(const StepContext &context) {
  std::vector<int64_t> result(context.rows);
  for (int64_t t = 0; t < context.rows; ++t)
    result[t] = context.firstPosition + t;
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
  std::vector<uint8_t> elements(values.size()), scales(values.size() / ref::kMxBlockSize);
  if (!ref::quantizeMxfp8(values, rows, cols, elements, scales, ref::MxScaleRule::RoundUp) ||
      !ref::dequantizeMxfp8(elements, scales, rows, cols, values))
    return Status::error("MXFP8 needs rows of a multiple of 32 values, got " +
                         std::to_string(cols));
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
  rows.assign(static_cast<size_t>(context.rows * shape.rowElements()), 0.0f);
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
  std::vector<float> out(static_cast<size_t>((past + context.rows) * width));
  if (past > 0) {
    HYBRID_ASSIGN_OR_RETURN(KvSequenceView view,
                            context.kvCache->view(kvSlot, context.kvSequence, past));
    std::span<float> head(out.data(), static_cast<size_t>(past * width));
    Status status = part == KvPart::Latent ? view.gatherLatents(head)
                    : part == KvPart::Rope ? view.gatherRopeKeys(head)
                                           : view.gatherIndexKeys(head);
    HYBRID_RETURN_IF_ERROR(status);
  }
  for (int64_t t = 0; t < context.rows; ++t)
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
                           std::to_string(c.firstPosition + t) + " is outside the vocabulary [0, " +
                           std::to_string(vocab) + ")");
    std::copy_n(w[0].data() + ids[t] * width, width, out.data() + t * width);
  }
  return Status::ok();
}

Status runKda(const StepContext &c, const fb::Dispatch &d, const Weights &w) {
  const fb::KdaParams *p = d.params_as_KdaParams();
  if (p->state_layout() != fb::StateLayout::KMajor)
    return Status::error("the cpu device keeps KDA state K-major; this plan asks for V-major");
  HYBRID_ASSIGN_OR_RETURN(std::span<float> x, floatValue(c, d.inputs()->Get(0)));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> out, floatValue(c, d.outputs()->Get(0)));
  const int64_t T = c.rows, dModel = rowElements(c, d.inputs()->Get(0));
  const int64_t H = p->num_heads(), K = p->head_dim(), P = H * K, W = p->conv_kernel();
  enum Role { Q, Kp, V, QConv, KConv, VConv, FA, FB, ALog, DtBias, B, GA, GB, G, ONorm, O };

  // The slot's conv state holds the q, k and v histories one after another, [W - 1, P] each.
  HYBRID_ASSIGN_OR_RETURN(std::span<float> convState, c.states->convState(p->state_slot(),
                                                                          c.stateSlot));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> state, c.states->state(p->state_slot(), c.stateSlot));
  const size_t history = static_cast<size_t>((W - 1) * P);
  std::vector<float> q(T * P), k(T * P), v(T * P);
  const std::vector<float> preQ = project(x, w.gemm(Q), T, dModel, P);
  const std::vector<float> preK = project(x, w.gemm(Kp), T, dModel, P);
  const std::vector<float> preV = project(x, w.gemm(V), T, dModel, P);
  ref::shortConvSilu(preQ, w[QConv], convState.subspan(0, history), q, T, P, W);
  ref::shortConvSilu(preK, w[KConv], convState.subspan(history, history), k, T, P, W);
  ref::shortConvSilu(preV, w[VConv], convState.subspan(2 * history, history), v, T, P, W);
  ref::l2NormalizeRows(q, T * H, K);
  ref::l2NormalizeRows(k, T * H, K);

  const int64_t gateRank = w.gemm(FA).layout->rows;
  std::vector<float> f =
      project(project(x, w.gemm(FA), T, dModel, gateRank), w.gemm(FB), T, gateRank, P);
  std::vector<float> g(T * P);
  std::optional<float> lowerBound;
  if (p->gate() == fb::KdaGate::LowerBound)
    lowerBound = p->gate_lower_bound();
  ref::kdaGate(f, w[ALog], w[DtBias], g, T, H, K, lowerBound);
  std::vector<float> beta = project(x, w.gemm(B), T, dModel, H);
  ref::kdaBeta(beta);

  if (c.kdaLog) {
    KdaReplayLog::Layer layer;
    layer.stateSlot = p->state_slot();
    layer.heads = H;
    layer.headDim = K;
    layer.convKernel = W;
    layer.preConv = preQ;
    layer.preConv.insert(layer.preConv.end(), preK.begin(), preK.end());
    layer.preConv.insert(layer.preConv.end(), preV.begin(), preV.end());
    layer.q = q;
    layer.k = k;
    layer.v = v;
    layer.g = g;
    layer.beta = beta;
    c.kdaLog->rows = T;
    c.kdaLog->layers.push_back(std::move(layer));
  }

  std::vector<float> o(T * P);
  ref::KdaParams core{T, H, K, K, 0.0f, q.data(), k.data(), v.data(), g.data(), beta.data(),
                      state.data(), o.data()};
  if (d.kernel() == fb::KernelId::KdaRecurrentDecode)
    ref::kdaRecurrent(core);
  else
    ref::kdaChunked(core, 64);

  std::vector<float> gate;
  if (w.has(G)) {
    gate = project(x, w.gemm(G), T, dModel, P);
  } else {
    const int64_t outRank = w.gemm(GA).layout->rows;
    gate = project(project(x, w.gemm(GA), T, dModel, outRank), w.gemm(GB), T, outRank, P);
  }
  ref::gatedRmsNorm(o, gate, w[ONorm], o, T * H, K, p->norm_epsilon());
  linear(o, w.gemm(O), out, T, P, dModel);
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
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < Hi; ++j)
      ref::applyRope({query.data() + (t * Hi + j) * Di, size_t(dr)}, c.firstPosition + t,
                     frequencies, layout);
  if (p->quantize() == fb::ActivationQuant::Mxfp8) // per head row
    return roundTripMxfp8(query, T * Hi, Di);
  return Status::ok();
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
  for (int64_t t = 0; t < T; ++t)
    ref::applyRope({key.data() + t * Di, size_t(dr)}, c.firstPosition + t, frequencies,
                   ropeLayout(p->rope()));
  if (p->quantize() == fb::ActivationQuant::Mxfp8)
    return roundTripMxfp8(key, T, Di);
  return Status::ok();
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
  std::span<float> staged = staging(c, p->kv_slot());
  for (int64_t t = 0; t < T; ++t)
    std::copy_n(keys.data() + t * Di, Di,
                staged.data() + t * shape.rowElements() + shape.latentDim + shape.ropeDim);
  HYBRID_ASSIGN_OR_RETURN(std::vector<float> allKeys,
                          pastAndCurrent(c, p->kv_slot(), KvPart::IndexKey, staged));
  const int64_t numKeys = static_cast<int64_t>(allKeys.size()) / Di;
  const std::vector<int64_t> pos = positions(c);
  std::vector<float> scores(static_cast<size_t>(T * numKeys));
  ref::indexerScores({T, numKeys, Hi, Di, queries.data(), allKeys.data(), headWeights.data(),
                      pos.data(), scores.data()});
  ref::topKIndices(scores, T, numKeys, p->top_k(), indices);
  return Status::ok();
}

Status runMla(const StepContext &c, const fb::Dispatch &d, const Weights &w) {
  const fb::MlaParams *p = d.params_as_MlaParams();
  const bool sparse = d.kernel() == fb::KernelId::SparseMlaPrefill ||
                      d.kernel() == fb::KernelId::SparseMlaDecode;
  const auto *inputs = d.inputs();
  HYBRID_ASSIGN_OR_RETURN(std::span<float> x, floatValue(c, inputs->Get(0)));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> out, floatValue(c, d.outputs()->Get(0)));
  enum Role { QProj, QBProj, KvA, KvALayerNorm, KvB, GateProj, OProj };
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

  // This step's cache rows: c = RMSNorm(kv_a latent part), k_r rotated (raw for NoPE).
  std::vector<float> kvA = project(x, w.gemm(KvA), T, dModel, rkv + dr);
  const std::vector<float> frequencies = ropeFrequencies(p->rope(), dr);
  const ref::RopeLayout layout = ropeLayout(p->rope());
  const std::vector<int64_t> pos = positions(c);
  const KvLayerShape &shape = c.kvCache->layerShape(p->kv_slot());
  if (shape.latentDim != rkv || shape.ropeDim != dr)
    return Status::error("KV slot " + std::to_string(p->kv_slot()) + " holds " +
                         std::to_string(shape.latentDim) + "+" + std::to_string(shape.ropeDim) +
                         " values per token, the attention makes " + std::to_string(rkv) + "+" +
                         std::to_string(dr));
  const fb::KvCacheLayer *quant =
      c.cacheSpec && c.cacheSpec->kv() && p->kv_slot() < int32_t(c.cacheSpec->kv()->size())
          ? c.cacheSpec->kv()->Get(p->kv_slot())
          : nullptr;
  std::vector<float> &stagedRows = (*c.kvStaging)[p->kv_slot()];
  std::span<float> staged = stagedRows.size() == size_t(T * shape.rowElements())
                                ? std::span<float>(stagedRows) // the indexer staged its keys
                                : staging(c, p->kv_slot());
  for (int64_t t = 0; t < T; ++t) {
    float *row = kvA.data() + t * (rkv + dr);
    ref::rmsNorm({row, size_t(rkv)}, w[KvALayerNorm], {row, size_t(rkv)}, 1, rkv,
                 p->latent_norm_epsilon());
    ref::applyRope({row + rkv, size_t(dr)}, pos[t], frequencies, layout);
    if (quant && quant->quant() == fb::KvQuant::Fp8Tiles) // what the cache will hold
      HYBRID_RETURN_IF_ERROR(roundTripFp8KvRow({row, size_t(rkv)}, {row + rkv, size_t(dr)},
                                               quant->quant_tile()));
    std::copy_n(row, rkv + dr, staged.data() + t * shape.rowElements());
    for (int64_t h = 0; h < H; ++h)
      ref::applyRope({queries.data() + (t * H + h) * qkDim + dn, size_t(dr)}, pos[t], frequencies,
                     layout);
  }
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

// The sum over the ranks of each rank's partial output (a sharded plan's explicit collective):
// a rank without a part (no input) adds zeros.
Status runAllReduceSum(const StepContext &c, const fb::Dispatch &d) {
  HYBRID_ASSIGN_OR_RETURN(std::span<float> out, floatValue(c, d.outputs()->Get(0)));
  const size_t count = static_cast<size_t>(c.rows * rowElements(c, d.outputs()->Get(0)));
  if (d.inputs()->size() == 1) {
    HYBRID_ASSIGN_OR_RETURN(std::span<float> partial, floatValue(c, d.inputs()->Get(0)));
    std::copy_n(partial.data(), count, out.data());
  } else {
    std::fill_n(out.data(), count, 0.0f);
  }
  if (!c.communicator)
    return Status::error("a sharded plan's collective needs a communicator "
                         "(LoadOptions::communicator, hybrid-run --world-size)");
  if (c.communicator->deviceBuffers()) // host memory handed to NCCL would fault on the GPU
    return Status::error("the " + c.communicator->backend() +
                         " communicator takes device buffers; the cpu reference's collectives "
                         "need a host one (loopback, tcp)");
  return c.communicator->allReduceSum(out.data(), count);
}

} // namespace

StatusOr<std::span<float>> floatValue(const StepContext &context, int32_t index) {
  return valueAs<float>(context, index, fb::DType::F32);
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

Status runDispatch(const StepContext &c, const fb::Dispatch &d) {
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
    status = runKda(c, d, w);
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
    for (size_t i = 0; i < sum.size(); ++i)
      sum[i] = a[i] + b[i];
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
  auto copyRow = [&](Arena &from, Arena &to, int32_t index, uint64_t fromRow, uint64_t toRow) {
    const fb::Value &value = *program.values()->Get(static_cast<flatbuffers::uoffset_t>(index));
    const uint64_t bytes =
        static_cast<uint64_t>(value.row_elements()) * dtypeByteSize(value.dtype());
    auto source = from.view(value.arena_offset() + fromRow * bytes, bytes);
    auto target = to.view(value.arena_offset() + toRow * bytes, bytes);
    if (!source.isOk())
      return source.status();
    if (!target.isOk())
      return target.status();
    std::copy(source->begin(), source->end(), target->begin());
    return Status::ok();
  };
  for (size_t row = 0; row < batch.size(); ++row) {
    StepContext one = context;
    one.arena = &scratch.rowArena;
    one.rows = 1;
    one.kvSequence = batch[row].kvSequence;
    one.stateSlot = batch[row].stateSlot;
    one.firstPosition = batch[row].position;
    one.kvStaging = &scratch.staging[row];
    one.kdaLog = nullptr;
    one.batch = {};
    for (int32_t input : *dispatch.inputs())
      HYBRID_RETURN_IF_ERROR(copyRow(*context.arena, scratch.rowArena, input, row, 0));
    HYBRID_RETURN_IF_ERROR(runDispatch(one, dispatch).withContext(
        "row " + std::to_string(row) + " of a batched step"));
    for (int32_t output : *dispatch.outputs())
      HYBRID_RETURN_IF_ERROR(copyRow(scratch.rowArena, *context.arena, output, 0, row));
  }
  return Status::ok();
}

} // namespace hybrid::cpu
