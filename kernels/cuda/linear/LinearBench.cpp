#include "hybrid/kernels/cuda/LinearBench.h"

#include "../common/bench_support.h"
#include "gemv.cuh"
#include "hybrid/kernels/cuda/KdaBench.h" // kH200CopyTbPerSecond
#include "hybrid/kernels/cuda/Linear.h"

#include <algorithm>
#include <cuda_runtime.h>
#include <random>

namespace hybrid::kernels::cuda {
using namespace bench;

namespace {
constexpr double kMatricesBytes = 256e6; // per timed graph: well past the 50 MB L2
constexpr int32_t kMostLayers = 512;

// A device, and row counts the decode kernels take; else false with `error` set.
bool decodeRowsRunnable(const std::vector<int32_t> &rowCounts, std::string &error) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    error = "no CUDA device";
    return false;
  }
  for (int32_t rows : rowCounts)
    if (rows < 1 || rows > kGemvMaxRows) {
      error = "rows " + std::to_string(rows) + " outside the decode kernel's 1-" +
              std::to_string(kGemvMaxRows);
      return false;
    }
  return true;
}

// "INxOUT".
std::string shapeName(const GemvBenchShape &shape) {
  return std::to_string(shape.in) + "x" + std::to_string(shape.out);
}

// A timed graph's layers: `layers`, else enough matrices of matrixBytes that none is read from L2.
int32_t layersFor(int32_t layers, double matrixBytes) {
  return layers > 0 ? layers
                    : int32_t(std::clamp<double>(kMatricesBytes / matrixBytes, 2, kMostLayers));
}

// `count` device copies of `bytes` at `source` (distinct addresses: no L2 reuse between layers);
// empty when an allocation or copy fails.
std::vector<const void *> layerCopies(DeviceAllocations &held, const void *source, size_t bytes,
                                      int32_t count) {
  std::vector<const void *> copies;
  for (int32_t l = 0; l < count; ++l) {
    auto *device = held.allocate<unsigned char>(bytes);
    if (!device || cudaMemcpy(device, source, bytes, cudaMemcpyDeviceToDevice) != cudaSuccess)
      return {};
    copies.push_back(device);
  }
  return copies;
}

// A row of results: `microseconds` for a graph of `layers` calls, `weightBytes` a call.
GemvBenchResult resultOf(int32_t rows, const GemvBenchShape &shape, const char *form,
                         bool automatic, int32_t layers, double microseconds, double weightBytes) {
  GemvBenchResult r;
  r.rows = rows;
  r.in = shape.in;
  r.out = shape.out;
  r.form = form;
  r.automatic = automatic;
  r.layers = layers;
  r.microseconds = microseconds / layers;
  r.weightBytes = weightBytes;
  r.terabytesPerSecond = r.weightBytes / (r.microseconds * 1e-6) / 1e12;
  r.copyShare = r.terabytesPerSecond / kH200CopyTbPerSecond;
  return r;
}
} // namespace

std::vector<GemvBenchResult> benchGemvDecode(const std::vector<int32_t> &rowCounts,
                                             const std::vector<GemvBenchShape> &shapes,
                                             int32_t layers, int32_t iterations,
                                             std::string &error) {
  if (!decodeRowsRunnable(rowCounts, error))
    return {};
  std::mt19937 rng(29);
  std::vector<GemvBenchResult> results;
  for (const GemvBenchShape &shape : shapes) {
    if (shape.in <= 0 || shape.in % 8 != 0 || shape.out <= 0) {
      error = "shape " + shapeName(shape) + ": in must be a positive multiple of 8, out positive";
      return {};
    }
    const size_t matrix = size_t(shape.in) * size_t(shape.out);
    const int32_t count = layersFor(layers, 2.0 * double(matrix));
    DeviceAllocations held; // this shape's buffers
    // One random matrix copied into every layer's.
    void *source = held.keep(deviceRandomBf16(matrix, 0.02f, 0.0f, rng, error));
    if (!source)
      return {};
    const std::vector<const void *> weights = layerCopies(held, source, matrix * 2, count);
    if (weights.empty()) {
      error = "cannot allocate " + std::to_string(count) + " matrices of " + shapeName(shape);
      return {};
    }
    const float *x =
        held.keep(deviceRandom(size_t(kGemvMaxRows) * shape.in, 1.0f, 0.0f, rng, error));
    float *y = held.allocate<float>(size_t(kGemvMaxRows) * shape.out);
    if (!x || !y) {
      error = error.empty() ? "cannot allocate the activations" : error;
      return {};
    }
    for (int32_t rows : rowCounts)
      for (GemvForm form : {GemvForm::Scalar, GemvForm::TensorCores}) {
        auto paramsOf = [&](const void *weight, GemvForm asked) {
          GemvParams p;
          p.rows = rows;
          p.in = shape.in;
          p.out = shape.out;
          p.x = x;
          p.xStride = shape.in;
          p.weight = weight;
          p.weightStride = shape.in;
          p.y = y;
          p.yStride = shape.out;
          p.form = asked;
          return p;
        };
        // The kernel's own rule: which forms the shape takes, which one a call picks itself.
        const bool tensorCores = gemvOnTensorCores(paramsOf(weights[0], form));
        if (form == GemvForm::TensorCores && !tensorCores)
          continue;
        const bool automatic =
            gemvOnTensorCores(paramsOf(weights[0], GemvForm::Auto)) == tensorCores;
        const double microseconds = graphMicroseconds(iterations, [&](cudaStream_t s) {
          for (const void *weight : weights)
            if (int status = launchGemv(paramsOf(weight, form), s))
              return status;
          return 0;
        });
        if (microseconds < 0) {
          error =
              "the GEMV launch failed for " + std::to_string(rows) + " rows of " + shapeName(shape);
          return {};
        }
        results.push_back(resultOf(rows, shape,
                                   form == GemvForm::Scalar ? "scalar" : "tensor-cores", automatic,
                                   count, microseconds, 2.0 * double(matrix)));
      }
  }
  return results;
}

