// The durable tier's on-disk format: one directory per checkpoint version
// holding one file per rank, a manifest and a commit marker. docs/format.md is
// the specification (layout, JSON schema, checksums, crash guarantees); this
// file is the C++ reader and writer of it.
//
//   <root>/<job_id>/<step>/            DurableVersionDir(); step in decimal
//       rank-00000.bin ...             RankFileName(rank): the shard's bytes
//       manifest.json                  DurableManifest as JSON
//       COMMITTED                      written last; names manifest.json's crc32c
//
// Writing a version (the agent's FlushTask and CommitDurableTask):
//   1. per rank, RankFileWriter::Create(fs, DurableRankFilePath(dir, rank),
//      size, crc), Append() the shard's bytes, Commit(): temp file, fsync,
//      rename, fsync directory. Ranks may be written by different nodes.
//   2. once every rank file is there, WriteDurableManifest(): manifest.json,
//      then COMMITTED, each atomically (temp, fsync, rename, fsync directory).
// A version is committed iff its COMMITTED marker exists. Crash guarantee: a
// crash at any point before WriteDurableManifest returns OK leaves a version
// that ReadDurableManifest reports as NotFound (never partly readable); after
// it returns OK, the version is readable after any crash.
//
// Reading: ReadDurableManifest() (every check that needs no rank data), then
// ReadRankFile() per rank (every item's crc32c and the file's).
// Deleting: DeleteDurableVersion() (COMMITTED first).
//
// Every function goes through the FileSystem interface (file_system.h), so
// the crash and fault behaviour is tested on MemFileSystem / FaultFileSystem.
// Errors from the file system are passed on with their code
// (ResourceExhausted = disk full, Unavailable = I/O error: retry) and the path
// and step in the message.
//
// Thread safety: the free functions may be called concurrently, but not on
// the same version directory for writing (two WriteDurableManifest or a write
// and a delete of one version race; meta never issues that). A RankFileWriter
// is used by one thread at a time; different writers (different ranks of one
// version) may run concurrently. Every call blocks until its I/O is done.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/file_system.h"
#include "common/manifest.h"

namespace ckpt {

// format_version 1: self-contained versions. 2: a version with references
// (incremental saves): some items' bytes are in the rank file of the same rank
// of an older version of the job, the sibling directory named by the item's
// ref_step (DurableRefDir). The writer writes 1 for a manifest without
// references and 2 for one with; the reader reads both.
inline constexpr int kDurableFormatVersion = 1;
inline constexpr int kDurableFormatVersionWithRefs = 2;
// File names inside a version directory (besides the rank files).
inline constexpr std::string_view kDurableManifestFileName = "manifest.json";
inline constexpr std::string_view kDurableCommittedFileName = "COMMITTED";
// Largest integer manifest.json holds as a JSON number: 2^53 - 1, the largest
// that JavaScript (and any reader parsing numbers as doubles) keeps exactly.
// Wider values (checksums, digests) are hex strings.
inline constexpr uint64_t kMaxDurableJsonInteger = (uint64_t{1} << 53) - 1;

// One rank's entry in manifest.json.
struct DurableShard {
  uint32_t rank = 0;
  std::string file;  // name inside the version directory: RankFileName(rank)
  uint64_t size_bytes = 0;
  uint32_t crc32c = 0;           // CRC-32C of the whole file
  uint64_t manifest_digest = 0;  // ManifestDigest(items)
  std::vector<ManifestItem> items;

  bool operator==(const DurableShard&) const = default;
};

// Everything manifest.json says about a version.
struct DurableManifest {
  // What the file says (ParseDurableManifest); the writer derives it from
  // the items (2 iff some item is a reference) and only checks that this is
  // 1 or 2.
  int format_version = kDurableFormatVersion;
  std::string job_id;
  uint64_t step = 0;
  uint32_t world_size = 0;
  std::string writer;  // program and version that wrote it, e.g. "ckpt-agent 0.1.0"
  int64_t created_unix_ms = 0;  // writer's wall clock when it wrote manifest.json
  std::vector<DurableShard> shards;  // one per rank, in rank order 0..world_size-1

