// ckpt._ckpt: the pybind11 layer of the Python client. It exposes the C++
// client (ckpt/client.h) at the level of flat items (name, buffer, dtype,
// shape, attributes); the package python/ckpt/ flattens nested Python state
// into such items and back.
//
// Errors: every absl::Status that is not OK becomes a Python exception of a
// ckpt.Error subclass chosen by its code (ckpt.NotFoundError, ...), carrying
// the status message. Nothing else is raised, except TypeError/BufferError
// from pybind11 for arguments of the wrong kind.
//
// The GIL is released around every call that blocks: Connect, the copy of a
// save (SaveBuilder::Commit), Wait, Latest, Load and the copies of a load, and
// the reads of read_durable. The caller's buffers are held (Py_buffer) for the
// whole of a save, so they cannot be freed while the copy runs; the caller
// must not modify them concurrently (as with any save).
//
// Thread safety: a Client object may be used from several Python threads at
// once (the C++ Client is thread-safe); SaveHandle likewise.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "ckpt/client.h"
#include "common/durable_format.h"
#include "common/file_system.h"

namespace py = pybind11;

namespace ckpt::python {
namespace {

// Exception classes by absl::StatusCode; filled in at module init. Index 0
// (OK) holds the base class ckpt.Error.
PyObject* g_errors[17] = {};

struct ErrorName {
  absl::StatusCode code;
  const char* name;
};
constexpr ErrorName kErrorNames[] = {
    {absl::StatusCode::kCancelled, "CancelledError"},
    {absl::StatusCode::kUnknown, "UnknownError"},
    {absl::StatusCode::kInvalidArgument, "InvalidArgumentError"},
    {absl::StatusCode::kDeadlineExceeded, "DeadlineExceededError"},
    {absl::StatusCode::kNotFound, "NotFoundError"},
    {absl::StatusCode::kAlreadyExists, "AlreadyExistsError"},
    {absl::StatusCode::kPermissionDenied, "PermissionDeniedError"},
    {absl::StatusCode::kResourceExhausted, "ResourceExhaustedError"},
    {absl::StatusCode::kFailedPrecondition, "FailedPreconditionError"},
    {absl::StatusCode::kAborted, "AbortedError"},
    {absl::StatusCode::kOutOfRange, "OutOfRangeError"},
    {absl::StatusCode::kUnimplemented, "UnimplementedError"},
    {absl::StatusCode::kInternal, "InternalError"},
    {absl::StatusCode::kUnavailable, "UnavailableError"},
    {absl::StatusCode::kDataLoss, "DataLossError"},
    {absl::StatusCode::kUnauthenticated, "UnauthenticatedError"},
};

// Raises the ckpt.Error subclass for `status` (which must not be OK).
[[noreturn]] void ThrowStatus(const absl::Status& status) {
  const int code = static_cast<int>(status.code());
  PyObject* type = (code > 0 && code < 17 && g_errors[code] != nullptr) ? g_errors[code] : g_errors[0];
  PyErr_SetString(type, std::string(status.message()).c_str());
  throw py::error_already_set();
}

void Check(const absl::Status& status) {
  if (!status.ok()) ThrowStatus(status);
}

Level ParseLevel(const std::string& level) {
  if (level == "staged") return Level::kStaged;
  if (level == "protected") return Level::kProtected;
  if (level == "persisted") return Level::kPersisted;
  ThrowStatus(absl::InvalidArgumentError(
      "level must be \"staged\", \"protected\" or \"persisted\", not \"" + level + "\""));
}

// None: no deadline; otherwise seconds from now (0 or less: check once).
absl::Time DeadlineFrom(std::optional<double> timeout_s) {
  if (!timeout_s.has_value()) return absl::InfiniteFuture();
  return absl::Now() + absl::Seconds(*timeout_s);
}

// A contiguous read-only view of a Python buffer, released on destruction.
class BufferView {
 public:
  explicit BufferView(const py::handle& obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
    held_ = true;
  }
  BufferView(BufferView&& other) noexcept : view_(other.view_), held_(other.held_) { other.held_ = false; }
  BufferView(const BufferView&) = delete;
  BufferView& operator=(const BufferView&) = delete;
  BufferView& operator=(BufferView&&) = delete;
  ~BufferView() {
    if (held_) PyBuffer_Release(&view_);
  }
  std::span<const std::byte> bytes() const {
    return {static_cast<const std::byte*>(view_.buf), static_cast<size_t>(view_.len)};
  }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

// A contiguous writable view of a Python buffer, released on destruction.
class WritableView {
 public:
  explicit WritableView(const py::handle& obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) {
      throw py::error_already_set();
    }
    held_ = true;
  }
  WritableView(WritableView&& other) noexcept : view_(other.view_), held_(other.held_) { other.held_ = false; }
  WritableView(const WritableView&) = delete;
  WritableView& operator=(const WritableView&) = delete;
  WritableView& operator=(WritableView&&) = delete;
  ~WritableView() {
    if (held_) PyBuffer_Release(&view_);
  }
  std::span<std::byte> bytes() const {
    return {static_cast<std::byte*>(view_.buf), static_cast<size_t>(view_.len)};
  }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

// A fresh uint8 numpy array of `n` bytes.
py::array_t<uint8_t> NewByteArray(size_t n) { return py::array_t<uint8_t>(static_cast<py::ssize_t>(n)); }

py::tuple ItemTuple(const std::string& name, int dtype, const std::vector<uint64_t>& shape,
                    const std::map<std::string, std::string>& attributes, py::array_t<uint8_t> data) {
  py::dict attrs;
  for (const auto& [k, v] : attributes) attrs[py::str(k)] = py::str(v);
  return py::make_tuple(name, dtype, py::cast(shape), attrs, std::move(data));
}

class PySaveHandle {
 public:
  explicit PySaveHandle(SaveHandle handle) : handle_(std::move(handle)) {}
  uint64_t step() const { return handle_.step(); }
  uint64_t size_bytes() const { return handle_.size_bytes(); }
  uint32_t crc32c() const { return handle_.crc32c(); }
  void Wait(const std::string& level, std::optional<double> timeout_s) const {
    const Level l = ParseLevel(level);
    const absl::Time deadline = DeadlineFrom(timeout_s);
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = handle_.Wait(l, deadline);
    }
    Check(status);
  }

