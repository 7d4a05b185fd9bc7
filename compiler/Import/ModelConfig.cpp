#include "compiler/Import/ModelConfig.h"

#include "compiler/Import/Checkpoint.h"

#include "llvm/ADT/StringExtras.h"

#include <cmath>
#include <set>

namespace hybrid::import {

namespace {

#include "compiler/Import/BuiltinMappings.inc" // kBuiltinMappings: {model_type, json text}

std::string render(const llvm::json::Value &value) {
  std::string text;
  llvm::raw_string_ostream os(text);
  os << value;
  return text;
}

bool sameValue(const llvm::json::Value &a, const llvm::json::Value &b) {
  std::optional<double> x = a.getAsNumber(), y = b.getAsNumber();
  if (x && y)
    return *x == *y;
  return a == b;
}

} // namespace

//===----------------------------------------------------------------------===//
// ArchitectureMapping
//===----------------------------------------------------------------------===//

StatusOr<ArchitectureMapping> ArchitectureMapping::parse(const llvm::json::Value &json,
                                                         std::string source) {
  ArchitectureMapping mapping;
  mapping.source = std::move(source);
  auto fail = [&](const std::string &message) {
    return Status::error(mapping.source + ": " + message);
  };
  const llvm::json::Object *root = json.getAsObject();
  if (!root)
    return fail("a mapping must be a JSON object");
  std::optional<llvm::StringRef> modelType = root->getString("model_type");
  if (!modelType)
    return fail("field 'model_type' missing or not a string");
  mapping.modelType = modelType->str();

  const llvm::json::Object *config = root->getObject("config");
  if (!config)
    return fail("field 'config' missing or not an object");
  for (const auto &[name, spec] : *config) {
    ConfigField field;
    const llvm::json::Array *paths = spec.getAsArray();
    if (const llvm::json::Object *object = spec.getAsObject()) {
      paths = object->getArray("paths");
      if (const llvm::json::Value *def = object->get("default")) {
        field.hasDefault = true;
        field.defaultValue = *def;
      }
    }
    if (!paths)
      return fail("config." + name.str() + ": expected a list of paths or {paths, default}");
    for (const llvm::json::Value &path : *paths) {
      std::optional<llvm::StringRef> text = path.getAsString();
      if (!text)
        return fail("config." + name.str() + ": paths must be strings");
      field.paths.push_back(text->str());
    }
    mapping.config[name.str()] = std::move(field);
  }

  const llvm::json::Object *layers = root->getObject("layers");
  if (!layers)
    return fail("field 'layers' missing or not an object");
  for (auto [key, rules] : {std::pair{"mixer", &mapping.mixerRules}, {"ffn", &mapping.ffnRules}}) {
    const llvm::json::Array *list = layers->getArray(key);
    if (!list)
      return fail(std::string("layers.") + key + " missing or not a list of rules");
    for (const llvm::json::Value &rule : *list) {
      if (!rule.getAsObject())
        return fail(std::string("layers.") + key + ": every rule must be an object");
      rules->push_back(*rule.getAsObject());
    }
  }

  const llvm::json::Object *tensors = root->getObject("tensors");
  if (!tensors)
    return fail("field 'tensors' missing or not an object");
  for (const auto &[group, roles] : *tensors) {
    const llvm::json::Object *roleMap = roles.getAsObject();
    if (!roleMap)
      return fail("tensors." + group.str() + " must be an object");
    for (const auto &[role, name] : *roleMap) {
      std::optional<llvm::StringRef> text = name.getAsString();
      if (!text)
        return fail("tensors." + group.str() + "." + role.str() + " must be a string");
      mapping.tensors[group.str()][role.str()] = text->str();
    }
  }
  if (std::optional<llvm::StringRef> suffix = root->getString("fp8_scale_suffix"))
    mapping.fp8ScaleSuffix = suffix->str();
  if (const llvm::json::Object *allowed = root->getObject("unreferenced_allowed")) {
    if (std::optional<llvm::StringRef> prefix = allowed->getString("layer_prefix"))
      mapping.extraLayerPrefix = prefix->str();
    if (std::optional<llvm::StringRef> setting = allowed->getString("extra_layers"))
      mapping.extraLayersSetting = setting->str();
    if (const llvm::json::Array *patterns = allowed->getArray("patterns"))
      for (const llvm::json::Value &pattern : *patterns)
        if (std::optional<llvm::StringRef> text = pattern.getAsString())
          mapping.unreferencedPatterns.push_back(text->str());
  }
  return mapping;
}

StatusOr<ArchitectureMapping> ArchitectureMapping::load(const std::string &path) {
  StatusOr<llvm::json::Value> json = readJsonFile(path);
  if (!json)
    return json.status();
  return parse(*json, path);
}

StatusOr<ArchitectureMapping> ArchitectureMapping::builtin(const std::string &modelType) {
  for (const auto &[type, text] : kBuiltinMappings) {
    if (modelType != type)
      continue;
    llvm::Expected<llvm::json::Value> json = llvm::json::parse(text);
    if (!json)
      return Status::error("built-in mapping " + modelType + ": " + llvm::toString(json.takeError()));
    return parse(*json, "built-in mapping " + modelType);
  }
  return Status::error("unknown model_type '" + modelType +
                       "' (supported: " + llvm::join(builtinModelTypes(), ", ") +
                       "; pass --mapping FILE for another layout)");
}

std::vector<std::string> ArchitectureMapping::builtinModelTypes() {
  std::vector<std::string> types;
  for (const auto &[type, text] : kBuiltinMappings)
    types.push_back(type);
  return types;
}

std::string ArchitectureMapping::tensorTemplate(const std::string &group,
                                                const std::string &role) const {
  auto groupIt = tensors.find(group);
  if (groupIt == tensors.end())
    return {};
  auto roleIt = groupIt->second.find(role);
  return roleIt == groupIt->second.end() ? std::string() : roleIt->second;
}

//===----------------------------------------------------------------------===//
// ModelConfig
//===----------------------------------------------------------------------===//

const llvm::json::Value *ModelConfig::lookup(const std::string &dottedPath) const {
  llvm::SmallVector<llvm::StringRef> parts;
  llvm::StringRef(dottedPath).split(parts, '.');
  const llvm::json::Object *object = &config_;
  const llvm::json::Value *value = nullptr;
  for (llvm::StringRef part : parts) {
    if (!object)
      return nullptr;
    value = object->get(part);
    if (!value || value->kind() == llvm::json::Value::Null)
      return nullptr;
    object = value->getAsObject();
  }
  return value;
}

std::string ModelConfig::describe(const std::string &name) const {
  auto it = mapping_.config.find(name);
  if (it == mapping_.config.end() || it->second.paths.empty())
    return name;
  std::string text = "'" + it->second.paths.front() + "'";
  for (size_t i = 1; i < it->second.paths.size(); ++i)
    text += " (or '" + it->second.paths[i] + "')";
  return text;
}

StatusOr<std::optional<llvm::json::Value>> ModelConfig::get(const std::string &name) const {
  auto it = mapping_.config.find(name);
  if (it == mapping_.config.end())
    return Status::error(mapping_.source + ": no config setting '" + name + "' in the mapping");
  const ConfigField &field = it->second;
  const llvm::json::Value *found = nullptr;
  std::string foundPath;
  for (const std::string &path : field.paths) {
    const llvm::json::Value *value = lookup(path);
    if (!value)
      continue;
    if (found && !sameValue(*found, *value))
      return error("fields '" + foundPath + "' (" + render(*found) + ") and '" + path + "' (" +
                   render(*value) + ") disagree");
    if (!found) {
      found = value;
      foundPath = path;
    }
  }
  if (found)
    return std::optional<llvm::json::Value>(*found);
  if (!field.hasDefault)
    return error("missing field " + describe(name));
  if (field.defaultValue.kind() == llvm::json::Value::Null)
    return std::optional<llvm::json::Value>();
  return std::optional<llvm::json::Value>(field.defaultValue);
}

StatusOr<std::optional<int64_t>> ModelConfig::getOptionalInt(const std::string &name) const {
  StatusOr<std::optional<llvm::json::Value>> value = get(name);
  if (!value)
    return value.status();
  if (!*value)
    return std::optional<int64_t>();
  std::optional<int64_t> number = (*value)->getAsInteger();
  if (!number) {
    // Some writers store integral settings as 2.0.
    std::optional<double> real = (*value)->getAsNumber();
    if (real && std::floor(*real) == *real && std::abs(*real) < 9e15)
      number = static_cast<int64_t>(*real);
  }
  if (!number)
    return error("field " + describe(name) + " must be an integer, got " + render(**value));
  return std::optional<int64_t>(*number);
}

StatusOr<int64_t> ModelConfig::getInt(const std::string &name) const {
  StatusOr<std::optional<int64_t>> value = getOptionalInt(name);
  if (!value)
    return value.status();
  if (!*value)
    return error("missing field " + describe(name));
  return **value;
}

StatusOr<std::optional<double>> ModelConfig::getOptionalDouble(const std::string &name) const {
  StatusOr<std::optional<llvm::json::Value>> value = get(name);
  if (!value)
    return value.status();
  if (!*value)
    return std::optional<double>();
  std::optional<double> number = (*value)->getAsNumber();
  if (!number)
    return error("field " + describe(name) + " must be a number, got " + render(**value));
  return std::optional<double>(*number);
}

StatusOr<double> ModelConfig::getDouble(const std::string &name) const {
  StatusOr<std::optional<double>> value = getOptionalDouble(name);
  if (!value)
    return value.status();
  if (!*value)
    return error("missing field " + describe(name));
  return **value;
}

StatusOr<bool> ModelConfig::getBool(const std::string &name) const {
  StatusOr<std::optional<llvm::json::Value>> value = get(name);
  if (!value)
    return value.status();
  std::optional<bool> flag = *value ? (*value)->getAsBoolean() : std::nullopt;
  if (!flag)
    return error("field " + describe(name) + " must be true or false");
  return *flag;
}

StatusOr<std::string> ModelConfig::getString(const std::string &name) const {
  StatusOr<std::optional<llvm::json::Value>> value = get(name);
  if (!value)
    return value.status();
  std::optional<llvm::StringRef> text = *value ? (*value)->getAsString() : std::nullopt;
  if (!text)
    return error("field " + describe(name) + " must be a string");
  return text->str();
}

StatusOr<std::optional<std::string>> ModelConfig::getOptionalString(const std::string &name) const {
  StatusOr<std::optional<llvm::json::Value>> value = get(name);
  if (!value)
    return value.status();
  if (!*value)
    return std::optional<std::string>();
  HYBRID_ASSIGN_OR_RETURN(std::string text, getString(name));
  return std::optional<std::string>(std::move(text));
}

StatusOr<std::vector<std::string>>
ModelConfig::layerKinds(const std::vector<llvm::json::Object> &rules, int64_t numLayers,
                        const std::string &what) const {
  std::optional<std::vector<std::string>> agreed;
  std::string agreedSource;
  std::vector<std::string> consulted;

  for (const llvm::json::Object &rule : rules) {
    std::vector<std::string> kinds(numLayers);
    std::string source;

    if (std::optional<llvm::StringRef> field = rule.getString("per_layer")) {
      consulted.push_back(field->str());
      const llvm::json::Value *list = lookup(field->str());
      if (!list)
        continue;
      source = "'" + field->str() + "'";
      const llvm::json::Array *array = list->getAsArray();
      if (!array)
        return error("field '" + field->str() + "' must be a list");
      if (static_cast<int64_t>(array->size()) != numLayers)
        return error("field '" + field->str() + "' lists " + std::to_string(array->size()) +
                     " layers but num_hidden_layers = " + std::to_string(numLayers));
      const llvm::json::Object *values = rule.getObject("values");
      for (int64_t i = 0; i < numLayers; ++i) {
        std::optional<llvm::StringRef> name = (*array)[i].getAsString();
        const llvm::json::Value *kind = name && values ? values->get(*name) : nullptr;
        if (!kind || !kind->getAsString()) {
          std::vector<std::string> known;
          if (values)
            for (const auto &entry : *values)
              known.push_back(entry.first.str());
          return error("field '" + field->str() + "'[" + std::to_string(i) + "] = " +
                       render((*array)[i]) + " is not a known " + what +
                       " kind (known: " + llvm::join(known, ", ") + ")");
        }
        kinds[i] = kind->getAsString()->str();
      }
    } else if (const llvm::json::Object *lists = rule.getObject("one_based_lists")) {
      std::vector<std::string> fields;
      for (const auto &entry : *lists)
        fields.push_back(entry.first.str());
      consulted.push_back(llvm::join(fields, "/"));
      bool any = false;
      for (const auto &[field, kind] : *lists) {
        const llvm::json::Value *list = lookup(field.str());
        if (!list)
          continue;
        any = true;
        const llvm::json::Array *array = list->getAsArray();
        if (!array)
          return error("field '" + field.str() + "' must be a list of 1-based layer numbers");
        for (const llvm::json::Value &entry : *array) {
          std::optional<int64_t> number = entry.getAsInteger();
          if (!number || *number < 1 || *number > numLayers)
            return error("field '" + field.str() + "' holds " + render(entry) +
                         ", not a layer number in 1.." + std::to_string(numLayers));
          std::string &slot = kinds[*number - 1];
          if (!slot.empty())
            return error("field '" + field.str() + "' lists layer " + std::to_string(*number) +
                         " which another list already assigned (" + slot + ")");
          slot = kind.getAsString() ? kind.getAsString()->str() : "";
        }
      }
      if (!any)
        continue;
      source = "'" + llvm::join(fields, "' / '") + "'";
      for (int64_t i = 0; i < numLayers; ++i)
        if (kinds[i].empty())
          return error("layer " + std::to_string(i + 1) + " (1-based) is in none of " + source);
    } else if (std::optional<llvm::StringRef> field = rule.getString("dense_prefix")) {
      consulted.push_back(field->str());
      const llvm::json::Value *first = lookup(field->str());
      if (!first)
        continue;
      std::optional<int64_t> firstDense = first->getAsInteger();
      if (!firstDense || *firstDense < 0)
        return error("field '" + field->str() + "' must be a non-negative integer");
      int64_t every = 1;
      std::string everyField = rule.getString("every").value_or("").str();
      if (const llvm::json::Value *value = everyField.empty() ? nullptr : lookup(everyField)) {
        std::optional<int64_t> number = value->getAsInteger();
        if (!number || *number < 1)
          return error("field '" + everyField + "' must be a positive integer");
        every = *number;
      }
      source = "'" + field->str() + "'";
      std::string dense = rule.getString("dense").value_or("").str();
      std::string sparse = rule.getString("sparse").value_or("").str();
      for (int64_t i = 0; i < numLayers; ++i)
        kinds[i] = (i >= *firstDense && i % every == 0) ? sparse : dense;
    } else if (std::optional<llvm::StringRef> kind = rule.getString("all")) {
      source = "the mapping's default";
      std::fill(kinds.begin(), kinds.end(), kind->str());
    } else {
      return Status::error(mapping_.source + ": unknown " + what + " rule " +
                           render(llvm::json::Value(llvm::json::Object(rule))));
    }

    if (!agreed) {
      agreed = std::move(kinds);
      agreedSource = source;
      continue;
    }
    for (int64_t i = 0; i < numLayers; ++i)
      if ((*agreed)[i] != kinds[i])
        return error(agreedSource + " and " + source + " disagree on the " + what + " of layer " +
                     std::to_string(i) + " (" + (*agreed)[i] + " vs " + kinds[i] + ")");
  }
  if (!agreed)
    return error("cannot tell the " + what + " kind of each layer: none of " +
                 llvm::join(consulted, ", ") + " is present");
  return *agreed;
}

} // namespace hybrid::import
