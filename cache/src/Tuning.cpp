#include "hybrid/cache/Tuning.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <sstream>

namespace hybrid::cache {

TuningConfig TunableKernel::defaults() const {
  TuningConfig config;
  for (const TunableParameter &parameter : parameters)
    config[parameter.name] = parameter.defaultValue;
  return config;
}

int64_t bucketSize(int64_t size) {
  int64_t bucket = 1;
  while (bucket < size && bucket < (int64_t{1} << 62))
    bucket *= 2;
  return bucket;
}

CandidateSet enumerateCandidates(const TunableKernel &kernel, const ShapeBucket &shape) {
  CandidateSet set;
  std::vector<size_t> choice(kernel.parameters.size(), 0);
  for (const TunableParameter &parameter : kernel.parameters)
    if (parameter.values.empty())
      return set; // no value to try: nothing to enumerate
  while (true) {
    TuningConfig config;
    for (size_t i = 0; i < choice.size(); ++i)
      config[kernel.parameters[i].name] = kernel.parameters[i].values[choice[i]];
    std::optional<std::string> reason =
        kernel.constraint ? kernel.constraint(config, shape) : std::nullopt;
    if (reason)
      set.rejected.emplace_back(std::move(config), std::move(*reason));
    else
      set.valid.push_back(std::move(config));
    // Next combination, the last parameter fastest.
    size_t i = choice.size();
    while (i > 0 && ++choice[i - 1] == kernel.parameters[i - 1].values.size())
      choice[--i] = 0;
    if (i == 0)
      return set;
  }
}

CacheKey tuningKey(const TunableKernel &kernel, const ShapeBucket &shape,
                   const TuningDevice &device, std::string *canonicalText) {
  KeyBuilder key;
  key.add("record", "kernel-tuning").add("kernel", kernel.name).add("revision", kernel.revision);
  // The space itself: a parameter added, removed or given other values re-tunes.
  for (const TunableParameter &parameter : kernel.parameters) {
    std::string values;
    for (int64_t value : parameter.values) {
      if (!values.empty())
        values += ',';
      values += std::to_string(value);
    }
    key.add("parameter." + parameter.name, values);
  }
  for (const auto &[dimension, size] : shape)
    key.add("shape." + dimension, size);
  key.add("gpu", device.gpu)
      .add("sm_count", device.smCount)
      .add("driver", device.driverVersion)
      .add("compiler", device.compiler);
  if (canonicalText)
    *canonicalText = key.canonicalText();
  return key.finish();
}

std::vector<std::byte> encodeTuningResult(const TuningResult &result) {
  std::ostringstream text;
  char number[64];
  auto real = [&](double value) {
    std::snprintf(number, sizeof number, "%.17g", value);
    return std::string(number);
  };
  text << "microseconds=" << real(result.microseconds) << "\n"
       << "default_microseconds=" << real(result.defaultMicroseconds) << "\n"
       << "candidates=" << result.candidates << "\n"
       << "tuning_seconds=" << real(result.tuningSeconds) << "\n";
  for (const auto &[name, value] : result.config)
    text << "param." << name << "=" << value << "\n";
  const std::string bytes = text.str();
  std::vector<std::byte> payload(bytes.size());
  std::memcpy(payload.data(), bytes.data(), bytes.size());
  return payload;
}

StatusOr<TuningResult> decodeTuningResult(std::span<const std::byte> payload,
                                          const TunableKernel &kernel) {
  const std::string text(reinterpret_cast<const char *>(payload.data()), payload.size());
  TuningResult result;
  std::istringstream lines(text);
  std::string line;
  bool seenTime = false;
  while (std::getline(lines, line)) {
    const size_t equals = line.find('=');
    if (equals == std::string::npos)
      return Status::error("tuning result: line '" + line + "' is not name=value");
    const std::string name = line.substr(0, equals), value = line.substr(equals + 1);
    if (name.rfind("param.", 0) == 0) {
      const std::string parameter = name.substr(6);
      const auto declared =
          std::find_if(kernel.parameters.begin(), kernel.parameters.end(),
                       [&](const TunableParameter &p) { return p.name == parameter; });
      if (declared == kernel.parameters.end())
        return Status::error("tuning result: parameter '" + parameter + "' is not one of " +
                             kernel.name + "'s");
      int64_t parsed = 0;
      const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), parsed);
      if (error != std::errc() || end != value.data() + value.size() ||
          std::find(declared->values.begin(), declared->values.end(), parsed) ==
              declared->values.end())
        return Status::error("tuning result: " + parameter + "=" + value +
                             " is not one of its values");
      result.config[parameter] = parsed;
      continue;
    }
    char *end = nullptr;
    const double number = std::strtod(value.c_str(), &end);
    if (value.empty() || *end != '\0')
      return Status::error("tuning result: " + name + "=" + value + " is not a number");
    if (name == "microseconds") {
      result.microseconds = number;
      seenTime = true;
    } else if (name == "default_microseconds") {
      result.defaultMicroseconds = number;
    } else if (name == "candidates") {
      result.candidates = static_cast<int32_t>(number);
    } else if (name == "tuning_seconds") {
      result.tuningSeconds = number;
    } else {
      return Status::error("tuning result: unknown field '" + name + "'");
    }
  }
  if (!seenTime)
    return Status::error("tuning result: no microseconds");
  for (const TunableParameter &parameter : kernel.parameters)
    if (!result.config.count(parameter.name))
      return Status::error("tuning result: no value for " + kernel.name + "'s parameter '" +
                           parameter.name + "'");
  return result;
}

Status storeTuning(CacheStore &store, const CacheKey &key, const TuningResult &result) {
  const std::vector<std::byte> payload = encodeTuningResult(result);
  return store.put(key, EntryKind::Tuning, payload);
}

StatusOr<std::optional<TuningResult>> lookupTuning(CacheStore &store, const CacheKey &key,
                                                   const TunableKernel &kernel,
                                                   std::string *whyRejected) {
  HYBRID_ASSIGN_OR_RETURN(std::optional<std::vector<std::byte>> payload,
                          store.get(key, EntryKind::Tuning, whyRejected));
  if (!payload)
    return std::optional<TuningResult>();
  StatusOr<TuningResult> decoded = decodeTuningResult(*payload, kernel);
  if (!decoded) {
    if (whyRejected)
      *whyRejected = store.pathFor(key) + ": " + decoded.status().message();
    HYBRID_RETURN_IF_ERROR(store.remove(key));
    return std::optional<TuningResult>();
  }
  return std::optional<TuningResult>(std::move(*decoded));
}

} // namespace hybrid::cache
