#include "server/agent/restorer.h"

#include <algorithm>
#include <deque>
#include <optional>
#include <span>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/crc32c.h"
#include "common/lock_check.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt::agent {
namespace {

constexpr uint64_t kReadChunkBytes = 8 << 20;

bool Decides(const absl::StatusOr<OpenResult>& local) {
  // A VALID local copy decides; so does an error of the agent's own. A copy
  // that is not held, or is quarantined (now or by this check), falls
  // through: the source's copy replaces it (HoldingTable::Add).
  return local.ok() || !(absl::IsNotFound(local.status()) || absl::IsDataLoss(local.status()));
}

// A peer read of bytes [offset, offset + length) of shard `id`.
ReadReq ShardRead(const ShardId& id, uint64_t offset, uint64_t length) {
  ReadReq req;
  req.what = ReadWhat::kShard;
  req.job_id = id.job_id;
  req.step = id.step;
  req.rank = id.rank;
  req.offset = offset;
  req.length = length;
  return req;
}

// OpenRequest::ranges against meta's record of the shard.
absl::Status CheckRanges(const std::vector<ByteRange>& ranges, const ShardRecord& shard) {
  if (ranges.size() > kMaxOpenRanges) {
    return absl::InvalidArgumentError(
        absl::StrCat(ranges.size(), " byte ranges asked of ", ShardIdString(shard.id), "; at most ", kMaxOpenRanges));
  }
  uint64_t end = 0;  // of the previous range
  for (const ByteRange& r : ranges) {
    if (r.length == 0 || r.offset > shard.size_bytes || r.length > shard.size_bytes - r.offset) {
      return absl::InvalidArgumentError(absl::StrCat("byte range [", r.offset, ", +", r.length, ") of ",
                                                     ShardIdString(shard.id), " is empty or beyond its ",
                                                     shard.size_bytes, " bytes"));
    }
    // In order and apart: together they are never more than the shard.
    if (r.offset < end) {
      return absl::InvalidArgumentError(absl::StrCat("byte range [", r.offset, ", +", r.length, ") of ",
                                                     ShardIdString(shard.id), " begins before the previous one ends (",
                                                     end, "): ranges must be in increasing order, apart"));
    }
    end = r.offset + r.length;
  }
  return absl::OkStatus();
}

// The source meta listed that a caller's `named` source stands for: a copy
// on the same node, the same owner's EC stripes, the same durable file. Null
// when meta lists none (the named source is then refused).
const ShardSource* Vouched(const ShardSource& named, const std::vector<ShardSource>& listed) {
  for (const ShardSource& m : listed) {
    if (m.kind != named.kind) continue;
    switch (named.kind) {
      case ShardSource::Kind::kReplica:
        if (m.holder.node_id == named.holder.node_id) return &m;
        break;
      case ShardSource::Kind::kEcDecode:
        if (m.ec.owner_node_id == named.ec.owner_node_id && m.ec.group_index == named.ec.group_index) return &m;
        break;
      case ShardSource::Kind::kDurable:
        if (m.durable_path == named.durable_path) return &m;
        break;
      case ShardSource::Kind::kLocal:
        break;
    }
  }
  return nullptr;
}

// Where a source is, for messages: its node or its durable path (meta's).
std::string SourceWhere(const ShardSource& src) {
  switch (src.kind) {
    case ShardSource::Kind::kReplica:
      return absl::StrCat("the copy on node \"", src.holder.node_id, "\"");
    case ShardSource::Kind::kEcDecode:
      return absl::StrCat("the EC stripes of node \"", src.ec.owner_node_id, "\"");
    case ShardSource::Kind::kDurable:
      return absl::StrCat("durable file ", QuoteForMessage(src.durable_path));
    case ShardSource::Kind::kLocal:
      break;
  }
  return "this node's copy";
}

// What the caller is told of a source that failed: the code and a phrase.
// The cause, which may state a size or a crc32c of bytes the caller never
// read, stays in the agent's log (the function that decides logs it).
// Unavailability, deadlines and this agent's own budget say nothing about
// the bytes and keep their message.
absl::Status SourceError(const ShardId& id, const ShardSource& src, const absl::Status& s) {
  log::Warn("restore of {} from {} ({}) failed: {}", ShardIdString(id), SourceKindName(src.kind), SourceWhere(src),
            s.ToString());
  switch (s.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kCancelled:
      return s;
    case absl::StatusCode::kDataLoss:
      return absl::DataLossError(absl::StrCat(SourceWhere(src), " does not match the shard (details in this agent's log)"));
    case absl::StatusCode::kNotFound:
      return absl::NotFoundError(absl::StrCat(SourceWhere(src), " was not found (details in this agent's log)"));
    default:
      return absl::Status(s.code(), absl::StrCat(SourceWhere(src), " could not be read (details in this agent's log)"));
  }
}

}  // namespace

