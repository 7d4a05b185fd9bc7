// Tests of the plan loader: plans are built here with the FlatBuffers builder from a small
// description, then mutated one field at a time. Every rejection must be one line that names the
// file and the offending field; random corruption must never crash (run under ASan too).
#include "hybrid/runtime/Plan.h"
#include "hybrid/runtime/WeightArchive.h"

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <gtest/gtest.h>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace hybrid {
namespace {

namespace fs = std::filesystem;
using namespace plan::fb;

//===------------------------------------------------------------------------------------------===//
// A plan description and its serialisation.
//===------------------------------------------------------------------------------------------===//

struct DispatchSpec {
  KernelId kernel = KernelId::Add;
  KernelParams paramsType = KernelParams::AddParams;
  bool withParams = true;
  std::vector<int32_t> inputs = {1, 1};
  std::vector<int32_t> outputs = {2};
  std::vector<int32_t> weights;
  int32_t stream = 0;
  std::vector<int32_t> waitEvents;
  int32_t signalEvent = -1;
  int32_t layer = -1;
  // Params fields the loader looks at.
  int32_t kvSlot = 0;
  int32_t stateSlot = 0;
  int32_t numExperts = 2;
  CollectiveGroup group = CollectiveGroup::TensorParallel;
  int32_t tailRows = 0;
  bool allToAll = false; // MoeParams.all_to_all
};

struct CopySpec {
  int32_t source = 0;
  int32_t destination = 0;
  int32_t stream = 0;
};

// Neither a dispatch nor a copy: a step without an op.
struct StepSpec {
  std::optional<DispatchSpec> dispatch;
  std::optional<CopySpec> copy;
};

struct ValueSpec {
  DType dtype = DType::F32;
  int64_t rowElements = 0;
  uint64_t arenaOffset = 0;
  ValueRows rows = ValueRows::Step;
};

struct WeightSpec {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;
  uint64_t size = 0;
  QuantKind quant = QuantKind::None;
  std::vector<int32_t> block;
  int32_t scale = -1;
};

struct KvSpec {
  int32_t layer = 0;
  int32_t latentDim = 0;
  int32_t ropeDim = 0;
  DType dtype = DType::F32;
  int32_t indexKeyDim = 0;
};

struct RecurrentSpec {
  int32_t layer = 0;
  int32_t numHeads = 0;
  int32_t headKDim = 0;
  int32_t headVDim = 0;
  int32_t convChannels = 0;
  int32_t convKernel = 0;
};

struct PlanSpec {
  bool withVersion = true;
  uint16_t major = kPlanVersionMajor;
  uint16_t minor = kPlanVersionMinor;
  bool withTarget = true;
  std::string device = "cpu";
  std::string arch;
  int32_t worldSize = 1;
  int32_t rank = 0;
  int32_t tensorParallel = 1;
  int32_t expertParallel = 1;
  int32_t contextParallel = 1;
  int64_t hiddenSize = 16;
  int64_t vocabSize = 16;
  int32_t numLayers = 2;
  std::vector<WeightSpec> weights;
  std::string archiveKey;
  uint64_t archiveBytes = 0;
  int32_t pageSize = 4;
  std::vector<KvSpec> kv;
  std::vector<RecurrentSpec> recurrent;
  // One program.
  std::string programName = "prefill";
  int64_t maxTokens = 4;
  std::vector<ValueSpec> values;
  std::vector<StepSpec> steps;
  uint64_t arenaBytes = 0;
  int32_t tokenIds = 0;
  int32_t logits = 2;
  std::vector<int32_t> layerOutputs;
  int32_t numStreams = 1;
  int32_t numEvents = 0;
  Fp8ActivationScale fp8ActivationScale = Fp8ActivationScale::Amax;
};

const std::string kArchiveKeyHex = "00112233445566778899aabbccddeeff";

// Two weights, a KV layer and a recurrent layer; values ids (I64 x 1), x (F32 x 16) and logits
// (F32 x 16) for 4 tokens; one step: logits = Add(x, x).
PlanSpec minimalPlan() {
  PlanSpec plan;
  plan.weights = {{"w0", DType::F32, {16, 16}, 4096, 1024, QuantKind::None, {}, -1},
                  {"w1", DType::BF16, {16}, 8192, 32, QuantKind::None, {}, -1}};
  plan.archiveKey = kArchiveKeyHex;
  plan.kv = {{1, 4, 2, DType::F32, 0}};
  plan.recurrent = {{0, 2, 4, 4, 24, 4}};
  plan.values = {{DType::I64, 1, 0}, {DType::F32, 16, 64}, {DType::F32, 16, 320}};
  plan.arenaBytes = 576;
  plan.steps = {{DispatchSpec{}, std::nullopt}};
  return plan;
}

DispatchSpec dispatchOf(KernelId kernel, KernelParams params, std::vector<int32_t> weights,
                        std::vector<int32_t> inputs = {1}, std::vector<int32_t> outputs = {1}) {
  DispatchSpec dispatch;
  dispatch.kernel = kernel;
  dispatch.paramsType = params;
  dispatch.weights = std::move(weights);
  dispatch.inputs = std::move(inputs);
  dispatch.outputs = std::move(outputs);
  return dispatch;
}

// MLA weights with the optional roles (q_proj, q_b_proj, g_proj) absent.
const std::vector<int32_t> kMlaRequiredOnly = {-1, -1, 0, 0, 0, -1, 0};

// Every kernel once, two streams and an event, a copy: the plan the fuzz test corrupts.
PlanSpec richPlan() {
  PlanSpec plan = minimalPlan();
  plan.values.push_back({DType::F32, 16, 576}); // 3: a second residual
  plan.values.push_back({DType::I32, 8, 832});  // 4: indexer top-k
  plan.arenaBytes = 960;
  plan.numStreams = 2;
  plan.numEvents = 1;
  plan.layerOutputs = {1, 3};
  auto repeat = [](int count, int32_t index) { return std::vector<int32_t>(count, index); };
  std::vector<DispatchSpec> dispatches = {
      dispatchOf(KernelId::Embed, KernelParams::EmbedParams, {0}, {0}, {1}),
      dispatchOf(KernelId::RmsNorm, KernelParams::RmsNormParams, {1}),
      dispatchOf(KernelId::KdaChunkPrefill, KernelParams::KdaParams, repeat(16, 0)),
      dispatchOf(KernelId::IndexerQuery, KernelParams::DsaIndexerParams, {0}, {1}, {2}),
      dispatchOf(KernelId::DsaIndexer, KernelParams::DsaIndexerParams, {}, {1, 1, 1}, {4}),
      dispatchOf(KernelId::SparseMlaPrefill, KernelParams::MlaParams, kMlaRequiredOnly, {1, 4}),
      dispatchOf(KernelId::MlaDecode, KernelParams::MlaParams, repeat(7, 0)),
      dispatchOf(KernelId::AttnRes, KernelParams::AttnResParams, {0, 1}, {1, 3}),
      dispatchOf(KernelId::Mlp, KernelParams::MlpParams, repeat(3, 0)),
      dispatchOf(KernelId::RouterTopK, KernelParams::MoeParams, {0, -1}, {1}, {2, 3}),
      dispatchOf(KernelId::MoeExperts, KernelParams::MoeParams, repeat(6, 0), {1, 2, 3}),
      dispatchOf(KernelId::Linear, KernelParams::LinearParams, {0}),
      dispatchOf(KernelId::LmHead, KernelParams::LmHeadParams, {0}, {1}, {2}),
  };
  dispatches[5].stream = 1;
  dispatches[5].signalEvent = 0;
  dispatches[6].waitEvents = {0};
  dispatches[2].layer = 0;
  dispatches[5].layer = 1;
  plan.steps.clear();
  for (const DispatchSpec &dispatch : dispatches)
    plan.steps.push_back({dispatch, std::nullopt});
  plan.steps.push_back({std::nullopt, CopySpec{1, 3, 1}});
  return plan;
}

flatbuffers::Offset<void> buildParams(flatbuffers::FlatBufferBuilder &builder,
                                      const DispatchSpec &dispatch) {
  switch (dispatch.paramsType) {
  case KernelParams::EmbedParams:
    return CreateEmbedParams(builder).Union();
  case KernelParams::RmsNormParams:
    return CreateRmsNormParams(builder, 1e-6f).Union();
  case KernelParams::LinearParams:
    return CreateLinearParams(builder).Union();
  case KernelParams::AddParams:
    return CreateAddParams(builder).Union();
  case KernelParams::KdaParams: {
    KdaParamsBuilder params(builder);
    params.add_num_heads(2);
    params.add_head_dim(4);
    params.add_conv_kernel(4);
    params.add_state_slot(dispatch.stateSlot);
    return params.Finish().Union();
  }
  case KernelParams::MlaParams: {
    MlaParamsBuilder params(builder);
    params.add_num_heads(2);
    params.add_kv_lora_rank(4);
    params.add_kv_slot(dispatch.kvSlot);
    return params.Finish().Union();
  }
  case KernelParams::DsaIndexerParams: {
    DsaIndexerParamsBuilder params(builder);
    params.add_top_k(8);
    params.add_kv_slot(dispatch.kvSlot);
    return params.Finish().Union();
  }
  case KernelParams::AttnResParams:
    return CreateAttnResParams(builder, 2, 1e-6f).Union();
  case KernelParams::MlpParams:
    return CreateMlpParams(builder).Union();
  case KernelParams::MoeParams: {
    MoeParamsBuilder params(builder);
    params.add_num_experts(dispatch.numExperts);
    params.add_top_k(1);
    params.add_all_to_all(dispatch.allToAll);
    return params.Finish().Union();
  }
  case KernelParams::LmHeadParams:
    return CreateLmHeadParams(builder).Union();
  case KernelParams::CollectiveParams:
    return CreateCollectiveParams(builder, dispatch.group, dispatch.tailRows).Union();
  case KernelParams::NONE:
    break;
  }
  return 0;
}

std::vector<std::byte> buildPlan(const PlanSpec &spec) {
  flatbuffers::FlatBufferBuilder builder;

  std::vector<flatbuffers::Offset<Weight>> weights;
  for (const WeightSpec &weight : spec.weights)
    weights.push_back(CreateWeightDirect(builder, weight.name.c_str(), weight.dtype, &weight.shape,
                                         weight.offset, weight.size, Layout::RowMajor, weight.quant,
                                         weight.block.empty() ? nullptr : &weight.block,
                                         weight.scale));

  std::vector<flatbuffers::Offset<KvCacheLayer>> kv;
  for (const KvSpec &layer : spec.kv)
    kv.push_back(CreateKvCacheLayer(builder, layer.layer, layer.latentDim, layer.ropeDim,
                                    layer.dtype, layer.indexKeyDim));
  std::vector<flatbuffers::Offset<RecurrentStateLayer>> recurrent;
  for (const RecurrentSpec &layer : spec.recurrent)
    recurrent.push_back(CreateRecurrentStateLayer(
        builder, layer.layer, layer.numHeads, layer.headKDim, layer.headVDim, StateLayout::KMajor,
        layer.convChannels, layer.convKernel));
  auto cache = CreateCacheSpecDirect(builder, spec.pageSize, &kv, &recurrent);

  std::vector<flatbuffers::Offset<Value>> values;
  for (size_t i = 0; i < spec.values.size(); ++i)
    values.push_back(CreateValueDirect(builder, spec.values[i].dtype, spec.values[i].rowElements,
                                       spec.values[i].arenaOffset,
                                       ("value" + std::to_string(i)).c_str(), spec.values[i].rows));
  std::vector<flatbuffers::Offset<Step>> steps;
  for (const StepSpec &step : spec.steps) {
    if (step.dispatch) {
      const DispatchSpec &dispatch = *step.dispatch;
      auto params = dispatch.withParams ? buildParams(builder, dispatch) : 0;
      auto op = CreateDispatchDirect(builder, dispatch.kernel, dispatch.paramsType, params,
                                     &dispatch.inputs, &dispatch.outputs, &dispatch.weights,
                                     dispatch.stream, &dispatch.waitEvents, dispatch.signalEvent,
                                     dispatch.layer);
      steps.push_back(CreateStep(builder, StepOp::Dispatch, op.Union()));
    } else if (step.copy) {
      auto op = CreateCopy(builder, step.copy->source, step.copy->destination, step.copy->stream);
      steps.push_back(CreateStep(builder, StepOp::Copy, op.Union()));
    } else {
      steps.push_back(CreateStep(builder));
    }
  }
  std::vector<flatbuffers::Offset<Program>> programs = {CreateProgramDirect(
      builder, spec.programName.c_str(), spec.maxTokens, &values, &steps, spec.arenaBytes,
      spec.tokenIds, spec.logits, &spec.layerOutputs, spec.numStreams, spec.numEvents)};

  Version version(spec.major, spec.minor);
  auto target = spec.withTarget ? CreateTargetDirect(builder, spec.device.c_str(),
                                                     spec.arch.c_str(), spec.worldSize, spec.rank,
                                                     spec.tensorParallel, spec.expertParallel,
                                                     spec.contextParallel)
                                : 0;
  auto plan =
      CreatePlanDirect(builder, spec.withVersion ? &version : nullptr, "hybrid-test 0.1",
                       "kimi_linear", target, spec.hiddenSize, spec.vocabSize, spec.numLayers,
                       &weights, spec.archiveKey.c_str(), spec.archiveBytes, cache, &programs,
                       spec.fp8ActivationScale);
  FinishPlanBuffer(builder, plan);
  auto *data = reinterpret_cast<const std::byte *>(builder.GetBufferPointer());
  return {data, data + builder.GetSize()};
}

//===------------------------------------------------------------------------------------------===//
// Helpers.
//===------------------------------------------------------------------------------------------===//

constexpr const char *kSource = "test.hyplan";

// Loads bytes that must be rejected; checks the message is one line starting with the source.
std::string loadError(const std::vector<std::byte> &bytes) {
  StatusOr<LoadedPlan> plan = LoadedPlan::fromBytes(bytes, kSource);
  EXPECT_FALSE(plan.isOk()) << "the plan was accepted";
  if (plan.isOk())
    return "";
  const std::string &message = plan.status().message();
  EXPECT_EQ(message.rfind(std::string(kSource) + ": ", 0), 0u) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  return message;
}

std::string loadError(const PlanSpec &spec) { return loadError(buildPlan(spec)); }

LoadedPlan loadOrDie(const PlanSpec &spec) {
  StatusOr<LoadedPlan> plan = LoadedPlan::fromBytes(buildPlan(spec), kSource);
  EXPECT_TRUE(plan.isOk()) << plan.status().message();
  return std::move(plan).value();
}

DispatchSpec &firstDispatch(PlanSpec &spec) { return *spec.steps[0].dispatch; }

#define EXPECT_CONTAINS(text, part)                                                                \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "message: " << (text)

//===------------------------------------------------------------------------------------------===//
// Valid plans.
//===------------------------------------------------------------------------------------------===//

TEST(PlanLoader, MinimalPlanLoads) {
  StatusOr<LoadedPlan> loaded = LoadedPlan::fromBytes(buildPlan(minimalPlan()), kSource);
  ASSERT_TRUE(loaded.isOk()) << loaded.status().message();
  LoadedPlan plan = std::move(loaded).value(); // tables stay valid across moves
  EXPECT_EQ(plan.path(), kSource);
  EXPECT_EQ(plan->version()->major(), kPlanVersionMajor);
  EXPECT_EQ(plan->weights()->size(), 2u);
  const Program *prefill = plan.findProgram("prefill");
  ASSERT_NE(prefill, nullptr);
  EXPECT_EQ(prefill->values()->size(), 3u);
  EXPECT_EQ(plan.findProgram("decode"), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(plan.bytes().data()) % 8, 0u);
}

TEST(PlanLoader, EveryKernelLoads) {
  StatusOr<LoadedPlan> plan = LoadedPlan::fromBytes(buildPlan(richPlan()), kSource);
  ASSERT_TRUE(plan.isOk()) << plan.status().message();
  EXPECT_EQ(plan->plan().programs()->Get(0)->steps()->size(), 14u);
}

TEST(PlanLoader, LoadsFromFile) {
  std::string path = (fs::path(testing::TempDir()) / "hybrid_plan_loader_test.hyplan").string();
  std::vector<std::byte> bytes = buildPlan(minimalPlan());
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char *>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
  }
  StatusOr<LoadedPlan> plan = LoadedPlan::load(path);
  ASSERT_TRUE(plan.isOk()) << plan.status().message();
  EXPECT_EQ(plan->path(), path);
  EXPECT_EQ(plan->bytes().size(), bytes.size());

  // A truncated file names the path.
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char *>(bytes.data()), 40);
  }
  StatusOr<LoadedPlan> truncated = LoadedPlan::load(path);
  ASSERT_FALSE(truncated.isOk());
  EXPECT_EQ(truncated.status().message().rfind(path + ": ", 0), 0u);
  fs::remove(path);

  StatusOr<LoadedPlan> missing = LoadedPlan::load(path);
  ASSERT_FALSE(missing.isOk());
  EXPECT_CONTAINS(missing.status().message(), path + ": cannot open");
}

