#include "cli/data_commands.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
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
#include "ckpt/v1/meta.grpc.pb.h"
#include "common/crc32c.h"
#include "common/durable_format.h"
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

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "ckptctl: %s: %s\n", absl::StatusCodeToString(s.code()).c_str(),
               std::string(s.message()).c_str());
  return 1;
}

std::unique_ptr<grpc::ClientContext> Context(const DataOptions& o) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000)));
  return ctx;
}

std::string Hex(uint32_t crc) { return absl::StrFormat("%08x", crc); }

// A stub for an agent's AgentService. ReadShard streams chunks of up to 4 MiB
// of data plus their offset and crc, more than gRPC's default 4 MiB receive
// limit, so the limit is lifted (as the client library does).
std::unique_ptr<v1::AgentService::Stub> AgentStub(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  return v1::AgentService::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
}

ManifestItem ItemOf(const v1::Item& item) {
  ManifestItem m;
  m.name = item.name();
  m.dtype = item.dtype();
  m.shape.assign(item.shape().begin(), item.shape().end());
  m.offset_bytes = item.offset_bytes();
  m.length_bytes = item.length_bytes();
  m.crc32c = item.crc32c();
  for (const auto& [k, v] : item.attributes()) m.attributes[k] = v;
  return m;
}

DurableShard ShardOf(const v1::ShardInfo& info) {
  DurableShard s;
  s.rank = info.key().rank();
  s.file = RankFileName(s.rank);
  s.size_bytes = info.size_bytes();
  s.crc32c = info.crc32c();
  s.manifest_digest = info.manifest_digest();
  for (const v1::Item& item : info.items()) s.items.push_back(ItemOf(item));
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

// Reads a whole shard from an agent with ReadShard, checking every chunk's
// crc, then every item's and the shard's against `info`.
absl::StatusOr<std::vector<char>> ReadFromAgent(const DataOptions& o, const std::string& address,
                                                const v1::ShardInfo& info) {
  auto stub = AgentStub(address);
  v1::ReadShardRequest req;
  *req.mutable_shard() = info.key();
  req.set_chunk_bytes(4 << 20);
  auto ctx = Context(o);
  auto reader = stub->ReadShard(ctx.get(), req);
  std::vector<char> bytes(info.size_bytes());
  uint64_t got = 0;
  v1::ReadShardResponse msg;
  while (reader->Read(&msg)) {
    if (Crc32c(msg.data()) != msg.chunk_crc32c()) {
      reader->Finish().ok();
      return absl::DataLossError(absl::StrCat("chunk at ", msg.offset_bytes(), " failed its crc32c"));
    }
    if (msg.offset_bytes() + msg.data().size() > bytes.size()) {
      return absl::DataLossError("the agent sent more bytes than the shard has");
    }
    std::memcpy(bytes.data() + msg.offset_bytes(), msg.data().data(), msg.data().size());
    got += msg.data().size();
  }
  absl::Status s = FromGrpc(reader->Finish(), absl::StrCat("ReadShard from ", address));
  if (!s.ok()) return s;
  if (got != info.size_bytes()) {
    return absl::DataLossError(absl::StrCat("got ", got, " of ", info.size_bytes(), " bytes"));
  }
  for (const v1::Item& item : info.items()) {
    const uint32_t crc = Crc32c(bytes.data() + item.offset_bytes(), item.length_bytes());
    if (crc != item.crc32c()) {
      return absl::DataLossError(absl::StrCat("item ", QuoteForMessage(item.name()), ": crc32c ", Hex(crc),
                                              " != manifest ", Hex(item.crc32c())));
    }
  }
  if (Crc32c(bytes.data(), bytes.size()) != info.crc32c()) {
    return absl::DataLossError("the shard's crc32c does not match");
  }
  return bytes;
}

}  // namespace

