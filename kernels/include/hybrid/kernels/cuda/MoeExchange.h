// The device side of the routed experts' all-to-all when the experts are spread over the context
// ranks (cp=N,ep=N; docs/parallelism.md): parallel::moeExpertParallel's packing and combine on
// the GPU, so a rank's rows go to the ranks holding their experts without a host round trip of
// the rows. Rank d of `ranks` holds experts [d E / ranks, (d + 1) E / ranks). Each rank lists the
// (token, choice) pairs it sends to each rank in (t, k) order, packs them as [expert id | x row]
// into slots of a padded exchange buffer, and after the experts ran where the rows went, adds
// each token's returned rows, weighted, in ascending expert order (stable in the choice order),
// as ref::moeExperts does. CUDA-free header. Launches return 0 or a cudaError_t
// (cudaErrorInvalidValue for a bad shape or a missing pointer).
#pragma once

#include <cstdint>

namespace hybrid::kernels::cuda {

inline constexpr int kMoeExchangeMaxRanks = 32;

// The destination lists: pair i = t * topK + k goes to rank ids[i] / (experts / ranks) as the
// slots[i]-th entry of its list; pairs[d * tokens * topK + j] is the pair in slot j of rank d's
// list; counts[d] the length of that list (fp32: what the communicator gathers). An id outside
// [0, experts) is no choice (slots -1), as the MoE forms skip it. One block: the lists are short
// next to the rows they move.
struct MoeRouteToRanksParams {
  int32_t tokens = 0;
  int32_t topK = 0;
  int32_t experts = 0;          // a multiple of ranks
  int32_t ranks = 0;            // <= kMoeExchangeMaxRanks
  const int32_t *ids = nullptr; // [tokens, topK]
  int32_t *slots = nullptr;     // [tokens, topK]
  int32_t *pairs = nullptr;     // [ranks, tokens * topK]
  float *counts = nullptr;      // [ranks]
};
int launchMoeRouteToRanks(const MoeRouteToRanksParams &params, void *stream);

// Slots [firstSlot, firstSlot + chunkSlots) of every rank's list into sent [ranks, chunkSlots,
// hidden + 1]: each row [expert id | the pair's token's x row], a slot past the list's count
// [-1 | zeros] (padding, which the receiving rank's experts skip).
struct MoePackRowsParams {
  int32_t tokens = 0; // this rank's rows (the lists' pairs index them)
  int32_t topK = 0;
  int32_t hidden = 0;
  int32_t ranks = 0;
  int32_t firstSlot = 0, chunkSlots = 0;
  const float *x = nullptr;       // [tokens, hidden]
  const int32_t *ids = nullptr;   // [tokens, topK]
  const int32_t *pairs = nullptr; // MoeRouteToRanksParams::pairs
  const float *counts = nullptr;  // MoeRouteToRanksParams::counts
  float *sent = nullptr;
};
int launchMoePackRows(const MoePackRowsParams &params, void *stream);

// Received rows [rows, hidden + 1] into what the MoE forms take as `rows` tokens of one choice
// each: x [rows, hidden], ids [rows] and weights [rows] of 1 (so a form's output row is its
// expert's output exactly: 0 + 1 * y).
struct MoeUnpackRowsParams {
  int32_t rows = 0;
  int32_t hidden = 0;
  const float *received = nullptr;
  float *x = nullptr;
  int32_t *ids = nullptr;
  float *weights = nullptr;
};
int launchMoeUnpackRows(const MoeUnpackRowsParams &params, void *stream);

// out[t] = the sum over t's choices in ascending expert id (stable), from zero, of weights[t, k]
// * the returned row of pair t * topK + k: rank d's slot j lies in the chunk c holding slots
// [chunkBegin[c], chunkBegin[c] + chunkSlots[c]), at row d * chunkSlots[c] + j - chunkBegin[c]
// of returned[c] ([ranks, chunkSlots[c], hidden]). Pairs without a slot add nothing.
inline constexpr int kMoeExchangeMaxChunks = 2;
struct MoeCombineReturnedParams {
  int32_t tokens = 0;
  int32_t topK = 0;
  int32_t hidden = 0;
  int32_t expertsPerRank = 0;
  const int32_t *ids = nullptr;   // [tokens, topK]
  const float *weights = nullptr; // [tokens, topK]
  const int32_t *slots = nullptr; // MoeRouteToRanksParams::slots
  int32_t chunks = 1;             // <= kMoeExchangeMaxChunks
  const float *returned[kMoeExchangeMaxChunks] = {};
  int32_t chunkBegin[kMoeExchangeMaxChunks] = {};
  int32_t chunkSlots[kMoeExchangeMaxChunks] = {};
  float *out = nullptr; // [tokens, hidden]
};
int launchMoeCombineReturned(const MoeCombineReturnedParams &params, void *stream);

} // namespace hybrid::kernels::cuda
