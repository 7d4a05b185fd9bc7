// Communicator.h on the CPU: the loopback backend's collectives (every rank a thread), their
// results to the bit whatever the threads' timing, mismatched calls and missing ranks failing
// every rank with a reason instead of hanging; the launch variables; the TCP rendezvous between
// threads (what a multi-process launch does, over loopback addresses); NCCL refusing cleanly
// without a GPU.
#include "hybrid/runtime/Communicator.h"

#include "RankThreads.h"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <functional>
#include <random>
#include <thread>

namespace hybrid::comm {
namespace {

using rankthreads::freePort;
using rankthreads::onEveryRank;

// A group of three whose collectives just failed on a mismatch stays usable: an all-reduce of
// ones sums to 3 on every rank.
void expectUsableAfterAMismatch(std::vector<std::unique_ptr<Communicator>> &group) {
  ASSERT_EQ(group.size(), 3u);
  const auto after = onEveryRank(group, [&](int, Communicator &c) -> Status {
    std::vector<float> v(4, 1.0f);
    HYBRID_RETURN_IF_ERROR(c.allReduceSum(v.data(), 4));
    return v[0] == 3.0f ? Status::ok() : Status::error("wrong sum after a mismatch");
  });
  for (const Status &s : after)
    EXPECT_TRUE(s) << s.message();
}

std::vector<float> randomValues(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float &x : v)
    x = normal(rng);
  return v;
}

// Every collective of `group` (world ranks) against its definition, to the bit.
void checkDefinitions(std::vector<std::unique_ptr<Communicator>> &group, int world) {
  const size_t count = 1000;
  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < world; ++r)
    inputs.push_back(randomValues(count * size_t(world), 7 + uint32_t(r)));

  const size_t ranks = size_t(world);
  std::vector<std::vector<float>> reduced(ranks), gathered(ranks), scattered(ranks), swapped(ranks);
  const auto statuses = onEveryRank(group, [&](int r, Communicator &c) -> Status {
    EXPECT_EQ(c.rank(), r);
    EXPECT_EQ(c.worldSize(), world);
    reduced[size_t(r)] = inputs[size_t(r)];
    HYBRID_RETURN_IF_ERROR(c.allReduceSum(reduced[size_t(r)].data(), reduced[size_t(r)].size()));
    gathered[size_t(r)].resize(count * size_t(world));
    HYBRID_RETURN_IF_ERROR(c.allGather(inputs[size_t(r)].data(), gathered[size_t(r)].data(), count));
    scattered[size_t(r)].resize(count);
    HYBRID_RETURN_IF_ERROR(
        c.reduceScatterSum(inputs[size_t(r)].data(), scattered[size_t(r)].data(), count));
    swapped[size_t(r)].resize(count * size_t(world));
    HYBRID_RETURN_IF_ERROR(c.allToAll(inputs[size_t(r)].data(), swapped[size_t(r)].data(), count));
    return c.barrier();
  });
  for (const Status &s : statuses)
    ASSERT_TRUE(s) << s.message();

  for (int r = 0; r < world; ++r)
    for (size_t i = 0; i < count * size_t(world); ++i) {
      float sum = 0.0f; // rank order, as the backend promises
      for (int q = 0; q < world; ++q)
        sum += inputs[size_t(q)][i];
      ASSERT_EQ(reduced[size_t(r)][i], sum) << "rank " << r << " element " << i;
      const int owner = int(i / count);
      ASSERT_EQ(gathered[size_t(r)][i], inputs[size_t(owner)][i % count]);
      ASSERT_EQ(swapped[size_t(r)][i], inputs[size_t(owner)][size_t(r) * count + i % count]);
    }
  for (int r = 0; r < world; ++r)
    for (size_t i = 0; i < count; ++i) {
      float sum = 0.0f;
      for (int q = 0; q < world; ++q)
        sum += inputs[size_t(q)][size_t(r) * count + i];
      ASSERT_EQ(scattered[size_t(r)][i], sum);
    }
}

