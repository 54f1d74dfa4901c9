#include "cli/data_commands.h"

#include <grpcpp/grpcpp.h>
#include <errno.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "ckpt/client.h"
#include "ckpt/v1/agent.grpc.pb.h"
#include "common/grpc_security.h"
#include "ckpt/v1/meta.grpc.pb.h"
#include "common/config.h"
#include "common/crc32c.h"
#include "common/durable_format.h"
#include "common/durable_slices.h"
#include "common/global_tensor.h"
#include "common/manifest_proto.h"
#include "common/unix_socket.h"
#include "common/file_system.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt::cli {
namespace {

using Json = nlohmann::ordered_json;

absl::Status FromGrpc(const grpc::Status& s, const std::string& what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), absl::StrCat(what, ": ", s.error_message()));
}

bool json_errors = false;

// "ckptctl: CODE: message" on stderr, or with --json one JSON object
// {"error": {"code": ..., "message": ...}} (as ckptctl_main.cc's errors).
int Fail(const absl::Status& s) {
  if (json_errors) {
    std::fprintf(stderr, "%s\n",
                 Json{{"error", {{"code", absl::StatusCodeToString(s.code())}, {"message", std::string(s.message())}}}}
                     .dump()
                     .c_str());
  } else {
    std::fprintf(stderr, "ckptctl: %s: %s\n", absl::StatusCodeToString(s.code()).c_str(),
                 std::string(s.message()).c_str());
  }
  return 1;
}

}  // namespace

void SetJsonErrors(bool on) { json_errors = on; }

namespace {

std::unique_ptr<grpc::ClientContext> Context(const DataOptions& o) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000)));
  return ctx;
}

std::string Hex(uint32_t crc) { return absl::StrFormat("%08x", crc); }

// gRPC channel to ckpt-meta or an agent. Responses carry whole manifests
// (Locate, OpenShard) and ReadShard chunks: no size limit on what we receive.
// gRPC's bandwidth-delay probing grows a stream's receive window without
// bound while we write to a slower disk (100+ MB buffered for a 1 GiB
// shard); a fixed 8 MiB window keeps the read just as fast here.
std::shared_ptr<grpc::Channel> Channel(const DataOptions& o, const std::string& target) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 8 << 20);
  return ChannelWithToken(target, o.credentials != nullptr ? o.credentials : grpc::InsecureChannelCredentials(), args,
                          o.token);
}

// A stub for the AgentService of node `node_id` at `address` (see Channel).
// With TLS the agent must show node_id's certificate (checked in the
// handshake, before anything is sent: an address meta lists could be anyone's),
// and no token goes to it: the admin role is proven by certificate, and a token
// goes to ckpt-meta only. Without TLS (an --insecure loopback cluster) the
// token goes along for an agent's --admin-token-file.
std::unique_ptr<v1::AgentService::Stub> AgentStub(const DataOptions& o, const std::string& node_id,
                                                  const std::string& address) {
  if (!o.tls.enabled()) return v1::AgentService::NewStub(Channel(o, address));
  TlsFiles tls = o.tls;
  tls.expect_peer_uri = NodePeerUri(node_id);
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials = ChannelCredentials(tls);
  DataOptions to_agent = o;
  to_agent.token.clear();
  // (The files were read once at start: an error now is a changed file; the
  // call then fails UNAVAILABLE on plaintext against a TLS port.)
  to_agent.credentials = credentials.ok() ? *credentials : grpc::InsecureChannelCredentials();
  return v1::AgentService::NewStub(Channel(to_agent, address));
}

DurableShard ShardOf(const v1::ShardInfo& info) {
  DurableShard s;
  s.rank = info.key().rank();
  s.file = RankFileName(s.rank);
  s.size_bytes = info.size_bytes();
  s.crc32c = info.crc32c();
  s.manifest_digest = info.manifest_digest();
  for (const v1::Item& item : info.items()) s.items.push_back(ManifestItemFromProto(item));
  return s;
}

// Agent gRPC addresses by node id.
absl::StatusOr<std::map<std::string, std::string>> NodeAddresses(const DataOptions& o,
                                                                 v1::MetaService::Stub* meta) {
  v1::ListNodesRequest req;
  v1::ListNodesResponse resp;
  auto ctx = Context(o);
  absl::Status s = FromGrpc(meta->ListNodes(ctx.get(), req, &resp), "ListNodes");
  if (!s.ok()) return s;
  std::map<std::string, std::string> out;
  for (const v1::NodeInfo& n : resp.nodes()) out[n.endpoint().node_id()] = n.endpoint().grpc_address();
  return out;
}

// ReadShard chunk size: big enough that per-message costs vanish, small
// enough that the stream holds little memory on either side.
constexpr uint64_t kReadChunkBytes = 1 << 20;
// A ReadShard stream's deadline: --timeout plus the time the shard takes at
// this (slow) rate, so that shards of any size can finish.
constexpr double kSlowestStreamBytesPerSecond = 32.0 * (1 << 20);

