// The cuda device's tuned kernel configurations (docs/autotune.md): looked up at run time, per
// launch shape bucket, from the cache folder hybrid-bench tune wrote on this GPU. At run time and
// not in the plan, because the key holds the GPU model, SM count and driver: facts of the machine
// that runs the plan, which the compiling machine (no GPU) does not know.
#include "cuda/CudaExecutorImpl.h"

#include "hybrid/kernels/cuda/Tune.h"

namespace hybrid::cudadev {
namespace kt = hybrid::kernels::tuning;

Status CudaExecutor::Impl::openTuning(const std::string &setting) {
  tuning = std::make_unique<kt::TuningTable>(); // defaults everywhere
  if (setting == "off")
    return Status::ok();
  const bool byDefault = setting == "default";
  StatusOr<std::string> dir = byDefault ? cache::defaultCacheDir() : StatusOr<std::string>(setting);
  auto device = kernels::cuda::cudaTuningDevice();
  auto store = dir.isOk() ? cache::CacheStore::open(*dir)
                          : StatusOr<cache::CacheStore>(dir.status());
  if (byDefault && (!device.isOk() || !store.isOk()))
    return Status::ok(); // no usable default cache folder: the defaults, as without tuning
  if (!device.isOk())
    return Status::error("tuning cache: " + device.status().message());
  if (!store.isOk())
    return Status::error("tuning cache '" + setting + "': " + store.status().message());
  tuning = std::make_unique<kt::TuningTable>(std::move(*store), std::move(*device));
  return Status::ok();
}

void CudaExecutor::Impl::applyTuning(kc::IndexerParams &params) {
  if (tuning && tuning->enabled())
    if (auto config = tuning->lookup(kt::indexerScoresKernel(), kt::indexerScoresShape(params)))
      kt::applyConfig(*config, params);
}

void CudaExecutor::Impl::applyTuning(kc::SparseMlaDecodeParams &params) {
  if (tuning && tuning->enabled())
    if (auto config =
            tuning->lookup(kt::sparseMlaDecodeKernel(), kt::sparseMlaDecodeShape(params)))
      kt::applyConfig(*config, params);
}

void CudaExecutor::Impl::applyTuning(kc::MoeExpertsParams &params) {
  if (tuning && tuning->enabled())
    if (auto config = tuning->lookup(kt::moeExpertsKernel(), kt::moeExpertsShape(params)))
      kt::applyConfig(*config, params);
}

void CudaExecutor::Impl::applyTuning(kc::KdaDecodeParams &params) {
  if (tuning && tuning->enabled())
    if (auto config = tuning->lookup(kt::kdaDecodeKernel(), kt::kdaDecodeShape(params)))
      kt::applyConfig(*config, params);
}

std::string CudaExecutor::tuningReport() const {
  if (!impl_->tuning || !impl_->tuning->enabled())
    return "kernel tuning: off (the kernels' defaults)\n";
  const cache::TuningDevice &device = impl_->tuning->device();
  return "kernel tuning for " + device.gpu + ", " + std::to_string(device.smCount) + " SMs, driver " +
         std::to_string(device.driverVersion) + ", " + device.compiler + ":\n" +
         impl_->tuning->report();
}

} // namespace hybrid::cudadev
