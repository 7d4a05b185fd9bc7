#include "hybrid/runtime/Server.h"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <limits>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <sys/socket.h>

namespace hybrid {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

// A Prometheus histogram (cumulative buckets, sum, count).
class Histogram {
public:
  void observe(double seconds) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < kBounds.size(); ++i)
      counts_[i] += seconds <= kBounds[i] ? 1 : 0;
    sum_ += seconds;
    ++count_;
  }
  void write(std::ostringstream &out, const std::string &name, const std::string &help) const {
    std::lock_guard<std::mutex> lock(mutex_);
    out << "# HELP " << name << " " << help << "\n# TYPE " << name << " histogram\n";
    for (size_t i = 0; i < kBounds.size(); ++i)
      out << name << "_bucket{le=\"" << kBounds[i] << "\"} " << counts_[i] << "\n";
    out << name << "_bucket{le=\"+Inf\"} " << count_ << "\n"
        << name << "_sum " << sum_ << "\n"
        << name << "_count " << count_ << "\n";
  }

private:
  static constexpr std::array<double, 11> kBounds = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                     0.5,   1.0,  2.5,   5.0,  10.0};
  mutable std::mutex mutex_;
  std::array<uint64_t, kBounds.size()> counts_{};
  double sum_ = 0;
  uint64_t count_ = 0;
};

// One HTTP request waiting on the engine for its tokens.
struct Pending {
  GenerationRequest request;
  Clock::time_point submitted = Clock::now();
  Clock::time_point lastToken;
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<TokenEvent> events; // not yet taken by the HTTP side
  bool done = false;
  bool rejected = false; // refused by the scheduler: a client error
  std::atomic<bool> abandoned{false}; // its client left (a stream that could not be written)
  std::string error;
};

bool isLoopback(const std::string &host) {
  return host == "127.0.0.1" || host == "localhost" || host == "::1";
}

// A seed for a request that gave none: 64 bits from the operating system's entropy.
uint64_t drawSeed() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

json errorBody(const std::string &message, const std::string &type) {
  return json{{"error", {{"message", message}, {"type", type}}}};
}

} // namespace

struct Server::Impl {
  Model &model;
  ServeOptions options;
  httplib::Server http;
  int port = 0;
  Scheduler scheduler; // the engine thread's alone

  std::mutex mutex; // guards inbox, stopping, queued and the published statistics
  std::condition_variable wake;
  std::deque<std::shared_ptr<Pending>> inbox;
  bool stopping = false;
  size_t queued = 0; // requests in the inbox or the scheduler
  SchedulerStats published;
  Model::Usage usage;
  std::thread engine;
  std::atomic<bool> ready{false};

  std::atomic<uint64_t> requests{0}, failedRequests{0}, generatedTokens{0}, nextCompletion{1};
  Histogram timeToFirstToken, interTokenLatency;

  Impl(Model &model, ServeOptions options)
      : model(model), options(std::move(options)), scheduler(model, this->options.scheduler) {}

  void engineLoop();
  void finish(Pending &pending, TokenEvent event);
  // A request stops counting against maxQueuedRequests; done before its client hears back, so
  // that client's next request finds room.
  void leaveQueue() {
    std::lock_guard<std::mutex> lock(mutex);
    --queued;
  }
  void routes();
  bool authorized(const httplib::Request &request, httplib::Response &response) const;
  void completions(const httplib::Request &request, httplib::Response &response, bool chat);
  std::string metrics();
};

void Server::Impl::finish(Pending &pending, TokenEvent event) {
  std::lock_guard<std::mutex> lock(pending.mutex);
  const auto now = Clock::now();
  if (event.error.empty()) {
    generatedTokens.fetch_add(1);
    if (pending.lastToken == Clock::time_point{})
      timeToFirstToken.observe(std::chrono::duration<double>(now - pending.submitted).count());
    else
      interTokenLatency.observe(std::chrono::duration<double>(now - pending.lastToken).count());
    pending.lastToken = now;
  } else {
    failedRequests.fetch_add(1);
    pending.error = event.error;
  }
  pending.done = pending.done || event.finished;
  pending.events.push_back(std::move(event));
  pending.changed.notify_all();
}

