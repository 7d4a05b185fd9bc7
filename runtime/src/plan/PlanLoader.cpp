// Plan loading: size and identifier checks, the FlatBuffers verifier, then semantic checks that
// make every index in the plan safe to use. Errors are one line: "<file>: <field>: <problem>".
#include "hybrid/runtime/Plan.h"
#include "hybrid/runtime/StatusHelpers.h"
#include "hybrid/runtime/UniqueFd.h"
#include "runtime/schema/kernel_signatures.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fcntl.h>
#include <flatbuffers/flatbuffers.h>
#include <set>
#include <sys/stat.h>
#include <system_error>
#include <unistd.h>

namespace hybrid {
namespace fb = plan::fb;
namespace {

// Root offset (4 bytes) + file identifier (4 bytes): the smallest buffer worth verifying.
constexpr size_t kMinPlanBytes = 8;
// The verifier's limits guard against malicious nesting and sharing; real plans have one table per
// weight, value and step, so allow far more tables than the FlatBuffers default of one million.
constexpr flatbuffers::uoffset_t kMaxVerifierDepth = 64;
constexpr flatbuffers::uoffset_t kMaxVerifierTables = 1u << 26;

std::string indexed(std::string_view base, size_t index) {
  std::string out(base);
  out += "[";
  out += std::to_string(index);
  out += "]";
  return out;
}

std::string kernelName(fb::KernelId kernel) {
  const char *name = fb::EnumNameKernelId(kernel);
  if (*name)
    return name;
  return "KernelId(" + std::to_string(static_cast<int>(kernel)) + ")";
}

std::string paramsName(fb::KernelParams params) {
  const char *name = fb::EnumNameKernelParams(params);
  if (*name)
    return name;
  return "KernelParams(" + std::to_string(static_cast<int>(params)) + ")";
}

// The role of weights[role] for error messages; MoE roles past the fixed ones are per expert.
std::string weightRoleName(const plan::KernelSignature &signature, size_t role) {
  if (role < static_cast<size_t>(signature.fixedWeights) && role < signature.weightRoles.size())
    return std::string(signature.weightRoles[role]);
  size_t expertRole = role - static_cast<size_t>(signature.fixedWeights);
  static constexpr const char *kExpertRoles[] = {"gate_proj", "up_proj", "down_proj"};
  return "expert " + std::to_string(expertRole / 3) + " " + kExpertRoles[expertRole % 3];
}

// Names from a verified buffer are NUL-terminated but may hold any byte.
std::string printable(const flatbuffers::String *text) {
  return text ? escapeBytes(text->string_view(), NonAscii::Escape) : "";
}

template <typename T> size_t lengthOf(const flatbuffers::Vector<T> *vector) {
  return vector ? vector->size() : 0;
}

bool isValidDType(fb::DType dtype) { return dtypeByteSize(dtype) != 0; }

std::string formatShape(const flatbuffers::Vector<int64_t> *shape) {
  std::string out = "[";
  for (size_t i = 0; i < lengthOf(shape); ++i) {
    if (i)
      out += ", ";
    out += std::to_string(shape->Get(static_cast<flatbuffers::uoffset_t>(i)));
  }
  out += "]";
  return out;
}

Status outOfRange(const std::string &field, int64_t index, size_t count, std::string_view what) {
  return Status::error(field + " = " + std::to_string(index) + " is out of range [0, " +
                       std::to_string(count) + ") of " + std::string(what));
}

// An index that must name an existing element.
Status checkIndex(const std::string &field, int64_t index, size_t count, std::string_view what) {
  if (index >= 0 && static_cast<uint64_t>(index) < count)
    return Status::ok();
  return outOfRange(field, index, count, what);
}

// An index that may also be -1 (absent).
Status checkOptionalIndex(const std::string &field, int64_t index, size_t count,
                          std::string_view what) {
  if (index == -1)
    return Status::ok();
  return checkIndex(field, index, count, what);
}

Status checkPositive(const std::string &field, int64_t value) {
  if (value > 0)
    return Status::ok();
  return Status::error(field + " = " + std::to_string(value) + " must be positive");
}

Status checkNonNegative(const std::string &field, int64_t value) {
  if (value >= 0)
    return Status::ok();
  return Status::error(field + " = " + std::to_string(value) + " must not be negative");
}

Status checkDType(const std::string &field, fb::DType dtype) {
  if (isValidDType(dtype))
    return Status::ok();
  return Status::error(field + " has the unknown value " + std::to_string(static_cast<int>(dtype)));
}

//===------------------------------------------------------------------------------------------===//
// Semantic checks over a structurally verified plan.
//===------------------------------------------------------------------------------------------===//

class PlanChecker {
public:
  explicit PlanChecker(const fb::Plan &plan) : plan_(plan) {}

  Status run() {
    HYBRID_RETURN_IF_ERROR(checkVersion());
    HYBRID_RETURN_IF_ERROR(checkModel());
    HYBRID_RETURN_IF_ERROR(checkWeightTable());
    HYBRID_RETURN_IF_ERROR(checkCache());
    HYBRID_RETURN_IF_ERROR(checkPrograms());
    return Status::ok();
  }

private:
  // What the steps of one program refer to.
  struct ProgramScope {
    std::string name; // "programs[0] 'prefill'", for "of ..." in range errors
    const flatbuffers::Vector<flatbuffers::Offset<fb::Value>> *values = nullptr;
    size_t numValues = 0;
    int32_t numStreams = 0;
    int32_t numEvents = 0;
  };

  Status checkVersion() {
    const fb::Version *version = plan_.version();
    if (!version)
      return Status::error("version: missing");
    std::string found = std::to_string(version->major()) + "." + std::to_string(version->minor());
    std::string supported =
        std::to_string(kPlanVersionMajor) + "." + std::to_string(kPlanVersionMinor);
    if (version->major() != kPlanVersionMajor)
      return Status::error("version: plan format " + found + " has another major version than " +
                           "this runtime's " + supported + "; recompile the plan");
    if (version->minor() > kPlanVersionMinor)
      return Status::error("version: plan format " + found + " is newer than this runtime's " +
                           supported + "; update the runtime or recompile the plan");
    return Status::ok();
  }

