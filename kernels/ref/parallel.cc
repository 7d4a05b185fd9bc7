#include "hybrid/kernels/ref/Parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace hybrid::kernels::ref {
namespace {

using Body = std::function<void(int64_t, int64_t)>;

// True on a thread while it runs a parallelFor body: nested calls then run inline.
thread_local bool insideParallelBody = false;

// One job at a time; the submitting thread works on it too. Workers sleep between jobs.
class ThreadPool {
public:
  explicit ThreadPool(int numWorkers) {
    for (int i = 0; i < numWorkers; ++i)
      workers_.emplace_back([this] { workerLoop(); });
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread &worker : workers_)
      worker.join();
  }

  void run(int64_t count, int64_t chunkSize, const Body &body) {
    std::lock_guard<std::mutex> oneJobAtATime(submitMutex_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      body_ = &body;
      count_ = count;
      chunkSize_ = chunkSize;
      numChunks_ = (count + chunkSize - 1) / chunkSize;
      nextChunk_.store(0);
      chunksDone_.store(0);
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mutex_);
    // Also wait for workers to leave drain(), so none touches body_ after we return.
    done_.wait(lock, [&] { return chunksDone_.load() == numChunks_ && busyWorkers_ == 0; });
  }

private:
  void workerLoop() {
    uint64_t seenGeneration = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || generation_ != seenGeneration; });
      if (stop_)
        return;
      seenGeneration = generation_;
      ++busyWorkers_;
      lock.unlock();
      drain();
      lock.lock();
      if (--busyWorkers_ == 0)
        done_.notify_all();
    }
  }

  void drain() {
    for (;;) {
      const int64_t chunk = nextChunk_.fetch_add(1);
      if (chunk >= numChunks_)
        return;
      const int64_t begin = chunk * chunkSize_;
      const int64_t end = std::min(count_, begin + chunkSize_);
      insideParallelBody = true;
      (*body_)(begin, end);
      insideParallelBody = false;
      if (chunksDone_.fetch_add(1) + 1 == numChunks_) {
        std::lock_guard<std::mutex> lock(mutex_);
        done_.notify_all();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex submitMutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  bool stop_ = false;
  uint64_t generation_ = 0;
  int busyWorkers_ = 0;
  const Body *body_ = nullptr;
  int64_t count_ = 0;
  int64_t chunkSize_ = 1;
  int64_t numChunks_ = 0;
  std::atomic<int64_t> nextChunk_{0};
  std::atomic<int64_t> chunksDone_{0};
};

ThreadPool &pool() {
  static ThreadPool instance(numThreads() - 1);
  return instance;
}

} // namespace

int numThreads() {
  static const int threads = [] {
    if (const char *env = std::getenv("HYBRID_NUM_THREADS")) {
      const int requested = std::atoi(env);
      if (requested >= 1)
        return requested;
    }
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }();
  return threads;
}

void parallelFor(int64_t count, const std::function<void(int64_t, int64_t)> &body,
                 int64_t minGrain) {
  if (count <= 0)
    return;
  minGrain = std::max<int64_t>(1, minGrain);
  const int threads = numThreads();
  // A few chunks per thread balances uneven work (causal attention rows) without much overhead.
  const int64_t maxChunks = std::min<int64_t>((count + minGrain - 1) / minGrain, 4 * threads);
  if (threads == 1 || maxChunks <= 1 || insideParallelBody) {
    body(0, count);
    return;
  }
  const int64_t chunkSize = (count + maxChunks - 1) / maxChunks;
  pool().run(count, chunkSize, body);
}

} // namespace hybrid::kernels::ref
