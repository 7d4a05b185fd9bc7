// hybrid-run: run a compiled model (plan.hyplan + weights.hyw) on a prompt, greedy decoding or
// sampling (--temperature, --top-p, --top-k, --seed).
#include "hybrid/runtime/Communicator.h"
#include "hybrid/runtime/Generate.h"
#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Sampling.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <thread>
#include <unistd.h>

namespace {

// Seconds from this process's start to now, from the kernel's record of its start (field 22 of
// /proc/self/stat, clock ticks since boot): what loading the executable and its shared libraries
// took before main. Negative where /proc cannot say.
double secondsSinceProcessStart() {
  std::ifstream file("/proc/self/stat");
  const std::string stat{std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
  const size_t nameEnd = stat.rfind(')'); // the command name (field 2) may hold spaces
  timespec now{};
  const long ticksPerSecond = sysconf(_SC_CLK_TCK);
  if (nameEnd == std::string::npos || ticksPerSecond <= 0 || clock_gettime(CLOCK_BOOTTIME, &now))
    return -1;
  std::istringstream fields(stat.substr(nameEnd + 1));
  std::string skipped;
  for (int field = 3; field < 22; ++field)
    fields >> skipped;
  unsigned long long startTicks = 0;
  if (!(fields >> startTicks))
    return -1;
  return double(now.tv_sec) + 1e-9 * double(now.tv_nsec) - double(startTicks) / ticksPerSecond;
}

double secondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

} // namespace

int main(int argc, char **argv) {
  const auto mainStart = std::chrono::steady_clock::now();
  const double beforeMain = secondsSinceProcessStart();
  CLI::App app{"Run a model compiled by hybrid-compile"};
  std::string modelDir, inputIds, output, compareWith;
  hybrid::LoadOptions load;
  hybrid::GenerationOptions generation;
  bool noCacheDecode = false;
  double tolerance = 2e-3;
  app.add_option("model_dir", modelDir, "Directory written by hybrid-compile")->required();
  app.add_option("--device", load.device,
                 "cpu (the reference), or cuda for a plan compiled with --device=cuda")
      ->default_val("cpu");
  app.add_option("--input-ids", inputIds, "Prompt: a list 1,2,3 or a safetensors file with "
                                          "input_ids")
      ->required();
  app.add_option("--max-new-tokens", generation.maxNewTokens, "Tokens to generate")
      ->default_val(16)
      ->check(CLI::NonNegativeNumber);
  app.add_option("--output", output,
                 "Write logits [1,T,V], gen_ids [1,N], gen_logits [N,V] (golden layout)");
  app.add_option("--speculate", generation.draftTokens,
                 "Speculative decoding with drafts of at most this many tokens (greedy outputs "
                 "do not change)")
      ->default_val(0)
      ->check(CLI::NonNegativeNumber);
  // Range checks are the sampling definition's own (samplingParamsProblem), after parsing.
  app.add_option("--temperature", generation.sampling.temperature,
                 "Sampling temperature (0: greedy, the default)")
      ->default_val(0.0f);
  app.add_option("--top-p", generation.sampling.topP,
                 "Nucleus sampling: the most probable tokens whose mass reaches P, in (0, 1]")
      ->default_val(1.0f);
  app.add_option("--top-k", generation.sampling.topK,
                 "Sample among the K most probable tokens (0: all)")
      ->default_val(0);
  app.add_option("--seed", generation.sampling.seed,
                 "Seed of the sampling's random numbers (the same seed, the same tokens)")
      ->default_val(0)
      ->check(CLI::NonNegativeNumber);
  std::string draftSource = "prompt-lookup";
  app.add_option("--draft", draftSource,
                 "Where --speculate's drafts come from: prompt-lookup (any model) or mtp (the "
                 "model's multi-token-prediction layer; a plan with an mtp program)")
      ->default_val("prompt-lookup");
  app.add_flag("--dump-hidden", generation.dumpHidden,
               "Also write hidden.<i> (after the embedding and each layer) and hidden.final");
  app.add_flag("--no-cache-decode", noCacheDecode,
               "Re-run the whole sequence for every new token instead of decoding with caches");
  app.add_option("--compare-with", compareWith,
                 "Reference safetensors (golden layout): report logits diff, gen_ids and the "
                 "first diverging layer; exit 1 when outside --tolerance");
  app.add_option("--tolerance", tolerance, "Max abs difference accepted by --compare-with")
      ->default_val(2e-3);
  app.add_option("--max-context", load.maxContextTokens, "KV-cache capacity in tokens")
      ->default_val(8192);
  app.add_option("--schedule-seed", load.scheduleSeed,
                 "cpu: run steps in a random order that respects the plan's streams and events "
                 "(0: program order)")
      ->default_val(0);
  app.add_flag("--bf16-gemm-inputs", load.bf16GemmInputs,
               "cuda: round GEMM inputs to bf16 instead of splitting them into two bf16 halves");
  app.add_option("--kda-prefill", load.kdaPrefill,
                 "cuda: KDA prefill kernel: auto (chunked where compiled, the default), chunked "
                 "(bf16 tensor cores) or recurrent (fp32)")
      ->default_val("auto")
      ->check(CLI::IsMember({"auto", "chunked", "recurrent"}));
  app.add_flag("--batch-invariant", load.batchInvariant,
               "cuda: a row's results do not depend on the rows sharing its call (a sequence's "
               "tokens the same at any batch, with or without speculation); slower at small "
               "batches");
  app.add_flag("--kda-bf16-state", load.kdaBf16State,
               "cuda: keep the KDA recurrent states in bf16 (half the memory and traffic)");
  app.add_option("--tuning-cache", load.tuningCache,
                 "cuda: kernel configurations tuned on this GPU (hybrid-bench tune): 'default' "
                 "(the compilation cache folder), a folder, or 'off' (the kernels' defaults)")
      ->default_val("default");
  bool noCudaGraphs = false;
  app.add_flag("--no-cuda-graphs", noCudaGraphs,
               "cuda: launch every kernel each step instead of replaying CUDA graphs (decode "
               "steps, and prefill / verification calls of up to 16 rows)");
  bool noPrefillGraphs = false;
  app.add_flag("--no-prefill-graphs", noPrefillGraphs,
               "cuda: launch the kernels of prefill / verification calls one by one (decode "
               "steps still replay graphs)");
  app.add_flag("--verify-weights", load.verifyWeightContents,
               "Re-hash every weight archive entry while loading");
  int worldSize = 1;
  app.add_option("--world-size", worldSize,
                 "Run a sharded model (hybrid-compile --shard) as this many rank threads of one "
                 "process over the loopback communicator; rank 0 reports (cuda: every rank on "
                 "the current GPU, collectives staged through the host: a correctness mode). "
                 "Without it, RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT make "
                 "this process one rank of a multi-process launch (cpu: over TCP; cuda: NCCL on "
                 "GPU LOCAL_RANK)")
      ->default_val(1)
      ->check(CLI::Range(1, 64));
  app.add_flag("--synthetic-weights", load.syntheticWeights,
               "Generate the weights of an archive compiled with hybrid-compile "
               "--synthetic-weights (seeded random values, on the GPU with --device cuda)");
  CLI11_PARSE(app, argc, argv);
  load.cudaGraphs = !noCudaGraphs;
  load.prefillGraphs = !noPrefillGraphs;

  auto fail = [](const std::string &message) {
    std::cerr << "error: " << message << "\n";
    return 1;
  };
  if (const std::string problem = hybrid::samplingParamsProblem(generation.sampling);
      !problem.empty()) {
    // The definition names the field (temperature, top_k, top_p): name the flag that set it.
    const std::string flag = problem.starts_with("top_k")   ? "--top-k"
                             : problem.starts_with("top_p") ? "--top-p"
                                                            : "--temperature";
    return fail(flag + ": " + problem);
  }
  if (generation.draftTokens > 0 && !hybrid::samplingIsGreedy(generation.sampling))
    std::cerr << "note: --speculate is ignored when sampling (drafts are verified greedily)\n";
  generation.useCaches = !noCacheDecode;
  if (!compareWith.empty())
    generation.dumpHidden = true;
  // Logits leave the device only for what writes or compares them: else greedy steps choose
  // there (the decode rate printed is the engine's, not a 0.66 MB copy per token).
  generation.keepLogits = !output.empty() || !compareWith.empty();

  auto drafts = hybrid::parseDraftSource(draftSource);
  if (!drafts)
    return fail("--draft: " + drafts.status().message());
  if (*drafts == hybrid::DraftSourceKind::Replay)
    return fail("--draft replay: " + std::string(hybrid::kReplayNeedsReference));
  generation.draftSource = *drafts;
  auto prompt = hybrid::readInputIds(inputIds);
  if (!prompt)
    return fail(prompt.status().message());
  // A sharded model: ranks 1.. run the same generation on their own threads (every rank must
  // make the same calls, so the collectives line up) and must arrive at the same tokens.
  std::vector<std::unique_ptr<hybrid::comm::Communicator>> group;
  std::vector<std::thread> peers;
  std::vector<hybrid::Status> peerStatus(static_cast<size_t>(worldSize), hybrid::Status::ok());
  std::vector<std::vector<int64_t>> peerTokens(static_cast<size_t>(worldSize));
  std::vector<uint64_t> indexerPairs(static_cast<size_t>(worldSize)); // per rank (Model::Usage)
  auto joinPeers = [&]() {
    for (std::thread &peer : peers)
      peer.join();
    peers.clear();
  };
  if (worldSize > 1) {
    auto made = hybrid::comm::makeLoopbackGroup(worldSize);
    if (!made)
      return fail(made.status().message());
    group = std::move(*made);
    for (int rank = 1; rank < worldSize; ++rank)
      peers.emplace_back([&, rank] {
        hybrid::LoadOptions rankLoad = load;
        rankLoad.communicator = group[static_cast<size_t>(rank)].get();
        auto peer = hybrid::Model::load(modelDir, rankLoad);
        if (!peer) {
          peerStatus[static_cast<size_t>(rank)] = peer.status();
          return;
        }
        auto generated = hybrid::generate(**peer, *prompt, generation);
        if (!generated) {
          peerStatus[static_cast<size_t>(rank)] = generated.status();
          return;
        }
        peerTokens[static_cast<size_t>(rank)] = generated->generated;
        indexerPairs[static_cast<size_t>(rank)] = (*peer)->usage().indexerScoredPairs;
      });
    load.communicator = group[0].get();
  }
  // The multi-process launch (torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
  // MASTER_PORT): this process is one rank, connected to the others over TCP (cpu) or NCCL on GPU
  // LOCAL_RANK (cuda); rank 0 reports.
  std::unique_ptr<hybrid::comm::Communicator> processRank;
  if (worldSize == 1) {
    auto connected = hybrid::comm::connectFromEnvironment(load.device);
    if (!connected)
      return fail(connected.status().message());
    processRank = std::move(*connected);
    load.communicator = processRank.get();
  }
  auto failRanks = [&](const std::string &message) {
    joinPeers();
    std::string all = worldSize > 1 ? "rank 0: " + message : message;
    if (processRank) // every process reports its own failure: say which rank it is
      all = "rank " + std::to_string(processRank->rank()) + ": " + message;
    for (int rank = 1; rank < worldSize; ++rank)
      if (!peerStatus[static_cast<size_t>(rank)])
        all += "\nrank " + std::to_string(rank) + ": " +
               peerStatus[static_cast<size_t>(rank)].message();
    return fail(all);
  };

  auto model = hybrid::Model::load(modelDir, load);
  if (!model)
    return failRanks(model.status().message());

  if (const std::string placement = (*model)->placementReport(); !placement.empty())
    std::cerr << placement;
  if (load.syntheticWeights) {
    const hybrid::WeightGeneration &generated = (*model)->weightGeneration();
    std::fprintf(stderr, "synthetic weights: %.3f GB generated on the device in %.3f s, "
                 "%.3f GB on the host in %.3f s\n",
                 generated.deviceBytes / 1e9, generated.deviceSeconds, generated.hostBytes / 1e9,
                 generated.hostSeconds);
  }
  const hybrid::LoadTimings &loadTimings = (*model)->loadTimings();
  std::fprintf(stderr, "load: %s\n", loadTimings.summary().c_str());
  const double mainToGenerate = secondsSince(mainStart);
  auto result = hybrid::generate(**model, *prompt, generation);
  if (!result)
    return failRanks(result.status().message());
  // Cold start: process start (main where /proc cannot say) to the first token, the prefill's.
  const double coldStart = std::max(0.0, beforeMain) + mainToGenerate + result->prefillSeconds;
  std::fprintf(stderr,
               "cold start to the first token: %.3f s from %s (before main %.3f, load %.3f, "
               "rest of main %.3f, prefill %.3f)\n",
               coldStart, beforeMain >= 0 ? "process start" : "main", std::max(0.0, beforeMain),
               loadTimings.totalSeconds, mainToGenerate - loadTimings.totalSeconds,
               result->prefillSeconds);
  joinPeers();
  for (int rank = 1; rank < worldSize; ++rank) {
    if (!peerStatus[static_cast<size_t>(rank)])
      return failRanks("rank " + std::to_string(rank) + " failed");
    if (peerTokens[static_cast<size_t>(rank)] != result->generated)
      return fail("rank " + std::to_string(rank) + " generated other tokens than rank 0: the "
                  "ranks' logits differ");
  }

  if (processRank && processRank->rank() != 0)
    return 0; // rank 0 reports (every rank computed the same logits)
  indexerPairs[0] = (*model)->usage().indexerScoredPairs;

  std::cout << "generated:";
  for (int64_t id : result->generated)
    std::cout << " " << id;
  std::cout << "\n";
  const double decodeTokens = std::max<double>(0, double(result->generated.size()) - 1);
  std::printf("prompt %zu tokens, time to first token %.1f ms (%.0f tokens/s prefill), "
              "%.1f tokens/s decode\n",
              result->prompt.size(), 1e3 * result->prefillSeconds,
              result->prompt.size() / std::max(result->prefillSeconds, 1e-9),
              decodeTokens / std::max(result->decodeSeconds, 1e-9));
  if (generation.draftTokens > 0 && hybrid::samplingIsGreedy(generation.sampling))
    std::printf("speculative (%s drafts): %lld verification passes, %lld draft tokens, "
                "%lld accepted (%.0f%%), %.2f tokens per pass\n",
                std::string(hybrid::draftSourceName(generation.draftSource)).c_str(),
                static_cast<long long>(result->verifySteps),
                static_cast<long long>(result->draftedTokens),
                static_cast<long long>(result->acceptedTokens),
                100.0 * result->acceptedTokens / std::max<int64_t>(1, result->draftedTokens),
                decodeTokens / std::max<double>(1, double(result->verifySteps)));
  // The DSA indexer's work per rank thread (counted pairs, not time): context parallelism
  // should spread it evenly.
  if (worldSize > 1 && indexerPairs[0] > 0) {
    std::printf("indexer pairs per rank:");
    for (uint64_t pairs : indexerPairs)
      std::printf(" %llu", static_cast<unsigned long long>(pairs));
    std::printf("\n");
  }

  if (!output.empty()) {
    hybrid::Status written = hybrid::writeGeneration(output, *result);
    if (!written)
      return fail(written.message());
  }
  if (!compareWith.empty()) {
    auto report = hybrid::compareWithReference(compareWith, *result, tolerance);
    if (!report)
      return fail(report.status().message());
    for (const std::string &line : report->lines)
      std::cout << line << "\n";
    std::cout << (report->passed ? "MATCH" : "MISMATCH") << "\n";
    return report->passed ? 0 : 1;
  }
  return 0;
}
