// DeviceTimeline.h over CUPTI's activity API: CUPTI hands over filled record buffers (from its
// own threads, or at the flush), which are decoded into DeviceActivity under a lock. libcupti is
// opened at the first start (dlopen), not linked: the binaries run where it is missing, and only
// --timeline then says so.
#include "hybrid/kernels/cuda/DeviceTimeline.h"

#ifdef HYBRID_CUPTI
#include <cstdlib>
#include <cuda_runtime.h>
#include <cupti.h>
#include <cxxabi.h>
#include <dlfcn.h>
#include <memory>
#include <mutex>
#include <type_traits>
#endif

namespace hybrid::kernels::cuda {

#ifndef HYBRID_CUPTI

bool deviceTimelineBuilt() { return false; }
std::string startDeviceTimeline() {
  return "this build has no CUPTI (the CUDA toolkit's cupti.h was not found at configure time)";
}
std::string stopDeviceTimeline(std::vector<DeviceActivity> &) { return startDeviceTimeline(); }

#else

namespace {

constexpr size_t kBufferBytes = 8u << 20;
constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                         CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET};

std::mutex recordsMutex;
std::vector<DeviceActivity> records; // decoded since the start
bool callbacksRegistered = false;

// The CUPTI entry points used here, from the library opened at run time.
struct Cupti {
  decltype(&cuptiActivityRegisterCallbacks) registerCallbacks = nullptr;
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityFlushAll) flushAll = nullptr;
  decltype(&cuptiActivityGetNextRecord) nextRecord = nullptr;
  decltype(&cuptiGetResultString) resultString = nullptr;
};
Cupti cupti;

// "" once the entry points are resolved, else why not.
std::string openCupti() {
  if (cupti.nextRecord)
    return "";
  void *library = nullptr;
  for (const char *name : {"libcupti.so.13", "libcupti.so", "/usr/local/cuda/lib64/libcupti.so.13",
                           "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so.13"})
    if ((library = dlopen(name, RTLD_NOW | RTLD_LOCAL)))
      break;
  if (!library)
    return "cannot open libcupti.so.13 (the CUDA toolkit's CUPTI): put its folder on "
           "LD_LIBRARY_PATH";
  Cupti found;
  bool complete = true;
  auto resolve = [&](auto &entry, const char *symbol) {
    entry = reinterpret_cast<std::remove_reference_t<decltype(entry)>>(dlsym(library, symbol));
    complete = complete && entry;
  };
  resolve(found.registerCallbacks, "cuptiActivityRegisterCallbacks");
  resolve(found.enable, "cuptiActivityEnable");
  resolve(found.disable, "cuptiActivityDisable");
  resolve(found.flushAll, "cuptiActivityFlushAll");
  resolve(found.nextRecord, "cuptiActivityGetNextRecord");
  resolve(found.resultString, "cuptiGetResultString");
  if (!complete)
    return "libcupti lacks an activity API entry point";
  cupti = found;
  return "";
}

std::string cuptiError(const char *call, CUptiResult result) {
  const char *text = nullptr;
  cupti.resultString(result, &text);
  return std::string(call) + ": " + (text ? text : "CUPTI error " + std::to_string(result));
}

std::string demangled(const char *name) {
  if (!name)
    return "?";
  int status = 0;
  std::unique_ptr<char, void (*)(void *)> readable(
      abi::__cxa_demangle(name, nullptr, nullptr, &status), std::free);
  return status == 0 && readable ? std::string(readable.get()) : std::string(name);
}

const char *copyDirection(uint8_t kind) {
  switch (kind) {
  case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
    return "copy host to device";
  case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
    return "copy device to host";
  case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
    return "copy device to device";
  default:
    return "copy";
  }
}

void CUPTIAPI bufferRequested(uint8_t **buffer, size_t *size, size_t *maxRecords) {
  *buffer = static_cast<uint8_t *>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *maxRecords = 0; // as many as fit
}

void CUPTIAPI bufferCompleted(CUcontext, uint32_t, uint8_t *buffer, size_t, size_t validBytes) {
  std::vector<DeviceActivity> decoded;
  CUpti_Activity *record = nullptr;
  while (cupti.nextRecord(buffer, validBytes, &record) == CUPTI_SUCCESS) {
    DeviceActivity a;
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL ||
        record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto *kernel = reinterpret_cast<const CUpti_ActivityKernel10 *>(record);
      a = {DeviceActivity::Kind::Kernel, demangled(kernel->name), kernel->streamId, kernel->start,
           kernel->end};
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto *copy = reinterpret_cast<const CUpti_ActivityMemcpy6 *>(record);
      a = {DeviceActivity::Kind::Copy, copyDirection(copy->copyKind), copy->streamId, copy->start,
           copy->end};
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto *set = reinterpret_cast<const CUpti_ActivityMemset4 *>(record);
      a = {DeviceActivity::Kind::Memset, "memset", set->streamId, set->start, set->end};
    } else {
      continue;
    }
    decoded.push_back(std::move(a));
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(recordsMutex);
  records.insert(records.end(), std::make_move_iterator(decoded.begin()),
                 std::make_move_iterator(decoded.end()));
}

} // namespace

bool deviceTimelineBuilt() { return true; }

std::string startDeviceTimeline() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    return "no CUDA device";
  if (std::string error = openCupti(); !error.empty())
    return error;
  if (!callbacksRegistered) {
    if (CUptiResult r = cupti.registerCallbacks(bufferRequested, bufferCompleted);
        r != CUPTI_SUCCESS)
      return cuptiError("cuptiActivityRegisterCallbacks", r);
    callbacksRegistered = true;
  }
  {
    std::lock_guard<std::mutex> lock(recordsMutex);
    records.clear();
  }
  for (CUpti_ActivityKind kind : kKinds)
    if (CUptiResult r = cupti.enable(kind); r != CUPTI_SUCCESS)
      return cuptiError("cuptiActivityEnable", r);
  return "";
}

std::string stopDeviceTimeline(std::vector<DeviceActivity> &activities) {
  if (std::string error = openCupti(); !error.empty())
    return error;
  const cudaError_t synced = cudaDeviceSynchronize();
  std::string error;
  if (CUptiResult r = cupti.flushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED); r != CUPTI_SUCCESS)
    error = cuptiError("cuptiActivityFlushAll", r);
  for (CUpti_ActivityKind kind : kKinds)
    if (CUptiResult r = cupti.disable(kind); r != CUPTI_SUCCESS && error.empty())
      error = cuptiError("cuptiActivityDisable", r);
  if (synced != cudaSuccess && error.empty())
    error = std::string("cudaDeviceSynchronize: ") + cudaGetErrorString(synced);
  std::lock_guard<std::mutex> lock(recordsMutex);
  activities.insert(activities.end(), std::make_move_iterator(records.begin()),
                    std::make_move_iterator(records.end()));
  records.clear();
  return error;
}

#endif

} // namespace hybrid::kernels::cuda
