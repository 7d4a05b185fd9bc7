#include "hybrid/kernels/ref/Mla.h"

#include "hybrid/kernels/ref/Linear.h"
#include "hybrid/kernels/ref/Math.h"
#include "hybrid/kernels/ref/Parallel.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <numbers>

namespace hybrid::kernels::ref {

std::vector<float> ropeInverseFrequencies(int64_t rotaryDim, double theta) {
  // fp32 like the references: θ_i = 1 / theta^(2i / rotaryDim).
  std::vector<float> inverseFrequencies(rotaryDim / 2);
  for (int64_t i = 0; i < rotaryDim / 2; ++i)
    inverseFrequencies[i] =
        1.0f / std::pow(static_cast<float>(theta),
                        static_cast<float>(2 * i) / static_cast<float>(rotaryDim));
  return inverseFrequencies;
}

YarnRamp yarnCorrectionRange(int64_t rotaryDim, double theta, const YarnConfig &yarn) {
  // The frequency index whose wavelength fits `rotations` times into the original context.
  auto correctionDim = [&](double rotations) {
    return static_cast<double>(rotaryDim) *
           std::log(static_cast<double>(yarn.originalMaxPositions) /
                    (rotations * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(theta));
  };
  YarnRamp ramp;
  ramp.low = std::max<int64_t>(0, static_cast<int64_t>(std::floor(correctionDim(yarn.betaFast))));
  ramp.high = std::min<int64_t>(rotaryDim - 1,
                                static_cast<int64_t>(std::ceil(correctionDim(yarn.betaSlow))));
  return ramp;
}

std::vector<float> yarnInverseFrequencies(int64_t rotaryDim, double theta, const YarnConfig &yarn) {
  const YarnRamp range = yarnCorrectionRange(rotaryDim, theta, yarn);
  const double low = static_cast<double>(range.low);
  double high = static_cast<double>(range.high);
  if (high == low)
    high += 0.001; // as the references: avoid a zero-width ramp
  std::vector<float> inverseFrequencies = ropeInverseFrequencies(rotaryDim, theta);
  for (size_t i = 0; i < inverseFrequencies.size(); ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double original = inverseFrequencies[i];
    // ramp 0 (high frequencies) keeps θ_i; ramp 1 (low frequencies) interpolates θ_i / factor.
    inverseFrequencies[i] =
        static_cast<float>(original / yarn.factor * ramp + original * (1.0 - ramp));
  }
  return inverseFrequencies;
}

double yarnMscale(double factor, double mscale) {
  return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

void applyRope(std::span<float> x, int64_t position, std::span<const float> inverseFrequencies,
               RopeLayout layout) {
  const int64_t pairs = static_cast<int64_t>(inverseFrequencies.size());
  assert(layout == RopeLayout::None || static_cast<int64_t>(x.size()) == 2 * pairs);
  if (layout == RopeLayout::None)
    return;
  for (int64_t i = 0; i < pairs; ++i) {
    const float angle = static_cast<float>(position) * inverseFrequencies[i];
    const float cosine = std::cos(angle), sine = std::sin(angle);
    const int64_t first = layout == RopeLayout::Interleaved ? 2 * i : i;
    const int64_t second = layout == RopeLayout::Interleaved ? 2 * i + 1 : i + pairs;
    const float a = x[first], b = x[second];
    x[first] = a * cosine - b * sine;
    x[second] = b * cosine + a * sine;
  }
}

namespace {

// The positions query t attends to: the listed ones of its sparse row (−1 and out-of-range
// entries skipped), or every causal position.
void attendedPositions(int64_t t, const int32_t *sparseIndices, int64_t topK, int64_t numKeys,
                       const int64_t *queryPositions, int64_t numQueries,
                       std::vector<int64_t> &keys) {
  keys.clear();
  if (sparseIndices) {
    for (int64_t j = 0; j < topK; ++j) {
      const int32_t index = sparseIndices[t * topK + j];
      if (index >= 0 && index < numKeys)
        keys.push_back(index);
    }
    return;
  }
  const int64_t position = queryPositions ? queryPositions[t] : numKeys - numQueries + t;
  for (int64_t s = 0; s <= std::min(position, numKeys - 1); ++s)
    keys.push_back(s);
}

// logits -> softmax weights, in place (max-subtracted exponentials over their sum).
void softmaxInPlace(std::vector<float> &logits) {
  const float maxLogit = *std::max_element(logits.begin(), logits.end());
  float sum = 0.0f;
  for (float &logit : logits) {
    logit = std::exp(logit - maxLogit);
    sum += logit;
  }
  for (float &logit : logits)
    logit /= sum;
}

} // namespace

void mlaAttention(const MlaAttentionParams &p) {
  const int64_t qkDim = p.nopeDim + p.ropeDim;
  const int64_t expandedDim = p.nopeDim + p.valueDim; // per head, per position: [k_nope | v]
  // Expand every cached latent once: kv[s, h, :] = kv_b_proj(c_s) viewed [H, nopeDim + valueDim].
  std::vector<float> expanded(p.numKeys * p.numHeads * expandedDim);
  linear({p.latents, static_cast<size_t>(p.numKeys * p.latentDim)},
         {p.kvBProj, static_cast<size_t>(p.numHeads * expandedDim * p.latentDim)}, expanded,
         p.numKeys, p.latentDim, p.numHeads * expandedDim);

  parallelFor(p.numQueries * p.numHeads, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> keys;
    std::vector<float> logits;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / p.numHeads, h = item % p.numHeads;
      attendedPositions(t, p.sparseIndices, p.topK, p.numKeys, p.queryPositions, p.numQueries,
                        keys);
      float *out = p.out + (t * p.numHeads + h) * p.valueDim;
      std::fill(out, out + p.valueDim, 0.0f);
      if (keys.empty())
        continue;

      const float *query = p.queries + (t * p.numHeads + h) * qkDim;
      logits.resize(keys.size());
      for (size_t j = 0; j < keys.size(); ++j) {
        const float *kNope = expanded.data() + (keys[j] * p.numHeads + h) * expandedDim;
        const float *kRope = p.ropeKeys + keys[j] * p.ropeDim;
        const float score = dot(query, kNope, p.nopeDim) + dot(query + p.nopeDim, kRope, p.ropeDim);
        logits[j] = score * p.softmaxScale;
      }
      softmaxInPlace(logits);
      for (size_t j = 0; j < keys.size(); ++j) {
        const float weight = logits[j];
        const float *value = expanded.data() + (keys[j] * p.numHeads + h) * expandedDim + p.nopeDim;
        for (int64_t d = 0; d < p.valueDim; ++d)
          out[d] += weight * value[d];
      }
    }
  });
}

void absorbMlaQueries(const MlaAttentionParams &p, float *absorbed) {
  const int64_t qkDim = p.nopeDim + p.ropeDim, wide = p.latentDim + p.ropeDim;
  const int64_t headRows = p.nopeDim + p.valueDim; // kv_b_proj rows per head: [W_UK; W_UV]
  parallelFor(p.numQueries * p.numHeads, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % p.numHeads;
      const float *query = p.queries + item * qkDim;
      float *target = absorbed + item * wide;
      const float *uk = p.kvBProj + h * headRows * p.latentDim; // [nopeDim, latentDim]
      for (int64_t r = 0; r < p.latentDim; ++r) {
        float sum = 0.0f;
        for (int64_t n = 0; n < p.nopeDim; ++n)
          sum += query[n] * uk[n * p.latentDim + r];
        target[r] = sum;
      }
      std::copy(query + p.nopeDim, query + qkDim, target + p.latentDim);
    }
  });
}

