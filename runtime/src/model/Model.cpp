#include "hybrid/runtime/Model.h"

#include "PrefixCache.h"

#include "cpu/CpuExecutor.h"
#ifdef HYBRID_HAS_CUDA_DEVICE
#include "cuda/CudaExecutor.h"
#endif
#include "hybrid/runtime/Communicator.h"
#include "hybrid/runtime/Memory.h"
#include "hybrid/runtime/Plan.h"
#include "hybrid/runtime/Safetensors.h"
#include "hybrid/runtime/WeightArchive.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>

namespace hybrid {
namespace fb = plan::fb;

namespace {

double secondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A program and the arena its values live in (allocated once, at load).
struct ProgramRunner {
  const fb::Program *program = nullptr;
  Arena arena;
  std::vector<int64_t> dsaTopKs; // each DSA layer's top_k, for Usage's sparse-attention counts
  bool contextParallel = false;  // a context-parallel prefill: values of this rank's rows
};

// Converts one archive entry to fp32; FP8 block-quantized weights are dequantized with their
// block scales (W[i, j] = fp8[i, j] * scale[i / block0, j / block1]).
// A synthetic entry's values are generated first (into a buffer of this entry's size only).
StatusOr<std::vector<float>> toFloat(const WeightArchive &archive, const fb::Plan &plan,
                                     int32_t index, WeightGeneration &generation) {
  const fb::Weight *weight = plan.weights()->Get(index);
  const WeightArchiveEntry *entry = archive.find(weight->name()->string_view());
  if (!entry)
    return Status::error("weight '" + weight->name()->str() + "' is not in the archive");
  std::span<const std::byte> bytes = archive.bytes(*entry);
  std::vector<std::byte> generated;
  if (entry->synthetic) {
    const auto start = std::chrono::steady_clock::now();
    generated.resize(entry->size);
    kernels::ref::fillSynthetic(syntheticFill(*entry), generated.data());
    bytes = generated;
    generation.hostBytes += entry->size;
    generation.hostSeconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const size_t count = bytes.size() / dtypeByteSize(entry->dtype);
  std::vector<float> values(count);
  auto load16 = [&](size_t i) {
    uint16_t bits;
    std::memcpy(&bits, bytes.data() + 2 * i, 2);
    return bits;
  };
  switch (entry->dtype) {
  case fb::DType::F32:
    std::memcpy(values.data(), bytes.data(), count * 4);
    break;
  case fb::DType::BF16:
    for (size_t i = 0; i < count; ++i)
      values[i] = safetensors::bf16ToFloat(load16(i));
    break;
  case fb::DType::F16:
    for (size_t i = 0; i < count; ++i)
      values[i] = safetensors::f16ToFloat(load16(i));
    break;
  case fb::DType::F8_E4M3:
    for (size_t i = 0; i < count; ++i)
      values[i] = safetensors::f8e4m3ToFloat(static_cast<uint8_t>(bytes[i]));
    break;
  default:
    return Status::error("weight '" + weight->name()->str() + "' has dtype " +
                         fb::EnumNameDType(entry->dtype) + ", which the cpu device cannot use");
  }
  if (weight->quant() != fb::QuantKind::Fp8Block)
    return values;

  if (!weight->shape() || weight->shape()->size() != 2 || !weight->block() ||
      weight->block()->size() != 2 || weight->scale() < 0)
    return Status::error("fp8 weight '" + weight->name()->str() +
                         "' needs a 2-D shape, a 2-D block and a scale");
  HYBRID_ASSIGN_OR_RETURN(std::vector<float> scales,
                          toFloat(archive, plan, weight->scale(), generation));
  const int64_t rows = weight->shape()->Get(0), cols = weight->shape()->Get(1);
  const int64_t blockRows = weight->block()->Get(0), blockCols = weight->block()->Get(1);
  const int64_t scaleCols = (cols + blockCols - 1) / blockCols;
  if (static_cast<int64_t>(scales.size()) != ((rows + blockRows - 1) / blockRows) * scaleCols)
    return Status::error("fp8 weight '" + weight->name()->str() +
                         "': the scale grid does not match its blocks");
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      values[i * cols + j] *= scales[(i / blockRows) * scaleCols + j / blockCols];
  return values;
}

} // namespace

// An execution order of the program's steps: program order, or a random interleaving of its
// streams in which every step still follows its stream's earlier steps and the latest earlier
// signal of each event it waits for.
std::vector<size_t> stepOrder(const fb::Program &program, uint64_t seed) {
  const auto *steps = program.steps();
  const size_t n = steps ? steps->size() : 0;
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i)
    order[i] = i;
  if (seed == 0 || n == 0)
    return order;

  std::vector<std::vector<size_t>> queues;    // per stream, in program order
  std::vector<std::vector<size_t>> waitsFor(n); // signalling steps each step waits for
  std::vector<int64_t> lastSignal;
  for (size_t i = 0; i < n; ++i) {
    const fb::Dispatch *dispatch = steps->Get(i)->op_as_Dispatch();
    const size_t stream = dispatch ? static_cast<size_t>(std::max(0, dispatch->stream())) : 0;
    if (queues.size() <= stream)
      queues.resize(stream + 1);
    queues[stream].push_back(i);
    if (!dispatch)
      continue;
    if (dispatch->wait_events())
      for (int32_t event : *dispatch->wait_events())
        if (event >= 0 && static_cast<size_t>(event) < lastSignal.size() &&
            lastSignal[event] >= 0)
          waitsFor[i].push_back(static_cast<size_t>(lastSignal[event]));
    if (dispatch->signal_event() >= 0) {
      if (lastSignal.size() <= static_cast<size_t>(dispatch->signal_event()))
        lastSignal.resize(dispatch->signal_event() + 1, -1);
      lastSignal[dispatch->signal_event()] = static_cast<int64_t>(i);
    }
  }
  std::mt19937_64 random(seed);
  std::vector<bool> done(n, false);
  std::vector<size_t> head(queues.size(), 0);
  order.clear();
  while (order.size() < n) {
    std::vector<size_t> ready;
    for (size_t q = 0; q < queues.size(); ++q) {
      if (head[q] == queues[q].size())
        continue;
      const size_t step = queues[q][head[q]];
      if (std::all_of(waitsFor[step].begin(), waitsFor[step].end(),
                      [&](size_t s) { return done[s]; }))
        ready.push_back(q);
    }
    if (ready.empty()) // a wait on a later signal: the loader rejects such plans; stay in order
      return stepOrder(program, 0);
    const size_t q = ready[std::uniform_int_distribution<size_t>(0, ready.size() - 1)(random)];
    const size_t step = queues[q][head[q]++];
    done[step] = true;
    order.push_back(step);
  }
  return order;
}

// Optional parts of a program run: the first row's position (-1: the sequence's length), rows
// for the program's hidden_input (the mtp program: from the host, or from a hidden-state record
// of the device's), and where to copy the final hidden state (the last layer_outputs entry) of
// every row on the host.
struct RunExtras {
  int64_t firstPosition = -1;
  bool lastRowLogits = false; // logitsOut receives the last row's logits only
  // A decode step whose device chooses each row's token (the cuda device): chosenOut [rows]
  // receives them by `choices`, and logitsOut is not written.
  std::span<const TokenChoice> choices = {};
  int64_t *chosenOut = nullptr;
  const float *hiddenInput = nullptr;
  int32_t hiddenRecord = -1; // with hiddenRecordFirst: rows [first, + rows) of that record
  int64_t hiddenRecordFirst = 0;
  float *finalHiddenOut = nullptr;
  int64_t chainStep = -1; // >= 0: step of a Model::decodeSteps chain (the cuda device)
};

// The rows whose logits a run returns: every row (empty), or with lastRowLogits the last row of
// the step, or of each segment of a batched one.
static std::vector<int64_t> logitRowsOf(int64_t rows, std::span<const cpu::BatchRow> batch,
                                        const RunExtras &extras) {
  if (!extras.lastRowLogits)
    return {};
  if (batch.empty())
    return {rows - 1};
  std::vector<int64_t> last;
  int64_t end = 0;
  for (const cpu::BatchRow &segment : batch)
    last.push_back((end += segment.rows) - 1);
  return last;
}

struct Model::Impl {
  std::string dir;
  // Usage's sparse-attention counters (read by other threads, e.g. a server's /metrics).
  std::atomic<uint64_t> sparseSelected{0}, sparseContext{0};
  std::atomic<uint64_t> indexerPairs{0}; // (query, key) pairs this rank's DSA indexers scored
  cpu::ParallelLayout layout;            // the plan's, for its collectives' groups
  void countSparseAttention(const ProgramRunner &runner, int64_t rows, int64_t firstPosition,
                            std::span<const cpu::BatchRow> batch);
  LoadOptions options;
  LoadedPlan plan;
  WeightArchive archive;
  std::vector<std::vector<float>> weights; // fp32, per plan weight index, as stored
  std::vector<cpu::WeightLayout> weightLayouts;
  PagedKvCache kvCache;
  RecurrentStatePool states;
  std::vector<bool> kvSequenceInUse;
  ProgramRunner prefill;
  ProgramRunner decode;
  ProgramRunner mtp;     // the multi-token-prediction layer, when the plan has one
  int32_t mtpKvSlot = -1; // its attention's KV cache layer
  std::vector<std::vector<float>> kvStaging;
  cpu::BatchScratch batchScratch; // decodeBatch's per-row runs of per-sequence kernels
  PrefixCache prefixCache{0, 1};
  WeightGeneration generation; // a synthetic archive's, at load
  LoadTimings timings;
  VerifyTimings verifyTimings;
  // Hidden-state records (Sequence::mainRecord, chainRecord) [rows, hidden] on the cpu device;
  // the cuda device keeps its own on the GPU.
  std::map<int32_t, std::vector<float>> hostRecords;
#ifdef HYBRID_HAS_CUDA_DEVICE
  // The cuda device; the members above still serve the dispatches it runs on the cpu reference.
  std::unique_ptr<cudadev::CudaExecutor> cuda;
#endif

