// --hybrid-assign-weight-layout: tiled ("NZ") layouts for the weights GEMM kernels read
// (Passes.td).
#include "compiler/Transforms/Passes.h"

#include "hybrid/kernels/ref/TiledLayout.h"
#include "hybrid/runtime/WeightArchive.h"
#include "runtime/schema/kernel_signatures.h"

#include "mlir/IR/Builders.h"
#include "llvm/ADT/DenseMap.h"

namespace hybrid {
#define GEN_PASS_DEF_ASSIGNWEIGHTLAYOUT
#include "compiler/Transforms/Passes.h.inc"
} // namespace hybrid

using namespace mlir;

namespace hybrid {
namespace {

int64_t elementBytes(Type type) { return std::max<int64_t>(1, type.getIntOrFloatBitWidth() / 8); }

void assignLayouts(plan::PlanOp planOp) {
  // The cuda device's GEMMs (cuBLASLt) read the checkpoint's row-major [out, in] weights.
  if (planOp.getDevice() == "cuda")
    return;
  Builder builder(planOp.getContext());
  SmallVector<plan::WeightOp> weights(planOp.getBodyBlock().getOps<plan::WeightOp>());

  // A weight is tiled when every dispatch reading it reads that role as a tiled GEMM operand.
  llvm::DenseMap<int32_t, bool> tiledEverywhere;
  planOp.walk([&](plan::DispatchOp dispatch) {
    const plan::KernelSignature *signature =
        plan::kernelSignature(static_cast<plan::fb::KernelId>(dispatch.getKernel()));
    for (auto [role, index] : llvm::enumerate(dispatch.getWeights())) {
      if (index < 0)
        continue;
      const bool tiled = signature && role < 32 && (signature->tiledWeights >> role) & 1;
      auto [it, inserted] = tiledEverywhere.try_emplace(index, tiled);
      if (!inserted)
        it->second = it->second && tiled;
    }
  });

  SmallVector<uint64_t> sizes;
  for (auto [index, weight] : llvm::enumerate(weights)) {
    auto type = cast<RankedTensorType>(weight.getType());
    const bool tile = tiledEverywhere.lookup(static_cast<int32_t>(index)) &&
                      type.getRank() == 2 && static_cast<int32_t>(weight.getScale()) < 0 &&
                      !weight.getBlock();
    if (tile) {
      const int64_t bytes = elementBytes(type.getElementType());
      kernels::ref::TileShape shape =
          kernels::ref::defaultTileFor(type.getDimSize(0), type.getDimSize(1), bytes);
      kernels::ref::TiledLayout layout{type.getDimSize(0), type.getDimSize(1), shape};
      weight.setNzTiledAttr(builder.getBoolAttr(true));
      weight.setTileAttr(builder.getDenseI32ArrayAttr(
          {static_cast<int32_t>(shape.rows), static_cast<int32_t>(shape.cols)}));
      weight.setSizeAttr(builder.getI64IntegerAttr(layout.tiledBytes(bytes)));
    }
    sizes.push_back(weight.getSize());
  }

  // Padding changes sizes: lay the archive out again with the shared rule.
  std::vector<uint64_t> offsets = planWeightOffsets(sizes);
  for (auto [weight, offset] : llvm::zip(weights, offsets))
    weight.setOffsetAttr(builder.getI64IntegerAttr(static_cast<int64_t>(offset)));
  if (!weights.empty())
    planOp.setWeightArchiveBytesAttr(
        builder.getI64IntegerAttr(static_cast<int64_t>(offsets.back() + sizes.back())));
}

struct AssignWeightLayoutPass : impl::AssignWeightLayoutBase<AssignWeightLayoutPass> {
  void runOnOperation() override {
    for (plan::PlanOp planOp : getOperation().getOps<plan::PlanOp>())
      assignLayouts(planOp);
  }
};

} // namespace
} // namespace hybrid
