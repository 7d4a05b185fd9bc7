// Token choice from a row of logits: greedy, temperature, top-k and top-p (nucleus) sampling.
// The definition below is the contract the cuda sampler follows too, with its sums in fp64 so
// that the two choose the same token from the same logits and uniform number (only a running sum
// within about 1e-16 of a boundary could differ).
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace hybrid::kernels::ref {

struct SamplingParams {
  float temperature = 0.0f; // <= 0: greedy
  int32_t topK = 0;         // > 0: only the topK largest logits (all tied with the topK-th too)
  float topP = 1.0f;        // < 1: only the most probable tokens whose mass reaches topP
  uint64_t seed = 0;        // with the step counter, the uniform number (samplingUniform)
};

// An empty string when the parameters are usable, else why not (naming the field).
std::string samplingParamsProblem(const SamplingParams &params);

// Whether `params` choose by argmax (temperature <= 0 or topK == 1).
bool samplingIsGreedy(const SamplingParams &params);

// A uniform number in [0, 1) from a seed and a counter (the number of tokens the request has
// generated): splitmix64 of the pair, its top 24 bits. The same on every device and run.
float samplingUniform(uint64_t seed, uint64_t counter);

// The token `logits` choose (NaN logits are never chosen):
//   greedy: the largest logit, the lowest id among ties;
//   otherwise, with s_i = logits_i / temperature (fp32) and m = max s:
//   - topK in (0, vocab): candidates are the ids with s_i >= the topK-th largest s (counted with
//     multiplicity), else every id;
//   - w_i = expf(s_i - m) for candidates, Z = the sum of the candidates' w (fp64);
//   - topP < 1: tau = the largest w value with sum over {w_j >= tau} of w_j >= topP * Z (fp64);
//     candidates keep only w_i >= tau;
//   - target = uniform * (sum of the candidates' w, fp64); the token is the first candidate in id
//     order whose running sum (fp64, id order) exceeds target, or the last candidate if none does.
//   A largest logit of +infinity chooses the first such id.
int64_t sampleToken(std::span<const float> logits, const SamplingParams &params, float uniform);

} // namespace hybrid::kernels::ref
