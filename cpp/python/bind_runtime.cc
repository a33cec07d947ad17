// Bindings of the runtime (baton._core.runtime): executor, transports, stores.
// Thin: conversion only. Values are Python objects (e.g. lists of jax.Arrays);
// byte transports see them as lists of arrays crossing as DLPack views.
#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <optional>

#include "baton/comm.h"
#include "baton/nccl_comm.h"
#include "baton/nccl_library.h"
#include "baton/plan.h"
#include "baton/runtime.h"
#include "baton/transfer_bench.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace rt = baton::runtime;

namespace {

using std::chrono::milliseconds;
milliseconds ms(double seconds) { return milliseconds(static_cast<int64_t>(seconds * 1000.0)); }

void translate_execution_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const rt::ExecutionError& e) {
    PyObject* errors = PyImport_ImportModule("baton.errors");
    PyObject* cls = errors ? PyObject_GetAttrString(errors, "ExecutionError") : nullptr;
    Py_XDECREF(errors);
    if (cls == nullptr) {
      PyErr_Clear();
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return;
    }
    PyObject* exc = PyObject_CallFunction(cls, "s", e.what());
    if (exc != nullptr) {
      PyObject* r = PyLong_FromLong(e.failed_rank);
      PyObject_SetAttrString(exc, "failed_rank", r);
      Py_XDECREF(r);
      PyErr_SetObject(cls, exc);
      Py_DECREF(exc);
    }
    Py_DECREF(cls);
  }
}

// A Python object as a runtime value. Releases its reference under the GIL.
struct PyValue : rt::ValueBase {
  explicit PyValue(nb::object o) : obj(std::move(o)) {
    // One attribute read per object (hasattr + attr evaluated jax's nbytes property twice).
    // A value that carries its own total (the frontend's sized buffer lists, an array) is
    // read once; a plain list or tuple is the sum of its items.
    auto bytes_of = [](nb::handle h) -> std::optional<size_t> {
      if (h.is_none()) return 0;
      try {
        nb::object n = nb::getattr(h, "nbytes", nb::none());
        if (!n.is_none()) return nb::cast<size_t>(n);
      } catch (...) {
        return 0;
      }
      return std::nullopt;
    };
    if (auto n = bytes_of(obj)) {
      bytes = *n;
    } else if (nb::isinstance<nb::list>(obj) || nb::isinstance<nb::tuple>(obj)) {
      for (nb::handle h : obj) bytes += bytes_of(h).value_or(0);
    }
  }
  ~PyValue() override {
    nb::gil_scoped_acquire gil;
    obj.reset();
  }
  size_t nbytes() const override { return bytes; }
  nb::object obj;
  size_t bytes = 0;
};

rt::Value wrap(nb::object o) { return std::make_shared<PyValue>(std::move(o)); }
nb::object unwrap(const rt::Value& v) {
  if (auto* p = dynamic_cast<PyValue*>(v.get())) return p->obj;
  throw rt::ExecutionError("internal: a value that is not a Python object reached Python");
}

// str(h) as a C++ string.
std::string pystr(nb::handle h) {
  PyObject* s = PyObject_Str(h.ptr());
  if (s == nullptr) {
    PyErr_Clear();
    return "?";
  }
  nb::str str = nb::steal<nb::str>(s);
  return str.c_str();
}

using AnyArray = nb::ndarray<nb::ro, nb::c_contig>;

rt::DType dtype_of(nb::dlpack::dtype d, const std::string& where) {
  using C = nb::dlpack::dtype_code;
  const auto code = static_cast<C>(d.code);
  if (d.lanes == 1) {
    if (code == C::Float && d.bits == 32) return rt::DType::F32;
    if (code == C::Float && d.bits == 64) return rt::DType::F64;
    if (code == C::Float && d.bits == 16) return rt::DType::F16;
    if (code == C::Bfloat && d.bits == 16) return rt::DType::BF16;
    if (code == C::Int && d.bits == 8) return rt::DType::I8;
    if (code == C::Int && d.bits == 16) return rt::DType::I16;
    if (code == C::Int && d.bits == 32) return rt::DType::I32;
    if (code == C::Int && d.bits == 64) return rt::DType::I64;
    if (code == C::UInt && d.bits == 8) return rt::DType::U8;
    if (code == C::UInt && d.bits == 16) return rt::DType::U16;
    if (code == C::UInt && d.bits == 32) return rt::DType::U32;
    if (code == C::UInt && d.bits == 64) return rt::DType::U64;
    if (code == C::Bool && d.bits == 8) return rt::DType::Bool;
  }
  throw rt::ExecutionError(fmt::format(
      "{}: unsupported dtype (DLPack code {}, {} bits, {} lanes); supported: float32, float64, "
      "float16, bfloat16, int8/16/32/64, uint8/16/32/64, bool",
      where, static_cast<int>(d.code), static_cast<int>(d.bits), static_cast<int>(d.lanes)));
}

