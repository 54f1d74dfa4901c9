// The durable tier's format (docs/format.md). JSON goes through nlohmann_json,
// whose exceptions stay inside this file: every entry point catches them and
// returns a Status.
#include "common/durable_format.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <map>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crc32c.h"
#include "common/names.h"
#include "common/status_macros.h"

namespace ckpt {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

// Bytes read per PositionedRead in ReadRankFile.
constexpr uint64_t kReadChunkBytes = uint64_t{8} << 20;
// Attempts at a fresh temporary name when one is taken (a stale file left by
// a dead process that had the same pid).
constexpr int kTempNameAttempts = 8;

absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// The directory holding `path`: "." for a bare name, "/" for "/name".
std::string Dirname(std::string_view path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string_view::npos) return ".";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

std::string JoinPath(std::string_view dir, std::string_view name) {
  if (!dir.empty() && dir.back() == '/') return absl::StrCat(AV(dir), AV(name));
  return absl::StrCat(AV(dir), "/", AV(name));
}

std::string Hex32(uint32_t v) { return absl::StrFormat("0x%08x", v); }
std::string Hex64(uint64_t v) { return absl::StrFormat("0x%016x", v); }

// A string as a JSON string literal. Throws nlohmann's type_error for
// strings that are not UTF-8; callers catch it.
std::string JsonString(const std::string& s) { return Json(s).dump(); }

// --- checks shared by the writer (InvalidArgument) and the reader (DataLoss) ---

// Returns "" if `m` is consistent, else what is wrong. Does not check
// format_version (the reader must refuse unknown versions before anything
// else, the writer writes only one).
std::string ManifestProblem(const DurableManifest& m) {
  if (absl::Status s = ValidateJobId(m.job_id); !s.ok()) return std::string(s.message());
  if (m.world_size == 0) return "world_size is 0";
  if (m.shards.size() != m.world_size) {
    return absl::StrCat("world_size is ", m.world_size, " but there are ", m.shards.size(),
                        " shards");
  }
  for (size_t i = 0; i < m.shards.size(); ++i) {
    const DurableShard& shard = m.shards[i];
    if (shard.rank != i) {
      return absl::StrCat("shard ", i, " has rank ", shard.rank, ": shards must list ranks 0..",
                          m.world_size - 1, " in order");
    }
    if (shard.file != RankFileName(shard.rank)) {
      return absl::StrCat("rank ", shard.rank, " has file ", QuoteForMessage(shard.file),
                          ", it must be \"", RankFileName(shard.rank), "\"");
    }
    if (absl::Status s = ValidateManifest(shard.items, shard.size_bytes, m.step); !s.ok()) {
      return absl::StrCat("rank ", shard.rank, ": ", s.message());
    }
    const uint64_t digest = ManifestDigest(shard.items);
    if (digest != shard.manifest_digest) {
      return absl::StrCat("rank ", shard.rank, ": manifest_digest is ", Hex64(shard.manifest_digest),
                          " but the items' digest is ", Hex64(digest));
    }
  }
  return "";
}

// Integers the writer would put in manifest.json as JSON numbers must be
// exact in a double (see kMaxDurableJsonInteger).
std::string JsonRangeProblem(const DurableManifest& m) {
  const auto too_big = [](std::string_view what, uint64_t v) {
    return absl::StrCat(AV(what), " is ", v, ", above 2^53-1, the largest integer manifest.json holds");
  };
  if (m.step > kMaxDurableJsonInteger) return too_big("step", m.step);
  const uint64_t abs_created = m.created_unix_ms < 0 ? ~static_cast<uint64_t>(m.created_unix_ms) + 1
                                                     : static_cast<uint64_t>(m.created_unix_ms);
  if (abs_created > kMaxDurableJsonInteger) return too_big("created_unix_ms", abs_created);
  for (const DurableShard& shard : m.shards) {
    const std::string rank = absl::StrCat("rank ", shard.rank, " ");
    if (shard.size_bytes > kMaxDurableJsonInteger) return too_big(rank + "size_bytes", shard.size_bytes);
    for (const ManifestItem& item : shard.items) {
      const std::string where = absl::StrCat(rank, "item ", QuoteForMessage(item.name), " ");
      if (item.offset_bytes > kMaxDurableJsonInteger) return too_big(where + "offset", item.offset_bytes);
      if (item.length_bytes > kMaxDurableJsonInteger) return too_big(where + "length", item.length_bytes);
      for (uint64_t d : item.shape) {
        if (d > kMaxDurableJsonInteger) return too_big(where + "shape dimension", d);
      }
    }
  }
  return "";
}

// --- JSON reading: typed field access that reports instead of throwing ---

// Reads fields of one JSON object; `where` names it in messages, e.g.
// "manifest.json: rank 2 item \"w\"". Errors are DataLoss.
class FieldReader {
 public:
  FieldReader(const Json& object, std::string where) : object_(object), where_(std::move(where)) {}

  absl::StatusOr<const Json*> Get(const char* key) const {
    if (!object_.is_object()) return Error("is not a JSON object");
    auto it = object_.find(key);
    if (it == object_.end()) return Error(absl::StrCat("has no \"", key, "\" field"));
    return &*it;
  }

  absl::StatusOr<uint64_t> Uint(const char* key, uint64_t max = UINT64_MAX) const {
    CKPT_ASSIGN_OR_RETURN(const Json* v, Get(key));
    if (!v->is_number_unsigned()) {
      return Error(absl::StrCat("field \"", key, "\" is ", Describe(*v),
                                ", not a non-negative integer"));
    }
    const uint64_t value = v->get<uint64_t>();
    if (value > max) {
      return Error(absl::StrCat("field \"", key, "\" is ", value, ", more than ", max));
    }
    return value;
  }