void Server::Impl::engineLoop() {
  std::map<uint64_t, std::shared_ptr<Pending>> active;
  ready = true;
  for (;;) {
    std::deque<std::shared_ptr<Pending>> arrived;
    {
      std::unique_lock<std::mutex> lock(mutex);
      wake.wait(lock, [&] { return stopping || !inbox.empty() || !scheduler.idle(); });
      if (stopping)
        break;
      arrived.swap(inbox);
    }
    for (auto &pending : arrived) {
      StatusOr<uint64_t> id = scheduler.submit(pending->request);
      if (!id) {
        leaveQueue();
        // Set before finish() publishes the event under the pending request's lock.
        pending->rejected = true;
        finish(*pending, TokenEvent{0, -1, true, id.status().message()});
        continue;
      }
      active[*id] = pending;
    }
    // Requests whose clients left are dropped before they cost another step.
    for (auto it = active.begin(); it != active.end();) {
      if (!it->second->abandoned) {
        ++it;
        continue;
      }
      scheduler.cancel(it->first);
      it = active.erase(it);
      leaveQueue();
    }
    for (TokenEvent &event : scheduler.step()) {
      auto found = active.find(event.request);
      if (found == active.end())
        continue;
      if (event.finished)
        leaveQueue();
      const bool last = event.finished;
      finish(*found->second, std::move(event));
      if (last)
        active.erase(found);
    }
    std::lock_guard<std::mutex> lock(mutex);
    published = scheduler.stats();
    usage = model.usage();
  }
  // Stopping: whoever still waits gets an error, so no HTTP thread hangs.
  std::deque<std::shared_ptr<Pending>> left;
  {
    std::lock_guard<std::mutex> lock(mutex);
    left.swap(inbox);
  }
  for (auto &[id, pending] : active)
    left.push_back(pending);
  for (auto &pending : left)
    finish(*pending, TokenEvent{0, -1, true, "the server is stopping"});
}

bool Server::Impl::authorized(const httplib::Request &request, httplib::Response &response) const {
  if (options.apiKey.empty() ||
      request.get_header_value("Authorization") == "Bearer " + options.apiKey)
    return true;
  response.status = 401;
  response.set_content(errorBody("missing or wrong API key (Authorization: Bearer ...)",
                                 "authentication_error")
                           .dump(),
                       "application/json");
  return false;
}

namespace {

// A token id: an integer that fits int64 (a larger unsigned one would wrap to a negative id).
bool tokenId(const json &value) {
  return value.is_number_integer() &&
         (!value.is_number_unsigned() ||
          value.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()));
}

} // namespace