  Impl(std::string dir, LoadOptions options, LoadedPlan plan, WeightArchive archive,
       PagedKvCache kvCache, RecurrentStatePool states)
      : dir(std::move(dir)), options(std::move(options)), plan(std::move(plan)),
        archive(std::move(archive)), kvCache(std::move(kvCache)), states(std::move(states)) {}

  // Runs `runner`'s program over `tokens` (at most max_tokens of them) for one sequence, or with
  // a `batch`, row r for batch[r]'s sequence (decode steps; `sequence` is then batch[0]'s).
  Status run(ProgramRunner &runner, Sequence &sequence, int32_t kvSequence, int32_t stateSlot,
             std::span<const int64_t> tokens, bool decodeStep, float *logitsOut,
             HiddenStates *hidden, cpu::KdaReplayLog *kdaLog = nullptr,
             std::span<const cpu::BatchRow> batch = {}, const RunExtras &extras = {});
  // Copies rows [srcRow, + rows) of the final hidden state the last run of `program` left to
  // rows [destRow, + rows) of hidden-state record `record`, on the device that ran it.
  Status recordFinalHidden(const fb::Program &program, int64_t srcRow, int64_t rows,
                           int32_t record, int64_t destRow);
  ProgramRunner *runnerOf(const fb::Program &program) {
    for (ProgramRunner *runner : {&prefill, &decode, &mtp})
      if (runner->program == &program)
        return runner;
    return nullptr;
  }
};

Status Model::Impl::recordFinalHidden(const fb::Program &program, int64_t srcRow, int64_t rows,
                                      int32_t record, int64_t destRow) {
#ifdef HYBRID_HAS_CUDA_DEVICE
  if (cuda)
    return cuda->recordFinalHidden(program, srcRow, rows, record, destRow);
#endif
  ProgramRunner *runner = runnerOf(program);
  const auto *outputs = program.layer_outputs();
  if (!runner || !outputs || outputs->size() == 0)
    return Status::error(dir + "/plan.hyplan: program '" + program.name()->str() +
                         "' has no final hidden state to record");
  const auto width = static_cast<uint64_t>(plan->hidden_size());
  const fb::Value *value = program.values()->Get(outputs->Get(outputs->size() - 1));
  HYBRID_ASSIGN_OR_RETURN(std::span<float> final,
                          runner->arena.viewAs<float>(value->arena_offset(),
                                                      static_cast<uint64_t>(srcRow + rows) * width));
  std::vector<float> &rowsOut = hostRecords[record];
  rowsOut.resize(static_cast<size_t>((destRow + rows) * static_cast<int64_t>(width)));
  std::copy(final.begin() + static_cast<std::ptrdiff_t>(srcRow * static_cast<int64_t>(width)),
            final.end(), rowsOut.begin() + static_cast<std::ptrdiff_t>(destRow * static_cast<int64_t>(width)));
  return Status::ok();
}

Status Model::Impl::run(ProgramRunner &runner, Sequence &sequence, int32_t kvSequence,
                        int32_t stateSlot, std::span<const int64_t> tokens, bool decodeStep,
                        float *logitsOut, HiddenStates *hidden, cpu::KdaReplayLog *kdaLog,
                        std::span<const cpu::BatchRow> batch, const RunExtras &extras) {
  const fb::Program *program = runner.program;
  const int64_t rows = static_cast<int64_t>(tokens.size());
  cpu::StepContext context;
  context.program = program;
  context.arena = &runner.arena;
  context.weights = &weights;
  context.weightLayouts = &weightLayouts;
  context.kvCache = &kvCache;
  context.cacheSpec = plan->cache();
  context.states = &states;
  context.kvStaging = &kvStaging;
  context.kvSequence = kvSequence;
  context.stateSlot = stateSlot;
  context.rows = rows;
  context.firstPosition = extras.firstPosition >= 0 ? extras.firstPosition : sequence.length();
  context.decode = decodeStep;
  context.kdaLog = kdaLog;
  context.communicator = options.communicator;
  context.layout = layout;
  context.indexerPairs = &indexerPairs;
  // A context-parallel prefill: this rank runs its zigzag share of the step's rows.
  cpu::ContextShard shard;
  if (runner.contextParallel) {
    if (!batch.empty() || kdaLog || extras.hiddenInput || extras.finalHiddenOut)
      return Status::error(dir + ": a context-parallel prefill runs whole prompts of one "
                                 "sequence (no batched rows, KDA replay logs or hidden inputs)");
    const int tp = std::max(1, layout.tensorParallel);
    shard = cpu::ContextShard::of(options.communicator->rank() / tp, layout.contextParallel, rows);
    context.contextShard = &shard;
    context.rows = static_cast<int64_t>(shard.rows.size());
  }
  for (auto &rowsOfSlot : kvStaging)
    rowsOfSlot.clear();
  countSparseAttention(runner, rows, context.firstPosition, batch);
  if (!batch.empty()) {
    if (batchScratch.rowArena.size() < program->arena_bytes()) {
      HYBRID_ASSIGN_OR_RETURN(batchScratch.rowArena, Arena::create(program->arena_bytes()));
    }
    batchScratch.staging.assign(batch.size(),
                                std::vector<std::vector<float>>(kvStaging.size()));
    context.batch = batch;
    context.batchScratch = &batchScratch;
  }

  const auto *layerOutputs = program->layer_outputs();
  if (extras.finalHiddenOut && (!layerOutputs || layerOutputs->size() == 0))
    return Status::error(dir + "/plan.hyplan: program '" + program->name()->str() +
                         "' has no layer_outputs to take final hidden states from");
  const size_t width = static_cast<size_t>(plan->hidden_size());
  if (program->hidden_input() >= 0 && !extras.hiddenInput && extras.hiddenRecord < 0)
    return Status::error("program '" + program->name()->str() +
                         "' reads hidden states, none were given");
#ifdef HYBRID_HAS_CUDA_DEVICE
  if (cuda) {
    if (program->hidden_input() >= 0)
      HYBRID_RETURN_IF_ERROR(extras.hiddenInput
                                 ? cuda->setHiddenInput(*program, extras.hiddenInput, rows)
                                 : cuda->setHiddenInput(*program, extras.hiddenRecord,
                                                        extras.hiddenRecordFirst, rows));
    if (extras.chainStep >= 0)
      return cuda->runChoosingChained(context, tokens, extras.choices, extras.chainStep);
    if (extras.chosenOut && !extras.finalHiddenOut && !hidden)
      return cuda->runChoosing(context, tokens, extras.choices, extras.chosenOut);
    HYBRID_RETURN_IF_ERROR(
        cuda->run(context, tokens, logitsOut, hidden, logitRowsOf(rows, batch, extras)));
    if (extras.finalHiddenOut)
      HYBRID_RETURN_IF_ERROR(cuda->downloadFinalHidden(*program, rows, extras.finalHiddenOut));
    return Status::ok();
  }
#endif
  const fb::Value *ids = program->values()->Get(program->token_ids());
  HYBRID_ASSIGN_OR_RETURN(std::span<int64_t> idSlot,
                          runner.arena.viewAs<int64_t>(ids->arena_offset(), context.rows));
  if (context.contextShard)
    for (size_t i = 0; i < shard.rows.size(); ++i)
      idSlot[i] = tokens[static_cast<size_t>(shard.rows[i])];
  else
    std::copy(tokens.begin(), tokens.end(), idSlot.begin());
  if (program->hidden_input() >= 0) {
    const float *source = extras.hiddenInput;
    if (!source) {
      const auto found = hostRecords.find(extras.hiddenRecord);
      if (found == hostRecords.end() ||
          found->second.size() < static_cast<size_t>(extras.hiddenRecordFirst + rows) * width)
        return Status::error("hidden-state record " + std::to_string(extras.hiddenRecord) +
                             " holds no rows [" + std::to_string(extras.hiddenRecordFirst) +
                             ", " + std::to_string(extras.hiddenRecordFirst + rows) + ")");
      source = found->second.data() + static_cast<size_t>(extras.hiddenRecordFirst) * width;
    }
    const fb::Value *slot = program->values()->Get(program->hidden_input());
    HYBRID_ASSIGN_OR_RETURN(std::span<float> hiddenSlot,
                            runner.arena.viewAs<float>(slot->arena_offset(),
                                                       static_cast<uint64_t>(rows) * width));
    std::copy_n(source, hiddenSlot.size(), hiddenSlot.begin());
  }

  for (size_t index : stepOrder(*program, options.scheduleSeed)) {
    const fb::Dispatch *dispatch = program->steps()->Get(index)->op_as_Dispatch();
    if (!dispatch)
      return Status::error(dir + "/plan.hyplan: program '" + program->name()->str() +
                           "' has a step the cpu device does not run");
    HYBRID_RETURN_IF_ERROR(cpu::runStepDispatch(context, *dispatch));
    if (!hidden || !layerOutputs)
      continue;
    // Copy out the residual stream right after the step that makes it (its slot is reused).
    for (int32_t output : *dispatch->outputs())
      for (size_t i = 0; i < layerOutputs->size(); ++i) {
        if (layerOutputs->Get(i) != output)
          continue;
        HYBRID_ASSIGN_OR_RETURN(std::span<float> values, cpu::floatValue(context, output));
        if (context.contextShard) { // this rank's rows: every rank's, in position order
          HYBRID_ASSIGN_OR_RETURN(std::vector<float> all,
                                  cpu::gatherContextRows(context, values, int64_t(width)));
          hidden->layers[i].insert(hidden->layers[i].end(), all.begin(), all.end());
          continue;
        }
        hidden->layers[i].insert(hidden->layers[i].end(), values.begin(), values.end());
      }
  }
  HYBRID_ASSIGN_OR_RETURN(std::span<float> logits, cpu::floatValue(context, program->logits()));
  const std::vector<int64_t> logitRows = logitRowsOf(rows, batch, extras);
  const size_t vocab = logits.size() / static_cast<size_t>(rows);
  if (logitRows.empty())
    std::copy(logits.begin(), logits.end(), logitsOut);
  for (size_t i = 0; i < logitRows.size(); ++i)
    std::copy_n(logits.begin() + static_cast<std::ptrdiff_t>(logitRows[i] * int64_t(vocab)), vocab,
                logitsOut + i * vocab);
  if (extras.finalHiddenOut) {
    HYBRID_ASSIGN_OR_RETURN(std::span<float> final,
                            cpu::floatValue(context, layerOutputs->Get(layerOutputs->size() - 1)));
    std::copy(final.begin(), final.end(), extras.finalHiddenOut);
  }
  return Status::ok();
}

#ifdef HYBRID_HAS_CUDA_DEVICE
constexpr const char *kDevices = "cpu, cuda";
#else
constexpr const char *kDevices = "cpu";
#endif

std::vector<LoadTimings::Phase> LoadTimings::phases() const {
  std::vector<Phase> all = {{"plan", planSeconds},
                            {"verify weights", verifyWeightsSeconds},
                            {"host pools", hostPoolsSeconds},
                            {"host weights", hostWeightsSeconds},
                            {"cuda init", cudaInitSeconds},
                            {"weight buffer", weightBufferSeconds},
                            {"weights", weightsSeconds},
                            {"kv pools", kvPoolsSeconds},
                            {"kernel setup", kernelSetupSeconds},
                            {"device pools", devicePoolsSeconds},
                            {"streams", streamsSeconds}};
  std::erase_if(all, [](const Phase &phase) { return phase.seconds <= 0; });
  return all;
}

std::string LoadTimings::summary() const {
  auto format = [](double seconds) {
    char text[32];
    std::snprintf(text, sizeof text, "%.3f", seconds);
    return std::string(text);
  };
  std::string text = format(totalSeconds) + " s (";
  double phased = 0;
  for (const Phase &phase : phases()) {
    text += std::string(phase.name) + " " + format(phase.seconds) + ", ";
    phased += phase.seconds;
  }
  return text + "other " + format(std::max(0.0, totalSeconds - phased)) + ")";
}

StatusOr<std::unique_ptr<Model>> Model::load(const std::string &dir, const LoadOptions &options) {
  const auto loadStart = std::chrono::steady_clock::now();
  LoadTimings timings;
  const bool cudaDevice = options.device == "cuda";
#ifdef HYBRID_HAS_CUDA_DEVICE
  if (options.device != "cpu" && !cudaDevice)
#else
  if (options.device != "cpu")
#endif
    return Status::error("device '" + options.device +
                         "' is not available in this build (available: " + kDevices + ")");
  // A sharded model has a plan per rank; a plan of another world is loaded anyway when it is
  // the only one there, so the refusal can say which layout it was compiled for.
  const int worldSize = options.communicator ? options.communicator->worldSize() : 1;
  const int rank = options.communicator ? options.communicator->rank() : 0;
  std::string planName = planFileName(rank, worldSize);
  if (!std::filesystem::exists(dir + "/" + planName))
    for (const std::string &other : {planFileName(0, 1), planFileName(0, 2)})
      if (std::filesystem::exists(dir + "/" + other))
        planName = other;
  auto phaseStart = std::chrono::steady_clock::now();
  HYBRID_ASSIGN_OR_RETURN(LoadedPlan plan, LoadedPlan::load(dir + "/" + planName));
  HYBRID_RETURN_IF_ERROR(checkTarget(plan, options.device, worldSize));
  HYBRID_RETURN_IF_ERROR(checkRank(plan, rank));
  if (options.communicator && options.communicator->deviceBuffers() && !cudaDevice)
    return Status::error("the " + options.communicator->backend() +
                         " communicator takes device buffers (the cuda device's); the cpu device "
                         "needs a host one (loopback, tcp)");
  HYBRID_ASSIGN_OR_RETURN(WeightArchive archive,
                          WeightArchive::open(dir + "/" + archiveFileName(rank, worldSize)));
  HYBRID_RETURN_IF_ERROR(checkWeights(plan, archive));
  timings.planSeconds = secondsSince(phaseStart);
  if (archive.synthetic() && !options.syntheticWeights)
    return Status::error(archive.path() + " holds synthetic weights (hybrid-compile "
                                          "--synthetic-weights): load it with syntheticWeights "
                                          "(hybrid-run --synthetic-weights) to generate them");
  if (options.syntheticWeights && !archive.synthetic())
    return Status::error(archive.path() + " holds real weights; syntheticWeights "
                                          "(--synthetic-weights) is for archives compiled with "
                                          "hybrid-compile --synthetic-weights");
  if (options.verifyWeightContents) {
    phaseStart = std::chrono::steady_clock::now();
    HYBRID_RETURN_IF_ERROR(archive.verifyContents());
    timings.verifyWeightsSeconds = secondsSince(phaseStart);
  }
  if (options.maxSequences < 1 || options.maxContextTokens < 1)
    return Status::error("maxSequences and maxContextTokens must be positive");
  if (options.prefixCacheEntries < 0 || options.prefixCacheBlockTokens < 1)
    return Status::error("prefixCacheEntries (" + std::to_string(options.prefixCacheEntries) +
                         ") must not be negative and prefixCacheBlockTokens (" +
                         std::to_string(options.prefixCacheBlockTokens) + ") must be positive");
  if (options.kdaBf16State && !cudaDevice)
    return Status::error("kdaBf16State: the cpu device is the fp32 oracle; bf16 KDA states are a "
                         "cuda device option");

  const fb::CacheSpec *spec = plan->cache();
  if (!spec)
    return Status::error(plan.path() + ": the plan has no cache spec");
  if (options.kvCacheTokens < 0)
    return Status::error("kvCacheTokens (" + std::to_string(options.kvCacheTokens) +
                         ") must not be negative");
  const int64_t pageSize = std::max<int64_t>(1, spec->page_size());
  const int64_t pagesPerSequence = (options.maxContextTokens + pageSize - 1) / pageSize;
  const int64_t sequencePages = options.kvCacheTokens > 0
                                    ? (options.kvCacheTokens + pageSize - 1) / pageSize
                                    : pagesPerSequence * options.maxSequences;
  // Kept prefixes hold pages of their own once their sequences are gone.
  phaseStart = std::chrono::steady_clock::now();
  HYBRID_ASSIGN_OR_RETURN(
      PagedKvCache kvCache,
      PagedKvCache::create(*spec, sequencePages + pagesPerSequence * options.prefixCacheEntries,
                           options.maxSequences));
  HYBRID_ASSIGN_OR_RETURN(RecurrentStatePool states,
                          RecurrentStatePool::create(*spec, options.maxSequences));
  timings.hostPoolsSeconds = secondsSince(phaseStart);

  auto impl = std::make_unique<Impl>(dir, options, std::move(plan), std::move(archive),
                                     std::move(kvCache), std::move(states));
  impl->kvSequenceInUse.assign(options.maxSequences, false);
  impl->layout = cpu::ParallelLayout{.tensorParallel = impl->plan->target()->tensor_parallel(),
                                     .contextParallel = impl->plan->target()->context_parallel()};
  impl->prefixCache = PrefixCache(options.prefixCacheEntries, options.prefixCacheBlockTokens);
  impl->kvStaging.resize(spec->kv() ? spec->kv()->size() : 0);

  const fb::Plan &root = impl->plan.plan();
  impl->weights.resize(root.weights() ? root.weights()->size() : 0);
  impl->weightLayouts.resize(impl->weights.size());
  // fp32 host copies: every weight for the cpu device; for the cuda device only what it asks for
  // (its small weights) and the weights of the steps it leaves to the cpu reference, so a large
  // model's GEMM weights are never held in fp32 on the host.
  std::vector<bool> converted(impl->weights.size(), false);
  auto convert = [&](int32_t index) -> StatusOr<const std::vector<float> *> {
    if (index < 0 || static_cast<size_t>(index) >= impl->weights.size())
      return Status::error(impl->plan.path() + ": weight index " + std::to_string(index) +
                           " is outside the plan's " + std::to_string(impl->weights.size()) +
                           " weights");
    if (!converted[static_cast<size_t>(index)]) {
      // Converted element by element; a tiled weight stays tiled for the tiled GEMM.
      HYBRID_ASSIGN_OR_RETURN(impl->weights[static_cast<size_t>(index)],
                              toFloat(impl->archive, root, index, impl->generation));
      converted[static_cast<size_t>(index)] = true;
    }
    return &impl->weights[static_cast<size_t>(index)];
  };
  phaseStart = std::chrono::steady_clock::now();
  for (size_t i = 0; i < impl->weights.size(); ++i) {
    if (!cudaDevice)
      HYBRID_RETURN_IF_ERROR(convert(static_cast<int32_t>(i)).status());
    const fb::Weight *weight = root.weights()->Get(static_cast<flatbuffers::uoffset_t>(i));
    cpu::WeightLayout &layout = impl->weightLayouts[i];
    if (weight->shape() && weight->shape()->size() == 2) {
      layout.rows = weight->shape()->Get(0);
      layout.cols = weight->shape()->Get(1);
    }
    if (weight->layout() == fb::Layout::NzTiled)
      layout.tiled = kernels::ref::TiledLayout{
          layout.rows, layout.cols, {weight->tile()->Get(0), weight->tile()->Get(1)}};
    if (weight->quant() == fb::QuantKind::Fp8Block) {
      if (layout.tiled)
        return Status::error(impl->plan.path() + ": fp8 weight '" + weight->name()->str() +
                             "' is tiled; FP8 weights stay row-major");
      layout.fp8Activations = root.fp8_activation_scale() == fb::Fp8ActivationScale::Ue8m0
                                  ? kernels::ref::Fp8ScaleRule::DeepSeekUe8m0
                                  : kernels::ref::Fp8ScaleRule::DeepSeekLinear;
    }
  }

  timings.hostWeightsSeconds = secondsSince(phaseStart);

  phaseStart = std::chrono::steady_clock::now();
  for (auto [name, runner] : {std::pair{"prefill", &impl->prefill}, {"decode", &impl->decode}}) {
    runner->program = impl->plan.findProgram(name);
    if (!runner->program)
      return Status::error(impl->plan.path() + ": the plan has no '" + name + "' program");
    HYBRID_ASSIGN_OR_RETURN(runner->arena, Arena::create(runner->program->arena_bytes()));
    for (const fb::Value *value : *runner->program->values())
      runner->contextParallel |= value->rows() != fb::ValueRows::Step;
    for (const fb::Step *step : *runner->program->steps())
      if (const fb::Dispatch *d = step->op_as_Dispatch();
          d && d->kernel() == fb::KernelId::DsaIndexer && d->params_as_DsaIndexerParams())
        runner->dsaTopKs.push_back(d->params_as_DsaIndexerParams()->top_k());
  }
  // The multi-token-prediction layer: its program, and the KV cache layer of its attention (the
  // layer after the decoder's).
  if (const fb::Program *mtp = impl->plan.findProgram("mtp")) {
    if (mtp->hidden_input() < 0)
      return Status::error(impl->plan.path() + ": program 'mtp' has no hidden_input");
    impl->mtp.program = mtp;
    HYBRID_ASSIGN_OR_RETURN(impl->mtp.arena, Arena::create(mtp->arena_bytes()));
    for (size_t slot = 0; spec->kv() && slot < spec->kv()->size(); ++slot)
      if (spec->kv()->Get(static_cast<flatbuffers::uoffset_t>(slot))->layer() == root.num_layers())
        impl->mtpKvSlot = static_cast<int32_t>(slot);
    if (impl->mtpKvSlot < 0)
      return Status::error(impl->plan.path() + ": program 'mtp' has no KV cache layer (cache.kv "
                                               "with layer = num_layers = " +
                           std::to_string(root.num_layers()) + ")");
  }
  timings.hostPoolsSeconds += secondsSince(phaseStart);
#ifdef HYBRID_HAS_CUDA_DEVICE
  if (cudaDevice) {
    auto cuda = cudadev::CudaExecutor::create(dir, root, impl->archive, convert, impl->states,
                                              impl->kvCache, options, timings);
    if (!cuda)
      return Status(cuda.status()).withContext("cuda device");
    impl->cuda = std::move(*cuda);
    impl->generation.deviceBytes = impl->cuda->weightGeneration().deviceBytes;
    impl->generation.deviceSeconds = impl->cuda->weightGeneration().deviceSeconds;
    phaseStart = std::chrono::steady_clock::now();
    for (int32_t index : impl->cuda->cpuStepWeights())
      HYBRID_RETURN_IF_ERROR(convert(index).status());
    timings.hostWeightsSeconds += secondsSince(phaseStart);
  }
#else
  (void)cudaDevice;
#endif
  timings.totalSeconds = secondsSince(loadStart);
  impl->timings = timings;
  return std::unique_ptr<Model>(new Model(std::move(impl)));
}

Model::Model(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

const WeightGeneration &Model::weightGeneration() const { return impl_->generation; }
const LoadTimings &Model::loadTimings() const { return impl_->timings; }
const VerifyTimings &Model::verifyTimings() const { return impl_->verifyTimings; }
Model::~Model() = default;

const fb::Plan &Model::plan() const { return impl_->plan.plan(); }
int64_t Model::vocabSize() const { return plan().vocab_size(); }
int64_t Model::hiddenSize() const { return plan().hidden_size(); }

std::string Model::placementReport() const {
#ifdef HYBRID_HAS_CUDA_DEVICE
  if (impl_->cuda)
    return impl_->cuda->placementReport();
#endif
  return {};
}

CudaGraphCounts Model::cudaGraphCounts() const {
#ifdef HYBRID_HAS_CUDA_DEVICE
  if (impl_->cuda)
    return impl_->cuda->graphCounts();
#endif
  return {};
}

// Each DSA layer's indexer picks min(top_k, position + 1) of the position + 1 causal positions
// for a token at `position`: the counts follow from the step's positions, on either device.
void Model::Impl::countSparseAttention(const ProgramRunner &runner, int64_t rows,
                                       int64_t firstPosition,
                                       std::span<const cpu::BatchRow> batch) {
  uint64_t selected = 0, context = 0;
  const cpu::BatchRow whole{.position = firstPosition, .rows = rows};
  for (const int64_t topK : runner.dsaTopKs)
    for (const cpu::BatchRow &segment : batch.empty() ? std::span(&whole, 1) : batch)
      for (int64_t r = 0; r < segment.rows; ++r) {
        const int64_t position = segment.position + r;
        selected += static_cast<uint64_t>(std::min(topK, position + 1));
        context += static_cast<uint64_t>(position + 1);
      }
  sparseSelected += selected;
  sparseContext += context;
}

Model::Usage Model::usage() const {
  Usage usage;
  usage.pageTokens = impl_->kvCache.pageSize();
  usage.totalPages = impl_->kvCache.numPages();
  usage.freePages = impl_->kvCache.freePages();
  usage.sequencesInUse = static_cast<int32_t>(
      std::count(impl_->kvSequenceInUse.begin(), impl_->kvSequenceInUse.end(), true));
  usage.maxSequences = impl_->options.maxSequences;
  usage.keptPrefixes = impl_->prefixCache.size();
  usage.recurrentStateBytes = impl_->states.slotElements() * sizeof(float);
  usage.sparseSelectedPositions = impl_->sparseSelected.load();
  usage.sparseContextPositions = impl_->sparseContext.load();
  usage.indexerScoredPairs = impl_->indexerPairs.load();
  return usage;
}

int64_t Model::maxContextTokens() const { return impl_->options.maxContextTokens; }
bool Model::batchInvariant() const {
#ifdef HYBRID_HAS_CUDA_DEVICE
  if (impl_->cuda)
    return impl_->cuda->batchInvariant();
#endif
  return true; // the cpu device: every row's arithmetic is its own
}

int64_t Model::pagesFor(int64_t tokens) const {
  if (impl_->kvCache.numLayers() == 0)
    return 0; // nothing is cached per token
  const int64_t page = impl_->kvCache.pageSize();
  return (std::max<int64_t>(0, tokens) + page - 1) / page;
}

StatusOr<std::unique_ptr<Sequence>> Model::newSequence() {
  auto free = std::find(impl_->kvSequenceInUse.begin(), impl_->kvSequenceInUse.end(), false);
  if (free == impl_->kvSequenceInUse.end())
    return Status::error("all " + std::to_string(impl_->options.maxSequences) +
                         " sequences are in use (LoadOptions::maxSequences)");
  HYBRID_ASSIGN_OR_RETURN(int32_t stateSlot, impl_->states.allocate());
#ifdef HYBRID_HAS_CUDA_DEVICE
  if (impl_->cuda)
    if (Status reset = impl_->cuda->resetSlot(stateSlot); !reset) {
      (void)impl_->states.release(stateSlot);
      return reset;
    }
#endif
  const int32_t kvSequence = static_cast<int32_t>(free - impl_->kvSequenceInUse.begin());
  *free = true;
  return std::unique_ptr<Sequence>(new Sequence(*this, kvSequence, stateSlot));
}

Sequence::~Sequence() {
  Model::Impl &impl = *model_.impl_;
  (void)impl.kvCache.freeSequence(kvSequence_);
  (void)impl.states.release(stateSlot_);
  impl.kvSequenceInUse[kvSequence_] = false;
}

StatusOr<std::vector<float>> Sequence::prefill(std::span<const int64_t> tokens,
                                               HiddenStates *hidden, PrefillLogits which) {
  Model::Impl &impl = *model_.impl_;
  const int64_t vocab = model_.vocabSize();
  const int64_t chunk = std::max<int64_t>(1, impl.prefill.program->max_tokens());
  if (tokens.empty())
    return Status::error("prefill needs at least one token");
  if (length_ + static_cast<int64_t>(tokens.size()) > impl.options.maxContextTokens)
    return Status::error("sequence would grow to " +
                         std::to_string(length_ + static_cast<int64_t>(tokens.size())) +
                         " tokens, past maxContextTokens = " +
                         std::to_string(impl.options.maxContextTokens));
  if (hidden) {
    const auto *outputs = impl.prefill.program->layer_outputs();
    hidden->rows = static_cast<int64_t>(tokens.size());
    hidden->width = model_.hiddenSize();
    hidden->layers.assign(outputs ? outputs->size() : 0, {});
  }
  const bool lastRow = which == PrefillLogits::LastRow;
  std::vector<float> logits((lastRow ? 1 : tokens.size()) * static_cast<size_t>(vocab));
  for (size_t begin = 0; begin < tokens.size(); begin += static_cast<size_t>(chunk)) {
    const size_t count = std::min(tokens.size() - begin, static_cast<size_t>(chunk));
    RunExtras extras;
    extras.lastRowLogits = lastRow; // each chunk's last row; the last chunk's stays
    HYBRID_RETURN_IF_ERROR(impl.run(impl.prefill, *this, kvSequence_, stateSlot_,
                                    tokens.subspan(begin, count), /*decodeStep=*/false,
                                    logits.data() + (lastRow ? 0 : begin * vocab), hidden,
                                    nullptr, {}, extras));
    HYBRID_RETURN_IF_ERROR(
        keepFinalHidden(*impl.prefill.program, length_, 0, static_cast<int64_t>(count)));
    length_ += static_cast<int64_t>(count);
  }
  return logits;
}

StatusOr<int64_t> Sequence::restorePrefix(std::span<const int64_t> tokens) {
  Model::Impl &impl = *model_.impl_;
  if (length_ != 0)
    return Status::error("a kept prefix starts a sequence; this one already holds " +
                         std::to_string(length_) + " tokens");
  PrefixCache &cache = impl.prefixCache;
  if (!cache.enabled() || tokens.size() < 2)
    return int64_t{0};
  const PrefixCache::Entry *entry = cache.find(tokens, static_cast<int64_t>(tokens.size()) - 1);
  if (!entry)
    return int64_t{0};
  HYBRID_RETURN_IF_ERROR(impl.kvCache.adoptPrefix(kvSequence_, entry->kv));
  Status restored = impl.states.restore(stateSlot_, entry->state);
#ifdef HYBRID_HAS_CUDA_DEVICE
  if (restored && impl.cuda) // the states the GPU kernels read live on the device
    restored = impl.cuda->uploadSlot(stateSlot_, impl.states);
#endif
  if (!restored) {
    (void)impl.kvCache.freeSequence(kvSequence_);
    return restored;
  }
  length_ = static_cast<int64_t>(entry->tokens.size());
  return length_;
}

Status Sequence::keepPrefix(std::span<const int64_t> tokens) {
  Model::Impl &impl = *model_.impl_;
  PrefixCache &cache = impl.prefixCache;
  if (!cache.enabled())
    return Status::ok();
  if (static_cast<int64_t>(tokens.size()) != length_)
    return Status::error("keepPrefix: " + std::to_string(tokens.size()) +
                         " tokens given for a sequence of " + std::to_string(length_));
  if (length_ == 0 || length_ % cache.blockTokens() != 0)
    return Status::error("keepPrefix: " + std::to_string(length_) +
                         " tokens are not a whole number of " +
                         std::to_string(cache.blockTokens()) + "-token blocks");
  // The MTP layer's rows lag (they need the next token); the kept prefix gets zero rows for
  // positions it has not run, and this sequence keeps its own length (its pages are now shared,
  // so its later MTP rows copy them first).
  const int64_t mtpRows = mtpLength();
  if (impl.mtpKvSlot >= 0 && mtpRows < length_)
    HYBRID_RETURN_IF_ERROR(setMtpLength(length_));
  StatusOr<KvPrefix> kv = impl.kvCache.holdPrefix(kvSequence_, length_);
  if (impl.mtpKvSlot >= 0)
    HYBRID_RETURN_IF_ERROR(impl.kvCache.truncateLayer(impl.mtpKvSlot, kvSequence_, mtpRows));
  if (!kv) {
    // Keeping is best effort: with no free page for a partial last page, nothing is kept.
    if (kv.status().isExhausted())
      return Status::ok();
    return kv.status();
  }
#ifdef HYBRID_HAS_CUDA_DEVICE
  if (impl.cuda) // the states the GPU kernels wrote live on the device
    if (Status downloaded = impl.cuda->downloadSlot(stateSlot_, impl.states); !downloaded) {
      impl.kvCache.releasePrefix(*kv);
      return downloaded;
    }
#endif
  StatusOr<RecurrentStateSnapshot> state = impl.states.snapshot(stateSlot_);
  if (!state) {
    impl.kvCache.releasePrefix(*kv);
    return state.status();
  }
  cache.insert(std::vector<int64_t>(tokens.begin(), tokens.end()), std::move(*kv),
               std::move(*state), impl.kvCache);
  return Status::ok();
}

int64_t Sequence::prefixBoundary(int64_t tokens) const {
  const PrefixCache &cache = model_.impl_->prefixCache;
  return cache.enabled() ? tokens / cache.blockTokens() * cache.blockTokens() : 0;
}

StatusOr<CachedPrefill> Sequence::prefillWithPrefixCache(std::span<const int64_t> tokens) {
  if (length_ != 0)
    return Status::error("prefillWithPrefixCache starts a sequence; this one already holds " +
                         std::to_string(length_) + " tokens");
  if (tokens.empty())
    return Status::error("prefill needs at least one token");
  const auto total = static_cast<int64_t>(tokens.size());
  CachedPrefill result;
  HYBRID_ASSIGN_OR_RETURN(result.cachedTokens, restorePrefix(tokens));
  auto prefillUpTo = [&](int64_t end) -> Status {
    HYBRID_ASSIGN_OR_RETURN(std::vector<float> logits,
                            prefill(tokens.subspan(static_cast<size_t>(length_),
                                                   static_cast<size_t>(end - length_))));
    result.logits.insert(result.logits.end(), logits.begin(), logits.end());
    return Status::ok();
  };
  if (const int64_t keep = prefixBoundary(total); keep > length_) {
    HYBRID_RETURN_IF_ERROR(prefillUpTo(keep));
    HYBRID_RETURN_IF_ERROR(keepPrefix(tokens.first(static_cast<size_t>(keep))));
  }
  if (total > length_)
    HYBRID_RETURN_IF_ERROR(prefillUpTo(total));
  return result;
}

StatusOr<DraftVerification> Sequence::verifyDraft(int64_t token,
                                                   std::span<const int64_t> draft) {
  if (draft.empty()) {
    DraftVerification result;
    HYBRID_ASSIGN_OR_RETURN(result.logits, decode(token));
    result.tokens.push_back(static_cast<int64_t>(
        std::max_element(result.logits.begin(), result.logits.end()) - result.logits.begin()));
    return result;
  }
  const DraftCheck check{.sequence = this, .token = token, .draft = draft};
  HYBRID_ASSIGN_OR_RETURN(std::vector<DraftVerification> results,
                          model_.verifyDrafts(std::span(&check, 1)));
  return std::move(results[0]);
}

Status Model::checkSegments(const char *caller, std::span<Sequence *const> sequences,
                            std::span<const int64_t> rows) const {
  const Impl &impl = *impl_;
  if (sequences.empty())
    return Status::error(std::string(caller) + ": no sequences");
  if (impl.prefill.contextParallel && sequences.size() > 1)
    return Status::error(std::string(caller) + ": " + impl.plan.path() +
                         " is context-parallel: its prefill splits one sequence over the ranks, "
                         "so it runs one sequence per call");
  int64_t total = 0;
  for (size_t i = 0; i < sequences.size(); ++i) {
    const Sequence *sequence = sequences[i];
    const std::string which = std::string(caller) + ": sequence " + std::to_string(i);
    if (!sequence || &sequence->model_ != this)
      return Status::error(which + " is not one of this model's");
    for (size_t j = 0; j < i; ++j)
      if (sequences[j] == sequence)
        return Status::error(std::string(caller) + ": sequences " + std::to_string(j) + " and " +
                             std::to_string(i) + " are the same sequence");
    if (rows[i] < 1)
      return Status::error(which + " has no tokens");
    if (sequence->length_ + rows[i] > impl.options.maxContextTokens)
      return Status::error(which + " would grow to " + std::to_string(sequence->length_ + rows[i]) +
                           " tokens, past maxContextTokens = " +
                           std::to_string(impl.options.maxContextTokens));
    total += rows[i];
  }
  if (total > maxPrefillTokens())
    return Status::error(std::string(caller) + ": " + std::to_string(total) + " rows of " +
                         std::to_string(sequences.size()) +
                         " sequences, the prefill program takes at most " +
                         std::to_string(maxPrefillTokens()) +
                         " per call (hybrid-compile --prefill-tokens)");
  return Status::ok();
}

int64_t Model::maxPrefillTokens() const {
  return std::max<int64_t>(1, impl_->prefill.program->max_tokens());
}

StatusOr<std::vector<float>> Model::prefillBatch(std::span<const PrefillSegment> segments,
                                                 PrefillLogits which) {
  Impl &impl = *impl_;
  std::vector<Sequence *> sequences;
  std::vector<int64_t> rows;
  for (const PrefillSegment &segment : segments) {
    sequences.push_back(segment.sequence);
    rows.push_back(static_cast<int64_t>(segment.tokens.size()));
  }
  HYBRID_RETURN_IF_ERROR(checkSegments("prefillBatch", sequences, rows));
  if (segments.size() == 1) // the plain prefill: one call, since the tokens fit it
    return sequences[0]->prefill(segments[0].tokens, nullptr, which);
  std::vector<cpu::BatchRow> batch;
  std::vector<int64_t> fed;
  for (const PrefillSegment &segment : segments) {
    batch.push_back({.kvSequence = segment.sequence->kvSequence_,
                     .stateSlot = segment.sequence->stateSlot_,
                     .position = segment.sequence->length_,
                     .rows = static_cast<int64_t>(segment.tokens.size())});
    fed.insert(fed.end(), segment.tokens.begin(), segment.tokens.end());
  }
  const bool lastRow = which == PrefillLogits::LastRow;
  std::vector<float> logits((lastRow ? segments.size() : fed.size()) *
                            static_cast<size_t>(vocabSize()));
  Sequence &first = *sequences[0];
  HYBRID_RETURN_IF_ERROR(impl.run(impl.prefill, first, first.kvSequence_, first.stateSlot_, fed,
                                  /*decodeStep=*/false, logits.data(), nullptr, nullptr, batch,
                                  RunExtras{.lastRowLogits = lastRow}));
  int64_t row = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    Sequence &sequence = *sequences[i];
    HYBRID_RETURN_IF_ERROR(
        sequence.keepFinalHidden(*impl.prefill.program, sequence.length_, row, rows[i]));
    sequence.length_ += rows[i];
    row += rows[i];
  }
  return logits;
}

StatusOr<std::vector<DraftVerification>> Model::verifyDrafts(std::span<const DraftCheck> checks,
                                                             bool keepLogits) {
  Impl &impl = *impl_;
  const auto vocab = static_cast<size_t>(vocabSize());
  std::vector<Sequence *> sequences;
  std::vector<int64_t> rows;
  for (size_t i = 0; i < checks.size(); ++i) {
    if (checks[i].draft.empty())
      return Status::error("verifyDrafts: check " + std::to_string(i) +
                           " has an empty draft (a token alone is a decode step)");
    sequences.push_back(checks[i].sequence);
    rows.push_back(1 + static_cast<int64_t>(checks[i].draft.size()));
  }
  HYBRID_RETURN_IF_ERROR(checkSegments("verifyDrafts", sequences, rows));
  VerifyTimings &timings = impl.verifyTimings;
  ++timings.calls;
  timings.sequences += static_cast<int64_t>(checks.size());
  auto phaseStart = std::chrono::steady_clock::now();
  auto lap = [&phaseStart](double &phase) {
    const auto now = std::chrono::steady_clock::now();
    phase += std::chrono::duration<double>(now - phaseStart).count();
    phaseStart = now;
  };
  // One snapshot per sequence before the pass and one KDA log per sequence. The GPU's KDA
  // states are copied on the device; the host pool's (the cpu device's, or layers on the cpu
  // reference) on the host.
  bool hostSnapshots = true;
#ifdef HYBRID_HAS_CUDA_DEVICE
  if (impl.cuda) {
    std::vector<int32_t> slots;
    for (const Sequence *sequence : sequences)
      slots.push_back(sequence->stateSlot_);
    HYBRID_RETURN_IF_ERROR(impl.cuda->snapshotSlots(slots));
    hostSnapshots = !impl.cuda->holdsEveryRecurrentState();
  }
#endif
  std::vector<RecurrentStateSnapshot> before;
  if (hostSnapshots)
    for (const Sequence *sequence : sequences) {
      HYBRID_ASSIGN_OR_RETURN(RecurrentStateSnapshot snapshot,
                              impl.states.snapshot(sequence->stateSlot_));
      before.push_back(std::move(snapshot));
    }
  lap(timings.snapshotSeconds);
  std::vector<cpu::KdaReplayLog> logs(checks.size());
  std::vector<cpu::BatchRow> batch;
  std::vector<int64_t> fed;
  for (size_t i = 0; i < checks.size(); ++i) {
    batch.push_back({.kvSequence = sequences[i]->kvSequence_,
                     .stateSlot = sequences[i]->stateSlot_,
                     .position = sequences[i]->length_,
                     .rows = rows[i],
                     .kdaLog = &logs[i]});
    fed.push_back(checks[i].token);
    fed.insert(fed.end(), checks[i].draft.begin(), checks[i].draft.end());
  }
  if (checks.size() == 1) // one sequence: the plain prefill path, logging into its log
    batch.clear();
  // Each row's greedy token: chosen on the device (only ids come back), or from the logits.
  bool chosenOnDevice = false;
#ifdef HYBRID_HAS_CUDA_DEVICE
  chosenOnDevice = !keepLogits && impl.cuda != nullptr;
#endif
  std::vector<float> logits(chosenOnDevice ? 0 : fed.size() * vocab);
  std::vector<int64_t> chosen(fed.size());
  const std::vector<TokenChoice> greedy(chosenOnDevice ? fed.size() : 0);
  RunExtras extras;
  if (chosenOnDevice) {
    extras.choices = greedy;
    extras.chosenOut = chosen.data();
  }
  Sequence &first = *sequences[0];
  HYBRID_RETURN_IF_ERROR(impl.run(impl.prefill, first, first.kvSequence_, first.stateSlot_, fed,
                                  /*decodeStep=*/false, chosenOnDevice ? nullptr : logits.data(),
                                  nullptr, &logs[0], batch, extras));
  lap(timings.passSeconds);

  auto argmax = [](std::span<const float> row) {
    return static_cast<int64_t>(std::max_element(row.begin(), row.end()) - row.begin());
  };
  std::vector<DraftVerification> results(checks.size());
  int64_t offset = 0; // the check's first row in the pass
  for (size_t i = 0; i < checks.size(); ++i) {
    Sequence &sequence = *sequences[i];
    const std::span<const int64_t> draft = checks[i].draft;
    DraftVerification &result = results[i];
    auto tokenOf = [&](int64_t r) {
      const auto at = static_cast<size_t>(offset + r);
      return chosenOnDevice ? chosen[at]
                            : argmax(std::span<const float>(logits).subspan(at * vocab, vocab));
    };
    while (result.accepted < static_cast<int64_t>(draft.size()) &&
           tokenOf(result.accepted) == draft[static_cast<size_t>(result.accepted)])
      ++result.accepted;
    result.tokens.assign(draft.begin(), draft.begin() + result.accepted);
    result.tokens.push_back(tokenOf(result.accepted));
    if (keepLogits) {
      const auto begin =
          logits.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(offset) * vocab);
      result.logits.assign(begin, begin + static_cast<std::ptrdiff_t>(
                                              static_cast<size_t>(result.accepted + 1) * vocab));
    }
    lap(timings.chooseSeconds);

    const int64_t start = sequence.length_;
    sequence.length_ += rows[i];
    const int64_t keep = 1 + result.accepted; // the token and the accepted draft tokens
    HYBRID_RETURN_IF_ERROR(sequence.keepFinalHidden(*impl.prefill.program, start, offset, keep));
    if (keep < rows[i]) {
      const int32_t slot = sequence.stateSlot_;
      HYBRID_RETURN_IF_ERROR(impl.kvCache.truncate(sequence.kvSequence_, start + keep));
      if (hostSnapshots) {
        HYBRID_RETURN_IF_ERROR(impl.states.restore(slot, before[i]));
        HYBRID_RETURN_IF_ERROR(cpu::replayKda(impl.states, slot, logs[i], keep));
      }
#ifdef HYBRID_HAS_CUDA_DEVICE
      if (impl.cuda) { // the GPU's KDA layers: back to the snapshot, then their logged inputs
        HYBRID_RETURN_IF_ERROR(impl.cuda->restoreSlot(slot, i));
        HYBRID_RETURN_IF_ERROR(impl.cuda->replayKdaLog(slot, keep, offset));
      }
#endif
      sequence.length_ = start + keep;
    }
    offset += rows[i];
    lap(timings.rollbackSeconds);
  }
  return results;
}

