// Placement planner: the survival table of issue 3, the plan properties over
// many seeded random clusters (no self-protection, distinct nodes, balanced
// load, failure-domain spread, determinism, stability under re-planning), the
// EC stripe layout, the survival methods against each other and against closed
// forms, and the error cases. Deterministic: seeded RNGs only.
#include "server/meta/planner.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "server/meta/policy.h"

namespace ckpt::meta {
namespace {

using ::testing::HasSubstr;
using Kind = ProtectionPolicy::Kind;
using Placement = ProtectionPolicy::Placement;

std::vector<PlannerNode> Unlabelled(int n) {
  std::vector<PlannerNode> nodes;
  for (int i = 0; i < n; ++i) nodes.push_back({absl::StrCat("node-", 1000 + i), ""});
  return nodes;
}

// n nodes with random unique ids; domains: 0 = unlabelled, else each node in
// one of `domains` racks chosen at random.
std::vector<PlannerNode> RandomCluster(std::mt19937_64& rng, int n, int domains) {
  std::set<std::string> ids;
  std::vector<PlannerNode> nodes;
  while (static_cast<int>(nodes.size()) < n) {
    std::string id = absl::StrCat("host-", rng() % 100000);
    if (!ids.insert(id).second) continue;
    std::string domain = domains == 0 ? "" : absl::StrCat("rack-", rng() % domains);
    nodes.push_back({std::move(id), std::move(domain)});
  }
  return nodes;
}

// D domains of exactly c nodes each, in a scrambled input order.
std::vector<PlannerNode> BalancedCluster(std::mt19937_64& rng, int domains, int per_domain) {
  std::vector<PlannerNode> nodes;
  for (int d = 0; d < domains; ++d) {
    for (int i = 0; i < per_domain; ++i) {
      nodes.push_back({absl::StrCat("n", rng() % 1000, "-", d, "-", i), absl::StrCat("rack", d)});
    }
  }
  std::shuffle(nodes.begin(), nodes.end(), rng);
  return nodes;
}

std::vector<ProtectionPolicy> AllPolicies() {
  std::vector<ProtectionPolicy> policies = {ProtectionPolicy::None()};
  for (int copies : {2, 3, 4, 8}) {
    policies.push_back(ProtectionPolicy::Replicate(copies, Placement::kRing));
    policies.push_back(ProtectionPolicy::Replicate(copies, Placement::kGroup));
  }
  for (auto [k, m] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {4, 2}, {3, 3}, {8, 2}}) {
    policies.push_back(ProtectionPolicy::ErasureCode(k, m));
  }
  return policies;
}

// Every structural property a plan must have; failures name the position.
void ExpectPlanProperties(const PlacementPlan& plan, const std::vector<PlannerNode>& input) {
  const ProtectionPolicy& policy = plan.policy();
  const int n = plan.size();
  ASSERT_EQ(n, static_cast<int>(input.size()));
  // The nodes are exactly the input, each findable by id.
  std::multiset<std::string> in_ids, plan_ids;
  for (const PlannerNode& node : input) in_ids.insert(node.id);
  for (const PlannerNode& node : plan.nodes()) plan_ids.insert(node.id);
  EXPECT_EQ(in_ids, plan_ids);
  for (const PlannerNode& node : input) {
    const std::optional<int> pos = plan.PositionOf(node.id);
    ASSERT_TRUE(pos.has_value()) << node.id;
    EXPECT_EQ(plan.nodes()[*pos], node);
  }
  EXPECT_FALSE(plan.PositionOf("no-such-node").has_value());

  if (policy.kind == Kind::kNone) {
    EXPECT_TRUE(plan.groups().empty());
    for (int i = 0; i < n; ++i) EXPECT_TRUE(plan.Protectors(i).empty());
    return;
  }

  // Groups: contiguous, covering every position once, sizes W..2W-1 and even.
  const int w = plan.window();
  ASSERT_FALSE(plan.groups().empty());
  int next = 0;
  int smallest = n, largest = 0;
  for (size_t gi = 0; gi < plan.groups().size(); ++gi) {
    const PlacementGroup& g = plan.groups()[gi];
    EXPECT_EQ(g.index, static_cast<int>(gi));
    EXPECT_EQ(g.first, next);
    EXPECT_GE(g.size, w);
    if (!(policy.kind == Kind::kReplicate && policy.placement == Placement::kRing)) {
      EXPECT_LE(g.size, 2 * w - 1);
    }
    smallest = std::min(smallest, g.size);
    largest = std::max(largest, g.size);
    for (int j = 0; j < g.size; ++j) EXPECT_EQ(plan.GroupIndex(g.first + j), g.index);
    next += g.size;
  }
  EXPECT_EQ(next, n);
  EXPECT_LE(largest - smallest, 1);

  if (policy.kind == Kind::kReplicate) {
    EXPECT_EQ(plan.tolerance(), policy.copies - 1);
    std::vector<int> received(n, 0);
    for (int i = 0; i < n; ++i) {
      const auto protectors = plan.Protectors(i);
      ASSERT_EQ(static_cast<int>(protectors.size()), policy.copies - 1) << "position " << i;
      std::set<int> distinct(protectors.begin(), protectors.end());
      EXPECT_EQ(distinct.size(), protectors.size()) << "position " << i;
      EXPECT_EQ(distinct.count(i), 0u) << "position " << i << " protects itself";
      for (int p : protectors) {
        ASSERT_GE(p, 0);
        ASSERT_LT(p, n);
        EXPECT_EQ(plan.GroupIndex(p), plan.GroupIndex(i));
        ++received[p];
      }
      for (int s : plan.ReplicaSources(i)) {
        const auto ps = plan.Protectors(s);
        EXPECT_NE(std::find(ps.begin(), ps.end(), i), ps.end());
      }
    }
    for (int i = 0; i < n; ++i) EXPECT_EQ(received[i], policy.copies - 1) << "position " << i;
    return;
  }

  // Erasure coding.
  const int k = policy.data_k, m = policy.parity_m;
  EXPECT_EQ(w, k + m);
  EXPECT_EQ(plan.tolerance(), m);
  EXPECT_LE(plan.stripe_layouts().size(), 2u);
  for (const PlacementGroup& g : plan.groups()) {
    const StripeLayout& layout = plan.Layout(g);
    ASSERT_EQ(layout.group_size(), g.size);
    ASSERT_EQ(layout.data_k(), k);
    ASSERT_EQ(layout.parity_m(), m);
    ASSERT_EQ(static_cast<int>(layout.stripes().size()), g.size);
    for (int s = 0; s < g.size; ++s) {
      const EcStripe& stripe = layout.stripes()[s];
      ASSERT_EQ(static_cast<int>(stripe.parity_members.size()), m);
      ASSERT_EQ(static_cast<int>(stripe.data.size()), k);
      std::set<int> members(stripe.parity_members.begin(), stripe.parity_members.end());
      for (size_t d = 0; d < stripe.data.size(); ++d) {
        members.insert(stripe.data[d].member);
        if (d > 0) {
          EXPECT_LT(stripe.data[d - 1].member, stripe.data[d].member);
        }
      }
      EXPECT_EQ(static_cast<int>(members.size()), k + m) << "stripe " << s;
      for (int member : members) {
        EXPECT_GE(member, 0);
        EXPECT_LT(member, g.size);
      }
    }
    for (int j = 0; j < g.size; ++j) {
      for (int t = 0; t < k; ++t) {
        const StripeSlot slot = layout.SegmentOf(j, t);
        ASSERT_LT(slot.stripe, g.size);
        EXPECT_EQ(layout.stripes()[slot.stripe].data[slot.position], (DataSlot{j, t}));
      }
      const auto parity = layout.ParityOf(j);
      ASSERT_EQ(static_cast<int>(parity.size()), m);
      for (const StripeSlot& slot : parity) {
        EXPECT_EQ(layout.stripes()[slot.stripe].parity_members[slot.position], j);
      }
    }
  }
  for (int i = 0; i < n; ++i) EXPECT_TRUE(plan.Protectors(i).empty());
}

// ---------------------------------------------------------------------------
// Policy
// ---------------------------------------------------------------------------

TEST(ProtectionPolicy, ValidatesRangesWithActionableMessages) {
  EXPECT_TRUE(ProtectionPolicy::None().Validate().ok());
  EXPECT_TRUE(ProtectionPolicy::Replicate(2, Placement::kRing).Validate().ok());
  EXPECT_TRUE(ProtectionPolicy::Replicate(8, Placement::kGroup).Validate().ok());
  EXPECT_TRUE(ProtectionPolicy::ErasureCode(32, 8).Validate().ok());
  EXPECT_TRUE(ProtectionPolicy::ErasureCode(1, 1).Validate().ok());

  const absl::Status one_copy = ProtectionPolicy::Replicate(1, Placement::kRing).Validate();
  EXPECT_EQ(one_copy.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(one_copy.message()), HasSubstr("copies is 1; it must be 2..8"));
  EXPECT_EQ(ProtectionPolicy::Replicate(9, Placement::kRing).Validate().code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status bad_k = ProtectionPolicy::ErasureCode(0, 2).Validate();
  EXPECT_EQ(bad_k.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad_k.message()), HasSubstr("data k is 0; it must be 1..32"));
  const absl::Status bad_m = ProtectionPolicy::ErasureCode(4, 9).Validate();
  EXPECT_THAT(std::string(bad_m.message()), HasSubstr("parity m is 9; it must be 1..8"));
  ProtectionPolicy bad_placement = ProtectionPolicy::Replicate(2, Placement::kRing);
  bad_placement.placement = static_cast<Placement>(7);
  EXPECT_EQ(bad_placement.Validate().code(), absl::StatusCode::kInvalidArgument);
  ProtectionPolicy bad_kind;
  bad_kind.kind = static_cast<Kind>(9);
  EXPECT_EQ(bad_kind.Validate().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ProtectionPolicy, DescribesItself) {
  EXPECT_EQ(ProtectionPolicy::None().ToString(), "none");
  EXPECT_EQ(ProtectionPolicy::Replicate(3, Placement::kRing).ToString(), "replicate{3, ring}");
  EXPECT_EQ(ProtectionPolicy::Replicate(2, Placement::kGroup).ToString(), "replicate{2, group}");
  EXPECT_EQ(ProtectionPolicy::ErasureCode(4, 2).ToString(), "ec{4, 2}");
  EXPECT_EQ(ProtectionPolicy::ErasureCode(4, 2).MinNodes(), 6);
  EXPECT_EQ(ProtectionPolicy::ErasureCode(4, 2).ToleratedFailures(), 2);
  EXPECT_EQ(ProtectionPolicy::Replicate(3, Placement::kGroup).MinNodes(), 3);
  EXPECT_EQ(ProtectionPolicy::Replicate(3, Placement::kGroup).ToleratedFailures(), 2);
}

// ---------------------------------------------------------------------------
// The survival table of issue 3
// ---------------------------------------------------------------------------

struct TableRow {
  Placement placement;
  int failures;
  double rounded;  // the issue's figure
  double exact;    // the exact rational it rounds
};

TEST(SurvivalProbability, ReproducesTheIssueTableFor16NodesTwoCopies) {
  const std::vector<TableRow> rows = {
      {Placement::kGroup, 2, 0.933, 112.0 / 120.0},  // loses iff both of one pair fail
      {Placement::kRing, 2, 0.867, 104.0 / 120.0},   // loses iff two neighbours fail
      {Placement::kGroup, 3, 0.800, 448.0 / 560.0},
      {Placement::kRing, 3, 0.629, 352.0 / 560.0},   // 16/13 * C(13,3) = 352 non-adjacent
  };
  // Labels do not matter for random node failures: check both.
  std::mt19937_64 rng(3);
  for (const auto& nodes : {Unlabelled(16), BalancedCluster(rng, 4, 4)}) {
    for (const TableRow& row : rows) {
      auto plan = PlanPlacement(nodes, ProtectionPolicy::Replicate(2, row.placement));
      ASSERT_TRUE(plan.ok()) << plan.status();
      SCOPED_TRACE(absl::StrCat(plan->policy().ToString(), " f=", row.failures));

      auto auto_estimate = SurvivalProbability(*plan, row.failures);
      ASSERT_TRUE(auto_estimate.ok()) << auto_estimate.status();
      EXPECT_TRUE(auto_estimate->exact);
      EXPECT_EQ(auto_estimate->method, SurvivalMethod::kEnumeration);
      EXPECT_EQ(auto_estimate->evaluated, row.failures == 2 ? 120u : 560u);
      EXPECT_EQ(auto_estimate->std_error, 0.0);
      EXPECT_NEAR(auto_estimate->probability, row.rounded, 0.0005);
      EXPECT_DOUBLE_EQ(auto_estimate->probability, row.exact);

      SurvivalOptions structured;
      structured.method = SurvivalMethod::kStructured;
      auto s = SurvivalProbability(*plan, row.failures, structured);
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_TRUE(s->exact);
      EXPECT_NEAR(s->probability, row.exact, 1e-12);

      SurvivalOptions monte_carlo;
      monte_carlo.method = SurvivalMethod::kMonteCarlo;
      auto mc = SurvivalProbability(*plan, row.failures, monte_carlo);
      ASSERT_TRUE(mc.ok()) << mc.status();
      EXPECT_FALSE(mc->exact);
      EXPECT_EQ(mc->evaluated, 200'000u);
      EXPECT_GT(mc->std_error, 0.0);
      EXPECT_NEAR(mc->probability, row.exact, 5 * mc->std_error);
    }
  }
}

TEST(SurvivalProbability, GroupBeatsRingAtEqualCost) {
  // The point of the table: at the same copies, group placement keeps data
  // more often than ring for every f >= 2.
  auto ring = PlanPlacement(Unlabelled(16), ProtectionPolicy::Replicate(2, Placement::kRing));
  auto group = PlanPlacement(Unlabelled(16), ProtectionPolicy::Replicate(2, Placement::kGroup));
  ASSERT_TRUE(ring.ok() && group.ok());
  for (int f = 2; f <= 8; ++f) {
    EXPECT_GT(SurvivalProbability(*group, f)->probability,
              SurvivalProbability(*ring, f)->probability)
        << "f=" << f;
  }
  EXPECT_EQ(SurvivalProbability(*ring, 1)->probability, 1.0);
  EXPECT_EQ(SurvivalProbability(*group, 1)->probability, 1.0);
}

// ---------------------------------------------------------------------------
// Survival methods
// ---------------------------------------------------------------------------

TEST(SurvivalProbability, TrivialCasesAndErrors) {
  auto plan = PlanPlacement(Unlabelled(10), ProtectionPolicy::ErasureCode(3, 2));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(SurvivalProbability(*plan, 0)->probability, 1.0);
  EXPECT_EQ(SurvivalProbability(*plan, 2)->probability, 1.0);  // tolerates m = 2
  EXPECT_EQ(SurvivalProbability(*plan, 10)->probability, 0.0);
  EXPECT_EQ(SurvivalProbability(*plan, -1).status().code(), absl::StatusCode::kInvalidArgument);
  const absl::Status too_many = SurvivalProbability(*plan, 11).status();
  EXPECT_EQ(too_many.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_many.message()), HasSubstr("0..10"));

  SurvivalOptions forced;
  forced.method = SurvivalMethod::kEnumeration;
  forced.exact_limit = 10;
  EXPECT_EQ(SurvivalProbability(*plan, 3, forced).status().code(),
            absl::StatusCode::kInvalidArgument);
  forced.method = SurvivalMethod::kStructured;
  forced.max_structured_work = 0;
  EXPECT_EQ(SurvivalProbability(*plan, 3, forced).status().code(),
            absl::StatusCode::kInvalidArgument);
  forced.method = SurvivalMethod::kMonteCarlo;
  forced.samples = 0;
  EXPECT_EQ(SurvivalProbability(*plan, 3, forced).status().code(),
            absl::StatusCode::kInvalidArgument);

  auto none = PlanPlacement(Unlabelled(5), ProtectionPolicy::None());
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(SurvivalProbability(*none, 0)->probability, 1.0);
  EXPECT_EQ(SurvivalProbability(*none, 1)->probability, 0.0);
  EXPECT_TRUE(SurvivalProbability(*none, 1)->exact);
}

TEST(SurvivalProbability, AutoFallsBackToStructuredThenMonteCarlo) {
  auto plan = PlanPlacement(Unlabelled(60), ProtectionPolicy::Replicate(2, Placement::kRing));
  ASSERT_TRUE(plan.ok());
  SurvivalOptions options;
  options.exact_limit = 1000;  // C(60, 3) = 34220
  auto structured = SurvivalProbability(*plan, 3, options);
  ASSERT_TRUE(structured.ok());
  EXPECT_EQ(structured->method, SurvivalMethod::kStructured);
  EXPECT_TRUE(structured->exact);
  options.max_structured_work = 1;
  options.samples = 5000;
  options.seed = 42;
  auto mc = SurvivalProbability(*plan, 3, options);
  ASSERT_TRUE(mc.ok());
  EXPECT_EQ(mc->method, SurvivalMethod::kMonteCarlo);
  EXPECT_FALSE(mc->exact);
  EXPECT_EQ(mc->seed, 42u);
  EXPECT_NEAR(mc->probability, structured->probability, 5 * mc->std_error);
}

TEST(SurvivalProbability, MonteCarloIsDeterministicForASeed) {
  auto plan = PlanPlacement(Unlabelled(40), ProtectionPolicy::ErasureCode(4, 2));
  ASSERT_TRUE(plan.ok());
  SurvivalOptions options;
  options.method = SurvivalMethod::kMonteCarlo;
  options.samples = 20'000;
  options.seed = 7;
  const double first = SurvivalProbability(*plan, 5, options)->probability;
  EXPECT_EQ(SurvivalProbability(*plan, 5, options)->probability, first);
  options.seed = 8;
  EXPECT_NE(SurvivalProbability(*plan, 5, options)->probability, first);
}

TEST(SurvivalProbability, EnumerationAndStructuredAgreeOnRandomPlans) {
  std::mt19937_64 rng(11);
  int compared = 0;
  for (int trial = 0; trial < 150; ++trial) {
    const std::vector<ProtectionPolicy> policies = AllPolicies();
    const ProtectionPolicy policy = policies[rng() % policies.size()];
    const int n = std::max(policy.MinNodes(), static_cast<int>(rng() % 22) + 1);
    auto plan = PlanPlacement(RandomCluster(rng, n, rng() % 4), policy);
    ASSERT_TRUE(plan.ok()) << plan.status();
    for (int f = 1; f < n; ++f) {
      SurvivalOptions enumerate, structured;
      enumerate.method = SurvivalMethod::kEnumeration;
      enumerate.exact_limit = 200'000;
      structured.method = SurvivalMethod::kStructured;
      auto e = SurvivalProbability(*plan, f, enumerate);
      if (!e.ok()) continue;  // too many subsets for this test
      auto s = SurvivalProbability(*plan, f, structured);
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_NEAR(e->probability, s->probability, 1e-9)
          << policy.ToString() << " n=" << n << " f=" << f;
      if (f <= policy.ToleratedFailures()) {
        EXPECT_EQ(e->probability, 1.0);
      }
      ++compared;
    }
  }
  EXPECT_GT(compared, 500);
}

// Survival decided from what the plan says nodes hold, independent of the
// window model SurvivalProbability uses: replication keeps a blob while its
// node or one of Protectors() is up; ec keeps data while no stripe of the
// layouts loses more than m of its members.
bool OracleSurvives(const PlacementPlan& plan, const std::vector<bool>& failed) {
  const ProtectionPolicy& policy = plan.policy();
  if (policy.kind == Kind::kNone) {
    return std::find(failed.begin(), failed.end(), true) == failed.end();
  }
  if (policy.kind == Kind::kReplicate) {
    for (int i = 0; i < plan.size(); ++i) {
      if (!failed[i]) continue;
      bool held = false;
      for (int p : plan.Protectors(i)) held = held || !failed[p];
      if (!held) return false;
    }
    return true;
  }
  for (const PlacementGroup& g : plan.groups()) {
    for (const EcStripe& stripe : plan.Layout(g).stripes()) {
      int lost = 0;
      for (int member : stripe.parity_members) lost += failed[g.first + member] ? 1 : 0;
      for (const DataSlot& slot : stripe.data) lost += failed[g.first + slot.member] ? 1 : 0;
      if (lost > policy.parity_m) return false;
    }
  }
  return true;
}

TEST(SurvivalProbability, MatchesAnOracleBuiltFromProtectorsAndStripes) {
  std::mt19937_64 rng(12);
  int compared = 0;
  const std::vector<ProtectionPolicy> policies = AllPolicies();
  for (int trial = 0; trial < 120; ++trial) {
    const ProtectionPolicy policy = policies[rng() % policies.size()];
    const int n = std::max(policy.MinNodes(), static_cast<int>(rng() % 16) + 1);
    auto plan = PlanPlacement(RandomCluster(rng, n, rng() % 4), policy);
    ASSERT_TRUE(plan.ok()) << plan.status();
    for (int f = 1; f <= n; ++f) {
      // Enumerate every f-subset through all n-bit masks with f bits set.
      if (n > 16) break;
      uint64_t total = 0, survived = 0;
      for (uint32_t mask = 0; mask < (1u << n); ++mask) {
        if (__builtin_popcount(mask) != f) continue;
        std::vector<bool> failed(n);
        for (int i = 0; i < n; ++i) failed[i] = (mask >> i) & 1u;
        ++total;
        survived += OracleSurvives(*plan, failed) ? 1 : 0;
      }
      auto got = SurvivalProbability(*plan, f);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_NEAR(got->probability, static_cast<double>(survived) / total, 1e-12)
          << policy.ToString() << " n=" << n << " f=" << f;
      ++compared;
    }
  }
  EXPECT_GT(compared, 400);
}

TEST(SurvivalProbability, StructuredMatchesClosedFormsAtScale) {
  const int n = 16384;
  const double c2 = n * (n - 1.0) / 2.0;
  const double c3 = n * (n - 1.0) * (n - 2.0) / 6.0;
  auto ring2 = PlanPlacement(Unlabelled(n), ProtectionPolicy::Replicate(2, Placement::kRing));
  auto ring3 = PlanPlacement(Unlabelled(n), ProtectionPolicy::Replicate(3, Placement::kRing));
  auto group2 = PlanPlacement(Unlabelled(n), ProtectionPolicy::Replicate(2, Placement::kGroup));
  auto ec42 = PlanPlacement(Unlabelled(n), ProtectionPolicy::ErasureCode(4, 2));
  ASSERT_TRUE(ring2.ok() && ring3.ok() && group2.ok() && ec42.ok());

  auto expect = [](const PlacementPlan& plan, int f, double want) {
    auto got = SurvivalProbability(plan, f);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->method, SurvivalMethod::kStructured);
    EXPECT_TRUE(got->exact);
    EXPECT_NEAR(got->probability, want, 1e-10) << plan.policy().ToString() << " f=" << f;
  };
  expect(*ring2, 2, 1.0 - n / c2);                                  // n adjacent pairs
  expect(*ring2, 3, n / (n - 3.0) * ((n - 3.0) * (n - 4.0) * (n - 5.0) / 6.0) / c3);
  expect(*ring3, 3, 1.0 - n / c3);                                  // n runs of three
  expect(*group2, 2, 1.0 - (n / 2) / c2);                           // n/2 pairs
  expect(*group2, 3, 1.0 - (n / 2) * (n - 2.0) / c3);
  // ec{4,2}: 2730 groups, the first 4 of 7 members; losing data needs 3
  // failures in one group (in a 7-group any 3 do: every window misses only
  // one member).
  const double groups6 = 2726, groups7 = 4;
  expect(*ec42, 3, 1.0 - (groups6 * 20 + groups7 * 35) / c3);
}

// ---------------------------------------------------------------------------
// Plans
// ---------------------------------------------------------------------------

TEST(PlanPlacement, RingSendsToTheNextNodes) {
  auto plan = PlanPlacement(
      std::vector<PlannerNode>{{"d", ""}, {"b", ""}, {"a", ""}, {"c", ""}},
      ProtectionPolicy::Replicate(2, Placement::kRing));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(*plan->ProtectorsOf("a"), std::vector<std::string>{"b"});
  EXPECT_EQ(*plan->ProtectorsOf("c"), std::vector<std::string>{"d"});
  EXPECT_EQ(*plan->ProtectorsOf("d"), std::vector<std::string>{"a"});
  EXPECT_EQ(plan->ProtectorsOf("e").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(plan->groups().size(), 1u);
  EXPECT_EQ(plan->GroupOf("c")->size, 4);
  EXPECT_EQ(plan->ReplicaSources(0), std::vector<int>{3});
}

TEST(PlanPlacement, InterleavesFailureDomainsRoundRobin) {
  auto plan = PlanPlacement(std::vector<PlannerNode>{{"a2", "rackA"},
                                                     {"c1", "rackC"},
                                                     {"b1", "rackB"},
                                                     {"a1", "rackA"},
                                                     {"b2", "rackB"},
                                                     {"u1", ""}},
                            ProtectionPolicy::Replicate(2, Placement::kGroup));
  ASSERT_TRUE(plan.ok());
  std::vector<std::string> order;
  for (const PlannerNode& node : plan->nodes()) order.push_back(node.id);
  // Domains by name: "" < rackA < rackB < rackC.
  EXPECT_EQ(order, (std::vector<std::string>{"u1", "a1", "b1", "c1", "a2", "b2"}));
  ASSERT_EQ(plan->groups().size(), 3u);
  EXPECT_EQ(*plan->ProtectorsOf("u1"), std::vector<std::string>{"a1"});
  EXPECT_EQ(*plan->ProtectorsOf("a1"), std::vector<std::string>{"u1"});
  EXPECT_EQ(plan->GroupOf("b2")->index, 2);
}

TEST(PlanPlacement, LeftoverNodesWidenGroupsEvenly) {
  // 7 nodes, groups of 2: 3 groups of sizes 3, 2, 2; the 3-group is a ring.
  auto plan = PlanPlacement(Unlabelled(7), ProtectionPolicy::Replicate(2, Placement::kGroup));
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->groups().size(), 3u);
  EXPECT_EQ(plan->groups()[0], (PlacementGroup{0, 0, 3, -1}));
  EXPECT_EQ(plan->groups()[1], (PlacementGroup{1, 3, 2, -1}));
  EXPECT_EQ(plan->groups()[2], (PlacementGroup{2, 5, 2, -1}));
  EXPECT_EQ(std::vector<int>(plan->Protectors(2).begin(), plan->Protectors(2).end()),
            std::vector<int>{0});
  // ec{2,1} over 13 nodes: 4 groups of 4, 3, 3, 3 with two layouts.
  auto ec = PlanPlacement(Unlabelled(13), ProtectionPolicy::ErasureCode(2, 1));
  ASSERT_TRUE(ec.ok());
  ASSERT_EQ(ec->groups().size(), 4u);
  EXPECT_EQ(ec->groups()[0].size, 4);
  EXPECT_EQ(ec->groups()[3].size, 3);
  EXPECT_EQ(ec->stripe_layouts().size(), 2u);
  EXPECT_EQ(ec->Layout(ec->groups()[0]).group_size(), 4);
  EXPECT_EQ(ec->Layout(ec->groups()[1]).group_size(), 3);
}

TEST(PlanPlacement, NoneYieldsAPlanWithoutProtection) {
  auto plan = PlanPlacement(Unlabelled(3), ProtectionPolicy::None());
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->size(), 3);
  EXPECT_TRUE(plan->groups().empty());
  EXPECT_TRUE(plan->ProtectorsOf("node-1000")->empty());
  EXPECT_EQ(plan->GroupOf("node-1000").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(plan->GroupIndex(0), -1);
  auto empty = PlanPlacement({}, ProtectionPolicy::None());
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, PlacementPlan());
}

