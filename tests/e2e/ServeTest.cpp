// hybrid-serve's server on loopback with a real HTTP client: golden greedy ids through
// /v1/completions, streaming, many concurrent requests, metrics, and refused requests.
#include "hybrid/runtime/Generate.h"
#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Safetensors.h"
#include "hybrid/runtime/Server.h"
#include "hybrid/runtime/Tokenizer.h"
#include "E2eTestSupport.h"

#include <gtest/gtest.h>
#include <cerrno>
#include <unistd.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <limits>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace hybrid {
namespace {

using json = nlohmann::json;

using e2etest::compiledDir;
using e2etest::goldenFile;

std::vector<int64_t> goldenTensor(const std::string &model, const std::string &name) {
  auto file = safetensors::File::open(goldenFile(model));
  EXPECT_TRUE(file.isOk());
  const safetensors::TensorInfo *info = file->find(name);
  EXPECT_NE(info, nullptr) << name;
  return info ? safetensors::readAsInt64(*file, *info).value() : std::vector<int64_t>{};
}

// A model and a server on a free loopback port, serving from a background thread.
class ServeTest : public testing::Test {
protected:
  void startServer(LoadOptions load = {}, ServeOptions options = {}) {
    auto loaded = Model::load(compiledDir("kimi_linear_tiny"), load);
    ASSERT_TRUE(loaded.isOk()) << loaded.status().message();
    model_ = std::move(*loaded);
    options.port = 0;
    auto started = Server::start(*model_, options);
    ASSERT_TRUE(started.isOk()) << started.status().message();
    server_ = std::move(*started);
    serving_ = std::thread([this] { EXPECT_TRUE(server_->serve().isOk()); });
    client_ = std::make_unique<httplib::Client>("127.0.0.1", server_->port());
    client_->set_read_timeout(120);
    for (int attempt = 0; attempt < 100; ++attempt) // listen() runs on the serving thread
      if (auto health = client_->Get("/health"); health && health->status == 200)
        return;
      else
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    FAIL() << "the server never answered /health";
  }
  void TearDown() override {
    if (server_)
      server_->stop();
    if (serving_.joinable())
      serving_.join();
  }
  // POST /v1/completions; the status and the body as JSON (null when not JSON).
  std::pair<int, json> complete(const json &body, const httplib::Headers &headers = {}) {
    httplib::Client client("127.0.0.1", server_->port());
    client.set_read_timeout(120);
    auto response = client.Post("/v1/completions", headers, body.dump(), "application/json");
    if (!response)
      return {-1, json{{"client_error", httplib::to_string(response.error())}}};
    return {response->status, json::parse(response->body, nullptr, false)};
  }

  std::pair<int, json> post(const std::string &path, const json &body) {
    httplib::Client client("127.0.0.1", server_->port());
    client.set_read_timeout(120);
    auto response = client.Post(path, body.dump(), "application/json");
    if (!response)
      return {-1, json{{"client_error", httplib::to_string(response.error())}}};
    return {response->status, json::parse(response->body, nullptr, false)};
  }

