#include "server/agent/agent.h"

#include <sys/types.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/crc32c.h"
#include "common/durable_format.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt::agent {
namespace {

constexpr uint64_t kFlushChunkBytes = 8 << 20;
constexpr size_t kMaxReportBatch = 512;
constexpr size_t kCommittedLeaseMemory = 4096;
constexpr int kCopyStateValid = 2;
constexpr int kCopyStateCorrupt = 3;

bool ProcessGone(uint32_t pid) {
  if (pid == 0) return false;
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

std::string FormatBytes(uint64_t b) {
  if (b >= (uint64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / double(uint64_t{1} << 30));
  if (b >= (uint64_t{1} << 20)) return absl::StrFormat("%.1f MiB", b / double(uint64_t{1} << 20));
  return absl::StrCat(b, " bytes");
}

// Splits a relative durable path ("job/7/rank-00000.bin") into validated
// components and joins it under the root.
absl::StatusOr<std::string> UnderRoot(const std::string& root, const std::string& rel) {
  std::vector<std::string> parts = absl::StrSplit(rel, '/');
  return JoinUnderRoot(root, std::span<const std::string>(parts));
}


}  // namespace

absl::StatusOr<std::unique_ptr<Agent>> Agent::Create(const AgentOptions& options, MetaLink* meta,
                                                     Clock* clock, FileSystem* durable_fs,
                                                     MetricsRegistry* metrics) {
  CKPT_RETURN_IF_ERROR(ValidateNodeId(options.node_id));
  std::unique_ptr<Agent> agent(new Agent(options, meta, clock, durable_fs, metrics));
  CKPT_RETURN_IF_ERROR(agent->Init());
  CKPT_RETURN_IF_ERROR(agent->StartDataPlane());
  return agent;
}

Agent::Agent(const AgentOptions& options, MetaLink* meta, Clock* clock, FileSystem* durable_fs,
             MetricsRegistry* metrics)
    : options_(options),
      meta_(meta),
      clock_(clock),
      durable_fs_(durable_fs),
      started_(clock->MonotonicNow()) {
  MetricsRegistry& m = *metrics;
  m_staged_bytes_ = &m.AddCounter("ckpt_agent_staged_bytes_total", "Bytes of shards committed by local clients");
  m_staged_shards_ = &m.AddCounter("ckpt_agent_staged_shards_total", "Shards committed by local clients");
  m_flush_bytes_ = &m.AddCounter("ckpt_agent_flush_bytes_total", "Bytes written to the durable tier");
  m_flush_shards_ = &m.AddCounter("ckpt_agent_flush_shards_total", "Rank files written to the durable tier");
  m_flush_errors_ = &m.AddCounter("ckpt_agent_flush_errors_total", "Failed durable-tier writes (each retry counts)");
  m_corrupt_ = &m.AddCounter("ckpt_agent_corrupt_copies_total", "Holdings whose bytes failed their crc32c");
  m_lease_rejected_ = &m.AddCounter("ckpt_agent_lease_rejected_total", "Staging leases refused for lack of memory");
  m_meta_errors_ = &m.AddCounter("ckpt_agent_meta_errors_total", "Failed calls to ckpt-meta");
  m_peer_sent_bytes_ = &m.AddCounter("ckpt_agent_peer_sent_bytes_total", "Bytes sent to peers (pushes and reads served)");
  m_peer_received_bytes_ =
      &m.AddCounter("ckpt_agent_peer_received_bytes_total", "Bytes received from peers (pushes and reads)");
  m_replicas_stored_ = &m.AddCounter("ckpt_agent_replicas_stored_total", "Replica copies received and stored");
  m_parity_stored_ = &m.AddCounter("ckpt_agent_parity_segments_total", "EC parity segments completed on this node");
  m_segments_rebuilt_ = &m.AddCounter("ckpt_agent_segments_rebuilt_total", "EC segments rebuilt on this node");
  m_peer_restores_ =
      &m.AddCounter("ckpt_agent_peer_restores_total", "Shards restored from a peer replica or by EC decode");
  m_peer_errors_ = &m.AddCounter("ckpt_agent_peer_errors_total", "Failed pushes, reads and decodes");
  m_used_ = &m.AddGauge("ckpt_agent_memory_used_bytes", "Memory-tier bytes in use (holdings and leases)");
  m_free_ = &m.AddGauge("ckpt_agent_memory_free_bytes", "Memory-tier bytes free");
  m_leased_ = &m.AddGauge("ckpt_agent_memory_leased_bytes", "Memory-tier bytes reserved by open staging leases");
  m_capacity_ = &m.AddGauge("ckpt_agent_memory_capacity_bytes", "Memory-tier capacity");
  m_flush_lag_bytes_ = &m.AddGauge("ckpt_agent_flush_lag_bytes", "Bytes chosen for flush and not yet durable");
  m_flush_lag_seconds_ = &m.AddGauge("ckpt_agent_flush_lag_seconds", "Age of the oldest shard waiting to be flushed");
  m_holdings_ = &m.AddGauge("ckpt_agent_holdings", "Committed shard copies held in memory");
  m_registered_ = &m.AddGauge("ckpt_agent_registered", "1 while registered with ckpt-meta");
}

absl::Status Agent::Init() {
  Arena::Options ao;
  ao.dir = options_.memory_dir;
  ao.capacity_bytes = options_.memory_bytes;
  ao.populate = options_.populate;
  CKPT_ASSIGN_OR_RETURN(arena_, Arena::Open(ao));
  {
    std::ifstream in(options_.memory_dir + "/incarnation");
    uint64_t inc = 0;
    if (in >> inc) {
      absl::MutexLock lock(&mu_);
      previous_incarnation_ = inc;
    }
  }
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->MonotonicNow();
  for (const ShardRecord& rec : arena_->adopted()) {
    if (rec.segment) {
      SegHolding sh;
      sh.rec = rec;
      segments_.emplace(*rec.segment, std::move(sh));
      continue;
    }
    Holding h;
    h.rec = rec;
    h.verified = true;  // Open() checked the crc
    h.committed_at = now;
    if (rec.role == 1) {
      // The STAGED report may not have reached meta before the restart; a
      // replay is answered ALREADY_EXISTS.
      HoldingReport r;
      r.kind = HoldingReport::Kind::kStaged;
      r.record = rec;
      QueueReportLocked(std::move(r));
    }
    holdings_.emplace(rec.id, std::move(h));
  }
  if (!arena_->adopted().empty() || !arena_->lost().empty()) {
    log::Info("memory tier: re-adopted {} holdings, {} lost", arena_->adopted().size(),
              arena_->lost().size());
  }
  m_capacity_->Set(static_cast<double>(arena_->capacity_bytes()));
  return absl::OkStatus();
}

Agent::~Agent() { Stop(); }

void Agent::Start() {
  threads_.emplace_back([this] { Loop("ckpt-agent-ctl", absl::Milliseconds(50), &Agent::ControlRound); });
  threads_.emplace_back([this] { Loop("ckpt-agent-vfy", absl::Milliseconds(200), &Agent::VerifyOnce); });
  threads_.emplace_back([this] { Loop("ckpt-agent-task", absl::Milliseconds(100), &Agent::TasksOnce); });
  threads_.emplace_back([this] { WatchLoop(); });
  for (int i = 0; i < 2; ++i) {
    threads_.emplace_back([this] {
      pthread_setname_np(pthread_self(), "ckpt-agent-peer");
      WorkLoop();
    });
  }
}

// Keeps meta's task stream open for the current incarnation, so tasks start
// as soon as meta creates them (heartbeats deliver them too, later).
void Agent::WatchLoop() {
  pthread_setname_np(pthread_self(), "ckpt-agent-wtch");
  while (true) {
    uint64_t inc;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || registered_; };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      inc = incarnation_;
    }
    absl::Status s = meta_->WatchTasks(options_.node_id, inc, [this](std::vector<AgentTask> tasks,
                                                                     std::vector<std::string> cancelled) {
      absl::MutexLock lock(&mu_);
      for (const std::string& id : cancelled) {
        if (running_now_.count(id) == 0) tasks_.erase(id);
        finished_tasks_.insert(id);
      }
      EnqueueTasksLocked(std::move(tasks));
    });
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    if (absl::IsUnimplemented(s)) return;  // no stream: heartbeats deliver tasks
    log::Debug("task stream ended: {}", s.ToString());
    // Reopen after a pause (or at once after re-registration).
    const uint64_t seen = incarnation_;
    auto changed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || incarnation_ != seen; };
    clock_->AwaitWithTimeout(&mu_, absl::Condition(&changed), absl::Seconds(1));
  }
}

