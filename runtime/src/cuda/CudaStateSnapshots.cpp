// Speculative verification's state snapshots on the device (issue 9): before a pass the KDA
// states of each verified sequence are copied to a device snapshot, and a sequence that rejects
// part of its draft gets them back before its accepted rows are replayed (replayKdaLog). A
// slot's states are two contiguous runs (recurrent states, conv states), so each snapshot or
// restore is two device-to-device copies on the run stream.
#include "cuda/CudaExecutor.h"
#include "cuda/CudaExecutorImpl.h"

#include <algorithm>
#include <string>

namespace hybrid::cudadev {

Status CudaExecutor::snapshotSlots(std::span<const int32_t> slots) {
  Impl &impl = *impl_;
  const size_t stateBytes = impl.slotStateBytes, convBytes = impl.slotConvFloats * sizeof(float);
  const size_t entryBytes = stateBytes + convBytes;
  if (slots.size() > impl.snapshotCapacity) {
    // Ordered after the previous pass's restores (same stream) before the old entries go.
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(impl.streams[0]->stream), "state snapshot growth");
    cudaFree(impl.snapshots);
    impl.snapshots = nullptr;
    impl.snapshotCapacity = 0;
    CUDA_RETURN_IF_ERROR(cudaMalloc(&impl.snapshots, std::max<size_t>(1, slots.size() * entryBytes)),
                         "state snapshots for " + std::to_string(slots.size()) + " sequences");
    impl.snapshotCapacity = slots.size();
  }
  cudaStream_t stream = impl.streams[0]->stream;
  for (size_t i = 0; i < slots.size(); ++i) {
    const auto slot = static_cast<uint64_t>(slots[i]);
    unsigned char *entry = impl.snapshots + i * entryBytes;
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(entry, impl.stateRegion + slot * stateBytes, stateBytes,
                                         cudaMemcpyDeviceToDevice, stream),
                         "state snapshot");
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(entry + stateBytes,
                                         impl.convRegion + slot * impl.slotConvFloats, convBytes,
                                         cudaMemcpyDeviceToDevice, stream),
                         "conv state snapshot");
  }
  return Status::ok();
}

Status CudaExecutor::restoreSlot(int32_t slot, size_t index) {
  Impl &impl = *impl_;
  if (index >= impl.snapshotCapacity)
    return Status::error("state snapshot " + std::to_string(index) + " was not taken (" +
                         std::to_string(impl.snapshotCapacity) + " held)");
  const size_t stateBytes = impl.slotStateBytes, convBytes = impl.slotConvFloats * sizeof(float);
  const unsigned char *entry = impl.snapshots + index * (stateBytes + convBytes);
  const auto at = static_cast<uint64_t>(slot);
  cudaStream_t stream = impl.streams[0]->stream;
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(impl.stateRegion + at * stateBytes, entry, stateBytes,
                                       cudaMemcpyDeviceToDevice, stream),
                       "state restore");
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(impl.convRegion + at * impl.slotConvFloats,
                                       entry + stateBytes, convBytes, cudaMemcpyDeviceToDevice,
                                       stream),
                       "conv state restore");
  return Status::ok();
}

bool CudaExecutor::batchInvariant() const {
  return impl_->batchInvariant && impl_->batchVariantLayers.empty();
}

bool CudaExecutor::holdsEveryRecurrentState() const {
  return impl_->gpuStateLayers.size() == impl_->layerStateBytes.size();
}

} // namespace hybrid::cudadev