  absl::StatusOr<int64_t> Int(const char* key) const {
    CKPT_ASSIGN_OR_RETURN(const Json* v, Get(key));
    if (v->is_number_unsigned()) {
      if (v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
        return Error(absl::StrCat("field \"", key, "\" is out of range"));
      }
      return static_cast<int64_t>(v->get<uint64_t>());
    }
    if (!v->is_number_integer()) {
      return Error(absl::StrCat("field \"", key, "\" is ", Describe(*v), ", not an integer"));
    }
    return v->get<int64_t>();
  }

  absl::StatusOr<std::string> String(const char* key) const {
    CKPT_ASSIGN_OR_RETURN(const Json* v, Get(key));
    if (!v->is_string()) {
      return Error(absl::StrCat("field \"", key, "\" is ", Describe(*v), ", not a string"));
    }
    return v->get<std::string>();
  }

  // "0x" followed by exactly `digits` hex digits (either case).
  absl::StatusOr<uint64_t> Hex(const char* key, int digits) const {
    CKPT_ASSIGN_OR_RETURN(std::string s, String(key));
    bool ok = s.size() == static_cast<size_t>(2 + digits) && s[0] == '0' && s[1] == 'x';
    uint64_t value = 0;
    for (size_t i = 2; ok && i < s.size(); ++i) {
      const char c = s[i];
      int nibble;
      if (c >= '0' && c <= '9') {
        nibble = c - '0';
      } else if (c >= 'a' && c <= 'f') {
        nibble = c - 'a' + 10;
      } else if (c >= 'A' && c <= 'F') {
        nibble = c - 'A' + 10;
      } else {
        ok = false;
        break;
      }
      value = (value << 4) | static_cast<uint64_t>(nibble);
    }
    if (!ok) {
      return Error(absl::StrCat("field \"", key, "\" is ", QuoteForMessage(s), ", not \"0x\" and ",
                                digits, " hex digits"));
    }
    return value;
  }

  absl::StatusOr<const Json*> Array(const char* key) const {
    CKPT_ASSIGN_OR_RETURN(const Json* v, Get(key));
    if (!v->is_array()) {
      return Error(absl::StrCat("field \"", key, "\" is ", Describe(*v), ", not an array"));
    }
    return v;
  }

  absl::StatusOr<const Json*> Object(const char* key) const {
    CKPT_ASSIGN_OR_RETURN(const Json* v, Get(key));
    if (!v->is_object()) {
      return Error(absl::StrCat("field \"", key, "\" is ", Describe(*v), ", not an object"));
    }
    return v;
  }

  absl::Status Error(std::string_view what) const {
    return absl::DataLossError(absl::StrCat(where_, " ", AV(what)));
  }

  const std::string& where() const { return where_; }

 private:
  static std::string Describe(const Json& v) {
    if (v.is_number_float()) return "a fractional number";
    if (v.is_number_unsigned()) return "a number";
    if (v.is_number_integer()) return "a negative integer";
    return absl::StrCat("of type ", v.type_name());
  }

