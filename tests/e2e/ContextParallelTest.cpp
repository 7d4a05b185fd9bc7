// Context-parallel prefill (hybrid-compile --shard=cp=N[,tp=M] or cp=N,ep=N, docs/parallelism.md)
// on the cpu device, every rank a thread over the loopback communicator: the golden checkpoints'
// prompt logits and greedy ids equal one rank's, for prompts shorter than the 2N chunks and
// lengths 2N does not divide, prefilled in one call or two; the DSA indexer's work is spread
// evenly; and with the experts over the context ranks each rank holds only its own.
#include "E2eTestSupport.h"

#include "hybrid/runtime/Communicator.h"
#include "hybrid/runtime/Plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <regex>
#include <set>
#include <thread>

namespace hybrid {
namespace {

using e2etest::compiledDir;

// What one rank saw: every prompt row's logits, the greedy continuation, the indexer's pairs.
struct RankRun {
  std::vector<float> logits;
  std::vector<int64_t> generated;
  uint64_t indexerPairs = 0;
  Status status = Status::ok();
};

int64_t argmax(std::span<const float> row) {
  return std::max_element(row.begin(), row.end()) - row.begin();
}

// Prefills `prompt` (in calls of at most `split` tokens) and decodes `newTokens` greedily.
Status runOne(Model &model, std::span<const int64_t> prompt, int64_t split, int newTokens,
              RankRun &run) {
  HYBRID_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> sequence, model.newSequence());
  for (size_t begin = 0; begin < prompt.size(); begin += size_t(split)) {
    const size_t count = std::min(prompt.size() - begin, size_t(split));
    HYBRID_ASSIGN_OR_RETURN(std::vector<float> logits,
                            sequence->prefill(prompt.subspan(begin, count)));
    run.logits.insert(run.logits.end(), logits.begin(), logits.end());
  }
  const size_t vocab = size_t(model.vocabSize());
  int64_t next = argmax(std::span<const float>(run.logits).last(vocab));
  for (int i = 0; i < newTokens; ++i) {
    run.generated.push_back(next);
    HYBRID_ASSIGN_OR_RETURN(std::vector<float> logits, sequence->decode(next));
    next = argmax(logits);
  }
  run.indexerPairs = model.usage().indexerScoredPairs;
  return Status::ok();
}

// The same run on every rank of a `world`-rank loopback group (one rank: no communicator);
// `skipping`: through comm::skipCollectives (hybrid-bench e2e --skip-collectives).
std::vector<RankRun> runRanks(const std::string &dir, int world, std::span<const int64_t> prompt,
                              int64_t split, int newTokens, bool skipping = false) {
  std::vector<RankRun> runs(static_cast<size_t>(world));
  std::vector<std::unique_ptr<comm::Communicator>> group;
  if (world > 1) {
    auto made = comm::makeLoopbackGroup(world);
    EXPECT_TRUE(made.isOk()) << made.status().message();
    if (!made.isOk())
      return {};
    group = std::move(*made);
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      LoadOptions options;
      options.communicator = world > 1 ? group[size_t(r)].get() : nullptr;
      std::unique_ptr<comm::Communicator> skipper;
      if (skipping && options.communicator) {
        skipper = comm::skipCollectives(*options.communicator);
        options.communicator = skipper.get();
      }
      RankRun &run = runs[size_t(r)];
      auto model = Model::load(dir, options);
      run.status = model.isOk() ? runOne(**model, prompt, split, newTokens, run) : model.status();
    });
  for (std::thread &thread : threads)
    thread.join();
  for (int r = 0; r < world; ++r)
    EXPECT_TRUE(runs[size_t(r)].status.isOk())
        << dir << " rank " << r << ": " << runs[size_t(r)].status.message();
  return runs;
}

std::vector<int64_t> promptOf(int64_t tokens, int64_t vocab) {
  std::vector<int64_t> prompt(static_cast<size_t>(tokens));
  for (int64_t i = 0; i < tokens; ++i)
    prompt[size_t(i)] = (i * 37 + 11) % vocab; // deterministic, every id in range
  return prompt;
}

struct Layout {
  const char *suffix; // compiled by e2e-shard-compile-<suffix>-<model>
  int world;
};

class ContextParallel : public ::testing::TestWithParam<std::string> {};

