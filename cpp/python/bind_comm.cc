// Bindings of the transfer contexts of compiled rank programs
// (baton._core.runtime): RankComm (CPU, comm.h) and NcclRankComm (CUDA,
// nccl_comm.h), which the XLA FFI handlers call by id. Conversion only.
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "baton/comm.h"
#include "baton/host_staged.h"
#include "baton/nccl_comm.h"
#include "baton/roll.h"
#include "bind_runtime.h"

namespace baton::python {

using namespace nb::literals;

namespace {

// A rank program's transfer context, registered for the FFI handlers under `id`.
struct PyComm {
  PyComm(int rank, double timeout)
      : comm(std::make_shared<rt::RankComm>(rank, ms(timeout))), id(rt::register_comm(comm)) {}
  ~PyComm() {
    nb::gil_scoped_release nogil;
    rt::unregister_staged_comm(id);
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

void bind_comm(nb::module_& m) {
  nb::enum_<runtime::CommOpKind>(m, "CommOpKind", nb::is_arithmetic(),
                                 "A transfer operation of a `baton_comm` FFI call (comm.h).")
      .value("SEND", runtime::CommOpKind::Send)
      .value("POST", runtime::CommOpKind::Post)
      .value("WAIT", runtime::CommOpKind::Wait);
  // The conversion from the rolled item level (roll.h's ItemOp) to the FFI level; RUN items
  // are no transfer (docs/RANK_IR.md, "Vocabularies").
  m.def(
      "comm_op_kind",
      [](baton::ItemOp op) {
        switch (op) {
          case baton::ItemOp::Send:
            return runtime::CommOpKind::Send;
          case baton::ItemOp::Post:
            return runtime::CommOpKind::Post;
          case baton::ItemOp::Wait:
            return runtime::CommOpKind::Wait;
          case baton::ItemOp::Run:
          case baton::ItemOp::Offload:
          case baton::ItemOp::Fetch:
            break;
        }
        throw nb::value_error("comm_op_kind: a RUN, OFFLOAD or FETCH item is no transfer");
      },
      "op"_a, "The baton_comm operation of a transfer item (ItemOp SEND, POST or WAIT).");
  nb::enum_<runtime::CudaTransport>(m, "CudaTransport",
                                    "The transport of a CUDA rank (choose_cuda_transport).")
      .value("NCCL", runtime::CudaTransport::Nccl)
      .value("HOST_STAGED", runtime::CudaTransport::HostStaged);
  m.def(
      "choose_cuda_transport",
      [](const std::vector<std::string>& hosts, const std::vector<int>& ordinals,
         bool nccl_available, const std::string& nccl_error) {
        try {
          auto c = runtime::choose_cuda_transport(hosts, ordinals, nccl_available, nccl_error);
          return std::make_pair(c.transport, c.reason);
        } catch (const std::invalid_argument& e) {
          throw nb::value_error(e.what());
        }
      },
      "hosts"_a, "ordinals"_a, "nccl_available"_a, "nccl_error"_a = "",
      "(CudaTransport, reason) of CUDA ranks whose GPU r is `ordinals[r]` on `hosts[r]`: "
      "HOST_STAGED when two ranks share a GPU of one host or NCCL is unavailable "
      "(`nccl_error` says why), with the one log line saying why; else NCCL and ''.");
  nb::class_<PyComm>(m, "RankComm",
                     "The transfers of one rank's compiled program (the XLA FFI handlers of "
                     "baton._core.ffi call it; `id` is their `comm` attribute).")
      .def(nb::init<int, double>(), "rank"_a, "timeout"_a = 60.0)
      .def_ro("id", &PyComm::id)
#if BATON_HAVE_NCCL
      .def(
          "stage_on_cuda",
          [](PyComm& c, int ordinal) {
            rt::register_staged_comm(c.id, std::make_shared<rt::HostStagedComm>(
                                               c.comm, rt::make_cuda_staging_device(ordinal)));
          },
          "ordinal"_a,
          "Runs this context's programs on CUDA device `ordinal` through pinned host staging "
          "(device -> host -> this transport -> host -> device), for ranks without NCCL.")
      .def_prop_ro(
          "staging_bytes",
          [](PyComm& c) -> size_t {
            auto s = rt::find_staged_comm(c.id);
            return s ? s->staging_bytes() : 0;
          },
          "Pinned bytes held by its host staging (0 when not staged).")
#endif
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
          "host_bytes",
          [](PyComm& c) {
            auto& h = c.comm->host_slots();
            return nb::make_tuple(h.held_bytes(), h.peak_bytes());
          },
          "(held, peak) bytes of offloaded buffers in host memory (OFFLOAD / FETCH), the "
          "peak since the last reset_host_peak.")
      .def(
          "reset_host_peak", [](PyComm& c) { c.comm->host_slots().reset_peak(); },
          "Starts a new host-memory peak from what is held now.")
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
          [](PyNcclComm& c, std::vector<std::tuple<int, int, bool, int, int>> transfers) {
            std::vector<rt::staging::InFlight> ts;
            for (const auto& [channel, stage, send, from, to] : transfers)
              ts.push_back({channel, stage, send, from, to});
            nb::gil_scoped_release nogil;
            c.comm->reserve(ts);
          },
          "transfers"_a,
          "Allocates, before the first step, the staging slots and CUDA events of the "
          "transfers in flight at once, and caps the pool: (channel, stage, send, from, to) per "
          "transfer of the rank's step, in flight from instruction `from` (its POST) to `to` (a "
          "receive's WAIT, a send's FREE; -1: the step's end) of the rank program "
          "(ffi.in_flight; after set_layout). Raises ExecutionError naming the rank, the "
          "direction and the bytes when they cannot be allocated.")
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
          "As above with (channel, stage, send, count) per kind of transfer: every transfer "
          "counted in flight at once.")
      .def_prop_ro(
          "reserved_bytes", [](PyNcclComm& c) { return c.comm->reserved_bytes(); },
          "(sends, receives): bytes of staging reserve() reserved, this context's and its "
          "routed slots' ((0, 0) before reserve).")
      .def_prop_ro(
          "events_created", [](PyNcclComm& c) { return c.comm->events_created(); },
          "CUDA events created so far (this context's and its routed slots').")
      .def_static("built", &rt::NcclComm::built, "True when built with CUDA and NCCL.")
      .def_ro("id", &PyNcclComm::id)
      .def_prop_ro("rank", [](PyNcclComm& c) { return c.comm->rank(); })
      .def_prop_ro("world_size", [](PyNcclComm& c) { return c.comm->world_size(); })
      .def_prop_ro("device", [](PyNcclComm& c) { return c.comm->device(); })
      .def_prop_ro(
          "alive", [](PyNcclComm& c) { return c.comm->alive(); },
          "Communicators up and no failure.")
      .def_prop_ro(
          "attached", [](PyNcclComm& c) { return c.comm->alive(); },
          "As RankComm.attached: usable (same as alive).")
      .def_prop_ro(
          "links",
          [](PyNcclComm& c) {
            std::vector<std::tuple<int, int, bool>> out;
            for (const rt::NcclLink& l : c.comm->links())
              out.emplace_back(l.peer, l.channel, l.send);
            return out;
          },
          "(peer, channel, send) as given.")
      .def_prop_ro(
          "slots_allocated", [](PyNcclComm& c) { return c.comm->slots_allocated(); },
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
}

}  // namespace baton::python