StatusOr<std::vector<float>> Sequence::recurrentState() const {
  Model::Impl &impl = *model_.impl_;
#ifdef HYBRID_HAS_CUDA_DEVICE
  if (impl.cuda)
    HYBRID_RETURN_IF_ERROR(impl.cuda->downloadSlot(stateSlot_, impl.states));
#endif
  std::vector<float> values;
  for (int32_t layer = 0; layer < impl.states.numLayers(); ++layer) {
    HYBRID_ASSIGN_OR_RETURN(std::span<float> state, impl.states.state(layer, stateSlot_));
    HYBRID_ASSIGN_OR_RETURN(std::span<float> conv, impl.states.convState(layer, stateSlot_));
    values.insert(values.end(), state.begin(), state.end());
    values.insert(values.end(), conv.begin(), conv.end());
  }
  return values;
}

int64_t Model::maxDecodeBatch() const { return std::max<int64_t>(1, impl_->decode.program->max_tokens()); }

StatusOr<std::vector<float>> Model::decodeBatch(std::span<Sequence *const> sequences,
                                                std::span<const int64_t> tokens) {
  return decodeRows(sequences, tokens, {}, nullptr);
}

StatusOr<std::vector<float>> Model::decodeRows(std::span<Sequence *const> sequences,
                                               std::span<const int64_t> tokens,
                                               std::span<const TokenChoice> choices,
                                               int64_t *chosen, int64_t chainSteps) {
  Impl &impl = *impl_;
  if (sequences.empty() || sequences.size() != tokens.size())
    return Status::error("decodeBatch: " + std::to_string(sequences.size()) + " sequences and " +
                         std::to_string(tokens.size()) + " tokens: one token per sequence, at "
                                                          "least one");
  if (static_cast<int64_t>(sequences.size()) > maxDecodeBatch())
    return Status::error("decodeBatch: " + std::to_string(sequences.size()) +
                         " sequences, the decode program takes at most " +
                         std::to_string(maxDecodeBatch()) + " (hybrid-compile --decode-batch)");
  std::vector<cpu::BatchRow> batch;
  for (size_t i = 0; i < sequences.size(); ++i) {
    const Sequence *sequence = sequences[i];
    if (!sequence || &sequence->model_ != this)
      return Status::error("decodeBatch: sequence " + std::to_string(i) +
                           " is not one of this model's");
    for (size_t j = 0; j < i; ++j)
      if (sequences[j] == sequence)
        return Status::error("decodeBatch: sequences " + std::to_string(j) + " and " +
                             std::to_string(i) + " are the same sequence");
    // (A chain's room for all its steps: decodeSteps checked it before anything ran.)
    if (sequence->length_ + 1 > impl.options.maxContextTokens)
      return Status::error("decodeBatch: sequence " + std::to_string(i) +
                           " is full: maxContextTokens = " +
                           std::to_string(impl.options.maxContextTokens));
    batch.push_back({.kvSequence = sequence->kvSequence_,
                     .stateSlot = sequence->stateSlot_,
                     .position = sequence->length_});
  }
  Sequence &first = *sequences[0];
#ifdef HYBRID_HAS_CUDA_DEVICE
  if (chainSteps > 0) {
    const size_t rows = sequences.size();
    HYBRID_RETURN_IF_ERROR(impl.cuda->beginChain(chainSteps, static_cast<int64_t>(rows)));
    for (int64_t step = 0; step < chainSteps; ++step) {
      RunExtras extras;
      extras.choices = choices.subspan(static_cast<size_t>(step) * rows, rows);
      extras.chainStep = step;
      if (Status run = impl.run(impl.decode, first, first.kvSequence_, first.stateSlot_, tokens,
                                /*decodeStep=*/true, nullptr, nullptr, nullptr, batch, extras);
          !run) {
        (void)impl.cuda->endChain(chainSteps, static_cast<int64_t>(rows), nullptr);
        return run;
      }
      for (size_t i = 0; i < rows; ++i)
        batch[i].position = ++sequences[i]->length_;
    }
    HYBRID_RETURN_IF_ERROR(impl.cuda->endChain(chainSteps, static_cast<int64_t>(rows), chosen));
    return std::vector<float>{};
  }
#endif
  std::vector<float> logits(chosen ? 0 : sequences.size() * static_cast<size_t>(vocabSize()));
  RunExtras extras;
  extras.choices = choices;
  extras.chosenOut = chosen;
  HYBRID_RETURN_IF_ERROR(impl.run(impl.decode, first, first.kvSequence_, first.stateSlot_,
                                  tokens, /*decodeStep=*/true, logits.data(), nullptr, nullptr,
                                  batch, extras));
  for (size_t i = 0; i < sequences.size(); ++i) {
    Sequence &sequence = *sequences[i];
    HYBRID_RETURN_IF_ERROR(sequence.keepFinalHidden(*impl.decode.program, sequence.length_,
                                                    static_cast<int64_t>(i), 1));
    ++sequence.length_;
  }
  return logits;
}