  Status checkModel() {
    const fb::Target *target = plan_.target();
    if (!target)
      return Status::error("target: missing");
    if (!target->device() || target->device()->size() == 0)
      return Status::error("target.device: missing");
    HYBRID_RETURN_IF_ERROR(checkPositive("target.world_size", target->world_size()));
    HYBRID_RETURN_IF_ERROR(checkPositive("target.tensor_parallel", target->tensor_parallel()));
    HYBRID_RETURN_IF_ERROR(checkPositive("target.expert_parallel", target->expert_parallel()));
    HYBRID_RETURN_IF_ERROR(checkPositive("target.context_parallel", target->context_parallel()));
    // The layout docs/parallelism.md describes: TP x CP ranks, experts spread over the same ranks.
    const int64_t world = target->world_size();
    // Experts spread over ranks holding the same tokens (the tensor-parallel ones) or, without
    // tensor parallelism, over the context ranks (exchanging rows in the prefill, since 1.5).
    if (int64_t(target->tensor_parallel()) * target->context_parallel() != world ||
        (target->expert_parallel() != 1 &&
         target->expert_parallel() != target->tensor_parallel() && !expertsOverContext()))
      return Status::error("target: tensor_parallel " + std::to_string(target->tensor_parallel()) +
                           " x context_parallel " + std::to_string(target->context_parallel()) +
                           " must equal world_size " + std::to_string(world) +
                           ", and expert_parallel " + std::to_string(target->expert_parallel()) +
                           " must be 1, tensor_parallel or (with tensor_parallel 1) "
                           "context_parallel");
    if (target->rank() < 0 || target->rank() >= world)
      return Status::error("target.rank: " + std::to_string(target->rank()) +
                           " is outside the world of " + std::to_string(world) + " ranks");
    HYBRID_RETURN_IF_ERROR(checkPositive("vocab_size", plan_.vocab_size()));
    HYBRID_RETURN_IF_ERROR(checkNonNegative("num_layers", plan_.num_layers()));
    if (plan_.fp8_activation_scale() > fb::Fp8ActivationScale::MAX)
      return Status::error("fp8_activation_scale has the unknown value " +
                           std::to_string(static_cast<int>(plan_.fp8_activation_scale())));
    return Status::ok();
  }

  Status checkWeightTable() {
    const auto *weights = plan_.weights();
    numWeights_ = lengthOf(weights);
    if (numWeights_ > 0 &&
        !parseArchiveKey(plan_.weight_archive_key() ? plan_.weight_archive_key()->string_view()
                                                    : std::string_view()))
      return Status::error("weight_archive_key: '" + printable(plan_.weight_archive_key()) +
                           "' is not 32 hex digits");
    std::set<std::string_view> names;
    for (size_t i = 0; i < numWeights_; ++i) {
      const fb::Weight *weight = weights->Get(static_cast<flatbuffers::uoffset_t>(i));
      std::string field = indexed("weights", i);
      if (!weight->name() || weight->name()->size() == 0)
        return Status::error(field + ".name: missing");
      field += " '" + printable(weight->name()) + "'";
      if (!names.insert(weight->name()->string_view()).second)
        return Status::error(field + ": duplicate weight name");
      HYBRID_RETURN_IF_ERROR(checkDType(field + ".dtype", weight->dtype()));
      if (weight->layout() > fb::Layout::MAX)
        return Status::error(field + ".layout has the unknown value " +
                             std::to_string(static_cast<int>(weight->layout())));
      if (weight->quant() > fb::QuantKind::MAX)
        return Status::error(field + ".quant has the unknown value " +
                             std::to_string(static_cast<int>(weight->quant())));

      // size == product(stored shape) * dtype size, overflow-checked.
      for (size_t axis = 0; axis < lengthOf(weight->shape()); ++axis) {
        const int64_t dim = weight->shape()->Get(static_cast<flatbuffers::uoffset_t>(axis));
        if (dim < 0)
          return Status::error(indexed(field + ".shape", axis) + " = " + std::to_string(dim) +
                               " is negative");
      }
      if (weight->layout() == fb::Layout::NzTiled) {
        if (lengthOf(weight->shape()) != 2 || lengthOf(weight->tile()) != 2 ||
            weight->tile()->Get(0) <= 0 || weight->tile()->Get(1) <= 0)
          return Status::error(field + ": layout NzTiled needs a 2-D shape and a positive 2-D "
                                       "tile");
        if (weight->quant() != fb::QuantKind::None)
          return Status::error(field + ": block-quantized weights are stored row-major");
      }
      const std::vector<int64_t> stored = storedShape(*weight);
      uint64_t bytes = dtypeByteSize(weight->dtype());
      for (int64_t dim : stored)
        if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(dim), &bytes))
          return Status::error(field + ".shape " + formatShape(weight->shape()) +
                               " has too many elements");
      if (weight->size() != bytes)
        return Status::error(field + ".size = " + std::to_string(weight->size()) + " but " +
                             dtypeName(weight->dtype()) + " " + formatShape(weight->shape()) +
                             " needs " + std::to_string(bytes) + " bytes");
      uint64_t end = 0;
      if (__builtin_add_overflow(weight->offset(), weight->size(), &end))
        return Status::error(field + ".offset + size overflows");

