#include "server/meta/planner.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace ckpt::meta {
namespace {

absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Cuts n positions into floor(n / w) groups of consecutive positions, as evenly
// as possible (the first n mod G groups get one extra member). Requires n >= w.
std::vector<PlacementGroup> CutEvenly(int n, int w) {
  const int count = n / w;
  const int base = n / count;
  const int extra = n % count;
  std::vector<PlacementGroup> groups(count);
  int first = 0;
  for (int j = 0; j < count; ++j) {
    groups[j].index = j;
    groups[j].first = first;
    groups[j].size = base + (j < extra ? 1 : 0);
    first += groups[j].size;
  }
  return groups;
}

// True if the failed members of one cyclic group of `g` members, given as
// ascending positions `failed` (all within [base, base + g) for some base),
// leave some window of `w` cyclically consecutive members with more than `t`
// failures, i.e. some t+1 failures lie within a span of w members.
bool CycleLoses(std::span<const int> failed, int g, int w, int t) {
  const int c = static_cast<int>(failed.size());
  if (c <= t) return false;
  if (g == w) return true;  // the window is the whole group
  for (int a = 0; a < c; ++a) {
    const int b = a + t;  // the (t+1)-th failure counting from failure a
    const int pb = b < c ? failed[b] : failed[b - c] + g;
    if (pb - failed[a] < w) return true;
  }
  return false;
}

// True if every node's data survives the failure of the ascending positions
// `failed` under `plan` (policy replicate or ec).
bool Survives(const PlacementPlan& plan, std::span<const int> failed) {
  const std::vector<PlacementGroup>& groups = plan.groups();
  size_t i = 0;
  while (i < failed.size()) {
    const PlacementGroup& group = groups[plan.GroupIndex(failed[i])];
    const int end = group.first + group.size;
    size_t j = i + 1;
    while (j < failed.size() && failed[j] < end) ++j;
    if (CycleLoses(failed.subspan(i, j - i), group.size, plan.window(), plan.tolerance())) {
      return false;
    }
    i = j;
  }
  return true;
}

// Advances `idx` (an ascending k-subset of [0, n)) to the next subset in
// lexicographic order; false after the last one.
bool NextCombination(std::vector<int>& idx, int n) {
  const int k = static_cast<int>(idx.size());
  int i = k - 1;
  while (i >= 0 && idx[i] == n - k + i) --i;
  if (i < 0) return false;
  ++idx[i];
  for (int j = i + 1; j < k; ++j) idx[j] = idx[j - 1] + 1;
  return true;
}

// C(n, k), saturated at UINT64_MAX.
uint64_t BinomialSaturated(int n, int k) {
  if (k < 0 || k > n) return 0;
  k = std::min(k, n - k);
  unsigned __int128 c = 1;
  for (int i = 1; i <= k; ++i) {
    c = c * static_cast<unsigned>(n - k + i) / static_cast<unsigned>(i);  // exact: C(n-k+i, i)
    if (c > std::numeric_limits<uint64_t>::max()) return std::numeric_limits<uint64_t>::max();
  }
  return static_cast<uint64_t>(c);
}

uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  return a > std::numeric_limits<uint64_t>::max() - b ? std::numeric_limits<uint64_t>::max()
                                                      : a + b;
}

uint64_t SaturatingMul(uint64_t a, uint64_t b) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) {
    return std::numeric_limits<uint64_t>::max();
  }
  return a * b;
}

// log(i!) for i in [0, n]. Summed rather than std::lgamma, which writes the
// global `signgam` and so is not thread-safe.
std::vector<double> LogFactorials(int n) {
  std::vector<double> lf(n + 1, 0.0);
  for (int i = 2; i <= n; ++i) lf[i] = lf[i - 1] + std::log(static_cast<double>(i));
  return lf;
}

// P(Binomial(g, p) = a) for 0 < p < 1.
double BinomialPmf(const std::vector<double>& lf, int g, int a, double p) {
  return std::exp(lf[g] - lf[a] - lf[g - a] + a * std::log(p) + (g - a) * std::log1p(-p));
}