  const Json& object_;
  const std::string where_;
};

absl::StatusOr<ManifestItem> ParseItem(const Json& json, const std::string& where, int format_version) {
  ManifestItem item;
  FieldReader f(json, where);
  CKPT_ASSIGN_OR_RETURN(item.name, f.String("name"));
  FieldReader named(json, absl::StrCat(where, " ", QuoteForMessage(item.name)));
  CKPT_ASSIGN_OR_RETURN(std::string dtype, named.String("dtype"));
  absl::StatusOr<int> dtype_number = DTypeFromName(dtype);
  if (!dtype_number.ok()) return named.Error(std::string(dtype_number.status().message()));
  item.dtype = *dtype_number;
  CKPT_ASSIGN_OR_RETURN(const Json* shape, named.Array("shape"));
  for (const Json& d : *shape) {
    if (!d.is_number_unsigned()) {
      return named.Error("field \"shape\" has an element that is not a non-negative integer");
    }
    item.shape.push_back(d.get<uint64_t>());
  }
  CKPT_ASSIGN_OR_RETURN(item.offset_bytes, named.Uint("offset_bytes"));
  CKPT_ASSIGN_OR_RETURN(item.length_bytes, named.Uint("length_bytes"));
  CKPT_ASSIGN_OR_RETURN(uint64_t crc, named.Hex("crc32c", 8));
  item.crc32c = static_cast<uint32_t>(crc);
  CKPT_ASSIGN_OR_RETURN(const Json* attributes, named.Object("attributes"));
  for (const auto& [key, value] : attributes->items()) {
    if (!value.is_string()) {
      return named.Error(absl::StrCat("attribute ", QuoteForMessage(key), " is not a string"));
    }
    item.attributes.emplace(key, value.get<std::string>());
  }
  if (json.contains("ref_step")) {
    if (format_version < kDurableFormatVersionWithRefs) {
      return named.Error("has a \"ref_step\", which format_version 1 does not have");
    }
    CKPT_ASSIGN_OR_RETURN(uint64_t ref, named.Uint("ref_step"));
    item.ref_step = ref;
  }
  return item;
}

absl::StatusOr<DurableManifest> ParseManifestJson(const Json& root) {
  FieldReader top(root, "manifest.json:");
  DurableManifest m;
  // format_version first: a newer format may change everything else.
  CKPT_ASSIGN_OR_RETURN(uint64_t version, top.Uint("format_version"));
  if (version < static_cast<uint64_t>(kDurableFormatVersion) ||
      version > static_cast<uint64_t>(kDurableFormatVersionWithRefs)) {
    return absl::FailedPreconditionError(
        absl::StrCat("manifest.json has format_version ", version, "; this reader understands ",
                     kDurableFormatVersion, " and ", kDurableFormatVersionWithRefs, " (upgrade ckpt to read it)"));
  }
  m.format_version = static_cast<int>(version);
  CKPT_ASSIGN_OR_RETURN(m.job_id, top.String("job_id"));
  CKPT_ASSIGN_OR_RETURN(m.step, top.Uint("step"));
  CKPT_ASSIGN_OR_RETURN(uint64_t world_size, top.Uint("world_size", UINT32_MAX));
  m.world_size = static_cast<uint32_t>(world_size);
  CKPT_ASSIGN_OR_RETURN(m.writer, top.String("writer"));
  CKPT_ASSIGN_OR_RETURN(m.created_unix_ms, top.Int("created_unix_ms"));
  CKPT_ASSIGN_OR_RETURN(const Json* shards, top.Array("shards"));
  if (shards->size() != m.world_size) {
    return top.Error(absl::StrCat("has world_size ", m.world_size, " but ", shards->size(),
                                  " shards"));
  }
  m.shards.reserve(shards->size());
  for (size_t i = 0; i < shards->size(); ++i) {
    FieldReader f((*shards)[i], absl::StrCat("manifest.json: shard ", i));
    DurableShard shard;
    CKPT_ASSIGN_OR_RETURN(uint64_t rank, f.Uint("rank", UINT32_MAX));
    shard.rank = static_cast<uint32_t>(rank);
    CKPT_ASSIGN_OR_RETURN(shard.file, f.String("file"));
    CKPT_ASSIGN_OR_RETURN(shard.size_bytes, f.Uint("size_bytes"));
    CKPT_ASSIGN_OR_RETURN(uint64_t crc, f.Hex("crc32c", 8));
    shard.crc32c = static_cast<uint32_t>(crc);
    CKPT_ASSIGN_OR_RETURN(shard.manifest_digest, f.Hex("manifest_digest", 16));
    CKPT_ASSIGN_OR_RETURN(const Json* items, f.Array("items"));
    shard.items.reserve(items->size());
    for (size_t j = 0; j < items->size(); ++j) {
      CKPT_ASSIGN_OR_RETURN(
          ManifestItem item,
          ParseItem((*items)[j], absl::StrCat("manifest.json: rank ", shard.rank, " item ", j), m.format_version));
      shard.items.push_back(std::move(item));
    }
    m.shards.push_back(std::move(shard));
  }
  if (m.format_version == kDurableFormatVersionWithRefs) {
    // Canonical: a version without references is written as format 1.
    bool refs = false;
    for (const DurableShard& shard : m.shards) {
      for (const ManifestItem& item : shard.items) refs = refs || item.ref_step.has_value();
    }
    if (!refs) return top.Error("has format_version 2 but no item with a \"ref_step\" (that is format 1)");
  }
  if (std::string problem = ManifestProblem(m); !problem.empty()) {
    return absl::DataLossError(absl::StrCat("manifest.json is inconsistent: ", problem));
  }
  // The writer's number rule (docs/format.md): what is read can be written
  // back, and no size in it is near 2^64.
  if (std::string problem = JsonRangeProblem(m); !problem.empty()) {
    return absl::DataLossError(absl::StrCat("manifest.json: ", problem));
  }
  return m;
}

// The format_version a manifest is written with: 2 iff it has references.
int FormatVersionOf(const DurableManifest& m) {
  for (const DurableShard& shard : m.shards) {
    for (const ManifestItem& item : shard.items) {
      if (item.ref_step) return kDurableFormatVersionWithRefs;
    }
  }
  return kDurableFormatVersion;
}

// The COMMITTED marker's content for a manifest.json of these bytes.
std::string EncodeMarker(std::string_view manifest_json, int format_version) {
  return absl::StrCat("{\"format_version\":", format_version, ",\"manifest\":\"",
                      AV(kDurableManifestFileName),
                      "\",\"manifest_size_bytes\":", manifest_json.size(),
                      ",\"manifest_crc32c\":\"", Hex32(Crc32c(manifest_json)), "\"}\n");
}

struct Marker {
  uint64_t manifest_size_bytes = 0;
  uint32_t manifest_crc32c = 0;
};

absl::StatusOr<Marker> ParseMarker(const std::string& text, const std::string& path) {
  Json root;
  try {
    root = Json::parse(text);
  } catch (const std::exception& e) {
    return absl::DataLossError(
        absl::StrCat("commit marker '", path, "' is not valid JSON: ", e.what()));
  }
  FieldReader f(root, absl::StrCat("commit marker '", path, "'"));
  CKPT_ASSIGN_OR_RETURN(uint64_t version, f.Uint("format_version"));
  if (version < static_cast<uint64_t>(kDurableFormatVersion) ||
      version > static_cast<uint64_t>(kDurableFormatVersionWithRefs)) {
    return absl::FailedPreconditionError(
        absl::StrCat("commit marker '", path, "' has format_version ", version, "; this reader understands ",
                     kDurableFormatVersion, " and ", kDurableFormatVersionWithRefs, " (upgrade ckpt to read it)"));
  }
  CKPT_ASSIGN_OR_RETURN(std::string manifest, f.String("manifest"));
  if (manifest != kDurableManifestFileName) {
    return f.Error(absl::StrCat("names manifest ", QuoteForMessage(manifest), ", not \"",
                                AV(kDurableManifestFileName), "\""));
  }
  Marker marker;
  CKPT_ASSIGN_OR_RETURN(marker.manifest_size_bytes, f.Uint("manifest_size_bytes"));
  CKPT_ASSIGN_OR_RETURN(uint64_t crc, f.Hex("manifest_crc32c", 8));
  marker.manifest_crc32c = static_cast<uint32_t>(crc);
  return marker;
}

// A temporary name beside `final_path` for attempt `attempt`:
// "<dir>/.<name>.tmp-<pid>-<n>", unique within the process by the counter.
std::string RankTempPath(const std::string& dir, std::string_view name) {
  static std::atomic<uint64_t> sequence{0};
  return JoinPath(dir, absl::StrCat(".", AV(name), AV(kAtomicWriteTempInfix), ::getpid(), "-",
                                    sequence.fetch_add(1, std::memory_order_relaxed)));
}

// Syncs `dir`'s parent and grandparent (the job directory and the durable
// root for a version directory), skipping repeats at the top of the tree.
absl::Status SyncParents(FileSystem* fs, const std::string& dir) {
  std::string child = dir;
  for (int level = 0; level < 2; ++level) {
    std::string parent = Dirname(child);
    if (parent == child) break;
    CKPT_RETURN_IF_ERROR(fs->SyncDir(parent));
    child = std::move(parent);
  }
  return absl::OkStatus();
}

}  // namespace