TEST(PlanLoader, KernelMetadata) {
  EXPECT_EQ(expectedParamsType(KernelId::SparseMlaDecode), KernelParams::MlaParams);
  EXPECT_EQ(expectedParamsType(KernelId::KdaRecurrentDecode), KernelParams::KdaParams);
  EXPECT_EQ(expectedParamsType(static_cast<KernelId>(999)), KernelParams::NONE);
  EXPECT_EQ(expectedWeightCount(KernelId::KdaChunkPrefill), 16);
  EXPECT_EQ(expectedWeightCount(KernelId::MlaPrefill), 7);
  EXPECT_EQ(expectedWeightCount(KernelId::DsaIndexer), 0);
  EXPECT_EQ(expectedWeightCount(KernelId::IndexerKey), 3);
  EXPECT_EQ(expectedWeightCount(KernelId::RouterTopK), 2);
  EXPECT_EQ(expectedWeightCount(KernelId::MoeExperts, 4), 12);
  EXPECT_EQ(expectedWeightCount(KernelId::AttnRes), 2);
  EXPECT_EQ(expectedWeightCount(KernelId::Mlp), 3);
  EXPECT_EQ(expectedWeightCount(KernelId::LmHead), 1);
  EXPECT_EQ(expectedWeightCount(KernelId::Add), 0);
}

