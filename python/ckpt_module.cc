// ckpt._ckpt: the pybind11 layer of the Python client. It exposes the C++
// client (ckpt/client.h) at the level of flat items (name, buffer, dtype,
// shape, attributes), and walks nested Python state into such items and back
// (save_state / load_state): a state of ten thousand tensors costs about a
// microsecond per item, where Python code would take several. Leaves the
// fast paths do not cover (non-contiguous or non-CPU tensors, numpy scalars,
// memoryviews, anything unknown) go through the package's Python helpers
// (ckpt._flatten, ckpt._leaf), so both paths write and read the same items.
//
// Errors: every absl::Status that is not OK becomes a Python exception of a
// ckpt.Error subclass chosen by its code (ckpt.NotFoundError, ...), carrying
// the status message. Nothing else is raised, except TypeError/BufferError
// from pybind11 for arguments of the wrong kind.
//
// The GIL is released around every call that blocks: Connect, the copy of a
// save (SaveBuilder::Commit), Wait, Latest, Load and the copies of a load, and
// the reads of read_durable. The objects a save reads (tensors, arrays, bytes;
// Py_buffer views where Python offers them) are referenced for the whole of
// the save, so they cannot be freed while the copy runs; the caller must not
// modify or resize them concurrently (as with any save).
//
// Thread safety: a Client object may be used from several Python threads at
// once (the C++ Client is thread-safe); SaveHandle likewise.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <bit>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "ckpt/client.h"
#include "common/durable_format.h"
#include "common/durable_slices.h"
#include "common/file_system.h"
#include "common/manifest.h"
#include "common/status_macros.h"

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

