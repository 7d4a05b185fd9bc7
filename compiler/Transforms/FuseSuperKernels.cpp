// --hybrid-fuse-super-kernels: groups of plan steps into the fused kernels the kernel library
// provides (Passes.td).
#include "compiler/Transforms/Passes.h"
#include "mlir/IR/Builders.h"

#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/DenseSet.h"

namespace hybrid {
#define GEN_PASS_DEF_FUSESUPERKERNELS
#include "compiler/Transforms/Passes.h.inc"
} // namespace hybrid

using namespace mlir;

namespace hybrid {
namespace {

// Folds every RMSNorm into the residual add or AttnRes mix that produces its input: the fused
// kernel writes both the sum (still read by the residual chain) and its normalised form.
void fuseNormsIntoProducers(plan::ProgramOp program) {
  Builder builder(program.getContext());
  llvm::DenseMap<int32_t, plan::DispatchOp> writerOf;
  SmallVector<plan::DispatchOp> fusedNorms;
  for (plan::DispatchOp dispatch : program.getBodyBlock().getOps<plan::DispatchOp>()) {
    if (dispatch.getKernel() == plan::KernelId::rms_norm) {
      auto producer = writerOf.lookup(dispatch.getInputs().front());
      const bool fusable = producer && producer.getOutputs().size() == 1 &&
                           (producer.getKernel() == plan::KernelId::add ||
                            producer.getKernel() == plan::KernelId::attn_res);
      if (fusable) {
        const int32_t normed = dispatch.getOutputs().front();
        auto epsilon = dispatch.getParams().get("epsilon");
        SmallVector<int32_t> outputs = {producer.getOutputs().front(), normed};
        SmallVector<int32_t> weights(producer.getWeights());
        weights.push_back(dispatch.getWeights().front());
        SmallVector<NamedAttribute> params(producer.getParams().getValue());
        if (producer.getKernel() == plan::KernelId::add) {
          producer.setKernel(plan::KernelId::add_rms_norm);
          params.push_back(builder.getNamedAttr("epsilon", epsilon));
        } else {
          producer.setKernel(plan::KernelId::attn_res_rms_norm);
          params.push_back(builder.getNamedAttr("output_norm_epsilon", epsilon));
        }
        producer.setOutputsAttr(builder.getDenseI32ArrayAttr(outputs));
        producer.setWeightsAttr(builder.getDenseI32ArrayAttr(weights));
        producer.setParamsAttr(builder.getDictionaryAttr(params));
        writerOf[normed] = producer;
        fusedNorms.push_back(dispatch);
        continue;
      }
    }
    for (int32_t output : dispatch.getOutputs())
      writerOf[output] = dispatch;
  }
  for (plan::DispatchOp norm : fusedNorms)
    norm.erase();
}

// Folds an add whose sum only an add_rms_norm reads into that add_rms_norm, as its third input:
// sum = a + (b + c), the two adds' order, so the same bits in one launch (an MoE's routed +
// shared experts, then the residual add and the next layer's norm: one launch of ~1 us a layer
// less at decode). A value the program also names elsewhere (a layer output, the logits) stays.
void foldAddsIntoNorms(plan::ProgramOp program) {
  llvm::DenseMap<int32_t, plan::DispatchOp> writerOf;
  llvm::DenseMap<int32_t, int> readers;
  for (plan::DispatchOp dispatch : program.getBodyBlock().getOps<plan::DispatchOp>()) {
    for (int32_t input : dispatch.getInputs())
      ++readers[input];
    for (int32_t output : dispatch.getOutputs())
      writerOf[output] = dispatch;
  }
  llvm::DenseSet<int32_t> named(program.getLayerOutputs().begin(), program.getLayerOutputs().end());
  named.insert(program.getLogits());
  named.insert(program.getTokenIds());
  named.insert(program.getHiddenInput());
  Builder builder(program.getContext());
  SmallVector<plan::DispatchOp> folded;
  for (plan::DispatchOp norm : program.getBodyBlock().getOps<plan::DispatchOp>()) {
    if (norm.getKernel() != plan::KernelId::add_rms_norm || norm.getInputs().size() != 2)
      continue;
    for (int position = 1; position >= 0; --position) {
      const int32_t value = norm.getInputs()[position];
      plan::DispatchOp add = writerOf.lookup(value);
      if (!add || add.getKernel() != plan::KernelId::add || add.getOutputs().size() != 1 ||
          add.getInputs().size() != 2 || readers.lookup(value) != 1 || named.contains(value) ||
          !add->isBeforeInBlock(norm))
        continue;
      const SmallVector<int32_t> inputs = {norm.getInputs()[1 - position], add.getInputs()[0],
                                           add.getInputs()[1]};
      norm.setInputsAttr(builder.getDenseI32ArrayAttr(inputs));
      folded.push_back(add);
      break;
    }
  }
  for (plan::DispatchOp add : folded)
    add.erase();
}

struct FuseSuperKernelsPass : impl::FuseSuperKernelsBase<FuseSuperKernelsPass> {
  void runOnOperation() override {
    getOperation().walk([](plan::ProgramOp program) {
      fuseNormsIntoProducers(program);
      foldAddsIntoNorms(program);
    });
  }
};

} // namespace
} // namespace hybrid