//===------------------------------------------------------------------------------------------===//
// Gates 1 and 2: size, identifier, structure.
//===------------------------------------------------------------------------------------------===//

TEST(PlanLoader, TooSmall) {
  EXPECT_CONTAINS(loadError(std::vector<std::byte>{}), "0 bytes, too small");
  EXPECT_CONTAINS(loadError(std::vector<std::byte>(7)), "7 bytes, too small");
}

TEST(PlanLoader, WrongIdentifier) {
  std::vector<std::byte> bytes = buildPlan(minimalPlan());
  std::memcpy(bytes.data() + 4, "NOPE", 4);
  EXPECT_CONTAINS(loadError(bytes), "file identifier is 'NOPE', expected 'HYPL'");
}

TEST(PlanLoader, Truncated) {
  std::vector<std::byte> bytes = buildPlan(minimalPlan());
  for (size_t keep : {size_t{8}, size_t{16}, bytes.size() / 2, bytes.size() - 8}) {
    SCOPED_TRACE(keep);
    std::vector<std::byte> truncated(bytes.begin(), bytes.begin() + keep);
    EXPECT_CONTAINS(loadError(truncated), "verifier");
  }
}

// Random single-byte flips and truncations of a plan using every kernel: each must load or be
// rejected with a proper message, never crash or read out of bounds (ASan build).
TEST(PlanLoader, RandomCorruptionNeverCrashes) {
  const std::vector<std::byte> original = buildPlan(richPlan());
  std::mt19937 random(42);
  int rejected = 0;
  for (int trial = 0; trial < 400; ++trial) {
    std::vector<std::byte> bytes = original;
    if (trial % 4 == 3) {
      bytes.resize(random() % original.size());
    } else {
      bytes[random() % bytes.size()] ^= static_cast<std::byte>(1 + random() % 255);
    }
    StatusOr<LoadedPlan> plan = LoadedPlan::fromBytes(bytes, kSource);
    if (!plan.isOk()) {
      ++rejected;
      const std::string &message = plan.status().message();
      EXPECT_EQ(message.rfind(std::string(kSource) + ": ", 0), 0u) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
      continue;
    }
    // A flip the checks cannot see (a float, a name) still leaves a usable plan.
    (void)checkTarget(*plan, "cpu", 1);
    const Program *program = plan->plan().programs()->Get(0);
    for (const Step *step : *program->steps()) {
      if (const Dispatch *dispatch = step->op_as_Dispatch()) {
        for (int32_t input : *dispatch->inputs())
          EXPECT_LT(static_cast<uint32_t>(input), program->values()->size());
      }
    }
  }
  EXPECT_GT(rejected, 100);
}

