// The MLA and DSA layers on the cuda device (issue 6): the indexer prolog (query and key heads),
// the fused indexer over the paged index-key pool, and MLA (dense or sparse) in the absorbed
// form over the paged latent pool, with the pools kept in step with the host PagedKvCache.
#include "cuda/CudaExecutorImpl.h"

#include "hybrid/kernels/cuda/DsaCacheWrite.h"
#include "hybrid/kernels/cuda/Elementwise.h"
#include "hybrid/kernels/cuda/Mla.h"
#include "hybrid/kernels/cuda/Norm.h"
#include "hybrid/kernels/ref/Quant.h"

#include <algorithm>
#include <vector>

namespace hybrid::cudadev {
namespace {

// MlaParams weight roles, and the indexer key's.
enum MlaRole { MlaQProj, MlaQBProj, MlaKvA, MlaKvANorm, MlaKvB, MlaGate, MlaOProj };
enum IndexerKeyRole { IndexerWk, IndexerKNorm, IndexerKNormBias };

bool isMla(fb::KernelId kernel) {
  return kernel == fb::KernelId::MlaPrefill || kernel == fb::KernelId::MlaDecode ||
         kernel == fb::KernelId::SparseMlaPrefill || kernel == fb::KernelId::SparseMlaDecode;
}
bool isSparseMla(fb::KernelId kernel) {
  return kernel == fb::KernelId::SparseMlaPrefill || kernel == fb::KernelId::SparseMlaDecode;
}
// The kernels that read or write a KV layer's pools (kv_slot in their params).
int32_t kvSlotOf(const fb::Dispatch &d) {
  if (isMla(d.kernel()))
    return d.params_as_MlaParams() ? d.params_as_MlaParams()->kv_slot() : -1;
  if (d.kernel() == fb::KernelId::DsaIndexer || d.kernel() == fb::KernelId::IndexerQuery ||
      d.kernel() == fb::KernelId::IndexerKey)
    return d.params_as_DsaIndexerParams() ? d.params_as_DsaIndexerParams()->kv_slot() : -1;
  return -1;
}

bool rotates(const fb::Rope *rope) { return rope && rope->kind() != fb::RopeKind::None; }
kc::RopePairing pairingOf(const fb::Rope *rope) {
  return rope && rope->pairing() == fb::RopePairing::HalfSplit ? kc::RopePairing::HalfSplit
                                                               : kc::RopePairing::Interleaved;
}

// Rows of an attention dispatch processed at once, so that its per-row buffers (MLA: queries,
// absorbed queries, latent outputs, heads, gate; indexer: a row of scores per key) stay within
// kChunkFloats however long the prefill.
constexpr int64_t kChunkFloats = int64_t(32) << 20;

int64_t mlaFloatsPerChunkRow(const fb::MlaParams &p) {
  const int64_t H = p.num_heads(), dn = p.qk_nope_head_dim(), dr = p.qk_rope_head_dim();
  const int64_t rkv = p.kv_lora_rank(), dv = p.v_head_dim();
  return H * (dn + dr) + H * (rkv + dr) + H * rkv + 2 * H * dv;
}
int64_t chunkRows(int64_t floatsPerRow, int64_t rows) {
  return std::clamp<int64_t>(kChunkFloats / std::max<int64_t>(1, floatsPerRow), 1, rows);
}
// Rows of an MLA dispatch processed at once: per-row buffers within kChunkFloats, and on the
// tensor-core kernel no more split partials than kSparseMlaMaxSplits splits a row give (rows of
// a longer causal context take more splits, so fewer of them go in a launch: a 128K-position
// prefill chunk's partials would otherwise double to 2.9 GB a stream).
int64_t mlaChunkRows(const fb::MlaParams &p, int64_t rows, bool tensorCore, int64_t topK) {
  const int64_t chunk = chunkRows(mlaFloatsPerChunkRow(p), rows);
  if (!tensorCore)
    return chunk;
  const int64_t splits = kc::sparseMlaMaxSplits(static_cast<int32_t>(topK));
  return std::max<int64_t>(1, chunk * kc::kSparseMlaMaxSplits / splits);
}
// Scratch of an MLA dispatch over `rows`: the step's kv_a projection, latents and rope keys,
// then one chunk's buffers (the largest chunk mlaChunkRows gives).
int64_t mlaScratchFloats(const fb::MlaParams &p, int64_t rows) {
  const int64_t rkv = p.kv_lora_rank(), dr = p.qk_rope_head_dim(), H = p.num_heads();
  const int64_t chunk = chunkRows(mlaFloatsPerChunkRow(p), rows);
  return pad(rows * (rkv + dr)) + pad(rows * rkv) + pad(rows * dr) +
         pad(chunk * H * (p.qk_nope_head_dim() + dr)) + pad(chunk * H * (rkv + dr)) +
         pad(chunk * H * rkv) + 2 * pad(chunk * H * p.v_head_dim());
}

// FlashMLA's tensor-core sparse decode takes these shapes; others use the CUDA-core kernel.
bool tensorCoreSparseShape(int64_t latentDim, int64_t ropeDim) {
  return (latentDim == 512 && ropeDim == 64) || (latentDim == 64 && ropeDim == 32);
}

// Whether an MLA dispatch over `kv` runs on the tensor-core kernel: FP8 pages of its shapes, and
// for dense (causal) attention a context the kernel's grid can cover; else the CUDA-core one.
bool onTensorCoreKernel(bool sparse, const DeviceKvLayer &kv, int64_t latentDim, int64_t ropeDim,
                        int64_t capacity) {
  return kv.latentType == kc::LatentCacheType::Fp8Tiles && tensorCoreSparseShape(latentDim, ropeDim) &&
         (sparse || capacity <= kc::sparseMlaMaxCausalPositions());
}

} // namespace

kc::MlaLatentRowsParams mlaLatentRowsParams(const fb::MlaParams &p, int64_t rows, const float *kvA,
                                            const float *normWeight,
                                            const float *inverseFrequencies,
                                            const int32_t *positions, float *latent, float *rope) {
  kc::MlaLatentRowsParams params;
  params.rows = static_cast<int32_t>(rows);
  params.latentDim = static_cast<int32_t>(p.kv_lora_rank());
  params.ropeDim = static_cast<int32_t>(p.qk_rope_head_dim());
  params.epsilon = p.latent_norm_epsilon();
  params.kvA = kvA;
  params.normWeight = normWeight;
  params.pairing = pairingOf(p.rope());
  params.inverseFrequencies = inverseFrequencies;
  params.positions = positions;
  params.latent = latent;
  params.rope = rope;
  return params;
}

Status CudaExecutor::Impl::planKvLayers(const fb::Plan &plan, PagedKvCache &kvCache,
                                        const LoadOptions &options, int64_t maxRows) {
  const fb::CacheSpec *spec = plan.cache();
  const int32_t numKv = spec && spec->kv() ? static_cast<int32_t>(spec->kv()->size()) : 0;
  kvLayers.assign(static_cast<size_t>(numKv), DeviceKvLayer{});
  pageTokens = std::max<int64_t>(1, spec ? spec->page_size() : 1);
  maxPages = static_cast<int32_t>((options.maxContextTokens + pageTokens - 1) / pageTokens);
  if (numKv == 0)
    return Status::ok();

  // A layer runs on the GPU when each of its MLA and indexer dispatches (the indexer prolog's
  // too) has kernels for its shapes and weights; the index keys' format is what the layer's IndexerKey rounds them to.
  std::vector<int> verdict(static_cast<size_t>(numKv), 0); // 0: unseen, 1: fits, -1: does not
  std::vector<kc::IndexKeyType> keyTypes(static_cast<size_t>(numKv), kc::IndexKeyType::F32);
  std::vector<fb::ActivationQuant> queryQuants(static_cast<size_t>(numKv),
                                               fb::ActivationQuant::None);
  auto fits = [&](const fb::Dispatch &d, int32_t slot) {
    const fb::KvCacheLayer *layer = spec->kv()->Get(static_cast<flatbuffers::uoffset_t>(slot));
    if (isMla(d.kernel())) {
      const fb::MlaParams *p = d.params_as_MlaParams();
      const int32_t kvB = roleOf(d, MlaKvB);
      const bool latentFits =
          layer->latent_dim() == p->kv_lora_rank() && layer->rope_dim() == p->qk_rope_head_dim() &&
          (layer->quant() == fb::KvQuant::None ||
           (layer->quant() == fb::KvQuant::Fp8Tiles && layer->quant_tile() == 128));
      const bool shapes = p->num_heads() > 0 && p->kv_lora_rank() > 0 &&
                          p->kv_lora_rank() <= kc::kMlaMaxLatentDim && p->kv_lora_rank() % 4 == 0 &&
                          p->qk_rope_head_dim() >= 0 && p->qk_rope_head_dim() <= 64 &&
                          p->qk_rope_head_dim() % 2 == 0 && p->qk_nope_head_dim() > 0 &&
                          p->qk_nope_head_dim() <= 256 && p->v_head_dim() > 0;
      // FP8 codes are read 16 bytes at a time (MlaHeadWeights).
      const bool kvBFits =
          kvB >= 0 &&
          plan.weights()->Get(static_cast<flatbuffers::uoffset_t>(kvB))->layout() ==
              fb::Layout::RowMajor &&
          (weightTypes[kvB] == fb::DType::BF16 || weightTypes[kvB] == fb::DType::F32 ||
           (weightTypes[kvB] == fb::DType::F8_E4M3 && p->kv_lora_rank() % 16 == 0 &&
            plan.weights()->Get(static_cast<flatbuffers::uoffset_t>(kvB))->offset() % 16 == 0));
      const bool gate = roleOf(d, MlaGate) < 0 || gemmWeight(roleOf(d, MlaGate));
      return latentFits && shapes && kvBFits && gate && roleOf(d, MlaKvANorm) >= 0 &&
             gemmWeight(roleOf(d, p->q_lora_rank() > 0 ? MlaQBProj : MlaQProj)) &&
             gemmWeight(roleOf(d, MlaKvA)) && gemmWeight(roleOf(d, MlaOProj));
    }
    if (d.kernel() != fb::KernelId::DsaIndexer)
      return indexerPrologFits(d);
    const fb::DsaIndexerParams *p = d.params_as_DsaIndexerParams();
    return p->index_heads() > 0 && p->index_heads() <= kc::kIndexerMaxHeads &&
           (p->index_head_dim() == 64 || p->index_head_dim() == 128) &&
           layer->index_key_dim() == p->index_head_dim() && p->top_k() > 0 &&
           p->top_k() <= kc::kIndexerMaxTopK; // a top-k above the capacity selects every key
  };
  for (const fb::Program *program : programs)
    for (const fb::Step *step : *program->steps()) {
      const fb::Dispatch *d = step->op_as_Dispatch();
      if (!d)
        continue;
      if (d->kernel() == fb::KernelId::IndexerQuery && d->params_as_DsaIndexerParams()) {
        const fb::DsaIndexerParams *p = d->params_as_DsaIndexerParams();
        if (p->kv_slot() >= 0 && p->kv_slot() < numKv)
          queryQuants[static_cast<size_t>(p->kv_slot())] = p->quantize();
      }
      if (d->kernel() == fb::KernelId::IndexerKey && d->params_as_DsaIndexerParams()) {
        const fb::DsaIndexerParams *p = d->params_as_DsaIndexerParams();
        if (p->kv_slot() >= 0 && p->kv_slot() < numKv)
          keyTypes[static_cast<size_t>(p->kv_slot())] =
              p->quantize() == fb::ActivationQuant::Mxfp8       ? kc::IndexKeyType::Mxfp8
              : p->quantize() == fb::ActivationQuant::Fp8PerRow ? kc::IndexKeyType::Fp8PerKey
                                                                : kc::IndexKeyType::F32;
      }
      const int32_t slot = kvSlotOf(*d);
      if (slot < 0 || slot >= numKv)
        continue;
      int &state = verdict[static_cast<size_t>(slot)];
      if (state >= 0)
        state = fits(*d, slot) ? 1 : -1;
    }

  size_t poolBytes = 0;
  std::vector<std::pair<size_t, size_t>> offsets(static_cast<size_t>(numKv));
  for (int32_t slot = 0; slot < numKv; ++slot) {
    if (verdict[static_cast<size_t>(slot)] != 1)
      continue;
    const fb::KvCacheLayer *layer = spec->kv()->Get(static_cast<flatbuffers::uoffset_t>(slot));
    DeviceKvLayer &kv = kvLayers[static_cast<size_t>(slot)];
    kv.onGpu = true;
    kv.latentDim = layer->latent_dim();
    kv.ropeDim = layer->rope_dim();
    kv.indexDim = layer->index_key_dim();
    kv.latentType = layer->quant() == fb::KvQuant::Fp8Tiles ? kc::LatentCacheType::Fp8Tiles
                                                           : kc::LatentCacheType::F32;
    kv.keyType = keyTypes[static_cast<size_t>(slot)];
    kv.mxfp8Queries = queryQuants[static_cast<size_t>(slot)] == fb::ActivationQuant::Mxfp8;
    kv.fp8HeadQueries = queryQuants[static_cast<size_t>(slot)] == fb::ActivationQuant::Fp8PerRow;
    if (kv.keyType == kc::IndexKeyType::Mxfp8 && kv.indexDim % 32 != 0)
      kv.keyType = kc::IndexKeyType::F32; // never: IndexerKey rounds only multiples of 32
    kv.latentPageBytes = pageTokens * kc::latentRowBytes(kv.latentType, kv.latentDim, kv.ropeDim);
    kv.indexPageBytes =
        kv.indexDim > 0 ? kc::indexerPageBytes(kv.keyType, static_cast<int32_t>(pageTokens), kv.indexDim)
                        : 0;
    offsets[static_cast<size_t>(slot)].first = poolBytes;
    poolBytes += alignUp(static_cast<size_t>(kv.latentPageBytes * kvCache.numPages()));
    offsets[static_cast<size_t>(slot)].second = poolBytes;
    poolBytes += alignUp(static_cast<size_t>(kv.indexPageBytes * kvCache.numPages()));
    kvOnGpu = true;
  }
  if (!kvOnGpu)
    return Status::ok();
  const size_t positionsOffset = poolBytes;
  poolBytes += 2 * alignUp(static_cast<size_t>(maxRows) * sizeof(int32_t));
  const size_t tablesOffset = poolBytes;
  const size_t tableEntries = static_cast<size_t>(maxRows) * static_cast<size_t>(maxPages);
  poolBytes += alignUp(tableEntries * sizeof(int32_t));
  CUDA_RETURN_IF_ERROR(cudaMalloc(&kvPool, poolBytes),
                       "KV pools (" + std::to_string(poolBytes) + " bytes for " +
                           std::to_string(kvCache.numPages()) + " pages)");
  CUDA_RETURN_IF_ERROR(cudaMemset(kvPool, 0, poolBytes), "KV pools");
  for (int32_t slot = 0; slot < numKv; ++slot) {
    DeviceKvLayer &kv = kvLayers[static_cast<size_t>(slot)];
    if (!kv.onGpu)
      continue;
    kv.latentPages = kvPool + offsets[static_cast<size_t>(slot)].first;
    kv.indexPages = kv.indexDim > 0 ? kvPool + offsets[static_cast<size_t>(slot)].second : nullptr;
  }
  rowPositions = reinterpret_cast<int32_t *>(kvPool + positionsOffset);
  rowSequences = reinterpret_cast<int32_t *>(
      kvPool + positionsOffset + alignUp(static_cast<size_t>(maxRows) * sizeof(int32_t)));
  blockTables = reinterpret_cast<int32_t *>(kvPool + tablesOffset);
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&pinnedPositions, static_cast<size_t>(maxRows) * sizeof(int32_t)),
                       "pinned positions");
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&pinnedSequences, static_cast<size_t>(maxRows) * sizeof(int32_t)),
                       "pinned positions");
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&pinnedTables, tableEntries * sizeof(int32_t)),
                       "pinned block tables");
  kvCache.recordPageCopies(true); // repeated on the pools by prepareKvStep
  return Status::ok();
}