const char* SourceKindName(ShardSource::Kind kind) {
  switch (kind) {
    case ShardSource::Kind::kLocal:
      return "SOURCE_KIND_LOCAL";
    case ShardSource::Kind::kReplica:
      return "SOURCE_KIND_REPLICA";
    case ShardSource::Kind::kEcDecode:
      return "SOURCE_KIND_EC_DECODE";
    case ShardSource::Kind::kDurable:
      return "SOURCE_KIND_DURABLE";
  }
  return "SOURCE_KIND_UNKNOWN";
}

Restorer::Restorer(Deps deps) : d_(std::move(deps)) {}

absl::StatusOr<OpenResult> Restorer::OpenLocal(const ShardId& id, bool skip_verify, const ClientRef& client,
                                               int64_t ttl_ms, uint64_t verify_at_most_bytes) {
  CKPT_ASSIGN_OR_RETURN(Pin pin, d_.holdings->PinValid(id));
  if (!skip_verify && verify_at_most_bytes != 0 && pin.rec->size_bytes > verify_at_most_bytes) {
    return absl::UnavailableError(absl::StrCat("the local copy of ", ShardIdString(id), " (", pin.rec->size_bytes,
                                               " bytes) is verified only over OpenShard (at most ",
                                               verify_at_most_bytes, " bytes here)"));
  }
  bool verified = false;
  if (!skip_verify) {
    std::string bad;
    if (absl::Status s = CheckShardBytes(*pin.rec, *pin.bytes, nullptr, &bad); !s.ok()) {
      d_.holdings->Quarantine(pin, std::string(s.message()));
      return s;
    }
    d_.holdings->MarkVerified(pin);
    verified = true;
  }
  // A session's handles live as long as the session; others by ttl.
  const absl::Duration ttl = !client.session_id.empty() ? absl::InfiniteDuration()
                                                        : absl::Milliseconds(ttl_ms > 0 ? ttl_ms : d_.default_handle_ttl_ms);
  OpenResult out;
  out.shard.record = pin.rec;
  out.shard.regions = RegionsOf(d_.arena->pool_path(), pin.rec->extents, pin.rec->size_bytes);
  out.verified = verified;
  out.expires_in_ms = ttl == absl::InfiniteDuration() ? 0 : absl::ToInt64Milliseconds(ttl);
  out.handle_id = d_.leases->OpenHandle(id, std::move(pin), client, ttl);
  return out;
}

absl::StatusOr<LocatedShard> Restorer::AskMeta(const ShardId& id, const std::vector<ShardSource>& named) {
  std::string kinds;
  for (const ShardSource& src : named) {
    if (src.kind == ShardSource::Kind::kLocal || absl::StrContains(kinds, SourceKindName(src.kind))) continue;
    absl::StrAppend(&kinds, kinds.empty() ? "" : ", ", SourceKindName(src.kind));
  }
  absl::StatusOr<LocatedShard> located =
      d_.meta != nullptr ? d_.meta->Locate(id, d_.node_id)
                         : absl::StatusOr<LocatedShard>(absl::UnimplementedError("this agent has no link to meta"));
  if (located.ok()) {
    located->shard.id = id;
    return located;
  }
  const absl::Status& s = located.status();
  log::Warn("restore of {}: meta's Locate failed ({}); the sources named ({}) are not read", ShardIdString(id),
            s.ToString(), kinds);
  if (absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) {
    return absl::UnavailableError(absl::StrCat("cannot ask meta where ", ShardIdString(id),
                                               " may be read from (", s.message(),
                                               "); no source but this node's own copy is read without meta's answer"));
  }
  // Meta's reason (the version's state, its world size, ...) is about a job
  // the caller may not see: the log has it.
  return absl::PermissionDeniedError(absl::StrCat("meta lists no readable copy of ", ShardIdString(id),
                                                  ": the sources named (", kinds, ") are refused, none was read"));
}