//===------------------------------------------------------------------------------------------===//
// Gate 3: semantic checks.
//===------------------------------------------------------------------------------------------===//

TEST(PlanLoader, Version) {
  PlanSpec newerMajor = minimalPlan();
  newerMajor.major = kPlanVersionMajor + 1;
  newerMajor.minor = 0;
  EXPECT_CONTAINS(loadError(newerMajor), "version: plan format 2.0 has another major version");

  PlanSpec newerMinor = minimalPlan();
  newerMinor.minor = kPlanVersionMinor + 1;
  EXPECT_CONTAINS(loadError(newerMinor), "version: plan format 1." +
                                             std::to_string(kPlanVersionMinor + 1) +
                                             " is newer than this runtime");

  // Older minor versions stay readable: their plans lack only fields with defaults.
  PlanSpec olderMinor = minimalPlan();
  olderMinor.minor = 0;
  EXPECT_TRUE(LoadedPlan::fromBytes(buildPlan(olderMinor), kSource).isOk());

  PlanSpec olderMajor = minimalPlan();
  olderMajor.major = 0;
  olderMajor.minor = 0;
  EXPECT_CONTAINS(loadError(olderMajor), "version: plan format 0.0");

  PlanSpec missing = minimalPlan();
  missing.withVersion = false;
  EXPECT_CONTAINS(loadError(missing), "version: missing");
}

TEST(PlanLoader, TargetAndModelFields) {
  PlanSpec noTarget = minimalPlan();
  noTarget.withTarget = false;
  EXPECT_CONTAINS(loadError(noTarget), "target: missing");
  PlanSpec worldSize = minimalPlan();
  worldSize.worldSize = 0;
  EXPECT_CONTAINS(loadError(worldSize), "target.world_size = 0 must be positive");
  PlanSpec vocab = minimalPlan();
  vocab.vocabSize = 0;
  EXPECT_CONTAINS(loadError(vocab), "vocab_size = 0");
}

TEST(PlanLoader, ValueIndexOutOfRange) {
  PlanSpec spec = minimalPlan();
  firstDispatch(spec).inputs = {1, 7};
  EXPECT_CONTAINS(loadError(spec), "programs[0].steps[0] (Add).inputs[1] = 7 is out of range [0, "
                                   "3) of the values of program 'prefill'");
  PlanSpec negative = minimalPlan();
  firstDispatch(negative).outputs = {-1};
  EXPECT_CONTAINS(loadError(negative), "outputs[0] = -1 is out of range");
}

TEST(PlanLoader, TokenIdsLogitsAndLayerOutputs) {
  PlanSpec tokenIds = minimalPlan();
  tokenIds.tokenIds = 3;
  EXPECT_CONTAINS(loadError(tokenIds), "programs[0].token_ids = 3 is out of range");
  PlanSpec tokenDtype = minimalPlan();
  tokenDtype.tokenIds = 1;
  EXPECT_CONTAINS(loadError(tokenDtype), "programs[0].token_ids = 1 names a F32 value");
  PlanSpec logits = minimalPlan();
  logits.logits = 0;
  EXPECT_CONTAINS(loadError(logits), "programs[0].logits = 0 names a I64 value");
  PlanSpec vocab = minimalPlan();
  vocab.vocabSize = 32;
  EXPECT_CONTAINS(loadError(vocab), "expected F32 with vocab_size 32");
  PlanSpec outputs = minimalPlan();
  outputs.layerOutputs = {1, 9};
  EXPECT_CONTAINS(loadError(outputs), "programs[0].layer_outputs[1] = 9 is out of range");
}

TEST(PlanLoader, ArenaOverflow) {
  PlanSpec spec = minimalPlan();
  spec.arenaBytes = 575;
  EXPECT_CONTAINS(loadError(spec), "programs[0].values[2]: arena_offset 320 + max_tokens 4 x 16 "
                                   "F32 reaches past arena_bytes 575");
  PlanSpec tokens = minimalPlan();
  tokens.maxTokens = 5;
  EXPECT_CONTAINS(loadError(tokens), "reaches past arena_bytes 576");
  PlanSpec huge = minimalPlan();
  huge.values[1].rowElements = int64_t{1} << 62; // the byte count overflows uint64
  EXPECT_CONTAINS(loadError(huge), "programs[0].values[1]: arena_offset 64");
  PlanSpec misaligned = minimalPlan();
  misaligned.values[1].arenaOffset = 66;
  EXPECT_CONTAINS(loadError(misaligned), "values[1].arena_offset = 66 is not aligned");
  PlanSpec maxTokens = minimalPlan();
  maxTokens.maxTokens = 0;
  EXPECT_CONTAINS(loadError(maxTokens), "programs[0].max_tokens = 0 must be positive");
}

TEST(PlanLoader, ParamsMustMatchKernel) {
  PlanSpec spec = minimalPlan();
  firstDispatch(spec).paramsType = KernelParams::LinearParams;
  EXPECT_CONTAINS(loadError(spec), "programs[0].steps[0] (Add).params: kernel Add takes "
                                   "AddParams, the plan gives LinearParams");

  PlanSpec indexer = minimalPlan();
  firstDispatch(indexer) =
      dispatchOf(KernelId::DsaIndexer, KernelParams::MlaParams, std::vector<int32_t>(5, 0));
  EXPECT_CONTAINS(loadError(indexer), "kernel DsaIndexer takes DsaIndexerParams, the plan gives "
                                      "MlaParams");

  PlanSpec missing = minimalPlan();
  firstDispatch(missing).withParams = false;
  EXPECT_CONTAINS(loadError(missing), "(Add).params: missing AddParams table");

  PlanSpec unknown = minimalPlan();
  firstDispatch(unknown).kernel = static_cast<KernelId>(200);
  EXPECT_CONTAINS(loadError(unknown), "programs[0].steps[0].kernel has the unknown value 200");
}

TEST(PlanLoader, WeightCountPerKernel) {
  PlanSpec linear = minimalPlan();
  firstDispatch(linear) = dispatchOf(KernelId::Linear, KernelParams::LinearParams, {0, 1});
  EXPECT_CONTAINS(loadError(linear),
                  "(Linear).weights: has 2 entries, Linear takes 1 in the role order");

  PlanSpec kda = minimalPlan();
  firstDispatch(kda) =
      dispatchOf(KernelId::KdaRecurrentDecode, KernelParams::KdaParams, std::vector<int32_t>(15));
  EXPECT_CONTAINS(loadError(kda), "has 15 entries, KdaRecurrentDecode takes 16");

  PlanSpec moe = minimalPlan();
  firstDispatch(moe) = dispatchOf(KernelId::MoeExperts, KernelParams::MoeParams,
                                  std::vector<int32_t>(5), {1, 1, 1});
  EXPECT_CONTAINS(loadError(moe), "has 5 entries, MoeExperts takes 6");
  firstDispatch(moe).weights.push_back(0);
  EXPECT_TRUE(LoadedPlan::fromBytes(buildPlan(moe), kSource).isOk());
  firstDispatch(moe).numExperts = 0;
  EXPECT_CONTAINS(loadError(moe), "(MoeExperts).params.num_experts = 0 must be positive");

  PlanSpec add = minimalPlan();
  firstDispatch(add).weights = {0};
  EXPECT_CONTAINS(loadError(add), "has 1 entries, Add takes 0");
}