// --- paths ---

absl::StatusOr<std::string> DurableVersionDir(std::string_view root, std::string_view job_id,
                                              uint64_t step) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(job_id));
  const std::string step_name = absl::StrCat(step);
  return JoinUnderRoot(root, {job_id, std::string_view(step_name)});
}

std::string DurableRefDir(std::string_view version_dir, uint64_t ref_step) {
  while (version_dir.size() > 1 && version_dir.back() == '/') version_dir.remove_suffix(1);
  return JoinPath(Dirname(version_dir), absl::StrCat(ref_step));
}

std::string DurableRankFilePath(std::string_view version_dir, uint32_t rank) {
  return JoinPath(version_dir, RankFileName(rank));
}

// --- RankFileWriter ---

RankFileWriter::RankFileWriter(FileSystem* fs, std::string final_path, std::string temp_path,
                               uint64_t expected_size_bytes, uint32_t expected_crc32c,
                               std::vector<std::string> created_dirs)
    : fs_(fs),
      final_path_(std::move(final_path)),
      temp_path_(std::move(temp_path)),
      expected_size_bytes_(expected_size_bytes),
      expected_crc32c_(expected_crc32c),
      created_dirs_(std::move(created_dirs)) {}

absl::StatusOr<std::unique_ptr<RankFileWriter>> RankFileWriter::Create(
    FileSystem* fs, std::string final_path, uint64_t expected_size_bytes,
    uint32_t expected_crc32c) {
  const size_t slash = final_path.find_last_of('/');
  if (slash == std::string::npos || slash + 1 == final_path.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank file path ", QuoteForMessage(final_path), " needs a directory and a file name"));
  }
  const std::string name = final_path.substr(slash + 1);
  if (absl::Status s = ValidatePathComponent(name); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank file path ", QuoteForMessage(final_path), ": ", s.message()));
  }
  const std::string dir = Dirname(final_path);

  // Note which directories are missing, so that Commit can make their names
  // durable too. A concurrent writer may create them in between: then its
  // own Commit syncs them, and WriteDurableManifest syncs the chain anyway.
  std::vector<std::string> created_dirs;
  for (std::string p = dir;;) {
    CKPT_ASSIGN_OR_RETURN(bool exists, fs->FileExists(p));
    if (exists) break;
    std::string up = Dirname(p);
    created_dirs.push_back(std::move(p));
    if (up == created_dirs.back()) break;
    p = std::move(up);
  }
  CKPT_RETURN_IF_ERROR_CTX(fs->CreateDirs(dir), "creating the rank file's directory");

  std::string temp_path;
  std::unique_ptr<WritableFile> file;
  for (int attempt = 0;; ++attempt) {
    temp_path = RankTempPath(dir, name);
    absl::StatusOr<std::unique_ptr<WritableFile>> opened =
        fs->NewWritableFile(temp_path, OpenMode::kCreateNew);
    if (opened.ok()) {
      file = *std::move(opened);
      break;
    }
    if (!absl::IsAlreadyExists(opened.status()) || attempt + 1 == kTempNameAttempts) {
      return Annotate(opened.status(), absl::StrCat("writing '", final_path, "'"));
    }
  }
  std::unique_ptr<RankFileWriter> writer(new RankFileWriter(
      fs, std::move(final_path), std::move(temp_path), expected_size_bytes, expected_crc32c,
      std::move(created_dirs)));
  writer->file_ = std::move(file);

  absl::Status reserved = writer->file_->Preallocate(expected_size_bytes);
  if (!reserved.ok() && !absl::IsUnimplemented(reserved)) {
    return writer->Fail(Annotate(
        reserved, absl::StrCat("reserving ", expected_size_bytes, " bytes for '",
                               writer->final_path_, "'")));
  }
  return writer;
}

RankFileWriter::~RankFileWriter() {
  // Errors cannot be reported from a destructor; Abandon() documents this.
  Abandon().IgnoreError();
}

absl::Status RankFileWriter::CheckOpen(std::string_view operation) const {
  switch (state_) {
    case State::kOpen:
      return absl::OkStatus();
    case State::kCommitted:
      return absl::FailedPreconditionError(absl::StrCat(
          AV(operation), " '", final_path_, "': the rank file writer already committed"));
    case State::kDone:
      break;
  }
  if (failure_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(AV(operation), " '", final_path_, "': the rank file writer was abandoned"));
  }
  return absl::FailedPreconditionError(absl::StrCat(AV(operation), " '", final_path_,
                                                    "': the rank file writer failed earlier: ",
                                                    failure_.ToString()));
}

absl::Status RankFileWriter::Fail(absl::Status error) {
  state_ = State::kDone;
  failure_ = error;
  if (file_ != nullptr) {
    // The file is being thrown away: whether its close succeeded is moot.
    file_->Close().IgnoreError();
    file_.reset();
  }
  absl::Status deleted = fs_->DeleteFile(temp_path_);
  if (deleted.ok() || absl::IsNotFound(deleted)) {
    temp_exists_ = false;
    return error;
  }
  return absl::Status(error.code(),
                      absl::StrCat(error.message(), " (and the temporary file was left behind: ",
                                   deleted.message(), ")"));
}

