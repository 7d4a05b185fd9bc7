// An OpenAI-compatible HTTP server over a Model (hybrid-serve): an engine thread runs the
// Scheduler while HTTP threads queue requests and wait for (or stream) their tokens.
// Endpoints: GET /health, /ready, /v1/models, /metrics (Prometheus text); POST /v1/completions
// with a prompt of token ids ("prompt": [ids]) or, with a tokenizer, text; POST
// /v1/chat/completions with "messages" (a tokenizer with a chat format needed); "max_tokens",
// "stream" (server-sent events), "stop_token_ids", and sampling: "temperature" (absent: greedy,
// not OpenAI's 1, so outputs are deterministic unless asked otherwise), "top_p", "top_k" (-1 or
// 0: off) and "seed" (absent: one drawn by the server). Generated ids come back in "token_ids", and
// with a tokenizer as "text" (chat: message "content"), special tokens left out; streamed text is
// decoded incrementally so a character split over tokens comes out whole.
#pragma once

#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Scheduler.h"
#include "hybrid/runtime/Status.h"
#include "hybrid/runtime/Tokenizer.h"

#include <memory>
#include <string>

namespace hybrid {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8000;             // 0: any free port (see Server::port)
  std::string apiKey;          // required ("Authorization: Bearer KEY") when not empty; a host
                               // other than loopback needs one
  std::string modelName = "hybrid";
  SchedulerOptions scheduler;
  size_t maxBodyBytes = 1 << 20;
  size_t maxQueuedRequests = 256; // waiting + running; more get 503
  int64_t defaultMaxTokens = 16;
  // A client that stops sending (a request's headers or body) or reading (a response) loses its
  // connection after about keepAliveSeconds + readTimeoutSeconds (cpp-httplib first waits up to
  // the keep-alive time for more bytes), so stalled clients cannot hold the server's threads.
  // Header lines are bounded by cpp-httplib (longer ones get 400).
  int readTimeoutSeconds = 30;
  int writeTimeoutSeconds = 30;
  int keepAliveSeconds = 5; // an idle kept-alive connection is closed after this
  // Text prompts, chat and decoded text need one (hybrid-serve --tokenizer DIR); it must outlive
  // the server. chatFormat overrides the format the tokenizer detected.
  const Tokenizer *tokenizer = nullptr;
  std::optional<ChatFormat> chatFormat;
};

// A /v1/completions body: the request the scheduler gets, and whether to stream. Checks the JSON
// shape only (token ranges and lengths are the scheduler's to check); the error is the message a
// 400 response carries, naming the field. A text prompt is encoded with the tokenizer (special
// tokens parsed, BOS first where its config asks for one); without one it is refused.
struct CompletionRequest {
  GenerationRequest generation;
  bool stream = false;
  bool seeded = false; // the body gave a "seed" (otherwise the server draws one)
};
StatusOr<CompletionRequest> parseCompletionRequest(const std::string &body,
                                                   int64_t defaultMaxTokens,
                                                   const Tokenizer *tokenizer = nullptr);
// A /v1/chat/completions body: "messages" ([{"role", "content" (text, or an array of
// {"type": "text", "text"} parts), "name"?}]) rendered in `format` and encoded; the format's
// end-of-turn tokens join the stop tokens.
StatusOr<CompletionRequest> parseChatRequest(const std::string &body, int64_t defaultMaxTokens,
                                             const Tokenizer *tokenizer, ChatFormat format);

class Server {
public:
  // Binds the socket and starts the engine thread; fails with the reason (bad options, port in
  // use). The model must outlive the server.
  static StatusOr<std::unique_ptr<Server>> start(Model &model, const ServeOptions &options);
  ~Server(); // stops
  Server(const Server &) = delete;
  Server &operator=(const Server &) = delete;

  int port() const;
  // Serves until stop() (from another thread or a signal handler's thread).
  Status serve();
  void stop();

  struct Impl;

private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

} // namespace hybrid
