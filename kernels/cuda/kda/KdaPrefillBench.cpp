#include "../common/bench_support.h"
#include "hybrid/kernels/cuda/KdaBench.h"
#include "hybrid/kernels/cuda/KdaPrefill.h"

#include <cuda_runtime.h>

namespace hybrid::kernels::cuda {
using namespace bench;

std::vector<KdaPrefillBenchResult>
benchKdaPrefill(const std::vector<std::pair<int32_t, int32_t>> &shapes, int32_t heads,
                int32_t headDim, int32_t iterations, KdaPrefillPath path, KdaStateType stateType,
                std::string &error) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    error = "no CUDA device";
    return {};
  }
  std::vector<KdaPrefillBenchResult> results;
  std::mt19937 rng(11);
  for (const auto &[sequences, length] : shapes) {
    const size_t P = size_t(heads) * headDim, W = 4, T = size_t(sequences) * length;
    std::vector<float *> buffers;
    auto make = [&](size_t n, float scale, float offset = 0.0f) {
      float *buffer = deviceRandom(n, scale, offset, rng, error);
      buffers.push_back(buffer);
      return buffer;
    };
    KdaPrefillParams p;
    p.sequences = sequences;
    p.heads = heads;
    p.headDim = headDim;
    p.convKernel = int32_t(W);
    p.qkv = make(T * 3 * P, 1.0f);
    p.weights.convWeight = make(3 * P * W, 0.5f);
    p.forget = make(T * P, 1.0f);
    p.weights.aLog = make(size_t(heads), 0.3f, 0.5f);
    p.weights.dtBias = make(P, 0.5f);
    p.betaLogits = make(T * heads, 1.0f);
    p.outputGate = make(T * P, 1.0f);
    p.weights.normWeight = make(size_t(headDim), 0.1f, 1.0f);
    p.convState = make(size_t(sequences) * 3 * (W - 1) * P, 1.0f);
    const size_t stateElements = size_t(sequences) * heads * headDim * headDim;
    p.stateType = stateType;
    if (stateType == KdaStateType::BF16) {
      p.state = deviceRandomBf16(stateElements, 0.05f, 0.0f, rng, error);
      buffers.push_back(static_cast<float *>(p.state)); // freed with the others
    } else {
      p.state = make(stateElements, 0.05f);
    }
    p.out = make(T * P, 1.0f);
    if (!error.empty())
      return {};
    std::vector<int32_t> cuSeqlens(size_t(sequences) + 1);
    for (int32_t i = 0; i <= sequences; ++i)
      cuSeqlens[i] = i * length;
    int32_t *deviceCuSeqlens = nullptr;
    BENCH_CHECK(cudaMalloc(&deviceCuSeqlens, cuSeqlens.size() * sizeof(int32_t)));
    BENCH_CHECK(cudaMemcpy(deviceCuSeqlens, cuSeqlens.data(), cuSeqlens.size() * sizeof(int32_t),
                           cudaMemcpyHostToDevice));
    p.cuSeqlens = deviceCuSeqlens;
    p.tokens = int32_t(T);
    p.path = path;
    void *workspace = nullptr;
    if (const size_t bytes = kdaPrefillWorkspaceBytes(p))
      BENCH_CHECK(cudaMalloc(&workspace, bytes));
    p.workspace = workspace;

    cudaStream_t stream;
    BENCH_CHECK(cudaStreamCreate(&stream));
    BENCH_CHECK(static_cast<cudaError_t>(launchKdaPrefill(p, stream))); // warm-up
    BENCH_CHECK(cudaStreamSynchronize(stream));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    launchKdaPrefill(p, stream);
    BENCH_CHECK(cudaStreamEndCapture(stream, &graph));
    BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    KdaPrefillBenchResult result;
    result.sequences = sequences;
    result.length = length;
    result.heads = heads;
    result.headDim = headDim;
    result.chunked = resolveKdaPrefillPath(p) == KdaPrefillPath::Chunked;
    result.bf16State = stateType == KdaStateType::BF16;
    result.milliseconds =
        medianMicroseconds(stream, iterations, [&] { cudaGraphLaunch(exec, stream); }) / 1e3;
    BENCH_CHECK(cudaStreamSynchronize(stream));
    result.tokensPerSecond = double(T) / (result.milliseconds * 1e-3);
    const KdaPrefillWork work = kdaPrefillWork(sequences, length, heads, headDim);
    // kdaPrefillWork counts an fp32 state; a bf16 one moves half of it.
    result.bytes = work.bytes - (result.bf16State ? 2.0 * 2.0 * double(stateElements) : 0.0);
    result.flops = work.flops;
    results.push_back(result);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    cudaFree(deviceCuSeqlens);
    cudaFree(workspace);
    for (float *buffer : buffers)
      cudaFree(buffer);
  }
  return results;
}

} // namespace hybrid::kernels::cuda