      HYBRID_RETURN_IF_ERROR(
          checkOptionalIndex(field + ".scale", weight->scale(), numWeights_, "the plan's weights"));
      if (weight->scale() >= 0 && static_cast<size_t>(weight->scale()) == i)
        return Status::error(field + ".scale names the weight itself");
      if (weight->quant() == fb::QuantKind::Fp8Block) {
        if (weight->scale() < 0)
          return Status::error(field + ".scale: quant Fp8Block needs a scale weight");
        if (lengthOf(weight->block()) == 0)
          return Status::error(field + ".block: quant Fp8Block needs a block shape");
      }
      for (size_t axis = 0; axis < lengthOf(weight->block()); ++axis)
        HYBRID_RETURN_IF_ERROR(
            checkPositive(indexed(field + ".block", axis), weight->block()->Get(axis)));
    }
    return Status::ok();
  }

  Status checkCache() {
    const fb::CacheSpec *cache = plan_.cache();
    const auto *kv = cache ? cache->kv() : nullptr;
    const auto *recurrent = cache ? cache->recurrent() : nullptr;
    numKvLayers_ = lengthOf(kv);
    numRecurrentLayers_ = lengthOf(recurrent);
    if (numKvLayers_ > 0)
      HYBRID_RETURN_IF_ERROR(checkPositive("cache.page_size", cache->page_size()));
    for (size_t i = 0; i < numKvLayers_; ++i) {
      const fb::KvCacheLayer *layer = kv->Get(static_cast<flatbuffers::uoffset_t>(i));
      std::string field = indexed("cache.kv", i);
      HYBRID_RETURN_IF_ERROR(
          checkIndex(field + ".layer", layer->layer(), numLayers(), "the plan's layers"));
      HYBRID_RETURN_IF_ERROR(checkNonNegative(field + ".latent_dim", layer->latent_dim()));
      HYBRID_RETURN_IF_ERROR(checkNonNegative(field + ".rope_dim", layer->rope_dim()));
      HYBRID_RETURN_IF_ERROR(checkNonNegative(field + ".index_key_dim", layer->index_key_dim()));
      if (layer->quant() > fb::KvQuant::MAX)
        return Status::error(field + ".quant has the unknown value " +
                             std::to_string(static_cast<int>(layer->quant())));
      if (layer->quant() == fb::KvQuant::Fp8Tiles)
        HYBRID_RETURN_IF_ERROR(checkPositive(field + ".quant_tile", layer->quant_tile()));
      if (int64_t{layer->latent_dim()} + layer->rope_dim() == 0)
        return Status::error(field + ": latent_dim and rope_dim are both 0");
      HYBRID_RETURN_IF_ERROR(checkDType(field + ".dtype", layer->dtype()));
    }
    for (size_t i = 0; i < numRecurrentLayers_; ++i) {
      const fb::RecurrentStateLayer *layer = recurrent->Get(static_cast<flatbuffers::uoffset_t>(i));
      std::string field = indexed("cache.recurrent", i);
      HYBRID_RETURN_IF_ERROR(
          checkIndex(field + ".layer", layer->layer(), numLayers(), "the plan's layers"));
      HYBRID_RETURN_IF_ERROR(checkPositive(field + ".num_heads", layer->num_heads()));
      HYBRID_RETURN_IF_ERROR(checkPositive(field + ".head_k_dim", layer->head_k_dim()));
      HYBRID_RETURN_IF_ERROR(checkPositive(field + ".head_v_dim", layer->head_v_dim()));
      HYBRID_RETURN_IF_ERROR(checkNonNegative(field + ".conv_channels", layer->conv_channels()));
      HYBRID_RETURN_IF_ERROR(checkPositive(field + ".conv_kernel", layer->conv_kernel()));
      if (layer->layout() > fb::StateLayout::MAX)
        return Status::error(field + ".layout has the unknown value " +
                             std::to_string(static_cast<int>(layer->layout())));
    }
    return Status::ok();
  }

  Status checkPrograms() {
    const auto *programs = plan_.programs();
    if (lengthOf(programs) == 0)
      return Status::error("programs: the plan has no program");
    std::set<std::string_view> names;
    for (size_t i = 0; i < programs->size(); ++i) {
      const fb::Program *program = programs->Get(static_cast<flatbuffers::uoffset_t>(i));
      std::string field = indexed("programs", i);
      if (!program->name() || program->name()->size() == 0)
        return Status::error(field + ".name: missing");
      if (!names.insert(program->name()->string_view()).second)
        return Status::error(field + ".name: duplicate program name '" +
                             printable(program->name()) + "'");
      HYBRID_RETURN_IF_ERROR(checkProgram(field, *program));
    }
    return Status::ok();
  }