void Agent::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    ++wake_;
  }
  meta_->CancelWatch();
  // No transport callback may run once the agent is gone; in-flight peer
  // waits then fail with Cancelled/Unavailable and the loops wind down.
  if (data_plane_started_) options_.transport->Stop();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

bool Agent::ControlRound() {
  ControlOnce();
  return false;
}

void Agent::Loop(const char* name, absl::Duration idle, bool (Agent::*once)()) {
  pthread_setname_np(pthread_self(), name);
  while (true) {
    uint64_t seen;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      seen = wake_;
    }
    const bool did = (this->*once)();
    if (did) continue;
    absl::MutexLock lock(&mu_);
    auto woken = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || wake_ != seen; };
    clock_->AwaitWithTimeout(&mu_, absl::Condition(&woken), idle);
  }
}

// ---------------------------------------------------------------------------
// Save path

std::vector<Region> Agent::RegionsFor(const std::vector<Extent>& extents, uint64_t size) const {
  std::vector<Region> out;
  uint64_t shard_off = 0;
  for (const Extent& e : extents) {
    if (shard_off >= size) break;
    const uint64_t len = std::min(e.length, size - shard_off);
    out.push_back(Region{arena_->pool_path(), e.offset, len, shard_off});
    shard_off += len;
  }
  return out;
}

uint64_t Agent::LeasedBytesLocked() const {
  uint64_t total = 0;
  for (const auto& [id, l] : leases_) {
    for (const Extent& e : l.extents) total += e.length;
  }
  return total;
}

std::string Agent::BudgetMessageLocked(uint64_t want) const {
  std::map<std::pair<std::string, uint64_t>, std::pair<uint64_t, int>> by_version;
  for (const auto& [id, h] : holdings_) {
    auto& v = by_version[{id.job_id, id.step}];
    for (const Extent& e : h.rec.extents) v.first += e.length;
    v.second++;
  }
  std::string held;
  int shown = 0;
  for (const auto& [key, v] : by_version) {
    if (shown++ == 8) {
      absl::StrAppend(&held, ", ...");
      break;
    }
    absl::StrAppend(&held, shown > 1 ? ", " : "", key.first, " step ", key.second, ": ",
                    FormatBytes(v.first), " (", v.second, v.second == 1 ? " shard)" : " shards)");
  }
  if (held.empty()) held = "no committed versions";
  const uint64_t leased = LeasedBytesLocked();
  return absl::StrCat("memory tier cannot hold ", FormatBytes(want), ": ", FormatBytes(arena_->free_bytes()),
                      " free of ", FormatBytes(arena_->capacity_bytes()), " (largest free run ",
                      FormatBytes(arena_->largest_free_extent()), "); held by ", held, "; open leases: ",
                      FormatBytes(leased), " in ", leases_.size(),
                      ". Older versions are evicted when meta's retention allows it (a newer version "
                      "PROTECTED); raise --memory or lower retention.keep_in_memory");
}

absl::StatusOr<LeaseGrant> Agent::AcquireLease(const LeaseRequest& req) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(req.job_id));
  if (req.size_bytes == 0) return absl::InvalidArgumentError("size_bytes must be larger than 0");
  if (req.size_bytes > arena_->capacity_bytes()) {
    m_lease_rejected_->Increment();
    return absl::ResourceExhaustedError(absl::StrCat(
        "a shard of ", FormatBytes(req.size_bytes), " is larger than the whole memory tier (",
        FormatBytes(arena_->capacity_bytes()), "); raise --memory"));
  }
  const ShardId id{req.job_id, req.step, req.rank};
  const auto begun_key = std::make_tuple(req.job_id, req.step, req.run_id);
  std::optional<uint32_t> world_size;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("agent is shutting down");
    auto h = holdings_.find(id);
    if (h != holdings_.end() && !h->second.corrupt) {
      return absl::AlreadyExistsError(absl::StrCat("shard ", ShardIdString(id),
                                                   " is already committed on this node"));
    }
    auto b = begun_.find(begun_key);
    if (b != begun_.end()) world_size = b->second;
    auto j = job_world_.find(req.job_id);
    if (!world_size && j != job_world_.end()) world_size = j->second;
  }
  if (!world_size) {
    // First save of the job on this node: a read-only look-up at meta, so an
    // unknown job is the lease's error (no write, no fsync on this path).
    absl::StatusOr<uint32_t> ws = meta_->JobWorldSize(req.job_id);
    if (!ws.ok()) {
      if (absl::IsUnavailable(ws.status()) || absl::IsDeadlineExceeded(ws.status())) m_meta_errors_->Increment();
      return ws.status();
    }
    world_size = *ws;
  }
  if (req.rank >= *world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", req.rank, " is out of range: job ", req.job_id,
                                                   " has world size ", *world_size));
  }
  {
    absl::MutexLock lock(&mu_);
    job_world_[req.job_id] = *world_size;
    if (begun_.emplace(begun_key, *world_size).second) {
      // Begin the version at meta in the background, before its STAGED
      // reports: a save never waits for meta's fsync, nor for meta at all
      // once the job is known here.
      Outbound o;
      o.kind = Outbound::Kind::kBegin;
      o.report.id = ShardId{req.job_id, req.step, 0};
      o.run_id = req.run_id;
      outbox_.push_back(std::move(o));
      ++wake_;
    }
  }
  absl::MutexLock lock(&mu_);
  // A trainer restarted mid-copy: its old lease for this rank is void.
  if (auto old = lease_of_shard_.find(id); old != lease_of_shard_.end()) {
    auto l = leases_.find(old->second);
    if (l != leases_.end()) {
      log::Info("lease {} for {} replaced by a new lease", l->first, ShardIdString(id));
      arena_->Free(l->second.extents);
      leases_.erase(l);
    }
    lease_of_shard_.erase(old);
  }
  absl::StatusOr<std::vector<Extent>> extents = arena_->Allocate(req.size_bytes);
  if (!extents.ok()) {
    m_lease_rejected_->Increment();
    return absl::ResourceExhaustedError(BudgetMessageLocked(req.size_bytes));
  }
  Lease l;
  l.id = absl::StrFormat("l-%x-%d", absl::ToUnixNanos(clock_->Now()) & 0xffffffffff, next_id_++);
  l.shard = id;
  l.size_bytes = req.size_bytes;
  l.extents = *std::move(extents);
  l.run_id = req.run_id;
  l.client_pid = req.client_pid;
  const int64_t ttl = req.ttl_ms > 0 ? req.ttl_ms : options_.default_lease_ttl_ms;
  l.expires = clock_->MonotonicNow() + absl::Milliseconds(ttl);
  LeaseGrant grant;
  grant.lease_id = l.id;
  grant.regions = RegionsFor(l.extents, l.size_bytes);
  grant.expires_in_ms = ttl;
  grant.item_alignment_bytes = options_.item_alignment_bytes;
  lease_of_shard_[id] = l.id;
  leases_.emplace(l.id, std::move(l));
  UpdateGauges();
  return grant;
}

uint32_t Agent::RangeCrc(const std::vector<Extent>& extents, uint64_t offset, uint64_t length) const {
  uint32_t crc = 0;
  uint64_t pos = 0;  // shard offset of the current extent
  for (const Extent& e : extents) {
    if (length == 0) break;
    const uint64_t end = pos + e.length;
    if (offset < end) {
      const uint64_t in = offset - pos;
      const uint64_t n = std::min(length, e.length - in);
      crc = Crc32cExtend(crc, arena_->Data(e.offset + in), n);
      offset += n;
      length -= n;
    }
    pos = end;
  }
  return crc;
}