// Streams a whole shard from the agent at `address` (ReadShard) into the
// rank file `path`, checking every chunk's crc, every item's crc32c (while
// the bytes go by) and the whole file's crc against `info`. Holds one chunk
// at a time. The file appears complete and checked, or not at all
// (RankFileWriter: temporary file, fsync, rename).
absl::Status StreamFromAgent(const DataOptions& o, const std::string& node, const std::string& address,
                             const v1::ShardInfo& info, const std::string& path) {
  const DurableShard shard = ShardOf(info);
  if (absl::Status s = ValidateManifest(shard.items, shard.size_bytes); !s.ok()) {
    return absl::DataLossError(absl::StrCat("the shard's manifest is bad: ", s.message()));
  }
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<RankFileWriter> out,
                        RankFileWriter::Create(PosixFileSystem(), path, shard.size_bytes, shard.crc32c));
  ItemCrcStream items(shard.items);
  auto stub = AgentStub(o, node, address);
  v1::ReadShardRequest req;
  *req.mutable_shard() = info.key();
  req.set_chunk_bytes(kReadChunkBytes);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(
                       (o.timeout_s + static_cast<double>(shard.size_bytes) / kSlowestStreamBytesPerSecond) * 1000)));
  auto reader = stub->ReadShard(&ctx, req);
  v1::ReadShardResponse msg;
  absl::Status bad;
  while (bad.ok() && reader->Read(&msg)) {
    if (msg.has_shard() && (msg.shard().size_bytes() != shard.size_bytes || msg.shard().crc32c() != shard.crc32c)) {
      bad = absl::DataLossError(absl::StrCat("the agent's copy is ", msg.shard().size_bytes(), " bytes with crc32c ",
                                             Hex(msg.shard().crc32c()), ", the version's ", shard.size_bytes,
                                             " bytes with crc32c ", Hex(shard.crc32c)));
    } else if (msg.offset_bytes() != items.position() && !msg.data().empty()) {
      bad = absl::DataLossError(absl::StrCat("the agent sent bytes at ", msg.offset_bytes(), ", expected ",
                                             items.position()));
    } else if (msg.data().size() > shard.size_bytes - items.position()) {
      bad = absl::DataLossError("the agent sent more bytes than the shard has");
    } else if (Crc32c(msg.data()) != msg.chunk_crc32c()) {
      bad = absl::DataLossError(absl::StrCat("chunk at ", msg.offset_bytes(), " failed its crc32c"));
    } else {
      const auto piece = std::as_bytes(std::span<const char>(msg.data()));
      bad = items.Update(piece);
      if (bad.ok()) bad = out->Append(piece);
      if (bad.ok() && o.meter != nullptr) o.meter->Add(piece.size());
      if (bad.ok()) MaybePauseAfterFirstChunk();
    }
  }
  // A failed read is not progress: the next source starts again.
  if (o.meter != nullptr && !bad.ok()) o.meter->Rewind(items.position());
  if (!bad.ok()) {
    ctx.TryCancel();
    reader->Finish().ok();  // cancelled by us: its status says nothing new
    return bad;
  }
  if (absl::Status s = FromGrpc(reader->Finish(), absl::StrCat("ReadShard from ", address)); !s.ok()) {
    if (o.meter != nullptr) o.meter->Rewind(items.position());
    return s;
  }
  if (items.position() != shard.size_bytes) {
    return absl::DataLossError(absl::StrCat("got ", items.position(), " of ", shard.size_bytes, " bytes"));
  }
  CKPT_RETURN_IF_ERROR(items.Finish());
  // Size and whole-file crc32c (DataLoss if they differ), then durable.
  return out->Commit();
}

}  // namespace

int SaveFile(const DataOptions& o, const std::string& job, uint64_t step, uint32_t rank, uint32_t world_size,
             const std::string& file) {
  std::error_code size_error;
  const uint64_t file_size = std::filesystem::file_size(file, size_error);
  std::FILE* in = size_error ? nullptr : std::fopen(file.c_str(), "rb");
  if (in == nullptr) return Fail(absl::NotFoundError(absl::StrCat("cannot read '", file, "'")));
  // Read in chunks: the progress line counts them (then the copy into the
  // agent's memory tier and its commit).
  Progress meter(absl::StrCat("save ", job, "/", step, " rank ", rank), file_size, o.progress);
  std::vector<char> data(file_size);
  size_t got = 0;
  while (got < data.size()) {
    const size_t n = std::fread(data.data() + got, 1, std::min<size_t>(kReadChunkBytes * 8, data.size() - got), in);
    if (n == 0) break;
    got += n;
    meter.Add(n);
  }
  const bool read_error = std::ferror(in) != 0 || got != data.size();
  std::fclose(in);
  if (read_error) return Fail(absl::UnavailableError(absl::StrCat("cannot read '", file, "' (", got, " of ", data.size(), " bytes)")));
  // A socket that cannot work fails now, saying what to do, instead of
  // after the client's connect timeout.
  if (absl::Status s = ProbeAgentSocket(o.agent_socket, "--agent-socket or CKPT_AGENT_SOCKET"); !s.ok()) {
    return Fail(s);
  }
  if (world_size == 0) {
    auto meta = v1::MetaService::NewStub(Channel(o, o.meta));
    v1::GetJobRequest req;
    req.set_job_id(job);
    v1::GetJobResponse resp;
    auto ctx = Context(o);
    absl::Status s = FromGrpc(meta->GetJob(ctx.get(), req, &resp), "GetJob");
    if (absl::IsNotFound(s)) {
      return Fail(absl::NotFoundError(absl::StrCat(s.message(), "; pass --world-size to create it")));
    }
    if (!s.ok()) return Fail(s);
    world_size = resp.job().spec().world_size();
  }
  ClientOptions co;
  co.meta_address = o.meta;
  co.agent_socket = o.agent_socket;
  co.job_id = job;
  co.rank = rank;
  co.world_size = world_size;
  co.connect_timeout = absl::Seconds(o.timeout_s);
  co.tls_ca_file = o.tls.ca_file;
  co.tls_cert_file = o.tls.cert_file;
  co.tls_key_file = o.tls.key_file;
  co.token_file = o.token_file;
  absl::StatusOr<Client> client = Client::Connect(co);
  if (!client.ok()) return Fail(client.status());
  meter.Note(absl::StrCat("read ", FormatBytes(data.size()), "; copying into the agent's memory tier"));
  SaveBuilder b = client->BeginSave(step);
  const std::string name = std::filesystem::path(file).filename().string();
  absl::Status s = b.Add(name, std::as_bytes(std::span<const char>(data)), DType::kBytes, {data.size()});
  if (!s.ok()) return Fail(s);
  absl::StatusOr<SaveHandle> h = b.Commit();
  if (!h.ok()) return Fail(h.status());
  if (absl::Status c = h->Committed(); !c.ok()) return Fail(c);  // the agent holds it before we say so
  meter.Finish();
  if (o.json) {
    std::cout << Json{{"job", job}, {"step", step}, {"rank", rank}, {"item", name},
                      {"size_bytes", h->size_bytes()}, {"crc32c", Hex(h->crc32c())}}
                     .dump(2)
              << "\n";
  } else {
    std::cout << "saved " << file << " as " << job << " step " << step << " rank " << rank << " ("
              << h->size_bytes() << " bytes, crc32c " << Hex(h->crc32c()) << ")\n";
  }
  return 0;
}