StatusOr<std::vector<int64_t>> Model::decodeBatchChoose(std::span<Sequence *const> rows,
                                                        std::span<const int64_t> tokens,
                                                        std::span<const TokenChoice> choices) {
  if (choices.size() != rows.size())
    return Status::error("decodeBatchChoose: " + std::to_string(rows.size()) + " sequences and " +
                         std::to_string(choices.size()) + " choices: one choice per sequence");
  for (size_t i = 0; i < choices.size(); ++i)
    if (const std::string problem = samplingParamsProblem(choices[i].params); !problem.empty())
      return Status::error("decodeBatchChoose: row " + std::to_string(i) + ": " + problem);
#ifdef HYBRID_HAS_CUDA_DEVICE
  // The cuda device chooses where the logits are; only the ids come back (and the final hidden
  // states a recording sequence keeps stay on the GPU).
  if (impl_->cuda) {
    std::vector<int64_t> chosen(rows.size());
    HYBRID_RETURN_IF_ERROR(decodeRows(rows, tokens, choices, chosen.data()).status());
    return chosen;
  }
#endif
  // One row takes the plain decode path, the one single-sequence callers have always used.
  const bool single = rows.size() == 1 && tokens.size() == 1 && rows[0] && &rows[0]->model_ == this;
  HYBRID_ASSIGN_OR_RETURN(std::vector<float> logits,
                          single ? rows[0]->decode(tokens[0]) : decodeBatch(rows, tokens));
  const auto vocab = static_cast<size_t>(vocabSize());
  std::vector<int64_t> chosen(rows.size());
  for (size_t i = 0; i < rows.size(); ++i)
    chosen[i] = chooseToken(std::span<const float>(logits).subspan(i * vocab, vocab), choices[i]);
  return chosen;
}

