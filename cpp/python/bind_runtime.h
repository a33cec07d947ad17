// Internal to the runtime bindings: what bind_runtime.cc, bind_comm.cc and
// bind_values.cc share (Python objects as runtime values, the wrapper types of
// stores and transports).
#pragma once
#include <nanobind/nanobind.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "baton/error.h"
#include "baton/runtime.h"

namespace baton::python {

namespace nb = nanobind;
namespace rt = baton::runtime;

using std::chrono::milliseconds;
inline milliseconds ms(double seconds) {
  return milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

// Nanoseconds since the clock's epoch.
inline int64_t ns(rt::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// A Python object as a runtime value, and back (bind_values.cc).
rt::Value wrap(nb::object o);
nb::object unwrap(const rt::Value& v);

// A layout from Python: a list whose items are (dtype, shape) pairs or objects
// with .dtype and .shape (arrays, jax.ShapeDtypeStruct).
rt::Layout to_layout(nb::handle obj);

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
  ~PyTasks() override;
  rt::Layout recv_layout(int rank, int32_t buffer) override;
  std::vector<rt::Value> run(const rt::TaskCall& c) override;
  void accumulate(int rank, int32_t buffer, const rt::Value& v) override;
  rt::Value received(int rank, int32_t buffer, rt::Value v) override;
  rt::Payload to_payload(const rt::Value& v) override;
  rt::Value from_payload(rt::Payload p) override;

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

// Binds RankComm and NcclRankComm (bind_comm.cc).
void bind_comm(nb::module_& m);

}  // namespace baton::python