// Runs `wait` (a blocking call returning a Status) with the GIL released,
// then raises its error, if any, as the matching ckpt.Error.
template <typename Wait>
void CheckReleased(Wait&& wait) {
  absl::Status status;
  {
    py::gil_scoped_release release;
    status = wait();
  }
  Check(status);
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

// ---- State <-> items ---------------------------------------------------------

// Attribute key holding an item's Python type (see python/ckpt/__init__.py).
constexpr const char* kTypeKey = "py.type";

// A torch dtype as ckpt sees it.
struct TorchDType {
  DType dtype;
  uint32_t size;
  bool complex;
};

// What the fast paths need from torch and numpy, looked up once. torch is
// only touched if the state holds tensors (or, on load, torch items).
struct PyTypes {
  bool torch_ready = false;
  py::object torch;
  PyObject* tensor_type = nullptr;  // torch.Tensor
  py::object strided;               // torch.strided
  py::object from_numpy, bfloat16, int16;
  py::object from_dlpack;  // torch._C._from_dlpack, or None (then numpy + from_numpy)
  std::vector<std::pair<py::object, TorchDType>> torch_dtypes;  // few: linear search by identity
  py::object numpy, ndarray, generic;
  py::str is_cpu, layout, dtype, shape, data_ptr, is_contiguous, is_neg, is_conj, view;

  // torch is imported by the caller already if a value can be a tensor.
  bool TorchLoaded() {
    if (torch_ready) return true;
    PyObject* mod = PyImport_GetModule(py::str("torch").ptr());  // new ref or NULL, no import
    if (mod == nullptr) {
      PyErr_Clear();
      return false;
    }
    InitTorch(py::reinterpret_steal<py::object>(mod));
    return true;
  }
  // For load: imports torch. False if it is not installed.
  bool ImportTorch() {
    if (torch_ready) return true;
    try {
      InitTorch(py::module_::import("torch"));
    } catch (const py::error_already_set&) {
      PyErr_Clear();
      return false;
    }
    return true;
  }
  void InitTorch(py::object mod) {
    torch = std::move(mod);
    tensor_type = torch.attr("Tensor").ptr();
    strided = torch.attr("strided");
    from_numpy = torch.attr("from_numpy");
    py::object c = torch.attr("_C");
    from_dlpack = py::hasattr(c, "_from_dlpack") ? c.attr("_from_dlpack") : py::object(py::none());
    bfloat16 = torch.attr("bfloat16");
    int16 = torch.attr("int16");
    const std::tuple<const char*, DType, uint32_t, bool> kinds[] = {
        {"float32", DType::kF32, 4, false}, {"float16", DType::kF16, 2, false},
        {"bfloat16", DType::kBF16, 2, false}, {"float64", DType::kF64, 8, false},
        {"int8", DType::kI8, 1, false},       {"int16", DType::kI16, 2, false},
        {"int32", DType::kI32, 4, false},     {"int64", DType::kI64, 8, false},
        {"uint8", DType::kU8, 1, false},      {"bool", DType::kBool, 1, false},
        {"complex64", DType::kC64, 8, true},  {"complex128", DType::kC128, 16, true},
    };
    for (const auto& [name, d, size, complex] : kinds) {
      if (!py::hasattr(torch, name)) continue;
      torch_dtypes.emplace_back(torch.attr(name), TorchDType{d, size, complex});
    }
    torch_ready = true;
  }
  const TorchDType* FindTorchDType(PyObject* dt) const {
    for (const auto& [obj, info] : torch_dtypes) {
      if (obj.ptr() == dt) return &info;
    }
    return nullptr;
  }
  const TorchDType* TorchDTypeFor(DType d) const {
    for (const auto& [obj, info] : torch_dtypes) {
      if (info.dtype == d) return &info;
    }
    return nullptr;
  }
  PyObject* TorchDTypeObject(DType d) const {
    for (const auto& [obj, info] : torch_dtypes) {
      if (info.dtype == d) return obj.ptr();
    }
    return nullptr;
  }

  void InitCommon() {
    if (numpy) return;
    numpy = py::module_::import("numpy");
    ndarray = numpy.attr("ndarray");
    generic = numpy.attr("generic");
    is_cpu = py::str("is_cpu");
    layout = py::str("layout");
    dtype = py::str("dtype");
    shape = py::str("shape");
    data_ptr = py::str("data_ptr");
    is_contiguous = py::str("is_contiguous");
    is_neg = py::str("is_neg");
    is_conj = py::str("is_conj");
    view = py::str("view");
  }
};

// Filled at module import (numpy and the attribute names) and, for torch,
// on first use; every access holds the GIL. Lives as long as the
// interpreter: never destroyed (no reference is dropped after finalization).
PyTypes& Types() {
  static PyTypes* types = new PyTypes();
  return *types;
}

// Python errors raised by the C API as a C++ exception pybind11 passes on.
void CheckPy(bool ok) {
  if (!ok) throw py::error_already_set();
}

// numpy dtype of a ckpt dtype (bf16 as uint16 bit patterns), or None. The
// dtype objects are made once.
py::object NumpyDType(int dtype) {
  static const char* const kNames[] = {nullptr,   "float32", "float16", "uint16",    "float64", "int8",
                                       "int16",   "int32",   "int64",   "uint8",     "uint16",  "uint32",
                                       "uint64",  "bool",    nullptr,   "complex64", "complex128"};
  static std::vector<py::object>* cache = [] {
    auto* c = new std::vector<py::object>();  // lives as long as the interpreter
    for (const char* name : kNames) c->push_back(name == nullptr ? py::object(py::none()) : py::object(py::dtype(name)));
    return c;
  }();
  if (dtype < 1 || dtype > 16) return py::none();
  return (*cache)[static_cast<size_t>(dtype)];
}

// ckpt dtype of a native-byte-order numpy dtype, or 0.
int DTypeOfNumpy(const py::dtype& dt) {
  const char order = dt.byteorder();
  if (order != '=' && order != '|' && !(order == '<' && std::endian::native == std::endian::little)) return 0;
  const char kind = dt.kind();
  const auto size = dt.itemsize();
  switch (kind) {
    case 'f':
      return size == 2 ? 2 : size == 4 ? 1 : size == 8 ? 4 : 0;
    case 'i':
      return size == 1 ? 5 : size == 2 ? 6 : size == 4 ? 7 : size == 8 ? 8 : 0;
    case 'u':
      return size == 1 ? 9 : size == 2 ? 10 : size == 4 ? 11 : size == 8 ? 12 : 0;
    case 'b':
      return size == 1 ? 13 : 0;
    case 'c':
      return size == 8 ? 15 : size == 16 ? 16 : 0;
    default:
      return 0;
  }
}

// Walks a state (python/ckpt/__init__.py's _flatten, item for item) into a
// SaveBuilder, keeping every object whose memory an item points into alive
// until the save is committed.
class Flattener {
 public:
  explicit Flattener(SaveBuilder* builder) : builder_(builder), types_(Types()) {}

  // Items whose index (Add order) the walk records: a lazy save's wait points.
  void WatchFor(const std::vector<std::string>& names) {
    for (const std::string& n : names) points_.emplace(n, std::nullopt);
  }
  // Incremental saves: items named in `unchanged` are ItemChange::kUnchanged,
  // every other one kDetect with `detect`, else kChanged.
  void Changes(const std::vector<std::string>& unchanged, bool detect) {
    for (const std::string& n : unchanged) unchanged_.emplace(n, false);
    detect_ = detect;
  }
  // kInvalidArgument for an unchanged name that is not an item of the state.
  void CheckUnchanged() const {
    for (const auto& [name, found] : unchanged_) {
      if (!found) {
        ThrowStatus(absl::InvalidArgumentError("unchanged item \"" + name + "\" is not an item of the state"));
      }
    }
  }

  // The recorded indexes; kInvalidArgument for a wait point that is not an item.
  std::map<std::string, size_t> Points() const {
    std::map<std::string, size_t> out;
    for (const auto& [name, index] : points_) {
      if (!index) {
        ThrowStatus(absl::InvalidArgumentError("wait point \"" + name + "\" is not an item of the state"));
      }
      out.emplace(name, *index);
    }
    return out;
  }

  void Walk(PyObject* value) {
    if (PyDict_Check(value)) {
      if (!path_.empty()) Marker("dict");
      const size_t len = path_.size();
      auto child = [&](PyObject* k, PyObject* v) {
        AppendKey(k);
        Walk(v);
        path_.resize(len);
      };
      if (PyDict_CheckExact(value)) {
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        // Keep the dict alive and its entries referenced while walking.
        py::object hold = py::reinterpret_borrow<py::object>(value);
        while (PyDict_Next(value, &pos, &k, &v)) {
          py::object kk = py::reinterpret_borrow<py::object>(k), vv = py::reinterpret_borrow<py::object>(v);
          child(k, v);
        }
      } else {  // OrderedDict and other subclasses: their own order
        py::object items = py::reinterpret_borrow<py::object>(value).attr("items")();
        for (py::handle kv : items) {
          py::tuple t = py::reinterpret_borrow<py::tuple>(kv);
          child(t[0].ptr(), t[1].ptr());
        }
      }
      return;
    }
    if (path_.empty()) {
      ThrowStatus(absl::InvalidArgumentError(std::string("a state must be a dict, not ") + Py_TYPE(value)->tp_name));
    }
    if (PyList_Check(value) || PyTuple_Check(value)) {
      Marker(PyList_Check(value) ? "list" : "tuple");
      py::object hold = py::reinterpret_borrow<py::object>(value);
      const size_t len = path_.size();
      const Py_ssize_t n = PyList_Check(value) ? PyList_GET_SIZE(value) : PyTuple_GET_SIZE(value);
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* v = PyList_Check(value) ? PyList_GET_ITEM(value, i) : PyTuple_GET_ITEM(value, i);
        path_ += '/';
        path_ += std::to_string(i);
        py::object vv = py::reinterpret_borrow<py::object>(v);
        Walk(v);
        path_.resize(len);
      }
      return;
    }
    if (types_.TorchLoaded() && PyObject_TypeCheck(value, reinterpret_cast<PyTypeObject*>(types_.tensor_type))) {
      if (!Tensor(value)) Fallback(value);
      return;
    }
    if (PyObject_TypeCheck(value, reinterpret_cast<PyTypeObject*>(types_.ndarray.ptr()))) {
      if (!Array(value)) Fallback(value);
      return;
    }
    if (PyObject_TypeCheck(value, reinterpret_cast<PyTypeObject*>(types_.generic.ptr()))) {
      Fallback(value);  // numpy scalars (some are also Python floats/ints)
      return;
    }
    if (PyBytes_Check(value)) {
      Hold(value);
      Add(std::span(reinterpret_cast<const std::byte*>(PyBytes_AS_STRING(value)),
                    static_cast<size_t>(PyBytes_GET_SIZE(value))),
          "bytes");
      return;
    }
    if (PyByteArray_CheckExact(value)) {
      // Its buffer may move if the bytearray is resized: hold it through the
      // buffer protocol, which forbids that.
      views_.emplace_back(py::handle(value));
      Add(views_.back().bytes(), "bytearray");
      return;
    }
    if (value == Py_None) {
      Add({}, "none");
      return;
    }
    if (PyBool_Check(value)) {
      Add(Own(value == Py_True ? "1" : "0"), "bool");
      return;
    }
    if (PyLong_Check(value)) {
      Add(Own(py::str(py::handle(value)).cast<std::string>()), "int");
      return;
    }
    if (PyFloat_Check(value)) {
      Add(Own(py::repr(py::handle(value)).cast<std::string>()), "float");
      return;
    }
    if (PyUnicode_Check(value)) {
      Py_ssize_t n = 0;
      const char* utf8 = PyUnicode_AsUTF8AndSize(value, &n);
      CheckPy(utf8 != nullptr);
      Hold(value);  // utf8 lives in the str object
      Add(std::span(reinterpret_cast<const std::byte*>(utf8), static_cast<size_t>(n)), "str");
      return;
    }
    Fallback(value);
  }

 private:
  // Appends "/<segment>" (or "<segment>" at the root) for a dict key, as
  // _encode_key does.
  void AppendKey(PyObject* key) {
    if (!path_.empty()) path_ += '/';
    if (PyUnicode_Check(key)) {
      Py_ssize_t n = 0;
      const char* s = PyUnicode_AsUTF8AndSize(key, &n);
      CheckPy(s != nullptr);
      if (n == 0) ThrowStatus(absl::InvalidArgumentError("dict keys must not be empty strings"));
      for (Py_ssize_t i = 0; i < n; ++i) {
        const char c = s[i];
        if (c == '%') {
          path_ += "%25";
        } else if (c == '/') {
          path_ += "%2F";
        } else if (c == '#' && i == 0) {
          path_ += "%23";
        } else {
          path_ += c;
        }
      }
      return;
    }
    if (PyLong_Check(key) && !PyBool_Check(key)) {
      path_ += '#';
      path_ += py::str(py::handle(key)).cast<std::string>();
      return;
    }
    ThrowStatus(absl::InvalidArgumentError(std::string("dict keys must be str or int, not ") +
                                           Py_TYPE(key)->tp_name + ": " +
                                           py::repr(py::handle(key)).cast<std::string>()));
  }

  void Marker(const char* kind) { Add({}, kind); }

  void Add(std::span<const std::byte> bytes, const char* kind, DType dtype = DType::kBytes,
           std::vector<uint64_t> shape = {}) {
    std::map<std::string, std::string> attrs;
    attrs.emplace(kTypeKey, kind);
    Check(builder_->Add(path_, bytes, dtype, std::move(shape), std::move(attrs), ChangeOf(path_)));
    Added(path_);
  }

  // Records the index of `name` if it is a wait point.
  void Added(const std::string& name) {
    if (points_.empty()) return;
    auto it = points_.find(name);
    if (it != points_.end()) it->second = builder_->item_count() - 1;
  }

  // Bytes this walk owns (small scalar encodings), at stable addresses.
  std::span<const std::byte> Own(std::string s) {
    owned_.push_back(std::move(s));
    const std::string& o = owned_.back();
    return {reinterpret_cast<const std::byte*>(o.data()), o.size()};
  }
  void Hold(PyObject* obj) { keep_.push_back(py::reinterpret_borrow<py::object>(obj)); }

  // A CPU, strided, contiguous tensor of a known dtype without lazy
  // conjugation or negation: saved from its own memory. False otherwise.
  bool Tensor(PyObject* t) {
    py::handle h(t);
    if (h.attr(types_.is_cpu).ptr() != Py_True) return false;
    if (h.attr(types_.layout).ptr() != types_.strided.ptr()) return false;
    const TorchDType* dt = types_.FindTorchDType(h.attr(types_.dtype).ptr());
    if (dt == nullptr) return false;
    if (h.attr(types_.is_contiguous)().ptr() != Py_True) return false;
    if (h.attr(types_.is_neg)().ptr() != Py_False) return false;
    if (dt->complex && h.attr(types_.is_conj)().ptr() != Py_False) return false;
    py::object shape = h.attr(types_.shape);  // torch.Size, a tuple
    if (!PyTuple_Check(shape.ptr())) return false;
    const Py_ssize_t ndim = PyTuple_GET_SIZE(shape.ptr());
    std::vector<uint64_t> dims(static_cast<size_t>(ndim));
    uint64_t elements = 1;
    for (Py_ssize_t d = 0; d < ndim; ++d) {
      dims[static_cast<size_t>(d)] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(shape.ptr(), d));
      elements *= dims[static_cast<size_t>(d)];
    }
    CheckPy(!PyErr_Occurred());
    const uint64_t bytes = elements * dt->size;
    const auto* data = bytes == 0 ? nullptr
                                  : static_cast<const std::byte*>(PyLong_AsVoidPtr(h.attr(types_.data_ptr)().ptr()));
    CheckPy(!PyErr_Occurred());
    Hold(t);
    Add(std::span(data, bytes), "torch", dt->dtype, std::move(dims));
    return true;
  }

  // A C-contiguous numpy array of a known native dtype. False otherwise.
  bool Array(PyObject* a) {
    py::array arr = py::reinterpret_borrow<py::array>(a);
    if ((arr.flags() & py::array::c_style) == 0) return false;
    const int d = DTypeOfNumpy(arr.dtype());
    if (d == 0) return false;
    std::vector<uint64_t> dims(arr.shape(), arr.shape() + arr.ndim());
    const auto bytes = static_cast<size_t>(arr.nbytes());
    Hold(a);
    Add(std::span(static_cast<const std::byte*>(arr.data()), bytes), "numpy", static_cast<DType>(d), std::move(dims));
    return true;
  }

  // Any other leaf: ckpt._flatten (Python) turns it into items, or raises.
  void Fallback(PyObject* value) {
    if (!flatten_) flatten_ = py::module_::import("ckpt").attr("_flatten");
    py::list out;
    flatten_(path_, py::handle(value), out);
    for (py::handle item : out) {
      auto t = item.cast<py::tuple>();
      keep_.push_back(py::reinterpret_borrow<py::object>(item));  // holds the buffer's owner too
      views_.emplace_back(t[1]);
      std::string name = t[0].cast<std::string>();
      const ItemChange change = ChangeOf(name);
      Check(builder_->Add(name, views_.back().bytes(), static_cast<DType>(t[2].cast<int>()),
                          t[3].cast<std::vector<uint64_t>>(), t[4].cast<std::map<std::string, std::string>>(),
                          change));
      Added(name);
    }
  }

  ItemChange ChangeOf(const std::string& name) {
    if (!unchanged_.empty()) {
      if (auto it = unchanged_.find(name); it != unchanged_.end()) {
        it->second = true;
        return ItemChange::kUnchanged;
      }
    }
    return detect_ ? ItemChange::kDetect : ItemChange::kChanged;
  }

  SaveBuilder* builder_;
  std::map<std::string, bool> unchanged_;  // name -> seen in the walk
  bool detect_ = false;
  PyTypes& types_;
  std::string path_;
  // Wait points: item name -> its index (Add order) once added.
  std::map<std::string, std::optional<size_t>> points_;
  std::vector<py::object> keep_;
  std::deque<BufferView> views_;  // stable: items point into them
  std::deque<std::string> owned_;
  py::object flatten_;
};

