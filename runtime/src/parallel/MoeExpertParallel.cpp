#include "hybrid/runtime/ContextParallel.h"

#include <algorithm>
#include <numeric>

namespace hybrid::parallel {

namespace ref = kernels::ref;

Status checkExpertsOfContextRank(int64_t numExperts, int rank, int world,
                                 const std::function<bool(int64_t)> &held) {
  if (world < 1 || numExperts % world != 0)
    return Status::error("all_to_all: " + std::to_string(numExperts) +
                         " experts do not split over the " + std::to_string(world) +
                         " context ranks");
  const int64_t perRank = numExperts / world;
  for (int64_t e = 0; e < numExperts; ++e) {
    const bool mine = e / perRank == rank;
    if (mine != held(e))
      return Status::error("all_to_all: context rank " + std::to_string(rank) + " of " +
                           std::to_string(world) + " holds experts [" +
                           std::to_string(rank * perRank) + ", " +
                           std::to_string((rank + 1) * perRank) + "), but expert " +
                           std::to_string(e) + "'s weights are " +
                           (mine ? "absent" : "present") + " in the dispatch");
  }
  return Status::ok();
}

Status moeExpertParallel(comm::Communicator &communicator, const ExpertParallelShard &s) {
  const int world = communicator.worldSize(), rank = communicator.rank();
  auto fail = [&](const std::string &why) {
    return Status::error("MoE expert parallel: rank " + std::to_string(rank) + ": " + why);
  };
  if (s.hidden <= 0 || s.topK <= 0 || s.tokens < 0 || s.numExperts <= 0)
    return fail("bad shape (" + std::to_string(s.tokens) + " tokens, hidden " +
                std::to_string(s.hidden) + ", top-k " + std::to_string(s.topK) + ", " +
                std::to_string(s.numExperts) + " experts)");
  if (s.numExperts % world != 0)
    return fail(std::to_string(s.numExperts) + " experts do not split evenly over " +
                std::to_string(world) + " ranks");
  const int64_t perRank = s.numExperts / world, H = s.hidden;
  if (int64_t(s.localExperts.size()) != perRank)
    return fail("holds " + std::to_string(s.localExperts.size()) + " experts, not " +
                std::to_string(perRank));
  if (s.tokens > 0 && (!s.x || !s.expertIds || !s.expertWeights || !s.out))
    return fail("missing buffers");
  for (int64_t i = 0; i < s.tokens * s.topK; ++i)
    if (s.expertIds[i] < -1 || s.expertIds[i] >= s.numExperts) // -1: no choice
      return fail("token " + std::to_string(i / s.topK) + " chose expert " +
                  std::to_string(s.expertIds[i]) + " of " + std::to_string(s.numExperts));

  // Rows to each destination: the (token, choice) pairs whose expert it holds, in (t, k) order.
  std::vector<std::vector<int64_t>> outgoing(static_cast<size_t>(world));
  for (int64_t i = 0; i < s.tokens * s.topK; ++i)
    if (s.expertIds[i] >= 0)
      outgoing[size_t(s.expertIds[i] / perRank)].push_back(i);
  // Everyone's counts (an N x N matrix, row = source), then the padded exchange.
  std::vector<float> mine(static_cast<size_t>(world)), counts(size_t(world) * size_t(world));
  for (int d = 0; d < world; ++d)
    mine[size_t(d)] = float(outgoing[size_t(d)].size());
  HYBRID_RETURN_IF_ERROR(communicator.allGather(mine.data(), counts.data(), mine.size()));
  const int64_t slots = int64_t(*std::max_element(counts.begin(), counts.end()));
  const int64_t width = H + 1; // [expert id, x row]
  std::vector<float> sent(size_t(world) * size_t(slots) * size_t(width), -1.0f),
      received(sent.size());
  for (int d = 0; d < world; ++d)
    for (size_t j = 0; j < outgoing[size_t(d)].size(); ++j) {
      const int64_t i = outgoing[size_t(d)][j];
      float *row = sent.data() + (size_t(d) * size_t(slots) + j) * size_t(width);
      row[0] = float(s.expertIds[i]);
      std::copy_n(s.x + (i / s.topK) * H, H, row + 1);
    }
  if (slots > 0)
    HYBRID_RETURN_IF_ERROR(
        communicator.allToAll(sent.data(), received.data(), size_t(slots * width)));

  // The experts held here, each on every row sent to it (rows are independent, so grouping them
  // changes no bits), results in the slots the rows came in.
  std::vector<float> results(size_t(world) * size_t(slots) * size_t(H), 0.0f),
      returned(results.size());
  std::vector<float> gathered, output;
  std::vector<size_t> rows;
  for (int64_t local = 0; local < perRank; ++local) {
    const int64_t expert = rank * perRank + local;
    rows.clear();
    for (int src = 0; src < world; ++src)
      for (int64_t j = 0; j < int64_t(counts[size_t(src) * size_t(world) + size_t(rank)]); ++j) {
        const size_t slot = size_t(src) * size_t(slots) + size_t(j);
        if (int64_t(received[slot * size_t(width)]) == expert)
          rows.push_back(slot);
      }
    if (rows.empty())
      continue;
    gathered.resize(rows.size() * size_t(H));
    output.resize(gathered.size());
    for (size_t r = 0; r < rows.size(); ++r)
      std::copy_n(received.data() + rows[r] * size_t(width) + 1, H, gathered.data() + r * size_t(H));
    ref::swiGluMlp(gathered, int64_t(rows.size()), s.localExperts[size_t(local)], output);
    for (size_t r = 0; r < rows.size(); ++r)
      std::copy_n(output.data() + r * size_t(H), H, results.data() + rows[r] * size_t(H));
  }
  if (slots > 0)
    HYBRID_RETURN_IF_ERROR(communicator.allToAll(results.data(), returned.data(), size_t(slots * H)));

  // Where each (token, choice)'s result came back, then the weighted sum per token in ascending
  // expert order (ties: the choice order), as ref::moeExperts adds them.
  std::vector<const float *> resultOf(size_t(s.tokens * s.topK), nullptr);
  for (int d = 0; d < world; ++d)
    for (size_t j = 0; j < outgoing[size_t(d)].size(); ++j)
      resultOf[size_t(outgoing[size_t(d)][j])] =
          returned.data() + (size_t(d) * size_t(slots) + j) * size_t(H);
  std::fill(s.out, s.out + s.tokens * H, 0.0f);
  std::vector<int64_t> order(static_cast<size_t>(s.topK));
  for (int64_t t = 0; t < s.tokens; ++t) {
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return s.expertIds[t * s.topK + a] < s.expertIds[t * s.topK + b];
    });
    for (int64_t k : order) {
      const int64_t i = t * s.topK + k;
      if (!resultOf[size_t(i)])
        continue;
      for (int64_t d = 0; d < H; ++d)
        s.out[t * H + d] += s.expertWeights[i] * resultOf[size_t(i)][d];
    }
  }
  return Status::ok();
}

} // namespace hybrid::parallel
