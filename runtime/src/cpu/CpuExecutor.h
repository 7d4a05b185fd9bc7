// The `cpu` device: executes a program's dispatches with the reference kernels (kernels/ref).
// Internal to the runtime; Model.cpp owns the state it works on.
#pragma once

#include "hybrid/kernels/ref/Mla.h" // RopeLayout
#include "hybrid/kernels/ref/Quant.h"
#include "hybrid/kernels/ref/TiledLayout.h"
#include "hybrid/runtime/Communicator.h"
#include "hybrid/runtime/Memory.h"
#include "hybrid/runtime/Status.h"
#include "runtime/schema/plan_generated.h"

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace hybrid::cpu {

// How a weight is laid out: its logical [rows, cols] and, for a tiled weight, the tiling the
// GEMM reads directly (the runtime never converts layouts). An FP8 weight (held dequantized)
// also says how the GEMM quantizes the activations it multiplies (MODEL_SPEC 8.1).
struct WeightLayout {
  int64_t rows = 0;
  int64_t cols = 0;
  std::optional<kernels::ref::TiledLayout> tiled;
  std::optional<kernels::ref::Fp8ScaleRule> fp8Activations;
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

// One row of a batched decode step (Model::decodeBatch): the sequence the row's token belongs to.
struct BatchRow {
  int32_t kvSequence = 0;
  int32_t stateSlot = 0;
  int64_t position = 0; // of the row's token in its sequence
};

// What running per-sequence kernels row by row needs: a one-row arena (the program's offsets, one
// row each) and every row's staged KV rows (per row, per KV slot), kept across the step's
// dispatches as a single sequence's staging is.
struct BatchScratch {
  Arena rowArena;
  std::vector<std::vector<std::vector<float>>> staging;
};

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
  // A batched decode step (Model::decodeBatch): row r belongs to batch[r]'s sequence, and the
  // per-sequence kernels run row by row in *batchScratch. Empty: every row is this sequence's.
  std::span<const BatchRow> batch;
  BatchScratch *batchScratch = nullptr;
  // A sharded plan's collectives (AllReduceSum) run over this rank's communicator.
  comm::Communicator *communicator = nullptr;
};

// Whether a kernel reads or writes a sequence's KV cache or recurrent state, or depends on the
// token's position (KDA, MLA, the DSA indexer's parts): in a batched step it runs row by row.
bool perSequenceKernel(plan::fb::KernelId kernel);

// Runs one dispatch; errors name the kernel and the offending value or weight.
Status runDispatch(const StepContext &context, const plan::fb::Dispatch &dispatch);

// runDispatch for any step: in a batched one (context.batch), row-wise kernels once over all
// rows (the same arithmetic per row as a one-row step) and per-sequence kernels once per row on
// a copy of the row in batchScratch->rowArena (which must hold the program's arena), with the
// row's sequence, state slot, position and staging (batchScratch->staging: one entry per row,
// each with one vector per KV slot, cleared at the step's start).
Status runStepDispatch(const StepContext &context, const plan::fb::Dispatch &dispatch);

// A plan's RoPE: which values pair up (None: no rotation), and the inverse frequencies of a
// rotaryDim-long slice (zeros without rotation). The cuda device uses the same frequencies.
kernels::ref::RopeLayout ropeLayout(const plan::fb::Rope *rope);
std::vector<float> ropeFrequencies(const plan::fb::Rope *rope, int64_t rotaryDim);

// A float view of value `index` for the step's rows (F32 values only).
StatusOr<std::span<float>> floatValue(const StepContext &context, int32_t index);

} // namespace hybrid::cpu