namespace {

// A field that is absent or null (OpenAI clients send null for "use the default").
const json *present(const json &body, const char *field) {
  auto found = body.find(field);
  return found == body.end() || found->is_null() ? nullptr : &*found;
}

// OpenAI's temperature, top_p and seed, and vLLM's top_k. Without a temperature the request is
// greedy (OpenAI defaults to 1): outputs are deterministic unless a client asks otherwise. Ranges
// are checked on the float values the sampler reads (1e-50 is a top_p of 0 there).
Status parseSampling(const json &body, CompletionRequest &request) {
  SamplingParams &sampling = request.generation.sampling;
  if (const json *temperature = present(body, "temperature")) {
    const double value = temperature->is_number() ? temperature->get<double>() : -1.0;
    if (!(value >= 0.0 && value <= std::numeric_limits<float>::max()))
      return Status::error("\"temperature\" must be a finite number >= 0");
    sampling.temperature = static_cast<float>(value);
  }
  if (const json *topP = present(body, "top_p")) {
    const double value = topP->is_number() ? topP->get<double>() : 0.0;
    sampling.topP = value > 0.0 && value <= 1.0 ? static_cast<float>(value) : 0.0f;
    if (!(sampling.topP > 0.0f && sampling.topP <= 1.0f))
      return Status::error("\"top_p\" must be a number in (0, 1]");
  }
  if (const json *topK = present(body, "top_k")) {
    const bool valid = topK->is_number_unsigned() ||
                       (topK->is_number_integer() && topK->get<int64_t>() >= -1);
    if (!valid)
      return Status::error("\"top_k\" must be an integer >= 0 (-1 or 0: all tokens)");
    // -1 is vLLM's "off", 0 the sampler's; a k past any vocabulary keeps every token too.
    const uint64_t k = topK->is_number_unsigned() ? topK->get<uint64_t>()
                       : topK->get<int64_t>() < 0  ? 0
                                                   : topK->get<uint64_t>();
    sampling.topK = static_cast<int32_t>(std::min<uint64_t>(k, std::numeric_limits<int32_t>::max()));
  }
  if (const json *seed = present(body, "seed")) {
    if (!seed->is_number_integer())
      return Status::error("\"seed\" must be an integer");
    // Negative seeds are as good as any: their two's-complement bits seed the generator.
    sampling.seed = seed->is_number_unsigned() ? seed->get<uint64_t>()
                                               : static_cast<uint64_t>(seed->get<int64_t>());
    request.seeded = true;
  }
  return Status::ok();
}

// The fields /v1/completions and /v1/chat/completions share: max_tokens, stop_token_ids, stream,
// and the sampling parameters.
Status parseCommonFields(const json &body, int64_t defaultMaxTokens, CompletionRequest &request) {
  json maxTokens = body.value("max_tokens", json(defaultMaxTokens));
  if (!body.contains("max_tokens") && body.contains("max_completion_tokens"))
    maxTokens = body["max_completion_tokens"];
  if (!tokenId(maxTokens))
    return Status::error("\"max_tokens\" must be an integer");
  request.generation.maxNewTokens = maxTokens.get<int64_t>();
  const json stops = body.value("stop_token_ids", json::array());
  if (!stops.is_array())
    return Status::error("\"stop_token_ids\" must be an array of token ids");
  for (const json &id : stops) {
    if (!tokenId(id))
      return Status::error("\"stop_token_ids\" must be an array of token ids");
    request.generation.stopTokens.push_back(id.get<int64_t>());
  }
  const json stream = body.value("stream", json(false));
  if (!stream.is_boolean())
    return Status::error("\"stream\" must be true or false");
  request.stream = stream.get<bool>();
  return parseSampling(body, request);
}

} // namespace

StatusOr<CompletionRequest> parseCompletionRequest(const std::string &text,
                                                   int64_t defaultMaxTokens,
                                                   const Tokenizer *tokenizer) {
  const json body = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object())
    return Status::error("the body is not a JSON object");
  CompletionRequest request;
  const json prompt = body.value("prompt", json());
  if (prompt.is_string()) {
    if (!tokenizer)
      return Status::error("\"prompt\": text prompts need a tokenizer (hybrid-serve --tokenizer "
                           "DIR); send token ids");
    if (prompt.get<std::string>().empty())
      return Status::error("\"prompt\" is empty");
    StatusOr<std::vector<int64_t>> ids = tokenizer->encode(prompt.get<std::string>());
    if (!ids)
      return Status::error("\"prompt\": " + ids.status().message());
    if (std::optional<int64_t> bos = tokenizer->promptBosToken())
      request.generation.prompt.push_back(*bos);
    request.generation.prompt.insert(request.generation.prompt.end(), ids->begin(), ids->end());
  } else {
    if (!prompt.is_array() || prompt.empty())
      return Status::error("\"prompt\" must be a non-empty array of token ids");
    for (const json &id : prompt) {
      if (!tokenId(id))
        return Status::error("\"prompt\" must be one array of token ids (one prompt per request)");
      request.generation.prompt.push_back(id.get<int64_t>());
    }
  }
  if (Status status = parseCommonFields(body, defaultMaxTokens, request); !status)
    return status;
  return request;
}

