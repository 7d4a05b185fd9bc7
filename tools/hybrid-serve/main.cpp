// hybrid-serve: an OpenAI-compatible HTTP server for a model compiled by hybrid-compile.
#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Server.h"
#include "hybrid/runtime/Tokenizer.h"

#include <CLI/CLI.hpp>

#include <csignal>
#include <pthread.h>
#include <cstdio>
#include <iostream>
#include <thread>

int main(int argc, char **argv) {
  CLI::App app{"Serve a model compiled by hybrid-compile (OpenAI-compatible HTTP)"};
  std::string modelDir;
  hybrid::LoadOptions load;
  hybrid::ServeOptions serve;
  app.add_option("model_dir", modelDir, "Directory written by hybrid-compile")->required();
  app.add_option("--device", load.device, "cpu or cuda")->default_val("cpu");
  app.add_option("--host", serve.host, "Address to listen on")->default_val("127.0.0.1");
  app.add_option("--port", serve.port, "Port (0: any free one, printed)")->default_val(8000);
  app.add_option("--api-key", serve.apiKey,
                 "Require 'Authorization: Bearer KEY' (needed off loopback)");
  app.add_option("--read-timeout", serve.readTimeoutSeconds,
                 "Seconds a client may stall while sending a request")
      ->default_val(serve.readTimeoutSeconds)->check(CLI::PositiveNumber);
  app.add_option("--write-timeout", serve.writeTimeoutSeconds,
                 "Seconds a client may stall while reading a response")
      ->default_val(serve.writeTimeoutSeconds)->check(CLI::PositiveNumber);
  app.add_option("--model-name", serve.modelName, "The id /v1/models reports")
      ->default_val("hybrid");
  app.add_option("--max-sequences", load.maxSequences, "Requests running at once")
      ->default_val(4)
      ->check(CLI::PositiveNumber);
  app.add_option("--max-context", load.maxContextTokens, "Longest sequence in tokens")
      ->default_val(8192)
      ->check(CLI::PositiveNumber);
  app.add_option("--kv-cache-tokens", load.kvCacheTokens,
                 "KV-cache capacity over all sequences (0: max-sequences x max-context)")
      ->default_val(0)
      ->check(CLI::NonNegativeNumber);
  app.add_option("--prefix-cache", load.prefixCacheEntries,
                 "Prompt prefixes kept for reuse (0: off)")
      ->default_val(0)
      ->check(CLI::NonNegativeNumber);
  app.add_option("--speculate", serve.scheduler.draftTokens,
                 "Speculative decoding with drafts of at most this many tokens (0: off); "
                 "greedy requests only, sampled ones decode without drafts")
      ->default_val(0)
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--batch-invariant", load.batchInvariant,
               "cuda: a request's tokens do not depend on the requests batched with it, nor on "
               "--speculate (LoadOptions::batchInvariant); slower at small batches");
  std::string draftSource = "prompt-lookup";
  app.add_option("--draft", draftSource,
                 "Where --speculate's drafts come from: prompt-lookup or mtp (the model's "
                 "multi-token-prediction layer)")
      ->default_val("prompt-lookup");
  std::string tokenizerDir, chatFormat = "auto";
  app.add_option("--tokenizer", tokenizerDir,
                 "Checkpoint directory with tokenizer.json or tiktoken.model (+ "
                 "tokenizer_config.json): text prompts, chat completions, decoded text");
  app.add_option("--chat-format", chatFormat,
                 "auto (from the tokenizer), kimi, deepseek-v3, deepseek-v3.2 or none")
      ->default_val("auto");
  app.add_flag("--synthetic-weights", load.syntheticWeights,
               "The model was compiled with --synthetic-weights: its values are generated at "
               "load (benchmarks of full-size shapes; never serve them for real)");
  app.add_option("--prefill-chunk", serve.scheduler.prefillChunkTokens,
                 "Prompt tokens a request gets per scheduler step")
      ->default_val(256)
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  // SIGINT / SIGTERM are taken by a thread of their own (sigwait), never by a handler: stopping
  // joins threads, which a signal handler must not do. Blocked before any thread starts, so every
  // thread inherits the mask.
  sigset_t stopSignals;
  sigemptyset(&stopSignals);
  sigaddset(&stopSignals, SIGINT);
  sigaddset(&stopSignals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stopSignals, nullptr);

  std::unique_ptr<hybrid::Tokenizer> tokenizer;
  auto format = hybrid::parseChatFormat(chatFormat);
  if (!format) {
    std::cerr << "error: --chat-format: " << format.status().message() << "\n";
    return 1;
  }
  serve.chatFormat = *format;
  if (!tokenizerDir.empty()) {
    auto loaded = hybrid::Tokenizer::load(tokenizerDir);
    if (!loaded) {
      std::cerr << "error: " << loaded.status().message() << "\n";
      return 1;
    }
    tokenizer = std::move(*loaded);
    serve.tokenizer = tokenizer.get();
    std::cerr << "hybrid-serve: tokenizer " << tokenizerDir << " (" << tokenizer->vocabSize()
              << " ids, chat format "
              << hybrid::chatFormatName(serve.chatFormat.value_or(tokenizer->chatFormat()))
              << ")\n";
  }

  auto drafts = hybrid::parseDraftSource(draftSource);
  if (!drafts) {
    std::cerr << "error: --draft: " << drafts.status().message() << "\n";
    return 1;
  }
  if (*drafts == hybrid::DraftSourceKind::Replay) {
    std::cerr << "error: --draft replay: " << hybrid::kReplayNeedsReference << "\n";
    return 1;
  }
  serve.scheduler.draftSource = *drafts;

  std::cerr << "hybrid-serve: loading " << modelDir << " (" << load.device << ")\n";
  auto model = hybrid::Model::load(modelDir, load);
  if (!model) {
    std::cerr << "error: " << model.status().message() << "\n";
    return 1;
  }
  if (*drafts == hybrid::DraftSourceKind::Mtp && !(*model)->hasMtp()) {
    std::cerr << "error: --draft mtp: " << modelDir << "/plan.hyplan has no 'mtp' program (the "
                 "checkpoint has no multi-token-prediction layer)\n";
    return 1;
  }
  std::cerr << "hybrid-serve: loaded in " << (*model)->loadTimings().summary() << "\n";
  if (const hybrid::WeightGeneration &g = (*model)->weightGeneration();
      g.hostBytes + g.deviceBytes > 0)
    std::cerr << "hybrid-serve: synthetic weights: " << double(g.deviceBytes) / 1e9
              << " GB generated on the device, " << double(g.hostBytes) / 1e9
              << " GB on the host\n";
  auto server = hybrid::Server::start(**model, serve);
  if (!server) {
    std::cerr << "error: " << server.status().message() << "\n";
    return 1;
  }
  hybrid::Server &running = **server;
  std::thread stopper([&running, stopSignals] {
    int signal = 0;
    sigwait(&stopSignals, &signal);
    running.stop();
  });
  std::printf("hybrid-serve: listening on http://%s:%d\n", serve.host.c_str(), running.port());
  std::fflush(stdout);
  const hybrid::Status served = running.serve();
  if (served) {
    stopper.join(); // serve() returns only after a stop, which came from the signal
  } else {
    running.stop();
    pthread_kill(stopper.native_handle(), SIGTERM); // wake the waiting thread
    stopper.join();
  }
  if (!served) {
    std::cerr << "error: " << served.message() << "\n";
    return 1;
  }
  return 0;
}