 private:
  SaveHandle handle_;
};

// "none" | "replicate:COPIES[:ring|group]" | "ec:K+M" (ckptctl's spelling).
Protection ParseProtection(const std::string& text) {
  auto bad = [&](const std::string& why) {
    ThrowStatus(absl::InvalidArgumentError(
        "protection \"" + text + "\": " + why +
        " (expected \"none\", \"replicate:COPIES[:ring|group]\" or \"ec:K+M\")"));
  };
  if (text == "none") return Protection::None();
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  uint32_t a = 0, b = 0;
  if (parts[0] == "replicate") {
    if (parts.size() < 2 || parts.size() > 3) bad("wrong number of ':' fields");
    if (!absl::SimpleAtoi(parts[1], &a)) bad("COPIES is not a number");
    Protection::Placement placement = Protection::Placement::kRing;
    if (parts.size() == 3) {
      if (parts[2] == "group") {
        placement = Protection::Placement::kGroup;
      } else if (parts[2] != "ring") {
        bad("placement must be ring or group");
      }
    }
    return Protection::Replicate(a, placement);
  }
  if (parts[0] == "ec") {
    if (parts.size() != 2) bad("wrong number of ':' fields");
    std::vector<std::string> km = absl::StrSplit(parts[1], '+');
    if (km.size() != 2 || !absl::SimpleAtoi(km[0], &a) || !absl::SimpleAtoi(km[1], &b)) {
      bad("K+M must be two numbers");
    }
    return Protection::ErasureCode(a, b);
  }
  bad("unknown kind");
  return Protection::None();
}

class PyClient {
 public:
  explicit PyClient(Client client) : client_(std::move(client)) {}

  static std::unique_ptr<PyClient> Connect(std::string job, uint32_t rank, uint32_t world_size,
                                           std::string meta, std::string agent_socket,
                                           uint32_t flush_every, uint32_t flush_every_seconds,
                                           uint32_t keep_in_memory, uint32_t keep_durable,
                                           std::string run_id, double connect_timeout,
                                           double rpc_timeout, double load_timeout,
                                           const std::optional<std::string>& protection) {
    ClientOptions o;
    // None: the job's stored protection, or the server's default if rank 0
    // creates it.
    if (protection.has_value()) o.protection = ParseProtection(*protection);
    o.job_id = std::move(job);
    o.rank = rank;
    o.world_size = world_size;
    o.meta_address = std::move(meta);
    o.agent_socket = std::move(agent_socket);
    o.flush_every_n_versions = flush_every;
    o.flush_every_seconds = flush_every_seconds;
    o.keep_in_memory = keep_in_memory;
    o.keep_durable = keep_durable;
    o.run_id = std::move(run_id);
    o.connect_timeout = absl::Seconds(connect_timeout);
    o.rpc_timeout = absl::Seconds(rpc_timeout);
    o.load_timeout = absl::Seconds(load_timeout);
    absl::StatusOr<Client> client = absl::UnknownError("not connected");
    {
      py::gil_scoped_release release;
      client = Client::Connect(o);
    }
    if (!client.ok()) ThrowStatus(client.status());
    return std::make_unique<PyClient>(std::move(*client));
  }