TEST(PlanLoader, WeightIndexOutOfRange) {
  PlanSpec spec = minimalPlan();
  firstDispatch(spec) = dispatchOf(KernelId::Linear, KernelParams::LinearParams, {2});
  EXPECT_CONTAINS(loadError(spec), "(Linear).weights[0] (weight) = 2 is out of range [0, 2) of "
                                   "the plan's weights");
  firstDispatch(spec).weights = {-2};
  EXPECT_CONTAINS(loadError(spec), "weights[0] (weight) = -2 is out of range");
}

TEST(PlanLoader, AbsentWeightsOnlyInOptionalRoles) {
  PlanSpec linear = minimalPlan();
  firstDispatch(linear) = dispatchOf(KernelId::Linear, KernelParams::LinearParams, {-1});
  EXPECT_CONTAINS(loadError(linear), "(Linear).weights[0] (weight) = -1, but the role is required");

  PlanSpec mla = minimalPlan();
  firstDispatch(mla) = dispatchOf(KernelId::MlaDecode, KernelParams::MlaParams, kMlaRequiredOnly);
  EXPECT_TRUE(LoadedPlan::fromBytes(buildPlan(mla), kSource).isOk());
  firstDispatch(mla).weights[4] = -1;
  EXPECT_CONTAINS(loadError(mla), "(MlaDecode).weights[4] (kv_b_proj) = -1, but the role is "
                                  "required");

  PlanSpec router = minimalPlan();
  firstDispatch(router) =
      dispatchOf(KernelId::RouterTopK, KernelParams::MoeParams, {0, -1}, {1}, {1, 1});
  EXPECT_TRUE(LoadedPlan::fromBytes(buildPlan(router), kSource).isOk()); // no correction bias
  firstDispatch(router).weights = {-1, 0};
  EXPECT_CONTAINS(loadError(router), "(RouterTopK).weights[0] (router) = -1, but the role is "
                                     "required");

  PlanSpec moe = minimalPlan();
  firstDispatch(moe) = dispatchOf(KernelId::MoeExperts, KernelParams::MoeParams,
                                  std::vector<int32_t>(6), {1, 1, 1});
  firstDispatch(moe).weights[4] = -1;
  EXPECT_CONTAINS(loadError(moe), "(MoeExperts).weights[4] (expert 1 up_proj) = -1, but the role "
                                  "is required");
  // Expert parallelism: the experts other ranks hold are absent from this rank's plan.
  moe.worldSize = 2;
  moe.tensorParallel = 2;
  moe.expertParallel = 2;
  firstDispatch(moe).weights = {0, 0, 0, -1, -1, -1};
  EXPECT_TRUE(LoadedPlan::fromBytes(buildPlan(moe), kSource).isOk());
}

// A sharded plan's all-reduce: one input (this rank's part) or none (it adds zeros), one output.
TEST(PlanLoader, AllReduceSum) {
  PlanSpec plan = minimalPlan();
  firstDispatch(plan) = dispatchOf(KernelId::AllReduceSum, KernelParams::CollectiveParams, {}, {1}, {2});
  EXPECT_TRUE(LoadedPlan::fromBytes(buildPlan(plan), kSource).isOk());
  firstDispatch(plan).inputs = {};
  EXPECT_TRUE(LoadedPlan::fromBytes(buildPlan(plan), kSource).isOk());
  firstDispatch(plan).inputs = {1, 1};
  EXPECT_CONTAINS(loadError(plan), "AllReduceSum takes 0 to 1 inputs and 1 output, the plan "
                                   "gives 2 and 1");
  firstDispatch(plan) = dispatchOf(KernelId::AllReduceSum, KernelParams::AddParams, {}, {1}, {2});
  EXPECT_CONTAINS(loadError(plan), "kernel AllReduceSum takes CollectiveParams, the plan gives "
                                   "AddParams");
}

// Context parallelism (plan format 1.4): values of other rows than the step's, their arena slots,
// and the gathers between them, only in a plan sharded for it.
TEST(PlanLoader, ContextParallelRowsAndGathers) {
  PlanSpec plan = minimalPlan();
  plan.worldSize = 2;
  plan.contextParallel = 2;
  plan.values[1].rows = ValueRows::ContextShard;
  firstDispatch(plan) = dispatchOf(KernelId::AllGatherRows, KernelParams::CollectiveParams, {},
                                   {1}, {2});
  firstDispatch(plan).group = CollectiveGroup::ContextParallel;
  EXPECT_TRUE(LoadedPlan::fromBytes(buildPlan(plan), kSource).isOk());
  firstDispatch(plan).tailRows = 3; // a KDA layer's conv tails
  EXPECT_TRUE(LoadedPlan::fromBytes(buildPlan(plan), kSource).isOk());

  PlanSpec negative = plan;
  firstDispatch(negative).tailRows = -1;
  EXPECT_CONTAINS(loadError(negative), "(AllGatherRows).params.tail_rows = -1 is negative");
  PlanSpec group = plan;
  firstDispatch(group).group = CollectiveGroup::TensorParallel;
  EXPECT_CONTAINS(loadError(group), "(AllGatherRows).params.group: AllGatherRows gathers over the "
                                    "ContextParallel group");
  PlanSpec backwards = plan;
  firstDispatch(backwards).inputs = {2};
  firstDispatch(backwards).outputs = {1};
  EXPECT_CONTAINS(loadError(backwards), "(AllGatherRows): gathers Step rows into ContextShard rows "
                                        "(ContextShard -> Step or ContextChunks -> "
                                        "AllContextChunks)");
  PlanSpec reduce = plan;
  firstDispatch(reduce) = dispatchOf(KernelId::AllReduceSum, KernelParams::CollectiveParams, {},
                                     {1}, {2});
  firstDispatch(reduce).group = CollectiveGroup::ContextParallel;
  EXPECT_CONTAINS(loadError(reduce), "(AllReduceSum).params.group: an all-reduce sums over the "
                                     "TensorParallel or ExpertParallel group");

  // Per-chunk values hold 2 (or 2 x context_parallel) rows: a slot sized for them fits.
  PlanSpec chunks = minimalPlan();
  chunks.worldSize = 2;
  chunks.contextParallel = 2;
  chunks.values.push_back({DType::F32, 100, 576, ValueRows::AllContextChunks}); // 4 rows
  chunks.arenaBytes = 576 + 4 * 100 * 4;
  EXPECT_TRUE(LoadedPlan::fromBytes(buildPlan(chunks), kSource).isOk());
  chunks.arenaBytes -= 4;
  EXPECT_CONTAINS(loadError(chunks), "values[3]: arena_offset 576 + 4 chunk rows x 100 F32 reaches "
                                     "past arena_bytes 2172");

  // Without context parallelism every value holds the step's rows, and there is no context group.
  PlanSpec unsharded = minimalPlan();
  unsharded.values[1].rows = ValueRows::ContextShard;
  EXPECT_CONTAINS(loadError(unsharded), "values[1].rows: ContextShard in a plan without context "
                                        "parallelism (target.context_parallel 1)");
  PlanSpec noGroup = minimalPlan();
  firstDispatch(noGroup) = dispatchOf(KernelId::AllGatherRows, KernelParams::CollectiveParams, {},
                                      {1}, {2});
  firstDispatch(noGroup).group = CollectiveGroup::ContextParallel;
  EXPECT_CONTAINS(loadError(noGroup), "(AllGatherRows).params.group: ContextParallel in a plan "
                                      "without context parallelism (target.context_parallel 1)");

  // Experts spread over the tensor ranks (the same tokens) or, with tensor_parallel 1, over the
  // context ranks (since 1.5), not over a number of ranks that is neither.
  PlanSpec experts = plan;
  experts.expertParallel = 2;
  EXPECT_TRUE(LoadedPlan::fromBytes(buildPlan(experts), kSource).isOk());
  experts.expertParallel = 4;
  EXPECT_CONTAINS(loadError(experts), "target: tensor_parallel 1 x context_parallel 2 must equal "
                                      "world_size 2, and expert_parallel 4 must be 1, "
                                      "tensor_parallel or (with tensor_parallel 1) "
                                      "context_parallel");
}