absl::StatusOr<ShardRecord> Agent::Commit(const std::string& lease_id, uint64_t size_bytes,
                                          std::vector<ManifestItem> items) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) {
    if (committed_leases_.count(lease_id) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("lease ", lease_id, " is already committed"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("lease \"", lease_id, "\" is unknown, aborted or expired; acquire a new one"));
  }
  Lease& l = it->second;
  if (size_bytes == 0) size_bytes = l.size_bytes;
  if (size_bytes > l.size_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("commit of ", size_bytes, " bytes exceeds the lease's ",
                                                   l.size_bytes, " bytes"));
  }
  CKPT_RETURN_IF_ERROR(ValidateManifest(items, size_bytes));
  items = SortedByOffset(items);
  // The shard crc from the items' crcs and the padding between them: no pass
  // over the item bytes (the verifier does that in the background).
  uint32_t crc = 0;
  uint64_t pos = 0;
  for (const ManifestItem& item : items) {
    if (item.offset_bytes > pos) {
      crc = Crc32cCombine(crc, RangeCrc(l.extents, pos, item.offset_bytes - pos), item.offset_bytes - pos);
    }
    crc = Crc32cCombine(crc, item.crc32c, item.length_bytes);
    pos = item.offset_bytes + item.length_bytes;
  }
  if (size_bytes > pos) crc = Crc32cCombine(crc, RangeCrc(l.extents, pos, size_bytes - pos), size_bytes - pos);

  ShardRecord rec;
  rec.id = l.shard;
  rec.role = 1;
  rec.size_bytes = size_bytes;
  rec.crc32c = crc;
  rec.manifest_digest = ManifestDigest(items);
  rec.items = std::move(items);
  rec.extents = arena_->Trim(std::move(l.extents), size_bytes);
  rec.run_id = l.run_id;
  rec.staged_unix_ms = clock_->NowUnixMillis();
  l.extents = rec.extents;
  if (absl::Status s = arena_->WriteRecord(rec); !s.ok()) {
    log::Error("cannot record shard {}: {}", ShardIdString(rec.id), s.ToString());
    return absl::UnavailableError(absl::StrCat("cannot record the shard in the memory tier: ", s.message()));
  }
  lease_of_shard_.erase(l.shard);
  leases_.erase(it);
  committed_leases_[lease_id] = rec.id;
  if (committed_leases_.size() > kCommittedLeaseMemory) committed_leases_.erase(committed_leases_.begin());
  Holding h;
  h.rec = rec;
  h.committed_at = clock_->MonotonicNow();
  holdings_[rec.id] = std::move(h);
  verify_queue_.push_back(rec.id);
  HoldingReport r;
  r.kind = HoldingReport::Kind::kStaged;
  r.record = rec;
  QueueReportLocked(std::move(r));
  ++wake_;
  m_staged_bytes_->Increment(static_cast<double>(size_bytes));
  m_staged_shards_->Increment();
  UpdateGauges();
  return rec;
}

absl::Status Agent::AbortLease(const std::string& lease_id) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) {
    if (committed_leases_.count(lease_id) != 0) {
      return absl::FailedPreconditionError(absl::StrCat("lease ", lease_id, " is committed"));
    }
    return absl::OkStatus();
  }
  arena_->Free(it->second.extents);
  lease_of_shard_.erase(it->second.shard);
  leases_.erase(it);
  UpdateGauges();
  return absl::OkStatus();
}

void Agent::QueueReportLocked(HoldingReport report) {
  Outbound o;
  o.report = std::move(report);
  outbox_.push_back(std::move(o));
  ++wake_;
}

// ---------------------------------------------------------------------------
// Restore path

absl::Status Agent::CheckBytes(const ShardRecord& rec, uint32_t* actual_crc, std::string* bad_item) const {
  uint32_t crc = 0;
  uint64_t pos = 0;
  absl::Status first_bad = absl::OkStatus();
  for (const ManifestItem& item : rec.items) {
    if (item.offset_bytes > pos) {
      crc = Crc32cCombine(crc, RangeCrc(rec.extents, pos, item.offset_bytes - pos), item.offset_bytes - pos);
    }
    const uint32_t c = RangeCrc(rec.extents, item.offset_bytes, item.length_bytes);
    if (c != item.crc32c && first_bad.ok()) {
      if (bad_item != nullptr) *bad_item = item.name;
      first_bad = absl::DataLossError(absl::StrFormat(
          "shard %s item %s: crc32c 0x%08x != manifest 0x%08x", ShardIdString(rec.id),
          QuoteForMessage(item.name), c, item.crc32c));
    }
    crc = Crc32cCombine(crc, c, item.length_bytes);
    pos = item.offset_bytes + item.length_bytes;
  }
  if (rec.size_bytes > pos) crc = Crc32cCombine(crc, RangeCrc(rec.extents, pos, rec.size_bytes - pos), rec.size_bytes - pos);
  if (actual_crc != nullptr) *actual_crc = crc;
  if (!first_bad.ok()) return first_bad;
  if (crc != rec.crc32c) {
    return absl::DataLossError(absl::StrFormat("shard %s: crc32c 0x%08x != recorded 0x%08x (padding changed)",
                                               ShardIdString(rec.id), crc, rec.crc32c));
  }
  return absl::OkStatus();
}

void Agent::QuarantineLocked(Holding& h, const std::string& detail) {
  if (h.corrupt) return;
  h.corrupt = true;
  h.corrupt_detail = detail;
  m_corrupt_->Increment();
  log::Error("quarantined corrupt copy of {}: {}", ShardIdString(h.rec.id), detail);
  flush_waiting_.erase(h.rec.id);
  HoldingReport r;
  r.kind = HoldingReport::Kind::kCopyState;
  r.id = h.rec.id;
  r.copy_role = h.rec.role;
  r.copy_state = kCopyStateCorrupt;
  r.size_bytes = h.rec.size_bytes;
  r.crc32c = h.rec.crc32c;
  r.detail = detail;
  QueueReportLocked(std::move(r));
  ++wake_;
}

absl::StatusOr<OpenResult> Agent::OpenShard(const ShardId& id, bool skip_verify, uint32_t client_pid,
                                            int64_t ttl_ms) {
  ShardRecord rec;
  {
    absl::MutexLock lock(&mu_);
    CKPT_ASSIGN_OR_RETURN(Holding * h, ValidHoldingLocked(id));
    h->pins++;
    rec = h->rec;
  }
  bool verified = false;
  if (!skip_verify) {
    std::string bad;
    absl::Status s = CheckBytes(rec, nullptr, &bad);
    absl::MutexLock lock(&mu_);
    auto it = holdings_.find(id);
    if (!s.ok()) {
      it->second.pins--;
      QuarantineLocked(it->second, std::string(s.message()));
      return s;
    }
    it->second.verified = true;
    verified = true;
  }
  absl::MutexLock lock(&mu_);
  const int64_t ttl = ttl_ms > 0 ? ttl_ms : options_.default_handle_ttl_ms;
  Handle h;
  h.id = absl::StrFormat("h-%x-%d", absl::ToUnixNanos(clock_->Now()) & 0xffffffffff, next_id_++);
  h.shard = id;
  h.client_pid = client_pid;
  h.expires = clock_->MonotonicNow() + absl::Milliseconds(ttl);
  OpenResult out;
  out.handle_id = h.id;
  out.shard.record = rec;
  out.shard.regions = RegionsFor(rec.extents, rec.size_bytes);
  out.verified = verified;
  out.expires_in_ms = ttl;
  handles_.emplace(h.id, std::move(h));
  return out;
}

absl::StatusOr<OpenResult> Agent::RestoreFromDurable(const ShardRecord& expected, const std::string& durable_path,
                                                     uint32_t client_pid, int64_t ttl_ms) {
  const ShardId& id = expected.id;
  bool held;
  {
    absl::MutexLock lock(&mu_);
    auto it = holdings_.find(id);
    held = it != holdings_.end() && !it->second.corrupt && !it->second.evict_pending;
  }
  if (held) return OpenShard(id, false, client_pid, ttl_ms);
  if (options_.durable_root.empty()) {
    return absl::UnavailableError("this agent has no durable tier (--durable-root is not set)");
  }
  CKPT_RETURN_IF_ERROR(ValidateManifest(expected.items, expected.size_bytes));
  CKPT_ASSIGN_OR_RETURN(std::string path, UnderRoot(options_.durable_root, durable_path));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, durable_fs_->NewReadableFile(path));
  if (file->Size() != expected.size_bytes) {
    return absl::DataLossError(absl::StrCat("durable file '", path, "' is ", file->Size(), " bytes, the shard ",
                                            expected.size_bytes));
  }
  std::vector<Extent> extents;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<std::vector<Extent>> e = arena_->Allocate(expected.size_bytes);
    if (!e.ok()) return absl::ResourceExhaustedError(BudgetMessageLocked(expected.size_bytes));
    extents = *std::move(e);
  }
  uint32_t crc = 0;
  uint64_t file_off = 0;
  absl::Status read = absl::OkStatus();
  arena_->ForEachPiece(extents, expected.size_bytes, [&](std::byte* p, uint64_t n) {
    for (uint64_t off = 0; off < n && read.ok(); off += kFlushChunkBytes) {
      const uint64_t len = std::min(kFlushChunkBytes, n - off);
      absl::StatusOr<size_t> got = file->PositionedRead(file_off, std::span<std::byte>(p + off, len));
      if (!got.ok()) {
        read = got.status();
      } else if (*got != len) {
        read = absl::DataLossError(absl::StrCat("durable file '", path, "' ended early"));
      } else {
        crc = Crc32cExtend(crc, p + off, len);
        file_off += len;
      }
    }
  });
  if (read.ok() && crc != expected.crc32c) {
    read = absl::DataLossError(absl::StrFormat("durable file '%s': crc32c 0x%08x != shard 0x%08x", path, crc,
                                               expected.crc32c));
  }
  {
  absl::MutexLock lock(&mu_);
  if (!read.ok()) {
    arena_->Free(extents);
    return read;
  }
  CKPT_RETURN_IF_ERROR(AdoptRestoredLocked(expected, std::move(extents), durable_path, "the durable tier"));
  }
  return OpenShard(id, true, client_pid, ttl_ms);
}