// One source of an open (Race::mu guards what changes).
struct Restorer::Attempt {
  size_t slot = 0;     // in Race::attempts
  size_t index = 0;    // in OpenRequest::sources
  ShardSource source;  // meta's version of it
  absl::Time started;
  uint64_t read_id = 0;    // the peer read under way (a replica), 0 if none
  // A new connection to a replica's holder gets this long (0: the plane's
  // own): the hedge delay while another source is left to try.
  int64_t connect_timeout_ms = 0;
  bool cancelled = false;  // another source served
  bool done = false;
  absl::Status status;               // why it failed
  std::optional<OpenResult> result;  // the winner's
};

// The sources of one open, read one after another or side by side. Shared by
// the caller and the attempts' threads: an attempt may outlive the open.
struct Restorer::Race {
  Race(ShardRecord e, ClientRef c, int64_t t, std::vector<ByteRange> r)
      : expected(std::move(e)), client(std::move(c)), ttl_ms(t), ranges(std::move(r)) {}
  const ShardRecord expected;
  const ClientRef client;
  const int64_t ttl_ms;
  const std::vector<ByteRange> ranges;  // OpenRequest::ranges
  absl::Mutex mu;
  std::deque<Attempt> attempts ABSL_GUARDED_BY(mu);  // (a deque: addresses stay)
  std::optional<size_t> winner ABSL_GUARDED_BY(mu);   // slot
  uint64_t ended ABSL_GUARDED_BY(mu) = 0;
};

void Restorer::RunAttempt(const std::shared_ptr<Race>& race, Attempt* a) {
  absl::StatusOr<OpenResult> r = ReadSource(a->source, race->expected, race->client, race->ttl_ms, race, a);
  std::string surplus;
  {
    CheckedLock lock(&race->mu);
    a->done = true;
    race->ended++;
    if (r.ok() && !race->winner) {
      race->winner = a->slot;
      a->result = *std::move(r);
    } else if (r.ok()) {
      surplus = r->handle_id;  // a faster source served: this handle is not wanted
    } else {
      a->status = r.status();
    }
  }
  if (!surplus.empty()) d_.leases->CloseHandle(surplus);
}

absl::StatusOr<OpenResult> Restorer::ReadSource(const ShardSource& src, const ShardRecord& expected,
                                                const ClientRef& client, int64_t ttl_ms,
                                                const std::shared_ptr<Race>& race, Attempt* attempt) {
  switch (src.kind) {
    case ShardSource::Kind::kReplica:
      if (race != nullptr && !race->ranges.empty()) {
        if (absl::StatusOr<OpenResult> held = OpenLocal(expected.id, false, client, ttl_ms); Decides(held)) return held;
        return RangesFromPeer(src.holder, race, attempt);
      }
      return FromPeerFor(expected, src.holder, client, ttl_ms, race, attempt);
    case ShardSource::Kind::kEcDecode:
      return ByDecode(expected, src.ec, client, ttl_ms);
    case ShardSource::Kind::kDurable:
      return FromDurable(expected, src.durable_path, client, ttl_ms);
    default:
      return absl::InvalidArgumentError("unknown source kind");
  }
}

