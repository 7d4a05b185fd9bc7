// hybrid-bench tune (docs/autotune.md): kernel configurations searched per shape bucket on this
// GPU and stored in the compilation cache, where the cuda device looks them up.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

struct TuneCommandOptions {
  std::vector<std::string> presets;   // presetRequests names
  std::vector<std::string> shapes;    // "KERNEL:dim=value,..."
  std::string cacheDir;               // empty: cache::defaultCacheDir()
  double budgetSeconds = 600;
  int32_t iterations = 20;
  double minGain = 0.02;
  bool retune = false;
  bool dryRun = false; // list the candidates and stored results, measure nothing
};

void addTuneOptions(CLI::App *tune, TuneCommandOptions &options);
int runTune(const TuneCommandOptions &options);