// Sum, by number of failures j in [0, jmax], of x^j * y^(g-j) over the failure
// patterns of a cycle of g positions with no w cyclically consecutive
// failures (g >= w >= 1). With x = y = 1 these are counts.
//
// A pattern with at least one survivor is split at its first survivor, at
// index a: a leading run of a failures (a < w), the survivor, then a suffix of
// g-1-a positions with no internal run of w failures whose trailing run b
// joins the leading run across the wrap, so a + b < w. The all-failed pattern
// has a run of g >= w and is never counted. One pass over the suffix lengths
// serves every a. Work: g * (jmax+1) * w cell updates.
std::vector<double> CycleNoRunWeights(int g, int w, int jmax, double x, double y) {
  std::vector<double> out(jmax + 1, 0.0);
  // cur[j * w + r]: weight of suffixes of the current length with j failures
  // ending in a run of r failures.
  std::vector<double> cur((jmax + 1) * w, 0.0);
  std::vector<double> next(cur.size(), 0.0);
  cur[0] = 1.0;
  auto take_snapshot = [&](int len) {
    const int a = g - 1 - len;  // leading failures for this suffix length
    if (a < 0 || a >= w || a > jmax) return;
    const double prefix = std::pow(x, a) * y;
    for (int j = 0; j + a <= jmax && j <= len; ++j) {
      double sum = 0.0;
      for (int r = 0; r + a < w; ++r) sum += cur[j * w + r];
      out[j + a] += prefix * sum;
    }
  };
  take_snapshot(0);
  for (int len = 1; len <= g - 1; ++len) {
    const int jtop = std::min(jmax, len);
    std::fill(next.begin(), next.begin() + (jtop + 1) * w, 0.0);
    for (int j = 0; j <= std::min(jmax, len - 1); ++j) {
      double survivor = 0.0;
      for (int r = 0; r < w; ++r) {
        const double v = cur[j * w + r];
        if (v == 0.0) continue;
        survivor += v;
        if (r + 1 < w && j + 1 <= jmax) next[(j + 1) * w + r + 1] += v * x;
      }
      next[j * w] += survivor * y;
    }
    std::swap(cur, next);
    take_snapshot(len);
  }
  return out;
}

// Highest number of failures a group of g members with windows of w and
// tolerance t can survive: each member lies in exactly w of the g windows, so
// a * w <= g * t.
int MaxSurvivableInGroup(int g, int w, int t) {
  return g == w ? t : static_cast<int>(static_cast<int64_t>(g) * t / w);
}

// Number of a-subsets of a group of g members that survive, for a in [0, amax]
// (ec windows: w = k+m, t = m). Visits every a-subset with t < a <= limit.
std::vector<double> GroupSurvivorCounts(int g, int w, int t, int amax) {
  std::vector<double> counts(amax + 1, 0.0);
  const int top = std::min(amax, MaxSurvivableInGroup(g, w, t));
  for (int a = 0; a <= top; ++a) {
    if (a <= t) {
      counts[a] = static_cast<double>(BinomialSaturated(g, a));
      continue;
    }
    std::vector<int> idx(a);
    std::iota(idx.begin(), idx.end(), 0);
    uint64_t ok = 0;
    do {
      if (!CycleLoses(idx, g, w, t)) ++ok;
    } while (NextCombination(idx, g));
    counts[a] = static_cast<double>(ok);
    if (ok == 0) break;  // more failures cannot help
  }
  return counts;
}

// The distinct group sizes of `plan` with how many groups have each.
std::vector<std::pair<int, int>> GroupSizeCounts(const PlacementPlan& plan) {
  std::vector<std::pair<int, int>> sizes;
  for (const PlacementGroup& g : plan.groups()) {
    auto it = std::find_if(sizes.begin(), sizes.end(),
                           [&](const auto& s) { return s.first == g.size; });
    if (it == sizes.end()) {
      sizes.emplace_back(g.size, 1);
    } else {
      ++it->second;
    }
  }
  return sizes;
}

