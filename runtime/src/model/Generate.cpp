#include "hybrid/runtime/Generate.h"

#include "hybrid/runtime/Memory.h"
#include "hybrid/runtime/Safetensors.h"
#include "hybrid/runtime/Scheduler.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <sstream>

namespace hybrid {
namespace {

int64_t argmax(std::span<const float> logits) {
  return std::max_element(logits.begin(), logits.end()) - logits.begin();
}
// The argmax of row `row` of logits [rows, vocab].
int64_t argmaxRow(std::span<const float> logits, int64_t vocab, int64_t row) {
  return argmax(logits.subspan(static_cast<size_t>(row * vocab), static_cast<size_t>(vocab)));
}

double seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::span<const std::byte> asBytes(const std::vector<float> &values) {
  return std::as_bytes(std::span(values));
}

double maxAbsDiff(std::span<const float> a, std::span<const float> b) {
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst = std::max(worst, std::abs(double(a[i]) - double(b[i])));
  return worst;
}

std::string format(double value) {
  std::ostringstream os;
  os.precision(3);
  os << std::scientific << value;
  return os.str();
}

// Each token chosen by options.sampling (greedy parameters: the argmax, lowest id on ties), the
// decode steps choosing on the device (Model::decodeBatchChoose): no logits come back but the
// prompt's (its last row only without keepLogits).
StatusOr<GenerationResult> generateChoosing(Model &model, std::span<const int64_t> prompt,
                                            const GenerationOptions &options) {
  const SamplingParams &sampling = options.sampling;
  GenerationResult result;
  result.vocabSize = model.vocabSize();
  result.prompt.assign(prompt.begin(), prompt.end());
  const size_t vocab = static_cast<size_t>(result.vocabSize);
  auto start = std::chrono::steady_clock::now();
  HYBRID_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> sequence, model.newSequence());
  HYBRID_ASSIGN_OR_RETURN(result.promptLogits,
                          sequence->prefill(prompt, options.dumpHidden ? &result.hidden : nullptr,
                                            options.keepLogits ? PrefillLogits::AllRows
                                                               : PrefillLogits::LastRow));
  result.prefillSeconds = seconds(start);
  if (options.maxNewTokens <= 0)
    return result;

  start = std::chrono::steady_clock::now();
  std::vector<int64_t> tokens(prompt.begin(), prompt.end());
  int64_t next = chooseToken(std::span<const float>(result.promptLogits).last(vocab),
                             tokenChoice(sampling, 0));
  for (int64_t step = 0;; ++step) {
    result.generated.push_back(next);
    tokens.push_back(next);
    if (step + 1 == options.maxNewTokens ||
        std::count(options.stopTokens.begin(), options.stopTokens.end(), next))
      break;
    const TokenChoice choice = tokenChoice(sampling, step + 1);
    if (options.useCaches) {
      Sequence *row = sequence.get();
      HYBRID_ASSIGN_OR_RETURN(const std::vector<int64_t> chosen,
                              model.decodeBatchChoose(std::span(&row, 1), std::span(&next, 1),
                                                      std::span(&choice, 1)));
      next = chosen[0];
    } else {
      sequence.reset();
      HYBRID_ASSIGN_OR_RETURN(sequence, model.newSequence());
      HYBRID_ASSIGN_OR_RETURN(std::vector<float> last,
                              sequence->prefill(tokens, nullptr, PrefillLogits::LastRow));
      next = chooseToken(last, choice);
    }
  }
  result.decodeSeconds = seconds(start);
  return result;
}

} // namespace