TEST_P(ContextParallel, LogitsAndGreedyIdsEqualOneRank) {
  const std::string model = GetParam();
  for (int64_t tokens : {int64_t(203), int64_t(3), int64_t(1)})
    for (int64_t split : {tokens, int64_t(150)}) {
      if (split > tokens)
        continue; // one call already
      const std::vector<int64_t> prompt = promptOf(tokens, 256);
      const std::vector<RankRun> one = runRanks(compiledDir(model), 1, prompt, split, 4);
      ASSERT_EQ(one.size(), 1u);
      ASSERT_TRUE(one[0].status.isOk());
      for (Layout layout : {Layout{"cp2", 2}, Layout{"cp4", 4}, Layout{"tp2-cp2", 4},
                            Layout{"cp2-ep2", 2}, Layout{"cp4-ep4", 4}}) {
        const std::string dir = compiledDir(model) + "-" + layout.suffix;
        SCOPED_TRACE(dir + ", " + std::to_string(tokens) + " tokens in calls of " +
                     std::to_string(split));
        const std::vector<RankRun> ranks = runRanks(dir, layout.world, prompt, split, 4);
        ASSERT_EQ(ranks.size(), size_t(layout.world));
        for (const RankRun &rank : ranks) {
          ASSERT_TRUE(rank.status.isOk());
          ASSERT_EQ(rank.logits.size(), one[0].logits.size());
          float worst = 0.0f;
          for (size_t i = 0; i < rank.logits.size(); ++i)
            worst = std::max(worst, std::abs(rank.logits[i] - one[0].logits[i]));
          EXPECT_LE(worst, 2e-3f);
          EXPECT_EQ(rank.generated, one[0].generated);
          // Every rank restores the same rows in the same order: the same bits everywhere.
          EXPECT_EQ(rank.logits, ranks[0].logits);
        }
      }
    }
}

INSTANTIATE_TEST_SUITE_P(Goldens, ContextParallel,
                         ::testing::Values("kimi_linear_tiny", "kimi_attnres_tiny",
                                           "deepseek_v32_tiny"));

// Experts over the context ranks (cp=N,ep=N): context rank r's plan holds the weights of
// experts [r E / N, (r + 1) E / N) and of no other (the rest are -1 in its moe_experts
// dispatches and absent from its weight table and archive); the prefill's dispatches exchange
// rows (all_to_all), the decode's do not and an all-reduce over the context group follows them.
TEST_P(ContextParallel, ExpertsOverTheContextRanksHoldOnlyTheirOwn) {
  const std::string model = GetParam();
  const std::regex expertName(R"(\.experts\.([0-9]+)\.)");
  for (Layout layout : {Layout{"cp2-ep2", 2}, Layout{"cp4-ep4", 4}}) {
    const std::string dir = compiledDir(model) + "-" + layout.suffix;
    for (int rank = 0; rank < layout.world; ++rank) {
      SCOPED_TRACE(dir + " rank " + std::to_string(rank));
      auto loaded = LoadedPlan::load(dir + "/" + planFileName(rank, layout.world));
      ASSERT_TRUE(loaded.isOk()) << loaded.status().message();
      const plan::fb::Plan &plan = loaded->plan();
      EXPECT_EQ(plan.target()->tensor_parallel(), 1);
      EXPECT_EQ(plan.target()->expert_parallel(), layout.world);
      EXPECT_EQ(plan.target()->context_parallel(), layout.world);
      int64_t experts = 0;
      int dispatches = 0;
      for (const plan::fb::Program *program : *plan.programs()) {
        const bool prefill = program->name()->str() == "prefill";
        const auto *steps = program->steps();
        for (size_t s = 0; s < steps->size(); ++s) {
          const plan::fb::Dispatch *d = steps->Get(flatbuffers::uoffset_t(s))->op_as_Dispatch();
          if (!d || d->kernel() != plan::fb::KernelId::MoeExperts)
            continue;
          ++dispatches;
          const plan::fb::MoeParams *p = d->params_as_MoeParams();
          experts = p->num_experts();
          EXPECT_EQ(p->all_to_all(), prefill) << program->name()->str();
          const int64_t perRank = experts / layout.world;
          for (int64_t e = 0; e < experts; ++e)
            for (int role = 0; role < 3; ++role) {
              const int32_t w = d->weights()->Get(flatbuffers::uoffset_t(3 * e + role));
              EXPECT_EQ(w >= 0, e / perRank == rank) << "expert " << e;
              if (w < 0)
                continue;
              std::smatch match;
              const std::string name =
                  plan.weights()->Get(flatbuffers::uoffset_t(w))->name()->str();
              ASSERT_TRUE(std::regex_search(name, match, expertName)) << name;
              EXPECT_EQ(std::stoll(match[1].str()), e) << name;
            }
          // The decode sums the experts' parts over the context group; the prefill does not.
          const plan::fb::Dispatch *next =
              s + 1 < steps->size() ? steps->Get(flatbuffers::uoffset_t(s + 1))->op_as_Dispatch()
                                    : nullptr;
          const bool reduced = next && next->kernel() == plan::fb::KernelId::AllReduceSum &&
                               next->inputs()->size() == 1 &&
                               next->inputs()->Get(0) == d->outputs()->Get(0) &&
                               next->params_as_CollectiveParams()->group() ==
                                   plan::fb::CollectiveGroup::ContextParallel;
          EXPECT_EQ(reduced, !prefill) << program->name()->str();
        }
      }
      EXPECT_GT(dispatches, 0);
      // No other rank's expert anywhere in this rank's weight table.
      const int64_t perRank = experts / layout.world;
      std::set<int64_t> held;
      for (const plan::fb::Weight *weight : *plan.weights()) {
        std::smatch match;
        const std::string name = weight->name()->str();
        if (std::regex_search(name, match, expertName))
          held.insert(std::stoll(match[1].str()));
      }
      ASSERT_FALSE(held.empty());
      EXPECT_EQ(*held.begin(), rank * perRank);
      EXPECT_EQ(*held.rbegin(), (rank + 1) * perRank - 1);
    }
  }
}