// One array (anything speaking DLPack or the buffer protocol) as a Tensor that
// references the array's memory (no copy when it is C-contiguous). Host
// arrays give device -1, CUDA arrays their device ordinal (NCCL transport).
rt::Tensor to_tensor(nb::handle obj, const std::string& where) {
  AnyArray arr;
  std::optional<rt::DType> forced;
  nb::object src = nb::borrow(obj);
  std::string name;
  if (nb::hasattr(obj, "dtype")) name = pystr(obj.attr("dtype"));
  nb::module_ np = nb::module_::import_("numpy");
  if (name == "bfloat16" && nb::isinstance(obj, np.attr("ndarray"))) {
    // numpy has no DLPack code for ml_dtypes' bfloat16: send the bits.
    src = np.attr("ascontiguousarray")(obj).attr("view")(np.attr("uint16"));
    forced = rt::DType::BF16;
  }
  bool ok = false;
  try {
    ok = nb::try_cast(src, arr, true);
  } catch (const std::exception&) {
    ok = false;
  }
  if (!ok)
    throw rt::ExecutionError(fmt::format(
        "{}: cannot transfer an object of type {} with dtype '{}' (need an array with a "
        "supported dtype: float32, float64, float16, bfloat16, int8/16/32/64, uint8/16/32/64, "
        "bool)",
        where, pystr(obj.type().attr("__name__")), name.empty() ? "?" : name));
  rt::Tensor t;
  t.dtype = forced ? *forced : dtype_of(arr.dtype(), where);
  if (arr.device_type() == nb::device::cuda::value)
    t.device = static_cast<int>(arr.device_id());
  else if (arr.device_type() != nb::device::cpu::value)
    throw rt::ExecutionError(fmt::format("{}: arrays on DLPack device type {} cannot be sent",
                                         where, arr.device_type()));
  for (size_t i = 0; i < arr.ndim(); ++i) t.shape.push_back(static_cast<int64_t>(arr.shape(i)));
  t.nbytes = arr.nbytes();
  t.data = const_cast<void*>(arr.data());
  auto* keep = new AnyArray(std::move(arr));
  t.owner = std::shared_ptr<void>(keep, [](void* p) {
    nb::gil_scoped_acquire gil;
    delete static_cast<AnyArray*>(p);
  });
  return t;
}

nb::object to_numpy(const rt::Tensor& t) {
  using C = nb::dlpack::dtype_code;
  nb::dlpack::dtype d{};
  d.lanes = 1;
  d.bits = static_cast<uint8_t>(rt::dtype_size(t.dtype) * 8);
  switch (t.dtype) {
    case rt::DType::F32:
    case rt::DType::F64:
    case rt::DType::F16:
      d.code = static_cast<uint8_t>(C::Float);
      break;
    case rt::DType::I8:
    case rt::DType::I16:
    case rt::DType::I32:
    case rt::DType::I64:
      d.code = static_cast<uint8_t>(C::Int);
      break;
    case rt::DType::Bool:
      d.code = static_cast<uint8_t>(C::Bool);
      break;
    default:  // unsigned and bfloat16 (as uint16 bits, viewed below)
      d.code = static_cast<uint8_t>(C::UInt);
  }
  std::vector<size_t> shape;
  for (int64_t s : t.shape) shape.push_back(static_cast<size_t>(s));
  auto* keep = new std::shared_ptr<void>(t.owner);
  nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<std::shared_ptr<void>*>(p); });
  if (t.device >= 0) {  // CUDA memory (NCCL transport): hand it to JAX
    if (t.dtype == rt::DType::BF16) d.code = static_cast<uint8_t>(C::Bfloat);
    nb::ndarray<nb::jax> arr(t.data, shape.size(), shape.data(), owner, nullptr, d,
                             nb::device::cuda::value, t.device);
    return nb::cast(arr, nb::rv_policy::reference);
  }
  nb::ndarray<nb::numpy> arr(t.data, shape.size(), shape.data(), owner, nullptr, d);
  nb::object out = nb::cast(arr, nb::rv_policy::reference);
  if (t.dtype == rt::DType::BF16)
    out = out.attr("view")(nb::module_::import_("ml_dtypes").attr("bfloat16"));
  return out;
}

// A layout from Python: a list whose items are (dtype, shape) pairs or objects
// with .dtype and .shape (arrays, jax.ShapeDtypeStruct).
rt::Layout to_layout(nb::handle obj) {
  rt::Layout out;
  if (obj.is_none()) return out;
  for (nb::handle item : obj) {
    nb::object dt, shape;
    if (nb::hasattr(item, "dtype") && nb::hasattr(item, "shape")) {
      dt = item.attr("dtype");
      shape = item.attr("shape");
    } else {
      dt = item[0];
      shape = item[1];
    }
    nb::object np_dtype = nb::module_::import_("numpy").attr("dtype")(dt);
    rt::TensorSpec spec;
    spec.dtype = rt::dtype_from_name(pystr(np_dtype));
    for (nb::handle d : shape) spec.shape.push_back(nb::cast<int64_t>(d));
    out.push_back(std::move(spec));
  }
  return out;
}

// A Python exception raised by a callback, as "Type: message" (the traceback
// stays out of the runtime's error messages).
[[noreturn]] void rethrow_python(nb::python_error& e, const char* what) {
  std::string type = pystr(e.type().attr("__name__"));
  std::string msg = pystr(e.value());
  e.restore();
  PyErr_Clear();
  throw rt::ExecutionError(fmt::format("{} raised {}: {}", what, type, msg));
}

