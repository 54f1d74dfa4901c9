// Placement planner: which nodes protect which for one job (docs/architecture.md "Protection"),
// and how likely a plan is to keep every node's data through f simultaneous
// random node failures.
//
// Pure domain code: no I/O, no clock, no randomness except the seeded Monte
// Carlo estimate. A plan is a deterministic function of the SET of alive nodes
// (id and failure domain) and the policy.
//
// ---- Plan order ----------------------------------------------------------
// Nodes are put in one "plan order"; a node's index in it is its position i of
// docs/architecture.md "Protection". Nodes are grouped by failure domain (unlabelled nodes form the
// domain ""), each domain's nodes sorted by id, and the domains (sorted by
// name) are interleaved round-robin: the first node of every domain, then the
// second of every domain that has one, and so on. So consecutive positions lie
// in different domains whenever the domain sizes allow it. With D domains of
// EQUAL size the order repeats with period D, and every run of up to D
// cyclically consecutive positions spans distinct domains.
//
// ---- Groups and windows ----------------------------------------------------
// Every policy except none cuts the plan order into groups of consecutive
// positions, and within a group of size g protects data in cyclic WINDOWS of W
// consecutive members (member j's window is members j, j+1, ..., j+W-1 mod g):
//
//   replicate{N, ring}   one group: all n nodes; W = N. Position i sends its
//                        blob to positions i+1..i+N-1 (mod n).
//   replicate{N, group}  G = floor(n/N) groups; W = N. Member j of a group
//                        sends its blob to members j+1..j+N-1 (mod g). For a
//                        group of exactly N that is every other member
//                        (Gemini's group placement).
//   ec{k, m}             G = floor(n/(k+m)) groups; W = k+m. Stripe s of a
//                        group covers window s (members s..s+k+m-1 mod g):
//                        parity on members s..s+m-1 (mod g), data on the other
//                        k members of the window, in member order. For a group
//                        of exactly k+m that is the rotated parity of
//                        docs/protocol.md "Node blobs and EC stripes".
//
// Leftover nodes (n not a multiple of W, group and ec only): the n nodes are
// cut into G groups as evenly as possible: group j has floor(n/G) members,
// plus one for the first n mod G groups. Every group therefore has between W
// and 2W-1 members (at most W+1 once n >= W*(W-1)), every node belongs to
// exactly one group, and because windows keep their size W:
//   - every blob still has exactly N copies (replicate) or is cut into exactly
//     k segments with m parity segments per stripe (ec); every node sends and
//     receives the same amount (N-1 blobs; k data + m parity segments);
//   - a group of g > W tolerates any W-1 (replicate) or m (ec) failures, and
//     more when they are spread: data is lost only when one window loses all
//     N members (replicate) or more than m members (ec).
// Even cutting (rather than one oversized last group) keeps groups no larger
// than D when there are D >= W failure domains of equal size, so each group's
// members, and hence every replica set and every stripe, span distinct
// domains.
//
// ---- Guarantees (tested in planner_test.cc) --------------------------------
// - No node protects itself; a node's protectors are distinct; a replicated
//   blob has exactly copies-1 protectors; every node appears as a protector
//   exactly copies-1 times (balanced memory and network).
// - EC: every stripe has k+m distinct members; every member holds exactly k
//   data segments (its own blob's segments 0..k-1) and m parity segments.
// - Failure domains: with D >= W domains of equal size, every replica set
//   (node plus protectors), every group and every stripe spans distinct
//   domains. With unequal sizes the spread is best effort (the order above).
// - Determinism: the same node set in any input order gives an identical plan.
// - Stability under re-planning (adding or removing one node, everything else
//   unchanged), ring placement:
//     * without failure-domain labels (one domain) positions shift but
//       neighbours do not: only the copies-1 nodes in front of the added or
//       removed node get different protectors (plus the added node itself);
//     * with labels, the change re-aligns the later nodes of that node's
//       domain X against the other domains: at most copies * (|X| + 1) nodes
//       get different protectors, where |X| counts X's nodes after the change
//       for an addition and before it for a removal. That is the price of
//       strict round-robin spread; all nodes of other domains keep their
//       protectors unless they sit next to a moved X node.
//   Group and ec placement cut the order into consecutive groups, so a change
//   can move group boundaries after the changed position; membership is
//   stable only under permutation of the input.
//
// ---- Survival probability ---------------------------------------------------
// SurvivalProbability(plan, f) is the probability that, when f distinct nodes
// chosen uniformly at random fail at once (before any re-protection), every
// node's blob is still recoverable from memory. Under the window model above
// that is: no window of any group lost more than t of its W members, with
// t = copies-1 (replicate: some copy survives) or t = m (ec: k segments of
// every stripe survive). Under none every failure loses data.
//
// Thread safety: PlacementPlan and StripeLayout are immutable after creation;
// any number of threads may call their const methods concurrently. The free
// functions are pure and safe to call concurrently; none blocks on I/O.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ec/layout.h"
#include "server/meta/policy.h"