TEST(PlanPlacement, RejectsBadInput) {
  const absl::Status invalid =
      PlanPlacement(Unlabelled(4), ProtectionPolicy::Replicate(1, Placement::kRing)).status();
  EXPECT_EQ(invalid.code(), absl::StatusCode::kInvalidArgument);

  std::vector<PlannerNode> dup = Unlabelled(4);
  dup.push_back({"node-1002", "rack9"});
  const absl::Status duplicate =
      PlanPlacement(dup, ProtectionPolicy::Replicate(2, Placement::kRing)).status();
  EXPECT_EQ(duplicate.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(duplicate.message()), HasSubstr("duplicate node id \"node-1002\""));

  std::vector<PlannerNode> unnamed = Unlabelled(4);
  unnamed[2].id.clear();
  EXPECT_EQ(PlanPlacement(unnamed, ProtectionPolicy::None()).status().code(),
            absl::StatusCode::kInvalidArgument);

  const absl::Status few =
      PlanPlacement(Unlabelled(2), ProtectionPolicy::Replicate(3, Placement::kRing)).status();
  EXPECT_EQ(few.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(few.message()), HasSubstr("needs at least 3 alive nodes; 2 present"));
  const absl::Status few_ec =
      PlanPlacement(Unlabelled(5), ProtectionPolicy::ErasureCode(4, 2)).status();
  EXPECT_EQ(few_ec.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(few_ec.message()), HasSubstr("needs at least 6 alive nodes; 5 present"));
  // Exactly enough is fine.
  EXPECT_TRUE(PlanPlacement(Unlabelled(6), ProtectionPolicy::ErasureCode(4, 2)).ok());
  EXPECT_TRUE(PlanPlacement(Unlabelled(3), ProtectionPolicy::Replicate(3, Placement::kRing)).ok());
}