StatusOr<GenerationResult> generateGreedy(Model &model, std::span<const int64_t> prompt,
                                          const GenerationOptions &options) {
  const bool speculate = options.draftTokens > 0 && options.useCaches;
  // Without keepLogits (and with caches: full forwards are the golden semantics) greedy steps
  // choose on the device, as sampled ones do.
  if (!options.keepLogits && options.useCaches && !speculate)
    return generateChoosing(model, prompt, options);
  GenerationResult result;
  result.vocabSize = model.vocabSize();
  result.prompt.assign(prompt.begin(), prompt.end());
  const size_t vocab = static_cast<size_t>(result.vocabSize);

  std::unique_ptr<DraftSource> drafts;
  if (speculate && options.draftSource == DraftSourceKind::Replay)
    return Status::error(std::string(kReplayNeedsReference));
  if (speculate) {
    HYBRID_ASSIGN_OR_RETURN(drafts, makeDraftSource(model, options.draftSource));
  }
  auto start = std::chrono::steady_clock::now();
  HYBRID_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> sequence, model.newSequence());
  if (drafts)
    drafts->attach(*sequence);
  HYBRID_ASSIGN_OR_RETURN(result.promptLogits,
                          sequence->prefill(prompt, options.dumpHidden ? &result.hidden : nullptr));
  result.prefillSeconds = seconds(start);
  if (options.maxNewTokens <= 0)
    return result;

  std::vector<float> last(result.promptLogits.end() - vocab, result.promptLogits.end());
  start = std::chrono::steady_clock::now();
  std::vector<int64_t> tokens(prompt.begin(), prompt.end());
  if (speculate) {
    // Each pass feeds the last chosen token and a draft; it returns the accepted draft tokens
    // and the model's own next one, with the logits that chose each.
    int64_t draftLength = options.draftTokens;
    int64_t next = argmax(last);
    auto emit = [&](int64_t token, std::span<const float> logits) {
      result.generated.push_back(token);
      result.generatedLogits.insert(result.generatedLogits.end(), logits.begin(), logits.end());
      tokens.push_back(token);
      return static_cast<int64_t>(result.generated.size()) >= options.maxNewTokens ||
             std::count(options.stopTokens.begin(), options.stopTokens.end(), token) > 0;
    };
    bool done = emit(next, last);
    while (!done) {
      const int64_t room = options.maxNewTokens - static_cast<int64_t>(result.generated.size());
      HYBRID_ASSIGN_OR_RETURN(const std::vector<int64_t> draft,
                              drafts->propose(*sequence, tokens, std::min(draftLength, room - 1)));
      HYBRID_ASSIGN_OR_RETURN(DraftVerification verified, sequence->verifyDraft(next, draft));
      ++result.verifySteps;
      result.draftedTokens += static_cast<int64_t>(draft.size());
      result.acceptedTokens += verified.accepted;
      draftLength = adaptDraftLength(draftLength, options.draftTokens,
                                     static_cast<int64_t>(draft.size()), verified.accepted);
      for (size_t i = 0; i < verified.tokens.size() && !done; ++i) {
        next = verified.tokens[i];
        done = emit(next, std::span<const float>(verified.logits).subspan(i * vocab, vocab));
      }
    }
    result.decodeSeconds = seconds(start);
    return result;
  }
  for (int64_t step = 0; step < options.maxNewTokens; ++step) {
    const int64_t next = argmax(last);
    result.generated.push_back(next);
    result.generatedLogits.insert(result.generatedLogits.end(), last.begin(), last.end());
    tokens.push_back(next);
    if (step + 1 == options.maxNewTokens ||
        std::count(options.stopTokens.begin(), options.stopTokens.end(), next))
      break;
    if (options.useCaches) {
      HYBRID_ASSIGN_OR_RETURN(last, sequence->decode(next));
    } else {
      sequence.reset();
      HYBRID_ASSIGN_OR_RETURN(sequence, model.newSequence());
      HYBRID_ASSIGN_OR_RETURN(std::vector<float> all, sequence->prefill(tokens));
      last.assign(all.end() - vocab, all.end());
    }
  }
  result.decodeSeconds = seconds(start);
  return result;
}

StatusOr<GenerationResult> generate(Model &model, std::span<const int64_t> prompt,
                                    const GenerationOptions &options) {
  if (const std::string problem = samplingParamsProblem(options.sampling); !problem.empty())
    return Status::error("sampling: " + problem);
  if (samplingIsGreedy(options.sampling))
    return generateGreedy(model, prompt, options);
  return generateChoosing(model, prompt, options);
}

