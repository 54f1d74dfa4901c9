// EtcdClient: a client of etcd's v3 API (etcd 3.4, over gRPC) for replicated
// meta (issue 37): key-value reads and writes, transactions that compare a
// key's version, create/mod revision or value, leases, and watches from a
// revision. The election and the lease keeper built on it are in
// etcd_session.h and etcd_election.h; docs/meta.md "Replicas on etcd: the
// client" shows how they fit.
//
//   EtcdOptions options;
//   options.endpoints = {"127.0.0.1:2379"};
//   CKPT_ASSIGN_OR_RETURN(std::unique_ptr<EtcdClient> etcd, EtcdClient::Create(options));
//   CKPT_ASSIGN_OR_RETURN(int64_t rev, etcd->Put("/ckpt/c1/x", "v"));
//   EtcdTxn txn;   // "write y only if x is still what I read"
//   txn.compare.push_back(EtcdCompare::ModRevision("/ckpt/c1/x", EtcdCompare::Result::kEqual, rev));
//   txn.success.push_back(EtcdOp::Put("/ckpt/c1/y", "w"));
//   CKPT_ASSIGN_OR_RETURN(EtcdTxnResult r, etcd->Txn(txn));   // r.succeeded
//
// Every call carries a deadline (EtcdOptions::call_timeout) and blocks until
// etcd answers or the deadline passes. No call is retried: a write that timed
// out may or may not have been applied, and only the caller knows whether
// doing it again is safe (a fenced Txn is; a plain Put of a log entry is not).
// When an endpoint is unreachable (UNAVAILABLE) or too slow (DEADLINE_EXCEEDED)
// the client moves on to the next endpoint, so the caller's retry goes to
// another member.
//
// Errors: the gRPC code etcd answered with (the numbers are absl's), the
// message "etcd <endpoint>: <call> <key>: <etcd's message>". Notably
// UNAVAILABLE (member down, no leader, "leader changed"), DEADLINE_EXCEEDED,
// NOT_FOUND (lease not found), OUT_OF_RANGE (a revision compacted away),
// INVALID_ARGUMENT (e.g. "request is too large": etcd's default limit is
// 1.5 MiB per request).
//
// Thread safety: EtcdClient is thread-safe (no lock is held across a call).
// An EtcdWatch is used by one thread at a time, and must be destroyed before
// the client that made it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/security/credentials.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ckpt::meta {

struct EtcdOptions {
  // The members' client addresses, "host:port" ("http://host:port", as etcd
  // prints them, is accepted). At least one.
  std::vector<std::string> endpoints;
  // Deadline of every unary call, and of a watch's creation.
  absl::Duration call_timeout = absl::Seconds(5);
  // TLS to etcd (e.g. grpc::SslCredentials); null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
};

// A key as etcd stores it (mvccpb.KeyValue).
struct EtcdKeyValue {
  std::string key;
  std::string value;
  int64_t create_revision = 0;  // revision of the key's creation (0: absent)
  int64_t mod_revision = 0;     // revision of its last change
  int64_t version = 0;          // changes since creation (1 after the create)
  int64_t lease = 0;            // lease the key is attached to (0: none)
};

// What Range reads. `range_end` empty: the key alone; EtcdPrefixEnd(key): every
// key with that prefix; "\0" (std::string(1, '\0')): every key >= key.
struct EtcdRange {
  enum class SortTarget { kKey, kVersion, kCreateRevision, kModRevision, kValue };
  enum class SortOrder { kNone, kAscend, kDescend };
  std::string range_end;
  int64_t limit = 0;     // 0: no limit
  int64_t revision = 0;  // read as of this revision; 0: the latest
  SortTarget sort_target = SortTarget::kKey;
  SortOrder sort_order = SortOrder::kNone;
  bool keys_only = false;
  bool count_only = false;
  // Only keys created (modified) within [min, max]; 0: no bound.
  int64_t min_create_revision = 0;
  int64_t max_create_revision = 0;
  int64_t min_mod_revision = 0;
  int64_t max_mod_revision = 0;
};

struct EtcdRangeResult {
  int64_t revision = 0;  // the store's revision the read saw
  std::vector<EtcdKeyValue> kvs;
  bool more = false;  // limit cut the answer short
  int64_t count = 0;  // keys in the range (before limit)
};

// One comparison of a Txn: `target` of `key` (or of every key in
// [key, range_end)) `result` the number or value given.
struct EtcdCompare {
  enum class Target { kVersion, kCreateRevision, kModRevision, kValue, kLease };
  enum class Result { kEqual, kGreater, kLess, kNotEqual };
  std::string key;
  std::string range_end;
  Target target = Target::kVersion;
  Result result = Result::kEqual;
  int64_t number = 0;  // for every target but kValue
  std::string value;   // for kValue

  static EtcdCompare Version(std::string key, Result result, int64_t version);
  static EtcdCompare CreateRevision(std::string key, Result result, int64_t revision);
  static EtcdCompare ModRevision(std::string key, Result result, int64_t revision);
  static EtcdCompare Value(std::string key, Result result, std::string value);
  static EtcdCompare Lease(std::string key, Result result, int64_t lease);
};

// One operation of a Txn.
struct EtcdOp {
  enum class Type { kGet, kPut, kDelete };
  Type type = Type::kGet;
  std::string key;
  std::string range_end;  // kGet, kDelete: as EtcdRange::range_end
  std::string value;      // kPut
  int64_t lease = 0;      // kPut
  int64_t limit = 0;      // kGet

  static EtcdOp Get(std::string key, std::string range_end = "");
  static EtcdOp Put(std::string key, std::string value, int64_t lease = 0);
  static EtcdOp Delete(std::string key, std::string range_end = "");
};