absl::StatusOr<OpenOutcome> Restorer::Open(const OpenRequest& req) {
  OpenOutcome out;
  absl::StatusOr<OpenResult> r = OpenLocal(req.id, req.skip_verify, req.client, req.ttl_ms, req.verify_at_most_bytes);
  const absl::Status local = r.status();
  const bool others_named = std::any_of(req.sources.begin(), req.sources.end(),
                                        [](const ShardSource& s) { return s.kind != ShardSource::Kind::kLocal; });
  if (!r.ok() && (absl::IsNotFound(local) || absl::IsDataLoss(local)) && others_named) {
    // Only what meta placed is read, checked against meta's record of the
    // shard (restorer.h). One Locate per open; none when the local copy
    // served.
    CKPT_ASSIGN_OR_RETURN(LocatedShard located, AskMeta(req.id, req.sources));
    CKPT_RETURN_IF_ERROR(CheckRanges(req.ranges, located.shard));
    std::vector<ByteRange> ranges = req.ranges;
    if (!ranges.empty()) {
      uint64_t wanted = 0;
      for (const ByteRange& r : ranges) wanted += r.length;
      CheckedLock lock(&ranged_mu_);
      auto [it, added] = ranged_bytes_.try_emplace(req.id, 0);
      if (added) ranged_order_.push_back(req.id);
      if (it->second + wanted > located.shard.size_bytes / 2) {
        ranges.clear();  // the whole shard, restored here for the node's ranks (restorer.h)
        ranged_bytes_.erase(it);
      } else {
        it->second += wanted;
      }
      while (ranged_order_.size() > kMaxRangedShards || (!ranged_order_.empty() &&
                                                         ranged_bytes_.count(ranged_order_.front()) == 0)) {
        ranged_bytes_.erase(ranged_order_.front());
        ranged_order_.pop_front();
      }
    }
    auto race = std::make_shared<Race>(located.shard, req.client, req.ttl_ms, std::move(ranges));
    size_t next = 0;
    bool any_vouched = false;
    // Starts the next named source meta vouches for (refusing the others);
    // false when none is left.
    auto launch = [&]() -> bool {
      for (; next < req.sources.size(); ++next) {
        const ShardSource& named = req.sources[next];
        if (named.kind == ShardSource::Kind::kLocal) continue;
        const ShardSource* src = Vouched(named, located.sources);
        if (src == nullptr) {
          log::Warn("restore of {}: a {} source ({}) is not one meta lists for the shard: refused, not read",
                    ShardIdString(req.id), SourceKindName(named.kind), SourceWhere(named));
          out.failed.push_back(SourceAttempt{
              next, absl::PermissionDeniedError(absl::StrCat("meta does not list this ", SourceKindName(named.kind),
                                                             " source for ", ShardIdString(req.id),
                                                             ": refused, not read"))});
          continue;
        }
        any_vouched = true;
        Attempt* a = nullptr;
        {
          CheckedLock lock(&race->mu);
          a = &race->attempts.emplace_back();
          a->slot = race->attempts.size() - 1;
          a->index = next;
          a->source = *src;
          a->started = d_.clock->MonotonicNow();
          for (size_t j = next + 1; j < req.sources.size(); ++j) {
            if (req.sources[j].kind != ShardSource::Kind::kLocal && Vouched(req.sources[j], located.sources)) {
              a->connect_timeout_ms = std::max<int64_t>(absl::ToInt64Milliseconds(d_.hedge_after), 1);
              break;
            }
          }
        }
        ++next;
        auto run = [this, race, a] { RunAttempt(race, a); };
        if (d_.races == nullptr || !d_.races->TrySubmit(run)) run();
        return true;
      }
      return false;
    };
    bool more = launch();
    while (true) {
      uint64_t seen = 0;
      size_t running = 0;
      const Attempt* newest = nullptr;
      uint64_t newest_read = 0;
      absl::Time newest_started;
      {
        CheckedLock lock(&race->mu);
        if (race->winner) break;
        seen = race->ended;
        for (const Attempt& a : race->attempts) running += a.done ? 0 : 1;
        for (const Attempt& a : race->attempts) {
          if (a.done) continue;
          newest = &a;  // the last one still reading
          newest_read = a.read_id;
          newest_started = a.started;
        }
      }
      if (running == 0) {
        if (!more || !(more = launch())) break;
        continue;
      }
      // A replica that has sent nothing for hedge_after (since the attempt
      // began: connecting counts; or since its last chunk) is raced by the
      // next source.
      absl::Time hedge_at = absl::InfiniteFuture();
      if (more && newest != nullptr && newest->source.kind == ShardSource::Kind::kReplica && d_.peers != nullptr) {
        absl::Time progress = newest_started;
        if (newest_read != 0) progress = std::max(progress, d_.peers->LastChunk(newest_read).value_or(progress));
        hedge_at = progress + d_.hedge_after;
        if (d_.clock->MonotonicNow() >= hedge_at) {
          log::Info("restore of {}: {} sent nothing for {}; reading the next source beside it",
                    ShardIdString(req.id), SourceWhere(newest->source), absl::FormatDuration(d_.hedge_after));
          d_.metrics->hedged_restores->Increment();
          more = launch();
          continue;
        }
      }
      CheckedLock lock(&race->mu);
      auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(race->mu) { return race->ended != seen; };
      d_.clock->AwaitWithTimeout(&race->mu, absl::Condition(&changed), hedge_at - d_.clock->MonotonicNow());
    }
    // The winner serves; the others still reading are cancelled; those that
    // failed are listed.
    std::vector<uint64_t> cancel;
    std::vector<std::pair<size_t, absl::Status>> failed;  // (index, raw status)
    std::vector<const ShardSource*> failed_src;
    {
      CheckedLock lock(&race->mu);
      for (Attempt& a : race->attempts) {
        if (race->winner && a.slot == *race->winner) {
          r = *std::move(a.result);
          out.served_by = a.index;
        } else if (!a.done) {
          a.cancelled = true;
          if (a.read_id != 0) cancel.push_back(a.read_id);
        } else {
          failed.emplace_back(a.index, a.status);
          failed_src.push_back(&a.source);
        }
      }
    }
    for (uint64_t id : cancel) d_.peers->Cancel(id, absl::CancelledError("another source served the restore first"));
    for (size_t i = 0; i < failed.size(); ++i) {
      // (Attempts that are done no longer change: their sources are read
      // without the lock.)
      out.failed.push_back(SourceAttempt{failed[i].first, SourceError(req.id, *failed_src[i], failed[i].second)});
    }
    std::sort(out.failed.begin(), out.failed.end(),
              [](const SourceAttempt& x, const SourceAttempt& y) { return x.index < y.index; });
    if (!out.served_by) {
      std::string why(local.message());
      for (const SourceAttempt& a : out.failed) {
        absl::StrAppend(&why, "; source ", SourceKindName(req.sources[a.index].kind), ": ", a.status.message());
      }
      return absl::Status(any_vouched ? absl::StatusCode::kDataLoss : absl::StatusCode::kPermissionDenied, why);
    }
  }
  CKPT_RETURN_IF_ERROR(r.status());
  if (!out.served_by && req.expected && req.expected->size_bytes != 0 &&
      (req.expected->size_bytes != r->shard.record->size_bytes || req.expected->crc32c != r->shard.record->crc32c)) {
    d_.leases->CloseHandle(r->handle_id);
    return absl::DataLossError(absl::StrCat("the local copy of ", ShardIdString(req.id),
                                            " differs from the expected shard (size/crc32c)"));
  }
  out.result = *std::move(r);
  return out;
}