class LoopbackCollectives : public testing::TestWithParam<int> {};

TEST_P(LoopbackCollectives, MatchTheirDefinitions) {
  auto group = makeLoopbackGroup(GetParam());
  ASSERT_TRUE(group) << group.status().message();
  checkDefinitions(*group, GetParam());
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, LoopbackCollectives, testing::Values(1, 2, 3, 4, 8));

TEST(LoopbackCommunicator, SameBitsWhateverTheTiming) {
  const int world = 4;
  auto group = makeLoopbackGroup(world);
  ASSERT_TRUE(group);
  std::vector<float> first;
  for (int round = 0; round < 20; ++round) {
    std::vector<std::vector<float>> data{static_cast<size_t>(world)};
    const auto statuses = onEveryRank(*group, [&](int r, Communicator &c) -> Status {
      std::mt19937 jitter(uint32_t(round * 31 + r));
      std::this_thread::sleep_for(std::chrono::microseconds(jitter() % 2000));
      data[size_t(r)] = randomValues(257, 100 + uint32_t(r));
      return c.allReduceSum(data[size_t(r)].data(), data[size_t(r)].size());
    });
    for (const Status &s : statuses)
      ASSERT_TRUE(s) << s.message();
    if (round == 0)
      first = data[0];
    for (int r = 0; r < world; ++r)
      ASSERT_EQ(data[size_t(r)], first) << "round " << round << " rank " << r;
  }
}

