#include "hybrid/kernels/ref/Kda.h"

#include "hybrid/kernels/ref/Math.h"
#include "hybrid/kernels/ref/Parallel.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <vector>

namespace hybrid::kernels::ref {

void shortConvSilu(std::span<const float> in, std::span<const float> weight,
                   std::span<float> convState, std::span<float> out, int64_t numTokens,
                   int64_t channels, int64_t kernelSize) {
  const int64_t history = kernelSize - 1;
  assert(static_cast<int64_t>(convState.size()) == history * channels);
  // Row r of the virtual input (convState ++ in): r < 0 reads the carried history.
  auto inputAt = [&](int64_t r, int64_t c) {
    return r < 0 ? convState[(r + history) * channels + c] : in[r * channels + c];
  };
  for (int64_t t = 0; t < numTokens; ++t) {
    for (int64_t c = 0; c < channels; ++c) {
      float acc = 0.0f;
      for (int64_t j = 0; j < kernelSize; ++j)
        acc += weight[c * kernelSize + j] * inputAt(t - history + j, c);
      out[t * channels + c] = silu(acc);
    }
  }
  // The new history is the last W−1 rows of the virtual input; it may still overlap the old one.
  std::vector<float> newState(convState.size());
  for (int64_t j = 0; j < history; ++j)
    for (int64_t c = 0; c < channels; ++c)
      newState[j * channels + c] = inputAt(numTokens - history + j, c);
  std::copy(newState.begin(), newState.end(), convState.begin());
}

void kdaGate(std::span<const float> f, std::span<const float> aLog, std::span<const float> dtBias,
             std::span<float> g, int64_t numTokens, int64_t numHeads, int64_t keyDim,
             std::optional<float> lowerBound) {
  for (int64_t t = 0; t < numTokens; ++t) {
    for (int64_t h = 0; h < numHeads; ++h) {
      const float decayScale = std::exp(aLog[h]);
      for (int64_t c = 0; c < keyDim; ++c) {
        const int64_t channel = h * keyDim + c;
        const int64_t index = t * numHeads * keyDim + channel;
        const float preActivation = f[index] + dtBias[channel];
        g[index] = lowerBound ? *lowerBound * sigmoid(decayScale * preActivation)
                              : -decayScale * softplus(preActivation);
      }
    }
  }
}

void kdaBeta(std::span<float> betaLogits) {
  for (float &value : betaLogits)
    value = sigmoid(value);
}

namespace {

// Strided views of one head's rows inside the [T, H, D] tensors.
struct HeadView {
  const KdaParams &p;
  int64_t head;
  const float *q(int64_t t) const { return p.q + (t * p.numHeads + head) * p.keyDim; }
  const float *k(int64_t t) const { return p.k + (t * p.numHeads + head) * p.keyDim; }
  const float *g(int64_t t) const { return p.g + (t * p.numHeads + head) * p.keyDim; }
  const float *v(int64_t t) const { return p.v + (t * p.numHeads + head) * p.valueDim; }
  float beta(int64_t t) const { return p.beta[t * p.numHeads + head]; }
  float *out(int64_t t) const { return p.out + (t * p.numHeads + head) * p.valueDim; }
  float *state() const { return p.state + head * p.keyDim * p.valueDim; }
};

float effectiveScale(const KdaParams &p) {
  return p.scale != 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(p.keyDim));
}

void recurrentHead(const HeadView &view) {
  const KdaParams &p = view.p;
  const int64_t K = p.keyDim, V = p.valueDim;
  const float scale = effectiveScale(p);
  float *S = view.state(); // S[i * V + j]: key channel i, value channel j
  std::vector<float> prediction(V), delta(V);
  for (int64_t t = 0; t < p.numTokens; ++t) {
    const float *k = view.k(t);
    const float *g = view.g(t);
    // S ← Diag(exp(g_t)) S
    for (int64_t i = 0; i < K; ++i) {
      const float decay = std::exp(g[i]);
      for (int64_t j = 0; j < V; ++j)
        S[i * V + j] *= decay;
    }
    // u = v_t − Sᵀ k_t;  S ← S + β_t k_t uᵀ
    std::fill(prediction.begin(), prediction.end(), 0.0f);
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j)
        prediction[j] += S[i * V + j] * k[i];
    const float *v = view.v(t);
    const float beta = view.beta(t);
    for (int64_t j = 0; j < V; ++j)
      delta[j] = (v[j] - prediction[j]) * beta;
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j)
        S[i * V + j] += k[i] * delta[j];
    // o_t = Sᵀ (scale · q_t)
    const float *q = view.q(t);
    float *o = view.out(t);
    std::fill(o, o + V, 0.0f);
    for (int64_t i = 0; i < K; ++i) {
      const float qi = q[i] * scale;
      for (int64_t j = 0; j < V; ++j)
        o[j] += S[i * V + j] * qi;
    }
  }
}

