// Prefill graphs (issue 9): a speculative verification pass of one sequence (a token and up to
// 15 draft tokens) launches every kernel of the prefill program, several hundred of them for
// Kimi-Linear-48B, and eagerly that costs about as much CPU time as the kernels take GPU time.
// Such calls replay CUDA graphs, as decode steps do. What a prefill's kernels read from the host
// side, they read from fixed device buffers uploaded before each call (token ids, cu_seqlens,
// positions, block-table row and table: runProgram, prepareKvStep); what they bake in is in the
// key: the program and run, the rows (launch shapes, scratch carving), the state slot (the KDA
// kernels take the slot's state pointers, not an index), the step kind (a decode-kind step's MoE
// experts never group on the host) and whether the KDA replay log is written (its buffers, and
// copies only a verification pass makes).
#include "cuda/CudaExecutorImpl.h"

namespace hybrid::cudadev {

// A graph holds only what replays the same way every time. Left out:
// - the decode program (its own graphs) and `hidden` dumps (values are read between steps);
// - batched calls (several sequences: each segment's slot and rows vary) and context-parallel
//   ones (rows gathered and split per rank, host-staged gathers);
// - programs with steps on the cpu reference (host round trips between the GPU runs);
// - MoE steps that group tokens by expert on the host: the launches depend on the router's
//   choices read back mid-step;
// - more rows than kPrefillGraphMaxRows: long prompts gain little, and each row count is a graph.
bool CudaExecutor::Impl::prefillGraphSafe(const fb::Program &program,
                                          const cpu::StepContext &host,
                                          const HiddenStates *hidden) {
  const size_t index = indexOf(program);
  if (!prefillGraphs || index == kDecode || index >= arenas.size())
    return false;
  if (hidden || !host.batch.empty() || host.contextShard || contextParallel > 1)
    return false;
  if (host.rows < 1 || host.rows > kPrefillGraphMaxRows)
    return false;
  for (const StepRun &run : runs[index])
    if (!run.gpu)
      return false;
  for (const fb::Step *step : *program.steps()) {
    const fb::Dispatch *d = step->op_as_Dispatch();
    if (d && d->kernel() == fb::KernelId::MoeExperts &&
        moeGroupsOnHost(program, *d, host))
      return false;
  }
  return true;
}

Status CudaExecutor::Impl::runPrefillGraph(const fb::Program &program, unsigned char *arena,
                                           size_t runIndex, const cpu::StepContext &host) {
  const PrefillGraphKey key{.program = indexOf(program),
                            .run = runIndex,
                            .rows = host.rows,
                            .stateSlot = host.stateSlot,
                            .decodeStep = host.decode,
                            .logsKda = host.kdaLog != nullptr};
  const StepRun &run = runs[key.program][runIndex];
  cudaStream_t origin = streams[0]->stream;
  // The log entries this run fills start where the program's earlier runs left off.
  const size_t logFirst = kdaLogUsed;
  auto found = prefillGraphExecs.find(key);
  if (found != prefillGraphExecs.end() && key.logsKda) {
    // A longer logged call since the capture may have moved an entry's buffer: the graph would
    // write the freed one. Captured again below (the key's first call warmed it already).
    const std::vector<LoggedKda> &entries = found->second.logEntries;
    bool moved = logFirst + entries.size() > kdaLog.size();
    for (size_t i = 0; !moved && i < entries.size(); ++i)
      moved = kdaLog[logFirst + i].inputs != entries[i].inputs;
    if (moved) {
      cudaGraphExecDestroy(found->second.exec);
      prefillGraphRecency.erase(found->second.recency);
      prefillGraphExecs.erase(found);
      found = prefillGraphExecs.end();
      warmedPrefillKeys.insert(key);
    }
  }
  if (found == prefillGraphExecs.end()) {
    if (warmedPrefillKeys.insert(key).second) { // the key's first call: eager
      ++graphCounts.prefillEager;
      return launchRun(program, arena, run, host, nullptr, /*capturing=*/false);
    }
    CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(origin, cudaStreamCaptureModeThreadLocal),
                         "prefill graph capture");
    Status launched = launchRun(program, arena, run, host, nullptr, /*capturing=*/true);
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(origin, &graph);
    if (!launched.ok()) {
      if (graph)
        cudaGraphDestroy(graph);
      return std::move(launched).withContext("while capturing a prefill graph of " +
                                             std::to_string(key.rows) + " rows");
    }
    CUDA_RETURN_IF_ERROR(ended, "prefill graph capture");
    cudaGraphExec_t exec = nullptr;
    const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    CUDA_RETURN_IF_ERROR(made, "prefill graph instantiation");
    if (prefillGraphExecs.size() >= kPrefillGraphCapacity) { // the least recently replayed goes
      const PrefillGraphKey oldest = prefillGraphRecency.back();
      prefillGraphRecency.pop_back();
      cudaGraphExecDestroy(prefillGraphExecs.at(oldest).exec);
      prefillGraphExecs.erase(oldest);
      ++graphCounts.prefillEvictions;
    }
    PrefillGraph entry;
    entry.exec = exec;
    if (key.logsKda) // the capture ran logKdaInputs' bookkeeping on the host
      entry.logEntries.assign(kdaLog.begin() + static_cast<std::ptrdiff_t>(logFirst),
                              kdaLog.begin() + static_cast<std::ptrdiff_t>(kdaLogUsed));
    prefillGraphRecency.push_front(key);
    entry.recency = prefillGraphRecency.begin();
    found = prefillGraphExecs.emplace(key, std::move(entry)).first;
    warmedPrefillKeys.erase(key);
    ++graphCounts.prefillCaptures;
  } else {
    prefillGraphRecency.splice(prefillGraphRecency.begin(), prefillGraphRecency,
                               found->second.recency);
    // What the eager run's logKdaInputs would have done: the entries it fills, laid out for
    // these rows, for replayKdaLog.
    const std::vector<LoggedKda> &entries = found->second.logEntries;
    std::copy(entries.begin(), entries.end(),
              kdaLog.begin() + static_cast<std::ptrdiff_t>(logFirst));
    kdaLogUsed = logFirst + entries.size();
  }
  CUDA_RETURN_IF_ERROR(cudaGraphLaunch(found->second.exec, origin), "prefill graph launch");
  ++graphCounts.prefillReplays;
  return Status::ok();
}

void CudaExecutor::Impl::destroyPrefillGraphs() {
  for (auto &[key, graph] : prefillGraphExecs)
    cudaGraphExecDestroy(graph.exec);
  prefillGraphExecs.clear();
  prefillGraphRecency.clear();
  warmedPrefillKeys.clear();
}

CudaGraphCounts CudaExecutor::graphCounts() const {
  CudaGraphCounts counts = impl_->graphCounts;
  for (const auto &[key, graphs] : impl_->decodeGraphs)
    counts.decodeGraphs += static_cast<int64_t>(graphs.size());
  return counts;
}

} // namespace hybrid::cudadev