absl::StatusOr<ReservationPtr> Restorer::ReserveFor(const ShardRecord& expected) {
  CKPT_RETURN_IF_ERROR(ValidateManifest(expected.items, expected.size_bytes));
  absl::StatusOr<ReservationPtr> r = d_.arena->Reserve(expected.size_bytes);
  if (!r.ok()) return absl::ResourceExhaustedError(d_.budget_message(expected.size_bytes));
  return r;
}

absl::StatusOr<OpenResult> Restorer::Adopt(const ShardRecord& expected, ReservationPtr bytes,
                                           const std::string& durable_path, const std::string& source,
                                           const ClientRef& client, int64_t ttl_ms) {
  ShardRecord rec = expected;
  rec.role = CopyRole::kRestored;
  SetItems(rec, SortedByOffset(expected.items));
  rec.durable_path = durable_path;
  rec.segment.reset();
  rec.staged_unix_ms = d_.clock->NowUnixMillis();
  absl::Status s = d_.holdings->Add(rec, std::move(bytes), /*verified=*/true, /*if_absent=*/true);
  if (!s.ok() && !absl::IsAlreadyExists(s)) return s;
  // Pinned (the handle) before meta hears of the copy: meta may have it
  // dropped at once (a version beyond keep_in_memory, restored from disk),
  // which must not pull it from under this open.
  absl::StatusOr<OpenResult> opened = OpenLocal(rec.id, /*skip_verify=*/true, client, ttl_ms);
  if (s.ok()) {
    HoldingReport r;
    r.kind = HoldingReport::Kind::kCopyState;
    r.id = rec.id;
    r.copy_role = CopyRole::kRestored;
    r.copy_state = CopyState::kValid;
    r.size_bytes = rec.size_bytes;
    r.crc32c = rec.crc32c;
    d_.session->Report(std::move(r));
    log::Info("restored {} ({} bytes) from {}", ShardIdString(rec.id), rec.size_bytes, source);
  }
  // (AlreadyExists: another restore of the same shard won meanwhile; this
  // opened that one.)
  return opened;
}