  // items: sequence of (name, buffer, dtype, shape, attributes).
  PySaveHandle SaveItems(uint64_t step, const py::sequence& items) {
    SaveBuilder builder = client_.BeginSave(step);
    std::vector<BufferView> views;
    views.reserve(py::len(items));
    for (const py::handle& item : items) {
      auto t = item.cast<py::tuple>();
      if (t.size() != 5) {
        ThrowStatus(absl::InvalidArgumentError("an item is (name, buffer, dtype, shape, attributes)"));
      }
      auto name = t[0].cast<std::string>();
      views.emplace_back(py::object(t[1]));
      auto dtype = t[2].cast<int>();
      auto shape = t[3].cast<std::vector<uint64_t>>();
      auto attributes = t[4].cast<std::map<std::string, std::string>>();
      Check(builder.Add(std::move(name), views.back().bytes(), static_cast<DType>(dtype), std::move(shape),
                        std::move(attributes)));
    }
    absl::StatusOr<SaveHandle> handle = absl::UnknownError("not committed");
    {
      py::gil_scoped_release release;
      handle = builder.Commit();
    }
    if (!handle.ok()) ThrowStatus(handle.status());
    return PySaveHandle(std::move(*handle));
  }

  void WaitVersion(uint64_t step, const std::string& level, std::optional<double> timeout_s) const {
    const Level l = ParseLevel(level);
    const absl::Time deadline = DeadlineFrom(timeout_s);
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = client_.WaitVersion(step, l, deadline);
    }
    Check(status);
  }

  // The newest step at `level`, or None if there is none.
  std::optional<uint64_t> Latest(const std::string& level) const {
    const Level l = ParseLevel(level);
    absl::StatusOr<uint64_t> step = absl::UnknownError("no answer");
    {
      py::gil_scoped_release release;
      step = client_.Latest(l);
    }
    if (step.ok()) return *step;
    if (step.status().code() == absl::StatusCode::kNotFound) return std::nullopt;
    ThrowStatus(step.status());
  }

  // Returns (served_from, [(name, dtype, shape, attributes, uint8 array)]):
  // every item copied out of the agent's memory tier.
  py::tuple LoadItems(uint64_t step) const {
    absl::StatusOr<LoadedShard> shard = absl::UnknownError("not loaded");
    {
      py::gil_scoped_release release;
      shard = client_.Load(step);
    }
    if (!shard.ok()) ThrowStatus(shard.status());
    py::list out;
    for (const LoadedItem& item : shard->items()) {
      absl::StatusOr<std::span<const std::byte>> bytes = shard->View(item.name);
      if (!bytes.ok()) ThrowStatus(bytes.status());
      py::array_t<uint8_t> data = NewByteArray(bytes->size());
      uint8_t* dst = data.mutable_data();
      {
        py::gil_scoped_release release;
        if (!bytes->empty()) std::memcpy(dst, bytes->data(), bytes->size());
      }
      out.append(ItemTuple(item.name, static_cast<int>(item.dtype), item.shape, item.attributes,
                           std::move(data)));
    }
    const char* served_from = ServedFromName(shard->served_from());
    absl::Status closed;
    {
      py::gil_scoped_release release;
      closed = shard->Close();
    }
    Check(closed);
    return py::make_tuple(served_from, out);
  }

  // Copies the named items of `step` straight into the caller's writable,
  // C-contiguous buffers (dict name -> buffer), checking each item's CRC-32C
  // (Client::LoadInto).
  void LoadInto(uint64_t step, const py::dict& buffers) const {
    std::vector<WritableView> views;
    views.reserve(buffers.size());
    std::map<std::string, std::span<std::byte>> spans;
    for (const auto& [name, buffer] : buffers) {
      views.emplace_back(py::reinterpret_borrow<py::object>(buffer));
      spans.emplace(name.cast<std::string>(), views.back().bytes());
    }
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = client_.LoadInto(step, spans);
    }
    Check(status);
  }

