// Recurrent state pool for the KDA layers: per sequence slot, every layer's fp32 state
// [H, K, V] and short-conv state [conv_kernel - 1, conv_channels], in one contiguous block.
#include "hybrid/runtime/Memory.h"
#include "hybrid/runtime/StatusHelpers.h"

#include <algorithm>
#include <cstring>
#include <exception>

namespace hybrid {
namespace fb = plan::fb;
namespace {

// Each layer's state and conv state start on an Arena::kAlignment boundary inside the slot block.
constexpr uint64_t kAlignmentFloats = Arena::kAlignment / sizeof(float);

std::string recurrentField(size_t index) {
  return "cache.recurrent[" + std::to_string(index) + "]";
}

struct SlotLayout {
  std::vector<RecurrentLayerShape> shapes;
  std::vector<uint64_t> stateOffsets; // floats into the slot block
  std::vector<uint64_t> convOffsets;
  uint64_t slotElements = 0;
};

// Validates CacheSpec.recurrent and lays one slot out; every product is overflow-checked.
StatusOr<SlotLayout> planSlotLayout(const fb::CacheSpec &spec) {
  SlotLayout layout;
  const auto *recurrent = spec.recurrent();
  for (flatbuffers::uoffset_t i = 0; recurrent && i < recurrent->size(); ++i) {
    const fb::RecurrentStateLayer *layer = recurrent->Get(i);
    RecurrentLayerShape shape;
    shape.layer = layer->layer();
    shape.numHeads = layer->num_heads();
    shape.headKDim = layer->head_k_dim();
    shape.headVDim = layer->head_v_dim();
    shape.layout = layer->layout();
    shape.convChannels = layer->conv_channels();
    shape.convKernel = layer->conv_kernel();
    if (shape.numHeads <= 0 || shape.headKDim <= 0 || shape.headVDim <= 0 ||
        shape.convChannels < 0 || shape.convKernel <= 0 || shape.layout > fb::StateLayout::MAX)
      return Status::error(recurrentField(i) + ": num_heads " + std::to_string(shape.numHeads) +
                           ", head_k_dim " + std::to_string(shape.headKDim) + ", head_v_dim " +
                           std::to_string(shape.headVDim) + ", conv_channels " +
                           std::to_string(shape.convChannels) + ", conv_kernel " +
                           std::to_string(shape.convKernel) + " do not describe a state");

    uint64_t stateElements = 0;
    uint64_t convElements = 0;
    uint64_t end = 0;
    bool overflow =
        __builtin_mul_overflow(static_cast<uint64_t>(shape.numHeads),
                               static_cast<uint64_t>(shape.headKDim), &stateElements) ||
        __builtin_mul_overflow(stateElements, static_cast<uint64_t>(shape.headVDim),
                               &stateElements) ||
        __builtin_mul_overflow(static_cast<uint64_t>(shape.convChannels),
                               static_cast<uint64_t>(shape.convKernel - 1), &convElements);
    // state at the cursor, conv state after it, each padded to the alignment.
    uint64_t stateOffset = layout.slotElements;
    uint64_t convOffset = 0;
    overflow = overflow || __builtin_add_overflow(stateOffset, stateElements, &end) ||
               __builtin_add_overflow(end, kAlignmentFloats - 1, &end);
    if (!overflow) {
      convOffset = end / kAlignmentFloats * kAlignmentFloats;
      overflow = __builtin_add_overflow(convOffset, convElements, &end) ||
                 __builtin_add_overflow(end, kAlignmentFloats - 1, &end);
    }
    if (overflow)
      return Status::error(recurrentField(i) + ": the state size overflows");
    layout.shapes.push_back(shape);
    layout.stateOffsets.push_back(stateOffset);
    layout.convOffsets.push_back(convOffset);
    layout.slotElements = end / kAlignmentFloats * kAlignmentFloats;
  }
  return layout;
}

} // namespace

StatusOr<uint64_t> RecurrentStatePool::bytesPerSlot(const fb::CacheSpec &spec) {
  return catchExceptions("recurrent state pool", [&]() -> StatusOr<uint64_t> {
    HYBRID_ASSIGN_OR_RETURN(SlotLayout layout, planSlotLayout(spec));
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(layout.slotElements, sizeof(float), &bytes))
      return Status::error("recurrent state pool: the slot size overflows");
    return bytes;
  });
}

StatusOr<RecurrentStatePool> RecurrentStatePool::create(const fb::CacheSpec &spec,
                                                        int32_t numSlots) {
  return catchExceptions("recurrent state pool", [&]() -> StatusOr<RecurrentStatePool> {
    if (numSlots <= 0)
      return Status::error("recurrent state pool: numSlots = " + std::to_string(numSlots) +
                           " must be positive");
    HYBRID_ASSIGN_OR_RETURN(SlotLayout layout, planSlotLayout(spec));
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(layout.slotElements, sizeof(float), &bytes) ||
        __builtin_mul_overflow(bytes, static_cast<uint64_t>(numSlots), &bytes))
      return Status::error("recurrent state pool: " + std::to_string(numSlots) + " slots overflow");

    RecurrentStatePool pool;
    HYBRID_ASSIGN_OR_RETURN(pool.storage_, Arena::create(bytes));
    for (size_t i = 0; i < layout.shapes.size(); ++i)
      pool.layers_.push_back({layout.shapes[i], layout.stateOffsets[i], layout.convOffsets[i]});
    pool.slotElements_ = layout.slotElements;
    pool.numSlots_ = numSlots;
    for (int32_t slot = numSlots - 1; slot >= 0; --slot)
      pool.freeSlots_.push_back(slot);
    pool.allocated_.assign(static_cast<size_t>(numSlots), false);
    return pool;
  });
}