bool CudaExecutor::Impl::indexerPrologFits(const fb::Dispatch &d) const {
  const fb::DsaIndexerParams *p = d.params_as_DsaIndexerParams();
  if (!p || p->index_heads() <= 0 || p->index_head_dim() <= 0 || p->rope_head_dim() < 0 ||
      p->rope_head_dim() % 2 != 0 || p->rope_head_dim() > p->index_head_dim() ||
      (p->quantize() != fb::ActivationQuant::None && p->index_head_dim() % 32 != 0) ||
      !gemmWeight(roleOf(d, 0)))
    return false;
  return d.kernel() == fb::KernelId::IndexerQuery ||
         (roleOf(d, IndexerKNorm) >= 0 && roleOf(d, IndexerKNormBias) >= 0);
}

bool CudaExecutor::Impl::attentionRunsOnGpu(const fb::Dispatch &d) const {
  const int32_t slot = kvSlotOf(d);
  const bool layerOnGpu = slot >= 0 && slot < static_cast<int32_t>(kvLayers.size()) &&
                          kvLayers[static_cast<size_t>(slot)].onGpu;
  switch (d.kernel()) {
  case fb::KernelId::IndexerQuery:
  case fb::KernelId::IndexerKey: // with the rest of their layer (they read its step positions)
  case fb::KernelId::DsaIndexer:
  case fb::KernelId::MlaPrefill:
  case fb::KernelId::MlaDecode:
  case fb::KernelId::SparseMlaPrefill:
  case fb::KernelId::SparseMlaDecode:
    return layerOnGpu;
  default:
    return false;
  }
}