StatusOr<CompletionRequest> parseChatRequest(const std::string &text, int64_t defaultMaxTokens,
                                             const Tokenizer *tokenizer, ChatFormat format) {
  const json body = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object())
    return Status::error("the body is not a JSON object");
  if (!tokenizer)
    return Status::error("chat completions need a tokenizer (hybrid-serve --tokenizer DIR)");
  const json messages = body.value("messages", json());
  if (!messages.is_array() || messages.empty())
    return Status::error("\"messages\" must be a non-empty array");
  std::vector<ChatMessage> chat;
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string field = "\"messages\"[" + std::to_string(i) + "]";
    const json &message = messages[i];
    if (!message.is_object() || !message.contains("role") || !message["role"].is_string())
      return Status::error(field + " must be an object with a string \"role\"");
    ChatMessage parsed;
    parsed.role = message["role"].get<std::string>();
    const json content = message.value("content", json());
    if (content.is_string()) {
      parsed.content = content.get<std::string>();
    } else if (content.is_array()) {
      for (const json &part : content) {
        if (!part.is_object() || part.value("type", json()) != json("text") ||
            !part.contains("text") || !part["text"].is_string())
          return Status::error(field + ".content: only {\"type\": \"text\", \"text\": ...} parts "
                                       "are supported");
        parsed.content += part["text"].get<std::string>();
      }
    } else if (!content.is_null()) {
      return Status::error(field + ".content must be a string or an array of text parts");
    }
    if (message.contains("name")) {
      if (!message["name"].is_string())
        return Status::error(field + ".name must be a string");
      parsed.name = message["name"].get<std::string>();
    }
    chat.push_back(std::move(parsed));
  }
  StatusOr<std::string> rendered = renderChat(format, chat);
  if (!rendered)
    return rendered.status();
  CompletionRequest request;
  StatusOr<std::vector<int64_t>> ids = tokenizer->encode(*rendered);
  if (!ids)
    return Status::error("\"messages\": " + ids.status().message());
  request.generation.prompt = std::move(*ids);
  if (Status status = parseCommonFields(body, defaultMaxTokens, request); !status)
    return status;
  for (int64_t id : tokenizer->endOfTurnTokens())
    request.generation.stopTokens.push_back(id);
  return request;
}