TEST(LoopbackCommunicator, MismatchedCallsFailEveryRank) {
  auto group = makeLoopbackGroup(3);
  ASSERT_TRUE(group);
  const auto statuses = onEveryRank(*group, [&](int r, Communicator &c) -> Status {
    std::vector<float> v(size_t(r == 2 ? 5 : 4), 1.0f);
    return c.allReduceSum(v.data(), v.size());
  });
  for (const Status &s : statuses) {
    ASSERT_FALSE(s);
    EXPECT_NE(s.message().find("allReduceSum"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("rank 2"), std::string::npos) << s.message();
  }
  // Different collectives at the same point: named too; the group stays usable afterwards.
  const auto mixed = onEveryRank(*group, [&](int r, Communicator &c) -> Status {
    std::vector<float> v(4, 1.0f), all(12);
    return r == 0 ? c.allGather(v.data(), all.data(), 4) : c.allReduceSum(v.data(), 4);
  });
  for (const Status &s : mixed)
    ASSERT_FALSE(s);
  EXPECT_NE(mixed[1].message().find("called allGather"), std::string::npos) << mixed[1].message();
  expectUsableAfterAMismatch(*group);
}

// skipCollectives (timing only): every collective leaves its buffers as they are and does not
// enter the real group's collectives (which stay in step afterwards); rank, world size, buffer
// kind and barriers are the real communicator's, a split its refusal.
TEST(SkippingCommunicator, CollectivesLeaveTheirBuffersAndTheRealGroupInStep) {
  auto group = makeLoopbackGroup(2);
  ASSERT_TRUE(group);
  const auto statuses = onEveryRank(*group, [&](int r, Communicator &real) -> Status {
    std::unique_ptr<Communicator> skipping = skipCollectives(real);
    if (skipping->rank() != r || skipping->worldSize() != 2 ||
        skipping->deviceBuffers() != real.deviceBuffers() ||
        skipping->backend() != "loopback (collectives skipped)")
      return Status::error("identity not forwarded: " + skipping->backend());
    std::vector<float> v(4, float(r + 1)), all(8, -1.0f), mine(4, -2.0f), received(8, -3.0f);
    HYBRID_RETURN_IF_ERROR(skipping->allReduceSum(v.data(), v.size()));
    HYBRID_RETURN_IF_ERROR(skipping->allGather(v.data(), all.data(), v.size()));
    HYBRID_RETURN_IF_ERROR(skipping->reduceScatterSum(all.data(), mine.data(), mine.size()));
    HYBRID_RETURN_IF_ERROR(skipping->allToAll(all.data(), received.data(), 4));
    if (v != std::vector<float>(4, float(r + 1)) || all != std::vector<float>(8, -1.0f) ||
        mine != std::vector<float>(4, -2.0f) || received != std::vector<float>(8, -3.0f))
      return Status::error("a skipped collective wrote its buffers");
    HYBRID_RETURN_IF_ERROR(skipping->barrier());
    auto split = skipping->split(0, r);
    if (split.isOk() || split.status().message().find("cannot split") == std::string::npos)
      return Status::error("split: not the real communicator's refusal");
    HYBRID_RETURN_IF_ERROR(real.allReduceSum(v.data(), v.size()));
    return v[0] == 3.0f ? Status::ok() : Status::error("the real group fell out of step");
  });
  for (const Status &s : statuses)
    EXPECT_TRUE(s) << s.message();
}

TEST(LoopbackCommunicator, AMissingRankTimesOutInsteadOfHanging) {
  auto group = makeLoopbackGroup(3, std::chrono::milliseconds(200));
  ASSERT_TRUE(group);
  const auto statuses = onEveryRank(*group, [&](int r, Communicator &c) -> Status {
    if (r == 1)
      return Status::ok(); // never arrives
    std::vector<float> v(8, 1.0f);
    return c.allReduceSum(v.data(), v.size());
  });
  for (int r : {0, 2}) {
    ASSERT_FALSE(statuses[size_t(r)]);
    EXPECT_NE(statuses[size_t(r)].message().find("waited 200 ms"), std::string::npos)
        << statuses[size_t(r)].message();
  }
  // The group is broken for good: a later collective fails at once with the same reason.
  std::vector<float> v(1);
  EXPECT_FALSE((*group)[0]->allReduceSum(v.data(), 1));
}

TEST(LoopbackCommunicator, RejectsBadGroups) {
  EXPECT_FALSE(makeLoopbackGroup(0));
  EXPECT_FALSE(makeLoopbackGroup(2, std::chrono::milliseconds(0)));
}

// Sets launch variables for one test and restores the environment after it.
class LaunchEnvironment : public testing::Test {
protected:
  void SetUp() override {
    for (const char *name : kNames)
      if (const char *value = std::getenv(name))
        saved_.emplace_back(name, value);
    clear();
  }
  void TearDown() override {
    clear();
    for (const auto &[name, value] : saved_)
      ::setenv(name.c_str(), value.c_str(), 1);
  }
  static void clear() {
    for (const char *name : kNames)
      ::unsetenv(name);
  }
  static constexpr const char *kNames[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                           "MASTER_PORT"};
  std::vector<std::pair<std::string, std::string>> saved_;
};

TEST_F(LaunchEnvironment, ReadsTheUsualVariables) {
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("RANK", "2", 1);
  ::setenv("MASTER_ADDR", "10.0.0.7", 1);
  ::setenv("MASTER_PORT", "29611", 1);
  auto config = rendezvousFromEnvironment();
  ASSERT_TRUE(config) << config.status().message();
  EXPECT_EQ(config->worldSize, 4);
  EXPECT_EQ(config->rank, 2);
  EXPECT_EQ(config->localRank, 2); // defaults to RANK
  EXPECT_EQ(config->masterAddress, "10.0.0.7");
  EXPECT_EQ(config->masterPort, 29611);
  ::setenv("LOCAL_RANK", "0", 1);
  EXPECT_EQ(rendezvousFromEnvironment()->localRank, 0);
}

TEST_F(LaunchEnvironment, NamesTheVariableThatIsWrong) {
  auto expectError = [](const std::string &variable) {
    auto config = rendezvousFromEnvironment();
    ASSERT_FALSE(config);
    EXPECT_NE(config.status().message().find(variable), std::string::npos)
        << config.status().message();
  };
  expectError("WORLD_SIZE");
  ::setenv("WORLD_SIZE", "2", 1);
  expectError("RANK");
  ::setenv("RANK", "two", 1);
  expectError("RANK");
  ::setenv("RANK", "2", 1); // outside the world
  expectError("RANK");
  ::setenv("RANK", "1", 1);
  expectError("MASTER_ADDR");
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", "70000", 1);
  expectError("MASTER_PORT");
  ::setenv("MASTER_PORT", "29500", 1);
  EXPECT_TRUE(rendezvousFromEnvironment());
  ::setenv("WORLD_SIZE", "1", 1); // one rank needs no master
  ::setenv("RANK", "0", 1);
  ::unsetenv("MASTER_ADDR");
  EXPECT_TRUE(rendezvousFromEnvironment());
}

TEST_F(LaunchEnvironment, LocalRankMustBeAGpuIndex) {
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("RANK", "1", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  for (const char *bad : {"-1", "gpu1", "1.5"}) {
    ::setenv("LOCAL_RANK", bad, 1);
    auto config = rendezvousFromEnvironment();
    ASSERT_FALSE(config) << bad;
    EXPECT_NE(config.status().message().find("LOCAL_RANK='" + std::string(bad) + "'"),
              std::string::npos)
        << config.status().message();
  }
}

// The tools' launch: a world of one without the variables, else the device's backend; errors
// name the variable, the device or the rank.
TEST_F(LaunchEnvironment, ConnectsThisProcessAsItsRank) {
  auto alone = connectFromEnvironment("cuda");
  ASSERT_TRUE(alone) << alone.status().message();
  EXPECT_EQ(*alone, nullptr); // no WORLD_SIZE: a world of one, nothing to connect
  ::setenv("WORLD_SIZE", "1", 1);
  alone = connectFromEnvironment("cpu");
  ASSERT_TRUE(alone) << alone.status().message();
  EXPECT_EQ(*alone, nullptr);

  ::setenv("WORLD_SIZE", "2", 1);
  auto missing = connectFromEnvironment("cpu");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.status().message().find("RANK"), std::string::npos)
      << missing.status().message();
  ::setenv("RANK", "1", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  auto device = connectFromEnvironment("tpu");
  ASSERT_FALSE(device);
  EXPECT_NE(device.status().message().find("device 'tpu'"), std::string::npos)
      << device.status().message();
  // No GPU, no NCCL in the build, or no GPU 4096 on this host: NCCL refuses, naming the rank.
  ::setenv("LOCAL_RANK", "4096", 1);
  auto nccl = connectFromEnvironment("cuda");
  ASSERT_FALSE(nccl);
  EXPECT_EQ(nccl.status().message().rfind("rank 1 of 2: nccl", 0), 0u)
      << nccl.status().message();
}

TEST(Rendezvous, EveryRankGetsEveryBlobInRankOrder) {
  const int world = 4, port = freePort();
  ASSERT_GT(port, 0);
  std::vector<StatusOr<std::vector<std::string>>> results;
  for (int r = 0; r < world; ++r)
    results.emplace_back(Status::error("not run"));
  std::vector<std::thread> threads;
  for (int r = world - 1; r >= 0; --r) // rank 0 last: the others retry until it listens
    threads.emplace_back([&, r] {
      RendezvousConfig config;
      config.rank = r;
      config.worldSize = world;
      config.masterPort = port;
      config.timeout = std::chrono::seconds(20);
      results[size_t(r)] =
          exchangeAtRendezvous(config, "blob of rank " + std::to_string(r) + std::string(r, 'x'));
    });
  for (std::thread &t : threads)
    t.join();
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(results[size_t(r)]) << "rank " << r << ": " << results[size_t(r)].status().message();
    ASSERT_EQ(results[size_t(r)]->size(), size_t(world));
    for (int q = 0; q < world; ++q)
      EXPECT_EQ((*results[size_t(r)])[size_t(q)], "blob of rank " + std::to_string(q) + std::string(q, 'x'));
  }
}

// Rank 1 from the environment, rank 0 from its own config on a thread: one TCP group.
TEST_F(LaunchEnvironment, EnvironmentRankJoinsOverTcp) {
  const int port = freePort();
  ASSERT_GT(port, 0);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("RANK", "1", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  std::vector<float> zero = {1.0f, 2.0f}, one = {10.0f, 20.0f};
  Status zeroStatus = Status::error("not run");
  std::thread rankZero([&] {
    RendezvousConfig config;
    config.worldSize = 2;
    config.masterPort = port;
    config.timeout = std::chrono::seconds(20);
    auto connected = connectTcp(config);
    zeroStatus = connected ? (*connected)->allReduceSum(zero.data(), zero.size())
                           : connected.status();
  });
  auto connected = connectFromEnvironment("cpu");
  Status oneStatus = connected ? (*connected)->allReduceSum(one.data(), one.size())
                               : connected.status();
  rankZero.join();
  ASSERT_TRUE(oneStatus) << oneStatus.message();
  ASSERT_TRUE(zeroStatus) << zeroStatus.message();
  EXPECT_EQ((*connected)->rank(), 1);
  EXPECT_EQ((*connected)->backend(), "tcp");
  EXPECT_FALSE((*connected)->deviceBuffers());
  EXPECT_EQ(one, (std::vector<float>{11.0f, 22.0f}));
  EXPECT_EQ(zero, one);
}

TEST(Rendezvous, FailsWithAReason) {
  RendezvousConfig lonely; // rank 1 of 2, nobody listening: gives up at the deadline
  lonely.rank = 1;
  lonely.worldSize = 2;
  lonely.masterPort = freePort();
  lonely.timeout = std::chrono::milliseconds(300);
  auto unreachable = exchangeAtRendezvous(lonely, "x");
  ASSERT_FALSE(unreachable);
  EXPECT_NE(unreachable.status().message().find("could not reach rank 0"), std::string::npos)
      << unreachable.status().message();

  RendezvousConfig waiting = lonely; // rank 0 whose peers never come
  waiting.rank = 0;
  waiting.masterPort = freePort();
  auto alone = exchangeAtRendezvous(waiting, "x");
  ASSERT_FALSE(alone);
  EXPECT_NE(alone.status().message().find("timed out waiting for rank 1"), std::string::npos)
      << alone.status().message();

  RendezvousConfig outside = lonely;
  outside.rank = 5;
  EXPECT_FALSE(exchangeAtRendezvous(outside, "x"));
  RendezvousConfig single; // one rank: no network at all
  auto self = exchangeAtRendezvous(single, "only");
  ASSERT_TRUE(self);
  EXPECT_EQ(self->front(), "only");
}

// `world` TCP communicators over 127.0.0.1, connected from one thread each (as separate
// processes would); empty with a failure when a rank cannot connect.
std::vector<std::unique_ptr<Communicator>> tcpGroup(int world, std::chrono::milliseconds timeout) {
  const int port = freePort();
  std::vector<std::unique_ptr<Communicator>> group(static_cast<size_t>(world));
  std::vector<Status> statuses(static_cast<size_t>(world), Status::ok());
  std::vector<std::thread> threads;
  for (int r = world - 1; r >= 0; --r) // rank 0 last: the others retry until it listens
    threads.emplace_back([&, r] {
      RendezvousConfig config;
      config.rank = r;
      config.worldSize = world;
      config.masterPort = port;
      config.timeout = timeout;
      auto connected = connectTcp(config);
      if (connected)
        group[size_t(r)] = std::move(*connected);
      else
        statuses[size_t(r)] = connected.status();
    });
  for (std::thread &t : threads)
    t.join();
  for (const Status &s : statuses)
    if (!s) {
      ADD_FAILURE() << s.message();
      return {};
    }
  return group;
}

// The TCP backend (one process per rank on the cpu device) gives the loopback backend's bits.
class TcpCollectives : public testing::TestWithParam<int> {};

TEST_P(TcpCollectives, MatchTheirDefinitions) {
  auto group = tcpGroup(GetParam(), std::chrono::seconds(20));
  ASSERT_EQ(group.size(), size_t(GetParam()));
  EXPECT_EQ(group[0]->backend(), "tcp");
  checkDefinitions(group, GetParam());
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, TcpCollectives, testing::Values(1, 2, 3, 4));

TEST(TcpCommunicator, MismatchedCallsFailEveryRankAndTheGroupStaysUsable) {
  auto group = tcpGroup(3, std::chrono::seconds(20));
  ASSERT_EQ(group.size(), 3u);
  const auto statuses = onEveryRank(group, [&](int r, Communicator &c) -> Status {
    std::vector<float> v(size_t(r == 2 ? 5 : 4), 1.0f), all(12);
    return r == 1 ? c.allGather(v.data(), all.data(), 4) : c.allReduceSum(v.data(), v.size());
  });
  for (const Status &s : statuses) {
    ASSERT_FALSE(s);
    EXPECT_NE(s.message().find("rank 1 called allGather of 4"), std::string::npos) << s.message();
  }
  expectUsableAfterAMismatch(group);
}

TEST(TcpCommunicator, FailsWithAReason) {
  RendezvousConfig lonely; // rank 1 of 2, nobody listening: gives up at the deadline
  lonely.rank = 1;
  lonely.worldSize = 2;
  lonely.masterPort = freePort();
  lonely.timeout = std::chrono::milliseconds(300);
  auto unreachable = connectTcp(lonely);
  ASSERT_FALSE(unreachable);
  EXPECT_NE(unreachable.status().message().find("tcp: rank 1 could not reach rank 0"),
            std::string::npos)
      << unreachable.status().message();
  RendezvousConfig outside = lonely;
  outside.rank = 2;
  EXPECT_FALSE(connectTcp(outside));

  // A rank that leaves: the other's collective fails (the peer closed the connection) instead
  // of hanging, and so does every later one.
  auto group = tcpGroup(2, std::chrono::seconds(20));
  ASSERT_EQ(group.size(), 2u);
  group[1].reset();
  std::vector<float> v(4, 1.0f);
  Status gone = group[0]->allReduceSum(v.data(), v.size());
  ASSERT_FALSE(gone);
  EXPECT_NE(gone.message().find("the peer closed the connection"), std::string::npos)
      << gone.message();
  EXPECT_FALSE(group[0]->barrier());
}

TEST(Rendezvous, TwoRanksClaimingTheSameRankAreRefused) {
  const int port = freePort();
  std::vector<Status> statuses(3, Status::ok());
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t)
    threads.emplace_back([&, t] {
      RendezvousConfig config;
      config.rank = t == 0 ? 0 : 1; // two claim rank 1 of a world of 3
      config.worldSize = 3;
      config.masterPort = port;
      config.timeout = std::chrono::seconds(5);
      auto result = exchangeAtRendezvous(config, "b");
      statuses[size_t(t)] = result ? Status::ok() : result.status();
    });
  for (std::thread &t : threads)
    t.join();
  ASSERT_FALSE(statuses[0]);
  EXPECT_NE(statuses[0].message().find("claims rank 1 twice"), std::string::npos)
      << statuses[0].message();
}

TEST(Nccl, RefusesCleanlyWithoutAGpuOrNccl) {
  RendezvousConfig config;
  auto connected = connectNccl(config);
  if (connected)
    GTEST_SKIP() << "a GPU with NCCL is present: the multi-GPU run is issue 11's";
  EXPECT_NE(connected.status().message().find("nccl"), std::string::npos)
      << connected.status().message();
}

} // namespace
} // namespace hybrid::comm