Status CudaExecutor::Impl::prepareAttention(const fb::Dispatch &d, const fb::Program &program,
                                            int64_t rows,
                                            const HostWeights &hostWeights,
                                            size_t &floats, size_t &xWidth, size_t &outWidth) {
  auto width = [&](int32_t value) { return static_cast<size_t>(valueOf(program, value).row_elements()); };
  auto frequencies = [&](const fb::Rope *rope, int64_t dims) -> Status {
    if (!rotates(rope) || dims == 0 || ropeFrequencies.count(&d))
      return Status::ok();
    return uploadFloats(cpu::ropeFrequencies(rope, dims), ropeFrequencies[&d],
                        "RoPE frequencies");
  };
  switch (d.kernel()) {
  case fb::KernelId::IndexerQuery:
  case fb::KernelId::IndexerKey: {
    const fb::DsaIndexerParams *p = d.params_as_DsaIndexerParams();
    HYBRID_RETURN_IF_ERROR(frequencies(p->rope(), p->rope_head_dim()));
    HYBRID_RETURN_IF_ERROR(uploadSmallWeight(roleOf(d, IndexerKNorm), hostWeights));
    HYBRID_RETURN_IF_ERROR(uploadSmallWeight(roleOf(d, IndexerKNormBias), hostWeights));
    xWidth = width(d.inputs()->Get(0));
    outWidth = width(d.outputs()->Get(0));
    return Status::ok();
  }
  case fb::KernelId::DsaIndexer: {
    const int64_t maxKeys = int64_t(maxPages) * pageTokens;
    const int64_t chunk = chunkRows(maxKeys, rows);
    prepared.attentionWorkspaceBytes =
        std::max(prepared.attentionWorkspaceBytes,
                 alignUp(static_cast<size_t>(chunk * maxKeys) * sizeof(float)) +
                     kc::indexerSelectWorkspaceBytes(static_cast<int32_t>(chunk),
                                                     static_cast<int32_t>(maxKeys)));
    return Status::ok();
  }
  default:
    if (!isMla(d.kernel()))
      return Status::error("no GPU attention kernel (placement error)");
    break;
  }
  const fb::MlaParams *p = d.params_as_MlaParams();
  const int64_t H = p->num_heads(), dn = p->qk_nope_head_dim(), dr = p->qk_rope_head_dim();
  const int64_t rkv = p->kv_lora_rank(), dv = p->v_head_dim();
  HYBRID_RETURN_IF_ERROR(frequencies(p->rope(), dr));
  HYBRID_RETURN_IF_ERROR(uploadSmallWeight(roleOf(d, MlaKvANorm), hostWeights));
  const int32_t kvB = roleOf(d, MlaKvB);
  const fb::Weight *kvBWeight = plan->weights()->Get(static_cast<flatbuffers::uoffset_t>(kvB));
  const int64_t kvBValues = H * (dn + dv) * rkv;
  if (!kvBWeight->shape() || kvBWeight->shape()->size() != 2 ||
      kvBWeight->shape()->Get(0) * kvBWeight->shape()->Get(1) != kvBValues)
    return Status::error("weight '" + kvBWeight->name()->str() + "' is not [" +
                         std::to_string(H * (dn + dv)) + ", " + std::to_string(rkv) + "]");
  // FP8 kv_b_proj: the absorption and expansion kernels take each weight as its code times its
  // block scale in fp32, the value the cpu reads (rounded to bf16 the weights would move the
  // attention output enough, about 1e-3, to flip the E4M3 rounding of o_proj's quantized input
  // here and there), from the codes: no fp32 copy (4 GB for DeepSeek-V3.2) to read.
  if (weightTypes[kvB] == fb::DType::F8_E4M3)
    HYBRID_RETURN_IF_ERROR(uploadFp8WeightScales(kvB, hostWeights));
  const size_t dModel = width(d.inputs()->Get(0));
  const size_t qIn = p->q_lora_rank() > 0 ? static_cast<size_t>(p->q_lora_rank()) : dModel;
  floats = static_cast<size_t>(mlaScratchFloats(*p, rows));
  xWidth = std::max({dModel, qIn, static_cast<size_t>(H * dv)});
  outWidth = std::max({dModel, static_cast<size_t>(H * (dn + dr)), static_cast<size_t>(rkv + dr),
                       static_cast<size_t>(H * dv)});
  const int32_t slot = kvSlotOf(d);
  const bool sparse = isSparseMla(d.kernel());
  const int64_t capacity = int64_t(maxPages) * pageTokens;
  if (slot >= 0 && slot < static_cast<int32_t>(kvLayers.size()) &&
      onTensorCoreKernel(sparse, kvLayers[static_cast<size_t>(slot)], rkv, dr, capacity)) {
    // As runMla launches it: the indexer's top-k, or (causal) every position a sequence holds.
    const int64_t topK = sparse ? static_cast<int64_t>(width(d.inputs()->Get(1))) : capacity;
    const int64_t chunk = mlaChunkRows(*p, rows, true, topK);
    prepared.attentionWorkspaceBytes = std::max(
        prepared.attentionWorkspaceBytes,
        kc::sparseMlaWorkspaceBytes(static_cast<int32_t>(chunk), static_cast<int32_t>(H),
                                    static_cast<int32_t>(rkv), static_cast<int32_t>(topK)));
  }
  return Status::ok();
}