void Server::Impl::completions(const httplib::Request &request, httplib::Response &response,
                               bool chat) {
  requests.fetch_add(1);
  auto fail = [&](int status, const std::string &message) {
    failedRequests.fetch_add(1);
    response.status = status;
    response.set_content(errorBody(message, status == 503 ? "overloaded" : "invalid_request_error")
                             .dump(),
                         "application/json");
  };
  const Tokenizer *tokenizer = options.tokenizer;
  StatusOr<CompletionRequest> parsed =
      chat ? parseChatRequest(request.body, options.defaultMaxTokens, tokenizer,
                              options.chatFormat.value_or(tokenizer ? tokenizer->chatFormat()
                                                                    : ChatFormat::None))
           : parseCompletionRequest(request.body, options.defaultMaxTokens, tokenizer);
  if (!parsed)
    return fail(400, parsed.status().message());
  // A sampled request without a seed gets a fresh one; with a seed it is reproducible.
  if (!parsed->seeded)
    parsed->generation.sampling.seed = drawSeed();
  auto pending = std::make_shared<Pending>();
  pending->request = std::move(parsed->generation);
  const bool stream = parsed->stream;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (stopping)
      return fail(503, "the server is stopping");
    if (queued >= options.maxQueuedRequests)
      return fail(503, "too many requests in flight (" + std::to_string(queued) + ")");
    ++queued;
    inbox.push_back(pending);
  }
  wake.notify_one();

  const std::string id =
      (chat ? "chatcmpl-" : "cmpl-") + std::to_string(nextCompletion.fetch_add(1));
  const char *object = chat ? "chat.completion" : "text_completion";
  const size_t promptTokens = pending->request.prompt.size();
  auto finishReason = [pending](int64_t token) {
    const auto &stopTokens = pending->request.stopTokens;
    return std::find(stopTokens.begin(), stopTokens.end(), token) != stopTokens.end() ? "stop"
                                                                                       : "length";
  };
  if (!stream) {
    std::unique_lock<std::mutex> lock(pending->mutex);
    pending->changed.wait(lock, [&] { return pending->done; });
    if (!pending->error.empty()) {
      response.status = pending->rejected ? 400 : 500;
      response.set_content(
          errorBody(pending->error, pending->rejected ? "invalid_request_error" : "server_error")
              .dump(),
          "application/json");
      return;
    }
    std::vector<int64_t> tokens;
    for (const TokenEvent &event : pending->events)
      tokens.push_back(event.token);
    // Generated ids are the model's, so decoding fails only on a vocabulary mismatch between
    // the model and the tokenizer: a server error.
    std::string text;
    if (tokenizer) {
      StatusOr<std::string> decoded = tokenizer->decode(tokens, /*skipSpecial=*/true);
      if (!decoded) {
        response.status = 500;
        response.set_content(errorBody(decoded.status().message(), "server_error").dump(),
                             "application/json");
        return;
      }
      text = std::move(*decoded);
    }
    json choice = {{"index", 0},
                   {"token_ids", tokens},
                   {"finish_reason", tokens.empty() ? "length" : finishReason(tokens.back())}};
    if (chat)
      choice["message"] = {{"role", "assistant"}, {"content", text}};
    else
      choice["text"] = text;
    const json result = {
        {"id", id},
        {"object", object},
        {"model", options.modelName},
        {"choices", {choice}},
        {"usage",
         {{"prompt_tokens", promptTokens},
          {"completion_tokens", tokens.size()},
          {"total_tokens", promptTokens + tokens.size()}}}};
    response.set_content(result.dump(), "application/json");
    return;
  }
  // Server-sent events: one chunk per token, then [DONE]. A client that goes away is noticed at
  // the next write, and its request is cancelled.
  // Text is decoded token by token; bytes of a character not yet complete wait for the next.
  std::shared_ptr<IncrementalDecoder> decoder;
  if (tokenizer)
    decoder = std::make_shared<IncrementalDecoder>(*tokenizer, /*skipSpecial=*/true);
  response.set_chunked_content_provider(
      "text/event-stream",
      [this, pending, id, finishReason, decoder, chat](size_t, httplib::DataSink &sink) {
        std::unique_lock<std::mutex> lock(pending->mutex);
        pending->changed.wait(lock, [&] { return pending->done || !pending->events.empty(); });
        while (!pending->events.empty()) {
          TokenEvent event = std::move(pending->events.front());
          pending->events.pop_front();
          json chunk;
          std::string text;
          if (event.error.empty() && decoder) {
            StatusOr<std::string> piece = decoder->push(event.token);
            if (!piece)
              event.error = piece.status().message();
            else
              text = std::move(*piece) + (event.finished ? decoder->finish() : std::string());
          }
          if (!event.error.empty()) {
            chunk = errorBody(event.error, pending->rejected ? "invalid_request_error"
                                                             : "server_error");
          } else {
            json choice = {{"index", 0},
                           {"token_ids", {event.token}},
                           {"finish_reason",
                            event.finished ? json(finishReason(event.token)) : json()}};
            if (chat)
              choice["delta"] = {{"role", "assistant"}, {"content", text}};
            else
              choice["text"] = text;
            chunk = {{"id", id},
                     {"object", chat ? "chat.completion.chunk" : "text_completion"},
                     {"model", options.modelName},
                     {"choices", {choice}}};
          }
          const std::string line = "data: " + chunk.dump() + "\n\n";
          if (!sink.write(line.data(), line.size())) {
            // The client left: the engine drops the request at its next step.
            pending->abandoned = true;
            wake.notify_one();
            return false;
          }
        }
        if (pending->done) {
          const std::string end = "data: [DONE]\n\n";
          sink.write(end.data(), end.size());
          sink.done();
        }
        return true;
      });
}

