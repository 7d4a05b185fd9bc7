#include "hybrid/runtime/PlanReport.h"

#include "hybrid/runtime/WeightArchive.h"
#include "runtime/schema/kernel_signatures.h"

#include <cstdio>
#include <map>
#include <string>

namespace hybrid {
std::string formatBytes(double count) {
  const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (count >= 1024 && unit < 4) {
    count /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, "%.1f %s", count, units[unit]);
  return text;
}

void printPlanReport(const plan::fb::Plan &plan, std::ostream &os) {
  namespace fb = plan::fb;
  os << "plan " << (plan.model_type() ? plan.model_type()->str() : "?") << " for "
     << (plan.target() && plan.target()->device() ? plan.target()->device()->str() : "?");
  if (plan.target() && plan.target()->arch() && plan.target()->arch()->size())
    os << " " << plan.target()->arch()->str();
  os << "\n";

  std::map<std::string, uint64_t> weightBytes;
  uint64_t totalWeights = 0, tiledBytes = 0;
  size_t tiled = 0;
  if (plan.weights())
    for (const fb::Weight *weight : *plan.weights()) {
      weightBytes[fb::EnumNameDType(weight->dtype())] += weight->size();
      totalWeights += weight->size();
      if (weight->layout() == fb::Layout::NzTiled) {
        ++tiled;
        tiledBytes += weight->size();
      }
    }
  os << "weights  " << (plan.weights() ? plan.weights()->size() : 0) << " tensors, "
     << formatBytes(double(totalWeights));
  for (const auto &[dtype, size] : weightBytes)
    os << ", " << dtype << " " << formatBytes(double(size));
  os << "; " << tiled << " tiled (" << formatBytes(double(tiledBytes)) << ")\n";

  if (const fb::CacheSpec *cache = plan.cache()) {
    uint64_t kvPerToken = 0, statePerSequence = 0;
    if (cache->kv())
      for (const fb::KvCacheLayer *layer : *cache->kv())
        kvPerToken += uint64_t(layer->latent_dim() + layer->rope_dim() + layer->index_key_dim()) *
                      dtypeByteSize(layer->dtype());
    if (cache->recurrent())
      for (const fb::RecurrentStateLayer *layer : *cache->recurrent())
        statePerSequence +=
            4ull * (uint64_t(layer->num_heads()) * layer->head_k_dim() * layer->head_v_dim() +
                    uint64_t(layer->conv_channels()) * (layer->conv_kernel() - 1));
    os << "cache    KV " << (cache->kv() ? cache->kv()->size() : 0) << " layers, "
       << formatBytes(double(kvPerToken)) << " per token; recurrent "
       << (cache->recurrent() ? cache->recurrent()->size() : 0) << " layers, "
       << formatBytes(double(statePerSequence)) << " per sequence\n";
  }

  if (!plan.programs())
    return;
  for (const fb::Program *program : *plan.programs()) {
    size_t steps = 0, fused = 0;
    std::map<std::string, size_t> fusedKinds;
    if (program->steps())
      for (const fb::Step *step : *program->steps()) {
        ++steps;
        const fb::Dispatch *dispatch = step->op_as_Dispatch();
        const plan::KernelSignature *signature =
            dispatch ? plan::kernelSignature(dispatch->kernel()) : nullptr;
        if (signature && !signature->fuses.empty()) {
          ++fused;
          ++fusedKinds[std::string(signature->name)];
        }
      }
    os << "program  " << (program->name() ? program->name()->str() : "?") << ": "
       << program->max_tokens() << " tokens, " << steps << " steps (" << fused << " fused), "
       << program->num_streams() << " streams, " << program->num_events() << " events, arena "
       << formatBytes(double(program->arena_bytes())) << "\n";
    for (const auto &[kind, count] : fusedKinds)
      os << "           " << count << " x " << kind << "\n";
  }
}

} // namespace hybrid