// Experts spread over the context ranks (plan format 1.5, cp=2 ep=2 tp=1): the prefill's
// MoeExperts on this rank's rows exchanges them (all_to_all), the decode's sums its part over the
// context group; neither anywhere else.
TEST(PlanLoader, ExpertsOverTheContextRanks) {
  PlanSpec prefill = minimalPlan();
  prefill.worldSize = 2;
  prefill.contextParallel = 2;
  prefill.expertParallel = 2;
  prefill.values = {{DType::I64, 1, 0, ValueRows::ContextShard},
                    {DType::F32, 16, 64, ValueRows::ContextShard},
                    {DType::F32, 16, 320, ValueRows::ContextShard}};
  firstDispatch(prefill) = dispatchOf(KernelId::MoeExperts, KernelParams::MoeParams,
                                      {0, 0, 0, -1, -1, -1}, {1, 1, 1}, {2});
  firstDispatch(prefill).allToAll = true;
  EXPECT_TRUE(LoadedPlan::fromBytes(buildPlan(prefill), kSource).isOk());
  PlanSpec partial = prefill; // a partial sum nothing completes
  firstDispatch(partial).allToAll = false;
  EXPECT_CONTAINS(loadError(partial), "(MoeExperts).params.all_to_all: MoeExperts on ContextShard "
                                      "rows with the experts spread over the context ranks must "
                                      "exchange its rows (all_to_all true)");
  PlanSpec tensorExperts = prefill; // tp=2 cp=2 ep=2: the experts over the tensor ranks
  tensorExperts.worldSize = 4;
  tensorExperts.tensorParallel = 2;
  EXPECT_CONTAINS(loadError(tensorExperts),
                  "(MoeExperts).params.all_to_all: only MoeExperts on ContextShard rows in a plan "
                  "whose experts are spread over the context ranks (expert_parallel = "
                  "context_parallel, tensor_parallel 1)");
  PlanSpec router = prefill;
  firstDispatch(router) =
      dispatchOf(KernelId::RouterTopK, KernelParams::MoeParams, {0, -1}, {1}, {2, 2});
  firstDispatch(router).allToAll = true;
  EXPECT_CONTAINS(loadError(router), "(RouterTopK).params.all_to_all: only MoeExperts");

  PlanSpec decode = minimalPlan();
  decode.programName = "decode";
  decode.worldSize = 2;
  decode.contextParallel = 2;
  decode.expertParallel = 2;
  firstDispatch(decode) = dispatchOf(KernelId::AllReduceSum, KernelParams::CollectiveParams, {},
                                     {1}, {2});
  firstDispatch(decode).group = CollectiveGroup::ContextParallel;
  EXPECT_TRUE(LoadedPlan::fromBytes(buildPlan(decode), kSource).isOk());
  PlanSpec onStepRows = decode; // the decode's rows: an all_to_all there is refused
  firstDispatch(onStepRows) = dispatchOf(KernelId::MoeExperts, KernelParams::MoeParams,
                                         {0, 0, 0, -1, -1, -1}, {1, 1, 1}, {2});
  firstDispatch(onStepRows).allToAll = true;
  EXPECT_CONTAINS(loadError(onStepRows), "(MoeExperts).params.all_to_all: only MoeExperts on "
                                         "ContextShard rows");
  PlanSpec shardRows = decode; // an all-reduce over the context ranks of rows they do not share
  shardRows.values[1].rows = ValueRows::ContextShard;
  shardRows.values[2].rows = ValueRows::ContextShard;
  EXPECT_CONTAINS(loadError(shardRows), "(AllReduceSum).params.group: an all-reduce sums over the "
                                        "TensorParallel or ExpertParallel group, or over "
                                        "ContextParallel the Step rows of a plan whose experts "
                                        "are spread over the context ranks");
}

TEST(PlanLoader, OperandCountsFollowTheKernelSignature) {
  PlanSpec mla = minimalPlan();
  firstDispatch(mla) =
      dispatchOf(KernelId::MlaDecode, KernelParams::MlaParams, kMlaRequiredOnly, {1, 1, 1});
  EXPECT_CONTAINS(loadError(mla), "(MlaDecode): MlaDecode takes 1 to 2 inputs and 1 output, the "
                                  "plan gives 3 and 1");
  PlanSpec outputs = minimalPlan();
  firstDispatch(outputs).outputs = {2, 2};
  EXPECT_CONTAINS(loadError(outputs), "Add takes 2 inputs and 1 output, the plan gives 2 and 2");
  PlanSpec attnRes = minimalPlan();
  firstDispatch(attnRes) =
      dispatchOf(KernelId::AttnRes, KernelParams::AttnResParams, {0, 1}, {}, {1});
  EXPECT_CONTAINS(loadError(attnRes), "AttnRes takes 1 or more inputs and 1 output, the plan "
                                      "gives 0 and 1");
}

