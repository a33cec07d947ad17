"""A rank program's transfers and markers as XLA FFI calls (``ffi.py``), and what they
recorded.

Each stretch of transfers between two tasks is one ``baton_comm`` custom call that posts
sends and receives on the transport and waits for receives where the next task needs them,
from XLA's thread with no Python; each task's begin and end is a ``baton_mark`` call. A
scalar token threads every call in stream order (each reads and writes it). On a rank of
several devices every call runs per device (``shard_map`` over the rank's sub-mesh) on its
local shard, and device i of one rank exchanges with device i of the other (the same block of
the same spec: shard to shard).

An offloaded buffer's OFFLOAD and FETCH (``baton.jit(offload=...)``) are one
``baton_offload`` / ``baton_fetch`` call each, on the same token, into and out of the host
slots the rank's ``RankComm`` holds.

``RankTransfers`` builds the calls of one rank (and tells its ``RankComm`` the layouts and
names of its transfers); ``recorded_events`` reads back what a traced program recorded.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec

from .. import _core
from .. import _jax_compat as jc
from . import ffi
from .rolling import ItemOp

comm_op_kind = _core.runtime.comm_op_kind
CommOpKind = _core.runtime.CommOpKind
OpCode = _core.OpCode
TRANSFERS = (ItemOp.SEND, ItemOp.POST, ItemOp.WAIT)  # the items a baton_comm call runs
_MAX_ARRAYS = 16  # host slot ids per offloaded buffer (one per array)


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def wire_spec(spec: PartitionSpec, axes: dict, shape) -> PartitionSpec:
    """``spec`` (how an array of ``shape`` is split over the batch axes) further split over
    the axes of ``axes`` (name -> size, the rank's sub-mesh) that it leaves out, together,
    along the first dimension whose block they divide; ``spec`` itself when none does. An
    array replicated over an axis would otherwise be sent whole by every device along it
    (the traffic times the axis' size)."""
    entries = list(spec) + [None] * (len(shape) - len(spec))

    def names(e):
        return () if e is None else (e if isinstance(e, tuple) else (e,))

    used = {n for e in entries for n in names(e)}
    free = tuple(n for n, size in axes.items() if n not in used and size > 1)
    if not free:
        return spec
    ways = int(np.prod([axes[n] for n in free], dtype=np.int64))
    for d, dim in enumerate(shape):
        split = int(np.prod([axes[n] for n in names(entries[d])], dtype=np.int64))
        if dim % split == 0 and (dim // split) % ways == 0:
            both = names(entries[d]) + free
            entries[d] = both[0] if len(both) == 1 else both
            while entries and entries[-1] is None:
                entries.pop()
            return PartitionSpec(*entries)
    return spec


class RankTransfers:
    """The FFI calls of one rank's program: ``comm`` (the rank's
    ``baton._core.runtime.RankComm``) on the rank's sub-mesh ``sub``."""

    def __init__(self, cs, comm, sub, rank):
        self.cs = cs
        self.comm = comm
        self.sub = sub
        self.rank = rank
        self.D = int(sub.devices.size)
        self.slots = self.host_slots() if cs.offload else {}
        self._offloaded: dict[tuple, list] = {}  # (kind, stage) -> its arrays' shapes, dtypes

    def configure(self, items) -> dict[tuple, list[int]]:
        """Tells the comm the rank's transfers (``items``): its shards, each channel's
        layout, the buffers' names per (peer, channel, send) and, on NCCL, the staging of
        the transfers in flight at once (``ffi.in_flight``). Returns (peer, channel, send) -> buffer ids of one step, in order."""
        cs, comm = self.cs, self.comm
        names: dict[tuple, list[str]] = {}
        order: dict[tuple, list[int]] = {}
        nccl = ffi.is_nccl(comm)
        if self.D > 1 and not nccl:  # (NCCL: one context per device slot, routed by ordinal)
            comm.set_shards([int(d.id) for d in self.sub.devices.flat])
        chan = cs.buffers.channel
        for op, k, s, m, peer in items:
            if op in TRANSFERS:
                comm.set_layout(chan(k, s), s, [_nbytes(a) for a in self.local(k, s)])
            if op in (ItemOp.SEND, ItemOp.POST):
                b = cs.buffers.id(k, s, m)
                names.setdefault((peer, chan(k, s), op == ItemOp.SEND), []).append(
                    cs.core_plan.describe_buffer(b))
                order.setdefault((peer, chan(k, s), op == ItemOp.SEND), []).append(b)
        for (peer, chan, send), ns in names.items():
            comm.set_names(peer, chan, send, ns)
        if nccl:  # staging and CUDA events of the transfers in flight at once, before any
            # receive is posted (the rank IR's post and wait points)
            comm.reserve(ffi.in_flight(cs.rank_ir().programs[self.rank]))
        return order

    def layout(self, k, s):
        """The avals of a (k, s) buffer as they cross (``_jax_compat.wire_aval``: typed keys
        as their key data)."""
        return [jc.wire_aval(a) for a in self.cs.buffers.layout(k, s)]

    def specs(self, k, s) -> list[PartitionSpec]:
        """How a (k, s) buffer's arrays are laid out on a rank's devices when they cross
        (``wire_spec``): split over the batch axes along their leading (batch) dimension
        where it divides, and over the rank's other axes (tensor, ...) along the first
        dimension they divide, so that no two devices send the same bytes; the same on both
        ranks, so device i sends to device i, and XLA gathers what the receiving rank's
        tasks need replicated over its own devices."""
        return [wire_spec(self.cs.mesh.batch_spec(a.shape), dict(self.sub.shape), a.shape)
                for a in self.layout(k, s)]

    def local(self, k, s) -> list:
        """The per-device (shard) avals of a (k, s) buffer."""
        out = []
        for a, spec in zip(self.layout(k, s), self.specs(k, s)):
            shape = list(a.shape)
            for dim, entry in enumerate(spec):
                if entry is not None:
                    names = entry if isinstance(entry, tuple) else (entry,)
                    for n in names:
                        shape[dim] //= int(self.sub.shape[n])
            out.append(jax.ShapeDtypeStruct(tuple(shape), a.dtype))
        return out

    def host_slots(self) -> dict[tuple, np.ndarray]:
        """(kind, stage) -> per microbatch, the first host slot id of that row's offloaded
        buffer (its host pool and slot in the rank IR; one id per array of the buffer; -1:
        not offloaded). Indexed by the microbatch, traced inside a scan."""
        prog = self.cs.rank_ir().programs[self.rank]
        base, n = [], 0
        for pool in prog.host_pools:
            base.append(n)
            n += int(pool.slots) * _MAX_ARRAYS
        rows: dict[tuple, np.ndarray] = {}
        for b in prog.buffers:
            if b.host_pool >= 0:
                row = rows.setdefault((b.key.kind, b.key.stage),
                                      np.full(self.cs.M, -1, np.int32))
                row[b.key.microbatch] = base[b.host_pool] + b.host_slot * _MAX_ARRAYS
        return rows

    def _slot(self, key, base):
        """The first host slot id of buffer ``key`` whose microbatch is ``key[2] + base``
        (``base``: the repetition's offset inside a scan, else 0)."""
        k, s, m = key
        return jax.numpy.asarray(self.slots[(k, s)])[m + base]

    def offload(self, key, base, arrays, token) -> None:
        """OFFLOAD of buffer ``key`` (its ``arrays``): each into its host slot."""
        first = self._slot(key, base)
        if len(arrays) > _MAX_ARRAYS:
            raise ValueError(f"rank {self.rank}: buffer {key} has {len(arrays)} arrays; an "
                             f"offloaded buffer has at most {_MAX_ARRAYS}")
        k, s, _ = key
        self._offloaded[(k, s)] = [(x.shape, x.dtype) for x in arrays]
        token.dep = ffi.offload(self.comm.id, first, token.dep, [jc.to_wire(x) for x in arrays])

    def fetch(self, key, base, token) -> list:
        """FETCH of buffer ``key``: its arrays back from their host slots (with the shapes
        and dtypes its row's OFFLOAD had: an OFFLOAD of the row comes first in the
        program)."""
        k, s, _ = key
        arrays = self._offloaded[(k, s)]
        wire = [jc.wire_aval(jax.ShapeDtypeStruct(shape, dtype)) for shape, dtype in arrays]
        token.dep, got = ffi.fetch(self.comm.id, self._slot(key, base), token.dep,
                                   [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in wire])
        return [jc.from_wire(x, dtype) for x, (_, dtype) in zip(got, arrays)]

    def per_device(self, fn, args, in_specs, out_specs):
        """``fn`` called on every device of the rank with its shards (``shard_map`` over the
        rank's sub-mesh): how the transfer calls run on a rank of several devices."""
        return jax.shard_map(fn, mesh=self.sub, in_specs=tuple(in_specs),
                             out_specs=tuple(out_specs), check_vma=False)(*args)

    def mark(self, phase, dep, after):
        """A task boundary marker (``baton_mark``) that runs after ``after`` (the task's
        outputs) exist. On several devices it is called on each (only shard 0's is kept),
        reading one element of each output (a whole sharded output would be gathered)."""
        cid = self.comm.id
        if self.D == 1:
            return ffi.mark(cid, phase, dep, after)
        small = [x.reshape(-1)[:1] for x in after if x.size]
        return self.per_device(lambda t, *xs: (ffi.mark(cid, phase, t, list(xs)),),
                               [dep, *small], [PartitionSpec()] * (1 + len(small)),
                               [PartitionSpec()])[0]

    def drain(self, dep):
        """Every send delivered (``baton_drain``) after ``dep``; on several devices, every
        device drains its own sends."""
        cid = self.comm.id
        if self.D == 1:
            return ffi.drain(cid, dep)
        return self.per_device(lambda t: (ffi.drain(cid, t),), [dep],
                               [PartitionSpec()], [PartitionSpec()])[0]

    def call(self, group, get, put, token):
        """One ``baton_comm`` custom call for a stretch of transfers: it posts the stretch's
        sends and receives and returns the arrays of the receives it waits on. On a rank of
        several devices, one call per device (``shard_map``) on its shards."""
        sends = [jc.to_wire(x) for op, k, s, m, _ in group if op == ItemOp.SEND
                 for x in get((k, s, m))]
        ops = [(int(comm_op_kind(op)), peer, self.cs.buffers.channel(k, s), s)
               for op, k, s, _, peer in group]
        if self.D == 1:
            outs = [jax.ShapeDtypeStruct(a.shape, a.dtype)
                    for op, k, s, _, _ in group if op == ItemOp.WAIT for a in self.layout(k, s)]
            token.dep, got = ffi.comm(self.comm.id, ops, token.dep, sends, outs)
        else:
            outs = [a for op, k, s, _, _ in group if op == ItemOp.WAIT for a in self.local(k, s)]
            send_specs = [sp for op, k, s, _, _ in group if op == ItemOp.SEND
                          for sp in self.specs(k, s)]
            recv_specs = [sp for op, k, s, _, _ in group if op == ItemOp.WAIT
                          for sp in self.specs(k, s)]
            cid = self.comm.id

            def per_device(tok, *xs):
                t, got = ffi.comm(cid, ops, tok, list(xs), outs)
                return (t, *got)

            res = self.per_device(per_device, [token.dep, *sends],
                                  [PartitionSpec(), *send_specs],
                                  [PartitionSpec(), *recv_specs])
            token.dep, got = res[0], list(res[1:])
        pos = 0
        for op, k, s, m, _ in group:
            if op == ItemOp.WAIT:
                avals = self.cs.buffers.layout(k, s)
                put((k, s, m), [jc.from_wire(x, a.dtype)
                                for x, a in zip(got[pos:pos + len(avals)], avals)])
                pos += len(avals)


def recorded_events(cs, rank, comm, order) -> list[tuple]:
    """The last step's recorded events of rank ``rank``'s program in the interpreter's format
    (``Executor.events``: instr, opcode name, buffer, peer, posted, started, completed in ns,
    the name ``_core.opcode_name`` gives) for its
    instruction stream: a RUN spans its tasks' begin and end markers, a SEND or RECV is its
    transfer (matched by order per peer and channel, as the handlers match them; ``order``:
    ``RankTransfers.configure``), a FREE happens when the RUN before it ended (where the
    interpreter frees). Empty unless the comm recorded."""
    marks = comm.take_marks()
    comm_events = comm.take_events()
    prog = cs.programs[rank]
    ops = [op for op, _, _, _ in prog]  # _core.OpCode
    tasks_per_run = [len(cs.buffers.tasks_of(rank, a)) for (_, a, _, _), op in zip(prog, ops)
                     if op == OpCode.RUN]
    if not marks or len(marks) != 2 * sum(tasks_per_run):
        return []
    spans, pos = [], 0
    for n in tasks_per_run:
        spans.append((marks[pos][1], marks[pos + 2 * n - 1][1]))
        pos += 2 * n
    instr_of = {(op, b): i for i, ((_, _, b, _), op) in enumerate(zip(prog, ops))
                if op in (OpCode.SEND, OpCode.RECV)}
    out, run_i = [], 0
    last_end = spans[0][0]
    for i, ((_, a, b, peer), op) in enumerate(zip(prog, ops)):
        if op == OpCode.RUN:
            t0, t1 = spans[run_i]
            out.append((i, _core.opcode_name(op), -1, -1, t0, t0, t1))
            last_end = t1
            run_i += 1
        elif op == OpCode.FREE:
            out.append((i, _core.opcode_name(op), b, -1, last_end, last_end, last_end))
    for kind, peer, chan, _, seq, po, st, co in comm_events:
        send = CommOpKind(kind) == CommOpKind.SEND
        ids = order.get((peer, chan, send))
        if not ids:
            continue
        b = ids[seq % len(ids)]
        op = OpCode.SEND if send else OpCode.RECV
        out.append((instr_of[(op, b)], _core.opcode_name(op), b, peer, po, st or po,
                    co or st or po))
    out.sort()
    return out