  bool operator==(const DurableManifest&) const = default;
};

// Returns "<root>/<job_id>/<step>" (step in decimal, unpadded). InvalidArgument
// if `job_id` is not a valid job id (ValidateJobId) or `root` is empty. Pure.
absl::StatusOr<std::string> DurableVersionDir(std::string_view root, std::string_view job_id,
                                              uint64_t step);

// Returns "<version_dir>/<RankFileName(rank)>". Pure.
std::string DurableRankFilePath(std::string_view version_dir, uint32_t rank);

// The directory of the version a reference names: "<version_dir>/../<ref_step>"
// written as "<parent of version_dir>/<ref_step>" (a trailing '/' of
// version_dir ignored). Pure.
std::string DurableRefDir(std::string_view version_dir, uint64_t ref_step);

// Writes one rank file so that it appears at its final path complete and
// checked, or not at all: the bytes go to a temporary file next to it
// (".<name>.tmp-<pid>-<n>"), which Commit() verifies, syncs and renames.
//
//   CKPT_ASSIGN_OR_RETURN(auto w, RankFileWriter::Create(fs, path, size, crc));
//   for (auto chunk : extents) CKPT_RETURN_IF_ERROR(w->Append(chunk));
//   CKPT_RETURN_IF_ERROR(w->Commit());
//
// After any error the writer is spent: every later call fails with
// FailedPrecondition, and the temporary file has been (or, from the
// destructor, will be) deleted. Retry with a new writer.
//
// Not thread-safe: one thread at a time (Append order is the file's order).
class RankFileWriter {
 public:
  // Creates the parent directory of `final_path` (and any missing ancestors),
  // opens a new temporary file beside it and reserves `expected_size_bytes`
  // on disk (Preallocate; file systems that cannot preallocate are fine).
  // `expected_crc32c` is the CRC-32C the bytes must have. Blocks on the I/O.
  // Errors: InvalidArgument if `final_path` has no directory part or no file
  // name; the file system's errors otherwise, notably ResourceExhausted when
  // the space cannot be reserved (nothing is left behind on error).
  static absl::StatusOr<std::unique_ptr<RankFileWriter>> Create(FileSystem* fs,
                                                                std::string final_path,
                                                                uint64_t expected_size_bytes,
                                                                uint32_t expected_crc32c);

  // Deletes the temporary file unless Commit() succeeded; errors are dropped
  // (call Abandon() first to see them).
  ~RankFileWriter();

  RankFileWriter(const RankFileWriter&) = delete;
  RankFileWriter& operator=(const RankFileWriter&) = delete;

  // Appends `data` to the file and extends the running crc32c. Blocks until
  // written (to the page cache; Commit syncs). InvalidArgument if the file
  // would exceed the expected size; the file system's error (e.g.
  // ResourceExhausted, Unavailable) if the write fails; FailedPrecondition
  // after Commit, Abandon or an earlier error.
  absl::Status Append(std::span<const std::byte> data);

  // Checks that exactly the expected number of bytes with the expected
  // crc32c were appended (DataLoss, giving expected and actual values, if
  // not: the bytes changed since the crc was taken), then Syncs and Closes
  // the temporary file, renames it over the final path and syncs the
  // directory (and the parents of any directory Create made), so the file
  // and its name survive a crash once this returns OK. On an error before
  // the rename the temporary file is deleted and the final path untouched.
  // If only a directory sync fails the file is in place but may not survive
  // a crash: the error is returned and a retry (new writer) is safe.
  // FailedPrecondition if called twice or after an error.
  absl::Status Commit();

  // Gives up: closes and deletes the temporary file. OK if there was nothing
  // to delete (already committed, abandoned or cleaned up after an error);
  // otherwise the file system's error from the deletion.
  absl::Status Abandon();

  const std::string& final_path() const { return final_path_; }
  const std::string& temp_path() const { return temp_path_; }
  uint64_t bytes_written() const { return bytes_written_; }
  // CRC-32C of the bytes appended so far.
  uint32_t crc32c() const { return crc32c_; }

 private:
  enum class State { kOpen, kCommitted, kDone };  // kDone: abandoned or failed

  RankFileWriter(FileSystem* fs, std::string final_path, std::string temp_path,
                 uint64_t expected_size_bytes, uint32_t expected_crc32c,
                 std::vector<std::string> created_dirs);

  // Records `error` as the reason the writer is spent, closes and deletes the
  // temporary file, and returns `error` (with a note if the delete failed).
  absl::Status Fail(absl::Status error);
  absl::Status CheckOpen(std::string_view operation) const;