Status CudaExecutor::Impl::prepareKvStep(const cpu::StepContext &host) {
  if (!kvOnGpu)
    return Status::ok();
  PagedKvCache &cache = *host.kvCache;
  const int64_t rows = host.rows;
  // Table row per sequence: one in a prefill (every row the same sequence), one per segment in
  // a batched step (a row each in a batched decode).
  std::vector<int32_t> tableSequences;
  // A context-parallel prefill writes every rank's rows of the step (at stepPositions); its
  // rows are this rank's.
  const cpu::ContextShard *shard = host.contextShard;
  const int64_t written = shard ? shard->stepRows : rows;
  if (host.batch.empty()) {
    HYBRID_RETURN_IF_ERROR(cache.prepareWrite(host.kvSequence, host.firstPosition, written));
    tableSequences.push_back(host.kvSequence);
    for (int64_t r = 0; r < std::max(rows, written); ++r) {
      if (r < rows)
        pinnedPositions[r] =
            static_cast<int32_t>(host.firstPosition + (shard ? shard->rows[size_t(r)] : r));
      pinnedSequences[r] = 0;
    }
  } else {
    int64_t r = 0;
    for (size_t i = 0; i < host.batch.size(); ++i) {
      const cpu::BatchRow &segment = host.batch[i];
      if (r + segment.rows > rows)
        return Status::error("a batched step's segments hold more than its " +
                             std::to_string(rows) + " rows");
      HYBRID_RETURN_IF_ERROR(cache.prepareWrite(segment.kvSequence, segment.position, segment.rows));
      tableSequences.push_back(segment.kvSequence);
      for (int64_t k = 0; k < segment.rows; ++k, ++r) {
        pinnedPositions[r] = static_cast<int32_t>(segment.position + k);
        pinnedSequences[r] = static_cast<int32_t>(i);
      }
    }
  }
  // The host's page copies since the last step, in order, before anything reads or writes them.
  HYBRID_RETURN_IF_ERROR(flushPageCopies(cache));
  for (size_t i = 0; i < tableSequences.size(); ++i) {
    std::span<const int32_t> pages = cache.pageTable(tableSequences[i]);
    if (static_cast<int64_t>(pages.size()) > maxPages)
      return Status::error("KV sequence " + std::to_string(tableSequences[i]) + " holds " +
                           std::to_string(pages.size()) + " pages, more than the " +
                           std::to_string(maxPages) + " of maxContextTokens");
    int32_t *row = pinnedTables + i * static_cast<size_t>(maxPages);
    std::copy(pages.begin(), pages.end(), row);
    std::fill(row + pages.size(), row + maxPages, 0);
  }
  const size_t rowBytes = static_cast<size_t>(rows) * sizeof(int32_t);
  stageUpload(rowPositions, pinnedPositions, rowBytes, "positions upload");
  stageUpload(rowSequences, pinnedSequences,
              static_cast<size_t>(std::max(rows, written)) * sizeof(int32_t),
              "block-table rows upload");
  writePositions = rowPositions;
  if (shard) {
    if (!stepPositions)
      return Status::error("a context-parallel prefill on a plan loaded without context "
                           "parallelism");
    for (int64_t t = 0; t < written; ++t)
      pinnedStepPositions[t] = static_cast<int32_t>(host.firstPosition + t);
    stageUpload(stepPositions, pinnedStepPositions, static_cast<size_t>(written) * sizeof(int32_t),
                "step positions upload");
    writePositions = stepPositions;
  }
  stageUpload(blockTables, pinnedTables,
              tableSequences.size() * static_cast<size_t>(maxPages) * sizeof(int32_t),
              "block tables upload");
  return Status::ok();
}