StatusOr<std::vector<int64_t>> Model::decodeSteps(std::span<Sequence *const> rows,
                                                  std::span<const int64_t> tokens,
                                                  std::span<const TokenChoice> choices,
                                                  int64_t steps) {
  const size_t n = rows.size();
  if (steps < 1)
    return Status::error("decodeSteps: " + std::to_string(steps) + " steps: at least one");
  if (choices.size() != n * static_cast<size_t>(steps))
    return Status::error("decodeSteps: " + std::to_string(choices.size()) + " choices for " +
                         std::to_string(steps) + " steps of " + std::to_string(n) +
                         " sequences: one per sequence and step");
  for (size_t i = 0; i < choices.size(); ++i)
    if (const std::string problem = samplingParamsProblem(choices[i].params); !problem.empty())
      return Status::error("decodeSteps: step " + std::to_string(i / std::max<size_t>(1, n)) +
                           ", row " + std::to_string(i % std::max<size_t>(1, n)) + ": " + problem);
  for (size_t i = 0; i < n; ++i)
    if (rows[i] && &rows[i]->model_ == this &&
        rows[i]->length_ + steps > impl_->options.maxContextTokens)
      return Status::error("decodeSteps: sequence " + std::to_string(i) + " has room for " +
                           std::to_string(impl_->options.maxContextTokens - rows[i]->length_) +
                           " more tokens, not " + std::to_string(steps));
  std::vector<int64_t> chosen;
#ifdef HYBRID_HAS_CUDA_DEVICE
  const bool recording = std::any_of(
      rows.begin(), rows.end(), [](const Sequence *row) { return row && row->recordFinalHidden_; });
  if (impl_->cuda && !recording) {
    chosen.resize(n * static_cast<size_t>(steps));
    HYBRID_RETURN_IF_ERROR(decodeRows(rows, tokens, choices, chosen.data(), steps).status());
    return chosen;
  }
#endif
  // Step by step (the cpu device, recording rows): each step's ids feed the next.
  std::vector<int64_t> next(tokens.begin(), tokens.end());
  for (int64_t step = 0; step < steps; ++step) {
    HYBRID_ASSIGN_OR_RETURN(
        std::vector<int64_t> ids,
        decodeBatchChoose(rows, next, choices.subspan(static_cast<size_t>(step) * n, n)));
    chosen.insert(chosen.end(), ids.begin(), ids.end());
    next = std::move(ids);
  }
  return chosen;
}