// Work units the structured computation would spend (saturated).
uint64_t StructuredWork(const PlacementPlan& plan, int f) {
  const bool replicate = plan.policy().kind == ProtectionPolicy::Kind::kReplicate;
  const int w = plan.window();
  const int t = plan.tolerance();
  uint64_t work = 0;
  int largest = 0;
  for (const auto& [g, count] : GroupSizeCounts(plan)) {
    largest = std::max(largest, g);
    const int amax = std::min(f, g);
    if (replicate) {
      work = SaturatingAdd(work, SaturatingMul(static_cast<uint64_t>(g) * (amax + 1), w));
    } else if (g > w) {
      const int top = std::min(amax, MaxSurvivableInGroup(g, w, t));
      for (int a = t + 1; a <= top; ++a) work = SaturatingAdd(work, BinomialSaturated(g, a));
    }
  }
  if (plan.groups().size() > 1) {
    const uint64_t per_group = static_cast<uint64_t>(f + 1) * (std::min(f, largest) + 1);
    work = SaturatingAdd(work, SaturatingMul(plan.groups().size(), per_group));
  }
  return std::max<uint64_t>(work, 1);
}

// Exact up to rounding; 0 < f < n. Failures are modelled as i.i.d.
// Bernoulli(p = f/n) per node, which conditioned on exactly f failures is the
// uniform f-subset; per-group weights P(a failures in the group, group
// survives) are convolved across groups and the weight of exactly f failures
// is divided by P(Binomial(n, p) = f). p = f/n keeps that divisor large, so
// nothing that matters underflows.
double StructuredSurvival(const PlacementPlan& plan, int f) {
  const int n = plan.size();
  const int w = plan.window();
  const int t = plan.tolerance();
  const double p = static_cast<double>(f) / n;
  const std::vector<double> lf = LogFactorials(n);
  const bool replicate = plan.policy().kind == ProtectionPolicy::Kind::kReplicate;

  std::vector<std::pair<int, std::vector<double>>> weights;  // group size -> by a
  for (const auto& [g, count] : GroupSizeCounts(plan)) {
    const int amax = std::min(f, g);
    std::vector<double> wg;
    if (replicate) {
      wg = CycleNoRunWeights(g, w, amax, p, 1.0 - p);
    } else {
      const std::vector<double> counts = GroupSurvivorCounts(g, w, t, amax);
      wg.assign(amax + 1, 0.0);
      for (int a = 0; a <= amax; ++a) {
        if (counts[a] == 0.0) continue;
        const double fraction = counts[a] / static_cast<double>(BinomialSaturated(g, a));
        wg[a] = fraction * BinomialPmf(lf, g, a, p);
      }
    }
    weights.emplace_back(g, std::move(wg));
  }
  auto weights_for = [&](int g) -> const std::vector<double>& {
    for (const auto& [size, wg] : weights) {
      if (size == g) return wg;
    }
    assert(false);
    return weights.front().second;
  };

  std::vector<double> q;
  if (plan.groups().size() == 1) {
    q = weights.front().second;
    q.resize(f + 1, 0.0);
  } else {
    q.assign(f + 1, 0.0);
    q[0] = 1.0;
    std::vector<double> nq(f + 1, 0.0);
    int seen = 0;  // members of the groups folded in so far
    for (const PlacementGroup& group : plan.groups()) {
      const std::vector<double>& wg = weights_for(group.size);
      const int jtop = std::min(f, seen + group.size);
      std::fill(nq.begin(), nq.begin() + jtop + 1, 0.0);
      for (int j = 0; j <= std::min(f, seen); ++j) {
        const double v = q[j];
        if (v == 0.0) continue;
        const int atop = std::min<int>(static_cast<int>(wg.size()) - 1, f - j);
        for (int a = 0; a <= atop; ++a) nq[j + a] += v * wg[a];
      }
      std::swap(q, nq);
      seen += group.size;
    }
  }
  const double probability = q[f] / BinomialPmf(lf, n, f, p);
  return std::clamp(probability, 0.0, 1.0);
}

