#include "server/agent/reconstructor.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/lock_check.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "server/agent/ec_support.h"

namespace ckpt::agent {

using transport::MutablePieces;

namespace {

using Buffer = std::shared_ptr<std::vector<uint8_t>>;

}  // namespace

Reconstructor::Reconstructor(PeerClient* peers, Clock* clock, AgentMetrics* metrics, Options options)
    : peers_(peers), clock_(clock), metrics_(metrics), options_(options) {}

ReadReq Reconstructor::SegmentReadReq(const SegmentLocation& loc, uint32_t data_k, uint32_t blob_segment_index,
                                      uint64_t offset, uint64_t length) {
  ReadReq req;
  req.what = ReadWhat::kSegment;
  req.job_id = loc.key.job_id;
  req.step = loc.key.step;
  req.group = loc.key.group;
  req.stripe = loc.key.stripe;
  req.position = loc.key.position;
  req.data_k = data_k;
  req.blob_segment_index = blob_segment_index;
  req.offset = offset;
  req.length = length;
  return req;
}

bool Reconstructor::IsSlow(const std::string& node_id) {
  CheckedLock lock(&mu_);
  auto it = slow_.find(node_id);
  if (it == slow_.end()) return false;
  if (clock_->MonotonicNow() - it->second > options_.remember_slow) {
    slow_.erase(it);
    return false;
  }
  return true;
}

void Reconstructor::MarkSlow(const std::string& node_id) {
  CheckedLock lock(&mu_);
  slow_[node_id] = clock_->MonotonicNow();
}

absl::Status Reconstructor::Rebuild(const std::vector<SegmentLocation>& sources, uint32_t data_k,
                                    uint32_t parity_m, uint64_t stripe_bytes, uint32_t position,
                                    uint32_t blob_segment_index, uint64_t offset, const MutablePieces& out) {
  CKPT_ASSIGN_OR_RETURN(const ec::Codec* codec, CodecFor(data_k, parity_m));
  const uint64_t len = transport::TotalBytes(out);
  if (len == 0) return absl::OkStatus();
  const uint32_t n = data_k + parity_m;
  if (position >= n || offset > stripe_bytes || len > stripe_bytes - offset) {
    return absl::InvalidArgumentError("rebuild range outside the stripe");
  }
  const uint64_t slice = std::min<uint64_t>(len, std::max<uint64_t>(options_.slice_bytes, 4096));
  // One buffer per position (+1 for the decoded output); replaced when a
  // read on it is abandoned.
  std::vector<Buffer> bufs(n + 1);
  auto buffer = [&](uint32_t p) -> Buffer& {
    if (bufs[p] == nullptr) bufs[p] = std::make_shared<std::vector<uint8_t>>(slice);
    return bufs[p];
  };
  std::vector<bool> usable(sources.size(), true);  // false once a source failed
  std::vector<std::string> errors;
  std::vector<size_t> worked;  // sources that served the previous slice
  std::vector<ec::Fragment> frags(n);
  for (uint64_t off = 0; off < len; off += slice) {
    const uint64_t cnt = std::min(slice, len - off);
    const uint64_t at = offset + off;
    // Order: sources that just worked, then the rest; slow holders last.
    std::vector<size_t> order = worked;
    for (size_t i = 0; i < sources.size(); ++i) {
      if (std::find(order.begin(), order.end(), i) == order.end()) order.push_back(i);
    }
    std::stable_partition(order.begin(), order.end(), [&](size_t i) {
      return !sources[i].holder.suspect && !IsSlow(sources[i].holder.node_id);
    });
    std::vector<bool> present(n, false);
    std::vector<uint64_t> real(n, 0);  // bytes of the slice a fragment really has (rest: zero padding)
    std::map<uint64_t, size_t> active;  // read id -> source index
    std::set<uint32_t> active_pos;
    std::vector<size_t> got;  // sources whose bytes are in `bufs` for this slice
    bool direct_done = false;
    auto abandon = [&](uint64_t id) {
      const uint32_t p = sources[active[id]].key.position;
      peers_->Abandon(id);
      bufs[p] = nullptr;  // a late payload may still land in it
      active_pos.erase(p);
      active.erase(id);
    };
    // Starts a read of source i; false if it cannot be started.
    auto start = [&](size_t i) -> bool {
      const SegmentLocation& loc = sources[i];
      const uint32_t p = loc.key.position;
      if (!usable[i] || p >= n || present[p] || active_pos.count(p) != 0) return false;
      real[p] = loc.length_bytes > at ? std::min(cnt, loc.length_bytes - at) : 0;
      if (real[p] == 0) {  // all padding here: zeros, nothing to read
        std::memset(buffer(p)->data(), 0, cnt);
        present[p] = true;
        got.push_back(i);
        return true;
      }
      Buffer buf = buffer(p);
      const bool direct = p == position;
      const absl::Time asked = clock_->MonotonicNow();
      absl::StatusOr<uint64_t> id = peers_->StartRead(
          loc.holder,
          SegmentReadReq(loc, direct ? data_k : 0, direct ? blob_segment_index : 0, at, real[p]),
          MutablePieces{std::span<std::byte>(reinterpret_cast<std::byte*>(buf->data()), real[p])}, buf,
          // A survivor that does not even take a connection within the
          // hedge delay (stopped, overloaded) is read around, as a silent
          // read is.
          std::max<int64_t>(absl::ToInt64Milliseconds(options_.hedge_after), 1));
      if (!id.ok()) {
        if (clock_->MonotonicNow() - asked >= options_.hedge_after) {
          MarkSlow(loc.holder.node_id);  // it made us wait: the others are read instead
          metrics_->hedged_reads->Increment();
        }
        usable[i] = false;
        errors.push_back(std::string(id.status().message()));
        return false;
      }
      active[*id] = i;
      active_pos.insert(p);
      return true;
    };
    auto others_present = [&] {
      uint32_t c = 0;
      for (uint32_t p = 0; p < n; ++p) c += (present[p] && p != position) ? 1 : 0;
      return c;
    };
    auto others_active = [&] {
      uint32_t c = 0;
      for (uint32_t p : active_pos) c += p != position ? 1 : 0;
      return c;
    };
    // Keeps enough reads going: the wanted fragment alone, or k others.
    auto top_up = [&](bool hedge) {
      // Read the wanted fragment itself only from a healthy holder; one meta
      // calls SUSPECT or that was slow lately is decoded around at once.
      bool direct_possible = false;
      for (size_t i : order) {
        if (usable[i] && sources[i].key.position == position && !sources[i].holder.suspect &&
            !IsSlow(sources[i].holder.node_id)) {
          direct_possible = true;
        }
      }
      if (!hedge && direct_possible && others_present() + others_active() == 0) {
        for (size_t i : order) {
          if (sources[i].key.position == position && !sources[i].holder.suspect && start(i)) return;
        }
      }
      uint32_t want = data_k;
      if (hedge && others_present() + others_active() >= data_k) want = others_present() + others_active() + 1;
      for (size_t i : order) {
        if (others_present() + others_active() >= want) break;
        if (sources[i].key.position == position) continue;
        start(i);
      }
      // Too few others to decode: the wanted fragment's holder after all,
      // even a suspect or slow one.
      if (active.empty() && others_present() < data_k) {
        for (size_t i : order) {
          if (sources[i].key.position == position && start(i)) return;
        }
      }
    };
    top_up(false);
    while (!direct_done && others_present() < data_k) {
      if (active.empty()) {
        top_up(false);
        if (active.empty()) break;  // nothing left to try
      }
      std::vector<uint64_t> ids;
      for (const auto& [id, i] : active) ids.push_back(id);
      const uint64_t done = peers_->AwaitAny(ids, clock_->MonotonicNow() + options_.hedge_after);
      if (done == 0) {
        // Nothing answered for a while: hedge with more survivors.
        for (const auto& [id, i] : active) MarkSlow(sources[i].holder.node_id);
        const size_t before = active.size();
        top_up(true);
        if (active.size() > before) metrics_->hedged_reads->Increment(static_cast<double>(active.size() - before));
        if (active.size() == before && ids.size() == active.size()) {
          // No one else to ask: keep waiting on what is in flight (each read
          // ends on its own after the peer timeout without progress).
          const uint64_t any = peers_->AwaitAny(ids, absl::InfiniteFuture());
          if (any == 0) {
            for (uint64_t id : ids) abandon(id);
            return absl::CancelledError("agent is shutting down");
          }
        }
        continue;
      }
      const size_t i = active[done];
      const uint32_t p = sources[i].key.position;
      absl::StatusOr<uint32_t> crc = peers_->FinishRead(done);
      active.erase(done);
      active_pos.erase(p);
      if (!crc.ok()) {
        usable[i] = false;
        bufs[p] = nullptr;
        errors.push_back(std::string(crc.status().message()));
        if (absl::IsCancelled(crc.status())) {
          std::vector<uint64_t> rest;
          for (const auto& [id, j] : active) rest.push_back(id);
          for (uint64_t id : rest) abandon(id);
          return crc.status();
        }
        top_up(false);
        continue;
      }
      std::memset(bufs[p]->data() + real[p], 0, cnt - real[p]);  // zero padding of a short fragment
      present[p] = true;
      got.push_back(i);
      if (p == position) direct_done = true;
      if (!direct_done && others_present() < data_k) top_up(false);
    }
    // Whatever is still in flight is not needed any more.
    std::vector<uint64_t> leftover;
    for (const auto& [id, i] : active) leftover.push_back(id);
    for (uint64_t id : leftover) abandon(id);
    if (!direct_done && others_present() < data_k) {
      return absl::DataLossError(absl::StrCat("only ", others_present(), " of the ", data_k,
                                              " segments needed could be read", errors.empty() ? "" : ": ",
                                              absl::StrJoin(errors, "; ")));
    }
    worked = got;
    const uint8_t* result = nullptr;
    if (direct_done) {
      result = bufs[position]->data();
    } else {
      std::vector<bool> use(n, false);
      uint32_t used = 0;
      for (uint32_t p = 0; p < n && used < data_k; ++p) {
        if (present[p] && p != position) {
          use[p] = true;
          ++used;
        }
      }
      Buffer& outbuf = bufs[n];
      if (outbuf == nullptr) outbuf = std::make_shared<std::vector<uint8_t>>(slice);
      for (uint32_t p = 0; p < n; ++p) {
        if (use[p]) {
          frags[p] = ec::Fragment{bufs[p]->data(), cnt, true};
        } else if (p == position) {
          frags[p] = ec::Fragment{outbuf->data(), cnt, false};
        } else {
          frags[p] = ec::Fragment{outbuf->data(), 0, false};  // missing, nothing wanted
        }
      }
      CKPT_RETURN_IF_ERROR(codec->Decode(frags, cnt));
      result = outbuf->data();
    }
    uint64_t copied = 0;
    for (const auto& piece : transport::SlicePieces(out, off, cnt)) {
      std::memcpy(piece.data(), result + copied, piece.size());
      copied += piece.size();
    }
  }
  return absl::OkStatus();
}

}  // namespace ckpt::agent
