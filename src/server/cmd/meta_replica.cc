#include "server/cmd/meta_replica.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/crypto.h"
#include "common/log.h"
#include "server/cmd/daemon.h"
#include "server/cmd/data_plane_key.h"

#if CKPT_HAVE_ETCD
#include "server/meta/etcd/etcd_client.h"
#include "server/meta/etcd/etcd_election.h"
#include "server/meta/etcd/etcd_session.h"
#include "server/meta/etcd/meta_log.h"
#include "server/meta/etcd/replicated_store.h"
#endif

namespace ckpt::daemon {
namespace {

bool ValidName(const std::string& s) {
  return !s.empty() && s != "." && s != ".." && std::all_of(s.begin(), s.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
}

// Outside MetaCore's record prefixes (records.h), beside the log's own key.
constexpr char kReplicatedDataPlaneKey[] = "~replica/data_plane_key";

}  // namespace

absl::StatusOr<std::string> LoadOrCreateReplicatedDataPlaneKey(meta::MetaStore* store) {
  absl::StatusOr<std::string> key = store->Get(kReplicatedDataPlaneKey);
  if (key.ok()) {
    if (key->size() != kDataPlaneKeyBytes) {
      return absl::DataLossError(absl::StrCat("the replicated data-plane key has ", key->size(), " bytes, not ",
                                              kDataPlaneKeyBytes));
    }
    return key;
  }
  if (!absl::IsNotFound(key.status())) return key.status();
  std::string made = RandomBytes(kDataPlaneKeyBytes);
  meta::WriteBatch batch;
  batch.Put(kReplicatedDataPlaneKey, made);
  if (absl::Status s = store->Commit(std::move(batch)); !s.ok()) return s;
  return made;
}

absl::StatusOr<ReplicaSettings> ParseReplicaOf(const std::string& url) {
  constexpr std::string_view kScheme = "etcd://";
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("replica_of '", url, "': ", why,
                                                   "; expected etcd://HOST:PORT[,HOST:PORT...]/PREFIX, "
                                                   "e.g. etcd://10.0.0.1:2379,10.0.0.2:2379/ckpt/prod"));
  };
  if (url.substr(0, kScheme.size()) != kScheme) return bad("not an etcd:// address");
  const std::string rest = url.substr(kScheme.size());
  const size_t slash = rest.find('/');
  if (slash == std::string::npos) return bad("no prefix after the members");
  ReplicaSettings out;
  for (const std::string& member : std::vector<std::string>(absl::StrSplit(rest.substr(0, slash), ','))) {
    if (absl::Status s = ValidateHostPort("replica_of", member); !s.ok()) return bad(std::string(s.message()));
    out.endpoints.push_back(member);
  }
  out.root = rest.substr(slash);
  while (out.root.size() > 1 && out.root.back() == '/') out.root.pop_back();
  for (const std::string& part : std::vector<std::string>(absl::StrSplit(out.root.substr(1), '/'))) {
    if (!ValidName(part)) return bad(absl::StrCat("prefix element '", part, "' is not a name of [A-Za-z0-9._-]"));
  }
  return out;
}

#if !CKPT_HAVE_ETCD

bool ReplicasSupported() { return false; }

absl::StatusOr<std::unique_ptr<MetaReplica>> MetaReplica::Start(const ReplicaSettings&, meta::MetaStore*) {
  return absl::UnimplementedError(
      "this ckpt-meta was built without the etcd client (Debian package golang-etcd-server-dev at build time)");
}

#else

bool ReplicasSupported() { return true; }

namespace {

constexpr absl::Duration kCampaignSlice = absl::Milliseconds(500);
// How long a starting replica keeps trying etcd's members before it exits.
constexpr absl::Duration kJoinPatience = absl::Seconds(30);

class EtcdReplica : public MetaReplica {
 public:
  EtcdReplica(ReplicaSettings settings, meta::MetaStore* local) : settings_(std::move(settings)), local_(local) {}

  ~EtcdReplica() override {
    if (follower_ != nullptr) follower_->Stop();
    store_.reset();  // writes what is queued (fails at once if the lease is lost)
    std::shared_ptr<Candidacy> c = candidacy();
    if (c == nullptr) return;
    // A lost lease: nothing to resign or revoke (etcd may be unreachable, and
    // each try would wait out its deadline before this process could exit).
    if (!c->session->status().ok()) return;
    if (leading()) {
      if (absl::Status s = c->election->Resign(); !s.ok()) log::Warn("ckpt-meta: resigning: {}", s.ToString());
    }
    (void)c->session->Close();  // our keys go now, not a lease later
  }