int SaveFile(const DataOptions& o, const std::string& job, uint64_t step, uint32_t rank, uint32_t world_size,
             const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return Fail(absl::NotFoundError(absl::StrCat("cannot read '", file, "'")));
  std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (world_size == 0) {
    auto meta = v1::MetaService::NewStub(grpc::CreateChannel(o.meta, grpc::InsecureChannelCredentials()));
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
  absl::StatusOr<Client> client = Client::Connect(co);
  if (!client.ok()) return Fail(client.status());
  SaveBuilder b = client->BeginSave(step);
  const std::string name = std::filesystem::path(file).filename().string();
  absl::Status s = b.Add(name, std::as_bytes(std::span<const char>(data)), DType::kBytes, {data.size()});
  if (!s.ok()) return Fail(s);
  absl::StatusOr<SaveHandle> h = b.Commit();
  if (!h.ok()) return Fail(h.status());
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
// it into its memory tier (it keeps a RESTORED copy), and it is read back from
// there with every crc checked. `*node` names the agent asked.
absl::StatusOr<std::vector<char>> DecodeOnAgent(const DataOptions& o,
                                                const std::map<std::string, std::string>& addresses,
                                                const v1::ShardInfo& info, const v1::ShardSource& src,
                                                std::string* node) {
  for (const auto& st : src.ec().stripes())
    for (const auto& seg : st.segments())
      if (node->empty()) *node = seg.holder().node_id();
  auto it = addresses.find(*node);
  if (it == addresses.end()) return absl::UnavailableError("no node holding a segment is known");
  auto stub = AgentStub(it->second);
  v1::OpenShardRequest oreq;
  *oreq.mutable_key() = info.key();
  *oreq.add_sources() = src;
  *oreq.mutable_expected() = info;
  v1::OpenShardResponse oresp;
  {
    auto ctx = Context(o);
    CKPT_RETURN_IF_ERROR(FromGrpc(stub->OpenShard(ctx.get(), oreq, &oresp), absl::StrCat("OpenShard on ", *node)));
  }
  absl::StatusOr<std::vector<char>> bytes = ReadFromAgent(o, it->second, info);
  v1::CloseShardRequest creq;
  creq.set_handle_id(oresp.handle_id());
  v1::CloseShardResponse cresp;
  auto ctx = Context(o);
  (void)stub->CloseShard(ctx.get(), creq, &cresp);  // the handle also expires on its own
  return bytes;
}

int RestoreOnline(const DataOptions& o, const std::string& job, uint64_t step, std::optional<uint32_t> rank,
                  const std::string& out_dir) {
  auto meta = v1::MetaService::NewStub(grpc::CreateChannel(o.meta, grpc::InsecureChannelCredentials()));
  absl::StatusOr<std::map<std::string, std::string>> addresses = NodeAddresses(o, meta.get());
  if (!addresses.ok()) return Fail(addresses.status());
  v1::GetVersionResponse vresp;
  if (absl::Status s = GetVersion(o, meta.get(), job, step, &vresp); !s.ok()) return Fail(s);
  const uint32_t world = vresp.version().world_size();
  if (rank && *rank >= world) {
    return Fail(absl::InvalidArgumentError(absl::StrCat("rank ", *rank, " is out of range: world size ", world)));
  }
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return Fail(absl::UnavailableError(absl::StrCat("cannot create '", out_dir, "': ", ec.message())));
  DurableManifest manifest;
  manifest.job_id = job;
  manifest.step = step;
  manifest.world_size = world;
  manifest.writer = "ckptctl restore";
  manifest.created_unix_ms = absl::ToUnixMillis(absl::Now());
  Json files = Json::array();
  for (uint32_t r = 0; r < world; ++r) {
    if (rank && r != *rank) continue;
    v1::LocateRequest lreq;
    lreq.set_job_id(job);
    lreq.set_step(step);
    lreq.set_rank(r);
    v1::LocateResponse loc;
    {
      auto ctx = Context(o);
      absl::Status s = FromGrpc(meta->Locate(ctx.get(), lreq, &loc), "Locate");
      if (!s.ok()) return Fail(s);
    }
    absl::StatusOr<std::vector<char>> bytes = absl::NotFoundError("no live source");
    std::string served, why;
    for (const v1::ShardSource& src : loc.sources()) {
      if (src.kind() == v1::SOURCE_KIND_EC_DECODE) {
        std::string node;
        bytes = DecodeOnAgent(o, *addresses, loc.shard(), src, &node);
        if (bytes.ok()) {
          served = absl::StrCat(node, " (ec decode)");
          break;
        }
        absl::StrAppend(&why, "; decode on ", node, ": ", bytes.status().message());
        continue;
      }
      if (src.kind() != v1::SOURCE_KIND_LOCAL && src.kind() != v1::SOURCE_KIND_REPLICA) {
        absl::StrAppend(&why, "; ", v1::SourceKind_Name(src.kind()), ": not readable by ckptctl (use --from-dir)");
        continue;
      }
      std::string address = src.holder().grpc_address();
      if (address.empty()) address = (*addresses)[src.holder().node_id()];
      bytes = ReadFromAgent(o, address, loc.shard());
      if (bytes.ok()) {
        served = src.holder().node_id();
        break;
      }
      absl::StrAppend(&why, "; ", src.holder().node_id(), ": ", bytes.status().message());
    }
    if (!bytes.ok()) {
      return Fail(absl::DataLossError(absl::StrCat("rank ", r, ": no source could be read", why,
                                                   " (for a flushed version, use restore --from-dir)")));
    }
    DurableShard shard = ShardOf(loc.shard());
    const std::string path = absl::StrCat(out_dir, "/", shard.file);
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes->data(), static_cast<std::streamsize>(bytes->size()));
    out.close();
    if (!out) return Fail(absl::UnavailableError(absl::StrCat("cannot write '", path, "'")));
    files.push_back(Json{{"rank", r}, {"path", path}, {"size_bytes", shard.size_bytes},
                         {"crc32c", Hex(shard.crc32c)}, {"served_from", served}});
    if (!o.json) {
      std::cout << "rank " << r << ": " << shard.size_bytes << " bytes from " << served << ", crc32c "
                << Hex(shard.crc32c) << " verified -> " << path << "\n";
    }
    manifest.shards.push_back(std::move(shard));
  }
  bool committed = false;
  if (!rank) {
    // A complete version: make out_dir a durable-tier version directory.
    absl::Status s = WriteDurableManifest(PosixFileSystem(), out_dir, manifest);
    if (!s.ok()) return Fail(s);
    committed = true;
  }
  if (o.json) {
    std::cout << Json{{"job", job}, {"step", step}, {"world_size", world}, {"out_dir", out_dir},
                      {"committed", committed}, {"files", files}}
                     .dump(2)
              << "\n";
  } else if (committed) {
    std::cout << "wrote manifest.json and COMMITTED: " << out_dir << " is a loadable version directory\n";
  }
  return 0;
}

int VerifyVersion(const DataOptions& o, const std::string& job, uint64_t step) {
  auto meta = v1::MetaService::NewStub(grpc::CreateChannel(o.meta, grpc::InsecureChannelCredentials()));
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
  Json findings = Json::array();
  int problems = 0;
  uint64_t checked = 0;
  for (const std::string& node : holders) {
    auto stub = AgentStub((*addresses)[node]);
    v1::VerifyRequest req;
    req.set_job_id(job);
    req.set_step(step);
    v1::VerifyResponse resp;
    auto ctx = Context(o);
    absl::Status s = FromGrpc(stub->Verify(ctx.get(), req, &resp), absl::StrCat("Verify on ", node));
    if (!s.ok()) {
      ++problems;
      findings.push_back(Json{{"node", node}, {"ok", false}, {"message", std::string(s.message())}});
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
    }
  }
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