// Rebuilds a state from a loaded shard (python/ckpt/__init__.py's _unflatten
// and _leaf, item for item): arrays and tensors are allocated here and filled
// by LoadedShard::CopyItem (crc-checked) with the GIL released.
// A fresh CPU tensor of `it`'s dtype and shape whose bytes the load then
// writes, made through DLPack (a stable C interface: no link to libtorch):
// one allocation and one torch call per tensor, against a numpy
// array and torch.from_numpy. The memory is freed when torch drops the
// tensor. None if the dtype has no DLPack form torch 1.13 takes back as
// the same dtype (bool, unsigned wider than 8 bits): numpy is used then.
namespace dlpack {
// The DLPack ABI (dlpack.h, v0.6, as torch 1.13 reads it).
struct Device {
  int32_t device_type;  // 1: CPU
  int32_t device_id;
};
struct DataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat, 5 complex
  uint8_t bits;
  uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor*);
};

// What a tensor made here owns.
struct Owned {
  ManagedTensor m{};
  std::vector<int64_t> shape, strides;
  void* data = nullptr;
};

void Delete(ManagedTensor* m) {
  Owned* o = static_cast<Owned*>(m->manager_ctx);
  std::free(o->data);
  delete o;
}

// A capsule torch did not take ("dltensor" still) owns its tensor.
void DeleteCapsule(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;  // taken: "used_dltensor"
  auto* m = static_cast<ManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (m != nullptr && m->deleter != nullptr) m->deleter(m);
}

std::optional<DataType> TypeOf(DType d) {
  switch (d) {
    case DType::kF32: return DataType{2, 32, 1};
    case DType::kF16: return DataType{2, 16, 1};
    case DType::kBF16: return DataType{4, 16, 1};
    case DType::kF64: return DataType{2, 64, 1};
    case DType::kI8: return DataType{0, 8, 1};
    case DType::kI16: return DataType{0, 16, 1};
    case DType::kI32: return DataType{0, 32, 1};
    case DType::kI64: return DataType{0, 64, 1};
    case DType::kU8: return DataType{1, 8, 1};
    case DType::kC64: return DataType{5, 64, 1};
    case DType::kC128: return DataType{5, 128, 1};
    default: return std::nullopt;
  }
}