void latentAttention(const LatentAttentionParams &p) {
  const int64_t wide = p.latentDim + p.ropeDim;
  parallelFor(p.numQueries * p.numHeads, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> keys;
    std::vector<float> logits;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / p.numHeads;
      attendedPositions(t, p.sparseIndices, p.topK, p.numKeys, p.queryPositions, p.numQueries,
                        keys);
      float *out = p.out + item * p.latentDim;
      std::fill(out, out + p.latentDim, 0.0f);
      if (keys.empty())
        continue;
      const float *query = p.queries + item * wide;
      logits.resize(keys.size());
      for (size_t j = 0; j < keys.size(); ++j) {
        const float score = dot(query, p.latents + keys[j] * p.latentDim, p.latentDim) +
                            dot(query + p.latentDim, p.ropeKeys + keys[j] * p.ropeDim, p.ropeDim);
        logits[j] = score * p.softmaxScale;
      }
      softmaxInPlace(logits);
      for (size_t j = 0; j < keys.size(); ++j) {
        const float weight = logits[j];
        const float *latent = p.latents + keys[j] * p.latentDim;
        for (int64_t d = 0; d < p.latentDim; ++d)
          out[d] += weight * latent[d];
      }
    }
  });
}

void expandLatentOutputs(const MlaAttentionParams &p, const float *latentOut, float *out) {
  const int64_t headRows = p.nopeDim + p.valueDim;
  parallelFor(p.numQueries * p.numHeads, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % p.numHeads;
      const float *uv = p.kvBProj + (h * headRows + p.nopeDim) * p.latentDim; // [valueDim, latent]
      for (int64_t v = 0; v < p.valueDim; ++v)
        out[item * p.valueDim + v] = dot(uv + v * p.latentDim, latentOut + item * p.latentDim,
                                         p.latentDim);
    }
  });
}

} // namespace hybrid::kernels::ref
