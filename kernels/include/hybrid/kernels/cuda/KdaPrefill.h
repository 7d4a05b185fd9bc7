// KDA prefill on CUDA (sm_90a), token recurrence over a varlen batch: for each sequence, its tokens
// in order through the short conv (with its state), SiLU, L2 norms, gate, beta, the delta rule on
// the fp32 state (read once before the first token, written once after the last) and the gated
// RMSNorm. The exact per-token math of the decode step (KdaDecode.h), so prefill and decode compose.
// Two implementations of the same contract: the recurrent one (one block per (head, sequence) walks
// the tokens, fp32 throughout) and the chunked one (64-token chunks in the WY/UT form with bf16
// tensor-core operands and an fp32 state, docs/cuda-kernels.md), which is the fast path at
// headDim 128. CUDA-free header.
#pragma once

#include "hybrid/kernels/cuda/KdaDecode.h"

#include <cstdint>

namespace hybrid::kernels::cuda {

// Which implementation runs (launchKdaPrefill); Auto takes the chunked one where it is compiled
// (headDim 128) for calls of more than kKdaRecurrentPrefillMaxTokens tokens, and the recurrent one
// elsewhere. Tests and benchmarks force one.
enum class KdaPrefillPath : int32_t { Auto, Recurrent, Chunked };
// Short calls (a speculative verification's 1 + draft rows, a replay, a prompt's last few
// tokens) take the recurrent kernel under Auto: its fp32 recurrence is the decode step's, so a
// verified row chooses what a decode step would (the chunked kernel's bf16 operands flipped the
// greedy token of the first pass at Kimi-Linear-48B shapes on synthetic weights), and a pass of
// a few rows does not fill a chunk anyway.
inline constexpr int32_t kKdaRecurrentPrefillMaxTokens = 16;

// A varlen prefill: headDim 64 or 128, convKernel 1..kKdaMaxConvKernel (KdaDecode.h); the rows
// of KdaLayerCall are the sequences' tokens, packed. An empty sequence keeps its states.
struct KdaPrefillParams : KdaLayerCall {
  int32_t sequences = 0;
  const int32_t *cuSeqlens = nullptr; // device [sequences + 1], non-decreasing, cuSeqlens[0] = 0
  // The packed token count cuSeqlens[sequences] as the host knows it (Auto's choice; the
  // chunked path's grid and workspace), and for the chunked path device scratch of
  // kdaChunkedPrefillWorkspaceBytes() bytes, 256-byte aligned, not shared with a launch that may
  // run concurrently.
  int32_t tokens = 0;
  void *workspace = nullptr;
  KdaPrefillPath path = KdaPrefillPath::Auto;
};

// Tokens per chunk of the chunked path.
constexpr int32_t kKdaPrefillChunk = 64;
// Workspace of the chunked path: per chunk and head the WY/UT factors of the chunk in bf16 (about
// 72 KiB), for at most tokens / 64 + sequences chunks.
size_t kdaChunkedPrefillWorkspaceBytes(const KdaPrefillParams &params);
// The path `params.path` resolves to, and the workspace it needs (0 for the recurrent path).
KdaPrefillPath resolveKdaPrefillPath(const KdaPrefillParams &params);
size_t kdaPrefillWorkspaceBytes(const KdaPrefillParams &params);

// Launches on `stream`; 0 or the CUDA error code. Unsupported headDim or convKernel, or no
// sequences, returns cudaErrorInvalidValue (1).
int launchKdaRecurrentPrefill(const KdaPrefillParams &params, void *stream);
// The chunked path: headDim 128 only (others return cudaErrorInvalidValue), needs `tokens` and
// the workspace. Three kernels: chunk factors in parallel, the state chain per (sequence, head,
// 32 value columns), then the gated RMSNorm.
int launchKdaChunkedPrefill(const KdaPrefillParams &params, void *stream);
// Either of the two, as resolveKdaPrefillPath says.
int launchKdaPrefill(const KdaPrefillParams &params, void *stream);

} // namespace hybrid::kernels::cuda