bool RecurrentStatePool::isAllocated(int32_t slot) const {
  return slot >= 0 && slot < numSlots_ && allocated_[static_cast<size_t>(slot)];
}

Status RecurrentStatePool::checkSlot(int32_t slot) const {
  if (slot < 0 || slot >= numSlots_)
    return Status::error("recurrent state pool: slot " + std::to_string(slot) +
                         " is out of range [0, " + std::to_string(numSlots_) + ")");
  if (!allocated_[static_cast<size_t>(slot)])
    return Status::error("recurrent state pool: slot " + std::to_string(slot) +
                         " is not allocated");
  return Status::ok();
}

Status RecurrentStatePool::checkLayerAndSlot(int32_t stateSlot, int32_t slot) const {
  if (stateSlot < 0 || stateSlot >= numLayers())
    return Status::error("recurrent state pool: state_slot " + std::to_string(stateSlot) +
                         " is out of range [0, " + std::to_string(numLayers()) + ")");
  return checkSlot(slot);
}

float *RecurrentStatePool::slotBlock(int32_t slot) {
  return reinterpret_cast<float *>(storage_.data()) + static_cast<uint64_t>(slot) * slotElements_;
}

StatusOr<int32_t> RecurrentStatePool::allocate() {
  if (freeSlots_.empty())
    return Status::error("recurrent state pool: all " + std::to_string(numSlots_) +
                         " sequence slots are in use");
  int32_t slot = freeSlots_.back();
  freeSlots_.pop_back();
  allocated_[static_cast<size_t>(slot)] = true;
  // A new sequence starts from the zero state (MODEL_SPEC section 2.4).
  std::fill_n(slotBlock(slot), slotElements_, 0.0f);
  return slot;
}

Status RecurrentStatePool::release(int32_t slot) {
  HYBRID_RETURN_IF_ERROR(checkSlot(slot));
  allocated_[static_cast<size_t>(slot)] = false;
  freeSlots_.push_back(slot); // never reallocates: at most numSlots entries, reserved at create
  return Status::ok();
}

StatusOr<std::span<float>> RecurrentStatePool::state(int32_t stateSlot, int32_t slot) {
  HYBRID_RETURN_IF_ERROR(checkLayerAndSlot(stateSlot, slot));
  const Layer &layer = layers_[static_cast<size_t>(stateSlot)];
  return std::span<float>(slotBlock(slot) + layer.stateOffset,
                          static_cast<size_t>(layer.shape.stateElements()));
}

StatusOr<std::span<float>> RecurrentStatePool::convState(int32_t stateSlot, int32_t slot) {
  HYBRID_RETURN_IF_ERROR(checkLayerAndSlot(stateSlot, slot));
  const Layer &layer = layers_[static_cast<size_t>(stateSlot)];
  return std::span<float>(slotBlock(slot) + layer.convOffset,
                          static_cast<size_t>(layer.shape.convStateElements()));
}

StatusOr<uint64_t> RecurrentStatePool::stateOffset(int32_t stateSlot, int32_t slot) const {
  HYBRID_RETURN_IF_ERROR(checkLayerAndSlot(stateSlot, slot));
  return static_cast<uint64_t>(slot) * slotElements_ + layers_[stateSlot].stateOffset;
}

StatusOr<uint64_t> RecurrentStatePool::convStateOffset(int32_t stateSlot, int32_t slot) const {
  HYBRID_RETURN_IF_ERROR(checkLayerAndSlot(stateSlot, slot));
  return static_cast<uint64_t>(slot) * slotElements_ + layers_[stateSlot].convOffset;
}

StatusOr<RecurrentStateSnapshot> RecurrentStatePool::snapshot(int32_t slot) const {
  return catchExceptions("recurrent state pool", [&]() -> StatusOr<RecurrentStateSnapshot> {
    HYBRID_RETURN_IF_ERROR(checkSlot(slot));
    const float *block = reinterpret_cast<const float *>(storage_.data()) +
                         static_cast<uint64_t>(slot) * slotElements_;
    RecurrentStateSnapshot snapshot;
    snapshot.values_.assign(block, block + slotElements_);
    return snapshot;
  });
}

Status RecurrentStatePool::restore(int32_t slot, const RecurrentStateSnapshot &snapshot) {
  HYBRID_RETURN_IF_ERROR(checkSlot(slot));
  if (snapshot.values_.size() != slotElements_)
    return Status::error("recurrent state pool: the snapshot holds " +
                         std::to_string(snapshot.values_.size()) + " floats, a slot of this pool " +
                         std::to_string(slotElements_));
  std::copy(snapshot.values_.begin(), snapshot.values_.end(), slotBlock(slot));
  return Status::ok();
}

} // namespace hybrid