StatusOr<BatchDecodeReport> benchmarkBatchedDecode(Model &model, std::span<const int64_t> prompt,
                                                   int64_t batch, int64_t steps) {
  if (batch < 1 || steps < 1 || prompt.empty())
    return Status::error("benchmarkBatchedDecode: batch, steps and the prompt must not be empty");
  const int64_t vocab = model.vocabSize();
  std::vector<std::unique_ptr<Sequence>> sequences;
  std::vector<Sequence *> rows;
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i < batch; ++i) {
    HYBRID_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> sequence, model.newSequence());
    HYBRID_ASSIGN_OR_RETURN(std::vector<float> logits,
                            sequence->prefill(prompt, nullptr, PrefillLogits::LastRow));
    tokens.push_back(argmaxRow(logits, vocab, 0));
    rows.push_back(sequence.get());
    sequences.push_back(std::move(sequence));
  }
  auto step = [&]() -> Status {
    HYBRID_ASSIGN_OR_RETURN(std::vector<float> logits, model.decodeBatch(rows, tokens));
    for (int64_t i = 0; i < batch; ++i)
      tokens[static_cast<size_t>(i)] = argmaxRow(logits, vocab, i);
    return Status::ok();
  };
  HYBRID_RETURN_IF_ERROR(step()); // warm-up
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < steps; ++i)
    HYBRID_RETURN_IF_ERROR(step());
  const double elapsed = seconds(start);
  BatchDecodeReport report;
  report.batch = batch;
  report.steps = steps;
  report.stepMilliseconds = 1e3 * elapsed / static_cast<double>(steps);
  report.tokensPerSecond = static_cast<double>(batch * steps) / std::max(elapsed, 1e-12);
  return report;
}

namespace {

// One Scheduler run over `prompts` (all submitted at once): every request's tokens, and the
// decode phase's seconds and tokens (the steps after every request had its first token).
struct ScheduledRun {
  std::vector<std::vector<int64_t>> tokens;
  double decodeSeconds = 0;
  int64_t decodeTokens = 0;
  SchedulerStats stats;
};

// `continuations` (replay drafts): each prompt's tokens from a plain run, or null.
StatusOr<ScheduledRun>
runScheduled(Model &model, const std::vector<std::vector<int64_t>> &prompts,
             const SchedulerOptions &options, int64_t maxNewTokens,
             const std::vector<std::vector<int64_t>> *continuations = nullptr) {
  Scheduler scheduler(model, options);
  std::map<uint64_t, size_t> indexOf;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::span<const int64_t> continuation =
        continuations ? std::span<const int64_t>((*continuations)[i]) : std::span<const int64_t>();
    HYBRID_ASSIGN_OR_RETURN(uint64_t id, scheduler.submit({.prompt = prompts[i],
                                                           .maxNewTokens = maxNewTokens,
                                                           .stopTokens = {},
                                                           .sampling = {}},
                                                          continuation));
    indexOf[id] = i;
  }
  ScheduledRun run;
  run.tokens.resize(prompts.size());
  size_t started = 0; // requests with their first token
  while (!scheduler.idle()) {
    const bool decodePhase = started == prompts.size();
    const auto start = std::chrono::steady_clock::now();
    const std::vector<TokenEvent> events = scheduler.step();
    if (decodePhase)
      run.decodeSeconds += seconds(start);
    for (const TokenEvent &event : events) {
      if (!event.error.empty())
        return Status::error("request " + std::to_string(indexOf[event.request]) + ": " +
                             event.error);
      std::vector<int64_t> &tokens = run.tokens[indexOf[event.request]];
      if (tokens.empty())
        ++started;
      else if (decodePhase)
        ++run.decodeTokens;
      tokens.push_back(event.token);
    }
  }
  run.stats = scheduler.stats();
  return run;
}

} // namespace

