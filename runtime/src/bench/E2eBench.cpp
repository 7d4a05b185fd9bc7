#include "hybrid/runtime/E2eBench.h"

#include "hybrid/runtime/Plan.h"          // findProgram
#include "hybrid/runtime/Sampling.h"      // TokenChoice
#include "hybrid/runtime/WeightArchive.h" // dtypeByteSize

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>

namespace hybrid::bench {
namespace fb = plan::fb;

namespace {

// Bytes of weight `index` and of its block scales, if any.
double weightBytes(const fb::Plan &plan, int32_t index) {
  if (!plan.weights() || index < 0 || index >= int32_t(plan.weights()->size()))
    return 0;
  const fb::Weight *w = plan.weights()->Get(uint32_t(index));
  double bytes = double(w->size());
  if (w->scale() >= 0 && w->scale() < int32_t(plan.weights()->size()))
    bytes += double(plan.weights()->Get(uint32_t(w->scale()))->size());
  return bytes;
}

// One cached token of a latent-cache layer: FP8 tiles (E4M3 latent, an fp32 scale per tile, the
// rope part in bf16: FlashMLA's V32 row) or the layer's dtype throughout.
double latentTokenBytes(const fb::KvCacheLayer &kv) {
  if (kv.quant() == fb::KvQuant::Fp8Tiles) {
    const int64_t tile = std::max(1, kv.quant_tile());
    return double(kv.latent_dim()) + 4.0 * double((kv.latent_dim() + tile - 1) / tile) +
           2.0 * kv.rope_dim();
  }
  return double(dtypeByteSize(kv.dtype())) * double(kv.latent_dim() + kv.rope_dim());
}

double secondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

} // namespace

DecodeStepBytes decodeStepBytes(const fb::Plan &plan, int64_t batch, int64_t context) {
  DecodeStepBytes bytes;
  const fb::Program *decode = findProgram(plan, "decode");
  std::map<int32_t, int32_t> topKOfSlot;  // DSA layers: positions the sparse attention reads
  std::map<int32_t, fb::ActivationQuant> keyQuantOfSlot; // DSA layers: the index keys' format
  std::set<int32_t> counted;
  if (decode && decode->steps())
    for (const fb::Step *step : *decode->steps()) {
      const fb::Dispatch *d = step ? step->op_as_Dispatch() : nullptr;
      if (!d)
        continue;
      if (const fb::DsaIndexerParams *p = d->params_as_DsaIndexerParams()) {
        if (d->kernel() == fb::KernelId::DsaIndexer)
          topKOfSlot[p->kv_slot()] = p->top_k();
        if (d->kernel() == fb::KernelId::IndexerKey)
          keyQuantOfSlot[p->kv_slot()] = p->quantize();
      }
      if (!d->weights())
        continue;
      if (d->kernel() == fb::KernelId::MoeExperts && d->params_as_MoeParams()) {
        const fb::MoeParams *moe = d->params_as_MoeParams();
        const double experts = std::max(1, moe->num_experts());
        const double k = std::min<double>(experts, std::max(1, moe->top_k()));
        double all = 0;
        for (int32_t index : *d->weights())
          all += weightBytes(plan, index);
        const double distinct = experts * (1.0 - std::pow(1.0 - k / experts, double(batch)));
        bytes.experts += all / experts * distinct;
        continue;
      }
      for (int32_t index : *d->weights()) {
        if (index < 0 || !counted.insert(index).second)
          continue;
        if (d->kernel() == fb::KernelId::Embed && plan.weights() &&
            index < int32_t(plan.weights()->size())) {
          const fb::Weight *table = plan.weights()->Get(uint32_t(index));
          const double rows = table->shape() && table->shape()->size() > 0
                                  ? double(std::max<int64_t>(1, table->shape()->Get(0)))
                                  : 1.0;
          bytes.weights += weightBytes(plan, index) / rows * double(batch); // the batch's rows
        } else {
          bytes.weights += weightBytes(plan, index);
        }
      }
    }
  if (plan.cache() && plan.cache()->kv())
    for (uint32_t slot = 0; slot < plan.cache()->kv()->size(); ++slot) {
      const fb::KvCacheLayer *kv = plan.cache()->kv()->Get(slot);
      int64_t rows = context;
      double indexBytes = 0;
      if (auto found = topKOfSlot.find(int32_t(slot)); found != topKOfSlot.end()) {
        rows = std::min<int64_t>(context, found->second);
        const double dim = kv->index_key_dim();
        const fb::ActivationQuant keys = keyQuantOfSlot[int32_t(slot)];
        indexBytes = double(context) * (keys == fb::ActivationQuant::Mxfp8       ? dim + dim / 32
                                        : keys == fb::ActivationQuant::Fp8PerRow ? dim + 4
                                                                                 : 4 * dim);
      }
      bytes.kvCache += double(batch) * (double(rows) * latentTokenBytes(*kv) + indexBytes);
    }
  if (plan.cache() && plan.cache()->recurrent())
    for (const fb::RecurrentStateLayer *state : *plan.cache()->recurrent()) {
      const double elements =
          double(state->num_heads()) * state->head_k_dim() * state->head_v_dim() +
          double(state->conv_channels()) * std::max(0, state->conv_kernel() - 1);
      bytes.recurrentState += 2.0 * 4.0 * elements * double(batch); // fp32, read and written
    }
  return bytes;
}

StatusOr<std::vector<E2eRow>> runE2e(Model &model, const E2eOptions &options,
                                     const std::function<void(const std::string &)> &progress) {
  auto say = [&](const std::string &line) {
    if (progress)
      progress(line);
  };
  if (options.decodeSteps <= 0)
    return Status::error("e2e: decode steps must be positive");
  std::mt19937_64 rng(options.seed);
  const int64_t vocab = model.vocabSize();
  const int64_t perCall = std::max<int64_t>(1, model.maxDecodeBatch());
  std::vector<E2eRow> rows;
  std::map<int64_t, double> sharedTtftMs; // shared prompt: the TTFT of each context's prompt
  for (int64_t batch : options.batches)
    for (int64_t context : options.contexts) {
      if (batch <= 0 || context <= 0)
        return Status::error("e2e: batch and context must be positive (batch " +
                             std::to_string(batch) + ", context " + std::to_string(context) + ")");
      E2eRow row;
      row.batch = batch;
      row.context = context;
      std::vector<std::unique_ptr<Sequence>> sequences;
      for (int64_t i = 0; i < batch; ++i) {
        auto sequence = model.newSequence();
        if (!sequence.isOk())
          return Status::error("e2e: batch " + std::to_string(batch) + ": " +
                               sequence.status().message());
        sequences.push_back(std::move(*sequence));
      }
      std::uniform_int_distribution<int64_t> token(0, vocab - 1);
      std::vector<int64_t> prompt(static_cast<size_t>(context));
      say("batch " + std::to_string(batch) + " context " + std::to_string(context) +
          ": prefill");
      // As a server: only the last row's logits come back (they choose the first token).
      auto prefill = [&](Sequence &sequence, std::span<const int64_t> tokens) -> Status {
        auto logits = sequence.prefill(tokens, nullptr, PrefillLogits::LastRow);
        if (!logits.isOk())
          return Status::error("e2e: prefill of " + std::to_string(tokens.size()) +
                               " tokens: " + logits.status().message());
        return Status::ok();
      };
      if (options.sharedPrompt) {
        // The same prompt for every row of this context, so a later row finds it kept.
        std::mt19937_64 promptRng(options.seed + static_cast<uint64_t>(context));
        for (int64_t &id : prompt)
          id = token(promptRng);
        // Whole blocks of all but the last token: what a later sequence can restore.
        const auto kept = static_cast<size_t>(sequences.front()->prefixBoundary(context - 1));
        if (kept == 0 && batch > 1)
          return Status::error("e2e: a shared prompt needs prefix caching and a context of at "
                               "least one prefix block (context " + std::to_string(context) + ")");
        const std::span<const int64_t> whole(prompt);
        int64_t restoring = 0; // the sequences before it prefilled the whole prompt
        if (auto measured = sharedTtftMs.find(context); measured != sharedTtftMs.end()) {
          row.ttftMs = measured->second; // an earlier row's prefill of this very prompt
          row.ttftReused = true;
        } else {
          Sequence &first = *sequences.front();
          auto start = std::chrono::steady_clock::now();
          if (kept > 0)
            HYBRID_RETURN_IF_ERROR(prefill(first, whole.first(kept)));
          double seconds = secondsSince(start);
          if (kept > 0)
            HYBRID_RETURN_IF_ERROR(first.keepPrefix(whole.first(kept))); // untimed: no prefill
          start = std::chrono::steady_clock::now();
          HYBRID_RETURN_IF_ERROR(prefill(first, whole.subspan(kept)));
          row.ttftMs = (seconds + secondsSince(start)) * 1e3;
          if (kept > 0)
            sharedTtftMs[context] = row.ttftMs;
          restoring = 1;
        }
        row.prefillTokensPerSecond = double(context) / (row.ttftMs * 1e-3);
        for (int64_t i = restoring; i < batch; ++i) {
          Sequence &sequence = *sequences[size_t(i)];
          HYBRID_ASSIGN_OR_RETURN(const int64_t restored, sequence.restorePrefix(whole));
          if (restored != int64_t(kept))
            return Status::error("e2e: the shared prompt's prefix was not restored (" +
                                 std::to_string(restored) + " of " + std::to_string(kept) +
                                 " tokens)");
          HYBRID_RETURN_IF_ERROR(prefill(sequence, whole.subspan(kept)));
        }
      } else {
        const auto prefillStart = std::chrono::steady_clock::now();
        for (int64_t i = 0; i < batch; ++i) {
          for (int64_t &id : prompt)
            id = token(rng);
          const auto start = std::chrono::steady_clock::now();
          HYBRID_RETURN_IF_ERROR(prefill(*sequences[size_t(i)], prompt));
          if (i == 0)
            row.ttftMs = secondsSince(start) * 1e3;
        }
        row.prefillTokensPerSecond = double(batch * context) / secondsSince(prefillStart);
      }

      // One step: every sequence one token, in calls of the decode program's batch, each row's
      // next token chosen (greedily) where the device holds the logits, as a server's step does.
      std::vector<Sequence *> pointers;
      for (auto &sequence : sequences)
        pointers.push_back(sequence.get());
      std::vector<int64_t> tokens(static_cast<size_t>(batch));
      const std::vector<TokenChoice> greedy(static_cast<size_t>(std::min(perCall, batch)));
      auto step = [&]() -> Status {
        for (int64_t &id : tokens)
          id = token(rng);
        for (int64_t first = 0; first < batch; first += perCall) {
          const int64_t count = std::min(perCall, batch - first);
          auto chosen = model.decodeBatchChoose(
              std::span<Sequence *const>(pointers.data() + first, size_t(count)),
              std::span<const int64_t>(tokens.data() + first, size_t(count)),
              std::span<const TokenChoice>(greedy.data(), size_t(count)));
          if (!chosen.isOk())
            return Status::error("e2e: decode at context " + std::to_string(context) + ": " +
                                 chosen.status().message());
        }
        return Status::ok();
      };
      say("batch " + std::to_string(batch) + " context " + std::to_string(context) + ": decode");
      // Chained: each call's rows decode all their steps in one Model::decodeSteps, greedy, the
      // first step fed random ids and the others the ids chosen before.
      auto chain = [&](int32_t steps) -> Status {
        for (int64_t &id : tokens)
          id = token(rng);
        const std::vector<TokenChoice> choices(
            static_cast<size_t>(std::min(perCall, batch) * steps));
        for (int64_t first = 0; first < batch; first += perCall) {
          const int64_t count = std::min(perCall, batch - first);
          auto chosen = model.decodeSteps(
              std::span<Sequence *const>(pointers.data() + first, size_t(count)),
              std::span<const int64_t>(tokens.data() + first, size_t(count)),
              std::span<const TokenChoice>(choices.data(), size_t(count * steps)), steps);
          if (!chosen.isOk())
            return Status::error("e2e: chained decode at context " + std::to_string(context) +
                                 ": " + chosen.status().message());
        }
        return Status::ok();
      };
      // Warm-up: two plain steps, or a chain of two (chained steps replay their own decode
      // graph: captured here, not in the timed chain).
      if (options.chainedDecode) {
        if (Status s = chain(2); !s)
          return s;
      } else {
        for (int warm = 0; warm < 2; ++warm)
          if (Status s = step(); !s)
            return s;
      }
      if (options.aroundProfiledStep) { // untimed: the profiler slows it
        options.aroundProfiledStep(true, batch, context);
        Status s = step();
        options.aroundProfiledStep(false, batch, context);
        if (!s)
          return s;
      }
      const auto decodeStart = std::chrono::steady_clock::now();
      if (options.chainedDecode) {
        if (Status s = chain(options.decodeSteps); !s)
          return s;
      } else {
        for (int32_t i = 0; i < options.decodeSteps; ++i)
          if (Status s = step(); !s)
            return s;
      }
      row.tpotUs = secondsSince(decodeStart) / options.decodeSteps * 1e6;
      row.decodeTokensPerSecond = double(batch) / (row.tpotUs * 1e-6);
      row.bytes = decodeStepBytes(model.plan(), batch, context + 2 + options.decodeSteps / 2);
      row.floorUs = row.bytes.total() / (options.bandwidthTbPerSecond * 1e12) * 1e6;
      rows.push_back(row);
    }
  return rows;
}

} // namespace hybrid::bench