absl::Status RankFileWriter::Append(std::span<const std::byte> data) {
  CKPT_RETURN_IF_ERROR(CheckOpen("append to"));
  if (data.size() > expected_size_bytes_ - bytes_written_) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "append to '", final_path_, "': ", bytes_written_, " + ", data.size(),
        " bytes exceed the expected size of ", expected_size_bytes_, " bytes")));
  }
  if (absl::Status s = file_->Append(data); !s.ok()) {
    return Fail(Annotate(s, absl::StrCat("writing '", final_path_, "'")));
  }
  crc32c_ = Crc32cExtend(crc32c_, data.data(), data.size());
  bytes_written_ += data.size();
  return absl::OkStatus();
}

absl::Status RankFileWriter::Commit() {
  CKPT_RETURN_IF_ERROR(CheckOpen("commit"));
  if (bytes_written_ != expected_size_bytes_ || crc32c_ != expected_crc32c_) {
    return Fail(absl::DataLossError(absl::StrCat(
        "commit '", final_path_, "': wrote ", bytes_written_, " bytes with crc32c ",
        Hex32(crc32c_), " but expected ", expected_size_bytes_, " bytes with crc32c ",
        Hex32(expected_crc32c_), " (the source bytes changed or are incomplete)")));
  }
  const std::string context = absl::StrCat("committing '", final_path_, "'");
  if (absl::Status s = file_->Sync(); !s.ok()) return Fail(Annotate(s, context));
  absl::Status closed = file_->Close();
  file_.reset();
  if (!closed.ok()) return Fail(Annotate(closed, context));
  if (absl::Status s = fs_->Rename(temp_path_, final_path_); !s.ok()) {
    return Fail(Annotate(s, context));
  }
  state_ = State::kCommitted;
  temp_exists_ = false;
  // The file is in place; from here an error means "may not survive a
  // crash". The temporary name no longer exists, so there is nothing to
  // clean up.
  absl::Status synced = fs_->SyncDir(Dirname(final_path_));
  for (const std::string& created : created_dirs_) {
    if (!synced.ok()) break;
    synced = fs_->SyncDir(Dirname(created));
  }
  if (!synced.ok()) {
    state_ = State::kDone;
    failure_ = Annotate(synced, context);
    return failure_;
  }
  return absl::OkStatus();
}

absl::Status RankFileWriter::Abandon() {
  if (state_ == State::kCommitted) return absl::OkStatus();
  if (state_ == State::kOpen) {
    state_ = State::kDone;
    if (file_ != nullptr) {
      file_->Close().IgnoreError();  // discarded with the file
      file_.reset();
    }
  }
  if (!temp_exists_) return absl::OkStatus();
  absl::Status deleted = fs_->DeleteFile(temp_path_);
  if (deleted.ok() || absl::IsNotFound(deleted)) {
    temp_exists_ = false;
    return absl::OkStatus();
  }
  return deleted;
}

// --- manifest.json ---

absl::StatusOr<std::string> EncodeDurableManifest(const DurableManifest& m) {
  if (m.format_version != kDurableFormatVersion && m.format_version != kDurableFormatVersionWithRefs) {
    return absl::InvalidArgumentError(absl::StrCat("manifest has format_version ", m.format_version, "; only ",
                                                   kDurableFormatVersion, " and ", kDurableFormatVersionWithRefs,
                                                   " can be written"));
  }
  const int format_version = FormatVersionOf(m);
  if (std::string problem = ManifestProblem(m); !problem.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot write manifest.json: ", problem));
  }
  if (std::string problem = JsonRangeProblem(m); !problem.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot write manifest.json: ", problem));
  }
  // The outer structure is laid out by hand, one item per line, so the file
  // is readable and diffable; nlohmann only escapes strings and encodes the
  // items. Key order is fixed by the code below.
  std::string out;
  try {
    absl::StrAppend(&out, "{\n  \"format_version\": ", format_version,
                    ",\n  \"job_id\": ", JsonString(m.job_id), ",\n  \"step\": ", m.step,
                    ",\n  \"world_size\": ", m.world_size, ",\n  \"writer\": ", JsonString(m.writer),
                    ",\n  \"created_unix_ms\": ", m.created_unix_ms, ",\n  \"shards\": [");
    for (size_t i = 0; i < m.shards.size(); ++i) {
      const DurableShard& shard = m.shards[i];
      absl::StrAppend(&out, i == 0 ? "\n" : ",\n", "    {\n      \"rank\": ", shard.rank,
                      ",\n      \"file\": ", JsonString(shard.file),
                      ",\n      \"size_bytes\": ", shard.size_bytes, ",\n      \"crc32c\": \"",
                      Hex32(shard.crc32c), "\",\n      \"manifest_digest\": \"",
                      Hex64(shard.manifest_digest), "\",\n      \"items\": [");
      for (size_t j = 0; j < shard.items.size(); ++j) {
        const ManifestItem& item = shard.items[j];
        OrderedJson attributes = OrderedJson::object();
        for (const auto& [key, value] : item.attributes) attributes[key] = value;
        OrderedJson encoded = {
            {"name", item.name},
            {"dtype", DTypeName(item.dtype)},
            {"shape", item.shape},
            {"offset_bytes", item.offset_bytes},
            {"length_bytes", item.length_bytes},
            {"crc32c", Hex32(item.crc32c)},
            {"attributes", std::move(attributes)},
        };
        if (item.ref_step) encoded["ref_step"] = *item.ref_step;
        absl::StrAppend(&out, j == 0 ? "\n" : ",\n", "        ", encoded.dump());
      }
      absl::StrAppend(&out, shard.items.empty() ? "]" : "\n      ]", "\n    }");
    }
    absl::StrAppend(&out, m.shards.empty() ? "]" : "\n  ]", "\n}\n");
  } catch (const std::exception& e) {
    // nlohmann refuses strings that are not UTF-8 (only attributes and the
    // writer name can be: the rest is validated above).
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write manifest.json: a string is not valid UTF-8: ", e.what()));
  }
  return out;
}

