// A communicator that does no communication (hybrid-bench e2e --skip-collectives): what a sharded
// step costs without its collectives, so that the share of the step spent communicating is the
// difference to the real run. Every collective returns at once and leaves its buffers as they
// are; rank, world size, buffer kind and group splits are the wrapped communicator's, so the
// plans load and run the same kernels. The numbers it yields are wrong by design.
#include "hybrid/runtime/Communicator.h"

namespace hybrid::comm {
namespace {

class SkippingCommunicator final : public Communicator {
public:
  SkippingCommunicator(Communicator &real, std::unique_ptr<Communicator> owned)
      : real_(real), owned_(std::move(owned)) {}

  int rank() const override { return real_.rank(); }
  int worldSize() const override { return real_.worldSize(); }
  std::string backend() const override { return real_.backend() + " (collectives skipped)"; }
  bool deviceBuffers() const override { return real_.deviceBuffers(); }

  Status allReduceSum(float *, size_t, void *) override { return Status::ok(); }
  Status allGather(const float *, float *, size_t, void *) override { return Status::ok(); }
  Status reduceScatterSum(const float *, float *, size_t, void *) override { return Status::ok(); }
  Status allToAll(const float *, float *, size_t, void *) override { return Status::ok(); }
  // Load and the tools synchronize through it: kept, it costs nothing per step.
  Status barrier() override { return real_.barrier(); }
  StatusOr<std::unique_ptr<Communicator>> split(int color, int key) override {
    HYBRID_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> group, real_.split(color, key));
    Communicator &groupRef = *group;
    return std::unique_ptr<Communicator>(new SkippingCommunicator(groupRef, std::move(group)));
  }

private:
  Communicator &real_;
  std::unique_ptr<Communicator> owned_; // a split's group; null for the one wrapped by the caller
};

} // namespace

std::unique_ptr<Communicator> skipCollectives(Communicator &real) {
  return std::make_unique<SkippingCommunicator>(real, nullptr);
}

} // namespace hybrid::comm
