// Per-request token choice (greedy, temperature, top-k, top-p, seed) in the runtime's terms. The
// definition is the reference one (kernels/ref/Sampling.h), the contract the cuda sampler follows
// too; this header names it in namespace hybrid so runtime users need not reach into kernels.
#pragma once

#include "hybrid/kernels/ref/Sampling.h"

#include <cstdint>
#include <span>

namespace hybrid {

using SamplingParams = kernels::ref::SamplingParams; // default: greedy
using kernels::ref::samplingIsGreedy;
using kernels::ref::samplingParamsProblem;
using kernels::ref::samplingUniform;

// How one row's token is chosen: the request's parameters and this step's uniform number.
struct TokenChoice {
  SamplingParams params;
  float uniform = 0.0f;
};

// The choice for a request's n-th generated token (n = 0 for the first): the uniform is
// samplingUniform(seed, n), a function of the request alone, so a seeded request gives the same
// tokens whatever batch (or preemption and recompute) it runs through.
inline TokenChoice tokenChoice(const SamplingParams &params, int64_t generated) {
  return {params, samplingUniform(params.seed, static_cast<uint64_t>(generated))};
}

// The token one row of logits [vocab] chooses, on the host: a prefill's last row (decode steps
// choose through Model::decodeBatchChoose). Greedy parameters give the argmax, lowest id on ties.
inline int64_t chooseToken(std::span<const float> logits, const TokenChoice &choice) {
  return kernels::ref::sampleToken(logits, choice.params, choice.uniform);
}

} // namespace hybrid