// The version's record at meta (with its shards, copies and segments).
absl::Status GetVersion(const DataOptions& o, v1::MetaService::Stub* meta, const std::string& job, uint64_t step,
                        v1::GetVersionResponse* out) {
  v1::GetVersionRequest req;
  req.set_job_id(job);
  req.set_step(step);
  auto ctx = Context(o);
  return FromGrpc(meta->GetVersion(ctx.get(), req, out), "GetVersion");
}

// A shard left only as EC stripes: an agent holding segments of them decodes
// it into its memory tier (it keeps a RESTORED copy), and it is streamed
// from there into `path` with every crc checked. `*node` names the agent
// asked.
absl::Status DecodeOnAgent(const DataOptions& o, const std::map<std::string, std::string>& addresses,
                           const v1::ShardInfo& info, const v1::ShardSource& src, const std::string& path,
                           std::string* node) {
  for (const auto& st : src.ec().stripes())
    for (const auto& seg : st.segments())
      if (node->empty()) *node = seg.holder().node_id();
  auto it = addresses.find(*node);
  if (it == addresses.end()) return absl::UnavailableError("no node holding a segment is known");
  auto stub = AgentStub(o, *node, it->second);
  v1::OpenShardRequest oreq;
  *oreq.mutable_key() = info.key();
  *oreq.add_sources() = src;
  *oreq.mutable_expected() = info;
  v1::OpenShardResponse oresp;
  {
    auto ctx = Context(o);
    CKPT_RETURN_IF_ERROR(FromGrpc(stub->OpenShard(ctx.get(), oreq, &oresp), absl::StrCat("OpenShard on ", *node)));
  }
  absl::Status read = StreamFromAgent(o, *node, it->second, info, path);
  v1::CloseShardRequest creq;
  creq.set_handle_id(oresp.handle_id());
  v1::CloseShardResponse cresp;
  auto ctx = Context(o);
  (void)stub->CloseShard(ctx.get(), creq, &cresp);  // the handle also expires on its own
  return read;
}

// Locates rank `r` of `job`/`step` at meta and streams it into `path` from
// the first source that serves it (a holder, or an agent decoding EC
// stripes), every crc checked. Returns where it came from; `info` gets the
// shard's record (items included).
// `counted`: the shard's size is already in o.meter's total (else added).
absl::StatusOr<std::string> FetchShard(const DataOptions& o, v1::MetaService::Stub* meta,
                                       const std::map<std::string, std::string>& addresses, const std::string& job,
                                       uint64_t step, uint32_t r, const std::string& path, v1::ShardInfo* info,
                                       bool counted = true) {
  v1::LocateRequest lreq;
  lreq.set_job_id(job);
  lreq.set_step(step);
  lreq.set_rank(r);
  v1::LocateResponse loc;
  {
    auto ctx = Context(o);
    CKPT_RETURN_IF_ERROR(FromGrpc(meta->Locate(ctx.get(), lreq, &loc), "Locate"));
  }
  if (!counted && o.meter != nullptr) o.meter->AddTotal(loc.shard().size_bytes());
  absl::Status read = absl::NotFoundError("no live source");
  std::string served, why;
  std::optional<absl::StatusCode> refusal;
  for (const v1::ShardSource& src : loc.sources()) {
    if (src.kind() == v1::SOURCE_KIND_EC_DECODE) {
      std::string node;
      read = DecodeOnAgent(o, addresses, loc.shard(), src, path, &node);
      if (read.ok()) {
        served = absl::StrCat(node, " (ec decode)");
        break;
      }
      absl::StrAppend(&why, "; decode on ", node, ": ", read.message());
      continue;
    }
    if (src.kind() != v1::SOURCE_KIND_LOCAL && src.kind() != v1::SOURCE_KIND_REPLICA) {
      absl::StrAppend(&why, "; ", v1::SourceKind_Name(src.kind()), ": not readable by ckptctl (use --from-dir)");
      continue;
    }
    std::string address = src.holder().grpc_address();
    if (address.empty()) {
      auto known = addresses.find(src.holder().node_id());
      if (known != addresses.end()) address = known->second;
    }
    read = StreamFromAgent(o, src.holder().node_id(), address, loc.shard(), path);
    if (read.ok()) {
      served = src.holder().node_id();
      break;
    }
    absl::StrAppend(&why, "; ", src.holder().node_id(), ": ", absl::StatusCodeToString(read.code()), ": ",
                    read.message());
    if (absl::IsUnauthenticated(read) || absl::IsPermissionDenied(read)) refusal = read.code();
  }
  if (!read.ok() && refusal) {
    // Not lost: this caller may not read it (the agents' --admin-token-file).
    return absl::Status(*refusal, absl::StrCat("rank ", r, ": the holders refused the read", why,
                                               " (the agents' TCP endpoint needs the admin token: --token-file)"));
  }
  if (!read.ok()) {
    return absl::DataLossError(absl::StrCat("rank ", r, " of ", job, "/", step, ": no source could be read", why,
                                            " (for a flushed version, use restore --from-dir)"));
  }
  *info = loc.shard();
  return served;
}