  absl::Status Init() {
    meta::EtcdOptions options;
    options.endpoints = settings_.endpoints;
    options.credentials = settings_.credentials;
    absl::StatusOr<std::unique_ptr<meta::EtcdClient>> etcd = meta::EtcdClient::Create(options);
    if (!etcd.ok()) return etcd.status();
    etcd_ = std::move(*etcd);
    // etcd may be out of reach for a moment (a member rejoining after a cut
    // takes calls before it can answer them): keep trying the members for a
    // while before giving up.
    absl::StatusOr<std::shared_ptr<Candidacy>> c;
    const absl::Time give_up = absl::Now() + kJoinPatience;
    for (bool warned = false;; warned = true) {
      c = NewCandidacy();
      if (c.ok() || !(absl::IsUnavailable(c.status()) || absl::IsDeadlineExceeded(c.status())) ||
          absl::Now() >= give_up) {
        break;
      }
      if (!warned) {
        log::Warn("ckpt-meta: joining the replicas on etcd: {}; trying the members for up to {}",
                  c.status().ToString(), absl::FormatDuration(kJoinPatience));
      }
      absl::SleepFor(absl::Milliseconds(200));
    }
    if (!c.ok()) return c.status();
    {
      absl::MutexLock lock(&mu_);
      candidacy_ = std::move(*c);
    }
    absl::StatusOr<std::unique_ptr<meta::LogFollower>> follower =
        meta::LogFollower::Create(local_, etcd_.get(), settings_.root);
    if (!follower.ok()) return follower.status();
    follower_ = std::move(*follower);
    follower_->Start();
    log::Info("ckpt-meta: replica of etcd {} {} (lease {} s): following the log from index {}",
              absl::StrJoin(settings_.endpoints, ","), settings_.root, absl::ToInt64Seconds(candidacy()->session->ttl()),
              follower_->applied_index() + 1);
    return absl::OkStatus();
  }

  absl::Status Lead(StopRequest* stop) override {
    std::string last_error;
    std::shared_ptr<Candidacy> c = candidacy();
    for (;;) {
      if (stop->requested()) return absl::CancelledError("stopping");
      if (absl::Status s = follower_->status(); !s.ok()) return absl::FailedPreconditionError(s.message());
      const absl::Status s = c->election->Campaign(settings_.name, kCampaignSlice);
      if (s.ok()) break;
      if (absl::IsFailedPrecondition(s)) {
        // Our lease lapsed while we followed (the etcd member we talked to
        // was cut off, or lost its quorum): a follower has nothing to fence,
        // so it queues again with a new lease instead of exiting.
        log::Warn("ckpt-meta: campaigning: {}; queueing again with a new lease", s.ToString());
        absl::StatusOr<std::shared_ptr<Candidacy>> renewed = NewCandidacy();
        if (!renewed.ok()) {
          if (renewed.status().ToString() != last_error) {
            log::Warn("ckpt-meta: campaigning: a new lease: {}", renewed.status().ToString());
            last_error = renewed.status().ToString();
          }
          absl::SleepFor(kCampaignSlice);
          continue;
        }
        c = std::move(*renewed);
        absl::MutexLock lock(&mu_);
        candidacy_ = c;  // the old one is freed by its last user
        continue;
      }
      if (!absl::IsDeadlineExceeded(s) && s.ToString() != last_error) {
        log::Warn("ckpt-meta: campaigning: {}", s.ToString());
        last_error = s.ToString();
      }
      absl::StatusOr<meta::EtcdKeyValue> leader = c->election->Leader();
      absl::MutexLock lock(&mu_);
      leader_name_ = leader.ok() ? leader->value : "unknown";
    }
    // We lead: nobody else appends now. Apply what the follower has not.
    follower_->Stop();
    absl::StatusOr<uint64_t> next;
    for (;;) {
      next = follower_->CatchUp();
      // Aborted: a snapshot replaced the log we were reading; read again.
      if (next.ok() || !(absl::IsUnavailable(next.status()) || absl::IsDeadlineExceeded(next.status()) ||
                         absl::IsAborted(next.status()))) {
        break;
      }
      if (!c->session->status().ok()) return absl::FailedPreconditionError(c->session->status().message());
      absl::SleepFor(absl::Milliseconds(100));
    }
    if (!next.ok()) return absl::FailedPreconditionError(absl::StrCat("catching up with the log: ", next.status().message()));
    store_ = std::make_unique<meta::ReplicatedMetaStore>(local_, etcd_.get(), c->election.get(), settings_.root, *next);
    {
      absl::MutexLock lock(&mu_);
      leading_ = true;
    }
    log::Info("ckpt-meta: leading {} from log index {} (election key {})", settings_.root, *next, c->election->key());
    return absl::OkStatus();
  }