StatusOr<SpeculationReport> benchmarkSpeculation(Model &model,
                                                 const std::vector<std::vector<int64_t>> &prompts,
                                                 const SpeculationOptions &options) {
  if (prompts.empty())
    return Status::error("benchmarkSpeculation: no prompts");
  SchedulerOptions plain;
  plain.prefillChunkTokens = options.prefillChunkTokens;
  plain.batchPrefillCalls = true; // several sequences' drafts verified in one pass
  // Untimed first: the cuda device captures its decode graph of this batch on first use.
  HYBRID_RETURN_IF_ERROR(
      runScheduled(model, prompts, plain, std::min<int64_t>(3, options.maxNewTokens)).status());
  HYBRID_ASSIGN_OR_RETURN(ScheduledRun reference,
                          runScheduled(model, prompts, plain, options.maxNewTokens));
  SchedulerOptions speculative = plain;
  speculative.draftTokens = options.draftTokens;
  speculative.draftSource = options.draftSource;
  speculative.draftOnlyWhenItPays = options.draftOnlyWhenItPays;
  speculative.replay = options.replay;
  // Replay drafts what the plain run just generated for each request.
  const bool replay = options.draftSource == DraftSourceKind::Replay;
  const VerifyTimings verifyBefore = model.verifyTimings();
  HYBRID_ASSIGN_OR_RETURN(ScheduledRun drafted,
                          runScheduled(model, prompts, speculative, options.maxNewTokens,
                                       replay ? &reference.tokens : nullptr));
  SpeculationReport report;
  report.prompts = static_cast<int64_t>(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    report.generatedTokens += static_cast<int64_t>(drafted.tokens[i].size());
    report.identical = report.identical && drafted.tokens[i] == reference.tokens[i];
  }
  report.plainTokensPerSecond = reference.decodeTokens / std::max(reference.decodeSeconds, 1e-9);
  report.speculativeTokensPerSecond = drafted.decodeTokens / std::max(drafted.decodeSeconds, 1e-9);
  report.verifySteps = drafted.stats.verifySteps;
  report.verifyCalls = drafted.stats.verifySteps - drafted.stats.batchedVerifySequences +
                       drafted.stats.verifyBatches;
  report.draftedTokens = drafted.stats.draftedTokens;
  report.acceptedTokens = drafted.stats.acceptedTokens;
  report.declinedDrafts = drafted.stats.declinedDrafts;
  report.verify = model.verifyTimings() - verifyBefore;

  // Per sequence: the pre-verification snapshot (fp32; on the device for the GPU's KDA layers),
  // the logged inputs of draftTokens + 1 rows per KDA layer, and the KV pages the draft rows can
  // take.
  const Model::Usage usage = model.usage();
  report.stateSnapshotBytes = usage.recurrentStateBytes;
  const bool onGpu = !model.placementReport().empty();
  const uint64_t rows = static_cast<uint64_t>(options.draftTokens + 1);
  if (const auto *recurrent = model.plan().cache()->recurrent())
    for (const auto *layer : *recurrent) {
      const uint64_t heads = static_cast<uint64_t>(layer->num_heads());
      const uint64_t P = heads * static_cast<uint64_t>(layer->head_k_dim());
      // cpu (KdaReplayLog): pre-conv q, k, v and q, k, v, g (7P) and beta (H) per row; cuda
      // (the device log): q, k, v (3P), forget (P), beta (H), gate (P) and an output row (P).
      report.replayLogBytes += rows * ((onGpu ? 6 : 7) * P + heads) * sizeof(float);
    }
  if (model.plan().cache()->kv() && model.plan().cache()->kv()->size() > 0) {
    HYBRID_ASSIGN_OR_RETURN(uint64_t pageBytes, PagedKvCache::bytesPerPage(*model.plan().cache()));
    // A pass of `rows` tokens spans at most pagesFor(rows) + 1 pages, the first already held.
    report.kvTailBytes = static_cast<uint64_t>(model.pagesFor(static_cast<int64_t>(rows))) * pageBytes;
  }
  report.rollbackBytesPerSequence =
      report.stateSnapshotBytes + report.replayLogBytes + report.kvTailBytes;
  return report;
}

int64_t adaptDraftLength(int64_t current, int64_t maximum, int64_t drafted, int64_t accepted) {
  if (drafted == 0)
    return current;
  if (accepted == drafted)
    return std::min(maximum, current + 1);
  if (2 * accepted < drafted)
    return std::max<int64_t>(1, current - 1);
  return current;
}