// Lays rank `shard.rank` of an incremental version (its own bytes already
// in `path`) out in one self-contained file at `path`: fetches this rank's
// shard of every version it refers to into a temporary file beside it,
// checks every reference is one of that shard's own items, and copies
// every item (crc checked) into the new layout. `served` gets where the
// referred shards came from.
absl::StatusOr<DurableShard> Materialize(const DataOptions& o, v1::MetaService::Stub* meta,
                                         const std::map<std::string, std::string>& addresses,
                                         const std::string& job, uint64_t step, const DurableShard& shard,
                                         const std::string& path, std::string* served) {
  std::map<uint64_t, std::string> base_files;  // ref step -> temporary file
  std::map<uint64_t, DurableShard> bases;
  absl::StatusOr<DurableShard> dense = absl::UnknownError("not materialized");
  [&] {
    for (uint64_t base : RefSteps(shard.items)) {
      // Hidden and named after this process (RestoreTempFileOwner): removed
      // on Ctrl-C, and swept by a later restore if this one is killed.
      const std::filesystem::path p(path);
      const std::string file = (p.parent_path() / absl::StrCat(".", p.filename().string(), ".ref-", base, ".tmp-",
                                                               ::getpid()))
                                   .string();
      base_files[base] = file;
      v1::ShardInfo info;
      absl::StatusOr<std::string> from =
          FetchShard(o, meta, addresses, job, base, shard.rank, file, &info, /*counted=*/false);
      if (!from.ok()) {
        dense = Annotate(from.status(), absl::StrCat("version ", base, ", whose items version ", step,
                                                     " refers to"));
        return;
      }
      absl::StrAppend(served, ", version ", base, " from ", *from);
      bases.emplace(base, ShardOf(info));
    }
    for (const ManifestItem& item : shard.items) {
      if (item.ref_step && !IsOwnItemOf(item, bases.at(*item.ref_step).items)) {
        dense = absl::DataLossError(absl::StrCat("rank ", shard.rank, " item ", QuoteForMessage(item.name),
                                                 " refers to [", item.offset_bytes, ", +", item.length_bytes,
                                                 ") of version ", *item.ref_step, ", which holds no such item"));
        return;
      }
    }
    std::vector<std::byte> bytes;
    dense = MaterializeShard(
        PosixFileSystem(), shard,
        [&](const ManifestItem& item) { return item.ref_step ? base_files.at(*item.ref_step) : path; }, &bytes);
    if (!dense.ok()) return;
    absl::StatusOr<std::unique_ptr<RankFileWriter>> w =
        RankFileWriter::Create(PosixFileSystem(), path, dense->size_bytes, dense->crc32c);
    absl::Status s = w.status();
    if (s.ok()) s = (*w)->Append(bytes);
    if (s.ok()) s = (*w)->Commit();
    if (!s.ok()) dense = s;
  }();
  for (const auto& [base, file] : base_files) std::remove(file.c_str());
  return dense;
}