  std::string node_id() const { return client_.node_id(); }

 private:
  Client client_;
};

// Reads a committed durable-tier version directory with no daemon:
// (job_id, step, world_size, {rank: [(name, dtype, shape, attributes, uint8 array)]}),
// each item's array a view into one array per rank file.
py::tuple ReadDurable(const std::string& version_dir) {
  absl::StatusOr<DurableManifest> manifest = absl::UnknownError("not read");
  {
    py::gil_scoped_release release;
    manifest = ReadDurableManifest(PosixFileSystem(), version_dir);
  }
  if (!manifest.ok()) ThrowStatus(manifest.status());
  py::dict ranks;
  for (const DurableShard& shard : manifest->shards) {
    py::array_t<uint8_t> file = NewByteArray(shard.size_bytes);
    std::span<std::byte> out(reinterpret_cast<std::byte*>(file.mutable_data()), shard.size_bytes);
    absl::Status read;
    {
      py::gil_scoped_release release;
      read = ReadRankFile(PosixFileSystem(), version_dir, shard, out);
    }
    Check(read);
    py::list items;
    for (const ManifestItem& item : shard.items) {
      // A view into the rank file's array (which it keeps alive): no copy.
      const auto begin = static_cast<py::ssize_t>(item.offset_bytes);
      const auto end = static_cast<py::ssize_t>(item.offset_bytes + item.length_bytes);
      auto data = file[py::slice(begin, end, 1)].cast<py::array_t<uint8_t>>();
      items.append(ItemTuple(item.name, item.dtype, item.shape, item.attributes, std::move(data)));
    }
    ranks[py::int_(shard.rank)] = items;
  }
  return py::make_tuple(manifest->job_id, manifest->step, manifest->world_size, ranks);
}

}  // namespace
}  // namespace ckpt::python

PYBIND11_MODULE(_ckpt, m) {
  using namespace ckpt::python;
  m.doc() = "Low-level binding of the ckpt C++ client; use the `ckpt` package instead.";

  PyObject* base = PyErr_NewExceptionWithDoc("ckpt.Error", "An error reported by ckpt (an absl::Status).",
                                             PyExc_Exception, nullptr);
  if (base == nullptr) throw py::error_already_set();
  g_errors[0] = base;
  m.attr("Error") = py::handle(base);
  for (const ErrorName& e : kErrorNames) {
    const std::string qualified = std::string("ckpt.") + e.name;
    PyObject* type = PyErr_NewException(qualified.c_str(), base, nullptr);
    if (type == nullptr) throw py::error_already_set();
    g_errors[static_cast<int>(e.code)] = type;
    m.attr(e.name) = py::handle(type);
  }

  py::class_<PySaveHandle>(m, "SaveHandle")
      .def_property_readonly("step", &PySaveHandle::step)
      .def_property_readonly("size_bytes", &PySaveHandle::size_bytes)
      .def_property_readonly("crc32c", &PySaveHandle::crc32c)
      .def("wait", &PySaveHandle::Wait, py::arg("level") = "protected", py::arg("timeout") = py::none());

  py::class_<PyClient>(m, "Client")
      .def_static("connect", &PyClient::Connect, py::arg("job"), py::arg("rank"), py::arg("world_size"),
                  py::arg("meta"), py::arg("agent_socket"), py::arg("flush_every") = 0,
                  py::arg("flush_every_seconds") = 0, py::arg("keep_in_memory") = 0,
                  py::arg("keep_durable") = 0, py::arg("run_id") = "", py::arg("connect_timeout") = 30.0,
                  py::arg("rpc_timeout") = 60.0, py::arg("load_timeout") = 600.0,
                  py::arg("protection") = py::none())
      .def("save_items", &PyClient::SaveItems, py::arg("step"), py::arg("items"))
      .def("wait", &PyClient::WaitVersion, py::arg("step"), py::arg("level") = "protected",
           py::arg("timeout") = py::none())
      .def("latest", &PyClient::Latest, py::arg("level") = "protected")
      .def("load_items", &PyClient::LoadItems, py::arg("step"))
      .def("load_into", &PyClient::LoadInto, py::arg("step"), py::arg("buffers"))
      .def_property_readonly("node_id", &PyClient::node_id);

  m.def("read_durable", &ReadDurable, py::arg("version_dir"));
}
