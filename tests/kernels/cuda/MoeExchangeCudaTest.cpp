// The experts' all-to-all kernels (MoeExchange.h) on one GPU, the exchange between ranks
// simulated by device copies: every rank's rows listed per destination (in (t, k) order, as
// parallel::moeExpertParallel lists them), packed into two chunks of padded slots, run through
// the receiving rank's experts only (the others absent) as one choice of weight 1 each, sent
// back and combined; each rank's output against the MoE form run on its own rows with every
// expert held. Ranks of 0 rows and a choice of -1 included. Labelled `gpu`; skipped without a
// GPU.
#include "CudaTestSupport.h"
#include "MoeCudaTestSupport.h"
#include "hybrid/kernels/cuda/Moe.h"
#include "hybrid/kernels/cuda/MoeExchange.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

namespace hybrid::kernels {
namespace {

// One rank's device side of the exchange.
struct Rank {
  int tokens = 0;
  std::vector<float> x, weights;
  std::vector<int32_t> ids;
  std::unique_ptr<DeviceBuffer<float>> dX, dWeights, dCounts;
  std::unique_ptr<DeviceBuffer<int32_t>> dIds, dSlots, dPairs;
  std::unique_ptr<DeviceBuffer<float>> sent[2], received[2], chunkX[2], chunkWeights[2], results[2],
      returned[2];
  std::unique_ptr<DeviceBuffer<int32_t>> chunkIds[2];
};

TEST(MoeExchangeCuda, SimulatedRanksMatchTheirOwnRowsWithEveryExpert) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(31);
  const int hidden = 256, inner = 64, experts = 12, topK = 4;
  for (bool grouped : {false, true})
    for (const std::vector<int> &rows : {std::vector<int>{5, 0, 7}, std::vector<int>{40, 33}}) {
      const int world = int(rows.size()), perRank = experts / world;
      SCOPED_TRACE(std::string(grouped ? "tensor-core form" : "per-token form") + ", " +
                   std::to_string(world) + " ranks");
      // bf16 experts, every rank's pointers to all of them; a rank's own view holds only its
      // share (the others null, as an expert-parallel plan's dispatch has them).
      std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> matrices;
      std::vector<uint64_t> pointers[3];
      for (int e = 0; e < experts; ++e)
        for (int m = 0; m < 3; ++m) {
          const size_t size = size_t(hidden) * inner;
          matrices.push_back(std::make_unique<DeviceBuffer<uint16_t>>(
              bf16Bits(roundedToBf16(random(size, rng, 0.05f)))));
          pointers[m].push_back(reinterpret_cast<uint64_t>(matrices.back()->data));
        }
      auto held = [&](int rank) { // gate, up, down arrays with only `rank`'s experts (-1: all)
        std::vector<std::unique_ptr<DeviceBuffer<uint64_t>>> arrays;
        for (int m = 0; m < 3; ++m) {
          std::vector<uint64_t> view = pointers[m];
          for (int e = 0; e < experts; ++e)
            if (rank >= 0 && e / perRank != rank)
              view[size_t(e)] = 0;
          arrays.push_back(std::make_unique<DeviceBuffer<uint64_t>>(view));
        }
        return arrays;
      };
      auto runForm = [&](const std::vector<std::unique_ptr<DeviceBuffer<uint64_t>>> &arrays,
                         int tokens, int choices, const float *x, const int32_t *ids,
                         const float *weights, float *out) {
        DeviceBuffer<uint8_t> workspace{std::vector<uint8_t>(
            grouped ? cuda::moeGroupedWorkspaceBytes(tokens, choices, hidden, inner, experts)
                    : cuda::moeExpertsWorkspaceBytes(tokens, choices, hidden, inner))};
        cuda::MoeExpertsParams p =
            expertsParams(tokens, hidden, inner, experts, choices, x, ids, weights,
                          arrays[0]->data, arrays[1]->data, arrays[2]->data, workspace.data);
        p.out = out;
        EXPECT_EQ(grouped ? cuda::launchMoeExpertsGrouped(p, true, nullptr)
                          : cuda::launchMoeExpertsPerToken(p, nullptr),
                  0);
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      };

      std::vector<Rank> ranks(static_cast<size_t>(world));
      for (int r = 0; r < world; ++r) {
        Rank &rank = ranks[size_t(r)];
        rank.tokens = rows[size_t(r)];
        rank.x = random(size_t(rank.tokens) * hidden, rng, 1.0f);
        RandomRouting routing = randomRouting(rank.tokens, experts, topK, 0.1f, 0.2f, rng);
        if (r == 0 && rank.tokens > 1)
          routing.ids[size_t(topK) + 2] = -1; // token 1's third: no choice
        rank.ids = std::move(routing.ids);
        rank.weights = std::move(routing.weights);
        const size_t pairs = std::max<size_t>(1, rank.ids.size());
        rank.dX = std::make_unique<DeviceBuffer<float>>(rank.tokens ? rank.x
                                                                    : std::vector<float>(1, 0.0f));
        rank.dWeights = std::make_unique<DeviceBuffer<float>>(
            rank.tokens ? rank.weights : std::vector<float>(1, 0.0f));
        rank.dIds = std::make_unique<DeviceBuffer<int32_t>>(
            rank.tokens ? rank.ids : std::vector<int32_t>(1, 0));
        rank.dSlots = std::make_unique<DeviceBuffer<int32_t>>(std::vector<int32_t>(pairs, -7));
        rank.dPairs =
            std::make_unique<DeviceBuffer<int32_t>>(std::vector<int32_t>(world * pairs, -7));
        rank.dCounts = std::make_unique<DeviceBuffer<float>>(std::vector<float>(size_t(world)));
        cuda::MoeRouteToRanksParams route;
        route.tokens = rank.tokens;
        route.topK = topK;
        route.experts = experts;
        route.ranks = world;
        route.ids = rank.dIds->data;
        route.slots = rank.dSlots->data;
        route.pairs = rank.dPairs->data;
        route.counts = rank.dCounts->data;
        ASSERT_EQ(cuda::launchMoeRouteToRanks(route, nullptr), 0);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        // The lists as moeExpertParallel makes them: pairs in (t, k) order per destination.
        std::vector<std::vector<int32_t>> lists(static_cast<size_t>(world));
        for (size_t i = 0; i < rank.ids.size(); ++i)
          if (rank.ids[i] >= 0)
            lists[size_t(rank.ids[i] / perRank)].push_back(int32_t(i));
        const std::vector<float> counts = rank.dCounts->download();
        const std::vector<int32_t> slots = rank.dSlots->download(),
                                   listed = rank.dPairs->download();
        for (int d = 0; d < world; ++d) {
          ASSERT_EQ(counts[size_t(d)], float(lists[size_t(d)].size())) << "rank " << r;
          for (size_t j = 0; j < lists[size_t(d)].size(); ++j) {
            EXPECT_EQ(listed[size_t(d) * rank.ids.size() + j], lists[size_t(d)][j]);
            EXPECT_EQ(slots[size_t(lists[size_t(d)][j])], int32_t(j));
          }
        }
      }
      // The padded slots and their two chunks, as every rank computes them from the counts.
      int64_t slots = 0;
      for (const Rank &rank : ranks)
        for (float count : rank.dCounts->download())
          slots = std::max(slots, int64_t(count));
      ASSERT_GT(slots, 1);
      const int chunkSlots[2] = {int((slots + 1) / 2), int(slots / 2)};
      const int chunkBegin[2] = {0, chunkSlots[0]};
      auto zeros = [](size_t n) {
        return std::make_unique<DeviceBuffer<float>>(std::vector<float>(n));
      };
      for (int c = 0; c < 2; ++c) {
        const size_t n = size_t(world) * chunkSlots[c];
        for (Rank &rank : ranks) {
          rank.sent[c] = zeros(n * (hidden + 1));
          rank.received[c] = zeros(n * (hidden + 1));
          rank.chunkX[c] = zeros(n * hidden);
          rank.chunkWeights[c] = zeros(n);
          rank.results[c] = zeros(n * hidden);
          rank.returned[c] = zeros(n * hidden);
          rank.chunkIds[c] = std::make_unique<DeviceBuffer<int32_t>>(std::vector<int32_t>(n));
          cuda::MoePackRowsParams pack;
          pack.tokens = rank.tokens;
          pack.topK = topK;
          pack.hidden = hidden;
          pack.ranks = world;
          pack.firstSlot = chunkBegin[c];
          pack.chunkSlots = chunkSlots[c];
          pack.x = rank.dX->data;
          pack.ids = rank.dIds->data;
          pack.pairs = rank.dPairs->data;
          pack.counts = rank.dCounts->data;
          pack.sent = rank.sent[c]->data;
          ASSERT_EQ(cuda::launchMoePackRows(pack, nullptr), 0);
        }
        // The all-to-all: rank r's block s of what it receives is rank s's block r.
        const size_t block = size_t(chunkSlots[c]) * (hidden + 1);
        for (int r = 0; r < world; ++r)
          for (int s = 0; s < world; ++s)
            ASSERT_EQ(cudaMemcpy(ranks[size_t(r)].received[c]->data + s * block,
                                 ranks[size_t(s)].sent[c]->data + r * block, block * sizeof(float),
                                 cudaMemcpyDeviceToDevice),
                      cudaSuccess);
        for (int r = 0; r < world; ++r) {
          Rank &rank = ranks[size_t(r)];
          cuda::MoeUnpackRowsParams unpack;
          unpack.rows = int32_t(n);
          unpack.hidden = hidden;
          unpack.received = rank.received[c]->data;
          unpack.x = rank.chunkX[c]->data;
          unpack.ids = rank.chunkIds[c]->data;
          unpack.weights = rank.chunkWeights[c]->data;
          ASSERT_EQ(cuda::launchMoeUnpackRows(unpack, nullptr), 0);
          runForm(held(r), int(n), 1, rank.chunkX[c]->data, rank.chunkIds[c]->data,
                  rank.chunkWeights[c]->data, rank.results[c]->data);
        }
        const size_t back = size_t(chunkSlots[c]) * hidden;
        for (int r = 0; r < world; ++r)
          for (int s = 0; s < world; ++s)
            ASSERT_EQ(cudaMemcpy(ranks[size_t(r)].returned[c]->data + s * back,
                                 ranks[size_t(s)].results[c]->data + r * back, back * sizeof(float),
                                 cudaMemcpyDeviceToDevice),
                      cudaSuccess);
      }
      const auto all = held(-1);
      for (int r = 0; r < world; ++r) {
        Rank &rank = ranks[size_t(r)];
        if (rank.tokens == 0)
          continue;
        DeviceBuffer<float> out{std::vector<float>(rank.x.size(), -3.0f)},
            expected{std::vector<float>(rank.x.size(), -5.0f)};
        cuda::MoeCombineReturnedParams combine;
        combine.tokens = rank.tokens;
        combine.topK = topK;
        combine.hidden = hidden;
        combine.expertsPerRank = perRank;
        combine.ids = rank.dIds->data;
        combine.weights = rank.dWeights->data;
        combine.slots = rank.dSlots->data;
        combine.chunks = 2;
        for (int c = 0; c < 2; ++c) {
          combine.returned[c] = rank.returned[c]->data;
          combine.chunkBegin[c] = chunkBegin[c];
          combine.chunkSlots[c] = chunkSlots[c];
        }
        combine.out = out.data;
        ASSERT_EQ(cuda::launchMoeCombineReturned(combine, nullptr), 0);
        runForm(all, rank.tokens, topK, rank.dX->data, rank.dIds->data, rank.dWeights->data,
                expected.data);
        // The same experts on the same rows, added in the same order: within rounding of the
        // forms' own launches (a routing slip would be of the order of the values).
        EXPECT_LT(relativeRms(out.download(), expected.download()), 1e-6) << "rank " << r;
      }
    }
}

} // namespace
} // namespace hybrid::kernels