// Makes `out_dir`, watches it for Ctrl-C, sweeps stale temporary files of
// ours there (their count in `*swept`) and, for a full restore (`uncommit`),
// removes a COMMITTED marker of what was there before.
absl::Status PrepareOutDir(const std::string& out_dir, bool uncommit, int* swept) {
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot create '", out_dir, "': ", ec.message()));
  WatchRestoreDir(out_dir);
  *swept = SweepStaleRestoreTempFiles(out_dir);
  if (uncommit) {
    const std::string marker = absl::StrCat(out_dir, "/", std::string(kDurableCommittedFileName));
    if (::unlink(marker.c_str()) != 0 && errno != ENOENT) {
      return absl::UnavailableError(absl::StrCat("cannot remove '", marker, "': ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

void PrintSwept(const std::string& out_dir, int swept) {
  if (swept > 0) {
    std::cout << "removed " << swept << " stale temporary file(s) of an earlier, interrupted restore in " << out_dir
              << "\n";
  }
}

int RestoreOnline(const DataOptions& options, const std::string& job, uint64_t step, std::optional<uint32_t> rank,
                  const std::string& out_dir) {
  DataOptions o = options;
  auto meta = v1::MetaService::NewStub(Channel(o, o.meta));
  absl::StatusOr<std::map<std::string, std::string>> addresses = NodeAddresses(o, meta.get());
  if (!addresses.ok()) return Fail(addresses.status());
  v1::GetVersionResponse vresp;
  if (absl::Status s = GetVersion(o, meta.get(), job, step, &vresp); !s.ok()) return Fail(s);
  const uint32_t world = vresp.version().world_size();
  if (rank && *rank >= world) {
    return Fail(absl::InvalidArgumentError(absl::StrCat("rank ", *rank, " is out of range: world size ", world)));
  }
  int swept = 0;
  if (absl::Status s = PrepareOutDir(out_dir, !rank, &swept); !s.ok()) return Fail(s);
  if (!o.json) PrintSwept(out_dir, swept);
  uint64_t total = 0;
  for (const v1::ShardDetail& d : vresp.version().shards()) {
    if (!rank || d.info().key().rank() == *rank) total += d.info().size_bytes();
  }
  Progress meter(absl::StrCat("restore ", job, "/", step), total, o.progress);
  o.meter = &meter;
  DurableManifest manifest;
  manifest.job_id = job;
  manifest.step = step;
  manifest.world_size = world;
  manifest.writer = "ckptctl restore";
  manifest.created_unix_ms = absl::ToUnixMillis(absl::Now());
  Json files = Json::array();
  for (uint32_t r = 0; r < world; ++r) {
    if (rank && r != *rank) continue;
    v1::ShardInfo info;
    const std::string path = absl::StrCat(out_dir, "/", RankFileName(r));
    absl::StatusOr<std::string> served = FetchShard(o, meta.get(), *addresses, job, step, r, path, &info);
    if (!served.ok()) return Fail(served.status());
    DurableShard shard = ShardOf(info);
    if (!RefSteps(shard.items).empty()) {
      // An incremental version: the versions it refers to are fetched too
      // (this rank's shard of each, checked the same way) and every item is
      // laid out in one self-contained rank file.
      absl::StatusOr<DurableShard> dense = Materialize(o, meta.get(), *addresses, job, step, shard, path, &*served);
      if (!dense.ok()) return Fail(dense.status());
      shard = *std::move(dense);
    }
    files.push_back(Json{{"rank", r}, {"path", path}, {"size_bytes", shard.size_bytes},
                         {"crc32c", Hex(shard.crc32c)}, {"served_from", *served}});
    if (!o.json) {
      meter.Clear();
      std::cout << "rank " << r << ": " << shard.size_bytes << " bytes from " << *served << ", crc32c "
                << Hex(shard.crc32c) << " verified -> " << path << "\n";
    }
    manifest.shards.push_back(std::move(shard));
  }
  bool committed = false;
  if (!rank) {
    // A complete version: make out_dir a durable-tier version directory.
    SetWritingManifest(true);
    absl::Status s = WriteDurableManifest(PosixFileSystem(), out_dir, manifest);
    SetWritingManifest(false);
    if (!s.ok()) return Fail(s);
    committed = true;
  }
  meter.Finish();
  if (o.json) {
    std::cout << Json{{"job", job}, {"step", step}, {"world_size", world}, {"out_dir", out_dir},
                      {"committed", committed}, {"stale_temp_files_removed", swept}, {"files", files}}
                     .dump(2)
              << "\n";
  } else if (committed) {
    std::cout << "wrote manifest.json and COMMITTED: " << out_dir << " is a loadable version directory\n";
  }
  return 0;
}

namespace {

// Copies the rank file of `shard` (no references) from `from_dir` into a
// RankFileWriter at `path` chunk by chunk, checking every item's crc32c as the
// bytes go by and the whole file's at Commit (what ReadRankFile checks).
absl::Status CopyRankFile(const DataOptions& o, const std::string& from_dir, const DurableShard& shard,
                          const std::string& path) {
  const std::string src = absl::StrCat(from_dir, "/", shard.file);
  std::FILE* in = std::fopen(src.c_str(), "rb");
  if (in == nullptr) {
    return absl::DataLossError(absl::StrCat("rank ", shard.rank, ": cannot open ", src, ": ", std::strerror(errno)));
  }
  absl::Status s = [&]() -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(std::unique_ptr<RankFileWriter> out,
                          RankFileWriter::Create(PosixFileSystem(), path, shard.size_bytes, shard.crc32c));
    ItemCrcStream items(shard.items);
    std::vector<std::byte> buf(kReadChunkBytes);
    while (true) {
      const size_t n = std::fread(buf.data(), 1, buf.size(), in);
      if (n == 0) break;
      if (items.position() + n > shard.size_bytes) {
        return absl::DataLossError(absl::StrCat("rank ", shard.rank, ": ", src, " is longer than the ",
                                                shard.size_bytes, " bytes the manifest says"));
      }
      const std::span<const std::byte> piece(buf.data(), n);
      CKPT_RETURN_IF_ERROR(items.Update(piece));
      CKPT_RETURN_IF_ERROR(out->Append(piece));
      if (o.meter != nullptr) o.meter->Add(n);
      MaybePauseAfterFirstChunk();
    }
    if (std::ferror(in) != 0) return absl::UnavailableError(absl::StrCat("read error on ", src));
    if (items.position() != shard.size_bytes) {
      return absl::DataLossError(absl::StrCat("rank ", shard.rank, ": ", src, " has ", items.position(),
                                              " bytes, the manifest says ", shard.size_bytes));
    }
    CKPT_RETURN_IF_ERROR(items.Finish());
    return out->Commit();  // size and whole-file crc32c, then durable
  }();
  std::fclose(in);
  return s;
}

// Writes `bytes` (the whole of `shard`) as the rank file at `path` through a
// RankFileWriter, in chunks (counted on `meter`, if any), and commits it.
absl::Status WriteRankFile(FileSystem* fs, const std::string& path, const DurableShard& shard,
                           std::span<const std::byte> bytes, Progress* meter) {
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<RankFileWriter> w,
                        RankFileWriter::Create(fs, path, shard.size_bytes, shard.crc32c));
  for (uint64_t at = 0; at < bytes.size(); at += kReadChunkBytes) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kReadChunkBytes, bytes.size() - at));
    CKPT_RETURN_IF_ERROR(w->Append(bytes.subspan(at, n)));
    if (meter != nullptr) meter->Add(n);
    MaybePauseAfterFirstChunk();
  }
  return w->Commit();  // size and whole-file crc32c, then durable
}

}  // namespace

