#include "hybrid/kernels/cuda/KdaBench.h"
#include "hybrid/kernels/cuda/KdaDecode.h"
#include "hybrid/kernels/cuda/LaunchFloor.h"
#include "../common/bench_support.h"
#include "kda_decode_inputs.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <random>

namespace hybrid::kernels::cuda {
using namespace bench;

std::vector<KdaDecodeBenchResult> benchKdaDecode(const std::vector<int32_t> &batches,
                                                 int32_t heads, int32_t headDim,
                                                 int32_t iterations, KdaDecodePath path,
                                                 KdaStateType stateType, std::string &error) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    error = "no CUDA device";
    return {};
  }
  std::vector<KdaDecodeBenchResult> results;
  std::mt19937 rng(7);
  for (int32_t batch : batches) {
    const size_t P = size_t(heads) * headDim, W = kDecodeConvKernel;
    std::vector<float *> buffers;
    auto make = [&](size_t n, float scale, float offset = 0.0f) {
      float *buffer = deviceRandom(n, scale, offset, rng, error);
      buffers.push_back(buffer);
      return buffer;
    };
    KdaDecodeParams p;
    randomDecodeInputs(p, batch, heads, headDim, make);
    p.convState = make(size_t(batch) * 3 * (W - 1) * P, 1.0f);
    const bool bf16State = stateType == KdaStateType::BF16;
    const size_t stateElements = size_t(batch) * heads * headDim * headDim;
    p.stateType = stateType;
    if (bf16State) {
      p.state = deviceRandomBf16(stateElements, 0.05f, 0.0f, rng, error);
      buffers.push_back(static_cast<float *>(p.state)); // freed with the others
    } else {
      p.state = make(stateElements, 0.05f);
    }
    p.out = make(size_t(batch) * P, 1.0f);
    p.path = path;
    if (!error.empty())
      return {};
    const size_t workspaceBytes = kdaDecodeWorkspaceBytes(p);
    if (workspaceBytes > 0) {
      float *workspace = nullptr;
      BENCH_CHECK(cudaMalloc(&workspace, workspaceBytes));
      buffers.push_back(workspace);
      p.workspace = workspace;
    }

    cudaStream_t stream;
    BENCH_CHECK(cudaStreamCreate(&stream));
    for (int i = 0; i < 10; ++i) // warm-up
      BENCH_CHECK(static_cast<cudaError_t>(launchKdaFusedDecode(p, stream)));
    BENCH_CHECK(cudaStreamSynchronize(stream));
    KdaDecodeBenchResult result;
    result.batch = batch;
    result.heads = heads;
    result.headDim = headDim;
    result.eagerMicroseconds =
        medianMicroseconds(stream, iterations, [&] { launchKdaFusedDecode(p, stream); });

    // One step captured as a graph and replayed: what the runtime's decode graphs do.
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    launchKdaFusedDecode(p, stream);
    BENCH_CHECK(cudaStreamEndCapture(stream, &graph));
    BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    result.graphMicroseconds =
        medianMicroseconds(stream, iterations, [&] { cudaGraphLaunch(exec, stream); });
    BENCH_CHECK(cudaStreamSynchronize(stream));

    // The floor: the same number of launches of an empty kernel, replayed the same way.
    cudaGraph_t floorGraph;
    cudaGraphExec_t floorExec;
    BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int launch = 0; launch < (workspaceBytes > 0 ? 2 : 1); ++launch)
      launchEmptyKernel(batch * heads, 128, stream);
    BENCH_CHECK(cudaStreamEndCapture(stream, &floorGraph));
    BENCH_CHECK(cudaGraphInstantiate(&floorExec, floorGraph, 0));
    result.graphFloorMicroseconds =
        medianMicroseconds(stream, iterations, [&] { cudaGraphLaunch(floorExec, stream); });
    BENCH_CHECK(cudaStreamSynchronize(stream));
    cudaGraphExecDestroy(floorExec);
    cudaGraphDestroy(floorGraph);
    result.stateBytes = 2.0 * (bf16State ? 2.0 : 4.0) * double(stateElements);
    result.bf16State = bf16State;
    result.graphStateTbPerSecond = result.stateBytes / (result.graphMicroseconds * 1e-6) / 1e12;
    const double convStateBytes = 2.0 * 4.0 * double(batch) * 3 * (W - 1) * P;
    const double activationBytes = 4.0 * double(batch) * (3 * P + P + heads + P + P);
    const double weightBytes = 4.0 * (3 * P * W + P + heads + headDim);
    result.trafficBytes = result.stateBytes + convStateBytes + activationBytes + weightBytes;
    result.graphTrafficTbPerSecond =
        result.trafficBytes / (result.graphMicroseconds * 1e-6) / 1e12;
    result.split = workspaceBytes > 0;
    results.push_back(result);

    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    for (float *buffer : buffers)
      cudaFree(buffer);
  }
  return results;
}

} // namespace hybrid::kernels::cuda
