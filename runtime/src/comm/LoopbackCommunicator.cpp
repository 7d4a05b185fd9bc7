// The loopback backend: the ranks are threads sharing memory. A collective is two barriers: at
// the first every rank has published its buffers (and the counts are checked to agree), between
// them each rank computes its own result from everyone's inputs into a private buffer, and at the
// second every rank has finished reading, so results may overwrite inputs (all-reduce in place).
#include "hybrid/runtime/Communicator.h"

#include <condition_variable>
#include <mutex>

namespace hybrid::comm {
namespace {

struct Group {
  int worldSize = 0;
  std::chrono::milliseconds timeout{0};
  std::mutex mutex;
  std::condition_variable changed;
  uint64_t generation = 0; // completed barriers
  int arrived = 0;
  std::string broken;      // set once: every later collective fails with it
  // What each rank published for the current collective.
  std::vector<const float *> inputs;
  std::vector<std::string> operations;
  std::vector<size_t> counts;
};

class LoopbackCommunicator final : public Communicator {
public:
  LoopbackCommunicator(std::shared_ptr<Group> group, int rank)
      : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int worldSize() const override { return group_->worldSize; }
  std::string backend() const override { return "loopback"; }

  Status allReduceSum(float *data, size_t count, void *) override {
    return collective("allReduceSum", data, count, [&](std::vector<float> &result) {
      result.assign(count, 0.0f);
      for (int r = 0; r < group_->worldSize; ++r) // rank order: the same bits every run
        for (size_t i = 0; i < count; ++i)
          result[i] += group_->inputs[size_t(r)][i];
    }, data);
  }
  Status allGather(const float *mine, float *all, size_t count, void *) override {
    return collective("allGather", mine, count, [&](std::vector<float> &result) {
      result.resize(count * size_t(group_->worldSize));
      for (int r = 0; r < group_->worldSize; ++r)
        std::copy(group_->inputs[size_t(r)], group_->inputs[size_t(r)] + count,
                  result.begin() + long(size_t(r) * count));
    }, all);
  }
  Status reduceScatterSum(const float *all, float *mine, size_t count, void *) override {
    return collective("reduceScatterSum", all, count, [&](std::vector<float> &result) {
      result.assign(count, 0.0f);
      for (int r = 0; r < group_->worldSize; ++r)
        for (size_t i = 0; i < count; ++i)
          result[i] += group_->inputs[size_t(r)][size_t(rank_) * count + i];
    }, mine);
  }
  Status allToAll(const float *sent, float *received, size_t count, void *) override {
    return collective("allToAll", sent, count, [&](std::vector<float> &result) {
      result.resize(count * size_t(group_->worldSize));
      for (int r = 0; r < group_->worldSize; ++r)
        std::copy(group_->inputs[size_t(r)] + size_t(rank_) * count,
                  group_->inputs[size_t(r)] + size_t(rank_ + 1) * count,
                  result.begin() + long(size_t(r) * count));
    }, received);
  }
  Status barrier() override { return wait("barrier"); }

private:
  // Waits until every rank has arrived at this barrier (or the group broke, or timed out).
  Status wait(const std::string &operation) {
    Group &g = *group_;
    std::unique_lock<std::mutex> lock(g.mutex);
    if (!g.broken.empty())
      return Status::error(g.broken);
    const uint64_t generation = g.generation;
    if (++g.arrived == g.worldSize) {
      g.arrived = 0;
      ++g.generation;
      g.changed.notify_all();
      return Status::ok();
    }
    if (!g.changed.wait_for(lock, g.timeout,
                            [&] { return g.generation != generation || !g.broken.empty(); })) {
      g.broken = "loopback " + operation + ": rank " + std::to_string(rank_) + " waited " +
                 std::to_string(g.timeout.count()) + " ms for the other ranks";
      g.changed.notify_all();
    }
    return g.broken.empty() ? Status::ok() : Status::error(g.broken);
  }

  template <typename Compute>
  Status collective(const std::string &operation, const float *input, size_t count,
                    Compute compute, float *output) {
    Group &g = *group_;
    {
      std::lock_guard<std::mutex> lock(g.mutex);
      g.inputs[size_t(rank_)] = input;
      g.operations[size_t(rank_)] = operation;
      g.counts[size_t(rank_)] = count;
    }
    if (Status arrived = wait(operation); !arrived)
      return arrived;
    // Every rank checks the same published facts, so all fail or none.
    for (int r = 0; r < g.worldSize; ++r)
      if (g.operations[size_t(r)] != operation || g.counts[size_t(r)] != count) {
        const std::string why = "loopback " + operation + " of " + std::to_string(count) +
                                " values on rank " + std::to_string(rank_) + ": rank " +
                                std::to_string(r) + " called " + g.operations[size_t(r)] +
                                " of " + std::to_string(g.counts[size_t(r)]);
        (void)wait(operation); // let the others see the mismatch too before anyone moves on
        return Status::error(why);
      }
    std::vector<float> result;
    compute(result);
    if (Status read = wait(operation); !read) // everyone has read everyone's input
      return read;
    std::copy(result.begin(), result.end(), output);
    return Status::ok();
  }

  std::shared_ptr<Group> group_;
  int rank_;
};

} // namespace

StatusOr<std::vector<std::unique_ptr<Communicator>>>
makeLoopbackGroup(int worldSize, std::chrono::milliseconds timeout) {
  if (worldSize < 1)
    return Status::error("loopback group: world size must be at least 1, not " +
                         std::to_string(worldSize));
  if (timeout.count() <= 0)
    return Status::error("loopback group: the timeout must be positive");
  auto group = std::make_shared<Group>();
  group->worldSize = worldSize;
  group->timeout = timeout;
  group->inputs.assign(size_t(worldSize), nullptr);
  group->operations.assign(size_t(worldSize), "");
  group->counts.assign(size_t(worldSize), 0);
  std::vector<std::unique_ptr<Communicator>> ranks;
  for (int r = 0; r < worldSize; ++r)
    ranks.push_back(std::make_unique<LoopbackCommunicator>(group, r));
  return ranks;
}

} // namespace hybrid::comm