TEST(PlanPlacement, PropertiesHoldOverManyRandomClusters) {
  std::mt19937_64 rng(2024);
  const std::vector<ProtectionPolicy> policies = AllPolicies();
  int planned = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 200);
    const int domains = static_cast<int>(rng() % 12);
    const std::vector<PlannerNode> nodes = RandomCluster(rng, n, domains);
    for (const ProtectionPolicy& policy : policies) {
      SCOPED_TRACE(absl::StrCat("trial ", trial, " n=", n, " domains=", domains, " ",
                                policy.ToString()));
      auto plan = PlanPlacement(nodes, policy);
      if (n < policy.MinNodes()) {
        EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
        continue;
      }
      ASSERT_TRUE(plan.ok()) << plan.status();
      ExpectPlanProperties(*plan, nodes);
      if (HasFailure()) return;
      // Same set, another input order: the identical plan.
      std::vector<PlannerNode> shuffled = nodes;
      std::shuffle(shuffled.begin(), shuffled.end(), rng);
      auto again = PlanPlacement(shuffled, policy);
      ASSERT_TRUE(again.ok());
      EXPECT_TRUE(*again == *plan);
      ++planned;
    }
  }
  EXPECT_GT(planned, 4000);
}

TEST(PlanPlacement, SpreadsEverySetAcrossBalancedFailureDomains) {
  std::mt19937_64 rng(99);
  for (int trial = 0; trial < 300; ++trial) {
    const int domains = 2 + static_cast<int>(rng() % 11);
    const int per_domain = 1 + static_cast<int>(rng() % 25);
    const std::vector<PlannerNode> nodes = BalancedCluster(rng, domains, per_domain);
    std::map<std::string, std::string> domain_of;
    for (const PlannerNode& node : nodes) domain_of[node.id] = node.failure_domain;
    for (const ProtectionPolicy& policy : AllPolicies()) {
      if (policy.kind == Kind::kNone) continue;
      const int w = policy.MinNodes();
      if (w > domains || w > static_cast<int>(nodes.size())) continue;
      SCOPED_TRACE(absl::StrCat("trial ", trial, " ", domains, " x ", per_domain, " ",
                                policy.ToString()));
      auto plan = PlanPlacement(nodes, policy);
      ASSERT_TRUE(plan.ok()) << plan.status();
      auto domain_at = [&](int position) { return plan->nodes()[position].failure_domain; };
      // Every replica set: the node and its protectors in distinct domains.
      for (int i = 0; i < plan->size(); ++i) {
        std::set<std::string> seen = {domain_at(i)};
        for (int p : plan->Protectors(i)) {
          EXPECT_TRUE(seen.insert(domain_at(p)).second)
              << "position " << i << " and its protector " << p << " share " << domain_at(p);
        }
      }
      // Every group (so every stripe) of group and ec placement.
      if (policy.kind == Kind::kErasureCode || policy.placement == Placement::kGroup) {
        for (const PlacementGroup& g : plan->groups()) {
          std::set<std::string> seen;
          for (int j = 0; j < g.size; ++j) {
            EXPECT_TRUE(seen.insert(domain_at(g.first + j)).second) << "group " << g.index;
          }
        }
      }
      if (HasFailure()) return;
    }
  }
}

