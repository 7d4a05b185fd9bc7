// The `cpu` device: executes a program's dispatches with the reference kernels (kernels/ref).
// Internal to the runtime; Model.cpp owns the state it works on.
#pragma once

#include "hybrid/kernels/ref/TiledLayout.h"
#include "hybrid/runtime/Memory.h"
#include "hybrid/runtime/Status.h"
#include "runtime/schema/plan_generated.h"

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace hybrid::cpu {

// How a weight is laid out: its logical [rows, cols] and, for a tiled weight, the tiling the
// GEMM reads directly (the runtime never converts layouts).
struct WeightLayout {
  int64_t rows = 0;
  int64_t cols = 0;
  std::optional<kernels::ref::TiledLayout> tiled;
};

// Everything a step may touch: the program's arena, the fp32 weights, the sequence's caches.
// What the KDA layers of one step consumed, per token, so that the recurrent state can be rebuilt
// for a prefix of the step's tokens without re-running the model (speculative decoding's
// rollback: restore the state from before the step, then replay the accepted tokens).
struct KdaReplayLog {
  struct Layer {
    int32_t stateSlot = 0; // KdaParams.state_slot
    int64_t heads = 0, headDim = 0, convKernel = 0;
    std::vector<float> preConv; // [3][T, P]: the q, k, v projections before the conv
    std::vector<float> q, k, v, g, beta; // the recurrence's inputs [T, P] ([T, H] for beta)
  };
  std::vector<Layer> layers;
  int64_t rows = 0;
};

// Rebuilds every logged layer's state and conv state of `slot` for the first `tokens` rows of the
// logged step, from the state the slot holds now (the state before that step).
Status replayKda(RecurrentStatePool &states, int32_t slot, const KdaReplayLog &log, int64_t tokens);

struct StepContext {
  const plan::fb::Program *program = nullptr;
  Arena *arena = nullptr;
  const std::vector<std::vector<float>> *weights = nullptr; // fp32, per plan weight index
  const std::vector<WeightLayout> *weightLayouts = nullptr; // per plan weight index
  PagedKvCache *kvCache = nullptr;
  const plan::fb::CacheSpec *cacheSpec = nullptr; // precision of each KV layer
  RecurrentStatePool *states = nullptr;
  // Rows of the current step being written per KV slot: the indexer stages its keys, the MLA
  // its latents, and the MLA appends the full rows to the cache after attending.
  std::vector<std::vector<float>> *kvStaging = nullptr;
  int32_t kvSequence = 0;
  int32_t stateSlot = 0;
  int64_t rows = 0;         // tokens in this step
  int64_t firstPosition = 0; // position of the step's first token in the sequence
  bool decode = false;
  KdaReplayLog *kdaLog = nullptr; // when set, KDA layers record their per-token inputs
};

// Runs one dispatch; errors name the kernel and the offending value or weight.
Status runDispatch(const StepContext &context, const plan::fb::Dispatch &dispatch);

// A float view of value `index` for the step's rows (F32 values only).
StatusOr<std::span<float>> floatValue(const StepContext &context, int32_t index);

} // namespace hybrid::cpu