absl::Status Agent::CloseShard(const std::string& handle_id) {
  absl::MutexLock lock(&mu_);
  auto it = handles_.find(handle_id);
  if (it == handles_.end()) return absl::OkStatus();
  const ShardId id = it->second.shard;
  handles_.erase(it);
  UnpinLocked(id);
  return absl::OkStatus();
}

absl::Status Agent::ReadShard(const ShardId& id, uint64_t offset, uint64_t length,
                              const std::function<absl::Status(const std::byte*, uint64_t)>& fn,
                              ShardRecord* record) {
  ShardRecord rec;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Holding*> h = ValidHoldingLocked(id);
    if (!h.ok()) return absl::NotFoundError(h.status().message());
    rec = (*h)->rec;
    if (offset > rec.size_bytes) {
      return absl::OutOfRangeError(absl::StrCat("offset ", offset, " is beyond the shard's ", rec.size_bytes, " bytes"));
    }
    (*h)->pins++;
  }
  if (record != nullptr) *record = rec;
  if (length == 0 || length > rec.size_bytes - offset) length = rec.size_bytes - offset;
  absl::Status result = absl::OkStatus();
  uint64_t pos = 0;
  for (const Extent& e : rec.extents) {
    if (length == 0 || !result.ok()) break;
    const uint64_t end = pos + e.length;
    if (offset < end) {
      const uint64_t in = offset - pos;
      const uint64_t n = std::min(length, e.length - in);
      result = fn(arena_->Data(e.offset + in), n);
      offset += n;
      length -= n;
    }
    pos = end;
  }
  absl::MutexLock lock(&mu_);
  UnpinLocked(id);
  return result;
}

// ---------------------------------------------------------------------------
// Holdings

void Agent::FreeHoldingLocked(const ShardId& id) {
  auto it = holdings_.find(id);
  if (it == holdings_.end()) return;
  if (it->second.pins > 0) {
    it->second.evict_pending = true;
    return;
  }
  if (absl::Status s = arena_->RemoveRecord(id); !s.ok()) {
    log::Error("cannot remove the record of {}: {}", ShardIdString(id), s.ToString());
  }
  arena_->Free(it->second.rec.extents);
  flush_waiting_.erase(id);
  holdings_.erase(it);
  UpdateGauges();
}

absl::StatusOr<Agent::Holding*> Agent::ValidHoldingLocked(const ShardId& id) {
  auto it = holdings_.find(id);
  if (it == holdings_.end() || it->second.evict_pending) {
    return absl::NotFoundError(absl::StrCat("shard ", ShardIdString(id), " is not held by this agent"));
  }
  if (it->second.corrupt) {
    return absl::DataLossError(absl::StrCat("the copy of ", ShardIdString(id),
                                            " on this node is quarantined: ", it->second.corrupt_detail));
  }
  return &it->second;
}

void Agent::UnpinLocked(const ShardId& id) {
  auto it = holdings_.find(id);
  if (it == holdings_.end()) return;
  it->second.pins--;
  if (it->second.evict_pending && it->second.pins == 0) FreeHoldingLocked(id);
}

HoldingInfo Agent::InfoLocked(const Holding& h) const {
  HoldingInfo i;
  i.id = h.rec.id;
  i.role = h.rec.role;
  i.state = h.corrupt ? kCopyStateCorrupt : kCopyStateValid;
  i.size_bytes = h.rec.size_bytes;
  i.crc32c = h.rec.crc32c;
  i.manifest_digest = h.rec.manifest_digest;
  i.stored_unix_ms = h.rec.staged_unix_ms;
  i.durable_path = h.rec.durable_path;
  i.verified = h.verified;
  return i;
}

std::vector<HoldingInfo> Agent::Inventory(const std::string& job_id, std::optional<uint64_t> step) const {
  absl::MutexLock lock(&mu_);
  std::vector<HoldingInfo> out;
  for (const auto& [id, h] : holdings_) {
    if (!job_id.empty() && id.job_id != job_id) continue;
    if (step && id.step != *step) continue;
    out.push_back(InfoLocked(h));
  }
  return out;
}

absl::StatusOr<std::vector<HoldingInfo>> Agent::Evict(const std::string& job_id, uint64_t step, bool dry_run) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job_id));
  if (Inventory(job_id, step).empty()) {
    return absl::NotFoundError(absl::StrCat("nothing of ", job_id, " step ", step, " is held here"));
  }
  CKPT_ASSIGN_OR_RETURN(MetaLink::EvictFacts facts, meta_->GetEvictFacts(job_id, step));
  constexpr int kPersisted = 4, kAborted = 6, kDeleted = 7;
  if (facts.newest_protected_step == step && facts.version_state != kAborted && facts.version_state != kDeleted) {
    return absl::FailedPreconditionError(absl::StrCat(
        job_id, " step ", step, " is the job's newest version at PROTECTED level or better; it is never evicted"));
  }
  if (facts.version_state != kPersisted && facts.version_state != kAborted && facts.version_state != kDeleted) {
    return absl::FailedPreconditionError(absl::StrCat(
        job_id, " step ", step,
        " is not PERSISTED: this node's copy may be the last readable one; flush it first (ckptctl flush) "
        "or let retention evict it"));
  }
  absl::MutexLock lock(&mu_);
  std::vector<HoldingInfo> out;
  std::vector<ShardId> ids;
  for (const auto& [id, h] : holdings_) {
    if (id.job_id != job_id || id.step != step) continue;
    out.push_back(InfoLocked(h));
    ids.push_back(id);
  }
  if (dry_run) return out;
  for (const HoldingInfo& info : out) {
    HoldingReport r;
    r.kind = HoldingReport::Kind::kCopyState;
    r.id = info.id;
    r.copy_role = info.role;
    r.copy_state = 5;  // EVICTED
    r.size_bytes = info.size_bytes;
    r.crc32c = info.crc32c;
    r.detail = "evicted by a node-local command";
    QueueReportLocked(std::move(r));
  }
  for (const ShardId& id : ids) FreeHoldingLocked(id);
  log::Info("evicted {} holdings of {} step {} (node-local command)", ids.size(), job_id, step);
  return out;
}