// The tensor (and where its bytes go in *dst), or None.
py::object Empty(PyObject* from_dlpack, const LoadedItem& it, std::span<std::byte>* dst) {
  const std::optional<DataType> type = TypeOf(it.dtype);
  const uint32_t elem = DTypeSize(it.dtype);
  if (!type || elem == 0 || it.shape.size() > 64) return py::none();
  uint64_t count = 1;  // elements, for DLPack's int64 shape and strides
  for (uint64_t d : it.shape) {
    if (d > (uint64_t{1} << 62) || (d != 0 && count > (uint64_t{1} << 62) / d)) return py::none();
    count *= d;
  }
  // The one size rule (common/manifest.h), exact: count x elem may exceed
  // 2^64 even with count < 2^62, and a wrapped product must not pass for
  // the length (the tensor would be bigger than its buffer).
  if (absl::StatusOr<uint64_t> need = ItemByteLength(static_cast<int>(it.dtype), it.shape);
      !need.ok() || *need != it.length_bytes) {
    ThrowStatus(absl::DataLossError("item \"" + it.name + "\": its length does not match its dtype and shape"));
  }
  auto o = std::make_unique<Owned>();
  // malloc's alignment (16) is numpy's; memalign is several times slower.
  // No huge pages (numpy's madvise for large arrays): a trainer's first
  // restore, into fresh memory, took twice as long with them here
  // (bench/load_bench.py --fresh), the kernel zeroing each 2 MiB page in the
  // fault on one core where the 4 KiB faults spread over the copy threads.
  o->data = std::malloc(std::max<size_t>(it.length_bytes, 1));
  if (o->data == nullptr) throw std::bad_alloc();
  o->shape.assign(it.shape.begin(), it.shape.end());
  o->strides.resize(o->shape.size());
  int64_t stride = 1;
  for (size_t k = o->shape.size(); k-- > 0;) {
    o->strides[k] = stride;
    stride *= std::max<int64_t>(o->shape[k], 1);
  }
  o->m.dl_tensor = Tensor{o->data,     Device{1, 0}, static_cast<int32_t>(o->shape.size()), *type,
                          o->shape.data(), o->strides.data(), 0};
  o->m.manager_ctx = o.get();
  o->m.deleter = &Delete;
  PyObject* capsule = PyCapsule_New(&o->m, "dltensor", &DeleteCapsule);
  CheckPy(capsule != nullptr);
  std::byte* data = static_cast<std::byte*>(o->data);
  o.release();  // the capsule's (then torch's) to free
  PyObject* t = PyObject_CallOneArg(from_dlpack, capsule);
  Py_DECREF(capsule);  // frees the tensor if torch did not take it
  CheckPy(t != nullptr);
  *dst = std::span(data, it.length_bytes);
  return py::reinterpret_steal<py::object>(t);
}
}  // namespace dlpack

class Unflattener {
 public:
  explicit Unflattener(const std::vector<LoadedItem>& items) : items_(&items), types_(Types()) {}

  // The same items (equal in every field) held by another LoadedShard.
  void Rebind(const std::vector<LoadedItem>& items) { items_ = &items; }

  // Allocates each item's destination (GIL held).
  void Allocate() {
    dst_.resize(items_->size());
    leaf_.resize(items_->size());
    raw_.resize(items_->size());
    tensor_.assign(items_->size(), false);
    for (size_t i = 0; i < items_->size(); ++i) {
      const LoadedItem& it = (*items_)[i];
      const std::string* kind = Kind(it);
      if (kind != nullptr && (*kind == "dict" || *kind == "list" || *kind == "tuple")) continue;
      if (kind != nullptr && *kind == "torch" && types_.ImportTorch() && !types_.from_dlpack.is_none()) {
        py::object t = dlpack::Empty(types_.from_dlpack.ptr(), it, &dst_[i]);
        if (!t.is_none()) {
          leaf_[i] = std::move(t);
          tensor_[i] = true;
          continue;
        }
      }
      const bool array_like =
          kind != nullptr ? (*kind == "torch" || *kind == "numpy" || *kind == "numpy_scalar")
                          : it.dtype != DType::kBytes;
      py::object np_dtype = array_like ? NumpyDType(static_cast<int>(it.dtype)) : py::object(py::none());
      if (array_like && !np_dtype.is_none()) {
        std::vector<py::ssize_t> shape(it.shape.begin(), it.shape.end());
        py::array arr(py::reinterpret_borrow<py::dtype>(np_dtype), shape);
        if (static_cast<uint64_t>(arr.nbytes()) != it.length_bytes) {
          ThrowStatus(absl::DataLossError("item \"" + it.name + "\": its length does not match its dtype and shape"));
        }
        dst_[i] = std::span(static_cast<std::byte*>(arr.mutable_data()), it.length_bytes);
        leaf_[i] = std::move(arr);
      } else {
        raw_[i].resize(it.length_bytes);
        dst_[i] = std::span(reinterpret_cast<std::byte*>(raw_[i].data()), raw_[i].size());
      }
    }
  }

  // Copies every item, on every copy thread (GIL released by the caller).
  // The first error.
  absl::Status Copy(const LoadedShard& shard) const {
    std::vector<size_t> index;
    std::vector<std::span<std::byte>> dst;
    index.reserve(items_->size());
    dst.reserve(items_->size());
    for (size_t i = 0; i < items_->size(); ++i) {
      if (dst_[i].data() == nullptr && (*items_)[i].length_bytes != 0) continue;  // containers
      index.push_back(i);
      dst.push_back(dst_[i]);
    }
    return shard.CopyItems(index, dst);
  }

  // Builds the nested state (GIL held).
  py::dict Build() {
    py::dict root;
    nodes_.emplace(std::string_view(), Node{root, nullptr});
    // Items come in save order, containers before their elements, except in
    // an incremental version (own items, then references): an element whose
    // container comes later waits for it.
    std::vector<size_t> later;
    for (size_t i = 0; i < items_->size(); ++i) {
      if (!Place(i)) later.push_back(i);
    }
    while (!later.empty()) {
      std::vector<size_t> still;
      for (size_t i : later) {
        if (!Place(i)) still.push_back(i);
      }
      if (still.size() == later.size()) {
        ThrowStatus(absl::DataLossError("item '" + (*items_)[still.front()].name +
                                        "' has no parent container in the checkpoint"));
      }
      later = std::move(still);
    }
    // Innermost first (created after their parents): children are built
    // before the sequences that hold them.
    for (auto it = seqs_.rbegin(); it != seqs_.rend(); ++it) {
      Seq& s = **it;
      py::list values;
      for (size_t k = 0; k < s.entries.size(); ++k) {
        const Entry& e = s.entries[k];
        if (!e.set) {
          PyErr_SetObject(PyExc_KeyError, py::int_(k).ptr());
          throw py::error_already_set();
        }
        values.append(e.seq != nullptr ? e.seq->built : e.value);
      }
      s.built = s.tuple ? py::object(py::tuple(values)) : py::object(values);
      if (s.parent) CheckPy(PyDict_SetItem(s.parent.ptr(), s.key.ptr(), s.built.ptr()) == 0);
    }
    return root;
  }

  // Puts item i into its container; false if that container is not built yet.
  bool Place(size_t i) {
    const LoadedItem& it = (*items_)[i];
    const std::string_view name = it.name;
    const size_t slash = name.rfind('/');
    const std::string_view parent_path = slash == std::string_view::npos ? std::string_view() : name.substr(0, slash);
    const std::string_view seg = slash == std::string_view::npos ? name : name.substr(slash + 1);
    auto parent = nodes_.find(parent_path);
    if (parent == nodes_.end()) return false;
    const Node p = parent->second;  // a copy: the emplace below may rehash nodes_
    const std::string* kind = Kind(it);
    py::object value;
    Seq* seq = nullptr;
    if (kind != nullptr && (*kind == "dict" || *kind == "list" || *kind == "tuple")) {
      if (*kind == "dict") {
        value = py::dict();
      } else {
        seqs_.push_back(std::make_unique<Seq>());
        seq = seqs_.back().get();
        seq->tuple = *kind == "tuple";
      }
      nodes_.emplace(name, Node{value, seq});
    } else {
      value = Leaf(i, kind);
    }
    if (p.seq != nullptr) {
      PyObject* raw = PyLong_FromString(std::string(seg).c_str(), nullptr, 10);  // int(seg), as _unflatten
      CheckPy(raw != nullptr);
      const py::object index = py::reinterpret_steal<py::object>(raw);
      const long long at = PyLong_AsLongLong(raw);
      CheckPy(!(at == -1 && PyErr_Occurred()));
      // Each element is an item: an index past the item count cannot be.
      if (at < 0 || static_cast<size_t>(at) >= items_->size()) {
        ThrowStatus(absl::DataLossError("item '" + it.name + "': index out of range"));
      }
      if (p.seq->entries.size() <= static_cast<size_t>(at)) p.seq->entries.resize(static_cast<size_t>(at) + 1);
      p.seq->entries[static_cast<size_t>(at)] = Entry{value, seq, true};
    } else {
      const py::object key = DecodeKey(seg);
      if (seq != nullptr) {
        seq->parent = p.obj;
        seq->key = key;
      }
      CheckPy(PyDict_SetItem(p.obj.ptr(), key.ptr(), seq != nullptr ? Py_None : value.ptr()) == 0);
    }
    return true;
  }

