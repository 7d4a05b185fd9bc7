#include "compiler/Analysis/ModelSummary.h"

#include "hybrid/runtime/PlanReport.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"

#include <map>

using namespace mlir;

namespace hybrid::analysis {
namespace {

std::string count(double n) {
  if (n >= 1e9)
    return llvm::formatv("{0:F2} B", n / 1e9).str();
  if (n >= 1e6)
    return llvm::formatv("{0:F2} M", n / 1e6).str();
  return llvm::formatv("{0:F1} K", n / 1e3).str();
}

} // namespace

void printModelSummary(ModelOp model, llvm::raw_ostream &os) {
  struct LayerRow {
    std::vector<std::string> kinds;
  };
  std::map<int64_t, LayerRow> layers;
  double parameters = 0, weightBytes = 0;
  double kvBytesPerToken = 0, recurrentBytes = 0, convBytes = 0;
  int64_t kvLayers = 0, recurrentLayers = 0;
  const double activationBytes = 2.0; // caches in bf16 for the summary

  auto addWeight = [&](WeightAttr weight) {
    parameters += weight.getNumElements();
    weightBytes += weight.getNumElements() * weight.getElementType().getIntOrFloatBitWidth() / 8.0;
    if (!weight.getScaleName().empty())
      weightBytes += weight.getScaleType().getNumElements() * 4.0;
  };
  model.walk([&](Operation *op) {
    for (NamedAttribute attr : op->getAttrs()) {
      if (auto weight = dyn_cast<WeightAttr>(attr.getValue()))
        addWeight(weight);
      else if (auto list = dyn_cast<ArrayAttr>(attr.getValue()))
        for (Attribute element : list)
          if (auto weight = dyn_cast<WeightAttr>(element))
            addWeight(weight);
    }
    int64_t layer = layerOf(op);
    std::string kind = op->getName().stripDialect().str();
    if (layer >= 0 && (isa<KdaOp, MlaOp, SparseMlaOp, DsaIndexerOp, MoeOp, MlpOp>(op)))
      layers[layer].kinds.push_back(kind);
    if (auto kda = dyn_cast<KdaOp>(op)) {
      ++recurrentLayers;
      int64_t p = kda.getNumHeads() * kda.getHeadDim();
      recurrentBytes += 4.0 * kda.getNumHeads() * kda.getHeadDim() * kda.getHeadDim();
      convBytes += activationBytes * 3 * p * (kda.getConvKernel() - 1);
    } else if (auto mla = dyn_cast<MlaOp>(op)) {
      ++kvLayers;
      kvBytesPerToken += activationBytes * (mla.getKvLoraRank() + mla.getQkRopeHeadDim());
    } else if (auto mla = dyn_cast<SparseMlaOp>(op)) {
      ++kvLayers;
      kvBytesPerToken += activationBytes * (mla.getKvLoraRank() + mla.getQkRopeHeadDim());
    } else if (auto indexer = dyn_cast<DsaIndexerOp>(op)) {
      kvBytesPerToken += activationBytes * indexer.getIndexHeadDim();
    }
  });

  os << "model " << model.getSymName() << " (" << model.getModelType()
     << "): " << model.getNumLayers() << " layers, hidden " << model.getHiddenSize() << ", vocab "
     << model.getVocabSize() << ", " << count(parameters) << " parameters ("
     << formatBytes(weightBytes) << ")\n";
  os << "layer  ops\n";
  for (const auto &[layer, row] : layers)
    os << llvm::format("%5lld  ", static_cast<long long>(layer)) << llvm::join(row.kinds, " + ")
       << "\n";
  os << "KV cache per token: " << kvLayers << " attention layers, " << formatBytes(kvBytesPerToken)
     << " (bf16)\n";
  os << "recurrent state per sequence: " << recurrentLayers << " KDA layers, "
     << formatBytes(recurrentBytes) << " fp32 state + " << formatBytes(convBytes)
     << " conv state (bf16)\n";
}

} // namespace hybrid::analysis
