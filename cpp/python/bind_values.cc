// Python values as runtime values: objects wrapped as values, arrays as tensors
// that view their memory (DLPack) and back, layouts, and the Tasks backed by
// Python callables. Conversion only.
#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <vector>

#include "bind_runtime.h"

namespace baton::python {

namespace {

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

}  // namespace

rt::Value wrap(nb::object o) { return std::make_shared<PyValue>(std::move(o)); }
nb::object unwrap(const rt::Value& v) {
  if (auto* p = dynamic_cast<PyValue*>(v.get())) return p->obj;
  throw rt::ExecutionError("internal: a value that is not a Python object reached Python");
}

namespace {

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

}  // namespace

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

namespace {

// A Python exception raised by a callback, as "Type: message" (the traceback
// stays out of the runtime's error messages).
[[noreturn]] void rethrow_python(nb::python_error& e, const char* what) {
  std::string type = pystr(e.type().attr("__name__"));
  std::string msg = pystr(e.value());
  e.restore();
  PyErr_Clear();
  throw rt::ExecutionError(fmt::format("{} raised {}: {}", what, type, msg));
}

}  // namespace

PyTasks::~PyTasks() {
  nb::gil_scoped_acquire gil;
  run_.reset();
  acc_.reset();
  recv_.reset();
  to_host_.reset();
  from_host_.reset();
  layout_.reset();
}

rt::Layout PyTasks::recv_layout(int rank, int32_t buffer) {
  nb::gil_scoped_acquire gil;
  if (!layout_.is_valid() || layout_.is_none()) return {};
  try {
    return to_layout(layout_(rank, buffer));
  } catch (nb::python_error& e) {
    rethrow_python(e, "recv_layout");
  }
}

std::vector<rt::Value> PyTasks::run(const rt::TaskCall& c) {
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

void PyTasks::accumulate(int rank, int32_t buffer, const rt::Value& v) {
  nb::gil_scoped_acquire gil;
  if (!acc_.is_valid() || acc_.is_none())
    throw rt::ExecutionError("no accumulate callback was given");
  try {
    acc_(rank, buffer, unwrap(v));
  } catch (nb::python_error& e) {
    rethrow_python(e, "accumulate");
  }
}

rt::Value PyTasks::received(int rank, int32_t buffer, rt::Value v) {
  if (!recv_.is_valid()) return v;
  nb::gil_scoped_acquire gil;
  if (recv_.is_none()) return v;
  try {
    return wrap(recv_(rank, buffer, unwrap(v)));
  } catch (nb::python_error& e) {
    rethrow_python(e, "the received callback");
  }
}

rt::Payload PyTasks::to_payload(const rt::Value& v) {
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
    for (nb::handle h : obj) p.push_back(to_tensor(h, fmt::format("array {} of a transfer", i++)));
  } else {
    p.push_back(to_tensor(obj, "transfer"));
  }
  return p;
}

rt::Value PyTasks::from_payload(rt::Payload p) {
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

}  // namespace baton::python
