// AttnRes on CUDA (AttnRes.h) against ref::attnResMix and the RMSNorm that reads the mix: one
// candidate (a first block), several, and 60 (a deep model's blocks), with and without the fused
// norm. Labelled `gpu`; skipped without a GPU.
#include "hybrid/kernels/cuda/AttnRes.h"
#include "hybrid/kernels/ref/AttnRes.h"
#include "hybrid/kernels/ref/Norm.h"
#include "CudaTestSupport.h"

#include <memory>
#include <vector>

namespace hybrid::kernels {
namespace {

TEST(AttnResCuda, MixAndNormMatchTheReference) {
  if (!gpuPresent())
    GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(12);
  struct Shape { int tokens, dim, candidates; };
  for (Shape s : {Shape{3, 256, 1}, Shape{5, 2304, 4}, Shape{2, 1000, 60}})
    for (bool withNorm : {false, true}) {
      SCOPED_TRACE("candidates " + std::to_string(s.candidates));
      std::vector<std::vector<float>> values;
      std::vector<std::unique_ptr<DeviceBuffer<float>>> device;
      std::vector<const float *> pointers;
      for (int m = 0; m < s.candidates; ++m) {
        values.push_back(random(size_t(s.tokens) * s.dim, rng, 1.0f + 0.1f * float(m)));
        device.push_back(std::make_unique<DeviceBuffer<float>>(values.back()));
        pointers.push_back(values.back().data());
      }
      const std::vector<float> norm = random(size_t(s.dim), rng, 0.1f, 1.0f);
      const std::vector<float> proj = random(size_t(s.dim), rng, 0.05f);
      const std::vector<float> outputNorm = random(size_t(s.dim), rng, 0.1f, 1.0f);
      std::vector<float> mixed(size_t(s.tokens) * s.dim), normed(mixed.size());
      ref::attnResMix(pointers, s.tokens, s.dim, norm, proj, 1e-6f, mixed);
      ref::rmsNorm(mixed, outputNorm, normed, s.tokens, s.dim, 1e-5f);

      DeviceBuffer<float> dNorm(norm), dProj(proj), dOutputNorm(outputNorm);
      DeviceBuffer<float> dMixed{std::vector<float>(mixed.size())}, dNormed{std::vector<float>(mixed.size())};
      cuda::AttnResParams p;
      p.tokens = s.tokens;
      p.dim = s.dim;
      p.candidates = s.candidates;
      for (int m = 0; m < s.candidates; ++m)
        p.values[m] = device[size_t(m)]->data;
      p.normWeight = dNorm.data;
      p.projWeight = dProj.data;
      p.epsilon = 1e-6f;
      p.mixed = dMixed.data;
      if (withNorm) {
        p.outputNormWeight = dOutputNorm.data;
        p.outputEpsilon = 1e-5f;
        p.normed = dNormed.data;
      }
      ASSERT_EQ(cuda::launchAttnResMix(p, nullptr), 0);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_LT(relativeRms(dMixed.download(), mixed), 1e-5);
      if (withNorm) {
        EXPECT_LT(relativeRms(dNormed.download(), normed), 1e-5);
      }
    }
  cuda::AttnResParams bad; // nothing set
  EXPECT_EQ(cuda::launchAttnResMix(bad, nullptr), int(cudaErrorInvalidValue));
}

} // namespace
} // namespace hybrid::kernels