std::string Server::Impl::metrics() {
  SchedulerStats stats;
  Model::Usage kv;
  {
    std::lock_guard<std::mutex> lock(mutex);
    stats = published;
    kv = usage;
  }
  std::ostringstream out;
  auto metric = [&](const std::string &name, const std::string &type, const std::string &help,
                    double value) {
    out << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n"
        << name << " " << value << "\n";
  };
  metric("hybrid_requests_total", "counter", "Completion requests received.",
         double(requests.load()));
  metric("hybrid_request_errors_total", "counter", "Completion requests that failed.",
         double(failedRequests.load()));
  metric("hybrid_generated_tokens_total", "counter", "Tokens generated.",
         double(generatedTokens.load()));
  metric("hybrid_requests_waiting", "gauge", "Requests waiting for admission.",
         double(stats.waiting));
  metric("hybrid_requests_running", "gauge", "Requests admitted and running.",
         double(stats.running));
  metric("hybrid_preemptions_total", "counter", "Requests preempted for KV pages.",
         double(stats.preemptions));
  metric("hybrid_requests_cancelled_total", "counter", "Requests whose clients left.",
         double(stats.cancelled));
  metric("hybrid_spec_verify_steps_total", "counter",
         "Speculative decoding: verification passes (accepted / passes = mean accepted length).",
         double(stats.verifySteps));
  metric("hybrid_spec_draft_tokens_total", "counter",
         "Speculative decoding: draft tokens proposed.", double(stats.draftedTokens));
  metric("hybrid_spec_accepted_tokens_total", "counter",
         "Speculative decoding: draft tokens accepted.", double(stats.acceptedTokens));
  metric("hybrid_decode_batches_total", "counter",
         "Batched decode calls (rows / calls = mean decode batch).", double(stats.decodeBatches));
  metric("hybrid_decode_batch_rows_total", "counter", "Decode steps run in batched calls.",
         double(stats.batchedDecodeRows));
  metric("hybrid_prefill_batches_total", "counter",
         "Prefill calls that ran several requests' chunks (Model::prefillBatch).",
         double(stats.prefillBatches));
  metric("hybrid_prefill_batch_requests_total", "counter",
         "Prompt chunks run in batched prefill calls (requests / calls = mean prefill batch).",
         double(stats.batchedPrefillSegments));
  metric("hybrid_spec_verify_batches_total", "counter",
         "Verification passes that checked several sequences' drafts (Model::verifyDrafts).",
         double(stats.verifyBatches));
  metric("hybrid_spec_verify_batch_sequences_total", "counter",
         "Sequences verified in batched passes.", double(stats.batchedVerifySequences));
  metric("hybrid_prompt_tokens_total", "counter",
         "Prompt tokens of admitted requests (cached / prompt = prefix-cache hit rate).",
         double(stats.promptTokens));
  metric("hybrid_prefix_cached_tokens_total", "counter",
         "Prompt tokens restored from the prefix cache.", double(stats.cachedPromptTokens));
  metric("hybrid_sparse_attention_selected_positions_total", "counter",
         "DSA layers: positions the indexer selected, over layers and query tokens.",
         double(kv.sparseSelectedPositions));
  metric("hybrid_sparse_attention_context_positions_total", "counter",
         "DSA layers: causal positions the selections were made from (selected / context = "
         "attention density).",
         double(kv.sparseContextPositions));
  metric("hybrid_kv_pages_total", "gauge", "KV cache pages.", double(kv.totalPages));
  metric("hybrid_kv_pages_free", "gauge", "Free KV cache pages.", double(kv.freePages));
  metric("hybrid_sequences_in_use", "gauge", "Sequence slots (KV page tables and state slots) in use.",
         double(kv.sequencesInUse));
  metric("hybrid_prefix_cache_entries", "gauge", "Prompt prefixes kept.", double(kv.keptPrefixes));
  timeToFirstToken.write(out, "hybrid_time_to_first_token_seconds",
                         "From request arrival to its first token.");
  interTokenLatency.write(out, "hybrid_inter_token_latency_seconds",
                          "Between consecutive tokens of a request.");
  return out.str();
}