 private:
  struct Seq;
  struct Entry {
    py::object value;
    Seq* seq = nullptr;  // a sequence: its built value once built
    bool set = false;
  };
  struct Seq {
    bool tuple = false;
    std::vector<Entry> entries;
    py::object parent, key;  // set when the parent is a dict
    py::object built;
  };
  struct Node {
    py::object obj;  // dict (or None for a sequence)
    Seq* seq;
  };

  static const std::string* Kind(const LoadedItem& it) {
    static const std::string key = kTypeKey;
    auto found = it.attributes.find(key);
    return found == it.attributes.end() ? nullptr : &found->second;
  }

  // _decode_key: "#<n>" is an int, anything else is unquoted ("%XX").
  static py::object DecodeKey(std::string_view seg) {
    if (!seg.empty() && seg[0] == '#') {
      PyObject* v = PyLong_FromString(std::string(seg.substr(1)).c_str(), nullptr, 10);
      CheckPy(v != nullptr);
      return py::reinterpret_steal<py::object>(v);
    }
    std::string bytes;
    bytes.reserve(seg.size());
    auto hex = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    for (size_t i = 0; i < seg.size(); ++i) {
      if (seg[i] == '%' && i + 2 < seg.size() && hex(seg[i + 1]) >= 0 && hex(seg[i + 2]) >= 0) {
        bytes += static_cast<char>(hex(seg[i + 1]) * 16 + hex(seg[i + 2]));
        i += 2;
      } else {
        bytes += seg[i];
      }
    }
    PyObject* s = PyUnicode_DecodeUTF8(bytes.data(), static_cast<Py_ssize_t>(bytes.size()), "replace");
    CheckPy(s != nullptr);
    return py::reinterpret_steal<py::object>(s);
  }

  // _leaf, with the item's bytes already in place.
  py::object Leaf(size_t i, const std::string* kind) {
    const LoadedItem& it = (*items_)[i];
    if (kind != nullptr && *kind == "torch") {
      if (!types_.ImportTorch()) {
        ThrowStatus(absl::FailedPreconditionError("this item was saved from torch, which is not installed"));
      }
      if (!leaf_[i]) return Fallback(i);
      if (tensor_[i]) return leaf_[i];  // made through DLPack
      if (it.dtype == DType::kBF16) {
        py::object t = types_.from_numpy(leaf_[i].attr(types_.view)(NumpyDType(6)));  // int16
        return t.attr(types_.view)(types_.bfloat16);
      }
      // (Straight through the C API: no argument tuple, one call per tensor.)
      PyObject* t = PyObject_CallOneArg(types_.from_numpy.ptr(), leaf_[i].ptr());
      CheckPy(t != nullptr);
      return py::reinterpret_steal<py::object>(t);
    }
    if (kind != nullptr && *kind == "numpy") {
      if (!leaf_[i]) return Fallback(i);
      return leaf_[i];
    }
    if (kind != nullptr && *kind == "numpy_scalar") {
      if (!leaf_[i]) return Fallback(i);
      return leaf_[i][py::tuple()];
    }
    const std::string& raw = raw_[i];
    if (kind == nullptr) {
      if (leaf_[i]) return leaf_[i];
      if (it.dtype == DType::kBytes) return py::bytes(raw);
      return Fallback(i);
    }
    if (*kind == "bytes") return py::bytes(raw);
    if (*kind == "bytearray") {
      return py::reinterpret_steal<py::object>(PyByteArray_FromStringAndSize(raw.data(), static_cast<Py_ssize_t>(raw.size())));
    }
    if (*kind == "none") return py::none();
    if (*kind == "bool") return py::bool_(raw == "1");
    if (*kind == "str") {
      PyObject* s = PyUnicode_DecodeUTF8(raw.data(), static_cast<Py_ssize_t>(raw.size()), nullptr);
      CheckPy(s != nullptr);
      return py::reinterpret_steal<py::object>(s);
    }
    return Fallback(i);  // int, float and anything else: as Python parses them
  }

  // ckpt._leaf(dtype, shape, attributes, data) with the bytes as a uint8 array.
  py::object Fallback(size_t i) {
    const LoadedItem& it = (*items_)[i];
    if (!leaf_fn_) leaf_fn_ = py::module_::import("ckpt").attr("_leaf");
    py::array_t<uint8_t> data(static_cast<py::ssize_t>(it.length_bytes));
    if (it.length_bytes > 0) std::memcpy(data.mutable_data(), dst_[i].data(), it.length_bytes);
    py::dict attrs;
    for (const auto& [k, v] : it.attributes) attrs[py::str(k)] = py::str(v);
    return leaf_fn_(static_cast<int>(it.dtype), py::cast(it.shape), attrs, data);
  }

  const std::vector<LoadedItem>* items_;
  PyTypes& types_;
  std::vector<std::span<std::byte>> dst_;
  std::vector<py::object> leaf_;  // arrays (or tensors: tensor_) allocated for array-like items
  std::vector<bool> tensor_;      // leaf_[i] is a torch tensor made through DLPack
  std::vector<std::string> raw_;  // bytes of the other items
  absl::flat_hash_map<std::string_view, Node> nodes_;
  std::vector<std::unique_ptr<Seq>> seqs_;
  py::object leaf_fn_;
};

class PySaveHandle {
 public:
  explicit PySaveHandle(SaveHandle handle) : handle_(std::move(handle)) {}
  uint64_t step() const { return handle_.step(); }
  uint64_t size_bytes() const { return handle_.size_bytes(); }
  uint32_t crc32c() const { return handle_.crc32c(); }
  void Wait(const std::string& level, std::optional<double> timeout_s) const {
    const Level l = ParseLevel(level);
    const absl::Time deadline = DeadlineFrom(timeout_s);
    CheckReleased([&] { return handle_.Wait(l, deadline); });
  }
  void Committed(std::optional<double> timeout_s) const {
    const absl::Time deadline = DeadlineFrom(timeout_s);
    CheckReleased([&] { return handle_.Committed(deadline); });
  }

 private:
  SaveHandle handle_;
};

// A lazy save (SaveBuilder::CommitLazy) and the Python objects its items
// point into: they stay referenced until the save has finished. Dropping it
// waits for that with the GIL released.
class PyLazySave {
 public:
  PyLazySave(LazySave lazy, std::unique_ptr<Flattener> keep, std::map<std::string, size_t> points)
      : lazy_(std::move(lazy)), keep_(std::move(keep)), points_(std::move(points)) {}
  PyLazySave(const PyLazySave&) = delete;
  PyLazySave& operator=(const PyLazySave&) = delete;
  ~PyLazySave() {
    {
      py::gil_scoped_release release;
      lazy_ = LazySave();  // the last handle: waits until the save finished
    }
    keep_.reset();  // the items' owners, with the GIL
  }
  uint64_t step() const { return lazy_.step(); }
  size_t item_count() const { return lazy_.item_count(); }
  size_t copied_items() const { return lazy_.copied_items(); }
  void WaitCopied(std::optional<double> timeout_s) {
    const absl::Time deadline = DeadlineFrom(timeout_s);
    CheckReleased([&] { return lazy_.WaitCopied(deadline); });
    // Copied: the save reads none of the items again. Their owners (the host
    // copies of GPU tensors among them) go now, with the GIL, not when the
    // client drops this save after the next one.
    keep_.reset();
  }
  // The wait points given to save_state_lazy, name -> item index.
  const std::map<std::string, size_t>& points() const { return points_; }
  // Blocks until the items up to the wait point `name` (Add order) are
  // copied: those may change then; the later ones are still being read.
  void WaitCopiedThrough(const std::string& name, std::optional<double> timeout_s) const {
    auto it = points_.find(name);
    if (it == points_.end()) {
      ThrowStatus(absl::InvalidArgumentError("\"" + name + "\" is not a wait point of this lazy save"));
    }
    const absl::Time deadline = DeadlineFrom(timeout_s);
    const size_t index = it->second;
    CheckReleased([&] { return lazy_.WaitItemCopied(index, deadline); });
  }
  PySaveHandle Result(std::optional<double> timeout_s) const {
    const absl::Time deadline = DeadlineFrom(timeout_s);
    absl::StatusOr<SaveHandle> h = absl::UnknownError("not committed");
    {
      py::gil_scoped_release release;
      h = lazy_.Wait(deadline);
    }
    if (!h.ok()) ThrowStatus(h.status());
    return PySaveHandle(std::move(*h));
  }

