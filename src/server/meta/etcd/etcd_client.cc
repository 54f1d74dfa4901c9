#include "server/meta/etcd/etcd_client.h"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <thread>
#include <utility>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_security.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"

namespace ckpt::meta {
namespace {

namespace pb = etcdserverpb;

// For messages: a key as "\"...\"" with unprintable bytes escaped.
std::string Quote(const std::string& key) { return absl::StrCat("\"", absl::CHexEscape(key), "\""); }

std::chrono::system_clock::time_point DeadlineAfter(absl::Duration timeout) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout);
}

EtcdKeyValue FromProto(const mvccpb::KeyValue& kv) {
  EtcdKeyValue out;
  out.key = kv.key();
  out.value = kv.value();
  out.create_revision = kv.create_revision();
  out.mod_revision = kv.mod_revision();
  out.version = kv.version();
  out.lease = kv.lease();
  return out;
}

void ToProto(const std::string& key, const EtcdRange& range, pb::RangeRequest* req) {
  req->set_key(key);
  req->set_range_end(range.range_end);
  req->set_limit(range.limit);
  req->set_revision(range.revision);
  switch (range.sort_order) {
    case EtcdRange::SortOrder::kNone: req->set_sort_order(pb::RangeRequest::NONE); break;
    case EtcdRange::SortOrder::kAscend: req->set_sort_order(pb::RangeRequest::ASCEND); break;
    case EtcdRange::SortOrder::kDescend: req->set_sort_order(pb::RangeRequest::DESCEND); break;
  }
  switch (range.sort_target) {
    case EtcdRange::SortTarget::kKey: req->set_sort_target(pb::RangeRequest::KEY); break;
    case EtcdRange::SortTarget::kVersion: req->set_sort_target(pb::RangeRequest::VERSION); break;
    case EtcdRange::SortTarget::kCreateRevision: req->set_sort_target(pb::RangeRequest::CREATE); break;
    case EtcdRange::SortTarget::kModRevision: req->set_sort_target(pb::RangeRequest::MOD); break;
    case EtcdRange::SortTarget::kValue: req->set_sort_target(pb::RangeRequest::VALUE); break;
  }
  req->set_keys_only(range.keys_only);
  req->set_count_only(range.count_only);
  req->set_min_create_revision(range.min_create_revision);
  req->set_max_create_revision(range.max_create_revision);
  req->set_min_mod_revision(range.min_mod_revision);
  req->set_max_mod_revision(range.max_mod_revision);
}

void ToProto(const EtcdCompare& c, pb::Compare* out) {
  out->set_key(c.key);
  out->set_range_end(c.range_end);
  switch (c.result) {
    case EtcdCompare::Result::kEqual: out->set_result(pb::Compare::EQUAL); break;
    case EtcdCompare::Result::kGreater: out->set_result(pb::Compare::GREATER); break;
    case EtcdCompare::Result::kLess: out->set_result(pb::Compare::LESS); break;
    case EtcdCompare::Result::kNotEqual: out->set_result(pb::Compare::NOT_EQUAL); break;
  }
  switch (c.target) {
    case EtcdCompare::Target::kVersion:
      out->set_target(pb::Compare::VERSION);
      out->set_version(c.number);
      break;
    case EtcdCompare::Target::kCreateRevision:
      out->set_target(pb::Compare::CREATE);
      out->set_create_revision(c.number);
      break;
    case EtcdCompare::Target::kModRevision:
      out->set_target(pb::Compare::MOD);
      out->set_mod_revision(c.number);
      break;
    case EtcdCompare::Target::kValue:
      out->set_target(pb::Compare::VALUE);
      out->set_value(c.value);
      break;
    case EtcdCompare::Target::kLease:
      out->set_target(pb::Compare::LEASE);
      out->set_lease(c.number);
      break;
  }
}