// Tasks backed by Python callables. Every callback runs with the GIL held.
class PyTasks : public rt::Tasks {
 public:
  PyTasks(nb::object run, nb::object accumulate, nb::object received, nb::object to_host,
          nb::object from_host, nb::object recv_layout)
      : run_(std::move(run)),
        acc_(std::move(accumulate)),
        recv_(std::move(received)),
        to_host_(std::move(to_host)),
        from_host_(std::move(from_host)),
        layout_(std::move(recv_layout)) {}
  ~PyTasks() override {
    nb::gil_scoped_acquire gil;
    run_.reset();
    acc_.reset();
    recv_.reset();
    to_host_.reset();
    from_host_.reset();
    layout_.reset();
  }
  rt::Layout recv_layout(int rank, int32_t buffer) override {
    nb::gil_scoped_acquire gil;
    if (!layout_.is_valid() || layout_.is_none()) return {};
    try {
      return to_layout(layout_(rank, buffer));
    } catch (nb::python_error& e) {
      rethrow_python(e, "recv_layout");
    }
  }

  std::vector<rt::Value> run(const rt::TaskCall& c) override {
    nb::gil_scoped_acquire gil;
    if (!run_.is_valid() || run_.is_none()) throw rt::ExecutionError("no run callback was given");
    nb::list ins, ids, out_ids;
    for (size_t i = 0; i < c.inputs.size(); ++i) {
      ins.append(unwrap(c.inputs[i]));
      ids.append((*c.input_ids)[i]);
    }
    for (int32_t b : *c.output_ids) out_ids.append(b);
    std::vector<rt::Value> res;
    try {
      nb::object outs = run_(c.rank, c.action, ids, ins, out_ids);
      for (nb::handle h : outs) res.push_back(wrap(nb::borrow(h)));
    } catch (nb::python_error& e) {
      rethrow_python(e, "the task");
    }
    return res;
  }
  void accumulate(int rank, int32_t buffer, const rt::Value& v) override {
    nb::gil_scoped_acquire gil;
    if (!acc_.is_valid() || acc_.is_none())
      throw rt::ExecutionError("no accumulate callback was given");
    try {
      acc_(rank, buffer, unwrap(v));
    } catch (nb::python_error& e) {
      rethrow_python(e, "accumulate");
    }
  }
  rt::Value received(int rank, int32_t buffer, rt::Value v) override {
    if (!recv_.is_valid()) return v;
    nb::gil_scoped_acquire gil;
    if (recv_.is_none()) return v;
    try {
      return wrap(recv_(rank, buffer, unwrap(v)));
    } catch (nb::python_error& e) {
      rethrow_python(e, "the received callback");
    }
  }
  rt::Payload to_payload(const rt::Value& v) override {
    nb::gil_scoped_acquire gil;
    nb::object obj = unwrap(v);
    try {
      if (to_host_.is_valid() && !to_host_.is_none()) obj = to_host_(obj);
    } catch (nb::python_error& e) {
      rethrow_python(e, "to_host");
    }
    rt::Payload p;
    if (nb::isinstance<nb::list>(obj) || nb::isinstance<nb::tuple>(obj)) {
      size_t i = 0;
      for (nb::handle h : obj)
        p.push_back(to_tensor(h, fmt::format("array {} of a transfer", i++)));
    } else {
      p.push_back(to_tensor(obj, "transfer"));
    }
    return p;
  }
  rt::Value from_payload(rt::Payload p) override {
    nb::gil_scoped_acquire gil;
    nb::list arrays;
    for (const rt::Tensor& t : p) arrays.append(to_numpy(t));
    nb::object obj = arrays;
    try {
      if (from_host_.is_valid() && !from_host_.is_none()) obj = from_host_(arrays);
    } catch (nb::python_error& e) {
      rethrow_python(e, "from_host");
    }
    return wrap(obj);
  }

 private:
  nb::object run_, acc_, recv_, to_host_, from_host_, layout_;
};

struct PyStore {
  std::shared_ptr<rt::Store> store;
};

// Owns a transport; closing releases the GIL because transport threads may
// need it to finish.
struct PyTransport {
  // Shared with the executors built on it: a transport closed while an
  // executor still exists goes away with the last executor.
  std::shared_ptr<rt::Transport> t;
  PyTasks codec{nb::none(), nb::none(), nb::none(), nb::none(), nb::none(), nb::none()};
  rt::Transport& get() {
    if (!t) throw baton::ConfigError("the transport is closed");
    return *t;
  }
  void close() {
    nb::gil_scoped_release nogil;
    t.reset();
  }
  ~PyTransport() {
    if (t) close();
  }
};

void wait_request(const rt::RequestPtr& r, double timeout, rt::Transport& t) {
  {
    nb::gil_scoped_release nogil;
    if (!r->wait_until(rt::Clock::now() + ms(timeout))) {
      const rt::TimeoutBlame b = rt::blame_silence(&t, r->peer, -1);
      const std::string msg = fmt::format(
          "rank {}: timed out after {:g} s waiting to {} {} {} rank {}{}", t.rank(), timeout,
          r->is_send ? "send" : "receive", r->what, r->is_send ? "to" : "from", r->peer, b.note);
      t.abort(msg, b.origin);
      throw rt::ExecutionError(msg, b.origin);
    }
  }
  r->check();
}

struct PyRequest {
  rt::RequestPtr r;
  PyTransport* t;
};

struct PyExecutor {
  PyExecutor(const baton::Plan& plan, int rank, PyTransport& transport, PyTasks& tasks,
             double timeout, bool record_events, bool early_receives)
      : keep(transport.t),
        exp(std::make_unique<rt::Executor>(
            plan, rank, transport.get(), tasks,
            rt::ExecutorOptions{ms(timeout), record_events, early_receives})),
        ex(*exp) {}
  ~PyExecutor() {
    // Waits for transfer threads that may need the GIL (Executor::~Executor).
    nb::gil_scoped_release nogil;
    exp.reset();
    keep.reset();
  }
  std::shared_ptr<rt::Transport> keep;
  std::unique_ptr<rt::Executor> exp;
  rt::Executor& ex;
};