absl::StatusOr<OpenResult> Restorer::FromPeer(const ShardRecord& expected, const PeerEndpoint& holder,
                                              const ClientRef& client, int64_t ttl_ms) {
  return FromPeerFor(expected, holder, client, ttl_ms, nullptr, nullptr);
}

absl::StatusOr<OpenResult> Restorer::FromPeerFor(const ShardRecord& expected, const PeerEndpoint& holder,
                                                 const ClientRef& client, int64_t ttl_ms,
                                                 const std::shared_ptr<Race>& race, Attempt* attempt) {
  if (absl::StatusOr<OpenResult> held = OpenLocal(expected.id, false, client, ttl_ms); Decides(held)) return held;
  if (d_.peers == nullptr) return absl::UnavailableError("this agent has no data plane");
  CKPT_ASSIGN_OR_RETURN(ReservationPtr bytes, ReserveFor(expected));
  const ReadReq req = ShardRead(expected.id, 0, expected.size_bytes);
  // The read keeps `bytes` alive while payloads may still land in them, so a
  // failure below only drops our reference.
  absl::StatusOr<uint32_t> crc = absl::UnknownError("not read");
  // (Whether another source is left is set when the attempt is made: no
  // lock needed to read it.)
  const int64_t connect_timeout_ms = attempt != nullptr ? attempt->connect_timeout_ms : 0;
  absl::StatusOr<uint64_t> id =
      d_.peers->StartRead(holder, req, bytes->MutablePieces(0, expected.size_bytes), bytes, connect_timeout_ms);
  if (!id.ok()) {
    crc = id.status();
  } else {
    bool cancelled = false;
    if (attempt != nullptr) {
      // The racing caller sees the read's progress (and cancels it when
      // another source served first).
      CheckedLock lock(&race->mu);
      attempt->read_id = *id;
      cancelled = attempt->cancelled;
    }
    if (cancelled) d_.peers->Cancel(*id, absl::CancelledError("another source served the restore first"));
    crc = d_.peers->FinishRead(*id);
  }
  if (crc.ok() && *crc != expected.crc32c) {
    log::Warn("restore of {}: the copy read from node \"{}\" has crc32c {:#010x}, the shard {:#010x}",
              ShardIdString(expected.id), holder.node_id, *crc, expected.crc32c);
    crc = absl::DataLossError(absl::StrFormat("the copy on node \"%s\" does not match the shard's crc32c",
                                              holder.node_id));
  }
  if (!crc.ok()) {
    d_.metrics->peer_errors->Increment();
    return crc.status();
  }
  d_.metrics->peer_restores->Increment();
  return Adopt(expected, std::move(bytes), "", absl::StrCat("node \"", holder.node_id, "\""), client, ttl_ms);
}