TEST(PlanLoader, StreamsEventsAndLayers) {
  PlanSpec stream = minimalPlan();
  firstDispatch(stream).stream = 1;
  EXPECT_CONTAINS(loadError(stream), "(Add).stream = 1 is out of range [0, 1) of the streams");
  PlanSpec wait = minimalPlan();
  firstDispatch(wait).waitEvents = {0};
  EXPECT_CONTAINS(loadError(wait), "(Add).wait_events[0] = 0 is out of range [0, 0) of the events");
  PlanSpec signal = minimalPlan();
  signal.numEvents = 2;
  firstDispatch(signal).signalEvent = 2;
  EXPECT_CONTAINS(loadError(signal), "(Add).signal_event = 2 is out of range");
  PlanSpec layer = minimalPlan();
  firstDispatch(layer).layer = 2;
  EXPECT_CONTAINS(loadError(layer), "(Add).layer = 2 is out of range [0, 2) of the plan's layers");
  PlanSpec streams = minimalPlan();
  streams.numStreams = 0;
  EXPECT_CONTAINS(loadError(streams), "programs[0].num_streams = 0 must be positive");
}

TEST(PlanLoader, CacheSlots) {
  PlanSpec mla = minimalPlan();
  firstDispatch(mla) = dispatchOf(KernelId::MlaPrefill, KernelParams::MlaParams, kMlaRequiredOnly);
  EXPECT_TRUE(LoadedPlan::fromBytes(buildPlan(mla), kSource).isOk());
  firstDispatch(mla).kvSlot = 1;
  EXPECT_CONTAINS(loadError(mla), "(MlaPrefill).params.kv_slot = 1 is out of range [0, 1) of "
                                  "cache.kv");
  PlanSpec kda = minimalPlan();
  firstDispatch(kda) =
      dispatchOf(KernelId::KdaChunkPrefill, KernelParams::KdaParams, std::vector<int32_t>(16, 0));
  firstDispatch(kda).stateSlot = 3;
  EXPECT_CONTAINS(loadError(kda), "params.state_slot = 3 is out of range [0, 1) of "
                                  "cache.recurrent");
  PlanSpec pageSize = minimalPlan();
  pageSize.pageSize = 0;
  EXPECT_CONTAINS(loadError(pageSize), "cache.page_size = 0 must be positive");
  PlanSpec kvLayer = minimalPlan();
  kvLayer.kv[0].layer = 5;
  EXPECT_CONTAINS(loadError(kvLayer), "cache.kv[0].layer = 5 is out of range");
  PlanSpec conv = minimalPlan();
  conv.recurrent[0].convKernel = 0;
  EXPECT_CONTAINS(loadError(conv), "cache.recurrent[0].conv_kernel = 0 must be positive");
}

TEST(PlanLoader, StepsAndCopies) {
  PlanSpec empty = minimalPlan();
  empty.steps.push_back({});
  EXPECT_CONTAINS(loadError(empty), "programs[0].steps[1].op: missing or unknown step type 0");
  PlanSpec copy = minimalPlan();
  copy.steps.push_back({std::nullopt, CopySpec{1, 3, 0}});
  EXPECT_CONTAINS(loadError(copy), "programs[0].steps[1].destination = 3 is out of range");
  PlanSpec mismatch = minimalPlan();
  mismatch.steps.push_back({std::nullopt, CopySpec{0, 1, 0}});
  EXPECT_CONTAINS(loadError(mismatch), "programs[0].steps[1]: copies a I64 value of 1 elements "
                                       "per row into a F32 value of 16");
  PlanSpec addArity = minimalPlan();
  firstDispatch(addArity).inputs = {1};
  EXPECT_CONTAINS(loadError(addArity), "Add takes 2 inputs and 1 output");
}

TEST(PlanLoader, WeightTable) {
  PlanSpec size = minimalPlan();
  size.weights[1].size = 31;
  EXPECT_CONTAINS(loadError(size), "weights[1] 'w1'.size = 31 but BF16 [16] needs 32 bytes");
  PlanSpec dtype = minimalPlan();
  dtype.weights[0].dtype = static_cast<DType>(42);
  EXPECT_CONTAINS(loadError(dtype), "weights[0] 'w0'.dtype has the unknown value 42");
  PlanSpec duplicate = minimalPlan();
  duplicate.weights[1].name = "w0";
  EXPECT_CONTAINS(loadError(duplicate), "weights[1] 'w0': duplicate weight name");
  PlanSpec scale = minimalPlan();
  scale.weights[0].scale = 2;
  EXPECT_CONTAINS(loadError(scale), "weights[0] 'w0'.scale = 2 is out of range [0, 2)");
  PlanSpec quant = minimalPlan();
  quant.weights[0].quant = QuantKind::Fp8Block;
  quant.weights[0].block = {128, 128};
  EXPECT_CONTAINS(loadError(quant), "weights[0] 'w0'.scale: quant Fp8Block needs a scale weight");
  quant.weights[0].scale = 1;
  EXPECT_TRUE(LoadedPlan::fromBytes(buildPlan(quant), kSource).isOk());
  quant.fp8ActivationScale = Fp8ActivationScale::Ue8m0;
  EXPECT_TRUE(LoadedPlan::fromBytes(buildPlan(quant), kSource).isOk());
  quant.fp8ActivationScale = static_cast<Fp8ActivationScale>(9);
  EXPECT_CONTAINS(loadError(quant), "fp8_activation_scale has the unknown value 9");
  PlanSpec key = minimalPlan();
  key.archiveKey = "not-hex";
  EXPECT_CONTAINS(loadError(key), "weight_archive_key: 'not-hex' is not 32 hex digits");
  PlanSpec negative = minimalPlan();
  negative.weights[1].shape = {-16};
  EXPECT_CONTAINS(loadError(negative), "weights[1] 'w1'.shape[0] = -16 is negative");
}

TEST(PlanLoader, ProgramNames) {
  PlanSpec unnamed = minimalPlan();
  unnamed.programName = "";
  EXPECT_CONTAINS(loadError(unnamed), "programs[0].name: missing");
}

//===------------------------------------------------------------------------------------------===//
// checkTarget.
//===------------------------------------------------------------------------------------------===//

TEST(PlanTarget, MatchingTargetPasses) {
  EXPECT_TRUE(checkTarget(loadOrDie(minimalPlan()), "cpu", 1).isOk());
  PlanSpec cuda = minimalPlan();
  cuda.device = "cuda";
  cuda.arch = "sm_90a";
  cuda.worldSize = 8;
  cuda.tensorParallel = 8;
  LoadedPlan plan = loadOrDie(cuda);
  EXPECT_TRUE(checkTarget(plan, "cuda", 8, "sm_90a").isOk());
  EXPECT_TRUE(checkTarget(plan, "cuda", 8).isOk()); // arch not compared
}