void ToProto(const EtcdOp& op, pb::RequestOp* out) {
  switch (op.type) {
    case EtcdOp::Type::kGet: {
      pb::RangeRequest* r = out->mutable_request_range();
      r->set_key(op.key);
      r->set_range_end(op.range_end);
      r->set_limit(op.limit);
      break;
    }
    case EtcdOp::Type::kPut: {
      pb::PutRequest* r = out->mutable_request_put();
      r->set_key(op.key);
      r->set_value(op.value);
      r->set_lease(op.lease);
      break;
    }
    case EtcdOp::Type::kDelete: {
      pb::DeleteRangeRequest* r = out->mutable_request_delete_range();
      r->set_key(op.key);
      r->set_range_end(op.range_end);
      break;
    }
  }
}

EtcdOpResult FromProto(const pb::ResponseOp& r) {
  EtcdOpResult out;
  switch (r.response_case()) {
    case pb::ResponseOp::kResponseRange:
      out.type = EtcdOp::Type::kGet;
      for (const auto& kv : r.response_range().kvs()) out.kvs.push_back(FromProto(kv));
      break;
    case pb::ResponseOp::kResponsePut:
      out.type = EtcdOp::Type::kPut;
      break;
    case pb::ResponseOp::kResponseDeleteRange:
      out.type = EtcdOp::Type::kDelete;
      out.deleted = r.response_delete_range().deleted();
      break;
    default:  // nested txns are not sent
      break;
  }
  return out;
}

// "http://h:p" -> "h:p"; "https://" only with credentials.
absl::StatusOr<std::string> ChannelTarget(const std::string& endpoint, bool tls) {
  std::string target = endpoint;
  if (absl::StartsWith(target, "http://")) {
    target = target.substr(7);
  } else if (absl::StartsWith(target, "https://")) {
    if (!tls) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd endpoint ", endpoint, " is https:// but no TLS credentials were given"));
    }
    target = target.substr(8);
  }
  while (!target.empty() && target.back() == '/') target.pop_back();
  if (target.empty()) return absl::InvalidArgumentError(absl::StrCat("etcd endpoint \"", endpoint, "\" is empty"));
  return target;
}

}  // namespace

struct EtcdClient::Impl {
  struct Endpoint {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<pb::KV::Stub> kv;
    std::unique_ptr<pb::Lease::Stub> lease;
    std::unique_ptr<pb::Watch::Stub> watch;
  };

  absl::Duration call_timeout;
  std::vector<Endpoint> endpoints;  // immutable after Create
  std::atomic<size_t> current{0};   // the endpoint calls go to

  size_t Pick() const { return current.load(std::memory_order_relaxed) % endpoints.size(); }

  // The absl::Status of a failed call to endpoint `i`; moves on to the next
  // endpoint if this one looks down or slow.
  absl::Status Failed(size_t i, const grpc::Status& status, const std::string& what) {
    const auto code = static_cast<absl::StatusCode>(status.error_code());
    MaybeMoveOn(i, code);
    return absl::Status(code, absl::StrCat("etcd ", endpoints[i].address, ": ", what, ": ",
                                           status.error_message()));
  }

  void MaybeMoveOn(size_t i, absl::StatusCode code) {
    if (code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded) {
      size_t expected = i;
      current.compare_exchange_strong(expected, (i + 1) % endpoints.size());
    }
  }

  void Prepare(grpc::ClientContext* ctx, absl::Duration timeout = absl::ZeroDuration()) const {
    ctx->set_deadline(DeadlineAfter(timeout > absl::ZeroDuration() ? std::min(timeout, call_timeout) : call_timeout));
    ctx->set_wait_for_ready(false);  // a member that is down fails fast
  }
};

struct EtcdWatch::Impl {
  std::string endpoint;
  std::string what;  // "Watch \"key\"" for messages
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<pb::WatchRequest, pb::WatchResponse>> stream;
  std::thread reader;

