// Multi-token-prediction drafts (docs/mtp.md) on a synthetic DeepSeek-V3.2 checkpoint with an MTP
// layer (the golden checkpoints have none): greedy outputs do not change with MTP speculation, the
// acceptance counters add up, the scheduler agrees, and the MTP program computes the formula
// (checked against the reference kernels where the MTP's decoder block adds nothing).
#include "hybrid/kernels/ref/Linear.h"
#include "hybrid/kernels/ref/Norm.h"
#include "hybrid/runtime/Draft.h"
#include "hybrid/runtime/Generate.h"
#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Safetensors.h"
#include "hybrid/runtime/Scheduler.h"
#include "hybrid/runtime/SyntheticCheckpoint.h"
#include "E2eTestSupport.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>

namespace hybrid {
namespace {

namespace fs = std::filesystem;
using e2etest::compiledDir;
using e2etest::greedyIds;
using e2etest::loadOrDie;
using e2etest::runToIdle;
using e2etest::SchedulerRun;
using e2etest::submitGreedy;

// tests/e2e/CMakeLists.txt compiles hybrid-synth --preset deepseek-v32-tiny --layers 2
// --mtp-layers 1 into this plan.
std::string mtpPlanDir() { return compiledDir("synth-mtp-cpu"); }

int64_t argmax(std::span<const float> row) {
  return std::max_element(row.begin(), row.end()) - row.begin();
}

std::vector<std::vector<int64_t>> randomPrompts(int64_t vocab) {
  std::mt19937 random(1234);
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t length : {1, 7, 23, 40}) {
    std::vector<int64_t> prompt(static_cast<size_t>(length));
    for (int64_t &token : prompt)
      token = std::uniform_int_distribution<int64_t>(0, vocab - 1)(random);
    prompts.push_back(prompt);
  }
  return prompts;
}

TEST(MtpTest, SpeculationKeepsGreedyOutputsAndCountsAddUp) {
  auto model = loadOrDie(mtpPlanDir());
  ASSERT_TRUE(model);
  ASSERT_TRUE(model->hasMtp());
  for (const std::vector<int64_t> &prompt : randomPrompts(model->vocabSize())) {
    GenerationOptions plain;
    plain.maxNewTokens = 10;
    auto reference = generateGreedy(*model, prompt, plain);
    ASSERT_TRUE(reference.isOk()) << reference.status().message();
    for (int64_t draftTokens : {1, 3}) {
      GenerationOptions speculative = plain;
      speculative.draftTokens = draftTokens;
      speculative.draftSource = DraftSourceKind::Mtp;
      auto result = generateGreedy(*model, prompt, speculative);
      ASSERT_TRUE(result.isOk()) << result.status().message();
      EXPECT_EQ(result->generated, reference->generated)
          << "prompt of " << prompt.size() << ", draft " << draftTokens;
      // Greedy logits too: each verification row is the prefill program's.
      ASSERT_EQ(result->generatedLogits.size(), reference->generatedLogits.size());
      double worst = 0;
      for (size_t i = 0; i < result->generatedLogits.size(); ++i)
        worst = std::max(worst, std::abs(double(result->generatedLogits[i]) -
                                         double(reference->generatedLogits[i])));
      EXPECT_LT(worst, 1e-4);
      // The first token comes from the prefill; each pass adds its accepted drafts and one.
      EXPECT_EQ(static_cast<int64_t>(result->generated.size()),
                1 + result->verifySteps + result->acceptedTokens);
      // Every pass but a last one with room for a single token drafts at least one.
      EXPECT_GE(result->draftedTokens, result->verifySteps - 1);
      EXPECT_LE(result->acceptedTokens, result->draftedTokens);
      EXPECT_LE(result->draftedTokens, draftTokens * result->verifySteps);
    }
  }
}

TEST(MtpTest, SchedulerWithMtpDraftsMatchesGreedy) {
  auto model = loadOrDie(mtpPlanDir());
  ASSERT_TRUE(model);
  SchedulerOptions options;
  options.draftTokens = 2;
  options.draftSource = DraftSourceKind::Mtp;
  options.prefillChunkTokens = 16; // prompts prefill in several chunks
  Scheduler scheduler(*model, options);
  const auto prompts = randomPrompts(model->vocabSize());
  const auto promptOf = submitGreedy(scheduler, prompts, 8);
  const SchedulerRun run = runToIdle(scheduler);
  EXPECT_TRUE(run.errors.empty());
  for (const auto &[id, prompt] : promptOf)
    EXPECT_EQ(run.tokens.at(id), greedyIds(*model, prompt, 8)) << "request " << id;
  const SchedulerStats stats = scheduler.stats();
  EXPECT_GT(stats.verifySteps, 0);
  EXPECT_LE(stats.acceptedTokens, stats.draftedTokens);
}

// SchedulerOptions::draftOnlyWhenItPays: whether a request drafts follows timings, the tokens do
// not; every token after a request's first comes from a verification pass (1 + its accepted
// drafts) or from a plain decode step that declined to draft, and the first pass is a probe.
TEST(MtpTest, SchedulerDraftingOnlyWhenItPaysKeepsTheTokens) {
  auto model = loadOrDie(mtpPlanDir());
  ASSERT_TRUE(model);
  SchedulerOptions options;
  options.draftTokens = 3;
  options.draftSource = DraftSourceKind::Mtp;
  options.draftOnlyWhenItPays = true;
  Scheduler scheduler(*model, options);
  const auto prompts = randomPrompts(model->vocabSize());
  const int64_t newTokens = 8;
  const auto promptOf = submitGreedy(scheduler, prompts, newTokens);
  const SchedulerRun run = runToIdle(scheduler);
  EXPECT_TRUE(run.errors.empty());
  for (const auto &[id, prompt] : promptOf)
    EXPECT_EQ(run.tokens.at(id), greedyIds(*model, prompt, newTokens)) << "request " << id;
  const SchedulerStats stats = scheduler.stats();
  EXPECT_GE(stats.verifySteps, 1);
  EXPECT_EQ(stats.verifySteps + stats.acceptedTokens + stats.declinedDrafts,
            static_cast<int64_t>(prompts.size()) * (newTokens - 1));
}

TEST(MtpTest, MtpDraftSourceNeedsAnMtpProgram) {
  auto model = loadOrDie(compiledDir("deepseek_v32_tiny"));
  ASSERT_TRUE(model);
  EXPECT_FALSE(model->hasMtp());
  auto source = makeDraftSource(*model, DraftSourceKind::Mtp);
  ASSERT_FALSE(source.isOk());
  EXPECT_NE(source.status().message().find("no 'mtp' program"), std::string::npos);
  GenerationOptions options;
  options.draftTokens = 2;
  options.draftSource = DraftSourceKind::Mtp;
  const std::vector<int64_t> prompt = {1, 2, 3};
  EXPECT_FALSE(generateGreedy(*model, prompt, options).isOk());
  SchedulerOptions scheduled;
  scheduled.draftTokens = 2;
  scheduled.draftSource = DraftSourceKind::Mtp;
  Scheduler scheduler(*model, scheduled);
  EXPECT_FALSE(scheduler.submit({prompt, 4, {}, {}}).isOk());
  EXPECT_FALSE(parseDraftSource("medusa").isOk());
  EXPECT_EQ(*parseDraftSource("mtp"), DraftSourceKind::Mtp);
}

// Writes a synthetic DeepSeek-V3.2 checkpoint with an MTP layer (2 decoder layers, so the MTP
// layer is model.layers.2) whose tensors `silenced` picks are zeros, and compiles it for the cpu.
std::string compileMtpCheckpoint(const fs::path &dir, uint64_t seed,
                                 bool (*silenced)(const std::string &name)) {
  auto spec = synth::SyntheticSpec::preset("deepseek-v32-tiny");
  EXPECT_TRUE(spec.isOk());
  spec->numLayers = 2;
  spec->numNextnPredictLayers = 1;
  spec->seed = seed;
  synth::SyntheticWriteOptions write;
  write.overwrite = true;
  EXPECT_TRUE(synth::writeSyntheticCheckpoint(*spec, dir.string(), write).isOk());
  const std::string shard = (dir / "model-00001-of-00001.safetensors").string();
  {
    auto file = safetensors::File::open(shard);
    EXPECT_TRUE(file.isOk()) << file.status().message();
    if (!file.isOk())
      return {};
    std::vector<std::vector<std::byte>> zeros;
    std::vector<safetensors::TensorView> views;
    for (const safetensors::TensorInfo &info : file->tensors()) {
      std::span<const std::byte> data = file->bytes(info);
      if (silenced(info.name)) {
        zeros.emplace_back(info.byteSize(), std::byte{0});
        data = zeros.back();
      }
      views.push_back({info.name, info.dtype, info.shape, data});
    }
    EXPECT_TRUE(safetensors::write(shard + ".edited", views).isOk());
  }
  fs::rename(shard + ".edited", shard);
  const std::string plan = dir.string() + "-cpu";
  const std::string command = std::string(HYBRID_COMPILE) + " " + dir.string() + " -o " + plan +
                              " --no-cache --quantization=none > /dev/null";
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  return plan;
}

// With both LM heads zero every logit is 0, so greedy decoding always picks token 0 and so does
// the MTP layer: every draft is accepted, which runs the MTP over several kept positions per pass
// and chains drafts on its own hidden states.
TEST(MtpTest, AcceptedDraftsKeepTheMtpCacheInStep) {
  const std::string plan =
      compileMtpCheckpoint(fs::path(HYBRID_E2E_DIR) / "synth-mtp-accepting", 31,
                           [](const std::string &name) {
                             return name == "lm_head.weight" ||
                                    name == "model.layers.2.shared_head.head.weight";
                           });
  auto model = loadOrDie(plan);
  ASSERT_TRUE(model);
  const std::vector<int64_t> prompt = {5, 9, 3, 77, 120};
  GenerationOptions options;
  options.maxNewTokens = 12;
  options.draftTokens = 3;
  options.draftSource = DraftSourceKind::Mtp;
  auto result = generateGreedy(*model, prompt, options);
  ASSERT_TRUE(result.isOk()) << result.status().message();
  EXPECT_EQ(result->generated, std::vector<int64_t>(12, 0));
  EXPECT_EQ(result->acceptedTokens, result->draftedTokens);
  EXPECT_GT(result->acceptedTokens, 6);
  EXPECT_EQ(static_cast<int64_t>(result->generated.size()),
            1 + result->verifySteps + result->acceptedTokens);

  // By hand: after a pass accepting everything, the MTP cache holds every consumed position.
  auto sequence = model->newSequence();
  ASSERT_TRUE(sequence.isOk());
  auto source = makeDraftSource(*model, DraftSourceKind::Mtp);
  ASSERT_TRUE(source.isOk());
  (*source)->attach(**sequence);
  ASSERT_TRUE((*sequence)->prefill(prompt).isOk());
  std::vector<int64_t> context = prompt;
  context.push_back(0);
  auto draft = (*source)->propose(**sequence, context, 3);
  ASSERT_TRUE(draft.isOk()) << draft.status().message();
  EXPECT_EQ(*draft, std::vector<int64_t>(3, 0));
  EXPECT_EQ((*sequence)->mtpLength(), static_cast<int64_t>(prompt.size()));
  auto verified = (*sequence)->verifyDraft(0, *draft);
  ASSERT_TRUE(verified.isOk());
  EXPECT_EQ(verified->accepted, 3);
  context.insert(context.end(), verified->tokens.begin(), verified->tokens.end());
  auto next = (*source)->propose(**sequence, context, 2);
  ASSERT_TRUE(next.isOk()) << next.status().message();
  EXPECT_EQ((*sequence)->mtpLength(), (*sequence)->length());
  EXPECT_EQ((*sequence)->length(), static_cast<int64_t>(prompt.size()) + 4);
}

// With the MTP block's output projections zeroed (attention o_proj, every expert's and the shared
// expert's down_proj) the block adds nothing to its residual, so the MTP logits are
// head(RMSNorm_shared(eh_proj([RMSNorm_enorm(embed(next)) | RMSNorm_hnorm(h)]))): computed here
// from the checkpoint with the reference kernels and compared with the mtp program's.
class MtpFormulaTest : public testing::Test {
protected:
  void SetUp() override {
    dir_ = fs::path(HYBRID_E2E_DIR) / "synth-mtp-formula";
    plan_ = compileMtpCheckpoint(dir_, 21, [](const std::string &name) {
      return name.starts_with("model.layers.2.") &&
             (name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight"));
    });
    shard_ = (dir_ / "model-00001-of-00001.safetensors").string();
    ASSERT_FALSE(plan_.empty());
  }

  std::vector<float> tensor(const std::string &name) {
    auto file = safetensors::File::open(shard_);
    EXPECT_TRUE(file.isOk());
    const safetensors::TensorInfo *info = file->find(name);
    EXPECT_NE(info, nullptr) << name;
    auto values = safetensors::readAsFloat(*file, *info);
    EXPECT_TRUE(values.isOk());
    return *values;
  }

  fs::path dir_;
  std::string shard_, plan_;
};

TEST_F(MtpFormulaTest, MtpLogitsFollowTheFormula) {
  auto model = loadOrDie(plan_);
  ASSERT_TRUE(model);
  const int64_t d = model->hiddenSize(), vocab = model->vocabSize();
  const std::vector<int64_t> prompt = {17, 4, 200, 93, 4, 58, 11};
  const auto T = static_cast<int64_t>(prompt.size());

  auto sequence = model->newSequence();
  ASSERT_TRUE(sequence.isOk());
  (*sequence)->recordFinalHidden(true);
  HiddenStates dumped;
  auto logits = (*sequence)->prefill(prompt, &dumped);
  ASSERT_TRUE(logits.isOk()) << logits.status().message();
  FinalHiddenRows hidden = (*sequence)->takeFinalHidden();
  ASSERT_EQ(hidden.firstPosition, 0);
  ASSERT_EQ(static_cast<int64_t>(hidden.rows.size()), T * d);
  // The recorded rows are the LM head's input: the dump's last entry (after model.norm).
  EXPECT_EQ(hidden.rows, dumped.layers.back());
  const int64_t next = argmax(std::span<const float>(*logits).last(static_cast<size_t>(vocab)));

  // The mtp program over every prompt position: row j pairs h_j with the token after it.
  std::vector<int64_t> following(prompt.begin() + 1, prompt.end());
  following.push_back(next);
  auto mtp = (*sequence)->runMtp(following, hidden.rows);
  ASSERT_TRUE(mtp.isOk()) << mtp.status().message();
  EXPECT_EQ((*sequence)->mtpLength(), T);

  // The reference, row by row.
  const std::vector<float> embed = tensor("model.embed_tokens.weight");
  const std::vector<float> enorm = tensor("model.layers.2.enorm.weight");
  const std::vector<float> hnorm = tensor("model.layers.2.hnorm.weight");
  const std::vector<float> ehProj = tensor("model.layers.2.eh_proj.weight");
  const std::vector<float> sharedNorm = tensor("model.layers.2.shared_head.norm.weight");
  const std::vector<float> head = tensor("model.layers.2.shared_head.head.weight");
  const double eps = 1e-6;
  double worst = 0;
  for (int64_t row = 0; row < T; ++row) {
    std::vector<float> joined(static_cast<size_t>(2 * d));
    std::span<const float> e(embed.data() + following[static_cast<size_t>(row)] * d,
                             static_cast<size_t>(d));
    std::span<const float> h(hidden.rows.data() + row * d, static_cast<size_t>(d));
    kernels::ref::rmsNorm(e, enorm, std::span(joined).first(static_cast<size_t>(d)), 1, d, eps);
    kernels::ref::rmsNorm(h, hnorm, std::span(joined).last(static_cast<size_t>(d)), 1, d, eps);
    std::vector<float> projected(static_cast<size_t>(d)), normed(static_cast<size_t>(d));
    kernels::ref::linear(joined, ehProj, projected, 1, 2 * d, d);
    kernels::ref::rmsNorm(projected, sharedNorm, normed, 1, d, eps);
    std::vector<float> expected(static_cast<size_t>(vocab));
    kernels::ref::linear(normed, head, expected, 1, d, vocab);
    std::span<const float> got =
        std::span<const float>(mtp->logits).subspan(static_cast<size_t>(row * vocab),
                                                     static_cast<size_t>(vocab));
    for (int64_t v = 0; v < vocab; ++v)
      worst = std::max(worst, std::abs(double(got[static_cast<size_t>(v)]) -
                                       double(expected[static_cast<size_t>(v)])));
    if (row == T - 1) {
      // The draft source proposes the argmax of this last row for a fresh sequence.
      auto fresh = model->newSequence();
      ASSERT_TRUE(fresh.isOk());
      auto source = makeDraftSource(*model, DraftSourceKind::Mtp);
      ASSERT_TRUE(source.isOk());
      (*source)->attach(**fresh);
      ASSERT_TRUE((*fresh)->prefill(prompt).isOk());
      std::vector<int64_t> context = prompt;
      context.push_back(next);
      auto draft = (*source)->propose(**fresh, context, 1);
      ASSERT_TRUE(draft.isOk()) << draft.status().message();
      ASSERT_EQ(draft->size(), 1u);
      EXPECT_EQ((*draft)[0], argmax(expected));
      EXPECT_EQ((*fresh)->mtpLength(), T); // chained rows are dropped, real ones stay
    }
  }
  EXPECT_LT(worst, 1e-3);
}

} // namespace
} // namespace hybrid