StatusOr<std::vector<float>> Sequence::decode(int64_t token) {
  Model::Impl &impl = *model_.impl_;
  if (length_ + 1 > impl.options.maxContextTokens)
    return Status::error("sequence is full: maxContextTokens = " +
                         std::to_string(impl.options.maxContextTokens));
  std::vector<float> logits(static_cast<size_t>(model_.vocabSize()));
  const int64_t ids[1] = {token};
  HYBRID_RETURN_IF_ERROR(impl.run(impl.decode, *this, kvSequence_, stateSlot_, ids,
                                  /*decodeStep=*/true, logits.data(), nullptr, nullptr));
  HYBRID_RETURN_IF_ERROR(keepFinalHidden(*impl.decode.program, length_, 0, 1));
  ++length_;
  return logits;
}

bool Model::hasMtp() const { return impl_->mtp.program != nullptr; }

void Sequence::recordFinalHidden(bool on) {
  recordFinalHidden_ = on;
  if (!on)
    recordedRows_ = 0;
}

FinalHiddenRows Sequence::takeFinalHidden() {
  Model::Impl &impl = *model_.impl_;
  FinalHiddenRows taken{.firstPosition = recordedFirst_, .rows = {}};
  const int64_t rows = std::exchange(recordedRows_, 0);
  taken.rows.resize(static_cast<size_t>(rows * model_.hiddenSize()));
#ifdef HYBRID_HAS_CUDA_DEVICE
  if (impl.cuda) {
    // A failed download is reported as no rows: the caller's position check names the gap.
    if (!impl.cuda->downloadRecord(mainRecord(), 0, rows, taken.rows.data()))
      taken.rows.clear();
    return taken;
  }
#endif
  const std::vector<float> &kept = impl.hostRecords[mainRecord()];
  std::copy_n(kept.begin(), taken.rows.size(), taken.rows.begin());
  return taken;
}