// Uniform integer in [0, bound) from `rng`, bound >= 1 (Lemire's method with
// rejection): unbiased and the same on every platform, unlike
// std::uniform_int_distribution.
uint64_t UniformBelow(std::mt19937_64& rng, uint64_t bound) {
  unsigned __int128 product = static_cast<unsigned __int128>(rng()) * bound;
  uint64_t low = static_cast<uint64_t>(product);
  if (low < bound) {
    const uint64_t threshold = (0 - bound) % bound;
    while (low < threshold) {
      product = static_cast<unsigned __int128>(rng()) * bound;
      low = static_cast<uint64_t>(product);
    }
  }
  return static_cast<uint64_t>(product >> 64);
}

}  // namespace

// ---------------------------------------------------------------------------
// PlacementPlan
// ---------------------------------------------------------------------------

std::optional<int> PlacementPlan::PositionOf(std::string_view node_id) const {
  auto it = std::lower_bound(by_id_.begin(), by_id_.end(), node_id,
                             [&](int position, std::string_view id) {
                               return std::string_view(nodes_[position].id) < id;
                             });
  if (it == by_id_.end() || nodes_[*it].id != node_id) return std::nullopt;
  return *it;
}

std::span<const int> PlacementPlan::Protectors(int position) const {
  assert(position >= 0 && position < size());
  if (protectors_.empty()) return {};
  const size_t per_node = static_cast<size_t>(policy_.copies - 1);
  return std::span<const int>(protectors_).subspan(position * per_node, per_node);
}

std::vector<int> PlacementPlan::ReplicaSources(int position) const {
  assert(position >= 0 && position < size());
  std::vector<int> sources;
  if (protectors_.empty()) return sources;
  const PlacementGroup& group = groups_[group_of_[position]];
  const int member = position - group.first;
  for (int d = 1; d < policy_.copies; ++d) {
    sources.push_back(group.first + (member - d + group.size) % group.size);
  }
  return sources;
}

absl::StatusOr<std::vector<std::string>> PlacementPlan::ProtectorsOf(
    std::string_view node_id) const {
  const std::optional<int> position = PositionOf(node_id);
  if (!position) {
    return absl::NotFoundError(absl::StrCat("node \"", AV(node_id), "\" is not in the plan"));
  }
  std::vector<std::string> ids;
  for (int p : Protectors(*position)) ids.push_back(nodes_[p].id);
  return ids;
}

int PlacementPlan::GroupIndex(int position) const {
  assert(position >= 0 && position < size());
  return group_of_.empty() ? -1 : group_of_[position];
}

absl::StatusOr<PlacementGroup> PlacementPlan::GroupOf(std::string_view node_id) const {
  const std::optional<int> position = PositionOf(node_id);
  if (!position) {
    return absl::NotFoundError(absl::StrCat("node \"", AV(node_id), "\" is not in the plan"));
  }
  if (groups_.empty()) {
    return absl::NotFoundError(absl::StrCat("a plan for ", policy_.ToString(), " has no groups"));
  }
  return groups_[group_of_[*position]];
}

const StripeLayout& PlacementPlan::Layout(const PlacementGroup& group) const {
  assert(group.layout >= 0 && group.layout < static_cast<int>(layouts_.size()));
  return layouts_[group.layout];
}