  meta::MetaStore* store() override { return store_.get(); }

  void Publish() override {
    const absl::StatusOr<int64_t> put =
        etcd_->Put(absl::StrCat(settings_.root, "/replicas/", settings_.name), absl::StrCat(applied_index()),
                   candidacy()->session->lease_id());
    if (put.ok() == publish_ok_) return;
    publish_ok_ = put.ok();
    if (!put.ok()) log::Warn("ckpt-meta: cannot publish this replica's progress in etcd: {}", put.status().ToString());
  }

  absl::StatusOr<std::vector<View>> Replicas() override {
    const std::string dir = absl::StrCat(settings_.root, "/replicas/");
    meta::EtcdRange range;
    range.range_end = meta::EtcdPrefixEnd(dir);
    absl::StatusOr<meta::EtcdRangeResult> r = etcd_->Range(dir, range);
    if (!r.ok()) return r.status();
    absl::StatusOr<meta::EtcdKeyValue> leader = candidacy()->election->Leader();
    std::vector<View> out;
    for (const meta::EtcdKeyValue& kv : r->kvs) {
      View v;
      v.name = kv.key.substr(dir.size());
      v.leader = leader.ok() && leader->value == v.name;
      (void)absl::SimpleAtoi(kv.value, &v.applied_index);
      out.push_back(std::move(v));
    }
    return out;
  }

  absl::Status WaitLost(absl::Duration timeout) override { return candidacy()->session->WaitLost(timeout); }

  std::string Role() override {
    absl::MutexLock lock(&mu_);
    return leading_ ? "leader" : absl::StrCat("follower (leader: ", leader_name_, ")");
  }
  bool leading() override {
    absl::MutexLock lock(&mu_);
    return leading_;
  }
  uint64_t applied_index() override {
    if (store_ != nullptr && leading()) return store_->replica_stats().last_index;
    return follower_->applied_index();
  }
  uint64_t entries_appended() override { return leading() ? store_->replica_stats().entries_appended : 0; }
  uint64_t groups_appended() override { return leading() ? store_->replica_stats().groups : 0; }
  double append_seconds() override { return leading() ? store_->replica_stats().append_seconds : 0; }

 private:
  const ReplicaSettings settings_;
  meta::MetaStore* const local_;
  // A lease and our place in the election under it. Replaced (by Lead, while
  // following) when the lease lapses; readers copy the pointer under mu_.
  struct Candidacy {
    std::unique_ptr<meta::EtcdSession> session;
    std::unique_ptr<meta::EtcdElection> election;  // on `session`
  };
  absl::StatusOr<std::shared_ptr<Candidacy>> NewCandidacy() {
    absl::StatusOr<std::unique_ptr<meta::EtcdSession>> session = meta::EtcdSession::Create(etcd_.get(), settings_.lease);
    if (!session.ok()) return session.status();
    auto c = std::make_shared<Candidacy>();
    c->session = std::move(*session);
    c->election = std::make_unique<meta::EtcdElection>(etcd_.get(), c->session.get(),
                                                         meta::replica::LeaderPrefix(settings_.root));
    return c;
  }
  std::shared_ptr<Candidacy> candidacy() {
    absl::MutexLock lock(&mu_);
    return candidacy_;
  }

  std::unique_ptr<meta::EtcdClient> etcd_;
  std::unique_ptr<meta::LogFollower> follower_;
  std::unique_ptr<meta::ReplicatedMetaStore> store_;  // set once by Lead, before leading_

  bool publish_ok_ = true;  // Publish's caller only

  absl::Mutex mu_;
  bool leading_ ABSL_GUARDED_BY(mu_) = false;
  std::string leader_name_ ABSL_GUARDED_BY(mu_) = "unknown";
  std::shared_ptr<Candidacy> candidacy_ ABSL_GUARDED_BY(mu_);  // set by Init
};

}  // namespace

absl::StatusOr<std::unique_ptr<MetaReplica>> MetaReplica::Start(const ReplicaSettings& settings,
                                                                 meta::MetaStore* local) {
  auto r = std::make_unique<EtcdReplica>(settings, local);
  if (absl::Status s = r->Init(); !s.ok()) return s;
  return std::unique_ptr<MetaReplica>(std::move(r));
}

#endif

}  // namespace ckpt::daemon