  Status checkProgram(const std::string &field, const fb::Program &program) {
    ProgramScope scope;
    scope.name = "program '" + printable(program.name()) + "'";
    scope.values = program.values();
    scope.numValues = lengthOf(program.values());
    scope.numStreams = program.num_streams();
    scope.numEvents = program.num_events();
    HYBRID_RETURN_IF_ERROR(checkPositive(field + ".max_tokens", program.max_tokens()));
    HYBRID_RETURN_IF_ERROR(checkPositive(field + ".num_streams", program.num_streams()));
    HYBRID_RETURN_IF_ERROR(checkNonNegative(field + ".num_events", program.num_events()));

    std::string valuesOf = "the values of " + scope.name;
    for (size_t i = 0; i < scope.numValues; ++i)
      HYBRID_RETURN_IF_ERROR(
          checkValue(indexed(field + ".values", i), program,
                     *scope.values->Get(static_cast<flatbuffers::uoffset_t>(i))));

    HYBRID_RETURN_IF_ERROR(
        checkIndex(field + ".token_ids", program.token_ids(), scope.numValues, valuesOf));
    const fb::Value *tokenIds = scope.values->Get(program.token_ids());
    if (tokenIds->dtype() != fb::DType::I64 || tokenIds->row_elements() != 1)
      return Status::error(field + ".token_ids = " + std::to_string(program.token_ids()) +
                           " names a " + dtypeName(tokenIds->dtype()) + " value of " +
                           std::to_string(tokenIds->row_elements()) +
                           " elements per row, expected I64 with 1");
    HYBRID_RETURN_IF_ERROR(
        checkIndex(field + ".logits", program.logits(), scope.numValues, valuesOf));
    const fb::Value *logits = scope.values->Get(program.logits());
    if (logits->dtype() != fb::DType::F32 || logits->row_elements() != plan_.vocab_size())
      return Status::error(
          field + ".logits = " + std::to_string(program.logits()) + " names a " +
          dtypeName(logits->dtype()) + " value of " + std::to_string(logits->row_elements()) +
          " elements per row, expected F32 with vocab_size " + std::to_string(plan_.vocab_size()));
    for (size_t i = 0; i < lengthOf(program.layer_outputs()); ++i)
      HYBRID_RETURN_IF_ERROR(checkIndex(indexed(field + ".layer_outputs", i),
                                        program.layer_outputs()->Get(i), scope.numValues,
                                        valuesOf));
    if (program.hidden_input() != -1) {
      HYBRID_RETURN_IF_ERROR(checkIndex(field + ".hidden_input", program.hidden_input(),
                                        scope.numValues, valuesOf));
      const fb::Value *hidden = scope.values->Get(program.hidden_input());
      if (hidden->dtype() != fb::DType::F32 || hidden->row_elements() != plan_.hidden_size())
        return Status::error(field + ".hidden_input = " + std::to_string(program.hidden_input()) +
                             " names a " + dtypeName(hidden->dtype()) + " value of " +
                             std::to_string(hidden->row_elements()) +
                             " elements per row, expected F32 with hidden_size " +
                             std::to_string(plan_.hidden_size()));
    }

    for (size_t i = 0; i < lengthOf(program.steps()); ++i) {
      const fb::Step *step = program.steps()->Get(static_cast<flatbuffers::uoffset_t>(i));
      std::string stepField = indexed(field + ".steps", i);
      switch (step->op_type()) {
      case fb::StepOp::Dispatch:
        if (!step->op_as_Dispatch())
          return Status::error(stepField + ".op: Dispatch without a table");
        HYBRID_RETURN_IF_ERROR(checkDispatch(stepField, *step->op_as_Dispatch(), scope));
        break;
      case fb::StepOp::Copy:
        if (!step->op_as_Copy())
          return Status::error(stepField + ".op: Copy without a table");
        HYBRID_RETURN_IF_ERROR(checkCopy(stepField, *step->op_as_Copy(), scope));
        break;
      default:
        return Status::error(stepField + ".op: missing or unknown step type " +
                             std::to_string(static_cast<int>(step->op_type())));
      }
    }
    return Status::ok();
  }