 private:
  LazySave lazy_;
  std::unique_ptr<Flattener> keep_;
  std::map<std::string, size_t> points_;
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
                                           const std::optional<std::string>& protection,
                                           uint32_t full_save_every, bool resize_world) {
    ClientOptions o;
    o.resize_world = resize_world;
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
    o.full_save_every = full_save_every;
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

  // Walks `state` (a dict) into items and saves them; see Flattener.
  // `unchanged`, `detect`, `partial`: incremental saves (ItemChange,
  // SaveBuilder::CarryRest).
  PySaveHandle SaveState(uint64_t step, const py::object& state, const std::vector<std::string>& unchanged,
                         bool detect, bool partial) {
    if (!PyDict_Check(state.ptr())) {
      ThrowStatus(absl::InvalidArgumentError(std::string("a state must be a dict, not ") +
                                             Py_TYPE(state.ptr())->tp_name));
    }
    SaveBuilder builder = client_.BeginSave(step);
    if (partial) builder.CarryRest();
    Flattener flat(&builder);
    flat.Changes(unchanged, detect);
    flat.Walk(state.ptr());
    flat.CheckUnchanged();
    absl::StatusOr<SaveHandle> handle = absl::UnknownError("not committed");
    {
      py::gil_scoped_release release;
      handle = builder.Commit();
    }
    if (!handle.ok()) ThrowStatus(handle.status());
    return PySaveHandle(std::move(*handle));
  }

  // As SaveState, in the background: returns once the state is walked.
  // `points`: item names whose copy can be waited for on their own
  // (PyLazySave::WaitCopiedThrough).
  std::unique_ptr<PyLazySave> SaveStateLazy(uint64_t step, const py::object& state,
                                            const std::vector<std::string>& points,
                                            const std::vector<std::string>& unchanged, bool detect, bool partial) {
    if (!PyDict_Check(state.ptr())) {
      ThrowStatus(absl::InvalidArgumentError(std::string("a state must be a dict, not ") +
                                             Py_TYPE(state.ptr())->tp_name));
    }
    SaveBuilder builder = client_.BeginSave(step);
    if (partial) builder.CarryRest();
    auto flat = std::make_unique<Flattener>(&builder);
    flat->WatchFor(points);
    flat->Changes(unchanged, detect);
    flat->Walk(state.ptr());
    flat->CheckUnchanged();
    std::map<std::string, size_t> found = flat->Points();
    absl::StatusOr<LazySave> lazy = builder.CommitLazy();
    if (!lazy.ok()) ThrowStatus(lazy.status());
    return std::make_unique<PyLazySave>(std::move(*lazy), std::move(flat), std::move(found));
  }

  // Opens the shard without the agent's pass over it and copies every item
  // into its destination with its crc checked (fill(shard) allocates the
  // destinations, GIL held; copy(shard) runs with the GIL released). On a
  // checksum mismatch, opens it again with the agent verifying (which
  // quarantines a corrupt local copy and uses the next source) and copies
  // once more. Returns the shard, closed (its items stay readable).
  template <typename Fill, typename Copy>
  LoadedShard LoadAndCopy(uint64_t step, Fill&& fill, Copy&& copy) const {
    std::string first_error;
    const std::vector<LoadedItem>* first_items = nullptr;
    std::optional<LoadedShard> first;
    for (int attempt = 0; attempt < 2; ++attempt) {
      absl::StatusOr<LoadedShard> shard = absl::UnknownError("not loaded");
      {
        py::gil_scoped_release release;
        shard = client_.Load(step, LoadOptions{.verify = attempt == 1});
      }
      if (!shard.ok()) {
        if (attempt == 0) ThrowStatus(shard.status());
        ThrowStatus(absl::Status(shard.status().code(), first_error + "; re-opening with verification failed: " +
                                                            std::string(shard.status().message())));
      }
      if (attempt == 0) {
        fill(*shard);
      } else if (!SameItems(*first_items, shard->items())) {
        // The destinations were made for the first manifest.
        ThrowStatus(absl::DataLossError(first_error + "; the verified copy's manifest differs from the first one's"));
      }
      absl::Status copied;
      {
        py::gil_scoped_release release;
        copied = copy(*shard);
        shard->CloseInBackground();  // the copies are done: no need to wait for the agent
      }
      if (copied.ok()) return *std::move(shard);
      if (attempt == 1 || copied.code() != absl::StatusCode::kDataLoss) ThrowStatus(copied);
      first_error = std::string(copied.message());
      first = *std::move(shard);  // the destinations point at its items' sizes
      first_items = &first->items();
    }
    ThrowStatus(absl::InternalError("unreachable"));
  }

  // (served_from, state): the state rebuilt from `step`; see Unflattener.
  py::tuple LoadState(uint64_t step) const {
    std::unique_ptr<Unflattener> un;
    LoadedShard shard = LoadAndCopy(
        step,
        [&](const LoadedShard& s) {
          un = std::make_unique<Unflattener>(s.items());
          un->Allocate();
        },
        [&](const LoadedShard& s) { return un->Copy(s); });
    // The destinations were laid out for the first manifest, which the
    // verified one (if it came to that) equals: its items serve the build.
    un->Rebind(shard.items());
    return py::make_tuple(ServedFromName(shard.served_from()), un->Build());
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
  double PauseProtection(double seconds) const {
    absl::StatusOr<absl::Duration> left = absl::UnknownError("not asked");
    {
      py::gil_scoped_release release;
      left = client_.PauseProtection(absl::Seconds(seconds));
    }
    if (!left.ok()) ThrowStatus(left.status());
    return absl::ToDoubleSeconds(*left);
  }

  py::dict RecommendedInterval(double step_time_s) const {
    absl::StatusOr<IntervalAdvice> a = absl::UnknownError("not asked");
    {
      py::gil_scoped_release release;
      a = client_.RecommendedInterval(absl::Seconds(step_time_s));
    }
    if (!a.ok()) ThrowStatus(a.status());
    py::dict d;
    d["steps"] = a->steps;
    d["interval_s"] = absl::ToDoubleSeconds(a->interval);
    d["checkpoint_cost_s"] = absl::ToDoubleSeconds(a->checkpoint_cost);
    d["mtbf_s"] = absl::ToDoubleSeconds(a->mtbf);
    d["mtbf_is_lower_bound"] = a->mtbf_is_lower_bound;
    d["failures_seen"] = a->failures_seen;
    d["observed_node_s"] = absl::ToDoubleSeconds(a->observed_node_time);
    d["job_nodes"] = a->job_nodes;
    d["explanation"] = a->explanation;
    return d;
  }

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
  // every item copied out of the agent's memory tier (crc-checked).
  py::tuple LoadItems(uint64_t step) const {
    std::vector<py::array_t<uint8_t>> arrays;
    std::vector<std::span<std::byte>> dst;
    LoadedShard shard = LoadAndCopy(
        step,
        [&](const LoadedShard& s) {
          for (const LoadedItem& item : s.items()) {
            arrays.push_back(NewByteArray(item.length_bytes));
            dst.emplace_back(reinterpret_cast<std::byte*>(arrays.back().mutable_data()), item.length_bytes);
          }
        },
        [&](const LoadedShard& s) -> absl::Status {
          std::vector<size_t> index(dst.size());
          for (size_t i = 0; i < index.size(); ++i) index[i] = i;
          return s.CopyItems(index, dst);
        });
    py::list out;
    const std::vector<LoadedItem>& items = shard.items();
    for (size_t i = 0; i < items.size(); ++i) {
      const LoadedItem& item = items[i];
      out.append(ItemTuple(item.name, static_cast<int>(item.dtype), item.shape, item.attributes,
                           std::move(arrays[i])));
    }
    return py::make_tuple(ServedFromName(shard.served_from()), out);
  }

  // load_into: copies the named items of `step` into the targets (dict name
  // -> tensor or array) in place. CPU, contiguous tensors and C-contiguous
  // writable arrays are resolved here; other targets go to
  // ckpt._load_into_buffer (which raises for what cannot be loaded into).
  void LoadIntoTargets(uint64_t step, const py::dict& targets) const {
    // The targets are read (with the GIL) while the client opens the shard
    // (without it): LoadIntoWhileOpening.
    PyTypes& types = Types();
    std::vector<WritableView> views;
    views.reserve(targets.size());
    std::vector<py::object> keep;
    keep.reserve(targets.size());
    std::map<std::string, std::span<std::byte>> spans;
    py::object fallback;
    // (Attributes through the C API: a thousand tensors cost a few of these
    // each, and pybind11's accessors double that.)
    auto attr = [](PyObject* o, const py::str& name) {
      PyObject* v = PyObject_GetAttr(o, name.ptr());
      CheckPy(v != nullptr);
      return py::reinterpret_steal<py::object>(v);
    };
    auto call = [&attr](PyObject* o, const py::str& name) {
      py::object f = attr(o, name);
      PyObject* v = PyObject_CallNoArgs(f.ptr());
      CheckPy(v != nullptr);
      return py::reinterpret_steal<py::object>(v);
    };
    std::exception_ptr failed;  // a Python error while reading the targets
    auto resolve = [&]() -> absl::StatusOr<Client::Buffers> {
      py::gil_scoped_acquire acquire;
      try {
        for (const auto& [name, target] : targets) {
          std::span<std::byte> span;
          bool done = false;
          PyObject* t = target.ptr();
          if (types.TorchLoaded() && PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(types.tensor_type))) {
            const TorchDType* dt = nullptr;
            if (attr(t, types.is_cpu).ptr() == Py_True && attr(t, types.layout).ptr() == types.strided.ptr() &&
                (dt = types.FindTorchDType(attr(t, types.dtype).ptr())) != nullptr &&
                call(t, types.is_contiguous).ptr() == Py_True) {
              uint64_t elements = 1;
              py::object shape = attr(t, types.shape);
              CheckPy(PyTuple_Check(shape.ptr()));
              for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(shape.ptr()); ++k) {
                const unsigned long long d = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(shape.ptr(), k));
                CheckPy(!PyErr_Occurred());
                elements *= d;
              }
              auto* data = static_cast<std::byte*>(PyLong_AsVoidPtr(call(t, types.data_ptr).ptr()));
              CheckPy(!PyErr_Occurred());
              span = std::span(data, elements * dt->size);
              keep.push_back(py::reinterpret_borrow<py::object>(target));
              done = true;
            }
          } else if (PyObject_TypeCheck(target.ptr(), reinterpret_cast<PyTypeObject*>(types.ndarray.ptr()))) {
            py::array arr = py::reinterpret_borrow<py::array>(target);
            if ((arr.flags() & py::array::c_style) != 0 && arr.writeable()) {
              views.emplace_back(target);
              span = views.back().bytes();
              done = true;
            }
          }
          if (!done) {
            if (!fallback) fallback = py::module_::import("ckpt").attr("_load_into_buffer");
            views.emplace_back(fallback(name, target));
            span = views.back().bytes();
          }
          Py_ssize_t n = 0;
          const char* utf8 = PyUnicode_Check(name.ptr()) ? PyUnicode_AsUTF8AndSize(name.ptr(), &n) : nullptr;
          if (utf8 == nullptr) {
            PyErr_Clear();
            ThrowStatus(absl::InvalidArgumentError("load_into: target names must be str"));
          }
          spans.emplace_hint(spans.end(), std::string(utf8, static_cast<size_t>(n)), span);
        }
      } catch (...) {
        failed = std::current_exception();
        return absl::CancelledError("reading the targets failed");
      }
      return std::move(spans);
    };
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = client_.LoadIntoWhileOpening(step, resolve);
    }
    if (failed) std::rethrow_exception(failed);
    Check(status);
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

  // {name: (dtype, shape, [(rank, item, offsets, lengths)])}: the global
  // tensors of `step` (Client::GlobalTensors).
  py::dict GlobalTensors(uint64_t step) const {
    absl::StatusOr<std::map<std::string, GlobalTensor>> tensors = absl::UnknownError("not read");
    {
      py::gil_scoped_release release;
      tensors = client_.GlobalTensors(step);
    }
    Check(tensors.status());
    py::dict out;
    for (const auto& [name, t] : *tensors) {
      py::list pieces;
      for (const GlobalPiece& p : t.pieces) pieces.append(py::make_tuple(p.rank, p.item, p.offsets, p.lengths));
      out[py::str(name)] = py::make_tuple(static_cast<int>(t.dtype), t.shape, pieces);
    }
    return out;
  }

  // slices: sequence of (name, offsets, lengths, writable C-contiguous
  // buffer) (Client::LoadSlices).
  void LoadSlices(uint64_t step, const py::sequence& slices) const {
    std::vector<WritableView> views;
    views.reserve(py::len(slices));
    std::vector<SliceRequest> requests;
    requests.reserve(py::len(slices));
    for (const py::handle& slice : slices) {
      auto t = slice.cast<py::tuple>();
      if (t.size() != 4) ThrowStatus(absl::InvalidArgumentError("a slice is (name, offsets, lengths, buffer)"));
      views.emplace_back(py::reinterpret_borrow<py::object>(t[3]));
      requests.push_back(SliceRequest{t[0].cast<std::string>(), t[1].cast<std::vector<uint64_t>>(),
                                      t[2].cast<std::vector<uint64_t>>(), views.back().bytes()});
    }
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = client_.LoadSlices(step, requests);
    }
    Check(status);
  }

  // {name: step} of this rank's items of `step`: the version each item's
  // bytes were copied at (older than `step` for what an incremental save
  // carried over).
  py::dict ItemSteps(uint64_t step) const {
    absl::StatusOr<LoadedShard> shard = absl::UnknownError("not loaded");
    {
      py::gil_scoped_release release;
      shard = client_.Load(step, LoadOptions{.verify = false});
      if (shard.ok()) shard->CloseInBackground();
    }
    if (!shard.ok()) ThrowStatus(shard.status());
    py::dict out;
    for (const LoadedItem& item : shard->items()) out[py::str(item.name)] = py::int_(item.step);
    return out;
  }

 private:
  static bool SameItems(const std::vector<LoadedItem>& a, const std::vector<LoadedItem>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i].name != b[i].name || a[i].dtype != b[i].dtype || a[i].shape != b[i].shape ||
          a[i].offset_bytes != b[i].offset_bytes || a[i].length_bytes != b[i].length_bytes ||
          a[i].crc32c != b[i].crc32c || a[i].attributes != b[i].attributes) {
        return false;
      }
    }
    return true;
  }

  Client client_;
};

