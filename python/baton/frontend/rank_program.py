"""One rank of a multi-rank step as one XLA program (``RankProgram``; one process per rank,
or several ranks in one process, each program on its rank's device).

The rank's instruction stream becomes one jitted program of its microbatch loop: its tasks in
the stream's order, and each stretch of transfers between two tasks one XLA FFI custom call
(``baton_comm``, ``ffi.py``) that posts sends and receives on the transport and waits for
receives where the next task needs them, from XLA's thread with no Python. A scalar token
threads every FFI call in stream order (each reads and writes it); sends read the arrays they
send, waits produce the arrays tasks read, and each task's end marker (``baton_mark``) reads
its outputs, so the transfers happen in the stream's order and no earlier than their data
(the argument is in ``docs/ARCHITECTURE.md``). Transfers match by order per (peer, channel),
the verifier's FIFO model; the tags need no buffer id.

The loop is a table (``RankProgram._loop``): one ``fori_loop`` whose body holds each *unit* of
the rank once (each distinct task, each distinct transfer stretch with its microbatches as
symbols), each a two-branch ``lax.switch`` run when the step's row names it; buffers live in
rings, one per set of kinds of equal avals, a slot per buffer (``rings.ring_slots``). So every
task is compiled once per rank. Ranks of several devices and GPU ranks are lowered straight
instead: the items rolled into scans (``rolling.py``, ``loop_program.py``); ``loop_form``
chooses.

Traced rank programs record their markers and transfers (a runtime switch of the same
executable; ``RankProgram.events``); profiling (``capture``) runs on the interpreter.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from .. import _core
from .. import _jax_compat as jc
from ..errors import ExecutionError
from . import ffi
from .loop_program import _LoopProgram
from .rings import _ring_aval, _ring_in, _symbolic, buffer_lives, ring_slots, table_steps
from .rolling import _exes, item_reads, item_writes, rank_items
from .task_env import _Env, _parts_of, _run_task, _Token

G = _core.graph
_MAX_ITEMS_PER_STAGE = 16  # a rank's pattern (rolled lowering): its tasks and transfers


LOOP_FORMS = ("table", "straight")


def loop_form(cs, rank: int) -> str:
    """How a rank's loop is lowered (the emitter's choice per platform): ``"table"`` (one
    ``fori_loop`` over the rank's table, each unit a two-branch ``lax.switch``: every task
    compiled once) or ``"straight"`` (the items in stream order, repeating runs rolled into
    ``lax.scan``, no conditionals). GPU ranks are lowered straight: XLA's GPU conditional
    thunk copies the branch index to the host and waits for it before every branch, so a
    table would run host and GPU in lockstep, one unit at a time, and receives could not be
    posted ahead of the compute they overlap. ``cs.loop_form`` or ``$BATON_LOOP_FORM``
    forces one (tests compare the two on CPU)."""
    forced = getattr(cs, "loop_form", None) or os.environ.get("BATON_LOOP_FORM") or None
    if forced is not None:
        if forced not in LOOP_FORMS:
            raise ValueError(f"rank {rank}: loop form {forced!r} is not one of {LOOP_FORMS}")
        return forced
    platforms = {d.platform for d in cs.mesh.rank_devices[rank]}
    return "straight" if platforms & {"gpu", "cuda"} else "table"


class RankProgram(_LoopProgram):
    """One rank of a multi-rank ``CompiledStep``: its microbatch loop as one jitted program
    whose transfers are XLA FFI custom calls into the C++ transports (``baton_comm``, see
    ``cpp/python/ffi_handlers.cc``; the module docstring says how they are ordered). Called
    with the loop's outer values (``CompiledStep._loop_needs``), it returns this rank's loop
    outputs (part index -> value) once every transfer is done. ``comm`` is the rank's
    ``baton._core.runtime.RankComm``, attached to its transport by the caller."""

    marks = True
    share = None  # the SharedProgram that runs this rank's table with others' (shared.py)
    shared_in = None  # while it traces: this device's (rows, slots) inputs

    def __init__(self, cs, rank, comm, timeout):
        ffi.register()
        self.comm = comm
        self.timeout = float(timeout)
        comm.set_timeout(self.timeout)
        # A rank of several devices runs SPMD: each transfer is called per device (shard_map
        # over the rank's sub-mesh) on its local shard, and device i of one rank exchanges
        # with device i of the other (the same block of the same spec: shard to shard).
        self.sub = cs.mesh.meshes[rank]
        self.D = int(self.sub.devices.size)
        # One device: the table (each task compiled once), but on GPUs (loop_form). Several:
        # the items rolled into scans, since JAX's Shardy partitioner does not apply the
        # model's sharding constraints inside a conditional's branches as it does in
        # straight-line code (the MoE GPT's dispatch became all-gathers instead of
        # all-to-alls; docs/ARCHITECTURE.md)
        self.form = loop_form(cs, rank)
        self.table = self.D == 1 and self.form == "table"
        if self.table:
            self.cs, self.rank, self.items = cs, rank, rank_items(cs, rank)
            self._table_init()
        else:  # no stacked buffers between loops: runs that would need them stay unrolled
            super().__init__(cs, rank, rank_items(cs, rank),
                             _MAX_ITEMS_PER_STAGE * max(1, cs.num_stages), stacked=False)
        self.needs = [o for o in cs.loop_needs[rank] if o not in cs.traced.literals]
        self.mine = [i for i, p in enumerate(cs.parts) if cs.stage_rank[p.stage] == rank]
        names: dict[tuple, list[str]] = {}
        self._order: dict[tuple, list[int]] = {}
        nccl = ffi.is_nccl(comm)
        if self.D > 1 and not nccl:  # (NCCL: one context per device slot, routed by ordinal)
            comm.set_shards([int(d.id) for d in self.sub.devices.flat])
        chan = cs.buffers.channel
        for op, k, s, m, peer in self.items:
            if op != "run":
                comm.set_layout(chan(k, s), s, [_nbytes(a) for a in self._local(k, s)])
            if op in ("send", "post"):
                b = cs.buffers.id(k, s, m)
                names.setdefault((peer, chan(k, s), op == "send"), []).append(
                    cs.core_plan.describe_buffer(b))
                self._order.setdefault((peer, chan(k, s), op == "send"), []).append(b)
        for (peer, chan, send), ns in names.items():
            comm.set_names(peer, chan, send, ns)
        if nccl:  # one step's staging slots and CUDA events, before any receive is posted
            comm.reserve(ffi.transfer_counts(self.items, chan))
        self.fn = jax.jit(self._program)
        self.compiled = None  # the executable (compile)

    # -- the table ------------------------------------------------------------------------
    def _table_init(self):
        """The rank's loop as a table (see ``_loop``): its steps, the distinct transfer
        stretches (microbatches as symbols) and tasks as units, one row per step, and the
        ring of each buffer kind a later unit reads."""
        cs = self.cs
        self.steps = table_steps(self.items)
        self.stretches: list[tuple] = []  # symbolic transfer stretches
        self.units: list[tuple[str, int]] = []  # (kind, stage) of each task unit
        rows = []
        for st, task in self.steps:
            row = [-1, -1, 0]
            if st:
                pat, ms = _symbolic(st)
                if pat not in self.stretches:
                    self.stretches.append(pat)
                row[0] = self.stretches.index(pat)
                row += ms
            if task is not None:
                if task[1:3] not in self.units:
                    self.units.append(task[1:3])
                row[1] = self.units.index(task[1:3])
                row[2] = task[3]
            rows.append(row)
        width = max(len(r) for r in rows)
        self.rows = np.asarray([r + [0] * (width - len(r)) for r in rows], np.int32)
        # (kind, stage) -> microbatch -> (write, last read); rings per kind until the
        # lowering knows the avals and pools the kinds of equal shape (``_pool``)
        self.lives = buffer_lives(cs, self.steps)
        self._pool({ks: ks for ks in self.lives})

    def _pool(self, pool_of):
        """Kinds with equal ``pool_of`` share a ring: ``self.pools`` (pool -> its kinds),
        ``self.slots`` ((kind, stage) -> the slot of each microbatch's buffer), ``self.rings``
        (pool -> slots)."""
        self.pool_of = dict(pool_of)
        self.slots, self.rings = ring_slots(self.lives, self.pool_of, self.cs.M)
        self.pools: dict = {}
        for ks in sorted(self.lives):
            self.pools.setdefault(self.pool_of[ks], []).append(ks)

    def ring_bytes(self, pooled: bool = True) -> int:
        """Bytes the rank's rings hold (after lowering): with the rings the program uses
        (``pooled``: kinds of equal avals share one), or with one ring per kind."""
        if pooled:
            return sum(R * self.buffer_bytes[kinds[0]] for pool, kinds in self.pools.items()
                       for R in [self.rings[pool]])
        _, sizes = ring_slots(self.lives, {ks: ks for ks in self.lives}, self.cs.M)
        return sum(R * self.buffer_bytes[ks] for ks, R in sizes.items())

    def live_buffer_peak(self) -> int:
        """The most bytes of ringed buffers ever live at once (a lower bound for any rings)."""
        ends = sorted({w for iv in self.lives.values() for w, _ in iv.values()})
        return max((sum(self.buffer_bytes[ks] for ks, iv in self.lives.items()
                        for w, last in iv.values() if w <= p <= last) for p in ends), default=0)

    def describe(self) -> str:
        """The table: its steps, its units (tasks, and transfer stretches with symbolic
        microbatches: ``>Act0`` send, ``+Grad1`` receive posted, ``<Grad1`` received) and
        the slots of each ring, e.g. ``table 16 steps; tasks F0 B0; transfers [>Act0.a]
        [+Grad1.a]; rings Stash0:2``. A rank of several devices: its rolled runs
        (``_LoopProgram.describe``)."""
        if not self.table:
            return super().describe()
        sym = {"send": ">", "post": "+", "wait": "<"}
        tasks = " ".join(f"{k}{s}" for k, s in self.units)
        tr = " ".join("[" + " ".join(f"{sym[op]}{k}{s}.{chr(97 + m)}"
                                     for op, k, s, m, _ in pat) + "]"
                      for pat in self.stretches)
        rings = " ".join(sorted("+".join(f"{k}{s}" for k, s in kinds) + f":{self.rings[pool]}"
                                for pool, kinds in self.pools.items()))
        return f"table {len(self.rows)} steps; tasks {tasks}; transfers {tr}; rings {rings}"

    def unit_sequence(self) -> list[str]:
        """The units the steps run, in order: ``F0``, or a stretch as ``>Act0 +Grad1``."""
        sym = {"send": ">", "post": "+", "wait": "<"}
        out = []
        for st, task in self.steps:
            if st:
                out.append(" ".join(f"{sym[op]}{k}{s}" for op, k, s, _, _ in st))
            if task is not None:
                out.append(f"{task[1]}{task[2]}")
        return out

    def _ring_avals(self, outer, mbs):
        """The avals of every ringed buffer kind: received ones from the plan's layouts, the
        ones a task makes from tracing each task unit once, abstractly, in stream order."""
        cs = self.cs
        avals: dict[tuple[str, int], list] = {}
        for st, _ in self.steps:
            for op, k, s, _, _ in st:
                if op == "wait":
                    avals[(k, s)] = list(cs.buffers.layout(k, s))

        def discover():
            done = set()
            marks, self.marks = self.marks, False
            try:
                for _, task in self.steps:
                    if task is None or task[1:3] in done:
                        continue
                    done.add(task[1:3])
                    _, kind, s, _, _ = task

                    def get(key):
                        return [jc.from_wire(jnp.zeros(_ring_aval(a).shape,
                                                       _ring_aval(a).dtype), a.dtype)
                                for a in avals[key[:2]]]

                    def put(key, v):
                        avals[key[:2]] = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in v]

                    _run_task(cs, kind, s, 0, outer, lambda v, _m: mbs[v][0], get, put,
                              lambda i, _m, x: None, lambda fn, args: fn(*args))
            finally:
                self.marks = marks
            return 0

        jax.eval_shape(discover)
        return avals

    def _loop(self, env, outer, whole_mb, token):
        """The rank's loop as one ``fori_loop`` over its table (one row per step). The body
        holds each unit once: every transfer stretch and every task of the rank, each a
        two-branch ``lax.switch`` (branch 0 passes its operands through, branch 1 runs the
        unit) that runs when the row names it. Buffers live in rings (one per set of kinds of
        equal avals, a slot per buffer: ``ring_slots``), weight-gradient sums and stacked
        outputs in the loop's carry;
        a unit's switch takes as operands only what it reads, and returns only what it
        writes, so XLA updates them in place (a pass-through in branch 0 is not copied).
        So each task is compiled once per rank, whatever the schedule, and the token that
        threads every unit keeps the stream's order."""
        if not self.table:
            return super()._loop(env, outer, whole_mb, token)
        cs = self.cs
        M = cs.M
        share = self.share if self.shared_in is not None else None
        # (shared by several ranks, shared.py: the units of every member, in this one's frame)
        t_units, t_stretches = (share.units, share.stretches) if share else (self.units,
                                                                             self.stretches)
        mbs = {v: whole_mb(v) for v in sorted({v for k, s in t_units for exe in _exes(cs, k, s)
                                               for v in exe.in_groups[1]})}
        avals = self._ring_avals(outer, mbs)
        # kinds of equal avals share a ring (ring_slots)
        self._pool({ks: tuple((_ring_aval(a).shape, np.dtype(_ring_aval(a).dtype).str)
                              for a in avals[ks]) for ks in self.lives})
        pool_of = self.pool_of
        # bytes of one buffer of each kind (ring_bytes: what the rings hold)
        self.buffer_bytes = {ks: sum(int(np.prod(_ring_aval(a).shape)) *
                                     np.dtype(_ring_aval(a).dtype).itemsize for a in avals[ks])
                             for ks in self.lives}
        sizes = self.rings
        if share is not None:  # (shared by several ranks: shared.py; each its rows, slots)
            sizes = share.rings(self.rings, pool_of)
            for sh in share.shares[1:]:
                sh.prog.buffer_bytes = {(k, sh.stage[s]): self.buffer_bytes[(k, s)]
                                        for k, s in self.lives}
        rings = {pool: [jnp.zeros((R, *_ring_aval(a).shape), _ring_aval(a).dtype)
                        for a in avals[self.pools[pool][0]]] for pool, R in sizes.items()}
        parts = sorted({i for k, s in t_units for i in _parts_of(cs, k, s)})
        acc, stk = {}, {}
        for i in parts:
            aval = cs.traced.avals[cs.parts[i].body]
            if cs.parts[i].reduce == G.Reduce.Stack:
                stk[i] = jnp.zeros((M, *aval.shape), aval.dtype)
            else:
                acc[i] = jnp.zeros(aval.shape, aval.dtype)
        if share is None:
            table = jnp.asarray(self.rows)
            slot_of = {ks: jnp.asarray(sl) for ks, sl in self.slots.items()}
        else:  # this device's rank's rows and slots (program inputs)
            table, slots = self.shared_in
            slot_of = {ks: slots[j] for j, ks in enumerate(share.kinds)}

        def unit_io(items):
            """(ring kinds read, ring kinds written, parts added to) of a unit's items."""
            rd = {pool_of[key[:2]] for it in items for key in item_reads(cs, it)
                  if key[:2] in pool_of}
            wr = {pool_of[key[:2]] for it in items for key in item_writes(cs, it)
                  if key[:2] in pool_of}
            ps = {i for it in items if it[0] == "run" for i in _parts_of(cs, it[1], it[2])}
            return sorted(rd - wr), sorted(wr), sorted(ps)

        def run_unit(items, ms, rd, wr, ps):
            def branch(w, r, row):
                w_rings, w_acc, w_stk, dep = w
                w_rings = {ks: list(v) for ks, v in w_rings.items()}
                w_acc, w_stk = dict(w_acc), dict(w_stk)
                r_rings = dict(r)
                local: dict[tuple, list] = {}

                def mat(j):
                    return row[ms[j]]

                def get(key):
                    if key in local:
                        return local[key]
                    k, s, j = key
                    pool = pool_of[(k, s)]
                    src = w_rings[pool] if pool in w_rings else r_rings[pool]
                    slot = slot_of[(k, s)][mat(j)]
                    return [jc.from_wire(jax.lax.dynamic_index_in_dim(x, slot, keepdims=False),
                                         a.dtype) for x, a in zip(src, avals[(k, s)])]

                def put(key, v):
                    local[key] = v
                    k, s, j = key
                    if (k, s) in pool_of:
                        pool, slot = pool_of[(k, s)], slot_of[(k, s)][mat(j)]
                        w_rings[pool] = [
                            jax.lax.dynamic_update_index_in_dim(x, _ring_in(y), slot, 0)
                            for x, y in zip(w_rings[pool], v)]

                def add(i, j, x):
                    if i in w_acc:
                        w_acc[i] = w_acc[i] + x
                    else:
                        w_stk[i] = jax.lax.dynamic_update_index_in_dim(w_stk[i], x, mat(j), 0)

                def mb(v, j):  # microbatch ``j`` of loop input ``v``
                    return jax.lax.dynamic_index_in_dim(mbs[v], mat(j), keepdims=False)

                tok = _Token(dep)
                self._items(list(items), 0, outer, mb, get, put, add, lambda: w_acc, tok)
                return w_rings, w_acc, w_stk, tok.dep

            return branch

        units = []  # (row column, id, items, microbatch columns, rd, wr, ps)
        for j, pat in enumerate(t_stretches):
            n = 1 + max(it[3] for it in pat)
            units.append((0, j, pat, list(range(3, 3 + n))) + unit_io(pat))
        for j, (kind, s) in enumerate(t_units):
            it = ("run", kind, s, 0, -1)
            units.append((1, j, (it,), [2]) + unit_io([it]))

        def body(t, carry):
            rg, ac, sk, dep = carry
            rg, ac, sk = dict(rg), dict(ac), dict(sk)
            row = table[t]
            for col, j, items, ms, rd, wr, ps in units:
                w = ({ks: rg[ks] for ks in wr}, {i: ac[i] for i in ps if i in ac},
                     {i: sk[i] for i in ps if i in sk}, dep)
                r = {ks: rg[ks] for ks in rd if ks in rg}
                w_rings, w_acc, w_stk, dep = jax.lax.switch(
                    (row[col] == j).astype(jnp.int32),
                    [lambda w, r, row: w, run_unit(items, ms, rd, wr, ps)], w, r, row)
                rg.update(w_rings)
                ac.update(w_acc)
                sk.update(w_stk)
            return rg, ac, sk, dep

        _, acc, stk, token.dep = jax.lax.fori_loop(0, share.T if share else len(self.rows),
                                                  body, (rings, acc, stk, token.dep))
        env.acc.update(acc)
        for i, x in stk.items():
            env.stack_rows[i] = [(0, M, 1, x)]

    @property
    def comms(self) -> list:
        """The transfer contexts this program's calls use (a ``SharedProgram``: its ranks')."""
        return [self.comm]

    def set_timeout(self, timeout) -> None:
        """Bounds every wait of the next steps (seconds)."""
        if self.timeout != float(timeout):
            self.timeout = float(timeout)
            self.comm.set_timeout(self.timeout)

    def compile(self, vals):
        """Traces and compiles the program for these inputs."""
        self.compiled = self.lower(vals).compile()

    def lower(self, vals):
        """Traces the program for these inputs (``jax.stages.Lowered``; its ``compile()``
        runs in XLA without the GIL, so several ranks' programs compile in parallel)."""
        return self.fn.lower(self._args(vals))

    def lowered_text(self) -> str:
        """The program's StableHLO, lowered from the loop inputs' avals (tests inspect its
        custom calls)."""
        cs = self.cs
        return self.fn.lower([jax.ShapeDtypeStruct(cs.traced.avals[o].shape,
                                                   cs.traced.avals[o].dtype,
                                                   sharding=cs.sharding(o, self.rank))
                              for o in self.needs]).as_text()

    def _args(self, vals):
        return self.cs.place(self.needs, [vals[o] for o in self.needs], self.rank)

    def __call__(self, vals) -> dict[int, Any]:
        """Runs one step; a failure (here or on another rank) raises ``ExecutionError``
        naming the rank where it started."""
        try:
            outs = (self.compiled or self.fn)(self._args(vals))
            jax.block_until_ready(outs)
        except BaseException as e:
            raise self.error(e) from e
        return dict(zip(self.mine, outs[1:]))

    def error(self, e: BaseException) -> ExecutionError:
        """``e`` (raised while running the program) as the step's ``ExecutionError``: the
        transfer context's failure when it has one (the rank it started on named), else
        ``e`` (a task error), after telling the other ranks."""
        if isinstance(e, ExecutionError):
            return e
        got = self.comm.failure()
        if got is not None:
            origin, msg = got
        else:
            origin, msg = self.rank, f"rank {self.rank}: {type(e).__name__}: {e}"
            if self.comm.attached:
                self.comm.abort(msg)
        err = ExecutionError(msg)
        err.failed_rank = origin
        return err

    def events(self) -> list[tuple]:
        """The last step's recorded events in the interpreter's format (``Executor.events``:
        instr, op, buffer, peer, posted, started, completed in ns) for its instruction stream:
        a RUN spans its tasks' begin and end markers, a SEND or RECV is its transfer (matched
        by order per peer and channel, as the handlers match them), a FREE happens when the
        RUN before it ended (where the interpreter frees). Empty unless the comm recorded."""
        cs = self.cs
        marks = self.comm.take_marks()
        comm_events = self.comm.take_events()
        prog = cs.programs[self.rank]
        ops = [op.split(".")[-1].upper() for op, _, _, _ in prog]
        tasks_per_run = [len(cs.buffers.tasks_of(self.rank, a)) for (_, a, _, _), op in zip(prog, ops)
                         if op == "RUN"]
        if not marks or len(marks) != 2 * sum(tasks_per_run):
            return []
        spans, pos = [], 0
        for n in tasks_per_run:
            spans.append((marks[pos][1], marks[pos + 2 * n - 1][1]))
            pos += 2 * n
        instr_of = {(op, b): i for i, ((_, _, b, _), op) in enumerate(zip(prog, ops))
                    if op in ("SEND", "RECV")}
        order = self._order  # (peer, channel, send) -> buffer ids of one step, in order
        out, run_i = [], 0
        last_end = spans[0][0]
        for i, ((_, a, b, peer), op) in enumerate(zip(prog, ops)):
            if op == "RUN":
                t0, t1 = spans[run_i]
                out.append((i, "RUN", -1, -1, t0, t0, t1))
                last_end = t1
                run_i += 1
            elif op == "FREE":
                out.append((i, "FREE", b, -1, last_end, last_end, last_end))
        for kind, peer, chan, _, seq, po, st, co in comm_events:
            ids = order.get((peer, chan, kind == 0))
            if not ids:
                continue
            b = ids[seq % len(ids)]
            op = "SEND" if kind == 0 else "RECV"
            out.append((instr_of[(op, b)], op, b, peer, po, st or po, co or st or po))
        out.sort()
        return out

    def _program(self, args):
        cs = self.cs
        lits = cs.traced.literals
        vals = dict(zip(self.needs, args))

        def outer(v):
            o, _ = cs.loop_src[v]
            return vals[o] if o in vals else lits[o]

        env = _Env()
        token = _Token(jnp.zeros((), jnp.int32))
        self._loop(env, outer, self._whole_mb(outer, {}), token)
        final = self._final_parts(env, self.mine)
        # every send delivered before the program ends
        cid = self.comm.id
        if self.D == 1:
            done = ffi.drain(cid, token.dep)
        else:  # every device drains its own sends
            done = self._per_device(lambda t: (ffi.drain(cid, t),), [token.dep],
                                    [PartitionSpec()], [PartitionSpec()])[0]
        return [done] + [final[i] for i in self.mine]

    # -- transfers -------------------------------------------------------------------------
    def _layout(self, k, s):
        """The avals of a (k, s) buffer as they cross (``_jax_compat.wire_aval``: typed keys
        as their key data)."""
        return [jc.wire_aval(a) for a in self.cs.buffers.layout(k, s)]

    def _specs(self, k, s) -> list[PartitionSpec]:
        """How a (k, s) buffer's arrays are laid out on a rank's devices when they cross:
        split over the batch axes along their leading (batch) dimension where it divides,
        else replicated; the same on both ranks, so device i sends to device i."""
        return [self.cs.mesh.batch_spec(a.shape) for a in self._layout(k, s)]

    def _local(self, k, s) -> list:
        """The per-device (shard) avals of a (k, s) buffer."""
        out = []
        for a, spec in zip(self._layout(k, s), self._specs(k, s)):
            shape = list(a.shape)
            for dim, entry in enumerate(spec):
                if entry is not None:
                    names = entry if isinstance(entry, tuple) else (entry,)
                    for n in names:
                        shape[dim] //= int(self.sub.shape[n])
            out.append(jax.ShapeDtypeStruct(tuple(shape), a.dtype))
        return out

    def _per_device(self, fn, args, in_specs, out_specs):
        """``fn`` called on every device of the rank with its shards (``shard_map`` over the
        rank's sub-mesh): how the transfer calls run on a rank of several devices."""
        return jax.shard_map(fn, mesh=self.sub, in_specs=tuple(in_specs),
                             out_specs=tuple(out_specs), check_vma=False)(*args)

    def _mark(self, phase, dep, after):
        """A task boundary marker (``baton_mark``) that runs after ``after`` (the task's
        outputs) exist. On several devices it is called on each (only shard 0's is kept),
        reading one element of each output (a whole sharded output would be gathered)."""
        cid = self.comm.id
        if self.D == 1:
            return ffi.mark(cid, phase, dep, after)
        small = [x.reshape(-1)[:1] for x in after if x.size]
        return self._per_device(lambda t, *xs: (ffi.mark(cid, phase, t, list(xs)),),
                                [dep, *small], [PartitionSpec()] * (1 + len(small)),
                                [PartitionSpec()])[0]

    def _comm(self, group, base, get, put, token):
        """One ``baton_comm`` custom call for a stretch of transfers: it posts the stretch's
        sends and receives and returns the arrays of the receives it waits on. On a rank of
        several devices, one call per device (``shard_map``) on its shards."""
        sends = [jc.to_wire(x) for op, k, s, m, _ in group if op == "send"
                 for x in get((k, s, m))]
        ops = [(_OP_KIND[op], peer, self.cs.buffers.channel(k, s), s)
               for op, k, s, _, peer in group]
        if self.D == 1:
            outs = [jax.ShapeDtypeStruct(a.shape, a.dtype)
                    for op, k, s, _, _ in group if op == "wait" for a in self._layout(k, s)]
            token.dep, got = ffi.comm(self.comm.id, ops, token.dep, sends, outs)
        else:
            outs = [a for op, k, s, _, _ in group if op == "wait" for a in self._local(k, s)]
            send_specs = [sp for op, k, s, _, _ in group if op == "send"
                          for sp in self._specs(k, s)]
            recv_specs = [sp for op, k, s, _, _ in group if op == "wait"
                          for sp in self._specs(k, s)]
            cid = self.comm.id

            def per_device(tok, *xs):
                t, got = ffi.comm(cid, ops, tok, list(xs), outs)
                return (t, *got)

            res = self._per_device(per_device, [token.dep, *sends],
                                   [PartitionSpec(), *send_specs],
                                   [PartitionSpec(), *recv_specs])
            token.dep, got = res[0], list(res[1:])
        pos = 0
        for op, k, s, m, _ in group:
            if op == "wait":
                avals = self.cs.buffers.layout(k, s)
                put((k, s, m), [jc.from_wire(x, a.dtype)
                                for x, a in zip(got[pos:pos + len(avals)], avals)])
                pos += len(avals)


_OP_KIND = {"send": 0, "post": 1, "wait": 2}  # CommOpKind (cpp/include/baton/comm.h)


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