  // dtype, row size, and the value's rows (max_tokens tokens, or its chunks) inside the arena.
  Status checkValue(const std::string &field, const fb::Program &program, const fb::Value &value) {
    HYBRID_RETURN_IF_ERROR(checkDType(field + ".dtype", value.dtype()));
    HYBRID_RETURN_IF_ERROR(checkPositive(field + ".row_elements", value.row_elements()));
    if (value.rows() > fb::ValueRows::MAX)
      return Status::error(field + ".rows has the unknown value " +
                           std::to_string(static_cast<int>(value.rows())));
    const int64_t contextParallel = plan_.target()->context_parallel();
    if (value.rows() != fb::ValueRows::Step && contextParallel == 1)
      return Status::error(field + ".rows: " + fb::EnumNameValueRows(value.rows()) +
                           " in a plan without context parallelism (target.context_parallel 1)");
    const int64_t rows = value.rows() == fb::ValueRows::ContextChunks      ? 2
                         : value.rows() == fb::ValueRows::AllContextChunks ? 2 * contextParallel
                                                                           : program.max_tokens();
    size_t elementBytes = dtypeByteSize(value.dtype());
    if (value.arena_offset() % elementBytes != 0)
      return Status::error(field + ".arena_offset = " + std::to_string(value.arena_offset()) +
                           " is not aligned to its " + dtypeName(value.dtype()) + " elements");
    const bool perChunk = value.rows() == fb::ValueRows::ContextChunks ||
                          value.rows() == fb::ValueRows::AllContextChunks;
    const std::string rowsText = perChunk ? std::to_string(rows) + " chunk rows"
                                          : "max_tokens " + std::to_string(rows);
    uint64_t bytes = 0;
    uint64_t end = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(rows),
                               static_cast<uint64_t>(value.row_elements()), &bytes) ||
        __builtin_mul_overflow(bytes, elementBytes, &bytes) ||
        __builtin_add_overflow(value.arena_offset(), bytes, &end) || end > program.arena_bytes())
      return Status::error(field + ": arena_offset " + std::to_string(value.arena_offset()) +
                           " + " + rowsText + " x " +
                           std::to_string(value.row_elements()) + " " + dtypeName(value.dtype()) +
                           " reaches past arena_bytes " + std::to_string(program.arena_bytes()));
    return Status::ok();
  }

  Status checkValueList(const std::string &field, const flatbuffers::Vector<int32_t> *list,
                        const ProgramScope &scope) {
    for (size_t i = 0; i < lengthOf(list); ++i)
      HYBRID_RETURN_IF_ERROR(checkIndex(indexed(field, i), list->Get(i), scope.numValues,
                                        "the values of " + scope.name));
    return Status::ok();
  }

  Status checkStream(const std::string &field, int32_t stream, const ProgramScope &scope) {
    return checkIndex(field, stream, static_cast<size_t>(scope.numStreams),
                      "the streams of " + scope.name);
  }

  Status checkDispatch(const std::string &field, const fb::Dispatch &dispatch,
                       const ProgramScope &scope) {
    fb::KernelId kernel = dispatch.kernel();
    const plan::KernelSignature *signature = plan::kernelSignature(kernel);
    if (!signature)
      return Status::error(field + ".kernel has the unknown value " +
                           std::to_string(static_cast<int>(kernel)));
    std::string context = field + " (" + kernelName(kernel) + ")";
    if (dispatch.params_type() != signature->params)
      return Status::error(context + ".params: kernel " + kernelName(kernel) + " takes " +
                           paramsName(signature->params) + ", the plan gives " +
                           paramsName(dispatch.params_type()));
    if (!dispatch.params())
      return Status::error(context + ".params: missing " + paramsName(signature->params) +
                           " table");

    // Operand counts and value indices.
    auto numInputs = static_cast<int64_t>(lengthOf(dispatch.inputs()));
    size_t numOutputs = lengthOf(dispatch.outputs());
    if (numInputs < signature->minInputs ||
        (signature->maxInputs >= 0 && numInputs > signature->maxInputs) ||
        static_cast<int>(numOutputs) != signature->numOutputs) {
      std::string inputs = std::to_string(signature->minInputs);
      if (signature->maxInputs != signature->minInputs)
        inputs +=
            signature->maxInputs < 0 ? " or more" : " to " + std::to_string(signature->maxInputs);
      return Status::error(context + ": " + kernelName(kernel) + " takes " + inputs +
                           " inputs and " + std::to_string(signature->numOutputs) +
                           (signature->numOutputs == 1 ? " output" : " outputs") +
                           ", the plan gives " + std::to_string(numInputs) + " and " +
                           std::to_string(numOutputs));
    }
    HYBRID_RETURN_IF_ERROR(checkValueList(context + ".inputs", dispatch.inputs(), scope));
    HYBRID_RETURN_IF_ERROR(checkValueList(context + ".outputs", dispatch.outputs(), scope));

    // Weights in the role order of plan.fbs; -1 only where the role is optional.
    int64_t numExperts = 0;
    if (signature->perExpertWeights) {
      numExperts = dispatch.params_as_MoeParams()->num_experts();
      HYBRID_RETURN_IF_ERROR(checkPositive(context + ".params.num_experts", numExperts));
    }
    int64_t weightCount = *expectedWeightCount(kernel, numExperts);
    size_t numWeights = lengthOf(dispatch.weights());
    if (static_cast<int64_t>(numWeights) != weightCount)
      return Status::error(context + ".weights: has " + std::to_string(numWeights) + " entries, " +
                           kernelName(kernel) + " takes " + std::to_string(weightCount) +
                           " in the role order of plan.fbs");
    for (size_t role = 0; role < numWeights; ++role) {
      int32_t weight = dispatch.weights()->Get(static_cast<flatbuffers::uoffset_t>(role));
      std::string roleField = indexed(context + ".weights", role) + " (" +
                              std::string(weightRoleName(*signature, role)) + ")";
      bool optional = role < 32 && (signature->optionalWeights >> role & 1u);
      // Expert parallelism: the routed experts other ranks hold are absent from this rank's plan.
      if (signature->perExpertWeights && role >= static_cast<size_t>(signature->fixedWeights) &&
          plan_.target()->expert_parallel() > 1)
        optional = true;
      if (weight == -1 && !optional)
        return Status::error(roleField + " = -1, but the role is required");
      HYBRID_RETURN_IF_ERROR(
          checkOptionalIndex(roleField, weight, numWeights_, "the plan's weights"));
    }

    HYBRID_RETURN_IF_ERROR(checkStream(context + ".stream", dispatch.stream(), scope));
    std::string eventsOf = "the events of " + scope.name;
    for (size_t i = 0; i < lengthOf(dispatch.wait_events()); ++i)
      HYBRID_RETURN_IF_ERROR(checkIndex(indexed(context + ".wait_events", i),
                                        dispatch.wait_events()->Get(i),
                                        static_cast<size_t>(scope.numEvents), eventsOf));
    HYBRID_RETURN_IF_ERROR(checkOptionalIndex(context + ".signal_event", dispatch.signal_event(),
                                              static_cast<size_t>(scope.numEvents), eventsOf));
    HYBRID_RETURN_IF_ERROR(
        checkOptionalIndex(context + ".layer", dispatch.layer(), numLayers(), "the plan's layers"));
    HYBRID_RETURN_IF_ERROR(checkActivation(context, dispatch));
    HYBRID_RETURN_IF_ERROR(checkCollective(context, dispatch, scope));
    HYBRID_RETURN_IF_ERROR(checkExpertAllToAll(context, dispatch, scope));
    return checkCacheSlots(context, dispatch);
  }

  // A collective's group exists in this plan's layout; a gather turns this rank's rows into
  // everyone's (ContextShard -> Step, ContextChunks -> AllContextChunks).
  Status checkCollective(const std::string &context, const fb::Dispatch &dispatch,
                         const ProgramScope &scope) {
    const fb::CollectiveParams *p = dispatch.params_as_CollectiveParams();
    if (!p)
      return Status::ok();
    if (p->group() > fb::CollectiveGroup::MAX)
      return Status::error(context + ".params.group has the unknown value " +
                           std::to_string(static_cast<int>(p->group())));
    const bool contextGroup = p->group() == fb::CollectiveGroup::ContextParallel;
    if (contextGroup && plan_.target()->context_parallel() == 1)
      return Status::error(context + ".params.group: ContextParallel in a plan without context "
                                     "parallelism (target.context_parallel 1)");
    if (dispatch.kernel() != fb::KernelId::AllGatherRows) {
      // Over the context ranks only the routed experts' parts of a step every context rank runs
      // whole (decode), in a plan whose experts are spread over them.
      if (contextGroup &&
          (!expertsOverContext() ||
           scope.values->Get(dispatch.outputs()->Get(0))->rows() != fb::ValueRows::Step))
        return Status::error(context + ".params.group: an all-reduce sums over the "
                                       "TensorParallel or ExpertParallel group, or over "
                                       "ContextParallel the Step rows of a plan whose experts "
                                       "are spread over the context ranks (expert_parallel = "
                                       "context_parallel, tensor_parallel 1)");
      return Status::ok();
    }
    if (!contextGroup)
      return Status::error(context + ".params.group: AllGatherRows gathers over the "
                                     "ContextParallel group");
    if (p->tail_rows() < 0)
      return Status::error(context + ".params.tail_rows = " + std::to_string(p->tail_rows()) +
                           " is negative");
    const fb::ValueRows from = scope.values->Get(dispatch.inputs()->Get(0))->rows();
    const fb::ValueRows to = scope.values->Get(dispatch.outputs()->Get(0))->rows();
    if (!(from == fb::ValueRows::ContextShard && to == fb::ValueRows::Step) &&
        !(from == fb::ValueRows::ContextChunks && to == fb::ValueRows::AllContextChunks))
      return Status::error(context + ": gathers " + fb::EnumNameValueRows(from) + " rows into " +
                           fb::EnumNameValueRows(to) + " rows (ContextShard -> Step or "
                           "ContextChunks -> AllContextChunks)");
    return Status::ok();
  }

  // MoeParams.all_to_all: the routed experts of a context-parallel prefill exchange this rank's
  // rows with the context ranks holding their experts. Only there, and there always (without it
  // the output would be a partial sum that nothing completes).
  Status checkExpertAllToAll(const std::string &context, const fb::Dispatch &dispatch,
                             const ProgramScope &scope) {
    const fb::MoeParams *p = dispatch.params_as_MoeParams();
    if (!p)
      return Status::ok();
    const bool shardRows = dispatch.kernel() == fb::KernelId::MoeExperts &&
                           scope.values->Get(dispatch.inputs()->Get(0))->rows() ==
                               fb::ValueRows::ContextShard;
    if (p->all_to_all() && (dispatch.kernel() != fb::KernelId::MoeExperts ||
                            !expertsOverContext() || !shardRows))
      return Status::error(context + ".params.all_to_all: only MoeExperts on ContextShard rows "
                                     "in a plan whose experts are spread over the context ranks "
                                     "(expert_parallel = context_parallel, tensor_parallel 1)");
    if (!p->all_to_all() && shardRows && expertsOverContext())
      return Status::error(context + ".params.all_to_all: MoeExperts on ContextShard rows with "
                                     "the experts spread over the context ranks must exchange "
                                     "its rows (all_to_all true)");
    return Status::ok();
  }

  // The routed experts spread over the context ranks (expert_parallel = context_parallel,
  // tensor_parallel 1): the layout whose prefill runs MoeExperts as an all-to-all.
  bool expertsOverContext() const {
    const fb::Target &target = *plan_.target();
    return target.tensor_parallel() == 1 && target.context_parallel() > 1 &&
           target.expert_parallel() == target.context_parallel();
  }

  // A gated MLP's activation is known and SiTU has its positive beta (the kernels divide by it).
  Status checkActivation(const std::string &context, const fb::Dispatch &dispatch) {
    fb::Activation activation;
    float beta = 0, linearBeta = 0;
    if (const fb::MlpParams *mlp = dispatch.params_as_MlpParams()) {
      activation = mlp->activation();
      beta = mlp->situ_beta();
      linearBeta = mlp->situ_linear_beta();
    } else if (const fb::MoeParams *moe = dispatch.params_as_MoeParams()) {
      activation = moe->activation();
      beta = moe->situ_beta();
      linearBeta = moe->situ_linear_beta();
    } else {
      return Status::ok();
    }
    if (activation > fb::Activation::MAX)
      return Status::error(context + ".params.activation has the unknown value " +
                           std::to_string(static_cast<int>(activation)));
    if (activation == fb::Activation::Situ && !(beta > 0 && linearBeta >= 0))
      return Status::error(context + ".params: the Situ activation needs situ_beta > 0 and "
                                     "situ_linear_beta >= 0, got " +
                           std::to_string(beta) + " and " + std::to_string(linearBeta));
    return Status::ok();
  }

  Status checkCacheSlots(const std::string &context, const fb::Dispatch &dispatch) {
    switch (dispatch.params_type()) {
    case fb::KernelParams::KdaParams:
      return checkIndex(context + ".params.state_slot",
                        dispatch.params_as_KdaParams()->state_slot(), numRecurrentLayers_,
                        "cache.recurrent");
    case fb::KernelParams::MlaParams:
      return checkIndex(context + ".params.kv_slot", dispatch.params_as_MlaParams()->kv_slot(),
                        numKvLayers_, "cache.kv");
    case fb::KernelParams::DsaIndexerParams:
      return checkIndex(context + ".params.kv_slot",
                        dispatch.params_as_DsaIndexerParams()->kv_slot(), numKvLayers_, "cache.kv");
    default:
      return Status::ok();
    }
  }

  Status checkCopy(const std::string &field, const fb::Copy &copy, const ProgramScope &scope) {
    std::string valuesOf = "the values of " + scope.name;
    HYBRID_RETURN_IF_ERROR(checkIndex(field + ".source", copy.source(), scope.numValues, valuesOf));
    HYBRID_RETURN_IF_ERROR(
        checkIndex(field + ".destination", copy.destination(), scope.numValues, valuesOf));
    HYBRID_RETURN_IF_ERROR(checkStream(field + ".stream", copy.stream(), scope));
    const fb::Value *source = scope.values->Get(copy.source());
    const fb::Value *destination = scope.values->Get(copy.destination());
    if (source->dtype() != destination->dtype() ||
        source->row_elements() != destination->row_elements())
      return Status::error(field + ": copies a " + dtypeName(source->dtype()) + " value of " +
                           std::to_string(source->row_elements()) + " elements per row into a " +
                           dtypeName(destination->dtype()) + " value of " +
                           std::to_string(destination->row_elements()));
    return Status::ok();
  }

  // The decoder layers, and the multi-token-prediction layer after them when the plan has an
  // `mtp` program (its KV cache and steps carry layer index num_layers).
  size_t numLayers() const {
    return static_cast<size_t>(std::max(plan_.num_layers(), 0)) +
           (findProgram(plan_, "mtp") ? 1 : 0);
  }

  const fb::Plan &plan_;
  size_t numWeights_ = 0;
  size_t numKvLayers_ = 0;
  size_t numRecurrentLayers_ = 0;
};