absl::StatusOr<OpenResult> Restorer::RangesFromPeer(const PeerEndpoint& holder, const std::shared_ptr<Race>& race,
                                                    Attempt* attempt) {
  const ShardRecord& expected = race->expected;
  if (d_.peers == nullptr) return absl::UnavailableError("this agent has no data plane");
  uint64_t total = 0;
  for (const ByteRange& r : race->ranges) total += r.length;  // (CheckRanges: each inside the shard)
  absl::StatusOr<ReservationPtr> reserved = d_.arena->Reserve(std::max<uint64_t>(total, 1));
  if (!reserved.ok()) return absl::ResourceExhaustedError(d_.budget_message(total));
  ReservationPtr bytes = *std::move(reserved);
  const int64_t connect_timeout_ms = attempt != nullptr ? attempt->connect_timeout_ms : 0;
  // The first range is read alone (the holder checks its whole copy then,
  // once); the others are all started, then waited for: the holder sends
  // them back to back.
  std::vector<uint64_t> offsets;  // of each range in `bytes`
  uint64_t total_at = 0;
  for (const ByteRange& r : race->ranges) {
    offsets.push_back(total_at);
    total_at += r.length;
  }
  absl::Status failed;
  uint32_t crc = 0;
  auto start = [&](size_t i) -> std::optional<uint64_t> {
    const ByteRange& r = race->ranges[i];
    const ReadReq req = ShardRead(expected.id, r.offset, r.length);
    // As FromPeerFor: the read keeps `bytes` alive while payloads may land.
    absl::StatusOr<uint64_t> id =
        d_.peers->StartRead(holder, req, bytes->MutablePieces(offsets[i], r.length), bytes, connect_timeout_ms);
    if (!id.ok()) {
      failed = id.status();
      return std::nullopt;
    }
    bool cancelled = false;
    if (attempt != nullptr) {
      CheckedLock lock(&race->mu);
      attempt->read_id = *id;  // the racing caller watches the newest read's progress
      cancelled = attempt->cancelled;
    }
    if (cancelled) failed = absl::CancelledError("another source served first");
    return *id;
  };
  auto finish = [&](size_t i, uint64_t id) {
    const ByteRange& r = race->ranges[i];
    if (!failed.ok()) d_.peers->Cancel(id, failed);
    absl::StatusOr<uint32_t> sent = d_.peers->FinishRead(id);
    // Every chunk was checked as it landed; the holder's crc32c of the whole
    // range (of its copy, checked against the shard's first) is checked too.
    const uint32_t landed = sent.ok() ? bytes->Crc(offsets[i], r.length) : 0;
    if (sent.ok() && *sent != landed) {
      log::Warn("restore of {}: bytes [{}, +{}) read from node \"{}\" have crc32c {:#010x}, its holder sent {:#010x}",
                ShardIdString(expected.id), r.offset, r.length, holder.node_id, landed, *sent);
      sent = absl::DataLossError(absl::StrFormat("bytes read from node \"%s\" do not match what it sent",
                                                 holder.node_id));
    }
    if (!sent.ok() && failed.ok()) failed = sent.status();
    crc = Crc32cCombine(crc, landed, r.length);
  };
  if (std::optional<uint64_t> first = start(0)) finish(0, *first);
  std::vector<std::pair<size_t, uint64_t>> started;
  for (size_t i = 1; i < race->ranges.size() && failed.ok(); ++i) {
    if (std::optional<uint64_t> id = start(i)) started.emplace_back(i, *id);
  }
  for (const auto& [i, id] : started) finish(i, id);
  if (!failed.ok()) {
    d_.metrics->peer_errors->Increment();
    return failed;
  }
  d_.metrics->peer_restores->Increment();
  auto rec = std::make_shared<ShardRecord>();
  rec->id = expected.id;
  rec->role = CopyRole::kRestored;
  rec->size_bytes = total;
  rec->crc32c = crc;
  rec->extents = bytes->extents();
  const absl::Duration ttl = !race->client.session_id.empty()
                                 ? absl::InfiniteDuration()
                                 : absl::Milliseconds(race->ttl_ms > 0 ? race->ttl_ms : d_.default_handle_ttl_ms);
  OpenResult out;
  out.ranges_only = true;
  out.verified = true;
  out.shard.record = rec;
  out.shard.regions = RegionsOf(d_.arena->pool_path(), rec->extents, total);
  out.expires_in_ms = ttl == absl::InfiniteDuration() ? 0 : absl::ToInt64Milliseconds(ttl);
  out.handle_id = d_.leases->OpenHandle(expected.id, Pin{rec, std::move(bytes)}, race->client, ttl);
  log::Debug("read {} byte range(s), {} bytes, of {} from node \"{}\"", race->ranges.size(), total,
             ShardIdString(expected.id), holder.node_id);
  return out;
}