Status CudaExecutor::Impl::flushPageCopies(PagedKvCache &cache) {
  cudaStream_t stream = streams[0]->stream;
  for (const PagedKvCache::PageCopy &copy : cache.takePageCopies())
    for (const DeviceKvLayer &kv : kvLayers) {
      if (!kv.onGpu)
        continue;
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(kv.latentPages + copy.to * kv.latentPageBytes,
                                           kv.latentPages + copy.from * kv.latentPageBytes,
                                           static_cast<size_t>(kv.latentPageBytes),
                                           cudaMemcpyDeviceToDevice, stream),
                           "KV page copy");
      if (kv.indexPages)
        CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(kv.indexPages + copy.to * kv.indexPageBytes,
                                             kv.indexPages + copy.from * kv.indexPageBytes,
                                             static_cast<size_t>(kv.indexPageBytes),
                                             cudaMemcpyDeviceToDevice, stream),
                             "KV page copy");
    }
  return Status::ok();
}

bool CudaExecutor::kvLayerOnDevice(int32_t kvSlot) const {
  return kvSlot >= 0 && kvSlot < static_cast<int32_t>(impl_->kvLayers.size()) &&
         impl_->kvLayers[static_cast<size_t>(kvSlot)].onGpu;
}

Status CudaExecutor::appendZeroKvRows(PagedKvCache &kvCache, int32_t kvSlot, int32_t kvSequence,
                                      int64_t count) {
  Impl &impl = *impl_;
  if (!kvLayerOnDevice(kvSlot))
    return Status::error("KV layer " + std::to_string(kvSlot) + " is not in the device pools");
  if (count <= 0)
    return Status::ok();
  const int64_t begin = kvCache.length(kvSlot, kvSequence);
  HYBRID_RETURN_IF_ERROR(kvCache.prepareWrite(kvSequence, begin, count));
  HYBRID_RETURN_IF_ERROR(impl.flushPageCopies(kvCache));
  // All-zero bytes decode to zero in every row format (codes and scales, fp32 or bf16 values);
  // an index-key row's scales are left: any finite scale times zero codes is zero.
  const DeviceKvLayer &kv = impl.kvLayers[static_cast<size_t>(kvSlot)];
  const std::span<const int32_t> pages = kvCache.pageTable(kvSequence);
  const int64_t latentRow = kv.latentPageBytes / impl.pageTokens;
  const int64_t codeRow = kv.keyType == kc::IndexKeyType::F32 ? 4 * int64_t(kv.indexDim)
                                                              : int64_t(kv.indexDim);
  cudaStream_t stream = impl.streams[0]->stream;
  for (int64_t position = begin; position < begin + count; ++position) {
    const int64_t page = pages[static_cast<size_t>(position / impl.pageTokens)];
    const int64_t slot = position % impl.pageTokens;
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(kv.latentPages + page * kv.latentPageBytes +
                                             slot * latentRow,
                                         0, static_cast<size_t>(latentRow), stream),
                         "zero KV rows");
    if (kv.indexPages)
      CUDA_RETURN_IF_ERROR(cudaMemsetAsync(kv.indexPages + page * kv.indexPageBytes +
                                               slot * codeRow,
                                           0, static_cast<size_t>(codeRow), stream),
                           "zero KV rows");
  }
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "zero KV rows");
  return kvCache.advance(kvSlot, kvSequence, count);
}

Status CudaExecutor::Impl::finishKvStep(size_t programIndex, const cpu::StepContext &host) {
  for (const fb::Dispatch *d : kvWriters[programIndex]) {
    const int32_t slot = d->params_as_MlaParams()->kv_slot();
    if (host.batch.empty()) {
      HYBRID_RETURN_IF_ERROR(host.kvCache->advance(
          slot, host.kvSequence, host.contextShard ? host.contextShard->stepRows : host.rows));
      continue;
    }
    for (const cpu::BatchRow &segment : host.batch)
      HYBRID_RETURN_IF_ERROR(host.kvCache->advance(slot, segment.kvSequence, segment.rows));
  }
  return Status::ok();
}