int RestoreFromDir(const DataOptions& options, const std::string& from_dir, const std::string& out_dir) {
  DataOptions o = options;
  FileSystem* fs = PosixFileSystem();
  absl::StatusOr<DurableManifest> m = ReadDurableManifest(fs, from_dir);
  if (!m.ok()) return Fail(m.status());
  int swept = 0;
  if (absl::Status s = PrepareOutDir(out_dir, /*uncommit=*/true, &swept); !s.ok()) return Fail(s);
  if (!o.json) PrintSwept(out_dir, swept);
  uint64_t in_total = 0;
  for (const DurableShard& shard : m->shards) in_total += shard.size_bytes;
  Progress meter(absl::StrCat("restore ", m->job_id, "/", m->step), in_total, o.progress);
  o.meter = &meter;
  Json files = Json::array();
  uint64_t total = 0;
  DurableManifest dense = *m;  // with every item in its own rank file (format 1)
  dense.format_version = kDurableFormatVersion;
  dense.writer = "ckptctl restore";
  dense.created_unix_ms = absl::ToUnixMillis(absl::Now());
  for (DurableShard& shard : dense.shards) {
    const std::string path = absl::StrCat(out_dir, "/", shard.file);
    if (RefSteps(shard.items).empty()) {
      if (absl::Status s = CopyRankFile(o, from_dir, shard, path); !s.ok()) return Fail(s);
    } else {
      // An incremental version: its references are read from the versions
      // they name and laid out, with its own items, in one self-contained
      // shard (in memory).
      std::vector<std::byte> bytes;
      absl::StatusOr<DurableShard> materialized = MaterializeDurableShard(fs, from_dir, *m, shard, &bytes);
      if (!materialized.ok()) return Fail(materialized.status());
      meter.AddTotal(materialized->size_bytes > shard.size_bytes ? materialized->size_bytes - shard.size_bytes : 0);
      shard = *std::move(materialized);
      if (absl::Status s = WriteRankFile(fs, path, shard, bytes, &meter); !s.ok()) return Fail(s);
    }
    total += shard.size_bytes;
    files.push_back(Json{{"rank", shard.rank}, {"path", path}, {"size_bytes", shard.size_bytes},
                         {"crc32c", Hex(shard.crc32c)}});
  }
  // manifest.json, then COMMITTED: out_dir is a committed version directory.
  SetWritingManifest(true);
  absl::Status committed = WriteDurableManifest(fs, out_dir, dense);
  SetWritingManifest(false);
  if (!committed.ok()) return Fail(committed);
  meter.Finish();
  if (o.json) {
    std::cout << Json{{"job", m->job_id},
                      {"step", m->step},
                      {"world_size", m->world_size},
                      {"out_dir", out_dir},
                      {"total_bytes", total},
                      {"committed", true},
                      {"stale_temp_files_removed", swept},
                      {"files", files}}
                     .dump(2)
              << "\n";
  } else {
    std::cout << "restored " << m->job_id << " step " << m->step << ": " << m->shards.size() << " rank files, "
              << FormatBytes(total) << ", all checksums verified, to " << out_dir
              << "; wrote manifest.json and COMMITTED: a loadable version directory\n";
  }
  return 0;
}