  mutable absl::Mutex mu;
  bool created ABSL_GUARDED_BY(mu) = false;
  bool cancel_requested ABSL_GUARDED_BY(mu) = false;
  absl::Status ended ABSL_GUARDED_BY(mu);  // not OK once the stream is over
  std::deque<EtcdEvent> events ABSL_GUARDED_BY(mu);
  int64_t next_revision ABSL_GUARDED_BY(mu) = 0;  // after the last event handed out

  // Conditions of mu.Await.
  bool CreatedOrEnded() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return created || !ended.ok(); }
  bool HasNews() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return !events.empty() || !ended.ok(); }

  // The reader thread: etcd's answers into `events` until the stream ends.
  // Holds `mu` only to publish, never across Read().
  void Run() {
    pthread_setname_np(pthread_self(), "etcd-watch");
    pb::WatchResponse resp;
    absl::Status why;
    while (stream->Read(&resp)) {
      absl::MutexLock lock(&mu);
      if (resp.created()) created = true;
      for (const mvccpb::Event& ev : resp.events()) {
        EtcdEvent e;
        e.type = ev.type() == mvccpb::Event::DELETE ? EtcdEvent::Type::kDelete : EtcdEvent::Type::kPut;
        e.kv = FromProto(ev.kv());
        events.push_back(std::move(e));
      }
      if (resp.canceled()) {
        if (resp.compact_revision() > 0) {
          why = absl::OutOfRangeError(absl::StrCat("etcd ", endpoint, ": ", what, ": revisions before ",
                                                   resp.compact_revision(), " were compacted"));
        } else {
          why = absl::CancelledError(absl::StrCat("etcd ", endpoint, ": ", what, ": etcd cancelled the watch: ",
                                                  resp.cancel_reason()));
        }
        break;
      }
    }
    if (!why.ok()) {  // etcd cancelled the watch: close our side too
      ctx.TryCancel();
      while (stream->Read(&resp)) {
      }
    }
    const grpc::Status finish = stream->Finish();
    absl::MutexLock lock(&mu);
    if (why.ok()) {
      if (cancel_requested) {
        why = absl::CancelledError(absl::StrCat("etcd ", endpoint, ": ", what, ": cancelled"));
      } else if (!finish.ok()) {
        why = absl::Status(static_cast<absl::StatusCode>(finish.error_code()),
                           absl::StrCat("etcd ", endpoint, ": ", what, ": ", finish.error_message()));
      } else {
        why = absl::UnavailableError(absl::StrCat("etcd ", endpoint, ": ", what, ": the stream ended"));
      }
    }
    ended = why;
  }

  void Stop() {
    {
      absl::MutexLock lock(&mu);
      cancel_requested = true;
    }
    ctx.TryCancel();
    if (reader.joinable()) reader.join();
  }
};

EtcdCompare EtcdCompare::Version(std::string key, Result result, int64_t version) {
  EtcdCompare c;
  c.key = std::move(key);
  c.target = Target::kVersion;
  c.result = result;
  c.number = version;
  return c;
}
EtcdCompare EtcdCompare::CreateRevision(std::string key, Result result, int64_t revision) {
  EtcdCompare c = Version(std::move(key), result, revision);
  c.target = Target::kCreateRevision;
  return c;
}
EtcdCompare EtcdCompare::ModRevision(std::string key, Result result, int64_t revision) {
  EtcdCompare c = Version(std::move(key), result, revision);
  c.target = Target::kModRevision;
  return c;
}
EtcdCompare EtcdCompare::Lease(std::string key, Result result, int64_t lease) {
  EtcdCompare c = Version(std::move(key), result, lease);
  c.target = Target::kLease;
  return c;
}
EtcdCompare EtcdCompare::Value(std::string key, Result result, std::string value) {
  EtcdCompare c;
  c.key = std::move(key);
  c.target = Target::kValue;
  c.result = result;
  c.value = std::move(value);
  return c;
}