// The three gates over bytes already in an aligned buffer. Errors without the source name.
Status verifyPlanBytes(const uint8_t *data, size_t size) {
  if (size < kMinPlanBytes)
    return Status::error("file is " + std::to_string(size) +
                         " bytes, too small to be a plan (truncated?)");
  if (size >= FLATBUFFERS_MAX_BUFFER_SIZE)
    return Status::error("file is " + std::to_string(size) +
                         " bytes, larger than a FlatBuffer can be");
  if (!fb::PlanBufferHasIdentifier(data)) {
    std::string identifier;
    for (size_t i = 0; i < flatbuffers::kFileIdentifierLength; ++i) {
      auto byte = data[sizeof(flatbuffers::uoffset_t) + i];
      if (byte >= 0x20 && byte < 0x7f) {
        identifier += static_cast<char>(byte);
      } else {
        char escaped[8];
        std::snprintf(escaped, sizeof escaped, "\\x%02x", byte);
        identifier += escaped;
      }
    }
    return Status::error("file identifier is '" + identifier + "', expected '" +
                         fb::PlanIdentifier() + "' (not a hybrid plan)");
  }
  flatbuffers::Verifier verifier(data, size, kMaxVerifierDepth, kMaxVerifierTables);
  if (!fb::VerifyPlanBuffer(verifier))
    return Status::error("the FlatBuffers verifier rejected the plan (corrupt, truncated, or "
                         "written with an incompatible schema)");
  return PlanChecker(*fb::GetPlan(data)).run();
}

} // namespace