absl::StatusOr<DurableManifest> ParseDurableManifest(std::string_view json) {
  Json root;
  try {
    root = Json::parse(json.begin(), json.end());
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat("manifest.json is not valid JSON: ", e.what()));
  }
  try {
    return ParseManifestJson(root);
  } catch (const std::exception& e) {
    // Not expected (every access is type-checked first); kept so that no
    // exception leaves this module.
    return absl::DataLossError(absl::StrCat("manifest.json could not be read: ", e.what()));
  }
}

absl::Status WriteDurableManifest(FileSystem* fs, const std::string& version_dir,
                                  const DurableManifest& manifest) {
  CKPT_ASSIGN_OR_RETURN(const std::string json, EncodeDurableManifest(manifest));
  const std::string context = absl::StrCat("committing '", version_dir, "'");
  for (const DurableShard& shard : manifest.shards) {
    const std::string path = JoinPath(version_dir, shard.file);
    absl::StatusOr<FileStat> stat = fs->Stat(path);
    if (absl::IsNotFound(stat.status())) {
      return absl::FailedPreconditionError(absl::StrCat(
          context, ": rank ", shard.rank, " file '", path, "' does not exist"));
    }
    CKPT_RETURN_IF_ERROR_CTX(stat, context);
    if (stat->is_directory || stat->size_bytes != shard.size_bytes) {
      return absl::FailedPreconditionError(absl::StrCat(
          context, ": rank ", shard.rank, " file '", path, "' ",
          stat->is_directory ? std::string("is a directory")
                             : absl::StrCat("is ", stat->size_bytes, " bytes"),
          ", the manifest says ", shard.size_bytes, " bytes"));
    }
  }
  const std::string marker = EncodeMarker(json, FormatVersionOf(manifest));
  const std::string marker_path = JoinPath(version_dir, kDurableCommittedFileName);

  // A marker for other content must go (durably) before manifest.json
  // changes, or a crash in between would leave a marker that does not match.
  absl::StatusOr<std::string> old_marker = ReadFileToString(fs, marker_path);
  if (old_marker.ok() && *old_marker != marker) {
    CKPT_RETURN_IF_ERROR_CTX(fs->DeleteFile(marker_path), context);
    CKPT_RETURN_IF_ERROR_CTX(fs->SyncDir(version_dir), context);
  } else if (!old_marker.ok() && !absl::IsNotFound(old_marker.status())) {
    return Annotate(old_marker.status(), context);
  }
  // The names leading to the version directory must be durable before the
  // marker is; the directory's own entries (the rank files) are synced by
  // the first atomic write below.
  CKPT_RETURN_IF_ERROR_CTX(SyncParents(fs, version_dir), context);
  CKPT_RETURN_IF_ERROR_CTX(
      WriteStringToFileAtomically(fs, JoinPath(version_dir, kDurableManifestFileName), json),
      context);
  CKPT_RETURN_IF_ERROR_CTX(WriteStringToFileAtomically(fs, marker_path, marker), context);
  return absl::OkStatus();
}

absl::StatusOr<DurableManifest> ReadDurableManifest(FileSystem* fs,
                                                    const std::string& version_dir) {
  const std::string marker_path = JoinPath(version_dir, kDurableCommittedFileName);
  absl::StatusOr<std::string> marker_text = ReadFileToString(fs, marker_path);
  if (absl::IsNotFound(marker_text.status())) {
    CKPT_ASSIGN_OR_RETURN(bool dir_exists, fs->FileExists(version_dir));
    if (!dir_exists) {
      return absl::NotFoundError(
          absl::StrCat("version directory '", version_dir, "' does not exist"));
    }
    return absl::NotFoundError(absl::StrCat("version '", version_dir,
                                            "' is not committed (no COMMITTED marker)"));
  }
  CKPT_RETURN_IF_ERROR(marker_text);
  CKPT_ASSIGN_OR_RETURN(const Marker marker, ParseMarker(*marker_text, marker_path));

  const std::string manifest_path = JoinPath(version_dir, kDurableManifestFileName);
  absl::StatusOr<std::string> json = ReadFileToString(fs, manifest_path);
  if (absl::IsNotFound(json.status())) {
    return absl::DataLossError(absl::StrCat("version '", version_dir,
                                            "' is committed but has no manifest.json"));
  }
  CKPT_RETURN_IF_ERROR(json);
  const uint32_t crc = Crc32c(*json);
  if (json->size() != marker.manifest_size_bytes || crc != marker.manifest_crc32c) {
    return absl::DataLossError(absl::StrCat(
        "'", manifest_path, "' is ", json->size(), " bytes with crc32c ", Hex32(crc),
        " but the COMMITTED marker records ", marker.manifest_size_bytes, " bytes with crc32c ",
        Hex32(marker.manifest_crc32c)));
  }
  absl::StatusOr<DurableManifest> manifest = ParseDurableManifest(*json);
  if (!manifest.ok()) {
    return Annotate(manifest.status(), absl::StrCat("version '", version_dir, "'"));
  }
  return manifest;
}

// --- rank files ---