int64_t ns(rt::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// A rank program's transfer context, registered for the FFI handlers under `id`.
struct PyComm {
  PyComm(int rank, double timeout)
      : comm(std::make_shared<rt::RankComm>(rank, ms(timeout))), id(rt::register_comm(comm)) {}
  ~PyComm() {
    nb::gil_scoped_release nogil;
    rt::unregister_comm(id);
    comm->detach();
  }
  std::shared_ptr<rt::RankComm> comm;
  int64_t id;
};

// ---- NcclRankComm: the CUDA counterpart of PyComm (nccl_comm.h), registered
// for the CUDA FFI handlers under `id`.
struct PyNcclComm {
  std::shared_ptr<rt::NcclComm> comm;
  int64_t id = 0;
  ~PyNcclComm() {
    nb::gil_scoped_release nogil;
    if (id) rt::unregister_nccl_comm(id);
    if (comm) comm->close();
  }
};
// ---- end NcclRankComm

}  // namespace

void init_runtime(nb::module_& root) {
  nb::register_exception_translator(&translate_execution_error);
  nb::module_ m = root.def_submodule("runtime", "Per-rank executor and transports");

  m.def("runtime_version", &rt::runtime_version);
  m.def("nccl_available", &rt::nccl_available);
  m.def("mapped_libraries", &rt::nccl_library::mapped, "prefix"_a,
        "Paths of the shared objects mapped into this process whose file name starts with "
        "`prefix` (e.g. 'libnccl').");
  m.def("nccl_version_mismatch", &rt::nccl_library::version_mismatch, "runtime"_a, "header"_a,
        "Empty when an NCCL library of version code `runtime` may serve code compiled against "
        "`header`; else why not.");
  m.def("nccl_library", &rt::nccl_library_info,
        "(path, version code, was already mapped, error) of the NCCL library the CUDA path "
        "loads (loading it on first call); ('', 0, False, why) when built without CUDA.");
  m.def("handshake_blob", &rt::handshake_blob, "plan"_a, "world_size"_a);
  m.def("retain_host_memory", &rt::retain_host_memory,
        "Makes glibc's malloc keep freed host memory for reuse (no per-call mmap/munmap of "
        "XLA:CPU's large buffers, hence no page faults); False where unsupported.");
  m.def("dtype_names", [] {
    std::vector<std::string> out;
    for (int i = 0; i <= static_cast<int>(rt::DType::Bool); ++i)
      out.push_back(rt::dtype_name(static_cast<rt::DType>(i)));
    return out;
  });

  m.def(
      "_host_tensors",
      [](nb::object value) {
        PyTasks codec{nb::none(), nb::none(), nb::none(), nb::none(), nb::none(), nb::none()};
        rt::Payload p = codec.to_payload(wrap(value));
        nb::list out;
        for (const rt::Tensor& t : p)
          out.append(nb::make_tuple(rt::dtype_name(t.dtype), t.shape,
                                    reinterpret_cast<uintptr_t>(t.data), t.nbytes));
        return out;
      },
      "value"_a,
      "How a value crosses a byte transport: (dtype, shape, data pointer, nbytes) "
      "per array (for tests: equal pointers prove zero-copy).");

  nb::class_<PyStore>(m, "Store", "A rendezvous key-value store.");
  m.def(
      "hash_store", [] { return PyStore{rt::make_hash_store()}; }, "In-process store.");
  m.def(
      "file_store", [](const std::string& dir) { return PyStore{rt::make_file_store(dir)}; },
      "dir"_a, "Store in a directory (processes on one host).");
  m.def(
      "callback_store",
      [](nb::object set, nb::object get) {
        auto hold = std::make_shared<std::pair<nb::object, nb::object>>(set, get);
        auto release = std::shared_ptr<void>(nullptr, [hold](void*) mutable {
          nb::gil_scoped_acquire gil;
          hold->first.reset();
          hold->second.reset();
        });
        auto s = rt::make_callback_store(
            [hold, release](const std::string& k, const std::string& v) {
              nb::gil_scoped_acquire gil;
              hold->first(k, nb::bytes(v.data(), v.size()));
            },
            [hold, release](const std::string& k, milliseconds timeout) {
              nb::gil_scoped_acquire gil;
              try {
                nb::object r = hold->second(k, static_cast<double>(timeout.count()) / 1000.0);
                if (nb::isinstance<nb::bytes>(r)) {
                  nb::bytes b = nb::borrow<nb::bytes>(r);
                  return std::string(b.c_str(), b.size());
                }
                return nb::cast<std::string>(r);
              } catch (nb::python_error& e) {
                throw rt::ExecutionError(fmt::format("store get('{}') failed: {}", k, e.what()));
              }
            });
        return PyStore{s};
      },
      "set"_a, "get"_a,
      "Store backed by Python callables set(key, value: bytes) and get(key, timeout_s) -> bytes "
      "(e.g. jax.distributed's key-value store).");

  nb::class_<PyTasks>(m, "Tasks", "Python callbacks the executor calls.")
      .def(nb::init<nb::object, nb::object, nb::object, nb::object, nb::object, nb::object>(),
           "run"_a = nb::none(), "accumulate"_a = nb::none(), "received"_a = nb::none(),
           "to_host"_a = nb::none(), "from_host"_a = nb::none(), "recv_layout"_a = nb::none(),
           "run(rank, action, input_ids, inputs, output_ids) -> one value per output id;\n"
           "accumulate(rank, buffer, value); received(rank, buffer, value) -> value;\n"
           "to_host(value) -> list of arrays; from_host(list of numpy arrays) -> value.");

  nb::class_<PyTransport>(m, "Transport", "A transport of one rank.")
      .def_prop_ro("rank", [](PyTransport& t) { return t.get().rank(); })
      .def_prop_ro("world_size", [](PyTransport& t) { return t.get().world_size(); })
      .def_prop_ro("kind", [](PyTransport& t) { return t.get().kind(); })
      .def_prop_ro("closed", [](PyTransport& t) { return !t.t; })
      .def(
          "failure", [](PyTransport& t) { return t.get().failure(); },
          "(origin rank, reason) once a rank failed, else None.")
      .def(
          "abort",
          [](PyTransport& t, const std::string& reason) {
            nb::gil_scoped_release nogil;
            t.get().abort(reason);
          },
          "reason"_a)
      .def("close", &PyTransport::close)
      .def(
          "isend",
          [](PyTransport& t, int peer, uint64_t tag, nb::object arrays, int channel,
             nb::object layout) {
            rt::Value v = wrap(arrays);
            const rt::Layout l = to_layout(layout);
            rt::Transport& tr = t.get();
            rt::RequestPtr r;
            {
              // Posting may wait for the transport's locks; its threads (completing
              // receives into Python values) must be able to take the GIL meanwhile.
              nb::gil_scoped_release nogil;
              r = tr.isend(peer, tag, std::move(v), fmt::format("tag {}", tag), &t.codec, channel,
                           l);
            }
            return PyRequest{std::move(r), &t};
          },
          "peer"_a, "tag"_a, "arrays"_a, "channel"_a = 0, "layout"_a = nb::none(),
          nb::keep_alive<0, 1>(),
          "Posts a send of a list of arrays; call flush() after the last post of a group. "
          "layout: the receiver's [(dtype, shape), ...] when it knows it too (Gloo then sends "
          "no header; the arrays are checked against it).")
      .def(
          "irecv",
          [](PyTransport& t, int peer, uint64_t tag, int channel, nb::object layout) {
            const rt::Layout l = to_layout(layout);
            rt::Transport& tr = t.get();
            rt::RequestPtr r;
            {
              nb::gil_scoped_release nogil;  // as isend
              r = tr.irecv(peer, tag, fmt::format("tag {}", tag), &t.codec, channel, l);
            }
            return PyRequest{std::move(r), &t};
          },
          "peer"_a, "tag"_a, "channel"_a = 0, "layout"_a = nb::none(), nb::keep_alive<0, 1>(),
          "Posts a receive. layout: [(dtype, shape), ...] or arrays/ShapeDtypeStructs "
          "(required by NCCL).")
      .def(
          "flush",
          [](PyTransport& t) {
            rt::Transport& tr = t.get();
            nb::gil_scoped_release nogil;
            tr.flush();
          },
          "Ends a communication group (NCCL issues it as one ncclGroupStart/End).")
      .def(
          "send",
          [](PyTransport& t, int peer, uint64_t tag, nb::object arrays, double timeout,
             nb::object layout) {
            auto r = t.get().isend(peer, tag, wrap(arrays), fmt::format("tag {}", tag), &t.codec, 0,
                                   to_layout(layout));
            t.get().flush();
            wait_request(r, timeout, t.get());
          },
          "peer"_a, "tag"_a, "arrays"_a, "timeout"_a = 60.0, "layout"_a = nb::none(),
          "Sends a list of arrays (blocking, bounded by timeout); layout as for isend.")
      .def(
          "recv",
          [](PyTransport& t, int peer, uint64_t tag, double timeout, nb::object layout) {
            auto r = t.get().irecv(peer, tag, fmt::format("tag {}", tag), &t.codec, 0,
                                   to_layout(layout));
            t.get().flush();
            wait_request(r, timeout, t.get());
            return unwrap(r->take_value());
          },
          "peer"_a, "tag"_a, "timeout"_a = 60.0, "layout"_a = nb::none(),
          "Receives a list of arrays: numpy (64-byte aligned) from host transports, jax.Arrays "
          "from NCCL (blocking, bounded).")
      .def(
          "exchange",
          [](PyTransport& t, const std::string& blob, double timeout) {
            nb::gil_scoped_release nogil;
            return t.get().exchange(blob, ms(timeout));
          },
          "blob"_a, "timeout"_a = 60.0);

  nb::class_<PyRequest>(m, "Request", "A posted transfer.")
      .def("done", [](PyRequest& r) { return r.r->done(); })
      .def(
          "wait",
          [](PyRequest& r, double timeout) -> nb::object {
            wait_request(r.r, timeout, r.t->get());
            if (r.r->is_send) return nb::none();
            return unwrap(r.r->take_value());
          },
          "timeout"_a = 60.0, "Waits (bounded); returns the received arrays, None for a send.");

  nb::class_<std::shared_ptr<rt::LocalHub>>(m, "LocalHub", "In-process transport hub.")
      .def(
          "__init__",
          [](std::shared_ptr<rt::LocalHub>* self, int world, double delay) {
            rt::TransportOptions o;
            o.delay = ms(delay);
            new (self) std::shared_ptr<rt::LocalHub>(rt::LocalHub::create(world, o));
          },
          "world_size"_a, "delay"_a = 0.0)
      .def(
          "transport",
          [](std::shared_ptr<rt::LocalHub>& h, int rank) {
            auto* t = new PyTransport();
            t->t = h->transport(rank);
            return t;
          },
          "rank"_a, nb::rv_policy::take_ownership);

  m.def(
      "gloo_transport",
      [](int rank, int world, PyStore& store, const std::string& hostname, double connect_timeout,
         const std::string& prefix, double delay, double heartbeat) {
        rt::GlooOptions o;
        o.hostname = hostname;
        o.connect_timeout = ms(connect_timeout);
        o.prefix = prefix;
        o.delay = ms(delay);
        o.heartbeat = ms(heartbeat);
        auto* t = new PyTransport();
        {
          nb::gil_scoped_release nogil;
          t->t = rt::make_gloo_transport(rank, world, store.store, o);
        }
        return t;
      },
      "rank"_a, "world_size"_a, "store"_a, "hostname"_a = "127.0.0.1", "connect_timeout"_a = 30.0,
      "prefix"_a = "baton", "delay"_a = 0.0, "heartbeat"_a = 1.0, nb::rv_policy::take_ownership);

  m.def(
      "nccl_transport",
      [](int rank, int world, int device, PyStore& store, int channels) {
        auto* t = new PyTransport();
        {
          nb::gil_scoped_release nogil;
          t->t = rt::make_nccl_transport(rank, world, device, store.store, {}, channels);
        }
        return t;
      },
      "rank"_a, "world_size"_a, "device"_a, "store"_a, "channels"_a = 2,
      nb::rv_policy::take_ownership);

  nb::class_<PyComm>(m, "RankComm",
                     "The transfers of one rank's compiled program (the XLA FFI handlers of "
                     "baton._core.ffi call it; `id` is their `comm` attribute).")
      .def(nb::init<int, double>(), "rank"_a, "timeout"_a = 60.0)
      .def_ro("id", &PyComm::id)
      .def_prop_ro("rank", [](PyComm& c) { return c.comm->rank(); })
      .def_prop_ro("attached", [](PyComm& c) { return c.comm->attached(); })
      .def(
          "attach",
          [](PyComm& c, PyTransport& t) {
            std::shared_ptr<rt::Transport> tr = t.t;
            if (!tr) throw baton::ConfigError("the transport is closed");
            nb::gil_scoped_release nogil;
            c.comm->attach(std::move(tr));
          },
          "transport"_a, "Uses this transport from now on (counters and failure reset).")
      .def("detach",
           [](PyComm& c) {
             nb::gil_scoped_release nogil;
             c.comm->detach();
           })
      .def(
          "abort",
          [](PyComm& c, const std::string& msg, int origin) {
            nb::gil_scoped_release nogil;
            c.comm->abort(msg, origin < 0 ? c.comm->rank() : origin);
          },
          "reason"_a, "origin"_a = -1,
          "Records the failure and tells every other rank (their waits fail at once).")
      .def(
          "set_timeout", [](PyComm& c, double t) { c.comm->set_timeout(ms(t)); }, "timeout"_a)
      .def(
          "set_layout",
          [](PyComm& c, int channel, int stage, std::vector<size_t> bytes) {
            c.comm->set_layout(channel, stage, std::move(bytes));
          },
          "channel"_a, "stage"_a, "nbytes"_a,
          "Bytes of each tensor of the (channel, stage) buffer as this rank receives it.")
      .def(
          "set_names",
          [](PyComm& c, int peer, int channel, bool send, std::vector<std::string> names) {
            c.comm->set_names(peer, channel, send, std::move(names));
          },
          "peer"_a, "channel"_a, "send"_a, "names"_a,
          "Names of one step's transfers with peer on channel, in order (error messages).")
      .def(
          "record", [](PyComm& c, bool on) { c.comm->record(on); }, "on"_a)
      .def(
          "set_shards",
          [](PyComm& c, std::vector<int> ordinals) { c.comm->set_shards(std::move(ordinals)); },
          "ordinals"_a,
          "The rank's devices: the handler call of device ordinal ordinals[i] (the jax device id "
          "on CPU) is shard i, which exchanges with shard i of the peers. [] (the default): one "
          "shard, any device. Resets the shards' counters; call it while no program runs.")
      .def(
          "set_route",
          [](PyComm& c, int ordinal, PyComm* member) {
            c.comm->set_route(ordinal, member ? member->comm : nullptr);
          },
          "ordinal"_a, "member"_a.none(),
          "A program several ranks share is lowered with this context's id: the handler call "
          "of device `ordinal` runs on `member`'s context (None: on this one again). Call it "
          "while no program runs.")
      .def(
          "set_alias",
          [](PyComm& c, std::vector<std::array<int, 3>> from, std::vector<std::array<int, 3>> to) {
            c.comm->set_alias(std::move(from), std::move(to));
          },
          "from"_a, "to"_a,
          "Runs a shared program's transfer of (peer, channel, stage) from[i] (as the rank it "
          "was lowered for names it) as one of to[i] ([] and []: as they are).")
      .def_prop_ro(
          "shards", [](PyComm& c) { return c.comm->shards(); },
          "The device ordinals given to set_shards ([]: one shard, any device).")
      .def(
          "failure", [](PyComm& c) { return c.comm->failure(); },
          "(origin rank, message) of the first failure since attach, else None.")
      .def(
          "counts", [](PyComm& c) { return c.comm->counts(); },
          "(sends, receives) posted since attach.")
      .def(
          "take_marks",
          [](PyComm& c) {
            nb::list out;
            for (const auto& [phase, t] : c.comm->take_marks())
              out.append(nb::make_tuple(phase, ns(t)));
            return out;
          },
          "(phase 0 begin / 1 end, time_ns) per task boundary since the last call, when "
          "recording.")
      .def(
          "take_events",
          [](PyComm& c, bool with_shard) {
            nb::list out;
            for (const rt::CommEvent& e : c.comm->take_events()) {
              if (with_shard)
                out.append(nb::make_tuple(static_cast<int>(e.kind), e.peer, e.channel, e.stage,
                                          e.seq, ns(e.posted), ns(e.started), ns(e.completed),
                                          e.shard));
              else
                out.append(nb::make_tuple(static_cast<int>(e.kind), e.peer, e.channel, e.stage,
                                          e.seq, ns(e.posted), ns(e.started), ns(e.completed)));
            }
            return out;
          },
          "with_shard"_a = false,
          "(kind 0 send / 1 receive, peer, channel, stage, seq, posted_ns, started_ns, "
          "completed_ns[, shard when with_shard]) per transfer of every shard since the last "
          "call, when recording (seq counts per shard).");

  // ---- NcclRankComm (CUDA; see nccl_comm.h) --------------------------------------
  nb::class_<PyNcclComm>(m, "NcclRankComm",
                         "The transfers of one rank's compiled program on CUDA over NCCL (the "
                         "CUDA XLA FFI handlers of baton._core.ffi.handlers_cuda call it; `id` is "
                         "their `comm` attribute). Every rank constructs its own at the same time "
                         "with the links its plan uses; raises ValueError (ConfigError) without a "
                         "CUDA device, without NCCL, or when built without CUDA.")
      .def(
          "__init__",
          [](PyNcclComm* self, int rank, int world, int device, PyStore& store,
             std::vector<std::tuple<int, int, bool>> links, double timeout,
             const std::string& prefix, double setup_timeout) {
            std::vector<rt::NcclLink> ls;
            ls.reserve(links.size());
            for (const auto& [peer, channel, send] : links) ls.push_back({peer, channel, send});
            std::shared_ptr<rt::NcclComm> c;
            {
              nb::gil_scoped_release nogil;
              c = std::make_shared<rt::NcclComm>(rank, world, device, store.store, std::move(ls),
                                                 ms(timeout), prefix, ms(setup_timeout));
            }
            new (self) PyNcclComm{c, rt::register_nccl_comm(c)};
          },
          "rank"_a, "world_size"_a, "device"_a, "store"_a, "links"_a, "timeout"_a = 60.0,
          "prefix"_a = "baton/nccl_comm", "setup_timeout"_a = 0.0,
          "links: (peer, channel, send) per direction of a link this rank uses (send=True: this "
          "rank sends to peer on channel). device: the CUDA ordinal of this context's device "
          "(one context per device slot of the rank). prefix: store key namespace (unique per "
          "construction and slot when a store is reused). setup_timeout: seconds the setup may "
          "take (0: max(timeout, 60)); a peer that does not arrive raises ExecutionError naming "
          "it.")
      .def(
          "set_route",
          [](PyNcclComm& c, int ordinal, PyNcclComm* member) {
            c.comm->set_route(ordinal, member ? member->comm : nullptr);
          },
          "ordinal"_a, "member"_a.none(),
          "Calls from CUDA device `ordinal` run on `member` (the context of that device slot; "
          "None removes the route). Settings given to this context are applied to its routed "
          "slots too.")
      .def(
          "reserve",
          [](PyNcclComm& c, std::vector<std::tuple<int, int, bool, int>> transfers) {
            std::vector<rt::staging::TransferCount> ts;
            for (const auto& [channel, stage, send, count] : transfers)
              ts.push_back({channel, stage, send, count});
            nb::gil_scoped_release nogil;
            c.comm->reserve(ts);
          },
          "transfers"_a,
          "Allocates one step's staging slots and CUDA events before the first step: "
          "(channel, stage, send, count) per kind of transfer of the rank's step (after "
          "set_layout).")
      .def_prop_ro("events_created", [](PyNcclComm& c) { return c.comm->events_created(); },
                   "CUDA events created so far (this context's and its routed slots').")
      .def_static("built", &rt::NcclComm::built, "True when built with CUDA and NCCL.")
      .def_ro("id", &PyNcclComm::id)
      .def_prop_ro("rank", [](PyNcclComm& c) { return c.comm->rank(); })
      .def_prop_ro("world_size", [](PyNcclComm& c) { return c.comm->world_size(); })
      .def_prop_ro("device", [](PyNcclComm& c) { return c.comm->device(); })
      .def_prop_ro("alive", [](PyNcclComm& c) { return c.comm->alive(); },
                   "Communicators up and no failure.")
      .def_prop_ro("attached", [](PyNcclComm& c) { return c.comm->alive(); },
                   "As RankComm.attached: usable (same as alive).")
      .def_prop_ro(
          "links",
          [](PyNcclComm& c) {
            std::vector<std::tuple<int, int, bool>> out;
            for (const rt::NcclLink& l : c.comm->links()) out.emplace_back(l.peer, l.channel, l.send);
            return out;
          },
          "(peer, channel, send) as given.")
      .def_prop_ro("slots_allocated", [](PyNcclComm& c) { return c.comm->slots_allocated(); },
                   "Staging slots allocated so far (the fixed pool's size).")
      .def(
          "set_timeout", [](PyNcclComm& c, double t) { c.comm->set_timeout(ms(t)); }, "timeout"_a)
      .def(
          "set_layout",
          [](PyNcclComm& c, int channel, int stage, std::vector<size_t> bytes) {
            c.comm->set_layout(channel, stage, std::move(bytes));
          },
          "channel"_a, "stage"_a, "nbytes"_a)
      .def(
          "set_names",
          [](PyNcclComm& c, int peer, int channel, bool send, std::vector<std::string> names) {
            c.comm->set_names(peer, channel, send, std::move(names));
          },
          "peer"_a, "channel"_a, "send"_a, "names"_a)
      .def(
          "record",
          [](PyNcclComm& c, bool on) {
            nb::gil_scoped_release nogil;
            c.comm->record(on);
          },
          "on"_a, "Records transfers and task marks with CUDA events (times when taken).")
      .def(
          "abort",
          [](PyNcclComm& c, const std::string& msg, int origin) {
            nb::gil_scoped_release nogil;
            c.comm->abort(msg, origin);
          },
          "reason"_a, "origin"_a = -1,
          "Records the failure, aborts the communicators and tells every other rank.")
      .def(
          "close",
          [](PyNcclComm& c) {
            nb::gil_scoped_release nogil;
            c.comm->close();
          },
          "Destroys the communicators (aborts them when transfers are pending).")
      .def("failure", [](PyNcclComm& c) { return c.comm->failure(); })
      .def("counts", [](PyNcclComm& c) { return c.comm->counts(); })
      .def(
          "take_marks",
          [](PyNcclComm& c) {
            std::vector<std::pair<int, rt::Clock::time_point>> marks;
            {
              nb::gil_scoped_release nogil;
              marks = c.comm->take_marks();
            }
            nb::list out;
            for (const auto& [phase, t] : marks) out.append(nb::make_tuple(phase, ns(t)));
            return out;
          },
          "(phase, time_ns) per task boundary (time 0: its event had not completed).")
      .def(
          "take_events",
          [](PyNcclComm& c) {
            std::vector<rt::CommEvent> events;
            {
              nb::gil_scoped_release nogil;
              events = c.comm->take_events();
            }
            nb::list out;
            for (const rt::CommEvent& e : events)
              out.append(nb::make_tuple(static_cast<int>(e.kind), e.peer, e.channel, e.stage, e.seq,
                                        ns(e.posted), ns(e.started), ns(e.completed)));
            return out;
          },
          "As RankComm.take_events (started/completed from CUDA events; 0 when not complete).");
  // ---- end NcclRankComm ---------------------------------------------------------

  m.def(
      "_pingpong",
      [](PyTransport& a, PyTransport& b, size_t nbytes, int iters, bool through_comm) {
        // Benchmark helper (bench/ffi_transfer.py); see baton/transfer_bench.h.
        std::shared_ptr<rt::Transport> ta = a.t, tb = b.t;
        nb::gil_scoped_release nogil;
        return rt::pingpong_seconds(ta, tb, nbytes, iters, through_comm);
      },
      "a"_a, "b"_a, "nbytes"_a, "iters"_a, "through_comm"_a);

  nb::class_<PyExecutor>(m, "Executor", "Runs one rank's program of a Plan.")
      .def(nb::init<const baton::Plan&, int, PyTransport&, PyTasks&, double, bool, bool>(),
           "plan"_a, "rank"_a, "transport"_a, "tasks"_a, "timeout"_a = 60.0,
           "record_events"_a = false, "early_receives"_a = true, nb::keep_alive<1, 2>(),
           nb::keep_alive<1, 4>(), nb::keep_alive<1, 5>())
      .def(
          "run",
          [](PyExecutor& e) {
            nb::gil_scoped_release nogil;
            e.ex.run();
          },
          "Runs one step (releases the GIL; callbacks take it).")
      .def(
          "handshake",
          [](PyExecutor& e, double timeout) {
            nb::gil_scoped_release nogil;
            e.ex.handshake(ms(timeout));
          },
          "timeout"_a = 60.0)
      .def_prop_ro("rank", [](PyExecutor& e) { return e.ex.rank(); })
      .def_prop_ro("steps_done", [](PyExecutor& e) { return e.ex.steps_done(); })
      .def("stats",
           [](PyExecutor& e) {
             const auto& s = e.ex.stats();
             nb::dict d;
             d["peak_live_buffers"] = s.peak_live_buffers;
             d["peak_live_bytes"] = s.peak_live_bytes;
             d["instructions"] = s.instructions;
             d["wait_seconds"] = s.wait_seconds;
             return d;
           })
      .def(
          "events",
          [](PyExecutor& e) {
            nb::list out;
            for (const rt::Event& ev : e.ex.events())
              out.append(nb::make_tuple(ev.instr, baton::opcode_name(ev.op), ev.buffer, ev.peer,
                                        ns(ev.posted), ns(ev.started), ns(ev.completed)));
            return out;
          },
          "(instr, op, buffer, peer, posted_ns, started_ns, completed_ns) per instruction of the "
          "last step (time.monotonic_ns clock); empty unless record_events.");
}