EtcdOp EtcdOp::Get(std::string key, std::string range_end) {
  EtcdOp op;
  op.type = Type::kGet;
  op.key = std::move(key);
  op.range_end = std::move(range_end);
  return op;
}
EtcdOp EtcdOp::Put(std::string key, std::string value, int64_t lease) {
  EtcdOp op;
  op.type = Type::kPut;
  op.key = std::move(key);
  op.value = std::move(value);
  op.lease = lease;
  return op;
}
EtcdOp EtcdOp::Delete(std::string key, std::string range_end) {
  EtcdOp op;
  op.type = Type::kDelete;
  op.key = std::move(key);
  op.range_end = std::move(range_end);
  return op;
}

std::string EtcdPrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    const auto last = static_cast<unsigned char>(end.back());
    if (last < 0xff) {
      end.back() = static_cast<char>(last + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');
}

EtcdClient::EtcdClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EtcdClient::~EtcdClient() = default;

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(EtcdOptions options) {
  if (options.endpoints.empty()) return absl::InvalidArgumentError("etcd: no endpoint given");
  if (options.call_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("etcd: call_timeout must be positive");
  }
  auto impl = std::make_unique<Impl>();
  impl->call_timeout = options.call_timeout;
  const bool tls = options.credentials != nullptr;
  auto credentials = tls ? options.credentials : grpc::InsecureChannelCredentials();
  for (const std::string& endpoint : options.endpoints) {
    absl::StatusOr<std::string> target = ChannelTarget(endpoint, tls);
    if (!target.ok()) return target.status();
    grpc::ChannelArguments args;
    SetReconnectArgs(&args);
    // Notice a member that vanished without closing the connection (a watch
    // waits on its stream with no deadline). etcd refuses pings more often
    // than every 5 s (--grpc-keepalive-min-time).
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                static_cast<int>(absl::ToInt64Milliseconds(options.call_timeout)));
    // Keep pinging a quiet watch (gRPC stops after 2 pings without data).
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    Impl::Endpoint e;
    e.address = *target;
    e.channel = grpc::CreateCustomChannel(*target, credentials, args);
    e.kv = pb::KV::NewStub(e.channel);
    e.lease = pb::Lease::NewStub(e.channel);
    e.watch = pb::Watch::NewStub(e.channel);
    impl->endpoints.push_back(std::move(e));
  }
  return std::unique_ptr<EtcdClient>(new EtcdClient(std::move(impl)));
}

std::string EtcdClient::endpoint() const { return impl_->endpoints[impl_->Pick()].address; }
absl::Duration EtcdClient::call_timeout() const { return impl_->call_timeout; }

absl::StatusOr<EtcdRangeResult> EtcdClient::Range(const std::string& key, const EtcdRange& range) {
  pb::RangeRequest req;
  ToProto(key, range, &req);
  pb::RangeResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  const size_t i = impl_->Pick();
  grpc::Status status = impl_->endpoints[i].kv->Range(&ctx, req, &resp);
  if (!status.ok()) return impl_->Failed(i, status, absl::StrCat("Range ", Quote(key)));
  EtcdRangeResult out;
  out.revision = resp.header().revision();
  out.more = resp.more();
  out.count = resp.count();
  out.kvs.reserve(resp.kvs_size());
  for (const auto& kv : resp.kvs()) out.kvs.push_back(FromProto(kv));
  return out;
}

absl::StatusOr<std::optional<EtcdKeyValue>> EtcdClient::Get(const std::string& key) {
  absl::StatusOr<EtcdRangeResult> r = Range(key, EtcdRange());
  if (!r.ok()) return r.status();
  if (r->kvs.empty()) return std::optional<EtcdKeyValue>();
  return std::optional<EtcdKeyValue>(std::move(r->kvs.front()));
}

absl::StatusOr<int64_t> EtcdClient::Put(const std::string& key, const std::string& value, int64_t lease) {
  pb::PutRequest req;
  req.set_key(key);
  req.set_value(value);
  req.set_lease(lease);
  pb::PutResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  const size_t i = impl_->Pick();
  grpc::Status status = impl_->endpoints[i].kv->Put(&ctx, req, &resp);
  if (!status.ok()) return impl_->Failed(i, status, absl::StrCat("Put ", Quote(key)));
  return resp.header().revision();
}