// Timing only: with every collective skipped a sharded model still loads and runs the same
// steps on every rank (nothing waits for a peer), and its logits are not the real run's (each
// rank lacks the others' rows): what hybrid-bench e2e --skip-collectives times.
TEST(ContextParallelWork, RunsWithItsCollectivesSkipped) {
  const std::vector<int64_t> prompt = promptOf(40, 256);
  const std::string dir = compiledDir("kimi_linear_tiny") + "-cp2";
  const std::vector<RankRun> real = runRanks(dir, 2, prompt, 40, 2);
  const std::vector<RankRun> skipped = runRanks(dir, 2, prompt, 40, 2, /*skipping=*/true);
  ASSERT_EQ(real.size(), 2u);
  ASSERT_EQ(skipped.size(), 2u);
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(skipped[r].status.isOk()) << skipped[r].status.message();
    ASSERT_EQ(skipped[r].logits.size(), real[r].logits.size());
    EXPECT_NE(skipped[r].logits, real[r].logits) << "rank " << r;
  }
}

// Zigzag pairs an early and a late chunk on each rank, so the causal (query, key) pairs the DSA
// indexer scores are spread evenly: every rank within 5% of the mean (counted by the runtime),
// and together exactly one rank's work.
TEST(ContextParallelWork, IndexerPairsPerRankWithinFivePercentOfTheMean) {
  const std::vector<int64_t> prompt = promptOf(1003, 256); // neither 4 nor 8 chunks divide it
  const std::vector<RankRun> one =
      runRanks(compiledDir("deepseek_v32_tiny"), 1, prompt, int64_t(prompt.size()), 0);
  ASSERT_EQ(one.size(), 1u);
  ASSERT_GT(one[0].indexerPairs, 0u);
  for (Layout layout : {Layout{"cp2", 2}, Layout{"cp4", 4}}) {
    SCOPED_TRACE(layout.suffix);
    const std::vector<RankRun> ranks =
        runRanks(compiledDir("deepseek_v32_tiny") + "-" + layout.suffix, layout.world, prompt,
                 int64_t(prompt.size()), 0);
    ASSERT_EQ(ranks.size(), size_t(layout.world));
    uint64_t total = 0;
    for (const RankRun &rank : ranks)
      total += rank.indexerPairs;
    EXPECT_EQ(total, one[0].indexerPairs);
    const double mean = double(total) / layout.world;
    for (size_t r = 0; r < ranks.size(); ++r)
      EXPECT_LE(std::abs(double(ranks[r].indexerPairs) - mean), 0.05 * mean)
          << "rank " << r << " scored " << ranks[r].indexerPairs << " pairs, the mean is "
          << mean;
  }
}

} // namespace
} // namespace hybrid