absl::StatusOr<std::vector<VerifyFinding>> Agent::Verify(const std::string& job_id, uint64_t step, bool dry_run,
                                                         uint64_t* bytes_checked) {
  std::vector<ShardRecord> recs;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, h] : holdings_) {
      if (id.job_id == job_id && id.step == step && !h.evict_pending) {
        h.pins++;
        recs.push_back(h.rec);
      }
    }
  }
  std::vector<ShardRecord> segs;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, h] : segments_) {
      if (id.job_id == job_id && id.step == step && !h.evict_pending) {
        h.pins++;
        segs.push_back(h.rec);
      }
    }
  }
  if (recs.empty() && segs.empty()) {
    return absl::NotFoundError(absl::StrCat("nothing of ", job_id, " step ", step, " is held here"));
  }
  std::vector<VerifyFinding> out;
  uint64_t checked = 0;
  // EC segments (parity, rebuilt data): their bytes against their crc32c.
  for (const ShardRecord& rec : segs) {
    VerifyFinding f;
    f.actual_crc32c = arena_->Checksum(rec.extents, rec.size_bytes);
    checked += rec.size_bytes;
    f.ok = f.actual_crc32c == rec.crc32c;
    if (!f.ok) {
      f.message = absl::StrFormat("segment crc32c 0x%08x != recorded 0x%08x", f.actual_crc32c, rec.crc32c);
    }
    absl::MutexLock lock(&mu_);
    auto it = segments_.find(*rec.segment);
    if (it == segments_.end()) continue;
    if (!f.ok && !dry_run && !it->second.corrupt) {
      it->second.corrupt = true;
      m_corrupt_->Increment();
      log::Error("quarantined corrupt segment {}: {}", SegmentIdString(*rec.segment), f.message);
      QueueSegmentReportLocked(*rec.segment, rec.segment_kind, kCopyStateCorrupt, rec.size_bytes, f.actual_crc32c,
                               "", f.message);
    }
    f.holding.id = rec.id;
    f.holding.segment = rec.segment;
    f.holding.segment_kind = rec.segment_kind;
    f.holding.state = it->second.corrupt ? kCopyStateCorrupt : kCopyStateValid;
    f.holding.size_bytes = rec.size_bytes;
    f.holding.crc32c = rec.crc32c;
    f.holding.stored_unix_ms = rec.staged_unix_ms;
    if (--it->second.pins == 0 && it->second.evict_pending) FreeSegmentLocked(*rec.segment);
    out.push_back(std::move(f));
  }
  for (const ShardRecord& rec : recs) {
    VerifyFinding f;
    std::string bad;
    absl::Status s = CheckBytes(rec, &f.actual_crc32c, &bad);
    checked += rec.size_bytes;
    f.ok = s.ok();
    f.bad_item = bad;
    f.message = std::string(s.message());
    absl::MutexLock lock(&mu_);
    auto it = holdings_.find(rec.id);
    if (it == holdings_.end()) continue;
    it->second.pins--;
    if (s.ok()) {
      it->second.verified = true;
    } else if (!dry_run) {
      QuarantineLocked(it->second, f.message);
    }
    f.holding = InfoLocked(it->second);
    if (it->second.evict_pending && it->second.pins == 0) FreeHoldingLocked(rec.id);
    out.push_back(std::move(f));
  }
  if (bytes_checked != nullptr) *bytes_checked = checked;
  return out;
}

bool Agent::VerifyOnce() {
  ShardRecord rec;
  {
    absl::MutexLock lock(&mu_);
    while (!verify_queue_.empty()) {
      const ShardId id = verify_queue_.front();
      verify_queue_.pop_front();
      auto it = holdings_.find(id);
      if (it == holdings_.end() || it->second.verified || it->second.corrupt || it->second.evict_pending) continue;
      it->second.pins++;
      rec = it->second.rec;
      break;
    }
    if (rec.id.job_id.empty()) return false;
  }
  absl::Status s = CheckBytes(rec, nullptr, nullptr);
  absl::MutexLock lock(&mu_);
  auto it = holdings_.find(rec.id);
  if (it == holdings_.end()) return true;
  it->second.pins--;
  if (s.ok()) {
    it->second.verified = true;
    ++wake_;  // a flush may be waiting for it
  } else {
    QuarantineLocked(it->second, std::string(s.message()));
  }
  if (it->second.evict_pending && it->second.pins == 0) FreeHoldingLocked(rec.id);
  return true;
}

// ---------------------------------------------------------------------------
// Flush and tasks

void Agent::RecordFlushError(const absl::Status& s) {
  absl::MutexLock lock(&mu_);
  RecordFlushErrorLocked(s);
}

void Agent::RecordFlushErrorLocked(const absl::Status& s) {
  m_flush_errors_->Increment();
  flush_errors_total_++;
  last_flush_error_ = s.ToString();
  last_flush_error_unix_ms_ = clock_->NowUnixMillis();
}

absl::Status Agent::FlushOne(const std::string& task_id, const FlushOrder& order, const std::string& job,
                             uint64_t step, uint64_t* bytes) {
  if (options_.durable_root.empty()) {
    return absl::UnavailableError("this agent has no durable tier (--durable-root is not set)");
  }
  const ShardId id{job, step, order.rank};
  ShardRecord rec;
  bool verified;
  {
    absl::MutexLock lock(&mu_);
    CKPT_ASSIGN_OR_RETURN(Holding * held, ValidHoldingLocked(id));
    auto it = holdings_.find(id);
    rec = held->rec;
    if ((order.size_bytes != 0 && order.size_bytes != rec.size_bytes) ||
        (order.crc32c != 0 && order.crc32c != rec.crc32c)) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "shard %s here is %d bytes crc 0x%08x but meta expects %d bytes crc 0x%08x", ShardIdString(id),
          rec.size_bytes, rec.crc32c, order.size_bytes, order.crc32c));
    }
    if (!rec.durable_path.empty() && rec.durable_path == order.durable_path) {
      // Written by an earlier attempt (or before a restart): report again.
      HoldingReport r;
      r.kind = HoldingReport::Kind::kPersisted;
      r.id = id;
      r.durable_path = rec.durable_path;
      r.size_bytes = rec.size_bytes;
      r.crc32c = rec.crc32c;
      r.task_id = task_id;
      QueueReportLocked(std::move(r));
      flush_waiting_.erase(id);
      ++wake_;
      return absl::OkStatus();
    }
    verified = it->second.verified;
    it->second.pins++;
  }
  auto unpin = [&] {
    absl::MutexLock lock(&mu_);
    UnpinLocked(id);
  };
  // Nothing leaves the node unchecked.
  if (!verified) {
    absl::Status s = CheckBytes(rec, nullptr, nullptr);
    absl::MutexLock lock(&mu_);
    auto it = holdings_.find(id);
    if (!s.ok()) {
      it->second.pins--;
      QuarantineLocked(it->second, std::string(s.message()));
      return s;
    }
    it->second.verified = true;
  }
  absl::Status result = [&]() -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(std::string path, UnderRoot(options_.durable_root, order.durable_path));
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<RankFileWriter> writer,
                          RankFileWriter::Create(durable_fs_, path, rec.size_bytes, rec.crc32c));
    absl::Status s = absl::OkStatus();
    arena_->ForEachPiece(rec.extents, rec.size_bytes, [&](const std::byte* p, uint64_t n) {
      for (uint64_t off = 0; off < n && s.ok(); off += kFlushChunkBytes) {
        const uint64_t len = std::min(kFlushChunkBytes, n - off);
        s = writer->Append(std::span<const std::byte>(p + off, len));
        if (s.ok()) *bytes += len;
      }
    });
    CKPT_RETURN_IF_ERROR(s);
    return writer->Commit();
  }();
  if (!result.ok()) {
    unpin();
    return result;
  }
  m_flush_bytes_->Increment(static_cast<double>(rec.size_bytes));
  m_flush_shards_->Increment();
  {
    absl::MutexLock lock(&mu_);
    auto it = holdings_.find(id);
    if (it != holdings_.end()) {
      it->second.rec.durable_path = order.durable_path;
      if (absl::Status s = arena_->WriteRecord(it->second.rec); !s.ok()) {
        log::Warn("cannot update the record of {}: {}", ShardIdString(id), s.ToString());
      }
    }
    flush_waiting_.erase(id);
    HoldingReport r;
    r.kind = HoldingReport::Kind::kPersisted;
    r.id = id;
    r.durable_path = order.durable_path;
    r.size_bytes = rec.size_bytes;
    r.crc32c = rec.crc32c;
    r.task_id = task_id;
    QueueReportLocked(std::move(r));
    ++wake_;
  }
  unpin();
  log::Debug("flushed {} ({} bytes) to {}", ShardIdString(id), rec.size_bytes, order.durable_path);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<FlushResult>> Agent::FlushNow(const std::string& job_id, uint64_t step,
                                                         const std::vector<uint32_t>& ranks) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job_id));
  if (options_.durable_root.empty()) {
    return absl::UnavailableError("this agent has no durable tier (--durable-root is not set)");
  }
  std::vector<FlushOrder> orders;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, h] : holdings_) {
      if (id.job_id != job_id || id.step != step || h.rec.role != 1) continue;
      if (!ranks.empty() && std::find(ranks.begin(), ranks.end(), id.rank) == ranks.end()) continue;
      orders.push_back(FlushOrder{id.rank, absl::StrCat(job_id, "/", step, "/", RankFileName(id.rank)),
                                  h.rec.size_bytes, h.rec.crc32c});
    }
  }
  if (orders.empty()) {
    return absl::NotFoundError(absl::StrCat("no shard of ", job_id, " step ", step, " is held here"));
  }
  std::vector<FlushResult> out;
  for (const FlushOrder& o : orders) {
    uint64_t bytes = 0;
    absl::Status s = FlushOne("", o, job_id, step, &bytes);
    if (!s.ok()) RecordFlushError(s);
    out.push_back(FlushResult{o.rank, o.durable_path, s});
  }
  return out;
}

