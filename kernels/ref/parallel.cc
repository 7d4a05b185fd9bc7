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
//
// Each job's counters live in its own Job, which a worker attaches to (under the lock) before
// touching it and which outlives every attached worker. Shared counters reset per job raced: a
// worker waking late for job N could take a chunk index from N's exhausted counter after run()
// returned, then read job N+1's chunk count and body and run (and count) a chunk of N+1 twice,
// so its done count could skip past the total and the submitter waited forever.
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
    Job job{&body, count, chunkSize, (count + chunkSize - 1) / chunkSize};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      ++generation_;
    }
    wake_.notify_all();
    drain(job);
    std::unique_lock<std::mutex> lock(mutex_);
    // Also wait for attached workers to leave drain(), so none touches `job` after we return.
    done_.wait(lock, [&] { return job.chunksDone.load() == job.numChunks && busyWorkers_ == 0; });
    job_ = nullptr; // workers waking late find no job
  }

private:
  struct Job {
    const Body *body;
    int64_t count, chunkSize, numChunks;
    std::atomic<int64_t> nextChunk{0};
    std::atomic<int64_t> chunksDone{0};
  };

  void workerLoop() {
    uint64_t seenGeneration = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || generation_ != seenGeneration; });
      if (stop_)
        return;
      seenGeneration = generation_;
      Job *job = job_;
      if (!job)
        continue;
      ++busyWorkers_;
      lock.unlock();
      drain(*job);
      lock.lock();
      if (--busyWorkers_ == 0)
        done_.notify_all();
    }
  }

  void drain(Job &job) {
    for (;;) {
      const int64_t chunk = job.nextChunk.fetch_add(1);
      if (chunk >= job.numChunks)
        return;
      const int64_t begin = chunk * job.chunkSize;
      const int64_t end = std::min(job.count, begin + job.chunkSize);
      insideParallelBody = true;
      (*job.body)(begin, end);
      insideParallelBody = false;
      if (job.chunksDone.fetch_add(1) + 1 == job.numChunks) {
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
  Job *job_ = nullptr; // the job being run, or none
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