//===------------------------------------------------------------------------------------------===//
// Kernel metadata.
//===------------------------------------------------------------------------------------------===//

std::vector<int64_t> storedShape(const fb::Weight &weight) {
  std::vector<int64_t> shape;
  if (weight.shape())
    shape.assign(weight.shape()->begin(), weight.shape()->end());
  if (weight.layout() != fb::Layout::NzTiled)
    return shape;
  if (shape.size() != 2 || !weight.tile() || weight.tile()->size() != 2 ||
      weight.tile()->Get(0) <= 0 || weight.tile()->Get(1) <= 0)
    return {};
  for (size_t axis = 0; axis < 2; ++axis) {
    const int64_t tile = weight.tile()->Get(static_cast<flatbuffers::uoffset_t>(axis));
    shape[axis] = (shape[axis] + tile - 1) / tile * tile;
  }
  return shape;
}

fb::KernelParams expectedParamsType(fb::KernelId kernel) {
  const plan::KernelSignature *signature = plan::kernelSignature(kernel);
  return signature ? signature->params : fb::KernelParams::NONE;
}

std::optional<int64_t> expectedWeightCount(fb::KernelId kernel, int64_t numExperts) {
  const plan::KernelSignature *signature = plan::kernelSignature(kernel);
  if (!signature)
    return std::nullopt;
  // MoeExperts: gate/up/down per expert.
  return signature->fixedWeights + (signature->perExpertWeights ? 3 * numExperts : 0);
}

//===------------------------------------------------------------------------------------------===//
// LoadedPlan.
//===------------------------------------------------------------------------------------------===//

StatusOr<LoadedPlan> LoadedPlan::load(const std::string &path) {
  return catchExceptions(path, [&]() -> StatusOr<LoadedPlan> {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.isOpen()) {
      int error = errno;
      return Status::error(path + ": cannot open: " + errnoMessage(error));
    }
    struct stat info {};
    if (::fstat(fd.get(), &info) != 0) {
      int error = errno;
      return Status::error(path + ": cannot stat: " + errnoMessage(error));
    }
    auto size = static_cast<uint64_t>(info.st_size);
    if (size >= FLATBUFFERS_MAX_BUFFER_SIZE) {
      return Status::error(path + ": file is " + std::to_string(size) +
                           " bytes, larger than a FlatBuffer can be");
    }
    LoadedPlan plan;
    plan.path_ = path;
    plan.size_ = size;
    plan.storage_.resize((size + sizeof(uint64_t) - 1) / sizeof(uint64_t));
    auto *cursor = reinterpret_cast<char *>(plan.storage_.data());
    size_t remaining = size;
    while (remaining > 0) {
      ssize_t got = ::read(fd.get(), cursor, remaining);
      if (got < 0 && errno == EINTR)
        continue;
      if (got <= 0) {
        int error = errno;
        return Status::error(path + ": read failed" +
                             (got < 0 ? ": " + errnoMessage(error) : ": file shrank while read"));
      }
      cursor += got;
      remaining -= static_cast<size_t>(got);
    }
    fd.closeNow();
    HYBRID_RETURN_IF_ERROR(
        verifyPlanBytes(reinterpret_cast<const uint8_t *>(plan.storage_.data()), size)
            .withContext(path));
    return plan;
  });
}

StatusOr<LoadedPlan> LoadedPlan::fromBytes(std::span<const std::byte> bytes,
                                           std::string sourceName) {
  return catchExceptions(sourceName, [&]() -> StatusOr<LoadedPlan> {
    LoadedPlan plan;
    plan.path_ = std::move(sourceName);
    plan.size_ = bytes.size();
    plan.storage_.resize((bytes.size() + sizeof(uint64_t) - 1) / sizeof(uint64_t));
    if (!bytes.empty())
      std::memcpy(plan.storage_.data(), bytes.data(), bytes.size());
    HYBRID_RETURN_IF_ERROR(
        verifyPlanBytes(reinterpret_cast<const uint8_t *>(plan.storage_.data()), plan.size_)
            .withContext(plan.path_));
    return plan;
  });
}

const fb::Plan &LoadedPlan::plan() const { return *fb::GetPlan(storage_.data()); }

