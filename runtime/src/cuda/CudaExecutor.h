// The `cuda` device: runs a program's dispatches on the GPU (kernels/cuda) on the plan's streams
// and events. Dispatches it has no GPU kernel for yet (AttnRes: issue 7) or whose shapes or
// weights its kernels do not take run on the cpu reference, on copies of exactly their input and
// output values; which ones do is decided once, at load, and reported (placementReport). The
// MLA / DSA layers it runs keep their KV rows in device pools that share the host PagedKvCache's
// page numbers (CudaAttention.cpp). Internal to the runtime; built when CUDA is found.
#pragma once

#include "cpu/CpuExecutor.h"
#include "hybrid/runtime/Model.h"
#include "hybrid/runtime/Sampling.h"
#include "hybrid/runtime/Status.h"
#include "hybrid/runtime/WeightArchive.h"
#include "runtime/schema/plan_generated.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace hybrid::cudadev {

// The fp32 values of plan weight `index`, converted from the archive on first use: the cuda device
// reads only its small weights (norms, biases, conv taps, block scales) and those of the steps it
// leaves to the cpu reference, so a large model's GEMM weights never take host memory in fp32.
using HostWeights = std::function<StatusOr<const std::vector<float> *>(int32_t index)>;

class CudaExecutor {
public:
  // Uploads the weights (GEMM weights as stored, small ones as fp32 from `hostWeights`) and makes
  // one device allocation for the programs' arenas, a mirror of `states`, and the scratch every
  // stream needs, and one for the KV pools of `kvCache`'s layers that run here (it then records
  // its page copies for this device to repeat). GEMM inputs go to the tensor cores split into two
  // bf16 halves (close to the fp32 oracle) unless options.bf16GemmInputs (Linear.h);
  // options.kdaPrefill picks the KDA prefill kernel. Fails with "no CUDA device" where there is no
  // GPU. Adds the time of its phases to the cuda fields of `timings` (the CUDA context is created
  // first, as a phase of its own).
  static StatusOr<std::unique_ptr<CudaExecutor>>
  create(const std::string &dir, const plan::fb::Plan &plan, const WeightArchive &archive,
         const HostWeights &hostWeights, const RecurrentStatePool &states, PagedKvCache &kvCache,
         const LoadOptions &options, LoadTimings &timings);
  ~CudaExecutor();
  CudaExecutor(const CudaExecutor &) = delete;
  CudaExecutor &operator=(const CudaExecutor &) = delete;