  FileSystem* const fs_;
  const std::string final_path_;
  const std::string temp_path_;
  const uint64_t expected_size_bytes_;
  const uint32_t expected_crc32c_;
  // Directories Create() made, deepest first: their parents are synced on
  // Commit so the new names are durable too.
  const std::vector<std::string> created_dirs_;
  std::unique_ptr<WritableFile> file_;
  State state_ = State::kOpen;
  absl::Status failure_;  // why the writer is spent, if it failed
  bool temp_exists_ = true;  // false once renamed or deleted
  uint64_t bytes_written_ = 0;
  uint32_t crc32c_ = 0;
};

// Encodes `manifest` as manifest.json's bytes (docs/format.md): keys in a
// fixed order, so equal manifests give identical bytes. Checks it first as
// ReadDurableManifest would (see there) and fails with InvalidArgument naming
// the problem, including integers above kMaxDurableJsonInteger and attribute
// strings that are not UTF-8. Pure.
absl::StatusOr<std::string> EncodeDurableManifest(const DurableManifest& manifest);

// Parses and checks manifest.json's bytes: JSON syntax, every field present
// with the right type, format_version, job id, rank list exactly
// 0..world_size-1 in order, file names == RankFileName(rank) (so no name can
// point outside the directory), known dtype names, ValidateManifest() per
// shard, and manifest_digest == ManifestDigest(items). Keys it does not know
// are ignored. Errors: FailedPrecondition for a format_version other than
// kDurableFormatVersion; DataLoss, naming the field (and rank, item) at fault,
// for anything else. Pure.
absl::StatusOr<DurableManifest> ParseDurableManifest(std::string_view json);

// Commits a version whose rank files are all in place: checks `manifest` (as
// EncodeDurableManifest; InvalidArgument), checks that every shard's file
// exists in `version_dir` with size_bytes bytes (FailedPrecondition naming the
// rank otherwise; the data is not re-read: RankFileWriter checked its crc),
// syncs the directory and its two parents (the job directory and the durable
// root), then writes manifest.json and, last, the COMMITTED marker, each
// atomically (WriteStringToFileAtomically). Returns OK once the version is
// durably committed. A COMMITTED marker already present for different content
// is deleted (and that deletion synced) before manifest.json is replaced.
// Idempotent: repeating the call with the same manifest writes the same
// bytes and returns OK. File system errors are passed on with context;
// nothing is left half-committed (ReadDurableManifest says NotFound, or
// DataLoss only if the directory was tampered with concurrently).
absl::Status WriteDurableManifest(FileSystem* fs, const std::string& version_dir,
                                  const DurableManifest& manifest);

// Reads a committed version's manifest. Checks the COMMITTED marker, that
// manifest.json matches the size and crc32c the marker records, then
// everything ParseDurableManifest checks. Does not read rank files.
// Errors:
//   NotFound           `version_dir` or its COMMITTED marker does not exist:
//                      the version is not (or no longer) committed
//   DataLoss           marker unreadable, manifest.json missing or not the one
//                      the marker names, or invalid (ParseDurableManifest)
//   FailedPrecondition format_version (marker or manifest) not understood
//   others             the file system's read errors (e.g. Unavailable)
// Callers that expect a particular (job, step) compare them with the result.
absl::StatusOr<DurableManifest> ReadDurableManifest(FileSystem* fs,
                                                    const std::string& version_dir);

// Reads one rank file of `version_dir` into `out` and verifies it: the file
// must be exactly shard.size_bytes long, every item's bytes must have the
// item's crc32c and the whole file shard.crc32c. Reads in 8 MiB chunks and
// checksums each byte once. Errors: InvalidArgument if out.size() !=
// shard.size_bytes, shard.file != RankFileName(shard.rank) or the items fail
// ValidateManifest; NotFound if the file is missing; DataLoss if its size
// differs, or naming the first item whose crc32c differs (expected and
// actual) or, if only padding differs, the file's crc32c; the file system's
// read errors otherwise. On error `out` holds unspecified bytes.
absl::Status ReadRankFile(FileSystem* fs, const std::string& version_dir,
                          const DurableShard& shard, std::span<std::byte> out);

// Reads every item of `shard` (a shard of the committed version at
// `version_dir`, as ReadDurableManifest gave it) and lays them out as a
// self-contained shard: the items in the manifest's order at offsets aligned
// to 64 bytes, padding zero. Own items come from the version's rank file,
// references from the rank file of the version they name (DurableRefDir),
// which must be committed, of the same job, and hold an own item with the
// reference's offset, length and crc32c. Every item's crc32c is checked.
// Returns the new shard (items with their new offsets and no references,
// size, crc32c, digest; file and rank as given) and its bytes in `*out`.
// Errors: NotFound (a referenced version is not committed), DataLoss (a
// crc32c differs, a reference names no such item, another job), the file
// system's. For a shard without references it returns the shard as is,
// read with ReadRankFile.
absl::StatusOr<DurableShard> MaterializeDurableShard(FileSystem* fs, const std::string& version_dir,
                                                     const DurableManifest& manifest, const DurableShard& shard,
                                                     std::vector<std::byte>* out);

// The layout and reading MaterializeDurableShard does, for any source:
// `file_of(item)` names the file that holds `item`'s bytes at its
// offset_bytes (this shard's file for its own items, the referred version's
// for references; the caller checked that those are its own items). Every
// item's crc32c is checked. Same result and errors as there.
absl::StatusOr<DurableShard> MaterializeShard(FileSystem* fs, const DurableShard& shard,
                                              const std::function<std::string(const ManifestItem&)>& file_of,
                                              std::vector<std::byte>* out);

// True iff `ref` is one of `base`'s own items: same offset, length and
// crc32c (an empty reference matches anything).
bool IsOwnItemOf(const ManifestItem& ref, const std::vector<ManifestItem>& base);

// Deletes a version directory: the COMMITTED marker first and a sync of the
// directory (so that from then on, even after a crash, the version is not
// committed), then every other entry (rank files, manifest.json, leftover
// temporary files, anything else), then the directory itself and a sync of
// its parent. Missing files or directory are not an error (OK if nothing is
// there): safe to repeat after a partial failure. Errors: the file system's,
// with the path. A crash part way leaves either the complete committed
// version (if the marker's removal was not yet durable) or an uncommitted one.
absl::Status DeleteDurableVersion(FileSystem* fs, const std::string& version_dir);

}  // namespace ckpt