absl::StatusOr<PlacementPlan> PlanPlacement(std::span<const PlannerNode> alive_nodes,
                                            const ProtectionPolicy& policy) {
  CKPT_RETURN_IF_ERROR(policy.Validate());
  if (alive_nodes.size() > static_cast<size_t>(std::numeric_limits<int>::max() / 16)) {
    return absl::InvalidArgumentError(
        absl::StrCat("too many nodes to plan: ", alive_nodes.size()));
  }
  const int n = static_cast<int>(alive_nodes.size());

  // Input indices sorted by id: finds duplicates, and (stable-sorted by domain
  // next) gives each domain's nodes in id order.
  std::vector<int> by_id(n);
  std::iota(by_id.begin(), by_id.end(), 0);
  std::sort(by_id.begin(), by_id.end(),
            [&](int a, int b) { return alive_nodes[a].id < alive_nodes[b].id; });
  for (int i = 0; i < n; ++i) {
    const std::string& id = alive_nodes[by_id[i]].id;
    if (id.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "node at index ", by_id[i], " of the alive node list has an empty id"));
    }
    if (i > 0 && id == alive_nodes[by_id[i - 1]].id) {
      return absl::InvalidArgumentError(absl::StrCat(
          "duplicate node id \"", id, "\" in the alive node list; node ids must be unique"));
    }
  }
  if (n < policy.MinNodes()) {
    return absl::FailedPreconditionError(absl::StrCat(
        policy.ToString(), " needs at least ", policy.MinNodes(), " alive nodes; ", n,
        " present"));
  }

  // Plan order: domains in name order, interleaved round-robin.
  std::vector<int> by_domain = by_id;
  std::stable_sort(by_domain.begin(), by_domain.end(), [&](int a, int b) {
    return alive_nodes[a].failure_domain < alive_nodes[b].failure_domain;
  });
  struct Run {
    int next;
    int end;
  };
  std::vector<Run> active;
  for (int i = 0; i < n;) {
    int j = i + 1;
    while (j < n &&
           alive_nodes[by_domain[j]].failure_domain == alive_nodes[by_domain[i]].failure_domain) {
      ++j;
    }
    active.push_back(Run{i, j});
    i = j;
  }
  PlacementPlan plan;
  plan.policy_ = policy;
  plan.nodes_.reserve(n);
  std::vector<int> position_of_input(n);
  while (!active.empty()) {
    size_t keep = 0;
    for (size_t r = 0; r < active.size(); ++r) {
      Run run = active[r];
      const int input = by_domain[run.next++];
      position_of_input[input] = static_cast<int>(plan.nodes_.size());
      plan.nodes_.push_back(alive_nodes[input]);
      if (run.next < run.end) active[keep++] = run;
    }
    active.resize(keep);
  }
  plan.by_id_.resize(n);
  for (int i = 0; i < n; ++i) plan.by_id_[i] = position_of_input[by_id[i]];

  switch (policy.kind) {
    case ProtectionPolicy::Kind::kNone:
      return plan;
    case ProtectionPolicy::Kind::kReplicate:
      plan.window_ = policy.copies;
      plan.tolerance_ = policy.copies - 1;
      if (policy.placement == ProtectionPolicy::Placement::kRing) {
        plan.groups_.push_back(PlacementGroup{0, 0, n, -1});
      } else {
        plan.groups_ = CutEvenly(n, plan.window_);
      }
      break;
    case ProtectionPolicy::Kind::kErasureCode:
      plan.window_ = policy.data_k + policy.parity_m;
      plan.tolerance_ = policy.parity_m;
      plan.groups_ = CutEvenly(n, plan.window_);
      for (PlacementGroup& group : plan.groups_) {
        auto it = std::find_if(plan.layouts_.begin(), plan.layouts_.end(),
                               [&](const StripeLayout& l) { return l.group_size() == group.size; });
        if (it == plan.layouts_.end()) {
          CKPT_ASSIGN_OR_RETURN(StripeLayout layout,
                                StripeLayout::Create(group.size, policy.data_k, policy.parity_m));
          plan.layouts_.push_back(std::move(layout));
          it = plan.layouts_.end() - 1;
        }
        group.layout = static_cast<int>(it - plan.layouts_.begin());
      }
      break;
  }

  plan.group_of_.resize(n);
  for (const PlacementGroup& group : plan.groups_) {
    std::fill_n(plan.group_of_.begin() + group.first, group.size, group.index);
  }
  if (policy.kind == ProtectionPolicy::Kind::kReplicate) {
    const int per_node = policy.copies - 1;
    plan.protectors_.resize(static_cast<size_t>(n) * per_node);
    for (const PlacementGroup& group : plan.groups_) {
      for (int j = 0; j < group.size; ++j) {
        int* out = &plan.protectors_[static_cast<size_t>(group.first + j) * per_node];
        for (int d = 1; d <= per_node; ++d) out[d - 1] = group.first + (j + d) % group.size;
      }
    }
  }
  return plan;
}