void Agent::EnqueueTasks(std::vector<AgentTask> tasks) {
  absl::MutexLock lock(&mu_);
  EnqueueTasksLocked(std::move(tasks));
}

void Agent::EnqueueTasksLocked(std::vector<AgentTask> tasks) {
  const absl::Time now = clock_->MonotonicNow();
  for (AgentTask& t : tasks) {
    if (finished_tasks_.count(t.id) != 0) continue;
    auto it = tasks_.find(t.id);
    if (it != tasks_.end()) {
      it->second.task.attempt = std::max(it->second.task.attempt, t.attempt);
      continue;
    }
    if (t.kind == TaskKind::kFlush) {
      for (const FlushOrder& o : t.flush) flush_waiting_.emplace(ShardId{t.job_id, t.step, o.rank}, now);
    }
    QueuedTask qt;
    qt.task = std::move(t);
    qt.not_before = now;
    qt.started = now;
    log::Debug("task {} ({}) for {} step {} queued", qt.task.id, qt.task.kind_name, qt.task.job_id, qt.task.step);
    tasks_.emplace(qt.task.id, std::move(qt));
  }
  ++wake_;
}

absl::Status Agent::RunTaskStep(QueuedTask& qt, bool* finished) {
  const AgentTask& t = qt.task;
  *finished = true;
  switch (t.kind) {
    case TaskKind::kFlush: {
      while (qt.next_shard < t.flush.size()) {
        const FlushOrder& o = t.flush[qt.next_shard];
        {
          // Flush only verified bytes; wait (without blocking the loop) for
          // the verifier if it has not reached this shard yet.
          absl::MutexLock lock(&mu_);
          auto it = holdings_.find(ShardId{t.job_id, t.step, o.rank});
          if (it != holdings_.end() && !it->second.verified && !it->second.corrupt) {
            *finished = false;
            return absl::OkStatus();
          }
        }
        uint64_t bytes = 0;
        absl::Status s = FlushOne(t.id, o, t.job_id, t.step, &bytes);
        qt.bytes_done += bytes;
        if (!s.ok()) return s;
        qt.next_shard++;
      }
      return absl::OkStatus();
    }
    case TaskKind::kCommitDurable: {
      if (options_.durable_root.empty()) {
        return absl::UnavailableError("this agent has no durable tier (--durable-root is not set)");
      }
      CKPT_ASSIGN_OR_RETURN(DurableManifest manifest, meta_->GetVersionManifest(t.job_id, t.step));
      manifest.writer = absl::StrCat("ckpt-agent ", options_.node_id);
      CKPT_ASSIGN_OR_RETURN(std::string dir, UnderRoot(options_.durable_root, t.durable_dir));
      return WriteDurableManifest(durable_fs_, dir, manifest);
    }
    case TaskKind::kDeleteDurable: {
      if (options_.durable_root.empty()) return absl::OkStatus();
      CKPT_ASSIGN_OR_RETURN(std::string dir, UnderRoot(options_.durable_root, t.durable_dir));
      return DeleteDurableVersion(durable_fs_, dir);
    }
    case TaskKind::kEvict: {
      absl::MutexLock lock(&mu_);
      std::vector<ShardId> ids;
      for (const auto& [id, h] : holdings_) {
        if (id.job_id == t.job_id && id.step == t.step) ids.push_back(id);
      }
      for (const ShardId& id : ids) FreeHoldingLocked(id);
      std::vector<SegmentId> segs;
      for (const auto& [id, h] : segments_) {
        if (id.job_id == t.job_id && id.step == t.step) segs.push_back(id);
      }
      for (const SegmentId& id : segs) FreeSegmentLocked(id);
      for (auto it = owned_segments_.begin(); it != owned_segments_.end();) {
        it = it->first.job_id == t.job_id && it->first.step == t.step ? owned_segments_.erase(it) : std::next(it);
      }
      if (!ids.empty()) log::Info("evicted {} holdings of {} step {}", ids.size(), t.job_id, t.step);
      return absl::OkStatus();
    }
    case TaskKind::kDrop: {
      absl::MutexLock lock(&mu_);
      for (const ShardId& id : t.drop) FreeHoldingLocked(id);
      for (const SegmentId& id : t.drop_segments) {
        FreeSegmentLocked(id);
        owned_segments_.erase(id);
      }
      log::Info("dropped {} holdings: {}", t.drop.size() + t.drop_segments.size(), t.reason);
      return absl::OkStatus();
    }
    case TaskKind::kReplicate:
      return RunReplicate(qt, finished);
    case TaskKind::kEcEncode:
      return RunEcEncode(qt, finished);
    case TaskKind::kRebuildSegments:
      return RunRebuild(qt);
    case TaskKind::kUnsupported:
      return absl::UnimplementedError(absl::StrCat("this agent cannot run ", t.kind_name, " tasks"));
  }
  return absl::InternalError("unknown task kind");
}

bool Agent::TasksOnce() {
  QueuedTask qt;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return false;
    const absl::Time now = clock_->MonotonicNow();
    const QueuedTask* best = nullptr;
    for (const auto& [id, t] : tasks_) {
      if (t.not_before > now || running_now_.count(id) != 0) continue;
      if (best == nullptr || t.task.priority > best->task.priority) best = &t;
    }
    if (best == nullptr) return false;
    qt = *best;
    running_now_.insert(qt.task.id);
  }
  bool finished = true;
  const absl::Status s = RunTaskStep(qt, &finished);
  absl::MutexLock lock(&mu_);
  running_now_.erase(qt.task.id);
  auto it = tasks_.find(qt.task.id);
  if (it == tasks_.end()) return true;  // cancelled meanwhile
  qt.task.attempt = std::max(qt.task.attempt, it->second.task.attempt);
  if (s.ok() && !finished) {
    qt.not_before = clock_->MonotonicNow() + absl::Milliseconds(20);
    it->second = qt;
    return false;
  }
  const bool retryable = qt.task.kind == TaskKind::kFlush &&
                         (absl::IsResourceExhausted(s) || absl::IsUnavailable(s) || absl::IsInternal(s) ||
                          absl::IsPermissionDenied(s));
  if (!s.ok() && qt.task.kind == TaskKind::kFlush) RecordFlushErrorLocked(s);
  if (!s.ok() && retryable && qt.tries + 1 < options_.flush_max_tries) {
    qt.tries++;
    int64_t backoff = options_.flush_retry_initial_ms << std::min(qt.tries - 1, 20);
    backoff = std::min(backoff, options_.flush_retry_max_ms);
    log::Warn("task {} ({} {} step {}) failed, retry {} in {} ms: {}", qt.task.id, qt.task.kind_name,
              qt.task.job_id, qt.task.step, qt.tries, backoff, s.ToString());
    qt.not_before = clock_->MonotonicNow() + absl::Milliseconds(backoff);
    it->second = qt;
    return true;
  }
  if (!s.ok()) {
    log::Error("task {} ({} {} step {}) failed: {}", qt.task.id, qt.task.kind_name, qt.task.job_id,
               qt.task.step, s.ToString());
  }
  tasks_.erase(it);
  finished_tasks_.insert(qt.task.id);
  if (finished_tasks_.size() > 100000) finished_tasks_.erase(finished_tasks_.begin());
  // The result follows the reports the task produced (ReportShards before
  // ReportTaskResult): both go out from the control loop, in order.
  Outbound out;
  out.kind = Outbound::Kind::kResult;
  out.task_id = qt.task.id;
  out.attempt = qt.task.attempt;
  out.result = s;
  out.bytes = qt.bytes_done;
  out.duration_ms = absl::ToInt64Milliseconds(clock_->MonotonicNow() - qt.started);
  outbox_.push_back(std::move(out));
  ++wake_;
  return true;
}

// ---------------------------------------------------------------------------
// Meta session

