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
      error = "shape " + std::to_string(shape.in) + "x" + std::to_string(shape.out) +
              ": in must be a positive multiple of 8, out positive";
      return {};
    }
    const size_t matrix = size_t(shape.in) * size_t(shape.out);
    const int32_t count =
        layers > 0
            ? layers
            : int32_t(std::clamp<double>(kMatricesBytes / (2.0 * double(matrix)), 2, kMostLayers));
    DeviceAllocations held; // this shape's buffers
    // One random matrix copied into every layer's (distinct addresses: no L2 reuse).
    void *source = held.keep(deviceRandomBf16(matrix, 0.02f, 0.0f, rng, error));
    if (!source)
      return {};
    std::vector<const void *> weights;
    for (int32_t l = 0; l < count; ++l) {
      auto *device = held.allocate<uint16_t>(matrix);
      if (!device ||
          cudaMemcpy(device, source, matrix * 2, cudaMemcpyDeviceToDevice) != cudaSuccess) {
        error = "cannot allocate " + std::to_string(count) + " matrices of " +
                std::to_string(shape.in) + "x" + std::to_string(shape.out);
        return {};
      }
      weights.push_back(device);
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
          error = "the GEMV launch failed for " + std::to_string(rows) + " rows of " +
                  std::to_string(shape.in) + "x" + std::to_string(shape.out);
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
      error = "shape " + std::to_string(shape.in) + "x" + std::to_string(shape.out) +
              ": FP8 layers need in a positive multiple of 16, out of 4";
      return {};
    }
    const size_t matrix = size_t(shape.in) * size_t(shape.out); // bytes: one code a weight
    const int64_t scaleFloats = (shape.out + 127) / 128 * linearFp8WeightScaleStride(shape.in);
    const int32_t count =
        layers > 0 ? layers
                   : int32_t(std::clamp<double>(kMatricesBytes / double(matrix), 2, kMostLayers));
    DeviceAllocations held; // this shape's buffers
    // Random finite E4M3 codes copied into every layer's matrix.
    const uint8_t *source = held.keep(deviceRandomFp8(matrix, rng, error));
    std::uniform_real_distribution<float> scale(0.5e-3f, 2e-3f);
    std::vector<float> scales(static_cast<size_t>(scaleFloats));
    for (float &v : scales)
      v = scale(rng);
    std::vector<const uint8_t *> weights;
    std::vector<const float *> weightScales;
    for (int32_t l = 0; l < count && source; ++l) {
      auto *device = held.allocate<uint8_t>(matrix);
      const float *table = held.keep(deviceCopy(scales));
      if (!device || !table ||
          cudaMemcpy(device, source, matrix, cudaMemcpyDeviceToDevice) != cudaSuccess) {
        error = "cannot allocate " + std::to_string(count) + " FP8 matrices of " +
                std::to_string(shape.in) + "x" + std::to_string(shape.out);
        return {};
      }
      weights.push_back(device);
      weightScales.push_back(table);
    }
    const float *x =
        held.keep(deviceRandom(size_t(kGemvMaxRows) * shape.in, 1.0f, 0.0f, rng, error));
    float *y = held.allocate<float>(size_t(kGemvMaxRows) * shape.out);
    void *scratch =
        held.allocate<unsigned char>(linearFp8MaxScratchBytes(kGemvMaxRows, shape.in, shape.out));
    if (!source || weights.empty() || !x || !y || !scratch) {
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
                  std::to_string(shape.in) + "x" + std::to_string(shape.out) + ": " +
                  linearErrorText(status);
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
                  std::to_string(shape.in) + "x" + std::to_string(shape.out);
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