// ---------------------------------------------------------------------------
// Survival probability
// ---------------------------------------------------------------------------

std::string_view SurvivalMethodName(SurvivalMethod method) {
  switch (method) {
    case SurvivalMethod::kAuto:
      return "auto";
    case SurvivalMethod::kEnumeration:
      return "enumeration";
    case SurvivalMethod::kStructured:
      return "structured";
    case SurvivalMethod::kMonteCarlo:
      return "monte-carlo";
  }
  return "unknown";
}

absl::StatusOr<SurvivalEstimate> SurvivalProbability(const PlacementPlan& plan, int failures,
                                                     const SurvivalOptions& options) {
  const int n = plan.size();
  if (failures < 0 || failures > n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "failures is ", failures, "; it must be 0..", n, " (the number of nodes in the plan)"));
  }
  SurvivalEstimate result;
  result.failures = failures;
  result.method = SurvivalMethod::kStructured;
  // Closed forms: nothing failed; everything failed (every window is then
  // lost, as W > t); policy none (any failure loses that node's only copy).
  if (failures == 0) return result;
  if (failures == n || plan.policy().kind == ProtectionPolicy::Kind::kNone) {
    result.probability = 0.0;
    return result;
  }

  const SurvivalMethod method = options.method;
  const uint64_t subsets = BinomialSaturated(n, failures);
  if (method == SurvivalMethod::kEnumeration ||
      (method == SurvivalMethod::kAuto && subsets <= options.exact_limit)) {
    if (subsets > options.exact_limit) {
      return absl::InvalidArgumentError(absl::StrCat(
          "enumeration would visit C(", n, ", ", failures, ") = ", subsets,
          " failure sets, more than exact_limit ", options.exact_limit,
          "; raise exact_limit or use another method"));
    }
    std::vector<int> failed(failures);
    std::iota(failed.begin(), failed.end(), 0);
    uint64_t survived = 0;
    do {
      if (Survives(plan, failed)) ++survived;
    } while (NextCombination(failed, n));
    result.method = SurvivalMethod::kEnumeration;
    result.evaluated = subsets;
    result.probability = static_cast<double>(survived) / static_cast<double>(subsets);
    return result;
  }

  const uint64_t work = StructuredWork(plan, failures);
  if (method == SurvivalMethod::kStructured ||
      (method == SurvivalMethod::kAuto && work <= options.max_structured_work)) {
    if (work > options.max_structured_work) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the structured computation needs about ", work, " work units, more than ",
          "max_structured_work ", options.max_structured_work,
          "; raise it or use Monte Carlo"));
    }
    result.method = SurvivalMethod::kStructured;
    result.evaluated = work;
    result.probability = StructuredSurvival(plan, failures);
    return result;
  }

  if (options.samples == 0) {
    return absl::InvalidArgumentError("Monte Carlo needs samples >= 1");
  }
  std::mt19937_64 rng(options.seed);
  std::vector<uint8_t> chosen(n, 0);
  std::vector<int> failed;
  failed.reserve(failures);
  uint64_t survived = 0;
  for (uint64_t s = 0; s < options.samples; ++s) {
    // Floyd's algorithm: a uniform failures-subset of [0, n) in O(failures).
    failed.clear();
    for (int j = n - failures; j < n; ++j) {
      const int r = static_cast<int>(UniformBelow(rng, static_cast<uint64_t>(j) + 1));
      const int pick = chosen[r] ? j : r;
      chosen[pick] = 1;
      failed.push_back(pick);
    }
    std::sort(failed.begin(), failed.end());
    if (Survives(plan, failed)) ++survived;
    for (int p : failed) chosen[p] = 0;
  }
  const double p = static_cast<double>(survived) / static_cast<double>(options.samples);
  result.method = SurvivalMethod::kMonteCarlo;
  result.exact = false;
  result.evaluated = options.samples;
  result.probability = p;
  result.std_error = std::sqrt(p * (1.0 - p) / static_cast<double>(options.samples));
  result.seed = options.seed;
  return result;
}

}  // namespace ckpt::meta