void Agent::ExpireLocked(absl::Time now) {
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->second.expires <= now || ProcessGone(it->second.client_pid)) {
      log::Info("lease {} for {} expired (client gone or ttl passed)", it->first, ShardIdString(it->second.shard));
      arena_->Free(it->second.extents);
      lease_of_shard_.erase(it->second.shard);
      it = leases_.erase(it);
    } else {
      ++it;
    }
  }
  std::vector<std::string> dead;
  for (const auto& [id, h] : handles_) {
    if (h.expires <= now || ProcessGone(h.client_pid)) dead.push_back(id);
  }
  for (const std::string& id : dead) {
    const ShardId shard = handles_[id].shard;
    handles_.erase(id);
    auto h = holdings_.find(shard);
    if (h != holdings_.end()) {
      h->second.pins--;
      if (h->second.evict_pending && h->second.pins == 0) FreeHoldingLocked(shard);
    }
  }
}

void Agent::Register() {
  NodeRegistration reg;
  reg.node_id = options_.node_id;
  reg.grpc_address = options_.grpc_address;
  reg.data_address = options_.data_address.empty() ? data_address() : options_.data_address;
  reg.failure_domain = options_.failure_domain;
  reg.agent_version = "0.1.0";
  reg.memory_capacity_bytes = arena_->capacity_bytes();
  {
    absl::MutexLock lock(&mu_);
    reg.previous_incarnation = std::max(previous_incarnation_, incarnation_);
  }
  absl::StatusOr<RegistrationReply> r = meta_->Register(reg);
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->MonotonicNow();
  if (!r.ok()) {
    m_meta_errors_->Increment();
    if (meta_reachable_ || next_register_ == absl::InfinitePast()) {
      log::Warn("cannot register with meta: {}", r.status().ToString());
    }
    meta_reachable_ = false;
    next_register_ = now + absl::Seconds(1);
    return;
  }
  incarnation_ = r->incarnation;
  registered_ = true;
  meta_reachable_ = true;
  inventory_due_ = true;
  heartbeat_ms_ = r->heartbeat_ms > 0 ? r->heartbeat_ms : 1000;
  lease_ms_ = r->lease_ms > 0 ? r->lease_ms : 5000;
  lease_valid_until_ = now + absl::Milliseconds(lease_ms_);
  next_heartbeat_ = now + absl::Milliseconds(heartbeat_ms_);
  last_heartbeat_unix_ms_ = clock_->NowUnixMillis();
  m_registered_->Set(1);
  std::ofstream(options_.memory_dir + "/incarnation") << incarnation_ << "\n";
  log::Info("registered with meta as {} incarnation {}", options_.node_id, incarnation_);
}

void Agent::SendInventory() {
  std::vector<InventoryItem> items;
  uint64_t inc;
  {
    absl::MutexLock lock(&mu_);
    inc = incarnation_;
    for (const auto& [id, h] : holdings_) {
      const HoldingInfo info = InfoLocked(h);
      InventoryItem it;
      it.id = id;
      it.role = info.role;
      it.state = info.state;
      it.size_bytes = info.size_bytes;
      it.crc32c = info.crc32c;
      it.manifest_digest = info.manifest_digest;
      it.stored_unix_ms = info.stored_unix_ms;
      it.durable_path = info.durable_path;
      items.push_back(std::move(it));
    }
    for (const auto& [id, h] : segments_) {
      InventoryItem it;
      it.is_segment = true;
      it.segment = id;
      it.segment_kind = h.rec.segment_kind;
      it.state = h.corrupt ? kCopyStateCorrupt : kCopyStateValid;
      it.size_bytes = h.rec.size_bytes;
      it.crc32c = h.rec.crc32c;
      it.stored_unix_ms = h.rec.staged_unix_ms;
      items.push_back(std::move(it));
    }
    for (const auto& [id, o] : owned_segments_) {
      if (segments_.count(id)) continue;
      InventoryItem it;
      it.is_segment = true;
      it.segment = id;
      it.segment_kind = kSegmentData;
      it.state = kCopyStateValid;
      it.size_bytes = o.length_bytes;
      it.crc32c = o.crc32c;
      items.push_back(std::move(it));
    }
  }
  absl::StatusOr<InventoryReply> r = meta_->ReportInventory(options_.node_id, inc, items);
  absl::MutexLock lock(&mu_);
  if (!r.ok()) {
    m_meta_errors_->Increment();
    log::Warn("inventory report failed: {}", r.status().ToString());
    if (absl::IsFailedPrecondition(r.status()) || absl::IsNotFound(r.status())) {
      registered_ = false;
      m_registered_->Set(0);
    }
    return;
  }
  inventory_due_ = false;
  for (const ShardId& id : r->drop) {
    log::Info("meta says drop {}", ShardIdString(id));
    FreeHoldingLocked(id);
  }
  for (const SegmentId& id : r->drop_segments) {
    log::Info("meta says drop segment {}", SegmentIdString(id));
    FreeSegmentLocked(id);
    owned_segments_.erase(id);
  }
  for (const ShardId& id : r->unknown) {
    log::Warn("meta does not know {} (kept; see ckptctl status)", ShardIdString(id));
  }
}

bool Agent::SendBegin(const Outbound& begin) {
  const ShardId& v = begin.report.id;
  absl::StatusOr<uint32_t> ws = meta_->BeginVersion(v.job_id, v.step, begin.run_id, options_.node_id);
  absl::MutexLock lock(&mu_);
  if (!ws.ok() && (absl::IsUnavailable(ws.status()) || absl::IsDeadlineExceeded(ws.status()))) {
    m_meta_errors_->Increment();
    meta_reachable_ = false;
    return false;  // keep it queued, and everything after it
  }
  outbox_.pop_front();
  if (ws.ok()) return true;
  // Meta refused the version (e.g. a step lower than the job's newest, or the
  // job was deleted): its shards here can never be staged. Drop them and
  // their queued reports; the trainer's Wait() sees meta's answer.
  log::Error("meta refused version {} step {} ({}); dropping its shards on this node", v.job_id, v.step,
             ws.status().ToString());
  begun_.erase(std::make_tuple(v.job_id, v.step, begin.run_id));
  std::vector<ShardId> drop;
  for (const auto& [id, h] : holdings_) {
    if (id.job_id == v.job_id && id.step == v.step && h.rec.run_id == begin.run_id) drop.push_back(id);
  }
  for (const ShardId& id : drop) FreeHoldingLocked(id);
  std::erase_if(outbox_, [&](const Outbound& o) {
    return o.kind == Outbound::Kind::kReport && o.report.kind == HoldingReport::Kind::kStaged &&
           o.report.record.id.job_id == v.job_id && o.report.record.id.step == v.step;
  });
  return true;
}

void Agent::SendReports() {
  while (true) {
    std::vector<HoldingReport> reports;
    std::optional<Outbound> result;
    std::optional<Outbound> begin;
    uint64_t inc;
    {
      absl::MutexLock lock(&mu_);
      if (outbox_.empty() || !registered_) return;
      inc = incarnation_;
      if (outbox_.front().kind == Outbound::Kind::kBegin) {
        begin = outbox_.front();
      } else if (outbox_.front().kind == Outbound::Kind::kResult) {
        result = outbox_.front();
      } else {
        for (const Outbound& o : outbox_) {
          if (o.kind != Outbound::Kind::kReport || reports.size() == kMaxReportBatch) break;
          reports.push_back(o.report);
        }
      }
    }
    if (begin) {
      if (!SendBegin(*begin)) return;
      continue;
    }
    if (result) {
      absl::Status s = meta_->ReportTaskResult(options_.node_id, inc, result->task_id, result->attempt,
                                               result->result, result->bytes, result->duration_ms);
      absl::MutexLock lock(&mu_);
      if (!s.ok()) {
        m_meta_errors_->Increment();
        if (absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) {
          meta_reachable_ = false;
          return;  // keep it queued
        }
        if (absl::IsFailedPrecondition(s)) {
          registered_ = false;
          m_registered_->Set(0);
          return;
        }
        log::Warn("task result for {} not accepted: {}", result->task_id, s.ToString());
      }
      outbox_.pop_front();
      continue;
    }
    absl::StatusOr<ReportReply> r = meta_->ReportShards(options_.node_id, inc, reports);
    absl::MutexLock lock(&mu_);
    if (!r.ok()) {
      m_meta_errors_->Increment();
      meta_reachable_ = false;
      log::Warn("reporting {} shard(s) to meta failed: {}", reports.size(), r.status().ToString());
      if (absl::IsFailedPrecondition(r.status()) || absl::IsNotFound(r.status())) {
        registered_ = false;
        m_registered_->Set(0);
      }
      return;
    }
    for (size_t i = 0; i < reports.size() && i < r->results.size(); ++i) {
      const absl::Status& s = r->results[i];
      const bool staged = reports[i].kind == HoldingReport::Kind::kStaged;
      const ShardId id = staged ? reports[i].record.id : reports[i].id;
      if (s.ok() || absl::IsAlreadyExists(s)) {
        if (staged) {
          auto h = holdings_.find(id);
          if (h != holdings_.end()) h->second.staged_reported = true;
        }
      } else if (staged && absl::IsFailedPrecondition(s)) {
        log::Warn("meta refused {}: {}; dropping this copy", ShardIdString(id), s.ToString());
        FreeHoldingLocked(id);
      } else {
        log::Warn("meta refused a report about {}: {}", ShardIdString(id), s.ToString());
      }
    }
    EnqueueTasksLocked(std::move(r->tasks));
    outbox_.erase(outbox_.begin(), outbox_.begin() + static_cast<long>(reports.size()));
  }
}

