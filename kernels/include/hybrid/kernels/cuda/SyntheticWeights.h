// Synthetic weights generated in place in device memory (see hybrid/kernels/SyntheticWeights.h for
// the values): the same bits as ref::fillSynthetic, without a host buffer. CUDA-free header.
#pragma once

#include "hybrid/kernels/SyntheticWeights.h"

namespace hybrid::kernels::cuda {

// Writes fill.storedElements elements of fill.storage into `out` (device memory) on `stream`.
// Returns 0 or the CUDA error code (cudaErrorInvalidValue for a null output with elements to
// write, a negative count or an unknown kind or storage).
int launchSyntheticFill(const SyntheticFill &fill, void *out, void *stream);

} // namespace hybrid::kernels::cuda