absl::Status ReadRankFile(FileSystem* fs, const std::string& version_dir,
                          const DurableShard& shard, std::span<std::byte> out) {
  if (out.size() != shard.size_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("reading rank ", shard.rank, ": buffer of ",
                                                   out.size(), " bytes for a shard of ",
                                                   shard.size_bytes, " bytes"));
  }
  if (shard.file != RankFileName(shard.rank)) {
    return absl::InvalidArgumentError(absl::StrCat("reading rank ", shard.rank, ": file name ",
                                                   QuoteForMessage(shard.file), " is not \"",
                                                   RankFileName(shard.rank), "\""));
  }
  CKPT_RETURN_IF_ERROR_CTX(ValidateManifest(shard.items, shard.size_bytes),
                           absl::StrCat("reading rank ", shard.rank));
  const std::string path = JoinPath(version_dir, shard.file);
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, fs->NewReadableFile(path));
  if (file->Size() != shard.size_bytes) {
    return absl::DataLossError(absl::StrCat("rank ", shard.rank, " file '", path, "' is ",
                                            file->Size(), " bytes, the manifest says ",
                                            shard.size_bytes));
  }

  // Items in file order; empty ones have nothing to read (their crc32c must
  // be that of no bytes, 0). ValidateManifest guarantees no overlaps.
  // References (last in canonical order) are another version's bytes: not read here.
  std::vector<ManifestItem> items = SortedByOffset(shard.items);
  while (!items.empty() && items.back().ref_step) items.pop_back();
  std::vector<size_t> order;  // indices of non-empty items
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].length_bytes > 0) order.push_back(i);
  }
  std::vector<uint32_t> item_crc(items.size(), 0);
  uint32_t file_crc = 0;
  size_t next = 0;  // position in `order` of the first item not yet fully read

  // Each byte is checksummed once: the file is cut into segments at chunk
  // and item boundaries, and each segment's crc is folded into the file's
  // crc and into its item's (if it belongs to one) with Crc32cCombine.
  for (uint64_t offset = 0; offset < shard.size_bytes;) {
    const uint64_t end = offset + std::min<uint64_t>(shard.size_bytes - offset, kReadChunkBytes);
    std::span<std::byte> chunk = out.subspan(offset, end - offset);
    CKPT_ASSIGN_OR_RETURN(size_t n, file->PositionedRead(offset, chunk));
    if (n != chunk.size()) {
      return absl::DataLossError(absl::StrCat("rank ", shard.rank, " file '", path,
                                              "' ended at byte ", offset + n, ", the manifest says ",
                                              shard.size_bytes, " bytes"));
    }
    for (uint64_t pos = offset; pos < end;) {
      uint64_t seg_end = end;
      const ManifestItem* item = nullptr;
      if (next < order.size()) {
        const ManifestItem& candidate = items[order[next]];
        if (candidate.offset_bytes <= pos) {
          item = &candidate;
          seg_end = std::min(end, candidate.offset_bytes + candidate.length_bytes);
        } else {
          seg_end = std::min(end, candidate.offset_bytes);
        }
      }
      const uint64_t len = seg_end - pos;
      const uint32_t crc = Crc32c(out.data() + pos, len);
      file_crc = Crc32cCombine(file_crc, crc, len);
      if (item != nullptr) {
        uint32_t& ic = item_crc[order[next]];
        ic = Crc32cCombine(ic, crc, len);
        if (seg_end == item->offset_bytes + item->length_bytes) ++next;
      }
      pos = seg_end;
    }
    offset = end;
  }

  size_t bad = 0;
  const ManifestItem* first_bad = nullptr;
  uint32_t first_bad_crc = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (item_crc[i] == items[i].crc32c) continue;
    if (bad++ == 0) {
      first_bad = &items[i];
      first_bad_crc = item_crc[i];
    }
  }
  if (first_bad != nullptr) {
    return absl::DataLossError(absl::StrCat(
        "rank ", shard.rank, " file '", path, "': item ", QuoteForMessage(first_bad->name), " [",
        first_bad->offset_bytes, ", +", first_bad->length_bytes, ") has crc32c ",
        Hex32(first_bad_crc), ", the manifest says ", Hex32(first_bad->crc32c),
        bad > 1 ? absl::StrCat(" (and ", bad - 1, " more items differ)") : std::string()));
  }
  if (file_crc != shard.crc32c) {
    return absl::DataLossError(absl::StrCat("rank ", shard.rank, " file '", path,
                                            "' has crc32c ", Hex32(file_crc),
                                            ", the manifest says ", Hex32(shard.crc32c),
                                            " (every item matches: padding bytes differ)"));
  }
  return absl::OkStatus();
}

// --- incremental versions ---

absl::StatusOr<DurableShard> MaterializeDurableShard(FileSystem* fs, const std::string& version_dir,
                                                     const DurableManifest& manifest, const DurableShard& shard,
                                                     std::vector<std::byte>* out) {
  const std::vector<uint64_t> refs = RefSteps(shard.items);
  if (refs.empty()) {
    out->resize(shard.size_bytes);
    CKPT_RETURN_IF_ERROR(ReadRankFile(fs, version_dir, shard, *out));
    return shard;
  }
  CKPT_RETURN_IF_ERROR_CTX(ValidateManifest(shard.items, shard.size_bytes, manifest.step),
                           absl::StrCat("reading rank ", shard.rank));
  // The versions referred to: committed, the same job, and each reference
  // one of their own items.
  std::map<uint64_t, DurableShard> bases;
  for (uint64_t step : refs) {
    const std::string dir = DurableRefDir(version_dir, step);
    absl::StatusOr<DurableManifest> base = ReadDurableManifest(fs, dir);
    if (!base.ok()) {
      return Annotate(base.status(), absl::StrCat("version ", manifest.step, " rank ", shard.rank,
                                                  " refers to items of version ", step, " ('", dir, "')"));
    }
    if (base->job_id != manifest.job_id || base->step != step || shard.rank >= base->shards.size()) {
      return absl::DataLossError(absl::StrCat("'", dir, "' holds ", base->job_id, " step ", base->step, " of ",
                                              base->shards.size(), " ranks, not ", manifest.job_id, " step ", step,
                                              " with rank ", shard.rank));
    }
    bases.emplace(step, std::move(base->shards[shard.rank]));
  }
  for (const ManifestItem& item : shard.items) {
    if (item.ref_step && !IsOwnItemOf(item, bases.at(*item.ref_step).items)) {
      return absl::DataLossError(absl::StrCat("rank ", shard.rank, " item ", QuoteForMessage(item.name),
                                              " refers to [", item.offset_bytes, ", +", item.length_bytes,
                                              ") of version ", *item.ref_step, ", which holds no such item"));
    }
  }
  return MaterializeShard(
      fs, shard,
      [&](const ManifestItem& item) {
        return item.ref_step ? JoinPath(DurableRefDir(version_dir, *item.ref_step), bases.at(*item.ref_step).file)
                             : JoinPath(version_dir, shard.file);
      },
      out);
}