// One chunk of L ≤ C positions starting at token t0, MODEL_SPEC §2.3 (r, i index the chunk).
void chunkStep(const HeadView &view, int64_t t0, int64_t L) {
  const KdaParams &p = view.p;
  const int64_t K = p.keyDim, V = p.valueDim;
  const float scale = effectiveScale(p);
  float *S = view.state();

  // G_r = Σ_{j≤r} g_j (cumulative log-decay inside the chunk), per key channel.
  std::vector<float> G(L * K);
  for (int64_t r = 0; r < L; ++r)
    for (int64_t c = 0; c < K; ++c)
      G[r * K + c] = view.g(t0 + r)[c] + (r > 0 ? G[(r - 1) * K + c] : 0.0f);

  // Decay-weighted dot products Σ_c a_r[c] · exp(G_r[c] − G_i[c]) · k_i[c] for i ≤ r, with a = β_r
  // k_r (Akk, strictly lower) and a = scale · q_r (Aqk, diagonal included). Only differences of G
  // are exponentiated: exp(−G) alone overflows for strong decays.
  std::vector<float> Akk(L * L, 0.0f), Aqk(L * L, 0.0f);
  std::vector<float> decayedKey(K);
  for (int64_t r = 0; r < L; ++r) {
    const float *qr = view.q(t0 + r);
    const float *kr = view.k(t0 + r);
    for (int64_t i = 0; i <= r; ++i) {
      const float *ki = view.k(t0 + i);
      for (int64_t c = 0; c < K; ++c)
        decayedKey[c] = std::exp(G[r * K + c] - G[i * K + c]) * ki[c];
      Aqk[r * L + i] = scale * dot(qr, decayedKey.data(), K);
      if (i < r)
        Akk[r * L + i] = view.beta(t0 + r) * dot(kr, decayedKey.data(), K);
    }
  }

  // UT transform by forward substitution, (I + Akk) X = Diag(β) Y:
  //   W = M (exp(G) ⊙ K),  U = M V.
  std::vector<float> W(L * K), U(L * V);
  for (int64_t r = 0; r < L; ++r) {
    const float beta = view.beta(t0 + r);
    const float *kr = view.k(t0 + r);
    const float *vr = view.v(t0 + r);
    for (int64_t c = 0; c < K; ++c)
      W[r * K + c] = beta * std::exp(G[r * K + c]) * kr[c];
    for (int64_t j = 0; j < V; ++j)
      U[r * V + j] = beta * vr[j];
    for (int64_t i = 0; i < r; ++i) {
      const float a = Akk[r * L + i];
      for (int64_t c = 0; c < K; ++c)
        W[r * K + c] -= a * W[i * K + c];
      for (int64_t j = 0; j < V; ++j)
        U[r * V + j] -= a * U[i * V + j];
    }
  }

  // V_new = U − W S: the part of each value the state entering the chunk does not predict.
  std::vector<float> Vnew(U);
  for (int64_t r = 0; r < L; ++r)
    for (int64_t c = 0; c < K; ++c) {
      const float w = W[r * K + c];
      for (int64_t j = 0; j < V; ++j)
        Vnew[r * V + j] -= w * S[c * V + j];
    }

  // O = (exp(G) ⊙ Q) S + Aqk V_new
  for (int64_t r = 0; r < L; ++r) {
    const float *qr = view.q(t0 + r);
    float *o = view.out(t0 + r);
    std::fill(o, o + V, 0.0f);
    for (int64_t c = 0; c < K; ++c) {
      const float decayedQ = qr[c] * scale * std::exp(G[r * K + c]);
      for (int64_t j = 0; j < V; ++j)
        o[j] += decayedQ * S[c * V + j];
    }
    for (int64_t i = 0; i <= r; ++i) {
      const float a = Aqk[r * L + i];
      for (int64_t j = 0; j < V; ++j)
        o[j] += a * Vnew[i * V + j];
    }
  }

  // S_next = Diag(exp(G_last)) S + (exp(G_last − G) ⊙ K)ᵀ V_new
  const float *Glast = &G[(L - 1) * K];
  for (int64_t c = 0; c < K; ++c) {
    const float stateDecay = std::exp(Glast[c]);
    for (int64_t j = 0; j < V; ++j)
      S[c * V + j] *= stateDecay;
    for (int64_t i = 0; i < L; ++i) {
      const float decayedK = std::exp(Glast[c] - G[i * K + c]) * view.k(t0 + i)[c];
      for (int64_t j = 0; j < V; ++j)
        S[c * V + j] += decayedK * Vnew[i * V + j];
    }
  }
}

} // namespace