// Number of nodes present in both plans whose protector ids differ.
int ChangedProtectors(const PlacementPlan& before, const PlacementPlan& after) {
  int changed = 0;
  for (const PlannerNode& node : before.nodes()) {
    if (!after.PositionOf(node.id)) continue;
    if (*before.ProtectorsOf(node.id) != *after.ProtectorsOf(node.id)) ++changed;
  }
  return changed;
}

TEST(PlanPlacement, RingIsStableWhenOneNodeJoinsOrLeaves) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const int copies = 2 + static_cast<int>(rng() % 4);
    const ProtectionPolicy policy = ProtectionPolicy::Replicate(copies, Placement::kRing);
    const int n = 2 * copies + static_cast<int>(rng() % 150);
    std::vector<PlannerNode> nodes = RandomCluster(rng, n + 1, 0);
    const PlannerNode extra = nodes.back();
    nodes.pop_back();
    auto base = PlanPlacement(nodes, policy);
    ASSERT_TRUE(base.ok());

    std::vector<PlannerNode> joined = nodes;
    joined.push_back(extra);
    auto after_join = PlanPlacement(joined, policy);
    ASSERT_TRUE(after_join.ok());
    // Only the copies-1 nodes in front of the newcomer send elsewhere.
    EXPECT_LE(ChangedProtectors(*base, *after_join), copies - 1) << "trial " << trial;

    std::vector<PlannerNode> left = nodes;
    left.erase(left.begin() + static_cast<int>(rng() % left.size()));
    auto after_leave = PlanPlacement(left, policy);
    ASSERT_TRUE(after_leave.ok());
    EXPECT_LE(ChangedProtectors(*base, *after_leave), copies - 1) << "trial " << trial;
  }
}