Status Sequence::keepFinalHidden(const fb::Program &program, int64_t position, int64_t srcRow,
                                 int64_t rows) {
  if (!recordFinalHidden_ || rows <= 0)
    return Status::ok();
  // Rows are kept for consecutive positions; anything else (a rollback) starts over.
  if (recordedRows_ == 0 || recordedFirst_ + recordedRows_ != position) {
    recordedFirst_ = position;
    recordedRows_ = 0;
  }
  HYBRID_RETURN_IF_ERROR(
      model_.impl_->recordFinalHidden(program, srcRow, rows, mainRecord(), recordedRows_));
  recordedRows_ += rows;
  return Status::ok();
}

int64_t Sequence::mtpLength() const {
  const Model::Impl &impl = *model_.impl_;
  return impl.mtpKvSlot >= 0 ? impl.kvCache.length(impl.mtpKvSlot, kvSequence_) : 0;
}

StatusOr<MtpOutput> Sequence::runMtp(std::span<const int64_t> tokens,
                                     std::span<const float> hidden) {
  Model::Impl &impl = *model_.impl_;
  if (!impl.mtp.program)
    return Status::error(impl.plan.path() + ": the plan has no 'mtp' program (compile a "
                                            "checkpoint with num_nextn_predict_layers = 1)");
  const auto width = static_cast<size_t>(model_.hiddenSize());
  const auto vocab = static_cast<size_t>(model_.vocabSize());
  if (tokens.empty() || hidden.size() != tokens.size() * width)
    return Status::error("runMtp: " + std::to_string(tokens.size()) + " tokens need as many " +
                         std::to_string(width) + "-wide hidden rows, got " +
                         std::to_string(hidden.size()) + " values");
  const int64_t position = mtpLength();
  if (position + static_cast<int64_t>(tokens.size()) > impl.options.maxContextTokens)
    return Status::error("the MTP cache would grow to " +
                         std::to_string(position + static_cast<int64_t>(tokens.size())) +
                         " tokens, past maxContextTokens = " +
                         std::to_string(impl.options.maxContextTokens));
  MtpOutput out;
  out.logits.resize(tokens.size() * vocab);
  out.hidden.resize(tokens.size() * width);
  const auto chunk = static_cast<size_t>(std::max<int64_t>(1, impl.mtp.program->max_tokens()));
  for (size_t begin = 0; begin < tokens.size(); begin += chunk) {
    const size_t count = std::min(tokens.size() - begin, chunk);
    RunExtras extras{.firstPosition = position + static_cast<int64_t>(begin),
                     .hiddenInput = hidden.data() + begin * width,
                     .finalHiddenOut = out.hidden.data() + begin * width};
    HYBRID_RETURN_IF_ERROR(impl.run(impl.mtp, *this, kvSequence_, stateSlot_,
                                    tokens.subspan(begin, count), /*decodeStep=*/false,
                                    out.logits.data() + begin * vocab, nullptr, nullptr, {},
                                    extras));
  }
  return out;
}