namespace ckpt::meta {

// One alive node as the planner sees it.
struct PlannerNode {
  // Unique, non-empty node id.
  std::string id;
  // Failure-domain label (rack, switch, ...); empty if unknown. All unlabelled
  // nodes form one domain "".
  std::string failure_domain;

  friend bool operator==(const PlannerNode&, const PlannerNode&) = default;
};

// ---------------------------------------------------------------------------
// EC stripe layout: ec/layout.h (shared with the agents).
// ---------------------------------------------------------------------------

using ec::DataSlot;
using ec::EcStripe;
using ec::StripeLayout;
using ec::StripeSlot;

// ---------------------------------------------------------------------------
// Plan
// ---------------------------------------------------------------------------

// A run of consecutive plan positions that protect only each other.
struct PlacementGroup {
  // Group number within the plan, 0-based, in plan order.
  int index = 0;
  // Member j is plan position first + j, for j in [0, size).
  int first = 0;
  int size = 0;
  // ec: index into PlacementPlan::stripe_layouts(); -1 otherwise.
  int layout = -1;
  friend bool operator==(const PlacementGroup&, const PlacementGroup&) = default;
};

class PlacementPlan {
 public:
  // An empty plan: policy none, no nodes.
  PlacementPlan() = default;

  const ProtectionPolicy& policy() const { return policy_; }
  // Number of nodes in the plan (all alive nodes it was made from).
  int size() const { return static_cast<int>(nodes_.size()); }
  // The nodes in plan order; nodes()[i] is at position i.
  const std::vector<PlannerNode>& nodes() const { return nodes_; }
  // Position of `node_id`, or nullopt if it is not in the plan.
  std::optional<int> PositionOf(std::string_view node_id) const;

  // Window size W and tolerance t of the file comment (0 and 0 under none).
  int window() const { return window_; }
  int tolerance() const { return tolerance_; }

  // replicate: the positions that receive a full copy of the blob of the node
  // at `position`, in send order (copies-1 entries). Empty under none and ec.
  // `position` must be in [0, size()) (checked by assert).
  std::span<const int> Protectors(int position) const;
  // replicate: the positions whose blobs the node at `position` holds a copy
  // of (copies-1 entries). Empty under none and ec.
  std::vector<int> ReplicaSources(int position) const;
  // Protectors(PositionOf(node_id)) as node ids. NotFound if `node_id` is not
  // in the plan.
  absl::StatusOr<std::vector<std::string>> ProtectorsOf(std::string_view node_id) const;

  // The groups in plan order (empty under none). They partition [0, size()).
  const std::vector<PlacementGroup>& groups() const { return groups_; }
  // Index of the group containing `position`, or -1 under none.
  int GroupIndex(int position) const;
  // The group containing `node_id`. NotFound if the node is not in the plan or
  // the plan has no groups (policy none).
  absl::StatusOr<PlacementGroup> GroupOf(std::string_view node_id) const;

  // ec: the distinct layouts the groups use (at most two: groups differ in
  // size by at most one). Empty otherwise.
  const std::vector<StripeLayout>& stripe_layouts() const { return layouts_; }
  // ec: the layout of `group` (which must be one of groups()).
  const StripeLayout& Layout(const PlacementGroup& group) const;

  friend bool operator==(const PlacementPlan&, const PlacementPlan&) = default;

 private:
  friend absl::StatusOr<PlacementPlan> PlanPlacement(std::span<const PlannerNode>,
                                                     const ProtectionPolicy&);