TEST(PlanPlacement, LabelledRingChangesAreBoundedByTheChangedDomain) {
  std::mt19937_64 rng(6);
  int64_t changed_total = 0, nodes_total = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int copies = 2 + static_cast<int>(rng() % 2);
    const int domains = 4 + static_cast<int>(rng() % 8);
    const ProtectionPolicy policy = ProtectionPolicy::Replicate(copies, Placement::kRing);
    const int n = 2 * domains + static_cast<int>(rng() % 200);
    std::vector<PlannerNode> nodes = RandomCluster(rng, n + 1, domains);
    const PlannerNode extra = nodes.back();
    nodes.pop_back();
    auto base = PlanPlacement(nodes, policy);
    ASSERT_TRUE(base.ok());

    auto domain_size = [](const std::vector<PlannerNode>& v, const std::string& domain) {
      return static_cast<int>(std::count_if(v.begin(), v.end(), [&](const PlannerNode& x) {
        return x.failure_domain == domain;
      }));
    };
    std::vector<PlannerNode> joined = nodes;
    joined.push_back(extra);
    auto after_join = PlanPlacement(joined, policy);
    ASSERT_TRUE(after_join.ok());
    const int join_changed = ChangedProtectors(*base, *after_join);
    EXPECT_LE(join_changed, copies * (domain_size(joined, extra.failure_domain) + 1));

    const PlannerNode gone = nodes[rng() % nodes.size()];
    std::vector<PlannerNode> left;
    for (const PlannerNode& x : nodes) {
      if (x.id != gone.id) left.push_back(x);
    }
    auto after_leave = PlanPlacement(left, policy);
    ASSERT_TRUE(after_leave.ok());
    const int leave_changed = ChangedProtectors(*base, *after_leave);
    EXPECT_LE(leave_changed, copies * (domain_size(nodes, gone.failure_domain) + 1));

    changed_total += join_changed + leave_changed;
    nodes_total += 2 * n;
  }
  // Most nodes keep their protectors.
  EXPECT_LT(static_cast<double>(changed_total) / nodes_total, 0.5);
}