absl::StatusOr<int64_t> EtcdClient::Delete(const std::string& key, const std::string& range_end) {
  pb::DeleteRangeRequest req;
  req.set_key(key);
  req.set_range_end(range_end);
  pb::DeleteRangeResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  const size_t i = impl_->Pick();
  grpc::Status status = impl_->endpoints[i].kv->DeleteRange(&ctx, req, &resp);
  if (!status.ok()) return impl_->Failed(i, status, absl::StrCat("Delete ", Quote(key)));
  return resp.deleted();
}

absl::Status EtcdClient::Compact(int64_t revision) {
  pb::CompactionRequest req;
  req.set_revision(revision);
  pb::CompactionResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  const size_t i = impl_->Pick();
  grpc::Status status = impl_->endpoints[i].kv->Compact(&ctx, req, &resp);
  if (!status.ok()) return impl_->Failed(i, status, absl::StrCat("Compact ", revision));
  return absl::OkStatus();
}

absl::StatusOr<EtcdTxnResult> EtcdClient::Txn(const EtcdTxn& txn, absl::Duration timeout) {
  pb::TxnRequest req;
  for (const EtcdCompare& c : txn.compare) ToProto(c, req.add_compare());
  for (const EtcdOp& op : txn.success) ToProto(op, req.add_success());
  for (const EtcdOp& op : txn.failure) ToProto(op, req.add_failure());
  pb::TxnResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx, timeout);
  const size_t i = impl_->Pick();
  grpc::Status status = impl_->endpoints[i].kv->Txn(&ctx, req, &resp);
  if (!status.ok()) {
    const std::string first = !txn.compare.empty()   ? txn.compare.front().key
                              : !txn.success.empty() ? txn.success.front().key
                                                     : std::string();
    return impl_->Failed(i, status, absl::StrCat("Txn on ", Quote(first)));
  }
  EtcdTxnResult out;
  out.succeeded = resp.succeeded();
  out.revision = resp.header().revision();
  for (const pb::ResponseOp& r : resp.responses()) out.results.push_back(FromProto(r));
  return out;
}

absl::StatusOr<EtcdLeaseGrant> EtcdClient::LeaseGrant(absl::Duration ttl, int64_t id) {
  pb::LeaseGrantRequest req;
  req.set_ttl(std::max<int64_t>(1, absl::ToInt64Seconds(absl::Ceil(ttl, absl::Seconds(1)))));
  req.set_id(id);
  pb::LeaseGrantResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  const size_t i = impl_->Pick();
  grpc::Status status = impl_->endpoints[i].lease->LeaseGrant(&ctx, req, &resp);
  if (!status.ok()) return impl_->Failed(i, status, "LeaseGrant");
  if (!resp.error().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("etcd ", impl_->endpoints[i].address, ": LeaseGrant: ", resp.error()));
  }
  return EtcdLeaseGrant{resp.id(), absl::Seconds(resp.ttl())};
}

absl::Status EtcdClient::LeaseRevoke(int64_t id) {
  pb::LeaseRevokeRequest req;
  req.set_id(id);
  pb::LeaseRevokeResponse resp;
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx);
  const size_t i = impl_->Pick();
  grpc::Status status = impl_->endpoints[i].lease->LeaseRevoke(&ctx, req, &resp);
  if (!status.ok()) return impl_->Failed(i, status, absl::StrCat("LeaseRevoke ", absl::Hex(id)));
  return absl::OkStatus();
}