absl::StatusOr<OpenResult> Restorer::ByDecode(const ShardRecord& expected, const EcDecodeSource& src,
                                              const ClientRef& client, int64_t ttl_ms) {
  if (absl::StatusOr<OpenResult> held = OpenLocal(expected.id, false, client, ttl_ms); Decides(held)) return held;
  if (d_.peers == nullptr) return absl::UnavailableError("this agent has no data plane");
  CKPT_ASSIGN_OR_RETURN(ReservationPtr bytes, ReserveFor(expected));
  const uint64_t shard_start = src.blob_offset_bytes;
  const uint64_t shard_end = shard_start + expected.size_bytes;
  // Each stripe holding part of the shard is rebuilt into the shard's space
  // (read from the surviving data segment, else decoded); stripes run
  // concurrently. The reconstructor lands peer data in its own buffers, so a
  // failed stripe never leaves a transfer writing into `bytes`.
  std::vector<absl::Status> results(src.stripes.size());
  std::vector<std::function<void()>> work;
  for (size_t i = 0; i < src.stripes.size(); ++i) {
    work.push_back([&, i] {
      const EcStripeSource& s = src.stripes[i];
      const uint64_t seg_start = static_cast<uint64_t>(s.blob_segment_index) * src.segment_bytes;
      const uint64_t a = std::max(seg_start, shard_start);
      const uint64_t b = std::min(seg_start + src.segment_bytes, shard_end);
      if (a >= b) return;
      absl::Status st = d_.reconstructor->Rebuild(s.segments, src.data_k, src.parity_m, s.stripe_length_bytes,
                                                  s.position, s.blob_segment_index, a - seg_start,
                                                  bytes->MutablePieces(a - shard_start, b - a));
      if (!st.ok()) results[i] = absl::Status(st.code(), absl::StrCat("stripe ", s.stripe_index, ": ", st.message()));
    });
  }
  d_.stripes->RunAll(std::move(work));
  absl::Status st;
  for (const absl::Status& r : results) {
    if (!r.ok() && st.ok()) st = r;
  }
  if (st.ok()) {
    const uint32_t crc = bytes->Crc(0, expected.size_bytes);
    if (crc != expected.crc32c) {
      log::Warn("restore of {}: the shard decoded from the EC stripes of node \"{}\" has crc32c {:#010x}, the "
                "shard {:#010x}", ShardIdString(expected.id), src.owner_node_id, crc, expected.crc32c);
      st = absl::DataLossError("the decoded shard does not match the shard's crc32c");
    }
  }
  if (!st.ok()) {
    d_.metrics->peer_errors->Increment();
    return st;
  }
  d_.metrics->peer_restores->Increment();
  return Adopt(expected, std::move(bytes), "", absl::StrCat("EC stripes of node \"", src.owner_node_id, "\""),
               client, ttl_ms);
}

absl::StatusOr<OpenResult> Restorer::FromDurable(const ShardRecord& expected, const std::string& durable_path,
                                                 const ClientRef& client, int64_t ttl_ms) {
  if (absl::StatusOr<OpenResult> held = OpenLocal(expected.id, false, client, ttl_ms); Decides(held)) return held;
  if (d_.durable_root.empty()) {
    return absl::UnavailableError("this agent has no durable tier (--durable-root is not set)");
  }
  CKPT_RETURN_IF_ERROR(ValidateManifest(expected.items, expected.size_bytes));
  std::vector<std::string> parts = absl::StrSplit(durable_path, '/');
  CKPT_ASSIGN_OR_RETURN(std::string path, JoinUnderRoot(d_.durable_root, std::span<const std::string>(parts)));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, d_.durable_fs->NewReadableFile(path));
  // (The file's size and crc32c go to the log, never into the error: see
  // the file comment.)
  if (file->Size() != expected.size_bytes) {
    log::Warn("restore of {}: durable file '{}' is {} bytes, the shard {}", ShardIdString(expected.id), path,
              file->Size(), expected.size_bytes);
    return absl::DataLossError(absl::StrCat("durable file ", QuoteForMessage(durable_path),
                                            " does not have the shard's size"));
  }
  CKPT_ASSIGN_OR_RETURN(ReservationPtr bytes, ReserveFor(expected));
  uint32_t crc = 0;
  uint64_t file_off = 0;
  for (const auto& piece : bytes->MutablePieces(0, expected.size_bytes)) {
    for (uint64_t off = 0; off < piece.size(); off += kReadChunkBytes) {
      const uint64_t len = std::min<uint64_t>(kReadChunkBytes, piece.size() - off);
      CKPT_ASSIGN_OR_RETURN(size_t got, file->PositionedRead(file_off, piece.subspan(off, len)));
      if (got != len) {
        return absl::DataLossError(absl::StrCat("durable file ", QuoteForMessage(durable_path), " ended early"));
      }
      crc = Crc32cExtend(crc, piece.data() + off, len);
      file_off += len;
    }
  }
  if (crc != expected.crc32c) {
    log::Warn("restore of {}: durable file '{}' has crc32c {:#010x}, the shard {:#010x}", ShardIdString(expected.id),
              path, crc, expected.crc32c);
    return absl::DataLossError(absl::StrCat("durable file ", QuoteForMessage(durable_path),
                                            " does not match the shard's crc32c"));
  }
  return Adopt(expected, std::move(bytes), durable_path, "the durable tier", client, ttl_ms);
}

}  // namespace ckpt::agent