Status CudaExecutor::Impl::runAttention(const fb::Program &program, unsigned char *arena,
                                        const fb::Dispatch &d, StreamResources &r,
                                        const cpu::StepContext &host) {
  if (isMla(d.kernel()))
    return runMla(program, arena, d, r, host);
  if (d.kernel() == fb::KernelId::DsaIndexer)
    return runDsaIndexer(program, arena, d, r, host);
  // The indexer's query heads (wq_b on the query latent) or key (wk, LayerNorm): rotated on their
  // leading rope dims, rounded to MXFP8 when the policy says so.
  const fb::DsaIndexerParams *p = d.params_as_DsaIndexerParams();
  const int64_t T = host.rows, Di = p->index_head_dim();
  const bool query = d.kernel() == fb::KernelId::IndexerQuery;
  const int64_t heads = query ? p->index_heads() : 1;
  const fb::Value &in = valueOf(program, d.inputs()->Get(0));
  const float *x = reinterpret_cast<const float *>(arena + in.arena_offset());
  float *out = reinterpret_cast<float *>(arena + valueOf(program, d.outputs()->Get(0)).arena_offset());
  HYBRID_RETURN_IF_ERROR(gemm(r, x, in.row_elements(), roleOf(d, 0), out, heads * Di, T,
                              in.row_elements(), heads * Di));
  if (!query) {
    kc::LayerNormParams norm;
    norm.rows = T;
    norm.dim = Di;
    norm.epsilon = p->norm_epsilon();
    norm.x = out;
    norm.weight = fp32Weights.at(roleOf(d, IndexerKNorm));
    norm.bias = fp32Weights.at(roleOf(d, IndexerKNormBias));
    norm.y = out;
    LAUNCH_RETURN_IF_ERROR(kc::launchLayerNorm(norm, r.stream), "indexer key LayerNorm");
  }
  // RoPE and the MXFP8 or FP8 rounding in one launch (the prolog's quantization fused).
  const bool rotated = rotates(p->rope()) && p->rope_head_dim() > 0;
  kc::RopeParams rope;
  rope.rows = static_cast<int32_t>(T);
  rope.heads = static_cast<int32_t>(heads);
  rope.rowStride = heads * Di;
  rope.headStride = Di;
  rope.dims = rotated ? p->rope_head_dim() : 0;
  rope.pairing = pairingOf(p->rope());
  rope.inverseFrequencies = rotated ? ropeFrequencies.at(&d) : nullptr;
  rope.positions = rowPositions;
  rope.x = out;
  rope.mxfp8Width = p->quantize() == fb::ActivationQuant::Mxfp8 ? heads * Di : 0;
  rope.fp8Width = p->quantize() == fb::ActivationQuant::Fp8PerRow ? heads * Di : 0;
  rope.fp8Group = static_cast<int32_t>(Di);
  LAUNCH_RETURN_IF_ERROR(kc::launchRope(rope, r.stream), "indexer RoPE and FP8 rounding");
  return Status::ok();
}

Status CudaExecutor::Impl::runDsaIndexer(const fb::Program &program, unsigned char *arena,
                                         const fb::Dispatch &d, StreamResources &r,
                                         const cpu::StepContext &host) {
  const fb::DsaIndexerParams *p = d.params_as_DsaIndexerParams();
  const DeviceKvLayer &kv = kvLayers[static_cast<size_t>(p->kv_slot())];
  auto value = [&](int32_t index) { return arena + valueOf(program, index).arena_offset(); };
  const int64_t T = host.rows, Hi = p->index_heads(), Di = p->index_head_dim();
  const int64_t topK = valueOf(program, d.outputs()->Get(0)).row_elements();
  const auto *queries = reinterpret_cast<const float *>(value(d.inputs()->Get(0)));
  const auto *keys = reinterpret_cast<const float *>(value(d.inputs()->Get(1)));
  const auto *headWeights = reinterpret_cast<const float *>(value(d.inputs()->Get(2)));
  auto *indices = reinterpret_cast<int32_t *>(value(d.outputs()->Get(0)));

  // The step's keys join the pool first: every row attends to its own and earlier positions. In
  // a context-parallel prefill they are every rank's (gathered), the queries this rank's.
  kc::IndexKeyWriteParams write;
  write.where = stepTokens(cpu::valueRows(host, valueOf(program, d.inputs()->Get(1))));
  write.dim = static_cast<int32_t>(Di);
  write.type = kv.keyType;
  write.keys = keys;
  write.pages = kv.indexPages;
  LAUNCH_RETURN_IF_ERROR(kc::launchWriteIndexKeys(write, r.stream), "index-key cache write");

  const int64_t maxKeys = int64_t(maxPages) * pageTokens;
  // The workspace form, rows in chunks: on the H200 it is faster than the fused form at every
  // measured shape (docs/performance.md, 2026-11-30), whose cluster of blocks per row leaves
  // most of the GPU idle at small batches.
  const int64_t chunk = chunkRows(maxKeys, std::max<int64_t>(1, T));
  const size_t scoreBytes = alignUp(static_cast<size_t>(chunk * maxKeys) * sizeof(float));
  if (scoreBytes + kc::indexerSelectWorkspaceBytes(static_cast<int32_t>(chunk),
                                                   static_cast<int32_t>(maxKeys)) >
      r.sizes.attentionWorkspaceBytes)
    return Status::error("indexer workspace larger than planned at load");
  for (int64_t first = 0; first < T; first += chunk) {
    kc::IndexerParams s;
    s.rows = static_cast<int32_t>(std::min(chunk, T - first));
    s.heads = static_cast<int32_t>(Hi);
    s.headDim = static_cast<int32_t>(Di);
    s.q = queries + first * Hi * Di;
    s.mxfp8Queries = kv.mxfp8Queries;
    s.fp8HeadQueries = kv.fp8HeadQueries;
    s.headWeights = headWeights + first * Hi;
    s.positions = rowPositions + first;
    s.sequences = rowSequences + first;
    s.keyPages = kv.indexPages;
    s.keyType = kv.keyType;
    s.pageTokens = static_cast<int32_t>(pageTokens);
    s.blockTables = blockTables;
    s.maxPages = maxPages;
    s.scores = static_cast<float *>(r.attentionWorkspace);
    s.maxKeys = static_cast<int32_t>(maxKeys);
    s.topK = static_cast<int32_t>(topK);
    s.indices = indices + first * topK;
    s.selectWorkspace = static_cast<unsigned char *>(r.attentionWorkspace) + scoreBytes;
    applyTuning(s);
    LAUNCH_RETURN_IF_ERROR(kc::launchIndexerTopK(s, r.stream), "DSA indexer");
  }
  return Status::ok();
}