std::span<const std::byte> LoadedPlan::bytes() const {
  return {reinterpret_cast<const std::byte *>(storage_.data()), size_};
}

const fb::Program *LoadedPlan::findProgram(std::string_view name) const {
  return hybrid::findProgram(plan(), name);
}

const fb::Program *findProgram(const fb::Plan &plan, std::string_view name) {
  const auto *programs = plan.programs();
  for (size_t i = 0; i < lengthOf(programs); ++i) {
    const fb::Program *program = programs->Get(static_cast<flatbuffers::uoffset_t>(i));
    if (program->name() && program->name()->string_view() == name)
      return program;
  }
  return nullptr;
}

//===------------------------------------------------------------------------------------------===//
// Matching the plan against the device and the weights.
//===------------------------------------------------------------------------------------------===//

// "tensor_parallel 2, expert_parallel 1, context_parallel 1", for refusals.
static std::string layoutOf(const fb::Target &target) {
  return "tensor_parallel " + std::to_string(target.tensor_parallel()) + ", expert_parallel " +
         std::to_string(target.expert_parallel()) + ", context_parallel " +
         std::to_string(target.context_parallel());
}

Status checkTarget(const LoadedPlan &loaded, std::string_view device, int worldSize,
                   std::string_view arch) {
  return catchExceptions(loaded.path(), [&]() -> Status {
    const fb::Target &target = *loaded->target(); // load() guarantees it is present
    std::string_view planDevice = target.device()->string_view();
    std::string_view planArch = target.arch() ? target.arch()->string_view() : "";
    auto describe = [](std::string_view name, std::string_view architecture) {
      std::string out(name);
      if (!architecture.empty()) {
        out += " ";
        out += architecture;
      }
      return out;
    };
    if (planDevice != device || (!arch.empty() && planArch != arch))
      return Status::error(loaded.path() + " was compiled for " + describe(planDevice, planArch) +
                           ", this runtime device is " + describe(device, arch));
    if (target.world_size() != worldSize)
      return Status::error(loaded.path() + " was compiled for world size " +
                           std::to_string(target.world_size()) + " (" + layoutOf(target) +
                           "), this runtime runs " + std::to_string(worldSize) +
                           (worldSize == 1 ? " rank" : " ranks"));
    return Status::ok();
  });
}

Status checkRank(const LoadedPlan &loaded, int rank) {
  return catchExceptions(loaded.path(), [&]() -> Status {
    const fb::Target &target = *loaded->target();
    if (target.rank() != rank)
      return Status::error(loaded.path() + " is rank " + std::to_string(target.rank()) +
                           "'s plan of " + std::to_string(target.world_size()) + " (" +
                           layoutOf(target) + "), this communicator's rank is " +
                           std::to_string(rank));
    return Status::ok();
  });
}

std::string planFileName(int rank, int worldSize) {
  return worldSize == 1 ? "plan.hyplan" : "plan.rank" + std::to_string(rank) + ".hyplan";
}

std::string archiveFileName(int rank, int worldSize) {
  return worldSize == 1 ? "weights.hyw" : "weights.rank" + std::to_string(rank) + ".hyw";
}

Status checkWeights(const LoadedPlan &loaded, const WeightArchive &archive) {
  return catchExceptions(loaded.path(), [&]() -> Status {
    const fb::Plan &plan = loaded.plan();
    std::string both = loaded.path() + " and " + archive.path();
    std::string_view planKeyText =
        plan.weight_archive_key() ? plan.weight_archive_key()->string_view() : "";
    std::optional<ArchiveKey> planKey = parseArchiveKey(planKeyText);
    if (!planKey || *planKey != archive.key())
      return Status::error(loaded.path() + " reads the weight archive with key '" +
                           std::string(planKeyText) + "' but " + archive.path() + " has key " +
                           formatArchiveKey(archive.key()));
    // weight_archive_bytes is where the last weight's data ends; the entry table follows it.
    uint64_t dataEnd = 0;
    for (const WeightArchiveEntry &entry : archive.entries())
      dataEnd = std::max(dataEnd, entry.offset + entry.size);
    if (plan.weight_archive_bytes() != 0 && plan.weight_archive_bytes() != dataEnd)
      return Status::error(
          both + ": weight_archive_bytes = " + std::to_string(plan.weight_archive_bytes()) +
          " but the archive's weight data ends at byte " + std::to_string(dataEnd));

    const auto *weights = plan.weights();
    for (size_t i = 0; i < lengthOf(weights); ++i) {
      const fb::Weight *weight = weights->Get(static_cast<flatbuffers::uoffset_t>(i));
      std::string field =
          both + ": " + indexed("weights", i) + " '" + printable(weight->name()) + "'";
      const WeightArchive::Entry *entry = archive.find(weight->name()->string_view());
      if (!entry)
        return Status::error(field + ": not in the archive");
      if (weight->dtype() != entry->dtype)
        return Status::error(field + ": dtype " + dtypeName(weight->dtype()) +
                             " but the archive has " + dtypeName(entry->dtype));
      // Tiled weights are stored padded to whole tiles.
      bool sameShape = storedShape(*weight) == entry->shape;
      if (!sameShape) {
        std::string archiveShape = "[";
        for (size_t axis = 0; axis < entry->shape.size(); ++axis) {
          if (axis)
            archiveShape += ", ";
          archiveShape += std::to_string(entry->shape[axis]);
        }
        archiveShape += "]";
        return Status::error(field + ": shape " + formatShape(weight->shape()) +
                             " but the archive has " + archiveShape);
      }
      if (weight->offset() != entry->offset)
        return Status::error(field + ": offset " + std::to_string(weight->offset()) +
                             " but the archive has " + std::to_string(entry->offset));
      if (weight->size() != entry->size)
        return Status::error(field + ": size " + std::to_string(weight->size()) +
                             " but the archive has " + std::to_string(entry->size));
    }
    return Status::ok();
  });
}

} // namespace hybrid