std::vector<int64_t> promptLookupDraft(std::span<const int64_t> context, int64_t maxTokens,
                                       int64_t maxNgram) {
  const auto length = static_cast<int64_t>(context.size());
  if (maxTokens <= 0)
    return {};
  for (int64_t n = std::min(maxNgram, length - 1); n >= 1; --n) {
    const auto tail = context.last(static_cast<size_t>(n));
    // The most recent earlier occurrence, so the draft follows the latest repetition.
    for (int64_t at = length - n - 1; at >= 0; --at) {
      if (!std::equal(tail.begin(), tail.end(), context.begin() + at))
        continue;
      const int64_t from = at + n;
      const int64_t count = std::min(maxTokens, length - from);
      return std::vector<int64_t>(context.begin() + from, context.begin() + from + count);
    }
  }
  return {};
}

StatusOr<std::vector<int64_t>> readInputIds(const std::string &spec) {
  // A list when it has a comma or only digits; otherwise a file.
  if (spec.find(',') != std::string::npos ||
      spec.find_first_not_of("0123456789 ") == std::string::npos) {
    std::vector<int64_t> ids;
    std::stringstream stream(spec);
    std::string item;
    while (std::getline(stream, item, ',')) {
      item.erase(std::remove(item.begin(), item.end(), ' '), item.end());
      if (item.empty())
        return Status::error("--input-ids '" + spec + "': empty entry in the list");
      int64_t id = 0;
      auto [end, error] = std::from_chars(item.data(), item.data() + item.size(), id);
      if (error != std::errc() || end != item.data() + item.size())
        return Status::error("--input-ids: '" + item + "' is not a token id");
      ids.push_back(id);
    }
    if (ids.empty())
      return Status::error("--input-ids: no token ids given");
    return ids;
  }
  HYBRID_ASSIGN_OR_RETURN(safetensors::File file, safetensors::File::open(spec));
  const safetensors::TensorInfo *info = file.find("input_ids");
  if (!info)
    return Status::error(spec + ": no tensor 'input_ids'");
  if (!(info->shape.size() == 1 || (info->shape.size() == 2 && info->shape[0] == 1)))
    return Status::error(spec + ": tensor 'input_ids' must be [T] or [1, T]");
  HYBRID_ASSIGN_OR_RETURN(std::vector<int64_t> ids, safetensors::readAsInt64(file, *info));
  if (ids.empty())
    return Status::error(spec + ": tensor 'input_ids' is empty");
  return ids;
}

Status writeGeneration(const std::string &path, const GenerationResult &result) {
  const int64_t T = static_cast<int64_t>(result.prompt.size());
  const int64_t N = static_cast<int64_t>(result.generated.size());
  std::vector<safetensors::TensorView> tensors;
  tensors.push_back({"logits", safetensors::DType::F32, {1, T, result.vocabSize},
                     asBytes(result.promptLogits)});
  tensors.push_back({"gen_ids", safetensors::DType::I64, {1, N},
                     std::as_bytes(std::span(result.generated))});
  if (!result.generatedLogits.empty() || N == 0) // sampled generation keeps no logits
    tensors.push_back({"gen_logits", safetensors::DType::F32, {N, result.vocabSize},
                       asBytes(result.generatedLogits)});
  tensors.push_back({"input_ids", safetensors::DType::I64, {1, T},
                     std::as_bytes(std::span(result.prompt))});
  const auto &layers = result.hidden.layers;
  std::vector<std::string> names;
  for (size_t i = 0; i < layers.size(); ++i)
    names.push_back(i + 1 == layers.size() ? "hidden.final" : "hidden." + std::to_string(i));
  for (size_t i = 0; i < layers.size(); ++i)
    tensors.push_back({names[i], safetensors::DType::F32, {1, T, result.hidden.width},
                       asBytes(layers[i])});
  return safetensors::write(path, tensors, {{"format", "hybrid-run"}});
}