void Server::Impl::routes() {
  http.set_payload_max_length(options.maxBodyBytes);
  http.set_read_timeout(options.readTimeoutSeconds, 0);
  http.set_write_timeout(options.writeTimeoutSeconds, 0);
  http.set_keep_alive_timeout(options.keepAliveSeconds);
  http.Get("/health", [](const httplib::Request &, httplib::Response &response) {
    response.set_content("ok\n", "text/plain");
  });
  http.Get("/ready", [this](const httplib::Request &, httplib::Response &response) {
    response.status = ready ? 200 : 503;
    response.set_content(ready ? "ready\n" : "loading\n", "text/plain");
  });
  http.Get("/v1/models", [this](const httplib::Request &request, httplib::Response &response) {
    if (!authorized(request, response))
      return;
    const json models = {
        {"object", "list"},
        {"data", {{{"id", options.modelName}, {"object", "model"}, {"owned_by", "hybrid"}}}}};
    response.set_content(models.dump(), "application/json");
  });
  http.Get("/metrics", [this](const httplib::Request &, httplib::Response &response) {
    response.set_content(metrics(), "text/plain; version=0.0.4");
  });
  http.Post("/v1/completions", [this](const httplib::Request &request,
                                      httplib::Response &response) {
    if (authorized(request, response))
      completions(request, response, /*chat=*/false);
  });
  http.Post("/v1/chat/completions", [this](const httplib::Request &request,
                                           httplib::Response &response) {
    if (authorized(request, response))
      completions(request, response, /*chat=*/true);
  });
}

StatusOr<std::unique_ptr<Server>> Server::start(Model &model, const ServeOptions &options) {
  if (!isLoopback(options.host) && options.apiKey.empty())
    return Status::error("serving on " + options.host +
                         " (not loopback) needs an API key (--api-key)");
  if (options.port < 0 || options.port > 65535)
    return Status::error("port " + std::to_string(options.port) + " is not in [0, 65535]");
  if (options.readTimeoutSeconds < 1 || options.writeTimeoutSeconds < 1 ||
      options.keepAliveSeconds < 1)
    return Status::error("the read, write and keep-alive timeouts must be at least 1 second");
  auto impl = std::make_unique<Impl>(model, options);
  impl->routes();
  // Handlers block while their request runs: enough threads for the requests in flight.
  const size_t threads = std::clamp<size_t>(options.maxQueuedRequests, 8, 64);
  impl->http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  // Debian's cpp-httplib listens with a backlog of 5: a burst of connections overflows it and
  // clients see their connection dropped. Keep the socket, and listen again with a deep backlog.
  int listening = -1;
  // Only SO_REUSEADDR (a restart binds despite TIME_WAIT): httplib's default also sets
  // SO_REUSEPORT, which lets a second server silently share a port that is in use.
  impl->http.set_socket_options([&listening](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    listening = sock;
  });
  if (options.port == 0) {
    impl->port = impl->http.bind_to_any_port(options.host);
    if (impl->port < 0)
      return Status::error("cannot bind " + options.host + " to any port");
  } else {
    if (!impl->http.bind_to_port(options.host, options.port))
      return Status::error("cannot bind " + options.host + ":" + std::to_string(options.port) +
                           " (in use, or not an address of this machine)");
    impl->port = options.port;
  }
  if (listening >= 0 && ::listen(listening, SOMAXCONN) != 0)
    return Status::error("cannot deepen the listen backlog of " + options.host + ":" +
                         std::to_string(impl->port));
  Impl *raw = impl.get();
  impl->engine = std::thread([raw] { raw->engineLoop(); });
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Server::~Server() { stop(); }

int Server::port() const { return impl_->port; }

Status Server::serve() {
  if (!impl_->http.listen_after_bind())
    return Status::error("the HTTP server stopped with an error");
  return Status::ok();
}

void Server::stop() {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stopping = true;
  }
  impl_->wake.notify_all();
  impl_->http.stop();
  if (impl_->engine.joinable())
    impl_->engine.join();
}

} // namespace hybrid
