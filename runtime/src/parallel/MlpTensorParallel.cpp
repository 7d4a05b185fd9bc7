#include "hybrid/runtime/ContextParallel.h"

namespace hybrid::parallel {

namespace ref = kernels::ref;

RowRange tensorParallelRows(int64_t size, int rank, int worldSize) {
  if (size <= 0 || worldSize <= 0 || rank < 0 || rank >= worldSize)
    return {};
  return {size * rank / worldSize, size * (rank + 1) / worldSize};
}

Status mlpTensorParallel(comm::Communicator &communicator, std::span<const float> x,
                         int64_t tokens, const ref::SwiGluWeights &slice, std::span<float> out) {
  const int64_t H = slice.hiddenSize, I = slice.intermediateSize;
  if (tokens < 0 || H <= 0 || I < 0 || x.size() < size_t(tokens * H) ||
      out.size() < size_t(tokens * H) || slice.gateProj.size() != size_t(I * H) ||
      slice.upProj.size() != size_t(I * H) || slice.downProj.size() != size_t(H * I))
    return Status::error("MLP tensor parallel: rank " + std::to_string(communicator.rank()) +
                         " passed a slice that does not fit (" + std::to_string(tokens) +
                         " tokens, hidden " + std::to_string(H) + ", " + std::to_string(I) +
                         " intermediate rows)");
  std::fill(out.begin(), out.begin() + tokens * H, 0.0f);
  if (I > 0 && tokens > 0)
    ref::swiGluMlp(x, tokens, slice, out); // this rank's partial sum
  return communicator.allReduceSum(out.data(), size_t(tokens * H));
}

} // namespace hybrid::parallel