Status CudaExecutor::Impl::runMla(const fb::Program &program, unsigned char *arena,
                                  const fb::Dispatch &d, StreamResources &r,
                                  const cpu::StepContext &host) {
  const fb::MlaParams *p = d.params_as_MlaParams();
  const bool sparse = isSparseMla(d.kernel());
  const DeviceKvLayer &kv = kvLayers[static_cast<size_t>(p->kv_slot())];
  auto value = [&](int32_t index) { return arena + valueOf(program, index).arena_offset(); };
  const int64_t T = host.rows, dModel = valueOf(program, d.inputs()->Get(0)).row_elements();
  const int64_t H = p->num_heads(), dn = p->qk_nope_head_dim(), dr = p->qk_rope_head_dim();
  const int64_t dv = p->v_head_dim(), rkv = p->kv_lora_rank(), qkDim = dn + dr;
  const int64_t qIn = p->q_lora_rank() > 0 ? p->q_lora_rank() : dModel;
  const auto *x = reinterpret_cast<const float *>(value(d.inputs()->Get(0)));
  const auto *queryInput =
      p->q_lora_rank() > 0 ? reinterpret_cast<const float *>(value(d.inputs()->Get(sparse ? 2 : 1)))
                           : x;
  const int32_t *indices = sparse ? reinterpret_cast<const int32_t *>(value(d.inputs()->Get(1)))
                                  : nullptr;
  const int64_t topK = sparse ? valueOf(program, d.inputs()->Get(1)).row_elements() : 0;
  auto *out = reinterpret_cast<float *>(value(d.outputs()->Get(0)));
  const float *frequencies = rotates(p->rope()) && dr > 0 ? ropeFrequencies.at(&d) : nullptr;
  const int32_t kvB = roleOf(d, MlaKvB);
  kc::MlaHeadWeights heads;
  heads.heads = static_cast<int32_t>(H);
  heads.nopeDim = static_cast<int32_t>(dn);
  heads.valueDim = static_cast<int32_t>(dv);
  heads.latentDim = static_cast<int32_t>(rkv);
  heads.kvB = weight(kvB);
  heads.type = weightTypes[kvB] == fb::DType::BF16      ? kc::WeightType::BF16
               : weightTypes[kvB] == fb::DType::F8_E4M3 ? kc::WeightType::Fp8Block
                                                        : kc::WeightType::F32;
  if (heads.type == kc::WeightType::Fp8Block) {
    heads.kvBScales = fp8WeightScales.at(kvB);
    heads.kvBScaleStride = kc::linearFp8WeightScaleStride(rkv);
  }

  // The step's cache rows: this step's own, or in a context-parallel prefill every rank's,
  // gathered (the input after the others: [latent | rope] rows at the step's positions).
  const int32_t ownInputs = (sparse ? 2 : 1) + (p->q_lora_rank() > 0 ? 1 : 0);
  const bool gathered = static_cast<int32_t>(d.inputs()->size()) == ownInputs + 1;
  const int64_t written =
      gathered ? cpu::valueRows(host, valueOf(program, d.inputs()->Get(ownInputs))) : T;
  if (gathered && valueOf(program, d.inputs()->Get(ownInputs)).row_elements() != rkv + dr)
    return Status::error("input " + std::to_string(ownInputs) + " (gathered cache rows) holds " +
                         std::to_string(valueOf(program, d.inputs()->Get(ownInputs)).row_elements()) +
                         " values per row, the attention makes " + std::to_string(rkv + dr));
  if (static_cast<size_t>(mlaScratchFloats(*p, std::max<int64_t>({1, T, written}))) >
      r.sizes.scratchFloats)
    return Status::error("MLA scratch larger than planned at load");
  float *next = r.scratch;
  auto carve = [&](int64_t floats) {
    float *start = next;
    next += pad(floats);
    return start;
  };
  // The positions a row may attend: the indexer's top-k, or (causal) a sequence's capacity.
  const int64_t capacity = int64_t(maxPages) * pageTokens, positions = sparse ? topK : capacity;
  const bool tensorCore = onTensorCoreKernel(sparse, kv, rkv, dr, capacity);
  const int64_t chunk = mlaChunkRows(*p, std::max<int64_t>(1, T), tensorCore, positions);
  const int64_t cacheRows = std::max(T, written);
  float *kvA = carve(cacheRows * (rkv + dr)), *latent = carve(cacheRows * rkv);
  float *rope = carve(cacheRows * dr);
  float *queries = carve(chunk * H * qkDim), *absorbed = carve(chunk * H * (rkv + dr));
  float *latentOut = carve(chunk * H * rkv), *headOut = carve(chunk * H * dv);
  float *gate = carve(chunk * H * dv);

  // The step's cache rows: c = RMSNorm(kv_a latent part), k_r rotated; into the pool first, so
  // that every row attends to its own position too.
  if (gathered) { // [latent | rope] rows, split into the write's two arrays
    const auto *rowsIn = reinterpret_cast<const float *>(value(d.inputs()->Get(ownInputs)));
    const size_t pitch = static_cast<size_t>(rkv + dr) * sizeof(float);
    CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(latent, static_cast<size_t>(rkv) * sizeof(float), rowsIn,
                                           pitch, static_cast<size_t>(rkv) * sizeof(float),
                                           static_cast<size_t>(written), cudaMemcpyDeviceToDevice,
                                           r.stream),
                         "gathered cache rows");
    if (dr > 0)
      CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(rope, static_cast<size_t>(dr) * sizeof(float),
                                             rowsIn + rkv, pitch,
                                             static_cast<size_t>(dr) * sizeof(float),
                                             static_cast<size_t>(written),
                                             cudaMemcpyDeviceToDevice, r.stream),
                           "gathered cache rows");
  }
  // In one chunk (a decode step) the projections of x (kv_a, the queries without a q LoRA, the
  // output gate) run as one group: a launch each would cost more latency than its bytes.
  const bool oneChunk = chunk >= T;
  const int32_t queryRole = roleOf(d, p->q_lora_rank() > 0 ? MlaQBProj : MlaQProj);
  const bool queriesWithKvA = !gathered && oneChunk && p->q_lora_rank() == 0;
  const bool gateWithKvA = !gathered && oneChunk && roleOf(d, MlaGate) >= 0;
  if (!gathered) {
    std::vector<GemmCall> ofX = {{x, dModel, roleOf(d, MlaKvA), kvA, rkv + dr, dModel, rkv + dr}};
    if (queriesWithKvA)
      ofX.push_back({x, dModel, queryRole, queries, H * qkDim, dModel, H * qkDim});
    if (gateWithKvA)
      ofX.push_back({x, dModel, roleOf(d, MlaGate), gate, H * dv, dModel, H * dv});
    HYBRID_RETURN_IF_ERROR(gemmGroup(r, ofX, T));
  }
  const kc::MlaLatentRowsParams rows =
      mlaLatentRowsParams(*p, T, kvA, fp32Weights.at(roleOf(d, MlaKvANorm)), frequencies,
                          rowPositions, latent, rope);
  if (!gathered)
    LAUNCH_RETURN_IF_ERROR(kc::launchMlaLatentRows(rows, r.stream), "MLA cache rows");
  kc::LatentWriteParams write;
  write.where = stepTokens(written);
  write.latentDim = static_cast<int32_t>(rkv);
  write.ropeDim = static_cast<int32_t>(dr);
  write.latent = latent;
  write.rope = rope;
  write.type = kv.latentType;
  write.pages = kv.latentPages;
  LAUNCH_RETURN_IF_ERROR(kc::launchWriteLatentRows(write, r.stream), "latent cache write");

  for (int64_t first = 0; first < T; first += chunk) {
    const int64_t n = std::min(chunk, T - first);
    const int32_t rowsNow = static_cast<int32_t>(n);
    if (!queriesWithKvA)
      HYBRID_RETURN_IF_ERROR(gemm(r, queryInput + first * qIn, qIn, queryRole, queries,
                                  H * qkDim, n, qIn, H * qkDim));
    if (frequencies) {
      kc::RopeParams ropeQ;
      ropeQ.rows = rowsNow;
      ropeQ.heads = static_cast<int32_t>(H);
      ropeQ.rowStride = H * qkDim;
      ropeQ.headStride = qkDim;
      ropeQ.offset = dn;
      ropeQ.dims = static_cast<int32_t>(dr);
      ropeQ.pairing = pairingOf(p->rope());
      ropeQ.inverseFrequencies = frequencies;
      ropeQ.positions = rowPositions + first;
      ropeQ.x = queries;
      LAUNCH_RETURN_IF_ERROR(kc::launchRope(ropeQ, r.stream), "MLA query RoPE");
    }
    LAUNCH_RETURN_IF_ERROR(kc::launchMlaAbsorbQueries(heads, rowsNow, static_cast<int32_t>(dr),
                                                      queries, absorbed, r.stream),
                           "MLA query absorption");
    if (tensorCore) {
      kc::SparseMlaDecodeParams s;
      s.rows = rowsNow;
      s.heads = static_cast<int32_t>(H);
      s.latentDim = static_cast<int32_t>(rkv);
      s.ropeDim = static_cast<int32_t>(dr);
      s.softmaxScale = p->softmax_scale();
      s.q = absorbed;
      s.topK = static_cast<int32_t>(positions); // causal: the grid sized for a full sequence
      if (sparse)
        s.indices = indices + first * topK;
      else // causal: every position up to the row's
        s.positions = rowPositions + first;
      s.sequences = rowSequences + first;
      s.latentPages = kv.latentPages;
      s.pageTokens = static_cast<int32_t>(pageTokens);
      s.blockTables = blockTables;
      s.maxPages = maxPages;
      s.out = latentOut;
      s.workspace = r.attentionWorkspace;
      if (kc::sparseMlaWorkspaceBytes(rowsNow, s.heads, s.latentDim, s.topK) >
          r.sizes.attentionWorkspaceBytes)
        return Status::error("sparse MLA workspace larger than planned at load");
      if (batchInvariant)
        s.rowInvariantSplits = true;
      else
        applyTuning(s);
      LAUNCH_RETURN_IF_ERROR(kc::launchSparseMlaDecode(s, r.stream), "sparse MLA");
    } else {
      kc::LatentAttentionParams a;
      a.rows = rowsNow;
      a.heads = static_cast<int32_t>(H);
      a.latentDim = static_cast<int32_t>(rkv);
      a.ropeDim = static_cast<int32_t>(dr);
      a.softmaxScale = p->softmax_scale();
      a.q = absorbed;
      a.indices = sparse ? indices + first * topK : nullptr;
      a.topK = static_cast<int32_t>(topK);
      a.positions = rowPositions + first;
      a.sequences = rowSequences + first;
      a.latentPages = kv.latentPages;
      a.cacheType = kv.latentType;
      a.pageTokens = static_cast<int32_t>(pageTokens);
      a.blockTables = blockTables;
      a.maxPages = maxPages;
      a.out = latentOut;
      LAUNCH_RETURN_IF_ERROR(kc::launchLatentAttention(a, r.stream), "MLA latent attention");
    }
    LAUNCH_RETURN_IF_ERROR(
        kc::launchMlaExpandOutputs(heads, rowsNow, latentOut, headOut, r.stream, batchInvariant),
        "MLA output expansion");
    if (roleOf(d, MlaGate) >= 0) { // output gate: heads * sigmoid(g_proj x)
      if (!gateWithKvA)
        HYBRID_RETURN_IF_ERROR(gemm(r, x + first * dModel, dModel, roleOf(d, MlaGate), gate,
                                    H * dv, n, dModel, H * dv));
      LAUNCH_RETURN_IF_ERROR(kc::launchSigmoidGate(headOut, gate, n * H * dv, r.stream),
                             "MLA output gate");
    }
    HYBRID_RETURN_IF_ERROR(gemm(r, headOut, H * dv, roleOf(d, MlaOProj), out + first * dModel,
                                dModel, n, H * dv, dModel));
  }
  return Status::ok();
}

} // namespace hybrid::cudadev
