// Bindings of the runtime (baton._core.runtime): executor, transports, stores.
// Thin: conversion only. Values are Python objects (e.g. lists of jax.Arrays);
// byte transports see them as lists of arrays crossing as DLPack views
// (bind_values.cc). The compiled programs' transfer contexts: bind_comm.cc.
#include "bind_runtime.h"

#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "baton/nccl_library.h"
#include "baton/plan.h"
#include "baton/runtime.h"
#include "baton/transfer_bench.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace rt = baton::runtime;
using baton::python::ms;
using baton::python::ns;
using baton::python::PyStore;
using baton::python::PyTasks;
using baton::python::PyTransport;
using baton::python::to_layout;
using baton::python::unwrap;
using baton::python::wrap;

namespace {

using std::chrono::milliseconds;

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
  PyExecutor(const baton::RankIR& ir, int rank, PyTransport& transport, PyTasks& tasks,
             double timeout, bool record_events)
      : keep(transport.t),
        exp(std::make_unique<rt::Executor>(ir, rank, transport.get(), tasks,
                                           rt::ExecutorOptions{ms(timeout), record_events})),
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

  baton::python::bind_comm(m);

  m.def(
      "_pingpong",
      [](PyTransport& a, PyTransport& b, size_t nbytes, int iters, bool through_comm) {
        // Benchmark helper (bench/ffi_transfer.py); see baton/transfer_bench.h.
        std::shared_ptr<rt::Transport> ta = a.t, tb = b.t;
        nb::gil_scoped_release nogil;
        return rt::pingpong_seconds(ta, tb, nbytes, iters, through_comm);
      },
      "a"_a, "b"_a, "nbytes"_a, "iters"_a, "through_comm"_a);

  nb::class_<PyExecutor>(m, "Executor",
                         "Runs one rank's program of a RankIR (ir.programs[rank]) with Python "
                         "task callbacks; refuses programs with OFFLOAD / FETCH.")
      .def(nb::init<const baton::RankIR&, int, PyTransport&, PyTasks&, double, bool>(), "ir"_a,
           "rank"_a, "transport"_a, "tasks"_a, "timeout"_a = 60.0, "record_events"_a = false,
           nb::keep_alive<1, 2>(), nb::keep_alive<1, 4>(), nb::keep_alive<1, 5>())
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
          "rank's plan stream (instr: its index there) for the last step (time.monotonic_ns "
          "clock); empty unless record_events.");
}