bool IsOwnItemOf(const ManifestItem& ref, const std::vector<ManifestItem>& base) {
  if (ref.length_bytes == 0) return true;
  return std::any_of(base.begin(), base.end(), [&](const ManifestItem& b) {
    return !b.ref_step && b.offset_bytes == ref.offset_bytes && b.length_bytes == ref.length_bytes &&
           b.crc32c == ref.crc32c;
  });
}

absl::StatusOr<DurableShard> MaterializeShard(FileSystem* fs, const DurableShard& shard,
                                              const std::function<std::string(const ManifestItem&)>& file_of,
                                              std::vector<std::byte>* out) {
  // The new layout: every item in the manifest's order, 64-byte aligned.
  DurableShard dense;
  dense.rank = shard.rank;
  dense.file = shard.file;
  uint64_t end = 0;
  for (const ManifestItem& item : shard.items) {
    ManifestItem placed = item;
    placed.ref_step.reset();
    // Each item is inside its own file, but the sum of many (references to
    // several versions) is checked too.
    if (__builtin_add_overflow(end, uint64_t{63}, &placed.offset_bytes) ||
        __builtin_add_overflow(placed.offset_bytes & ~uint64_t{63}, placed.length_bytes, &end)) {
      return absl::DataLossError(absl::StrCat("rank ", shard.rank, ": the items up to ",
                                                     QuoteForMessage(item.name), " (", item.length_bytes,
                                                     " bytes) add up to more than 2^64 bytes"));
    }
    placed.offset_bytes &= ~uint64_t{63};
    dense.items.push_back(std::move(placed));
  }
  dense.size_bytes = std::max<uint64_t>(end, 1);
  // Every item inside its file before anything is allocated: a damaged
  // manifest that claims more bytes than the files hold is DataLoss, not an
  // allocation of what it claims.
  std::map<std::string, std::unique_ptr<ReadableFile>> files;  // path -> open file
  std::vector<ReadableFile*> file_of_item(shard.items.size(), nullptr);
  for (size_t i = 0; i < shard.items.size(); ++i) {
    const ManifestItem& item = shard.items[i];
    if (item.length_bytes == 0) continue;
    const std::string path = file_of(item);
    auto& file = files[path];
    if (file == nullptr) {
      CKPT_ASSIGN_OR_RETURN(file, fs->NewReadableFile(path));
    }
    if (item.offset_bytes > file->Size() || item.length_bytes > file->Size() - item.offset_bytes) {
      return absl::DataLossError(absl::StrCat("'", path, "' (", file->Size(), " bytes) ends before item ",
                                              QuoteForMessage(item.name), " [", item.offset_bytes, ", +",
                                              item.length_bytes, ")"));
    }
    file_of_item[i] = file.get();
  }
  out->assign(dense.size_bytes, std::byte{0});
  for (size_t i = 0; i < shard.items.size(); ++i) {
    const ManifestItem& item = shard.items[i];
    if (item.length_bytes == 0) continue;
    const std::string path = file_of(item);
    ReadableFile* const file = file_of_item[i];
    std::span<std::byte> dst(out->data() + dense.items[i].offset_bytes, item.length_bytes);
    CKPT_ASSIGN_OR_RETURN(size_t n, file->PositionedRead(item.offset_bytes, dst));
    if (n != dst.size()) {
      return absl::DataLossError(absl::StrCat("'", path, "' ended before item ", QuoteForMessage(item.name),
                                              " [", item.offset_bytes, ", +", item.length_bytes, ")"));
    }
    const uint32_t crc = Crc32c(dst.data(), dst.size());
    if (crc != item.crc32c) {
      return absl::DataLossError(absl::StrCat("'", path, "': item ", QuoteForMessage(item.name), " [",
                                              item.offset_bytes, ", +", item.length_bytes, ") has crc32c ",
                                              Hex32(crc), ", the manifest says ", Hex32(item.crc32c)));
    }
  }
  dense.crc32c = Crc32c(out->data(), out->size());
  dense.manifest_digest = ManifestDigest(dense.items);
  return dense;
}

// --- deletion ---

absl::Status DeleteDurableVersion(FileSystem* fs, const std::string& version_dir) {
  const std::string context = absl::StrCat("deleting '", version_dir, "'");
  // The marker goes first, and its absence is made durable before anything
  // else is touched: this also covers a marker removed by an earlier attempt
  // whose directory sync failed.
  absl::Status deleted = fs->DeleteFile(JoinPath(version_dir, kDurableCommittedFileName));
  if (!deleted.ok() && !absl::IsNotFound(deleted)) return Annotate(deleted, context);
  absl::Status synced = fs->SyncDir(version_dir);
  if (absl::IsNotFound(synced)) return absl::OkStatus();  // no directory: nothing to do
  CKPT_RETURN_IF_ERROR_CTX(synced, context);

  absl::StatusOr<std::vector<std::string>> names = fs->ListDir(version_dir);
  if (absl::IsNotFound(names.status())) return absl::OkStatus();
  CKPT_RETURN_IF_ERROR_CTX(names, context);
  for (const std::string& name : *names) {
    CKPT_RETURN_IF_ERROR_CTX(DeleteRecursively(fs, JoinPath(version_dir, name)), context);
  }
  absl::Status removed = fs->DeleteDir(version_dir);
  if (absl::IsNotFound(removed)) return absl::OkStatus();
  CKPT_RETURN_IF_ERROR_CTX(removed, context);
  absl::Status parent_synced = fs->SyncDir(Dirname(version_dir));
  if (absl::IsNotFound(parent_synced)) return absl::OkStatus();
  return Annotate(parent_synced, context);
}

}  // namespace ckpt