StatusOr<int64_t> Sequence::mtpStep(std::span<const int64_t> tokens, int32_t record,
                                    int64_t first) {
  Model::Impl &impl = *model_.impl_;
  if (!impl.mtp.program)
    return Status::error(impl.plan.path() + ": the plan has no 'mtp' program (compile a "
                                            "checkpoint with num_nextn_predict_layers = 1)");
  const int64_t position = mtpLength();
  const auto total = static_cast<int64_t>(tokens.size());
  if (total == 0)
    return Status::error("an MTP step needs at least one token");
  if (position + total > impl.options.maxContextTokens)
    return Status::error("the MTP cache would grow to " + std::to_string(position + total) +
                         " tokens, past maxContextTokens = " +
                         std::to_string(impl.options.maxContextTokens));
  // Only the last row's logits choose the draft token; earlier chunks only fill the MTP cache.
  std::vector<float> logits(static_cast<size_t>(model_.vocabSize()));
  const int64_t chunk = std::max<int64_t>(1, impl.mtp.program->max_tokens());
  int64_t count = 0;
  for (int64_t begin = 0; begin < total; begin += count) {
    count = std::min(total - begin, chunk);
    const RunExtras extras{.firstPosition = position + begin,
                           .lastRowLogits = true,
                           .hiddenRecord = record,
                           .hiddenRecordFirst = first + begin};
    HYBRID_RETURN_IF_ERROR(impl.run(impl.mtp, *this, kvSequence_, stateSlot_,
                                    tokens.subspan(static_cast<size_t>(begin),
                                                   static_cast<size_t>(count)),
                                    /*decodeStep=*/false, logits.data(), nullptr, nullptr, {},
                                    extras));
  }
  HYBRID_RETURN_IF_ERROR(impl.recordFinalHidden(*impl.mtp.program, count - 1, 1, chainRecord(), 0));
  return static_cast<int64_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

StatusOr<int64_t> Sequence::draftMtp(std::span<const int64_t> tokens) {
  const int64_t position = mtpLength();
  const auto rows = static_cast<int64_t>(tokens.size());
  if (position < recordedFirst_ || position + rows > recordedFirst_ + recordedRows_)
    return Status::error("MTP drafts: positions [" + std::to_string(position) + ", " +
                         std::to_string(position + rows) + ") need recorded final hidden "
                         "states, the sequence holds [" + std::to_string(recordedFirst_) + ", " +
                         std::to_string(recordedFirst_ + recordedRows_) +
                         ") (attach the draft source before the first prefill)");
  HYBRID_ASSIGN_OR_RETURN(int64_t token, mtpStep(tokens, mainRecord(), position - recordedFirst_));
  recordedRows_ = 0;
  return token;
}

StatusOr<int64_t> Sequence::draftMtpChained(int64_t token) {
  return mtpStep(std::span<const int64_t>(&token, 1), chainRecord(), 0);
}

Status Sequence::setMtpLength(int64_t length) {
  Model::Impl &impl = *model_.impl_;
  if (impl.mtpKvSlot < 0)
    return Status::error(impl.plan.path() + ": the plan has no 'mtp' program");
  const int64_t current = mtpLength();
  if (length <= current)
    return impl.kvCache.truncateLayer(impl.mtpKvSlot, kvSequence_, length);
#ifdef HYBRID_HAS_CUDA_DEVICE
  if (impl.cuda && impl.cuda->kvLayerOnDevice(impl.mtpKvSlot))
    return impl.cuda->appendZeroKvRows(impl.kvCache, impl.mtpKvSlot, kvSequence_,
                                       length - current);
#endif
  const int64_t rowElements = impl.kvCache.layerShape(impl.mtpKvSlot).rowElements();
  const std::vector<float> zeros(static_cast<size_t>((length - current) * rowElements), 0.0f);
  return impl.kvCache.append(impl.mtpKvSlot, kvSequence_, zeros);
}

} // namespace hybrid