// The global tensors of a committed durable version, as
// Client.global_tensors gives them: (step, {name: (dtype, shape, [(rank,
// item, offsets, lengths)])}).
py::tuple DurableGlobalTensorsOf(const std::string& version_dir) {
  absl::StatusOr<DurableManifest> manifest = absl::UnknownError("not read");
  {
    py::gil_scoped_release release;
    manifest = ReadDurableManifest(PosixFileSystem(), version_dir);
  }
  Check(manifest.status());
  absl::StatusOr<std::map<std::string, DurableGlobalTensor>> tensors = DurableGlobalTensors(*manifest);
  Check(tensors.status());
  py::dict out;
  for (const auto& [name, t] : *tensors) {
    py::list pieces;
    for (const DurablePiece& p : t.pieces) {
      pieces.append(py::make_tuple(p.rank, manifest->shards[p.rank].items[p.item].name, p.box.offsets, p.box.lengths));
    }
    out[py::str(name)] = py::make_tuple(t.dtype, t.shape, pieces);
  }
  return py::make_tuple(manifest->step, out);
}

// Reads slices of global tensors of a committed durable version into
// writable buffers (ReadDurableSlices); returns the bytes read.
uint64_t ReadDurableSlicesInto(const std::string& version_dir, const py::sequence& slices) {
  std::vector<WritableView> views;
  views.reserve(py::len(slices));
  std::vector<DurableSliceRequest> requests;
  for (const py::handle& slice : slices) {
    auto t = slice.cast<py::tuple>();
    if (t.size() != 4) ThrowStatus(absl::InvalidArgumentError("a slice is (name, offsets, lengths, buffer)"));
    views.emplace_back(py::reinterpret_borrow<py::object>(t[3]));
    requests.push_back(DurableSliceRequest{
        t[0].cast<std::string>(), Box{t[1].cast<std::vector<uint64_t>>(), t[2].cast<std::vector<uint64_t>>()},
        views.back().bytes()});
  }
  absl::StatusOr<uint64_t> read = absl::UnknownError("not read");
  {
    py::gil_scoped_release release;
    absl::StatusOr<DurableManifest> manifest = ReadDurableManifest(PosixFileSystem(), version_dir);
    read = manifest.ok() ? ReadDurableSlices(PosixFileSystem(), version_dir, *manifest, requests)
                         : absl::StatusOr<uint64_t>(manifest.status());
  }
  Check(read.status());
  return *read;
}

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
  for (const DurableShard& listed : manifest->shards) {
    DurableShard shard = listed;
    py::array_t<uint8_t> file;
    if (RefSteps(listed.items).empty()) {
      file = NewByteArray(shard.size_bytes);
      std::span<std::byte> out(reinterpret_cast<std::byte*>(file.mutable_data()), shard.size_bytes);
      absl::Status read;
      {
        py::gil_scoped_release release;
        read = ReadRankFile(PosixFileSystem(), version_dir, shard, out);
      }
      Check(read);
    } else {
      // An incremental version (format 2): its references are read from the
      // versions they name, into one self-contained shard.
      std::vector<std::byte> bytes;
      absl::StatusOr<DurableShard> dense = absl::UnknownError("not read");
      {
        py::gil_scoped_release release;
        dense = MaterializeDurableShard(PosixFileSystem(), version_dir, *manifest, listed, &bytes);
      }
      if (!dense.ok()) ThrowStatus(dense.status());
      shard = *std::move(dense);
      // Containers before their elements (own items came first, then references).
      std::stable_sort(shard.items.begin(), shard.items.end(), [](const ManifestItem& a, const ManifestItem& b) {
        return std::count(a.name.begin(), a.name.end(), '/') < std::count(b.name.begin(), b.name.end(), '/');
      });
      file = NewByteArray(bytes.size());
      std::memcpy(file.mutable_data(), bytes.data(), bytes.size());
    }
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
  Types().InitCommon();
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
      .def("wait", &PySaveHandle::Wait, py::arg("level") = "protected", py::arg("timeout") = py::none())
      .def("committed", &PySaveHandle::Committed, py::arg("timeout") = py::none());

  py::class_<PyLazySave>(m, "LazySave")
      .def_property_readonly("step", &PyLazySave::step)
      .def_property_readonly("item_count", &PyLazySave::item_count)
      .def_property_readonly("copied_items", &PyLazySave::copied_items)
      .def("wait_copied", &PyLazySave::WaitCopied, py::arg("timeout") = py::none())
      .def_property_readonly("points", &PyLazySave::points)
      .def("wait_copied_through", &PyLazySave::WaitCopiedThrough, py::arg("name"), py::arg("timeout") = py::none())
      .def("result", &PyLazySave::Result, py::arg("timeout") = py::none());
  py::class_<PyClient>(m, "Client")
      .def_static("connect", &PyClient::Connect, py::arg("job"), py::arg("rank"), py::arg("world_size"),
                  py::arg("meta"), py::arg("agent_socket"), py::arg("flush_every") = 0,
                  py::arg("flush_every_seconds") = 0, py::arg("keep_in_memory") = 0,
                  py::arg("keep_durable") = 0, py::arg("run_id") = "", py::arg("connect_timeout") = 30.0,
                  py::arg("rpc_timeout") = 60.0, py::arg("load_timeout") = 600.0,
                  py::arg("protection") = py::none(), py::arg("full_save_every") = 10,
                  py::arg("resize_world") = false)
      .def("save_items", &PyClient::SaveItems, py::arg("step"), py::arg("items"))
      .def("save_state", &PyClient::SaveState, py::arg("step"), py::arg("state"),
           py::arg("unchanged") = std::vector<std::string>(), py::arg("detect") = false, py::arg("partial") = false)
      .def("save_state_lazy", &PyClient::SaveStateLazy, py::arg("step"), py::arg("state"),
           py::arg("points") = std::vector<std::string>(), py::arg("unchanged") = std::vector<std::string>(),
           py::arg("detect") = false, py::arg("partial") = false)
      .def("item_steps", &PyClient::ItemSteps, py::arg("step"))
      .def("load_state", &PyClient::LoadState, py::arg("step"))
      .def("wait", &PyClient::WaitVersion, py::arg("step"), py::arg("level") = "protected",
           py::arg("timeout") = py::none())
      .def("latest", &PyClient::Latest, py::arg("level") = "protected")
      .def("recommended_interval", &PyClient::RecommendedInterval, py::arg("step_time"))
      .def("pause_protection", &PyClient::PauseProtection, py::arg("seconds"))
      .def("load_items", &PyClient::LoadItems, py::arg("step"))
      .def("load_into", &PyClient::LoadInto, py::arg("step"), py::arg("buffers"))
      .def("load_into_targets", &PyClient::LoadIntoTargets, py::arg("step"), py::arg("targets"))
      .def("global_tensors", &PyClient::GlobalTensors, py::arg("step"))
      .def("load_slices", &PyClient::LoadSlices, py::arg("step"), py::arg("slices"))
      .def_property_readonly("node_id", &PyClient::node_id);

  m.def("read_durable", &ReadDurable, py::arg("version_dir"));
  m.def("durable_global_tensors", &DurableGlobalTensorsOf, py::arg("version_dir"));
  m.def("read_durable_slices", &ReadDurableSlicesInto, py::arg("version_dir"), py::arg("slices"));
  // Young's interval for given numbers (ckpt::YoungDalyInterval): what
  // recommended_interval computes from the measured cost and meta's MTBF.
  m.def(
      "young_daly_interval",
      [](double checkpoint_cost_s, double mtbf_s, double step_time_s) {
        if (!(step_time_s > 0) || !(checkpoint_cost_s >= 0) || !(mtbf_s >= 0)) {
          throw py::value_error("young_daly_interval: step_time must be positive, cost and MTBF not negative");
        }
        const ckpt::IntervalAdvice a = ckpt::YoungDalyInterval(absl::Seconds(checkpoint_cost_s), absl::Seconds(mtbf_s),
                                                               absl::Seconds(step_time_s));
        py::dict d;
        d["steps"] = a.steps;
        d["interval_s"] = absl::ToDoubleSeconds(a.interval);
        return d;
      },
      py::arg("checkpoint_cost_s"), py::arg("mtbf_s"), py::arg("step_time_s"));
}