void Agent::Heartbeat() {
  LoadReport load;
  uint64_t inc;
  {
    absl::MutexLock lock(&mu_);
    inc = incarnation_;
    load.memory_capacity_bytes = arena_->capacity_bytes();
    load.memory_free_bytes = arena_->free_bytes();
    load.memory_used_bytes = load.memory_capacity_bytes - load.memory_free_bytes;
    load.memory_leased_bytes = LeasedBytesLocked();
    const absl::Time now = clock_->MonotonicNow();
    absl::Time oldest = now;
    for (const auto& [id, since] : flush_waiting_) {
      auto h = holdings_.find(id);
      if (h != holdings_.end()) load.flush_lag_bytes += h->second.rec.size_bytes;
      oldest = std::min(oldest, since);
    }
    load.flush_lag_ms = absl::ToInt64Milliseconds(now - oldest);
    load.flush_errors_total = flush_errors_total_;
    for (const auto& [id, t] : tasks_) {
      load.running.push_back(RunningTask{id, t.task.attempt, t.bytes_done, 0});
    }
  }
  const absl::Time sent = clock_->MonotonicNow();
  absl::StatusOr<HeartbeatReply> r = meta_->Heartbeat(options_.node_id, inc, load);
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->MonotonicNow();
  if (!r.ok()) {
    m_meta_errors_->Increment();
    if (absl::IsFailedPrecondition(r.status()) || absl::IsNotFound(r.status())) {
      log::Warn("meta fenced this agent ({}); registering again", r.status().ToString());
      registered_ = false;
      m_registered_->Set(0);
      next_register_ = now;
    } else {
      if (meta_reachable_) log::Warn("heartbeat failed: {}", r.status().ToString());
      meta_reachable_ = false;
      next_heartbeat_ = now + absl::Milliseconds(heartbeat_ms_);
    }
    return;
  }
  meta_reachable_ = true;
  node_state_ = r->node_state;
  lease_ms_ = r->lease_ms > 0 ? r->lease_ms : lease_ms_;
  heartbeat_ms_ = r->heartbeat_ms > 0 ? r->heartbeat_ms : heartbeat_ms_;
  lease_valid_until_ = sent + absl::Milliseconds(lease_ms_);
  next_heartbeat_ = now + absl::Milliseconds(heartbeat_ms_);
  last_heartbeat_unix_ms_ = clock_->NowUnixMillis();
  if (r->inventory_required) {
    inventory_due_ = true;
    // meta restarted: re-send STAGED reports of shards it may not have seen.
  }
  for (const std::string& id : r->cancelled_task_ids) {
    if (running_now_.count(id) == 0) tasks_.erase(id);
    finished_tasks_.insert(id);
  }
  EnqueueTasksLocked(std::move(r->tasks));
}

void Agent::ControlOnce() {
  bool registered, inventory_due, heartbeat_due, register_due, have_reports;
  const absl::Time round_start = clock_->MonotonicNow();
  absl::Time locked_at;
  {
    absl::MutexLock lock(&mu_);
    locked_at = clock_->MonotonicNow();
    const absl::Time now = clock_->MonotonicNow();
    ExpireLocked(now);
    registered = registered_;
    register_due = !registered_ && now >= next_register_;
    inventory_due = inventory_due_;
    heartbeat_due = now >= next_heartbeat_;
    have_reports = !outbox_.empty();
    UpdateGauges();
  }
  if (!registered) {
    if (register_due) Register();
    absl::MutexLock lock(&mu_);
    registered = registered_;
    inventory_due = inventory_due_;
  }
  if (!registered) return;
  // STAGED reports before the inventory: meta must know a shard before it
  // judges the holding.
  const absl::Time reports_start = clock_->MonotonicNow();
  if (have_reports || inventory_due) SendReports();
  const absl::Time reports_done = clock_->MonotonicNow();
  if (inventory_due) SendInventory();
  if (heartbeat_due) Heartbeat();
  // A slow round delays the heartbeat and risks the lease: say why.
  const absl::Duration took = clock_->MonotonicNow() - round_start;
  if (took > absl::Milliseconds(500)) {
    log::Warn("control round took {} ms (lock wait {} ms, reports {} ms, rest {} ms)",
              absl::ToInt64Milliseconds(took), absl::ToInt64Milliseconds(locked_at - round_start),
              absl::ToInt64Milliseconds(reports_done - reports_start),
              absl::ToInt64Milliseconds(clock_->MonotonicNow() - reports_done));
  }
}

void Agent::UpdateGauges() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  const uint64_t free = arena_->free_bytes();
  m_free_->Set(static_cast<double>(free));
  m_used_->Set(static_cast<double>(arena_->capacity_bytes() - free));
  m_leased_->Set(static_cast<double>(LeasedBytesLocked()));
  m_holdings_->Set(static_cast<double>(holdings_.size()));
  uint64_t lag = 0;
  absl::Time oldest = clock_->MonotonicNow();
  const absl::Time now = oldest;
  for (const auto& [id, since] : flush_waiting_) {
    auto h = holdings_.find(id);
    if (h != holdings_.end()) lag += h->second.rec.size_bytes;
    oldest = std::min(oldest, since);
  }
  m_flush_lag_bytes_->Set(static_cast<double>(lag));
  m_flush_lag_seconds_->Set(absl::ToDoubleSeconds(now - oldest));
}

AgentStatusSnapshot Agent::Status() const {
  absl::MutexLock lock(&mu_);
  AgentStatusSnapshot s;
  s.node_id = options_.node_id;
  s.incarnation = incarnation_;
  s.registered = registered_ && !inventory_due_;
  s.meta_reachable = meta_reachable_;
  s.last_heartbeat_unix_ms = last_heartbeat_unix_ms_;
  const absl::Time now = clock_->MonotonicNow();
  s.lease_remaining_ms = registered_ ? absl::ToInt64Milliseconds(lease_valid_until_ - now) : 0;
  s.node_state = node_state_;
  s.uptime_ms = absl::ToInt64Milliseconds(now - started_);
  s.capacity_bytes = arena_->capacity_bytes();
  s.free_bytes = arena_->free_bytes();
  s.used_bytes = s.capacity_bytes - s.free_bytes;
  s.leased_bytes = LeasedBytesLocked();
  s.open_leases = static_cast<uint32_t>(leases_.size());
  s.open_handles = static_cast<uint32_t>(handles_.size());
  for (const auto& [id, h] : holdings_) s.holdings.push_back(InfoLocked(h));
  absl::Time oldest = now;
  for (const auto& [id, since] : flush_waiting_) {
    auto h = holdings_.find(id);
    if (h != holdings_.end()) s.flush_lag_bytes += h->second.rec.size_bytes;
    oldest = std::min(oldest, since);
    s.flush_pending_shards++;
  }
  s.flush_lag_ms = absl::ToInt64Milliseconds(now - oldest);
  s.flush_errors_total = flush_errors_total_;
  s.last_flush_error = last_flush_error_;
  s.last_flush_error_unix_ms = last_flush_error_unix_ms_;
  for (const auto& [id, t] : tasks_) s.running_tasks.push_back(RunningTask{id, t.task.attempt, t.bytes_done, 0});
  s.memory_dir = options_.memory_dir;
  s.durable_root = options_.durable_root;
  s.pool_path = arena_->pool_path();
  s.pool_bytes = arena_->capacity_bytes();
  return s;
}

}  // namespace ckpt::agent