// ---------------------------------------------------------------------------
// Stripe layout
// ---------------------------------------------------------------------------

TEST(StripeLayout, RotatesParityAsInTheDesign) {
  // Group of exactly k+m: stripe s has parity on members s..s+m-1 (mod n) and
  // data on the other k members in member order; member j's segment t goes to
  // the t-th stripe in which j holds data.
  for (auto [k, m] : std::vector<std::pair<int, int>>{{4, 2}, {2, 1}, {8, 3}, {1, 1}, {3, 5}}) {
    const int n = k + m;
    auto layout = StripeLayout::Create(n, k, m);
    ASSERT_TRUE(layout.ok()) << layout.status();
    std::vector<int> next_segment(n, 0);
    for (int s = 0; s < n; ++s) {
      const EcStripe& stripe = layout->stripes()[s];
      std::vector<int> parity, data;
      for (int p = 0; p < m; ++p) parity.push_back((s + p) % n);
      for (int j = 0; j < n; ++j) {
        if (std::find(parity.begin(), parity.end(), j) == parity.end()) data.push_back(j);
      }
      EXPECT_EQ(stripe.parity_members, parity);
      ASSERT_EQ(stripe.data.size(), data.size());
      for (size_t d = 0; d < data.size(); ++d) {
        EXPECT_EQ(stripe.data[d], (DataSlot{data[d], next_segment[data[d]]++}));
        EXPECT_EQ(layout->SegmentOf(data[d], stripe.data[d].segment),
                  (StripeSlot{s, static_cast<int>(d)}));
      }
    }
    for (int j = 0; j < n; ++j) EXPECT_EQ(next_segment[j], k);
  }
  // ec{4,2}: stripe 0 has parity on 0,1 and segment 0 of members 2..5; member
  // 0 holds data in stripes 1..4, member 5 in stripes 0..3.
  auto layout = StripeLayout::Create(6, 4, 2);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->stripes()[0].parity_members, (std::vector<int>{0, 1}));
  EXPECT_EQ(layout->stripes()[0].data,
            (std::vector<DataSlot>{{2, 0}, {3, 0}, {4, 0}, {5, 0}}));
  EXPECT_EQ(layout->stripes()[5].parity_members, (std::vector<int>{5, 0}));
  EXPECT_EQ(layout->SegmentOf(0, 0), (StripeSlot{1, 0}));
  EXPECT_EQ(layout->SegmentOf(5, 3), (StripeSlot{3, 3}));
  ASSERT_EQ(layout->ParityOf(0).size(), 2u);
  EXPECT_EQ(layout->ParityOf(0)[0], (StripeSlot{0, 0}));
  EXPECT_EQ(layout->ParityOf(0)[1], (StripeSlot{5, 1}));
}

TEST(StripeLayout, RejectsBadShapes) {
  EXPECT_EQ(StripeLayout::Create(5, 4, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StripeLayout::Create(40, 33, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StripeLayout::Create(40, 4, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(StripeLayout::Create(11, 4, 2).ok());
}

}  // namespace
}  // namespace ckpt::meta