TEST(PlanTarget, OtherDeviceArchOrWorldSizeRefused) {
  PlanSpec cuda = minimalPlan();
  cuda.device = "cuda";
  cuda.arch = "sm_90a";
  LoadedPlan plan = loadOrDie(cuda);
  Status device = checkTarget(plan, "cpu", 1);
  EXPECT_EQ(device.message(),
            "test.hyplan was compiled for cuda sm_90a, this runtime device is cpu");
  Status arch = checkTarget(plan, "cuda", 1, "sm_100a");
  EXPECT_EQ(arch.message(),
            "test.hyplan was compiled for cuda sm_90a, this runtime device is cuda sm_100a");

  LoadedPlan cpu = loadOrDie(minimalPlan());
  EXPECT_EQ(checkTarget(cpu, "cuda", 1, "sm_90a").message(),
            "test.hyplan was compiled for cpu, this runtime device is cuda sm_90a");
  EXPECT_EQ(checkTarget(cpu, "cpu", 4).message(),
            "test.hyplan was compiled for world size 1 (tensor_parallel 1, expert_parallel 1, "
            "context_parallel 1), this runtime runs 4 ranks");
}

// A sharded plan (--hybrid-shard) is refused by a world of another size or another rank, with
// both named; its layout must add up.
TEST(PlanTarget, ShardedPlanNeedsItsWorldAndRank) {
  PlanSpec sharded = minimalPlan();
  sharded.worldSize = 2;
  sharded.rank = 1;
  sharded.tensorParallel = 2;
  sharded.expertParallel = 2;
  LoadedPlan plan = loadOrDie(sharded);
  EXPECT_TRUE(checkTarget(plan, "cpu", 2).isOk());
  EXPECT_TRUE(checkRank(plan, 1).isOk());
  EXPECT_EQ(checkTarget(plan, "cpu", 1).message(),
            "test.hyplan was compiled for world size 2 (tensor_parallel 2, expert_parallel 2, "
            "context_parallel 1), this runtime runs 1 rank");
  EXPECT_EQ(checkTarget(plan, "cpu", 4).message(),
            "test.hyplan was compiled for world size 2 (tensor_parallel 2, expert_parallel 2, "
            "context_parallel 1), this runtime runs 4 ranks");
  EXPECT_EQ(checkRank(plan, 0).message(),
            "test.hyplan is rank 1's plan of 2 (tensor_parallel 2, expert_parallel 2, "
            "context_parallel 1), this communicator's rank is 0");

  PlanSpec uneven = sharded;
  uneven.tensorParallel = 3;
  EXPECT_CONTAINS(loadError(uneven), "target: tensor_parallel 3 x context_parallel 1 must equal "
                                     "world_size 2, and expert_parallel 2 must be 1, "
                                     "tensor_parallel or (with tensor_parallel 1) "
                                     "context_parallel");
  PlanSpec outside = sharded;
  outside.rank = 2;
  EXPECT_CONTAINS(loadError(outside), "target.rank: 2 is outside the world of 2 ranks");
}

//===------------------------------------------------------------------------------------------===//
// checkWeights.
//===------------------------------------------------------------------------------------------===//

class PlanWeightsTest : public testing::Test {
protected:
  void SetUp() override {
    std::string pattern = (fs::path(testing::TempDir()) / "hybrid_plan_weights_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr) << pattern;
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  // An archive with key `keyHex` holding `weights` in order (by default the minimal plan's:
  // w0 F32 [16, 16], w1 BF16 [16]).
  WeightArchive writeArchive(const std::string &keyHex,
                             std::vector<WeightSpec> weights = minimalPlan().weights) {
    std::string path = (fs::path(dir_) / ("w" + std::to_string(counter_++) + ".hyw")).string();
    StatusOr<WeightArchiveWriter> writer =
        WeightArchiveWriter::create(path, *parseArchiveKey(keyHex));
    EXPECT_TRUE(writer.isOk());
    for (const WeightSpec &weight : weights)
      EXPECT_TRUE(writer
                      ->add(weight.name, weight.dtype, weight.shape,
                            std::vector<std::byte>(weight.size, std::byte{1}))
                      .isOk());
    EXPECT_TRUE(writer->finish().isOk());
    StatusOr<WeightArchive> archive = WeightArchive::open(path);
    EXPECT_TRUE(archive.isOk()) << archive.status().message();
    return std::move(archive).value();
  }

  std::string dir_;
  int counter_ = 0;
};

TEST_F(PlanWeightsTest, MatchingArchivePasses) {
  WeightArchive archive = writeArchive(kArchiveKeyHex);
  Status status = checkWeights(loadOrDie(minimalPlan()), archive);
  EXPECT_TRUE(status.isOk()) << status.message();

  // weight_archive_bytes is where the last weight's data ends (the entry table follows).
  PlanSpec withSize = minimalPlan();
  for (const WeightArchiveEntry &entry : archive.entries())
    withSize.archiveBytes = std::max(withSize.archiveBytes, entry.offset + entry.size);
  Status sized = checkWeights(loadOrDie(withSize), archive);
  EXPECT_TRUE(sized.isOk()) << sized.message();
}

TEST_F(PlanWeightsTest, KeyMismatch) {
  WeightArchive archive = writeArchive("ffffffffffffffffffffffffffffffff");
  Status status = checkWeights(loadOrDie(minimalPlan()), archive);
  EXPECT_CONTAINS(status.message(), "test.hyplan reads the weight archive with key '" +
                                        kArchiveKeyHex + "' but " + archive.path() +
                                        " has key ffffffffffffffffffffffffffffffff");
}

TEST_F(PlanWeightsTest, ArchiveSizeMismatch) {
  WeightArchive archive = writeArchive(kArchiveKeyHex);
  PlanSpec spec = minimalPlan();
  spec.archiveBytes = archive.fileSize() + 1;
  EXPECT_CONTAINS(checkWeights(loadOrDie(spec), archive).message(), "weight_archive_bytes = ");
}

TEST_F(PlanWeightsTest, EntryMismatches) {
  LoadedPlan plan = loadOrDie(minimalPlan());

  std::vector<WeightSpec> missing = {minimalPlan().weights[0]};
  EXPECT_CONTAINS(checkWeights(plan, writeArchive(kArchiveKeyHex, missing)).message(),
                  "weights[1] 'w1': not in the archive");

  std::vector<WeightSpec> dtype = minimalPlan().weights;
  dtype[1].dtype = DType::F16;
  EXPECT_CONTAINS(checkWeights(plan, writeArchive(kArchiveKeyHex, dtype)).message(),
                  "weights[1] 'w1': dtype BF16 but the archive has F16");

  std::vector<WeightSpec> shape = minimalPlan().weights;
  shape[0].shape = {256};
  EXPECT_CONTAINS(checkWeights(plan, writeArchive(kArchiveKeyHex, shape)).message(),
                  "weights[0] 'w0': shape [16, 16] but the archive has [256]");

  // w1 written first: both land at other offsets than the plan says.
  std::vector<WeightSpec> order = {minimalPlan().weights[1], minimalPlan().weights[0]};
  Status moved = checkWeights(plan, writeArchive(kArchiveKeyHex, order));
  EXPECT_CONTAINS(moved.message(), "weights[0] 'w0': offset 4096 but the archive has 8192");
  EXPECT_EQ(moved.message().rfind("test.hyplan and " + dir_, 0), 0u) << moved.message();
}

} // namespace
} // namespace hybrid