std::vector<GemvBenchResult> benchFp8GemvDecode(const std::vector<int32_t> &rowCounts,
                                                const std::vector<GemvBenchShape> &shapes,
                                                int32_t layers, int32_t iterations,
                                                std::string &error) {
  if (!decodeRowsRunnable(rowCounts, error))
    return {};
  LinearContext context;
  if (int status = context.init()) {
    error = std::string("cannot set up cuBLASLt: ") + linearErrorText(status);
    return {};
  }
  std::mt19937 rng(31);
  std::vector<GemvBenchResult> results;
  for (const GemvBenchShape &shape : shapes) {
    if (shape.in <= 0 || shape.in % 16 != 0 || shape.out <= 0 || shape.out % 4 != 0) {
      error =
          "shape " + shapeName(shape) + ": FP8 layers need in a positive multiple of 16, out of 4";
      return {};
    }
    const size_t matrix = size_t(shape.in) * size_t(shape.out); // bytes: one code a weight
    const int64_t scaleFloats = (shape.out + 127) / 128 * linearFp8WeightScaleStride(shape.in);
    const int32_t count = layersFor(layers, double(matrix));
    DeviceAllocations held; // this shape's buffers
    // Random finite E4M3 codes copied into every layer's matrix, the scales into every layer's.
    const uint8_t *source = held.keep(deviceRandomFp8(matrix, rng, error));
    if (!source)
      return {};
    const std::vector<float> scales = randomFp8BlockScales(static_cast<size_t>(scaleFloats), rng);
    const std::vector<const void *> weights = layerCopies(held, source, matrix, count);
    std::vector<const float *> weightScales;
    for (int32_t l = 0; l < count && !weights.empty(); ++l)
      if (const float *table = held.keep(deviceCopy(scales)))
        weightScales.push_back(table);
    if (weights.empty() || weightScales.size() != size_t(count)) {
      error = "cannot allocate " + std::to_string(count) + " FP8 matrices of " + shapeName(shape);
      return {};
    }
    const float *x =
        held.keep(deviceRandom(size_t(kGemvMaxRows) * shape.in, 1.0f, 0.0f, rng, error));
    float *y = held.allocate<float>(size_t(kGemvMaxRows) * shape.out);
    void *scratch =
        held.allocate<unsigned char>(linearFp8MaxScratchBytes(kGemvMaxRows, shape.in, shape.out));
    if (!x || !y || !scratch) {
      error = error.empty() ? "cannot allocate the FP8 layers' buffers" : error;
      return {};
    }
    for (int32_t rows : rowCounts)
      for (bool decodeKernel : {true, false}) {
        if (decodeKernel && shape.in % 128 != 0)
          continue;
        auto paramsOf = [&](size_t layer) {
          LinearFp8Params p;
          p.rows = rows;
          p.in = shape.in;
          p.out = shape.out;
          p.x = x;
          p.weight = weights[layer];
          p.weightScale = weightScales[layer];
          p.y = y;
          p.scratch = scratch;
          return p;
        };
        context.setDecodeKernel(decodeKernel);
        // Outside the graph first: cuBLASLt's algorithm choice and the kernels' one-time setup.
        if (int status = context.runFp8(paramsOf(0), nullptr);
            status != 0 || cudaDeviceSynchronize() != cudaSuccess) {
          error = "the FP8 layer failed for " + std::to_string(rows) + " rows of " +
                  shapeName(shape) + ": " + linearErrorText(status);
          return {};
        }
        const double microseconds = graphMicroseconds(iterations, [&](cudaStream_t s) {
          for (size_t layer = 0; layer < weights.size(); ++layer)
            if (int status = context.runFp8(paramsOf(layer), s))
              return status;
          return 0;
        });
        if (microseconds < 0) {
          error = "the FP8 layer failed in a graph for " + std::to_string(rows) + " rows of " +
                  shapeName(shape);
          return {};
        }
        results.push_back(resultOf(rows, shape, decodeKernel ? "fp8-gemv" : "fp8-cublaslt",
                                   decodeKernel || shape.in % 128 != 0, count, microseconds,
                                   double(matrix) + 4.0 * double(scaleFloats)));
      }
  }
  return results;
}

} // namespace hybrid::kernels::cuda