  std::unique_ptr<Model> model_;
  std::unique_ptr<Server> server_;
  std::thread serving_;
  std::unique_ptr<httplib::Client> client_;
};

TEST_F(ServeTest, GreedyThroughTheServerEqualsTheGoldenIds) {
  startServer();
  const std::vector<int64_t> prompt = goldenTensor("kimi_linear_tiny", "input_ids");
  const std::vector<int64_t> golden = goldenTensor("kimi_linear_tiny", "gen_ids");
  auto [status, body] = complete({{"prompt", prompt}, {"max_tokens", golden.size()}});
  ASSERT_EQ(status, 200) << body.dump();
  EXPECT_EQ(body["choices"][0]["token_ids"].get<std::vector<int64_t>>(), golden);
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(body["usage"]["prompt_tokens"], prompt.size());
  EXPECT_EQ(body["usage"]["completion_tokens"], golden.size());

  auto models = client_->Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(json::parse(models->body)["data"][0]["id"], "hybrid");
  auto ready = client_->Get("/ready");
  ASSERT_TRUE(ready);
  EXPECT_EQ(ready->status, 200);
}

TEST_F(ServeTest, StreamingSendsEachTokenThenDone) {
  startServer();
  const std::vector<int64_t> prompt = goldenTensor("kimi_linear_tiny", "input_ids");
  const std::vector<int64_t> golden = goldenTensor("kimi_linear_tiny", "gen_ids");
  const json body = {{"prompt", prompt}, {"max_tokens", 5}, {"stream", true},
                     {"stop_token_ids", {golden[3]}}};
  auto response = client_->Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(response);
  ASSERT_EQ(response->status, 200);
  EXPECT_EQ(response->get_header_value("Content-Type"), "text/event-stream");
  std::vector<int64_t> tokens;
  std::string lastReason;
  bool done = false;
  std::istringstream lines(response->body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("data: ", 0) != 0)
      continue;
    const std::string data = line.substr(6);
    if (data == "[DONE]") {
      done = true;
      continue;
    }
    const json chunk = json::parse(data);
    tokens.push_back(chunk["choices"][0]["token_ids"][0].get<int64_t>());
    if (!chunk["choices"][0]["finish_reason"].is_null())
      lastReason = chunk["choices"][0]["finish_reason"];
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(tokens, std::vector<int64_t>(golden.begin(), golden.begin() + 4)) << "stops at [3]";
  EXPECT_EQ(lastReason, "stop");
}

// More concurrent clients than sequences and HTTP threads: none is lost, each gets the ids of a
// greedy run on its own, and the server stays up.
TEST_F(ServeTest, ManyConcurrentRequestsAllComplete) {
  LoadOptions load;
  load.maxSequences = 3;
  ServeOptions options;
  options.scheduler.prefillChunkTokens = 16;
  startServer(load, options);
  const std::vector<int64_t> prompt = goldenTensor("kimi_linear_tiny", "input_ids");
  constexpr int kClients = 24;
  std::vector<std::vector<int64_t>> prompts(kClients), results(kClients);
  for (int i = 0; i < kClients; ++i)
    prompts[i].assign(prompt.begin() + i % 7, prompt.begin() + 20 + i % 13);
  std::vector<int> statuses(kClients, 0);
  std::vector<std::string> errors(kClients);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i)
    clients.emplace_back([&, i] {
      auto [status, body] = complete({{"prompt", prompts[i]}, {"max_tokens", 4}});
      statuses[i] = status;
      if (status != 200)
        errors[i] = body.dump();
      if (status == 200)
        results[i] = body["choices"][0]["token_ids"].get<std::vector<int64_t>>();
    });
  for (std::thread &client : clients)
    client.join();

  auto reference = Model::load(compiledDir("kimi_linear_tiny")).value();
  GenerationOptions greedy;
  greedy.maxNewTokens = 4;
  for (int i = 0; i < kClients; ++i) {
    ASSERT_EQ(statuses[i], 200) << "client " << i << ": " << errors[i];
    EXPECT_EQ(results[i], generateGreedy(*reference, prompts[i], greedy).value().generated)
        << "client " << i;
  }
  auto health = client_->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  auto metrics = client_->Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("hybrid_requests_total 24\n"), std::string::npos) << metrics->body;
  EXPECT_NE(metrics->body.find("hybrid_generated_tokens_total 96\n"), std::string::npos);
  EXPECT_NE(metrics->body.find("hybrid_time_to_first_token_seconds_count 24\n"),
            std::string::npos);
  // Every prompt token admitted is counted (the prefix-cache hit rate's denominator); sparse
  // attention counters are exported (zero or not, by the model's layers).
  EXPECT_NE(metrics->body.find("\nhybrid_prompt_tokens_total "), std::string::npos);
  EXPECT_EQ(metrics->body.find("\nhybrid_prompt_tokens_total 0\n"), std::string::npos);
  EXPECT_NE(metrics->body.find("\nhybrid_sparse_attention_selected_positions_total "),
            std::string::npos);
  EXPECT_NE(metrics->body.find("\nhybrid_sparse_attention_context_positions_total "),
            std::string::npos);
}