void kdaRecurrent(const KdaParams &params) {
  parallelFor(params.numHeads, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h)
      recurrentHead(HeadView{params, h});
  });
}

void kdaChunked(const KdaParams &params, int64_t chunkSize) {
  assert(chunkSize > 0);
  parallelFor(params.numHeads, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h)
      for (int64_t t0 = 0; t0 < params.numTokens; t0 += chunkSize)
        chunkStep(HeadView{params, h}, t0, std::min(chunkSize, params.numTokens - t0));
  });
}

void kdaSegmentSummary(const KdaParams &segment, float *transition, float *offset) {
  const int64_t T = segment.numTokens, H = segment.numHeads, K = segment.keyDim,
                V = segment.valueDim;
  std::vector<float> ignoredOut(std::max<int64_t>(1, T * H * std::max(K, V)));
  KdaParams p = segment;
  p.out = ignoredOut.data();
  std::fill(offset, offset + H * K * V, 0.0f);
  p.state = offset;
  kdaRecurrent(p); // B: the final state from a zero state
  const std::vector<float> zeros(std::max<int64_t>(1, T * H * K), 0.0f);
  std::fill(transition, transition + H * K * K, 0.0f);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < K; ++i)
      transition[(h * K + i) * K + i] = 1.0f;
  p.v = zeros.data();
  p.valueDim = K;
  p.state = transition;
  kdaRecurrent(p); // M: the recurrence with v = 0 from the identity
}

void kdaApplySummary(int64_t numHeads, int64_t keyDim, int64_t valueDim, const float *transition,
                     const float *offset, const float *state, float *next) {
  const int64_t K = keyDim, V = valueDim;
  std::copy(offset, offset + numHeads * K * V, next);
  for (int64_t h = 0; h < numHeads; ++h) {
    const float *m = transition + h * K * K, *in = state + h * K * V;
    float *out = next + h * K * V;
    for (int64_t i = 0; i < K; ++i)
      for (int64_t x = 0; x < K; ++x)
        for (int64_t j = 0; j < V; ++j)
          out[i * V + j] += m[i * K + x] * in[x * V + j];
  }
}

void kdaSegmentScan(const KdaParams &params, int64_t segments) {
  const int64_t T = params.numTokens, H = params.numHeads, K = params.keyDim, V = params.valueDim;
  segments = std::clamp<int64_t>(segments, 1, std::max<int64_t>(1, T));
  auto segmentBegin = [&](int64_t s) { return T * s / segments; };
  // A view of tokens [begin, end) with its own state buffer and output.
  auto segmentParams = [&](int64_t begin, int64_t end, float *state, float *out) {
    KdaParams p = params;
    p.numTokens = end - begin;
    p.q += begin * H * K;
    p.k += begin * H * K;
    p.g += begin * H * K;
    p.beta += begin * H;
    p.v += begin * H * V;
    p.state = state;
    p.out = out;
    return p;
  };

  // 1. Per segment, in parallel: its summary (M, B).
  std::vector<std::vector<float>> B(segments, std::vector<float>(H * K * V, 0.0f));
  std::vector<std::vector<float>> M(segments, std::vector<float>(H * K * K, 0.0f));
  parallelFor(segments, [&](int64_t first, int64_t last) {
    for (int64_t s = first; s < last; ++s) // inside a parallel body the kernels run inline
      kdaSegmentSummary(segmentParams(segmentBegin(s), segmentBegin(s + 1), nullptr, nullptr),
                        M[s].data(), B[s].data());
  });

  // 2. Sequential combine: each segment's initial state, per head S_{s+1} = M_s S_s + B_s.
  std::vector<std::vector<float>> initial(segments, std::vector<float>(H * K * V));
  std::copy(params.state, params.state + H * K * V, initial[0].begin());
  for (int64_t s = 0; s + 1 < segments; ++s)
    kdaApplySummary(H, K, V, M[s].data(), B[s].data(), initial[s].data(), initial[s + 1].data());

  // 3. Each segment again from its true initial state, for its outputs; the last one's final
  // state is the sequence's.
  parallelFor(segments, [&](int64_t first, int64_t last) {
    for (int64_t s = first; s < last; ++s) {
      const int64_t begin = segmentBegin(s), end = segmentBegin(s + 1);
      kdaRecurrent(segmentParams(begin, end, initial[s].data(), params.out + begin * H * V));
    }
  });
  std::copy(initial[segments - 1].begin(), initial[segments - 1].end(), params.state);
}

} // namespace hybrid::kernels::ref