  ProtectionPolicy policy_;
  std::vector<PlannerNode> nodes_;
  std::vector<int> by_id_;          // positions sorted by node id
  int window_ = 0;
  int tolerance_ = 0;
  std::vector<int> protectors_;     // replicate: [position * (copies-1) + r]
  std::vector<PlacementGroup> groups_;
  std::vector<int> group_of_;       // [position] -> group index
  std::vector<StripeLayout> layouts_;
};

// Plans `policy` over `alive_nodes` (in any order; the plan does not depend on
// it). Policy none yields a plan with the nodes in plan order and no
// protectors or groups. Does not block; O(n log n) time.
// Errors:
//   InvalidArgument     the policy is invalid (policy.Validate()), a node id is
//                       empty, or two nodes share an id;
//   FailedPrecondition  fewer alive nodes than the policy needs (copies for
//                       replicate, k+m for ec); the message says how many are
//                       needed and how many are present.
absl::StatusOr<PlacementPlan> PlanPlacement(std::span<const PlannerNode> alive_nodes,
                                            const ProtectionPolicy& policy);

// ---------------------------------------------------------------------------
// Survival probability
// ---------------------------------------------------------------------------

enum class SurvivalMethod {
  // Choose: enumeration if C(n, f) <= exact_limit, else the structured exact
  // computation if its work <= max_structured_work, else Monte Carlo.
  kAuto,
  // Visit every f-subset of the nodes and count the survivors (exact integer
  // counting). Requires C(n, f) <= exact_limit.
  kEnumeration,
  // Exact up to floating-point rounding (agrees with enumeration to 1e-9 in
  // planner_test): a transfer-matrix count per group (runs of failures on a cycle for
  // replication; per-group subset counts for ec), combined across groups
  // under i.i.d. Bernoulli(f/n) failures conditioned on exactly f of them.
  // Polynomial in n and f, so exact for large clusters too. Requires its work
  // estimate <= max_structured_work.
  kStructured,
  // `samples` failure sets drawn uniformly with a mt19937_64 seeded with
  // `seed`: the same seed gives the same estimate on every platform.
  kMonteCarlo,
};

struct SurvivalOptions {
  // Most f-subsets that enumeration may visit.
  uint64_t exact_limit = 2'000'000;
  // Most work units (DP cell updates, or subsets of one group visited) the
  // structured computation may spend; 2e8 is a few hundred milliseconds.
  uint64_t max_structured_work = 200'000'000;
  // Monte Carlo sample count (>= 1) and seed.
  uint64_t samples = 200'000;
  uint64_t seed = 1;
  SurvivalMethod method = SurvivalMethod::kAuto;
};

struct SurvivalEstimate {
  // Number of simultaneous failures asked about.
  int failures = 0;
  // P(every node's blob is recoverable), in [0, 1].
  double probability = 1.0;
  // True for enumeration and structured computation (and trivial cases).
  bool exact = true;
  // Work done: subsets enumerated, structured work units, or samples drawn.
  uint64_t evaluated = 0;
  // Monte Carlo: binomial standard error sqrt(p(1-p)/samples); 0 if exact.
  double std_error = 0.0;
  // The method that produced the figure (never kAuto). f = 0, f = n and
  // policy none are answered in closed form and report kStructured.
  SurvivalMethod method = SurvivalMethod::kStructured;
  // Monte Carlo: the seed used, to reproduce the figure.
  uint64_t seed = 0;
};

// Probability that `plan` keeps every node's data when `failures` distinct
// nodes chosen uniformly at random fail simultaneously (see the file
// comment). f = 0 gives 1. Runs on the calling thread; its work is bounded by
// the options (a 16-node f=3 enumeration takes microseconds).
// Errors: InvalidArgument if failures < 0 or > plan.size(), if samples is 0
// for Monte Carlo, or if a forced exact method exceeds its work limit.
absl::StatusOr<SurvivalEstimate> SurvivalProbability(const PlacementPlan& plan, int failures,
                                                     const SurvivalOptions& options = {});

// "auto", "enumeration", "structured", "monte-carlo".
std::string_view SurvivalMethodName(SurvivalMethod method);

}  // namespace ckpt::meta