// A streaming client that leaves after its first token: the request is cancelled (its sequence
// freed) instead of running its 200 tokens to the end.
TEST_F(ServeTest, AStreamWhoseClientLeavesIsCancelled) {
  startServer();
  httplib::Request request;
  request.method = "POST";
  request.path = "/v1/completions";
  request.headers = {{"Content-Type", "application/json"}};
  request.body = json{{"prompt", {1, 2, 3}}, {"max_tokens", 200}, {"stream", true}}.dump();
  int chunks = 0;
  request.content_receiver = [&](const char *, size_t, uint64_t, uint64_t) {
    return ++chunks < 1; // hang up on the first chunk
  };
  httplib::Client client("127.0.0.1", server_->port());
  httplib::Response response;
  httplib::Error error = httplib::Error::Success;
  EXPECT_FALSE(client.send(request, response, error));
  EXPECT_EQ(chunks, 1);

  std::string metrics;
  for (int attempt = 0; attempt < 200; ++attempt) {
    auto got = client_->Get("/metrics");
    ASSERT_TRUE(got);
    metrics = got->body;
    if (metrics.find("hybrid_requests_cancelled_total 1\n") != std::string::npos &&
        metrics.find("hybrid_sequences_in_use 0\n") != std::string::npos)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_NE(metrics.find("hybrid_requests_cancelled_total 1\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("hybrid_sequences_in_use 0\n"), std::string::npos) << metrics;
  auto [status, body] = complete({{"prompt", {1, 2, 3}}, {"max_tokens", 2}});
  EXPECT_EQ(status, 200) << body.dump();
}

TEST_F(ServeTest, BadRequestsGetAReasonAndTheServerStaysUp) {
  ServeOptions options;
  options.apiKey = "secret";
  startServer({}, options);
  const httplib::Headers auth = {{"Authorization", "Bearer secret"}};
  auto expectError = [&](const json &body, int status, const std::string &message,
                         const httplib::Headers &headers) {
    auto [gotStatus, got] = complete(body, headers);
    EXPECT_EQ(gotStatus, status) << body.dump();
    EXPECT_EQ(got["error"]["message"], message) << body.dump();
  };
  expectError({{"prompt", {1, 2}}}, 401, "missing or wrong API key (Authorization: Bearer ...)",
              {});
  expectError({{"prompt", "hello"}}, 400,
              "\"prompt\": text prompts need a tokenizer (hybrid-serve --tokenizer DIR); send "
              "token ids",
              auth);
  expectError({{"prompt", {{1, 2}, {3}}}}, 400,
              "\"prompt\" must be one array of token ids (one prompt per request)", auth);
  expectError({{"prompt", json::array()}}, 400, "\"prompt\" must be a non-empty array of token ids",
              auth);
  expectError({{"prompt", {1, 999}}}, 400,
              "request: token id 999 at position 1 is outside the vocabulary [0, 256)", auth);
  expectError({{"prompt", {1}}, {"max_tokens", 0}}, 400,
              "request: maxNewTokens = 0 must be at least 1", auth);
  expectError({{"prompt", {1}}, {"stream", "yes"}}, 400, "\"stream\" must be true or false", auth);
  expectError({{"prompt", {1}}, {"temperature", -0.5}}, 400,
              "\"temperature\" must be a finite number >= 0", auth);
  expectError({{"prompt", {1}}, {"top_p", 0}}, 400, "\"top_p\" must be a number in (0, 1]", auth);
  expectError({{"prompt", {1}}, {"top_k", -2}}, 400,
              "\"top_k\" must be an integer >= 0 (-1 or 0: all tokens)", auth);
  expectError({{"prompt", {1}}, {"seed", "7"}}, 400, "\"seed\" must be an integer", auth);
  httplib::Client client("127.0.0.1", server_->port());
  auto notJson = client.Post("/v1/completions", auth, "{not json", "application/json");
  ASSERT_TRUE(notJson);
  EXPECT_EQ(notJson->status, 400);
  auto [status, body] = complete({{"prompt", {1, 2, 3}}, {"max_tokens", 2}}, auth);
  EXPECT_EQ(status, 200) << body.dump();
}

// A body past the limit is refused before it is parsed, and queued requests past the bound get
// 503; the server keeps serving.
TEST_F(ServeTest, LimitsOnBodiesAndQueueHold) {
  ServeOptions options;
  options.maxBodyBytes = 1024;
  options.maxQueuedRequests = 1;
  startServer({}, options);
  httplib::Client client("127.0.0.1", server_->port());
  auto huge = client.Post("/v1/completions", std::string(4096, ' '), "application/json");
  ASSERT_TRUE(huge);
  EXPECT_EQ(huge->status, 413);

  // One long request holds the only place; a second one meanwhile is refused.
  std::thread holder([&] {
    auto [status, body] = complete({{"prompt", {1, 2, 3}}, {"max_tokens", 400}});
    EXPECT_EQ(status, 200) << body.dump();
  });
  // Once the engine runs it (400 tokens take far longer than one refused request), try.
  bool running = false;
  for (int attempt = 0; attempt < 500 && !running; ++attempt) {
    auto metrics = client_->Get("/metrics");
    running = metrics && metrics->body.find("hybrid_requests_running 1\n") != std::string::npos;
    if (!running)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_TRUE(running);
  auto [refusedStatus, refused] = complete({{"prompt", {4}}, {"max_tokens", 1}});
  EXPECT_EQ(refusedStatus, 503);
  EXPECT_EQ(refused["error"]["message"], "too many requests in flight (1)");
  holder.join();
  auto [status, body] = complete({{"prompt", {4}}, {"max_tokens", 1}});
  EXPECT_EQ(status, 200) << body.dump();
}

// Under memory pressure (two 64-token KV pages for twelve requests that each grow past one page),
// requests wait for pages or, when an older one needs a page while running, the youngest is
// preempted and recomputed; every one still completes with the greedy ids; a prompt longer than
// the context gets a 400 naming the limit, and the server stays up (issue 12).
TEST_F(ServeTest, MemoryPressurePreemptsButNeverDrops) {
  LoadOptions load;
  load.maxSequences = 4;
  load.maxContextTokens = 128;
  load.kvCacheTokens = 128;
  startServer(load, {});
  const std::vector<int64_t> golden = goldenTensor("kimi_linear_tiny", "input_ids");
  constexpr int kClients = 12;
  std::vector<std::vector<int64_t>> prompts(kClients), results(kClients);
  std::vector<int> statuses(kClients, 0);
  std::vector<std::string> errors(kClients);
  for (int i = 0; i < kClients; ++i)
    prompts[i].assign(golden.begin() + i % 5, golden.begin() + 20 + i % 9);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i)
    clients.emplace_back([&, i] {
      auto [status, body] = complete({{"prompt", prompts[i]}, {"max_tokens", 44}});
      statuses[i] = status;
      if (status == 200)
        results[i] = body["choices"][0]["token_ids"].get<std::vector<int64_t>>();
      else
        errors[i] = body.dump();
    });
  for (std::thread &client : clients)
    client.join();
  auto reference = Model::load(compiledDir("kimi_linear_tiny")).value();
  GenerationOptions greedy;
  greedy.maxNewTokens = 44;
  for (int i = 0; i < kClients; ++i) {
    ASSERT_EQ(statuses[i], 200) << "client " << i << ": " << errors[i];
    EXPECT_EQ(results[i], generateGreedy(*reference, prompts[i], greedy).value().generated)
        << "client " << i;
  }
  auto metrics = client_->Get("/metrics");
  ASSERT_TRUE(metrics);
  const size_t at = metrics->body.find("\nhybrid_preemptions_total ");
  ASSERT_NE(at, std::string::npos) << metrics->body;
  EXPECT_GT(std::stod(metrics->body.substr(at + 26)), 0.0)
      << "the pages never ran out: the test no longer exercises preemption";

  std::vector<int64_t> tooLong(golden.begin(), golden.end());
  while (tooLong.size() < 140)
    tooLong.insert(tooLong.end(), golden.begin(), golden.end());
  auto [status, body] = complete({{"prompt", tooLong}, {"max_tokens", 1}});
  EXPECT_EQ(status, 400);
  EXPECT_NE(body.dump().find("exceed the context of 128"), std::string::npos) << body.dump();
  auto health = client_->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

// Raw bytes to the server on a fresh connection; what comes back until the server closes it or
// `waitSeconds` pass, and whether it closed.
struct RawReply {
  std::string bytes;
  bool closed = false;
  double seconds = 0;
};
RawReply rawExchange(int port, const std::string &request, int waitSeconds) {
  RawReply reply;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr *>(&address), sizeof address) != 0) {
    if (fd >= 0)
      ::close(fd);
    return reply;
  }
  timeval timeout{waitSeconds, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  const auto start = std::chrono::steady_clock::now();
  (void)::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  char buffer[4096];
  while (true) {
    const ssize_t got = ::recv(fd, buffer, sizeof buffer, 0);
    if (got > 0) {
      reply.bytes.append(buffer, size_t(got));
      continue;
    }
    reply.closed = got == 0 || errno == ECONNRESET;
    break;
  }
  reply.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ::close(fd);
  return reply;
}

// A client that stops sending in the middle of its headers loses the connection after the read
// timeout instead of holding a server thread; an oversized header line gets 400.
TEST_F(ServeTest, StalledClientsAndHugeHeadersAreCutOff) {
  ServeOptions options;
  options.readTimeoutSeconds = 1;
  options.keepAliveSeconds = 1; // cpp-httplib waits this long for a request's next bytes too
  startServer({}, options);
  const RawReply stalled =
      rawExchange(server_->port(), "POST /v1/completions HTTP/1.1\r\nHost: test\r\n", 10);
  EXPECT_TRUE(stalled.closed);
  EXPECT_LT(stalled.seconds, 5.0);
  EXPECT_GE(stalled.seconds, 0.5);
  const RawReply huge = rawExchange(
      server_->port(), "GET /health HTTP/1.1\r\nX-Big: " + std::string(65536, 'a') + "\r\n\r\n", 10);
  EXPECT_EQ(huge.bytes.rfind("HTTP/1.1 400", 0), 0u) << huge.bytes.substr(0, 80);
  // The server is still serving.
  auto health = client_->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

// The /v1/completions body parser alone (also a fuzz target: tests/fuzz).
TEST(CompletionRequest, ParsesTheFieldsAndNamesTheBadOne) {
  auto ok = parseCompletionRequest(
      R"({"prompt": [1, 2, 3], "max_tokens": 5, "stop_token_ids": [7], "stream": true})", 16);
  ASSERT_TRUE(ok.isOk()) << ok.status().message();
  EXPECT_EQ(ok->generation.prompt, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(ok->generation.maxNewTokens, 5);
  EXPECT_EQ(ok->generation.stopTokens, (std::vector<int64_t>{7}));
  EXPECT_TRUE(ok->stream);
  auto defaults = parseCompletionRequest(R"({"prompt": [4]})", 16);
  ASSERT_TRUE(defaults.isOk());
  EXPECT_EQ(defaults->generation.maxNewTokens, 16);
  EXPECT_FALSE(defaults->stream);
  auto error = [](const std::string &body) {
    auto parsed = parseCompletionRequest(body, 16);
    return parsed.isOk() ? std::string("ok") : parsed.status().message();
  };
  EXPECT_EQ(error("[1]"), "the body is not a JSON object");
  EXPECT_EQ(error(R"({"prompt": 1e999})"), "the body is not a JSON object");
  EXPECT_EQ(error(R"({"prompt": []})"), "\"prompt\" must be a non-empty array of token ids");
  // An id beyond int64 would wrap to a negative one: refused here, before the scheduler.
  EXPECT_EQ(error(R"({"prompt": [18446744073709551615]})"),
            "\"prompt\" must be one array of token ids (one prompt per request)");
  EXPECT_EQ(error(R"({"prompt": [1], "max_tokens": 1.5})"), "\"max_tokens\" must be an integer");
  EXPECT_EQ(error(R"({"prompt": [1], "stop_token_ids": 3})"),
            "\"stop_token_ids\" must be an array of token ids");
  EXPECT_EQ(error(R"({"prompt": [1], "stream": "yes"})"), "\"stream\" must be true or false");
}

// Sampling fields: absent (or null) means greedy and no seed; -1 is vLLM's top_k "off"; every bad
// value is refused naming its field, on both endpoints.
TEST(CompletionRequest, ParsesSamplingAndNamesTheBadField) {
  auto defaults = parseCompletionRequest(R"({"prompt": [4], "temperature": null})", 16);
  ASSERT_TRUE(defaults.isOk()) << defaults.status().message();
  EXPECT_TRUE(samplingIsGreedy(defaults->generation.sampling));
  EXPECT_EQ(defaults->generation.sampling.topK, 0);
  EXPECT_EQ(defaults->generation.sampling.topP, 1.0f);
  EXPECT_FALSE(defaults->seeded);
  auto full = parseCompletionRequest(
      R"({"prompt": [4], "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 123})", 16);
  ASSERT_TRUE(full.isOk()) << full.status().message();
  EXPECT_EQ(full->generation.sampling.temperature, 0.7f);
  EXPECT_EQ(full->generation.sampling.topP, 0.9f);
  EXPECT_EQ(full->generation.sampling.topK, 40);
  EXPECT_EQ(full->generation.sampling.seed, 123u);
  EXPECT_TRUE(full->seeded);
  auto off = parseCompletionRequest(
      R"({"prompt": [4], "temperature": 2, "top_k": -1, "seed": -1})", 16);
  ASSERT_TRUE(off.isOk()) << off.status().message();
  EXPECT_EQ(off->generation.sampling.topK, 0);
  EXPECT_EQ(off->generation.sampling.seed, ~uint64_t(0));
  auto huge = parseCompletionRequest(R"({"prompt": [4], "top_k": 18446744073709551615})", 16);
  ASSERT_TRUE(huge.isOk()) << huge.status().message();
  EXPECT_EQ(huge->generation.sampling.topK, std::numeric_limits<int32_t>::max());
  auto error = [](const std::string &fields) {
    auto parsed = parseCompletionRequest(R"({"prompt": [1], )" + fields + "}", 16);
    return parsed.isOk() ? std::string("ok") : parsed.status().message();
  };
  const std::string temperature = "\"temperature\" must be a finite number >= 0";
  EXPECT_EQ(error(R"("temperature": -1)"), temperature);
  EXPECT_EQ(error(R"("temperature": "hot")"), temperature);
  EXPECT_EQ(error(R"("temperature": 1e300)"), temperature); // past float: infinite
  EXPECT_EQ(error(R"("temperature": 0)"), "ok");
  const std::string topP = "\"top_p\" must be a number in (0, 1]";
  EXPECT_EQ(error(R"("top_p": 0)"), topP);
  EXPECT_EQ(error(R"("top_p": 1.01)"), topP);
  EXPECT_EQ(error(R"("top_p": 1e-60)"), topP); // 0 as the sampler's float
  EXPECT_EQ(error(R"("top_p": true)"), topP);
  EXPECT_EQ(error(R"("top_p": 1)"), "ok");
  const std::string topK = "\"top_k\" must be an integer >= 0 (-1 or 0: all tokens)";
  EXPECT_EQ(error(R"("top_k": -2)"), topK);
  EXPECT_EQ(error(R"("top_k": 2.5)"), topK);
  EXPECT_EQ(error(R"("seed": 1.5)"), "\"seed\" must be an integer");
  EXPECT_EQ(error(R"("seed": [1])"), "\"seed\" must be an integer");
}

// A tokenizer that fits the tiny models' 256 ids: one tiktoken token per byte that can occur in
// UTF-8 (243), then Kimi's special tokens and reserved ones up to id 255.
std::unique_ptr<Tokenizer> byteTokenizer() {
  const std::string dir = std::string(HYBRID_E2E_DIR) + "/byte-tokenizer";
  std::filesystem::create_directories(dir);
  static const char *kAlphabet =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::ofstream model(dir + "/tiktoken.model");
  int64_t rank = 0;
  for (int byte = 0; byte < 256; ++byte) {
    if (byte == 0xC0 || byte == 0xC1 || byte >= 0xF5)
      continue;
    const std::string base64 = {kAlphabet[byte >> 2], kAlphabet[(byte & 3) << 4], '=', '='};
    model << base64 << " " << rank++ << "\n";
  }
  model.close();
  json added = json::object();
  const std::vector<std::string> specials = {"[BOS]",           "[EOS]",         "<|im_end|>",
                                             "<|im_user|>",     "<|im_assistant|>",
                                             "<|im_system|>",   "<|im_middle|>"};
  for (int64_t id = rank; id < 256; ++id) {
    const size_t k = size_t(id - rank);
    added[std::to_string(id)] = {
        {"content", k < specials.size() ? specials[k] : "<|reserved_" + std::to_string(id) + "|>"},
        {"special", true}};
  }
  std::ofstream(dir + "/tokenizer_config.json") << json{{"added_tokens_decoder", added}}.dump();
  auto tokenizer = Tokenizer::load(dir);
  EXPECT_TRUE(tokenizer.isOk()) << tokenizer.status().message();
  return tokenizer.isOk() ? std::move(*tokenizer) : nullptr;
}

// Collects a server-sent-events body: the ids, the text (completions "text" or chat
// delta.content) and whether [DONE] came.
struct Streamed {
  std::vector<int64_t> tokens;
  std::string text;
  bool done = false;
};
Streamed readStream(const std::string &body, bool chat) {
  Streamed out;
  std::istringstream lines(body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("data: ", 0) != 0)
      continue;
    const std::string data = line.substr(6);
    if (data == "[DONE]") {
      out.done = true;
      continue;
    }
    const json choice = json::parse(data)["choices"][0];
    out.tokens.push_back(choice["token_ids"][0].get<int64_t>());
    out.text += chat ? choice["delta"]["content"].get<std::string>()
                     : choice["text"].get<std::string>();
  }
  return out;
}

TEST_F(ServeTest, TextPromptsAndChatGoThroughTheTokenizer) {
  auto tokenizer = byteTokenizer();
  ASSERT_TRUE(tokenizer);
  ASSERT_EQ(tokenizer->chatFormat(), ChatFormat::Kimi);
  ServeOptions options;
  options.tokenizer = tokenizer.get();
  startServer({}, options);
  const std::string prompt = "Hello, 世界 🚀";
  const std::vector<int64_t> ids = tokenizer->encode(prompt).value();
  // A text prompt runs exactly as its ids do, and the answer's text is its ids decoded.
  auto [status, byText] = complete({{"prompt", prompt}, {"max_tokens", 6}});
  ASSERT_EQ(status, 200) << byText.dump();
  auto [idStatus, byIds] = complete({{"prompt", ids}, {"max_tokens", 6}});
  ASSERT_EQ(idStatus, 200) << byIds.dump();
  const auto generated = byText["choices"][0]["token_ids"].get<std::vector<int64_t>>();
  EXPECT_EQ(generated, byIds["choices"][0]["token_ids"].get<std::vector<int64_t>>());
  EXPECT_EQ(byText["usage"]["prompt_tokens"], ids.size());
  EXPECT_EQ(byText["choices"][0]["text"], tokenizer->decode(generated, true).value());

  // Chat: the Kimi rendering of the messages, with <|im_end|> and [EOS] as stop tokens.
  const json messages = {{{"role", "system"}, {"content", "Be brief."}},
                         {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Hi 👋"}}}}}};
  const std::vector<ChatMessage> chat = {{"system", "Be brief.", ""}, {"user", "Hi 👋", ""}};
  const auto chatIds = tokenizer->encode(renderChat(ChatFormat::Kimi, chat).value()).value();
  auto [chatStatus, chatBody] = post("/v1/chat/completions", {{"messages", messages},
                                                              {"max_tokens", 8}});
  ASSERT_EQ(chatStatus, 200) << chatBody.dump();
  EXPECT_EQ(chatBody["object"], "chat.completion");
  std::vector<int64_t> stops = tokenizer->endOfTurnTokens();
  auto [plainStatus, plain] =
      complete({{"prompt", chatIds}, {"max_tokens", 8}, {"stop_token_ids", stops}});
  ASSERT_EQ(plainStatus, 200) << plain.dump();
  const auto answer = chatBody["choices"][0]["token_ids"].get<std::vector<int64_t>>();
  EXPECT_EQ(answer, plain["choices"][0]["token_ids"].get<std::vector<int64_t>>());
  EXPECT_EQ(chatBody["usage"]["prompt_tokens"], chatIds.size());
  EXPECT_EQ(chatBody["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(chatBody["choices"][0]["message"]["content"], tokenizer->decode(answer, true).value());

  // Streaming: the pieces of text add up to the whole answer, in both endpoints.
  for (const bool isChat : {false, true}) {
    json body = isChat ? json{{"messages", messages}, {"max_tokens", 8}}
                       : json{{"prompt", prompt}, {"max_tokens", 6}};
    body["stream"] = true;
    auto response = client_->Post(isChat ? "/v1/chat/completions" : "/v1/completions",
                                  body.dump(), "application/json");
    ASSERT_TRUE(response);
    ASSERT_EQ(response->status, 200);
    const Streamed streamed = readStream(response->body, isChat);
    EXPECT_TRUE(streamed.done);
    EXPECT_EQ(streamed.tokens, isChat ? answer : generated);
    EXPECT_EQ(streamed.text, tokenizer->decode(streamed.tokens, true).value());
  }

  auto [badStatus, bad] = post("/v1/chat/completions",
                               {{"messages", {{{"role", "tool"}, {"content", "{}"}}}}});
  EXPECT_EQ(badStatus, 400);
  EXPECT_EQ(bad["error"]["message"], "\"messages\"[0]: role \"tool\" is not supported by the "
                                     "kimi chat format (system, user, assistant)");
}

// A seeded sampled request answers the same text twice, alone or beside other requests, and
// (at a high temperature) not the greedy answer; the greedy default still gives the golden ids.
TEST_F(ServeTest, SeededSamplingIsReproducibleAndNotGreedy) {
  auto tokenizer = byteTokenizer();
  ASSERT_TRUE(tokenizer);
  ServeOptions options;
  options.tokenizer = tokenizer.get();
  startServer({}, options);
  const std::vector<int64_t> prompt = goldenTensor("kimi_linear_tiny", "input_ids");
  const std::vector<int64_t> golden = goldenTensor("kimi_linear_tiny", "gen_ids");
  const json sampled = {{"prompt", prompt}, {"max_tokens", golden.size()}, {"temperature", 5.0},
                        {"top_p", 0.95}, {"seed", 20240601}};
  auto [status, first] = complete(sampled);
  ASSERT_EQ(status, 200) << first.dump();
  // Again, while greedy and unseeded sampled requests run beside it.
  std::pair<int, json> again, greedy, unseeded;
  std::thread others([&] {
    greedy = complete({{"prompt", prompt}, {"max_tokens", golden.size()}});
    unseeded = complete({{"prompt", prompt}, {"max_tokens", golden.size()}, {"temperature", 5.0}});
  });
  again = complete(sampled);
  others.join();
  ASSERT_EQ(again.first, 200) << again.second.dump();
  ASSERT_EQ(greedy.first, 200) << greedy.second.dump();
  ASSERT_EQ(unseeded.first, 200) << unseeded.second.dump();
  const json &choice = first["choices"][0];
  EXPECT_EQ(again.second["choices"][0]["token_ids"], choice["token_ids"]);
  EXPECT_EQ(again.second["choices"][0]["text"], choice["text"]);
  const auto ids = choice["token_ids"].get<std::vector<int64_t>>();
  EXPECT_EQ(ids.size(), golden.size());
  EXPECT_EQ(choice["text"], tokenizer->decode(ids, true).value());
  EXPECT_NE(ids, golden);
  EXPECT_EQ(greedy.second["choices"][0]["token_ids"].get<std::vector<int64_t>>(), golden);
  EXPECT_EQ(unseeded.second["choices"][0]["token_ids"].size(), golden.size());
}

TEST_F(ServeTest, ChatWithoutATokenizerIsRefused) {
  startServer();
  auto [status, body] =
      post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}});
  EXPECT_EQ(status, 400);
  EXPECT_EQ(body["error"]["message"],
            "chat completions need a tokenizer (hybrid-serve --tokenizer DIR)");
}

TEST(ChatRequest, ParsesMessagesAndNamesTheBadField) {
  auto tokenizer = byteTokenizer();
  ASSERT_TRUE(tokenizer);
  auto error = [&](const std::string &body) {
    auto parsed = parseChatRequest(body, 16, tokenizer.get(), ChatFormat::Kimi);
    return parsed.isOk() ? std::string("ok") : parsed.status().message();
  };
  EXPECT_EQ(error(R"({"messages": [{"role": "user", "content": "x"}]})"), "ok");
  EXPECT_EQ(error(R"({"messages": []})"), "\"messages\" must be a non-empty array");
  EXPECT_EQ(error(R"({"messages": [{"content": "x"}]})"),
            "\"messages\"[0] must be an object with a string \"role\"");
  EXPECT_EQ(error(R"({"messages": [{"role": "user", "content": 3}]})"),
            "\"messages\"[0].content must be a string or an array of text parts");
  EXPECT_EQ(error(R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})"),
            "\"messages\"[0].content: only {\"type\": \"text\", \"text\": ...} parts are "
            "supported");
  EXPECT_EQ(error(R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": "4"})"),
            "\"max_tokens\" must be an integer");
  EXPECT_EQ(error(R"({"messages": [{"role": "user", "content": "x"}], "top_p": 2})"),
            "\"top_p\" must be a number in (0, 1]");
  auto sampledChat = parseChatRequest(
      R"({"messages": [{"role": "user", "content": "x"}], "temperature": 1.2, "seed": 5})", 16,
      tokenizer.get(), ChatFormat::Kimi);
  ASSERT_TRUE(sampledChat.isOk()) << sampledChat.status().message();
  EXPECT_EQ(sampledChat->generation.sampling.temperature, 1.2f);
  EXPECT_EQ(sampledChat->generation.sampling.seed, 5u);
  auto parsed = parseChatRequest(R"({"messages": [{"role": "user", "content": "x"}],
      "max_completion_tokens": 3, "stop_token_ids": [5]})", 16, tokenizer.get(), ChatFormat::Kimi);
  ASSERT_TRUE(parsed.isOk()) << parsed.status().message();
  EXPECT_EQ(parsed->generation.maxNewTokens, 3);
  std::vector<int64_t> stops = {5};
  for (int64_t id : tokenizer->endOfTurnTokens())
    stops.push_back(id);
  EXPECT_EQ(parsed->generation.stopTokens, stops);
  // Text completions with a tokenizer: an empty or non-UTF-8 prompt is refused.
  auto text = [&](const std::string &body) {
    auto parsed = parseCompletionRequest(body, 16, tokenizer.get());
    return parsed.isOk() ? std::string("ok") : parsed.status().message();
  };
  EXPECT_EQ(text(R"({"prompt": "abc"})"), "ok");
  EXPECT_EQ(text(R"({"prompt": ""})"), "\"prompt\" is empty");
}

TEST(ServeOptions, OffLoopbackNeedsAnApiKey) {
  auto model = Model::load(compiledDir("kimi_linear_tiny")).value();
  ServeOptions options;
  options.host = "0.0.0.0";
  options.port = 0;
  auto server = Server::start(*model, options);
  ASSERT_FALSE(server.isOk());
  EXPECT_EQ(server.status().message(), "serving on 0.0.0.0 (not loopback) needs an API key "
                                       "(--api-key)");
  options.host = "127.0.0.1";
  options.port = 70000;
  EXPECT_EQ(Server::start(*model, options).status().message(), "port 70000 is not in [0, 65535]");
  // A port in use is refused, not shared.
  options.port = 0;
  auto first = Server::start(*model, options);
  ASSERT_TRUE(first.isOk()) << first.status().message();
  options.port = (*first)->port();
  auto second = Server::start(*model, options);
  ASSERT_FALSE(second.isOk());
  EXPECT_EQ(second.status().message(),
            "cannot bind 127.0.0.1:" + std::to_string(options.port) +
                " (in use, or not an address of this machine)");
}

} // namespace
} // namespace hybrid