absl::StatusOr<absl::Duration> EtcdClient::LeaseKeepAliveOnce(int64_t id, absl::Duration timeout) {
  grpc::ClientContext ctx;
  impl_->Prepare(&ctx, timeout);
  const size_t i = impl_->Pick();
  const std::string what = absl::StrCat("LeaseKeepAlive ", absl::Hex(id));
  auto stream = impl_->endpoints[i].lease->LeaseKeepAlive(&ctx);
  pb::LeaseKeepAliveRequest req;
  req.set_id(id);
  pb::LeaseKeepAliveResponse resp;
  const bool answered = stream->Write(req) && stream->Read(&resp);
  if (answered) {
    ctx.TryCancel();  // one refresh per stream: done with it
    (void)stream->Finish();  // CANCELLED, by us
  } else {
    grpc::Status status = stream->Finish();
    if (status.ok()) status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the stream ended without an answer");
    return impl_->Failed(i, status, what);
  }
  if (resp.ttl() <= 0) {
    return absl::NotFoundError(absl::StrCat("etcd ", impl_->endpoints[i].address, ": ", what,
                                            ": the lease has expired or was revoked"));
  }
  return absl::Seconds(resp.ttl());
}

absl::StatusOr<std::unique_ptr<EtcdWatch>> EtcdClient::Watch(const std::string& key, const std::string& range_end,
                                                             int64_t start_revision) {
  auto impl = std::make_unique<EtcdWatch::Impl>();
  const size_t i = impl_->Pick();
  impl->endpoint = impl_->endpoints[i].address;
  impl->what = absl::StrCat("Watch ", Quote(key));
  {
    absl::MutexLock lock(&impl->mu);
    impl->next_revision = start_revision;
  }
  // No deadline on the stream (it lives as long as the watch); its creation
  // is bounded below, and the channel's keepalive notices a dead member.
  impl->stream = impl_->endpoints[i].watch->Watch(&impl->ctx);
  pb::WatchRequest req;
  pb::WatchCreateRequest* create = req.mutable_create_request();
  create->set_key(key);
  create->set_range_end(range_end);
  create->set_start_revision(start_revision);
  if (!impl->stream->Write(req)) {
    impl->ctx.TryCancel();
    grpc::Status status = impl->stream->Finish();
    if (status.ok()) status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the stream closed");
    return impl_->Failed(i, status, impl->what);
  }
  EtcdWatch::Impl* raw = impl.get();
  impl->reader = std::thread([raw] { raw->Run(); });
  bool created = false;
  absl::Status ended;
  {
    absl::MutexLock lock(&impl->mu);
    impl->mu.AwaitWithTimeout(absl::Condition(raw, &EtcdWatch::Impl::CreatedOrEnded), impl_->call_timeout);
    created = impl->created;
    ended = impl->ended;
  }
  if (!created) {
    impl->Stop();
    if (!ended.ok()) {
      impl_->MaybeMoveOn(i, ended.code());  // as for unary calls
      return ended;
    }
    return impl_->Failed(i, grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "etcd did not create the watch in time"),
                         impl->what);
  }
  return std::unique_ptr<EtcdWatch>(new EtcdWatch(std::move(impl)));
}

EtcdWatch::EtcdWatch(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

EtcdWatch::~EtcdWatch() { Cancel(); }

void EtcdWatch::Cancel() { impl_->Stop(); }

int64_t EtcdWatch::next_revision() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->next_revision;
}

absl::StatusOr<std::vector<EtcdEvent>> EtcdWatch::Next(absl::Duration timeout) {
  Impl* w = impl_.get();
  absl::MutexLock lock(&w->mu);
  w->mu.AwaitWithTimeout(absl::Condition(w, &Impl::HasNews), timeout);
  if (!w->events.empty()) {
    std::vector<EtcdEvent> out(std::make_move_iterator(w->events.begin()),
                               std::make_move_iterator(w->events.end()));
    w->events.clear();
    w->next_revision = out.back().kv.mod_revision + 1;
    return out;
  }
  if (!w->ended.ok()) return w->ended;
  return absl::DeadlineExceededError(absl::StrCat("etcd ", w->endpoint, ": ", w->what, ": no event within ",
                                                  absl::FormatDuration(timeout)));
}

}  // namespace ckpt::meta