StatusOr<ComparisonReport> compareWithReference(const std::string &referencePath,
                                                const GenerationResult &result, double tolerance) {
  HYBRID_ASSIGN_OR_RETURN(safetensors::File reference, safetensors::File::open(referencePath));
  ComparisonReport report;
  auto floats = [&](const std::string &name) -> StatusOr<std::vector<float>> {
    const safetensors::TensorInfo *info = reference.find(name);
    if (!info)
      return Status::error(referencePath + ": no tensor '" + name + "'");
    return safetensors::readAsFloat(reference, *info);
  };

  HYBRID_ASSIGN_OR_RETURN(std::vector<float> logits, floats("logits"));
  if (logits.size() != result.promptLogits.size())
    return Status::error(referencePath + ": tensor 'logits' has " + std::to_string(logits.size()) +
                         " values, the run made " + std::to_string(result.promptLogits.size()) +
                         " (same prompt and model?)");
  report.maxLogitsDiff = maxAbsDiff(logits, result.promptLogits);
  report.lines.push_back("prompt logits: max abs diff " + format(report.maxLogitsDiff) +
                         (report.maxLogitsDiff <= tolerance ? " (within " : " (OVER ") +
                         format(tolerance) + ")");

  report.genIdsMatch = true;
  if (const safetensors::TensorInfo *info = reference.find("gen_ids")) {
    HYBRID_ASSIGN_OR_RETURN(std::vector<int64_t> ids, safetensors::readAsInt64(reference, *info));
    const size_t common = std::min(ids.size(), result.generated.size());
    report.comparedGenIds = static_cast<int64_t>(common);
    report.genIdsMatch = std::equal(ids.begin(), ids.begin() + common, result.generated.begin());
    report.lines.push_back("gen_ids: " + std::to_string(common) + " compared, " +
                           (report.genIdsMatch ? "identical" : "DIFFERENT"));
  }

  // Hidden states: ours are hidden.0 (embedding) .. hidden.<L> (each layer) + hidden.final.
  // References come as ours (hybrid-run --output --dump-hidden: those names), as L + 2 numbered
  // entries (the last is the final norm's output), or in the HF convention: L + 1 numbered
  // entries, the one after the last layer being the final norm's output.
  const auto &ours = result.hidden.layers;
  if (!ours.empty()) {
    const size_t numLayers = ours.size() - 2;
    const bool namedFinal = reference.find("hidden.final") != nullptr;
    const bool perLayerPlusFinal = reference.find("hidden." + std::to_string(numLayers + 1));
    auto compare = [&](const std::string &name, size_t mine) -> Status {
      HYBRID_ASSIGN_OR_RETURN(std::vector<float> expected, floats(name));
      const double diff = maxAbsDiff(expected, ours[mine]);
      if (diff > tolerance && report.firstDivergingHidden.empty()) {
        report.firstDivergingHidden = name;
        report.firstDivergingDiff = diff;
      }
      return Status::ok();
    };
    for (size_t i = 0;; ++i) {
      const std::string name = "hidden." + std::to_string(i);
      if (!reference.find(name))
        break;
      const bool isFinal = !namedFinal && ((!perLayerPlusFinal && i == numLayers) ||
                                           (perLayerPlusFinal && i == numLayers + 1));
      const size_t mine = isFinal ? ours.size() - 1 : i;
      if (mine >= ours.size() || (!isFinal && mine == ours.size() - 1))
        break;
      HYBRID_RETURN_IF_ERROR(compare(name, mine));
    }
    if (namedFinal)
      HYBRID_RETURN_IF_ERROR(compare("hidden.final", ours.size() - 1));
    report.lines.push_back(report.firstDivergingHidden.empty()
                               ? "hidden states: every layer within tolerance"
                               : "hidden states: first divergence at " +
                                     report.firstDivergingHidden + " (max abs diff " +
                                     format(report.firstDivergingDiff) + ")");
  }
  report.passed = report.maxLogitsDiff <= tolerance && report.genIdsMatch &&
                  report.firstDivergingHidden.empty();
  return report;
}

} // namespace hybrid