int RestoreResharded(const DataOptions& o, const std::string& from_dir, const std::string& out_dir,
                     uint32_t world_size, const std::map<std::string, uint32_t>& splits) {
  FileSystem* fs = PosixFileSystem();
  absl::StatusOr<DurableManifest> m = ReadDurableManifest(fs, from_dir);
  if (!m.ok()) return Fail(m.status());
  absl::StatusOr<std::map<std::string, DurableGlobalTensor>> tensors = DurableGlobalTensors(*m);
  if (!tensors.ok()) return Fail(tensors.status());
  for (const auto& [name, dim] : splits) {
    auto t = tensors->find(name);
    if (t == tensors->end()) {
      std::cerr << "ckptctl: --split " << name << ": step " << m->step << " has no global tensor of that name\n";
      return 2;
    }
    if (dim >= t->second.shape.size()) {
      std::cerr << "ckptctl: --split " << name << "=" << dim << ": the tensor has " << t->second.shape.size()
                << " dimensions\n";
      return 2;
    }
  }
  size_t others = 0;
  for (const DurableShard& shard : m->shards) {
    for (const ManifestItem& item : shard.items) {
      auto place = ParseGlobalPlace(item.name, item.dtype, item.shape, item.attributes);
      if (place.ok() && !place->has_value()) ++others;
    }
  }
  int swept = 0;
  if (absl::Status s = PrepareOutDir(out_dir, /*uncommit=*/true, &swept); !s.ok()) return Fail(s);
  if (!o.json) PrintSwept(out_dir, swept);
  DurableManifest out;
  out.job_id = m->job_id;
  out.step = m->step;
  out.world_size = world_size;
  out.writer = "ckptctl restore --world-size";
  out.created_unix_ms = absl::ToUnixMillis(absl::Now());
  uint64_t total = 0, read = 0;
  for (uint32_t rank = 0; rank < world_size; ++rank) {
    // This rank's part of every tensor, laid out at 64-byte aligned offsets.
    DurableShard shard;
    shard.rank = rank;
    shard.file = RankFileName(rank);
    std::vector<DurableSliceRequest> requests;
    uint64_t size = 0;
    for (const auto& [name, t] : *tensors) {
      Box box{std::vector<uint64_t>(t.shape.size(), 0), t.shape};
      if (auto s = splits.find(name); s != splits.end()) {
        const uint64_t n = t.shape[s->second], base = n / world_size, extra = n % world_size;
        box.offsets[s->second] = rank * base + std::min<uint64_t>(rank, extra);
        box.lengths[s->second] = base + (rank < extra ? 1 : 0);
      }
      ManifestItem item;
      item.name = name;
      item.dtype = t.dtype;
      item.shape = box.lengths;
      item.offset_bytes = (size + 63) / 64 * 64;
      item.length_bytes = box.Elements() * DTypeElementSize(t.dtype);
      item.attributes = GlobalAttributes(name, name, t.shape, box.offsets);
      size = item.offset_bytes + item.length_bytes;
      shard.items.push_back(std::move(item));
      requests.push_back(DurableSliceRequest{name, std::move(box), {}});
    }
    std::vector<std::byte> bytes(size);
    for (size_t i = 0; i < requests.size(); ++i) {
      requests[i].dst = std::span<std::byte>(bytes.data() + shard.items[i].offset_bytes, shard.items[i].length_bytes);
    }
    absl::StatusOr<uint64_t> n = ReadDurableSlices(fs, from_dir, *m, requests);
    if (!n.ok()) return Fail(Annotate(n.status(), absl::StrCat("new rank ", rank)));
    read += *n;
    for (ManifestItem& item : shard.items) {
      item.crc32c = Crc32c(std::span<const std::byte>(bytes.data() + item.offset_bytes, item.length_bytes));
    }
    shard.size_bytes = size;
    shard.crc32c = Crc32c(bytes);
    shard.manifest_digest = ManifestDigest(shard.items);
    const std::string path = absl::StrCat(out_dir, "/", shard.file);
    if (absl::Status s = WriteRankFile(fs, path, shard, bytes, nullptr); !s.ok()) return Fail(s);
    total += size;
    out.shards.push_back(std::move(shard));
  }
  SetWritingManifest(true);
  absl::Status committed = WriteDurableManifest(fs, out_dir, out);
  SetWritingManifest(false);
  if (!committed.ok()) return Fail(committed);
  if (o.json) {
    std::cout << Json{{"job", m->job_id},       {"step", m->step},        {"world_size", world_size},
                      {"from_world_size", m->world_size}, {"out_dir", out_dir}, {"total_bytes", total},
                      {"bytes_read", read},     {"global_tensors", tensors->size()},
                      {"items_left_out", others}, {"committed", true}}
                     .dump(2)
              << "\n";
  } else {
    std::cout << "resharded " << m->job_id << " step " << m->step << " from " << m->world_size << " to "
              << world_size << " ranks: " << tensors->size() << " global tensors, " << FormatBytes(total)
              << " written, " << FormatBytes(read) << " read, all checksums verified";
    if (others > 0) std::cout << "; " << others << " items of no global tensor left out";
    std::cout << "; wrote manifest.json and COMMITTED: " << out_dir << " is a loadable version directory\n";
  }
  return 0;
}

int RestoreOnlineResharded(const DataOptions& o, const std::string& job, uint64_t step, const std::string& out_dir,
                           uint32_t world_size, const std::map<std::string, uint32_t>& splits) {
  const std::string source = absl::StrCat(out_dir, "/.reshard-source-", ::getpid());
  int rc = 0;
  {
    // With --json the staging restore's own result is not printed: one
    // JSON document comes out, the resharded one.
    std::ostringstream hidden;
    std::streambuf* was = o.json ? std::cout.rdbuf(hidden.rdbuf()) : nullptr;
    rc = RestoreOnline(o, job, step, std::nullopt, source);
    if (was != nullptr) std::cout.rdbuf(was);
  }
  if (rc == 0) rc = RestoreResharded(o, source, out_dir, world_size, splits);
  std::error_code ec;
  std::filesystem::remove_all(source, ec);
  if (ec) std::cerr << "ckptctl: cannot remove the staging directory " << source << ": " << ec.message() << "\n";
  return rc;
}

int NodeHoldings(const DataOptions& o, const std::string& node, const std::string& job) {
  auto meta = v1::MetaService::NewStub(Channel(o, o.meta));
  absl::StatusOr<std::map<std::string, std::string>> addresses = NodeAddresses(o, meta.get());
  if (!addresses.ok()) return Fail(addresses.status());
  auto it = addresses->find(node);
  if (it == addresses->end()) return Fail(absl::NotFoundError(absl::StrCat("meta knows no node \"", node, "\"")));
  auto stub = AgentStub(o, node, it->second);
  v1::GetInventoryRequest req;
  req.set_job_id(job);
  v1::GetInventoryResponse resp;
  auto ctx = Context(o);
  if (absl::Status s = FromGrpc(stub->GetInventory(ctx.get(), req, &resp), absl::StrCat("GetInventory on ", node));
      !s.ok()) {
    return Fail(s);
  }
  auto name = [](const std::string& full, const char* prefix) {
    std::string n = full.rfind(prefix, 0) == 0 ? full.substr(std::strlen(prefix)) : full;
    for (char& c : n) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return n;
  };
  Json rows = Json::array();
  for (const v1::InventoryEntry& e : resp.entries()) {
    Json r;
    if (e.has_shard()) {
      r["job"] = e.shard().job_id();
      r["step"] = e.shard().step();
      r["what"] = absl::StrCat("rank ", e.shard().rank());
      r["role"] = name(v1::CopyRole_Name(e.role()), "COPY_ROLE_");
    } else {
      r["job"] = e.segment().job_id();
      r["step"] = e.segment().step();
      r["what"] = absl::StrCat("g", e.segment().group_index(), ".s", e.segment().stripe_index(), ".p",
                               e.segment().position());
      r["role"] = name(v1::SegmentKind_Name(e.segment_kind()), "SEGMENT_KIND_");
    }
    r["size_bytes"] = e.size_bytes();
    r["state"] = name(v1::CopyState_Name(e.state()), "COPY_STATE_");
    r["stored_unix_ms"] = e.stored_unix_ms();
    rows.push_back(std::move(r));
  }
  if (o.json) {
    std::cout << Json{{"node_id", resp.node_id()}, {"incarnation", resp.incarnation()}, {"holdings", rows}}.dump(2)
              << "\n";
    return 0;
  }
  std::cout << "node " << resp.node_id() << " (incarnation " << resp.incarnation() << "): " << rows.size()
            << " holding(s)\n";
  for (const Json& r : rows) {
    std::cout << "  " << r["job"].get<std::string>() << "/" << r["step"].get<uint64_t>() << " "
              << r["what"].get<std::string>() << "  " << r["role"].get<std::string>() << "  "
              << r["size_bytes"].get<uint64_t>() << " bytes  " << r["state"].get<std::string>() << "\n";
  }
  return 0;
}