  // Runs `program` (prefill, decode or mtp) over `tokens` for the sequence in `host` (whose
  // arena, fp32 weights and caches serve the dispatches that run on the cpu reference); writes
  // logits [rows, vocab]. The mtp program reads the hidden rows setHiddenInput gave it. With
  // options.cudaGraphs the decode program's GPU runs are replayed as graphs (not while `hidden`
  // is asked for: it reads values between steps), and with options.prefillGraphs so are
  // single-sequence prefill calls of up to 16 rows that a graph can hold (prefillGraphSafe).
  // With `logitRows` (ascending) only those rows' logits come back, in that order (a prefill's
  // next-token choice, each segment's last row in a batched one: the other rows cost a copy of
  // rows x vocab floats to the host).
  // host.batch's segments (a batched prefill) each keep their own state slot, positions and
  // block-table row.
  Status run(const cpu::StepContext &host, std::span<const int64_t> tokens, float *logits,
             HiddenStates *hidden, std::span<const int64_t> logitRows = {});
  // A decode step (or a prefill: a verification pass) whose rows choose their tokens on the GPU
  // (kernels/cuda/Sampling.h, the reference's definition): `chosen` [rows] receives them and no
  // logits leave the device.
  Status runChoosing(const cpu::StepContext &host, std::span<const int64_t> tokens,
                     std::span<const TokenChoice> choices, int64_t *chosen);
  // Decode steps in a chain (Model::decodeSteps): beginChain makes room for steps x rows ids;
  // each runChoosingChained queues step `step` (its tokens the host's for step 0, the previous
  // step's choices on the device after) without waiting for it, so the host prepares the next
  // step while the GPU runs this one; endChain waits for the last and copies every step's ids
  // to `chosen` [steps, rows]. A failure (or a chain given up: endChain with null) leaves the
  // device synchronized.
  Status beginChain(int64_t steps, int64_t rows);
  Status runChoosingChained(const cpu::StepContext &host, std::span<const int64_t> tokens,
                            std::span<const TokenChoice> choices, int64_t step);
  Status endChain(int64_t steps, int64_t rows, int64_t *chosen);
  // A fresh sequence in `slot`: its recurrent and conv states are zeroed on the device.
  Status resetSlot(int32_t slot);
  // Copies the device's KDA states of `slot` (the layers whose kernels run on the GPU; bf16
  // states widened to fp32) into `pool`'s slot, or back from it (rounded to bf16 where kept so),
  // for what works on host snapshots: prefix caching, Sequence::recurrentState.
  Status downloadSlot(int32_t slot, RecurrentStatePool &pool);
  Status uploadSlot(int32_t slot, RecurrentStatePool &pool);
  // Speculative rollback without host round trips: snapshotSlots copies the device states of
  // `slots` (every GPU KDA layer's recurrent and conv state) to device snapshot i = their index,
  // ordered before the next run; restoreSlot copies snapshot `index` back into `slot`. One
  // device-to-device copy per sequence (44 MB at Kimi-Linear-48B shapes, tens of microseconds)
  // where downloadSlot / uploadSlot cross PCIe through pageable host memory.
  Status snapshotSlots(std::span<const int32_t> slots);
  Status restoreSlot(int32_t slot, size_t index);
  // Whether every recurrent layer's state lives on the device (no KDA step on the cpu reference):
  // then the host pool's copies are unused by steps and need no snapshot.
  bool holdsEveryRecurrentState() const;
  // Speculative rollback: in a step run with host.kdaLog set (a prefill), the GPU KDA layers keep
  // copies of their inputs; this reruns their prefill kernels over the first `tokens` of them on
  // `slot`'s states (which the caller has put back to before that step). Layers on the cpu
  // reference log into host.kdaLog as on the cpu device. A batched verification replays each
  // sequence's segment: its first `tokens` rows from row `firstRow` of the step.
  Status replayKdaLog(int32_t slot, int64_t tokens, int64_t firstRow = 0);
  // Multi-token prediction (the `mtp` program, docs/mtp.md) without host round trips: hidden
  // rows are kept in device records, growable [rows, hidden] buffers named by an id the caller
  // picks (the Model: two per KV sequence, the main model's final hidden states and the MTP's
  // chained one). recordFinalHidden copies rows [srcRow, + rows) of `program`'s final hidden
  // state (its last layer_outputs value, as its last run left it) to rows [destRow, + rows) of a
  // record; setHiddenInput fills the program's hidden_input slot for its next run from rows
  // [first, + rows) of a record, or from host memory; downloadRecord copies record rows out.
  Status recordFinalHidden(const plan::fb::Program &program, int64_t srcRow, int64_t rows,
                           int32_t record, int64_t destRow);
  Status setHiddenInput(const plan::fb::Program &program, int32_t record, int64_t first,
                        int64_t rows);
  Status setHiddenInput(const plan::fb::Program &program, const float *hostRows, int64_t rows);
  Status downloadRecord(int32_t record, int64_t first, int64_t rows, float *out);
  // `program`'s final hidden state of its last run, rows [0, rows), to the host.
  Status downloadFinalHidden(const plan::fb::Program &program, int64_t rows, float *out);
  // Whether KV layer `kvSlot` keeps its rows in the device pools (then the host PagedKvCache only
  // counts them), and zero rows for positions [begin, + count) of a sequence there, counted by
  // the host cache (the MTP layer's rows for positions it never ran: a restored prefix).
  bool kvLayerOnDevice(int32_t kvSlot) const;
  Status appendZeroKvRows(PagedKvCache &kvCache, int32_t kvSlot, int32_t kvSequence,
                          int64_t count);
  // The graphs captured and replayed so far (LoadOptions::cudaGraphs, prefillGraphs).
  CudaGraphCounts graphCounts() const;
  // Which kernels run where, one line per program.
  const std::string &placementReport() const { return report_; }
  // LoadOptions::batchInvariant held for every layer on the GPU (the report says which not).
  bool batchInvariant() const;
  // The tuned kernel configurations looked up so far (LoadOptions::tuningCache), one line per
  // kernel and shape bucket: the configuration, or why the defaults run.
  std::string tuningReport() const;
  // The weights of the steps that run on the cpu reference: what the host must hold in fp32.
  const std::vector<int32_t> &cpuStepWeights() const { return cpuStepWeights_; }
  // A synthetic archive's weights generated on the device at create (deviceBytes, deviceSeconds).
  const WeightGeneration &weightGeneration() const { return generation_; }

  struct Impl;

private:
  explicit CudaExecutor(std::unique_ptr<Impl> impl);
  // A step of `host`'s program up to its KV bookkeeping; the logits stay in the arena.
  Status runProgram(const cpu::StepContext &host, std::span<const int64_t> tokens,
                    HiddenStates *hidden);
  // runProgram's launches alone: the step's work queued, every stream joined into stream 0 at
  // the end of each GPU run; not yet synchronized, the KV bookkeeping not yet advanced.
  // With deviceTokens, the ids are copied from there (a chained step's); with markUploaded, an
  // event is recorded once the step's staged inputs have been copied, before its kernels.
  Status enqueueProgram(const cpu::StepContext &host, std::span<const int64_t> tokens,
                        HiddenStates *hidden, const int64_t *deviceTokens = nullptr,
                        bool markUploaded = false);
  std::unique_ptr<Impl> impl_;
  std::string report_;
  std::vector<int32_t> cpuStepWeights_;
  WeightGeneration generation_;
};

} // namespace hybrid::cudadev