struct EtcdTxn {
  std::vector<EtcdCompare> compare;  // all must hold (an empty list holds)
  std::vector<EtcdOp> success;       // applied if they do
  std::vector<EtcdOp> failure;       // applied if not
};

struct EtcdOpResult {
  EtcdOp::Type type = EtcdOp::Type::kGet;
  std::vector<EtcdKeyValue> kvs;  // kGet
  int64_t deleted = 0;            // kDelete
};

struct EtcdTxnResult {
  bool succeeded = false;  // the comparisons held: `success` ran, else `failure`
  int64_t revision = 0;    // the store's revision after the txn (that of its writes, if any)
  std::vector<EtcdOpResult> results;  // one per op that ran, in order
};

struct EtcdLeaseGrant {
  int64_t id = 0;
  absl::Duration ttl;  // as etcd granted it (it raises tiny TTLs to its minimum)
};

struct EtcdEvent {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  // The key after the change; for kDelete, key and mod_revision (that of the
  // deletion) only.
  EtcdKeyValue kv;
};

// The range_end that selects every key starting with `prefix` ("a/" -> "a0";
// "\0" for an empty prefix or one of only 0xff bytes).
std::string EtcdPrefixEnd(const std::string& prefix);

class EtcdWatch;

class EtcdClient {
 public:
  // Checks the options and makes one channel per endpoint; connects lazily
  // (a member that is down fails the first call made to it, not Create).
  // InvalidArgument for no endpoint, an empty one, "https://" without
  // credentials, or a non-positive call_timeout.
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(EtcdOptions options);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // The key's current state, or nullopt if it does not exist.
  absl::StatusOr<std::optional<EtcdKeyValue>> Get(const std::string& key);
  absl::StatusOr<EtcdRangeResult> Range(const std::string& key, const EtcdRange& range);
  // Sets key to value (attached to `lease` if not 0); returns the revision of
  // the write.
  absl::StatusOr<int64_t> Put(const std::string& key, const std::string& value, int64_t lease = 0);
  // Deletes the key (or [key, range_end)); returns how many keys were deleted.
  absl::StatusOr<int64_t> Delete(const std::string& key, const std::string& range_end = "");
  // Drops the history before `revision` (every key keeps its value as of
  // then): etcd frees the space of deleted keys and old values. Watches and
  // reads at older revisions then fail with OUT_OF_RANGE. OUT_OF_RANGE too if
  // it is compacted already that far.
  absl::Status Compact(int64_t revision);
  // One atomic transaction. A comparison that fails is not an error:
  // succeeded is false and the failure ops ran.
  // `timeout`, if positive and below call_timeout, bounds this call instead.
  absl::StatusOr<EtcdTxnResult> Txn(const EtcdTxn& txn, absl::Duration timeout = absl::ZeroDuration());

  // A new lease of `ttl` (rounded up to whole seconds, at least 1); `id` 0
  // lets etcd choose it.
  absl::StatusOr<EtcdLeaseGrant> LeaseGrant(absl::Duration ttl, int64_t id = 0);
  // Ends the lease now and deletes its keys. NOT_FOUND if it had already
  // expired or been revoked.
  absl::Status LeaseRevoke(int64_t id);
  // Refreshes the lease once over etcd's LeaseKeepAlive stream (a stream per
  // refresh, so that each carries the deadline); returns the TTL it has again.
  // NOT_FOUND if it has expired or was revoked. `timeout` (if positive and
  // below call_timeout) bounds this call instead: a lease holder must give up
  // on a member that does not answer soon enough to try the next one before
  // its lease runs out.
  absl::StatusOr<absl::Duration> LeaseKeepAliveOnce(int64_t id, absl::Duration timeout = absl::ZeroDuration());

  // Watches `key` (or [key, range_end)) from `start_revision` (inclusive; 0:
  // from now): every change at or after it, in revision order, including
  // those already made. Returns once etcd has created the watch (within
  // call_timeout). If start_revision was compacted away, OUT_OF_RANGE from
  // here or from the watch's first Next().
  absl::StatusOr<std::unique_ptr<EtcdWatch>> Watch(const std::string& key, const std::string& range_end,
                                                   int64_t start_revision);

  // The endpoint the next call goes to.
  std::string endpoint() const;
  absl::Duration call_timeout() const;

 private:
  struct Impl;  // etcd_client.cc
  explicit EtcdClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// One watch stream: a thread reads etcd's answers into a queue that Next()
// drains. The watch ends when etcd cancels it (compaction), the connection
// breaks, or the owner cancels it; it is not re-created: resume with
// EtcdClient::Watch(key, range_end, next_revision()).
class EtcdWatch {
 public:
  // Cancels the stream and joins the reader thread. Blocks briefly.
  ~EtcdWatch();
  EtcdWatch(const EtcdWatch&) = delete;
  EtcdWatch& operator=(const EtcdWatch&) = delete;

  // The events that arrived, in revision order, waiting up to `timeout` for
  // at least one. DEADLINE_EXCEEDED if none came in time (the watch goes on).
  // Once the watch has ended and its events are drained: why it ended, for
  // good (UNAVAILABLE naming the endpoint when the stream broke, OUT_OF_RANGE
  // when etcd compacted the revisions it needed, CANCELLED after Cancel()).
  absl::StatusOr<std::vector<EtcdEvent>> Next(absl::Duration timeout);
  // The revision after the last event handed out by Next() (the start
  // revision before any): where a new watch resumes without a gap.
  int64_t next_revision() const;
  // Ends the watch; Next() then returns CANCELLED once drained. Blocks until
  // the reader thread has stopped.
  void Cancel();

 private:
  friend class EtcdClient;
  struct Impl;  // etcd_client.cc
  explicit EtcdWatch(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ckpt::meta