int VerifyVersion(const DataOptions& o, const std::string& job, uint64_t step) {
  auto meta = v1::MetaService::NewStub(Channel(o, o.meta));
  absl::StatusOr<std::map<std::string, std::string>> addresses = NodeAddresses(o, meta.get());
  if (!addresses.ok()) return Fail(addresses.status());
  v1::GetVersionResponse vresp;
  if (absl::Status s = GetVersion(o, meta.get(), job, step, &vresp); !s.ok()) return Fail(s);
  std::set<std::string> holders;
  for (const v1::ShardDetail& d : vresp.version().shards()) {
    for (const v1::ShardCopy& c : d.copies()) {
      if (c.state() == v1::COPY_STATE_VALID) holders.insert(c.node_id());
    }
  }
  // Parity and rebuilt segments live on nodes that may hold no full copy.
  for (const v1::SegmentInfo& seg : vresp.version().segments()) {
    if (seg.state() == v1::COPY_STATE_VALID && seg.length_bytes() > 0) holders.insert(seg.holder_node_id());
  }
  // Progress: every valid copy and segment is re-read once by its holder
  // (one Verify per holder: the line moves holder by holder).
  uint64_t total = 0;
  for (const v1::ShardDetail& d : vresp.version().shards()) {
    for (const v1::ShardCopy& c : d.copies()) {
      if (c.state() == v1::COPY_STATE_VALID) total += d.info().size_bytes();
    }
  }
  for (const v1::SegmentInfo& seg : vresp.version().segments()) {
    if (seg.state() == v1::COPY_STATE_VALID) total += seg.length_bytes();
  }
  Progress meter(absl::StrCat("verifying ", job, "/", step), total, o.progress);
  meter.Note(absl::StrCat(FormatBytes(total), " on ", holders.size(), " holder(s)"));
  Json findings = Json::array();
  int problems = 0;
  uint64_t checked = 0, pieces = 0;
  size_t holders_done = 0;
  for (const std::string& node : holders) {
    auto stub = AgentStub(o, node, (*addresses)[node]);
    v1::VerifyRequest req;
    req.set_job_id(job);
    req.set_step(step);
    v1::VerifyResponse resp;
    auto ctx = Context(o);
    absl::Status s = FromGrpc(stub->Verify(ctx.get(), req, &resp), absl::StrCat("Verify on ", node));
    if (!s.ok()) {
      ++problems;
      findings.push_back(Json{{"node", node}, {"ok", false}, {"message", std::string(s.message())}});
      ++holders_done;
      continue;
    }
    checked += resp.bytes_checked();
    for (const v1::VerifyFinding& f : resp.findings()) {
      problems += f.ok() ? 0 : 1;
      Json finding{{"node", node}, {"ok", f.ok()}, {"expected_crc32c", Hex(f.expected_crc32c())},
                   {"actual_crc32c", Hex(f.actual_crc32c())}, {"bad_item", f.bad_item()}, {"message", f.message()}};
      if (f.holding().has_segment()) {
        const v1::SegmentKey& k = f.holding().segment();
        finding["segment"] = absl::StrCat("g", k.group_index(), ".s", k.stripe_index(), ".p", k.position());
      } else {
        finding["rank"] = f.holding().shard().rank();
      }
      findings.push_back(std::move(finding));
      ++pieces;
    }
    ++holders_done;
    meter.SetDetail(absl::StrCat(holders_done, "/", holders.size(), " holder(s), ", pieces, " shard(s)/segment(s) checked, ",
                                 problems, " problem(s)"));
    meter.Add(resp.bytes_checked());
  }
  meter.Finish();
  if (o.json) {
    std::cout << Json{{"job", job}, {"step", step}, {"bytes_checked", checked}, {"problems", problems},
                      {"findings", findings}}
                     .dump(2)
              << "\n";
  } else {
    for (const Json& f : findings) {
      std::cout << (f["ok"].get<bool>() ? "ok   " : "BAD  ") << f["node"].get<std::string>();
      if (f.contains("rank")) std::cout << " rank " << f["rank"].get<uint32_t>();
      if (f.contains("segment")) std::cout << " segment " << f["segment"].get<std::string>();
      if (!f["message"].get<std::string>().empty()) std::cout << ": " << f["message"].get<std::string>();
      std::cout << "\n";
    }
    std::cout << job << " step " << step << ": " << holders.size() << " holder(s), " << checked
              << " bytes checked, " << problems << " problem(s)\n";
  }
  return problems == 0 ? 0 : 1;
}

}  // namespace ckpt::cli
