"""Steps as XLA programs: a one-rank step as one program, one rank's loop as one program.

**One rank** (``SingleProgram``, ``baton.jit(single_program=...)``). When every stage of a
plan is on one rank there is nothing to overlap: the executor would only add a host round
trip per task (dispatch, output allocation, the optimizer as its own call). As Megatron-LM
does for a pipeline of size 1, Baton then compiles the whole step (the code before the loop,
the rank's tasks in the schedule's order, the reductions and the code after the loop) into
one jitted function. The schedule still decides the order and so the memory profile: GPipe
runs every forward before any backward and keeps every stash, 1F1B (fused) one microbatch at
a time, ZB-H1 F, I and W.

**One rank of several** (``RankProgram``; one process per rank, or several ranks in one
process, each program on its rank's device). The rank's instruction stream becomes one jitted
program of its microbatch loop: its tasks in the stream's order, and each stretch of transfers
between two tasks one XLA FFI custom call (``baton_comm``, ``ffi.py``) that posts sends and
receives on the transport and waits for receives where the next task needs them, from XLA's
thread with no Python. A scalar token threads every FFI call in stream order (each reads and
writes it); sends read the arrays they send, waits produce the arrays tasks read, and each
task's end marker (``baton_mark``) reads its outputs, so the transfers happen in the stream's
order and no earlier than their data (the argument is in ``docs/ARCHITECTURE.md``). Transfers
match by order per (peer, channel), the verifier's FIFO model; the tags need no buffer id.

The loop is a table (``RankProgram._loop``): one ``fori_loop`` whose body holds each *unit* of
the rank once (each distinct task, each distinct transfer stretch with its microbatches as
symbols), each a two-branch ``lax.switch`` run when the step's row names it; buffers live in
rings, one per set of kinds of equal avals, a slot per buffer (``ring_slots``). So every task
is compiled once per rank.

**One rank** rolls its task list into loops instead: ``roll`` splits the items into runs of a
repeating pattern whose microbatches grow by ``delta`` per repetition (``[FB0]`` x 8 for fused
1F1B; ``[F0 I0 W0]`` x 8 for ZB-H1) and each run of two or more repetitions becomes a
``lax.scan``:

* weight-gradient sums are its carry (zeros, ``+``, ``/ M``);
* a buffer read one repetition after the one that made it is a carry slot, written where it
  is made and read where the next repetition reads it;
* microbatch slices are its ``xs``;
* buffers read after the run and stacked per-microbatch outputs are its ``ys``.

A pattern is rolled only when every buffer a repetition reads is made earlier in the same
repetition or in the previous one (a carry slot): a buffer made before the run would have to
be read from a stack of copies. Items outside any run are called in place.

Traced rank programs record their markers and transfers (a runtime switch of the same
executable; ``RankProgram.events``); profiling (``capture``) and traced one-rank steps run on
the interpreter.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from .. import _core
from .. import _jax_compat as jc
from ..errors import ExecutionError
from . import ffi
from .tasks import buffer_reads, donatable, final_part, parts_of, task_exes

G = _core.graph
_MAX_PERIOD_PER_STAGE = 4
_MAX_ITEMS_PER_STAGE = 16  # a rank's pattern (rolled lowering): its tasks and transfers

# An item: (op, kind, stage, microbatch, peer). op "run": kind a task kind (F, B, I, W, FB);
# "send" / "post" (a receive posted) / "wait" (a receive waited on): kind a buffer kind.
Item = tuple


def task_list(cs, rank: int = 0) -> list[tuple[str, int, int]]:
    """A rank's tasks in program order: (kind, stage, microbatch); fused F+B as ``FB``."""
    b = cs.buffers
    return [t for a in range(len(b.rank_actions[rank])) for t in b.tasks_of(rank, a)]


def _exes(cs, kind, s):
    return task_exes(cs.tasks, kind, s)


def reads(cs, kind, s, m) -> list[tuple[str, int, int]]:
    """Buffers (kind, stage, microbatch) a task passes to its function (``buffer_reads``
    of the plan's reads)."""
    return buffer_reads(_exes(cs, kind, s)[0], cs.buffers.reads(kind, s, m))


def writes(cs, kind, s, m) -> list[tuple[str, int, int]]:
    """Buffers a task makes (the plan's, ``Buffers.writes``), but its weight gradients: a
    program adds them to its sums directly."""
    return [key for key in cs.buffers.writes(kind, s, m) if key[0] != "WGrad"]


def item_reads(cs, it: Item) -> list[tuple[str, int, int]]:
    op, k, s, m, _ = it
    if op == "run":
        return reads(cs, k, s, m)
    return [(k, s, m)] if op == "send" else []


def item_writes(cs, it: Item) -> list[tuple[str, int, int]]:
    op, k, s, m, _ = it
    if op == "run":
        return writes(cs, k, s, m)
    return [(k, s, m)] if op == "wait" else []


def _shift(it: Item, d: int) -> Item:
    return (it[0], it[1], it[2], it[3] + d, it[4])


def rank_items(cs, rank: int) -> list[Item]:
    """A rank's program as items, read from the C++ rank program (``cs.rank_ir()``,
    docs/RANK_IR.md), which says where each group of transfers is posted (its receives where
    the plan posts them: before the RUN that precedes the RECV) and where each receive is
    waited on (just before the first task that reads it). The C++ verifier checks what the
    FFI transfers need: each wait follows its post, and the waits of one (peer, channel) come
    in post order."""
    prog = cs.rank_ir().programs[rank]
    bufs = cs.buffers
    items: list[Item] = []

    def key(b):
        return bufs.key(prog.buffers[b].id)

    for ins in prog.instrs:
        if ins.op == _core.RankOp.POST:
            for t in prog.groups[ins.group].transfers:
                x = prog.transfers[t]
                op = "send" if x.dir == _core.TransferDir.SEND else "post"
                items.append((op, *key(x.buffer), x.peer))
        elif ins.op == _core.RankOp.WAIT:
            x = prog.transfers[ins.transfer]
            items.append(("wait", *key(x.buffer), x.peer))
        elif ins.op == _core.RankOp.RUN:
            for kind, s, m in bufs.tasks_of(rank, prog.units[ins.unit].action):
                items.append(("run", kind, s, m, -1))
    return items


def _analyze(cs, pat: list[Item], delta: int):
    """The carry slots of ``pat`` as a scan body advancing ``delta`` microbatches per
    repetition, or None when it cannot be one. A slot ``(k, s, m)`` is a buffer the pattern
    makes at microbatch ``m`` and the next repetition reads (there at ``m`` again, i.e.
    ``m - delta`` relative to it)."""
    makers: dict[tuple[str, int], dict[int, int]] = {}
    for j, it in enumerate(pat):
        for k, s, m in item_writes(cs, it):
            if m in makers.setdefault((k, s), {}):
                return None
            makers[(k, s)][m] = j
    slots = _Slots()
    for j, it in enumerate(pat):
        for k, s, m in item_reads(cs, it):
            mk = makers.get((k, s))
            if mk is None:
                # made before the run: the scan would read it from a stack of the buffers
                # (copies, as slow as the zero-filled stacked outputs of stacked_buffers)
                return None
            if mk.get(m, len(pat)) < j:
                continue  # made earlier in this repetition
            if m + delta in mk:
                slots.add((k, s, m + delta))
                if mk[m + delta] < j:  # overwritten before this read: both live at once
                    slots.copies += 1
                continue
            return None
    return slots


class _Slots(set):
    """Carry slots; ``copies``: reads of a slot's previous value after the repetition has
    made its new one. Both values are then live at once, so the loop's buffer cannot be updated
    in place (XLA copies the new value into it every repetition: an 11 MB stash per microbatch
    for the GPT of the benchmarks); read before it is overwritten, the slot is updated in
    place."""

    copies = 0


def _last_reads(cs, items) -> dict[tuple, int]:
    """The last position in ``items`` that reads each buffer."""
    last: dict[tuple, int] = {}
    for pos, it in enumerate(items):
        for key in item_reads(cs, it):
            last[key] = pos
    return last


def _stacked_out(cs, last_read, pat, r, d, end, slots) -> list[tuple[str, int, int]]:
    """The buffers (pattern microbatch) a run of ``pat`` (ending at position ``end``) makes
    that items after it read: they leave the scan stacked over its repetitions (its ``ys``),
    except the last repetition's value of a carry slot (the final carry)."""
    out = []
    for key in sorted({key for it in pat for key in item_writes(cs, it)}):
        k, s, m = key
        later = [t for t in range(r) if last_read.get((k, s, m + t * d), -1) >= end]
        if later and not (key in slots and later == [r - 1]):
            out.append(key)
    return out


def roll(cs, items, max_period=None, stacked=True) -> list[tuple[list[Item], int, int]]:
    """``items`` as runs ``(pattern, repetitions, delta)``: repetition t runs the pattern's
    items at microbatch ``m + t * delta``. Greedy from the front: among the (period, delta)
    with at least two repetitions, the one whose carry slots are all updated in place (see
    _Slots; else the fewest copies), then the one covering the most items, then the shortest
    period and the smallest delta; an item no period covers is a run of one. ``stacked``
    False: no run hands stacked buffers to later items (see _stacked_out)."""
    n = len(items)
    if max_period is None:
        max_period = _MAX_PERIOD_PER_STAGE * cs.num_stages
    max_p = max(1, max_period)
    last_read = _last_reads(cs, items)
    runs = []
    i = 0
    while i < n:
        best = (1, 1, 1)  # (period, repetitions, delta)
        # (-slot copies, items covered): the largest wins, then the first. A copy costs every
        # repetition; rolling only saves compile time, so no coverage pays for a copy.
        best_key = (-(1 << 30), 1)
        for p in range(1, min(max_p, (n - i) // 2) + 1):
            pat = items[i:i + p]
            for d in range(1, min(p, cs.M) + 1):
                r = 1
                while i + (r + 1) * p <= n and all(
                        items[i + r * p + j] == _shift(it, r * d) for j, it in enumerate(pat)):
                    r += 1
                if r < 2 or (0, r * p) <= best_key:
                    continue
                slots = _analyze(cs, pat, d)
                if (slots is not None and (-slots.copies, r * p) > best_key
                        and (stacked or not _stacked_out(cs, last_read, pat, r, d,
                                                         i + p * r, slots))):
                    best, best_key = (p, r, d), (-slots.copies, r * p)
        p, r, d = best
        runs.append((list(items[i:i + p]), r, d))
        i += p * r
    return runs


def _rotate(cs, runs):
    """Runs whose pattern starts and ends with transfers (rank 1 of a 1F1B: ``[<Act0 FB1
    >Grad1 +Act0]``) split a stretch of transfers at every repetition: two callbacks where one
    would do. Such a run becomes its first transfers in place, the pattern rotated (``[FB1
    >Grad1 +Act0 <Act0]``) for one repetition fewer, and the last repetition's rest in
    place."""
    out = []
    for pat, r, d in runs:
        k = 0
        while k < len(pat) and pat[k][0] != "run":
            k += 1
        if r > 2 and 0 < k < len(pat) and pat[-1][0] != "run":
            head, rest = pat[:k], pat[k:]
            rot = rest + [_shift(it, d) for it in head]
            if _analyze(cs, rot, d) is not None:
                out += [([it], 1, 1) for it in head]
                out.append((rot, r - 1, d))
                out += [([_shift(it, (r - 1) * d)], 1, 1) for it in rest]
                continue
        out.append((pat, r, d))
    return out


class _Env:
    """Values of one step while it is traced: buffers per (kind, stage, microbatch), either
    single or rows of a scan's stacked output; part sums; stacked parts."""

    def __init__(self):
        self.single: dict[tuple, list] = {}
        self.rows: dict[tuple[str, int], list[tuple[int, int, int, list]]] = {}
        self.acc: dict[int, Any] = {}
        self.stack_single: dict[int, dict[int, Any]] = {}
        self.stack_rows: dict[int, list[tuple[int, int, int, Any]]] = {}

    def get(self, key):
        if key in self.single:
            return self.single[key]
        k, s, m = key
        for m0, r, d, ys in self.rows.get((k, s), ()):
            if m0 <= m < m0 + r * d and (m - m0) % d == 0:
                return [y[(m - m0) // d] for y in ys]
        raise KeyError(f"internal: buffer {key} is read before it is made")

    def add(self, cs, i, m, x):
        if cs.parts[i].reduce == G.Reduce.Stack:
            self.stack_single.setdefault(i, {})[m] = x
        else:
            self.acc[i] = x if i not in self.acc else self.acc[i] + x

    def stacked_part(self, i, M):
        rows = self.stack_rows.get(i, [])
        if len(rows) == 1 and rows[0][:3] == (0, M, 1):
            return rows[0][3]
        per = dict(self.stack_single.get(i, {}))
        for m0, r, d, y in rows:
            for t in range(r):
                per[m0 + t * d] = y[t]
        return jnp.stack([per[m] for m in range(M)])


def _run_task(cs, kind, s, m, inv, mb, get, put, add, call):
    """Calls one task's function(s) (plain, traced into the enclosing program); ``call(fn,
    args)`` calls one of them."""
    exes = _exes(cs, kind, s)
    exe = exes[0]
    args = [inv(v) for v in exe.in_groups[0]] + [mb(v, m) for v in exe.in_groups[1]]
    for key in buffer_reads(exe, cs.buffers.reads(kind, s, m)):
        args += get(key)
    got = exe.split(call(exe.plain, args))
    wgrad_parts, mb_parts = exe.body
    if len(exes) == 2:  # B as I then W: I's WStash goes straight to W
        we = exes[1]
        wargs = [inv(v) for v in we.in_groups[0]] + [mb(v, m) for v in we.in_groups[1]]
        got["wgrad"] = we.split(call(we.plain, wargs + got["wstash"]))["wgrad"]
        wgrad_parts = we.body[0]
    for key, v in cs.buffers.outputs(kind, s, m, got):
        if key[0] != "WGrad":  # (summed below)
            put(key, v)
    for i, x in zip(wgrad_parts, got["wgrad"]):
        add(i, m, x)
    for i, x in zip(mb_parts, got["mb"]):
        add(i, m, x)


def _parts_of(cs, kind, s):
    return parts_of(cs.tasks, kind, s)


class _Token:
    """The scalar that orders a rank program's tasks and callbacks (None: not ordered)."""

    def __init__(self, dep):
        self.dep = dep

    def call(self, fn, args):
        """``fn(*args)`` started after what precedes the token (its outputs are tied to the
        token by ``tie`` once the task has added them to the sums, so XLA can fuse the adds
        into the task)."""
        if self.dep is None:
            return fn(*args)
        args, self.dep = jax.lax.optimization_barrier((list(args), self.dep))
        return fn(*args)

    def tie(self, xs):
        """``xs`` (e.g. updated sums) computed before whatever follows the token."""
        if self.dep is None or not xs:
            return xs
        xs, self.dep = jax.lax.optimization_barrier((list(xs), self.dep))
        return xs


class _LoopProgram:
    """The microbatch loop of one rank as traced code: items rolled into scans (see the module
    docstring). Subclasses give the items and, for a rank of several, the transfers."""

    marks = False  # task boundary markers (RankProgram: baton_mark calls)

    def __init__(self, cs, rank, items, max_period=None, stacked=True):
        self.cs = cs
        self.rank = rank
        self.items = items
        self.runs = _rotate(cs, roll(cs, items, max_period, stacked))
        last_read = _last_reads(cs, items)
        self._keep = []  # per run: the buffers it makes that later items read (its ys)
        self._slots = []  # per run: its carry slots
        pos = 0
        for pattern, r, d in self.runs:
            end = pos + len(pattern) * r
            slots = sorted(_analyze(cs, pattern, d) or ()) if r > 1 else []
            self._keep.append(_stacked_out(cs, last_read, pattern, r, d, end, slots)
                              if r > 1 else [])
            self._slots.append(slots)
            pos = end

    def stacked_buffers(self) -> list[str]:
        """Buffer kinds a scan hands to later items stacked over its microbatches (GPipe's
        stashes). Such a program is slower than the executor: XLA zero-fills each stacked
        output before the loop writes it (about 216 MB per step for the GPT of
        bench/one_rank.py, 632 against 599 ms), where the executor keeps per-microbatch
        buffers."""
        return sorted({f"{k}{s}" for keep in self._keep for k, s, _ in keep})

    def describe(self) -> str:
        """The runs, e.g. ``scan 8 x [FB0]`` or ``scan 8 x [F0]; [B0]; ...``; transfers
        as ``>Act0`` (send), ``+Grad1`` (receive posted), ``<Grad1`` (received)."""
        sym = {"send": ">", "post": "+", "wait": "<"}

        def name(it):
            return f"{it[1]}{it[2]}" if it[0] == "run" else f"{sym[it[0]]}{it[1]}{it[2]}"

        out = []
        for pat, r, d in self.runs:
            head = f"scan {r} x " if r > 1 else ""
            step = f"/{d}" if r > 1 and d > 1 else ""
            out.append(head + "[" + " ".join(name(it) for it in pat) + "]" + step)
        return "; ".join(out)

    # -- transfers (RankProgram) --------------------------------------------------------
    def _comm(self, group, base, get, put, token):
        raise ValueError("internal: this program has no transfers")

    def _mark(self, phase, dep, after):
        raise ValueError("internal: this program has no markers")

    # -- the traced loop ------------------------------------------------------------------
    def _loop(self, env, outer, whole_mb, token):
        """Traces the loop into ``env`` (its sums, stacked parts and buffers)."""
        cs = self.cs
        pending: list[Item] = []

        def flush():
            if pending:
                self._items(list(pending), 0, outer, lambda v, mm: whole_mb(v)[mm], env.get,
                            env.single.__setitem__, lambda i, mm, x: env.add(cs, i, mm, x),
                            lambda: env.acc, token)
                pending.clear()

        for (pattern, r, d), keep, slots in zip(self.runs, self._keep, self._slots):
            if r == 1:
                pending.extend(pattern)
            else:
                flush()
                self._scan(pattern, r, d, keep, slots, env, outer, whole_mb, token)
        flush()

    def _items(self, items, base, inv, mb, get, put, add, acc, token):
        """Traces ``items`` in order: tasks (tied to the token), and each stretch of
        transfers between two tasks as one callback."""
        cs = self.cs
        i = 0
        while i < len(items):
            it = items[i]
            if it[0] == "run":
                _, kind, s, m, _ = it
                made: dict[tuple, list] = {}

                def put_(key, v, made=made):
                    made[key] = v

                if self.marks:  # the task starts (recorded only when tracing)
                    token.dep = self._mark(0, token.dep, [])
                _run_task(cs, kind, s, m, inv, mb, get, put_, add, token.call)
                tied = []
                if token.dep is not None:  # the task's buffers and sums before what follows
                    a = acc()
                    touched = [j for j in _parts_of(cs, kind, s) if j in a]
                    keys = list(made)
                    tied = token.tie([a[j] for j in touched] + [made[k] for k in keys])
                    for j, x in zip(touched, tied):
                        a[j] = x
                    for k, v in zip(keys, tied[len(touched):]):
                        made[k] = v
                for k, v in made.items():
                    put(k, v)
                if self.marks:
                    # the task ended: the mark reads its outputs and sums, so it runs once
                    # they are computed (an optimization_barrier orders XLA's passes, not its
                    # run time: a token through one alone would not wait for the compute)
                    token.dep = self._mark(1, token.dep, jax.tree.leaves(tied))
                i += 1
            else:
                j = i
                while j < len(items) and items[j][0] != "run":
                    j += 1
                self._comm(items[i:j], base, get, put, token)
                i = j

    def _scan(self, pattern, r, d, keep, slots, env, outer, whole_mb, token):
        cs = self.cs
        slot_read = {(k, s, m - d): (k, s, m) for k, s, m in slots}  # read key -> slot
        # xs: microbatch slices and the repetition index (a pattern reads no buffer made before
        # the run except through a carry slot, see _analyze)
        xs: dict[tuple, Any] = {("t",): jnp.arange(r, dtype=jnp.int32)}
        for it in pattern:
            if it[0] == "run":
                for exe in _exes(cs, it[1], it[2]):
                    for v in exe.in_groups[1]:
                        xs[("m", v, it[3])] = whole_mb(v)[it[3]:it[3] + (r - 1) * d + 1:d]
        # carry: the sums the pattern adds to, the slots, the token
        parts = set()
        for it in pattern:
            if it[0] == "run":
                parts.update(_parts_of(cs, it[1], it[2]))
        summed = sorted(i for i in parts if cs.parts[i].reduce != G.Reduce.Stack)
        stacked = sorted(i for i in parts if cs.parts[i].reduce == G.Reduce.Stack)
        init_acc = {}
        for i in summed:
            if i in env.acc:
                init_acc[i] = env.acc[i]
            else:
                aval = cs.traced.avals[cs.parts[i].body]
                init_acc[i] = jnp.zeros(aval.shape, aval.dtype)
        init_slots = {key: env.get(rd) for rd, key in slot_read.items()}
        init = (init_acc, init_slots, token.dep)

        def body(carry, x):
            acc, slot_vals, dep = carry
            acc = dict(acc)
            local: dict[tuple, list] = {}
            st: dict[int, Any] = {}
            tok = _Token(dep)

            def get(key):
                return local[key] if key in local else slot_vals[slot_read[key]]

            def add(i, m, v):
                if i in acc:
                    acc[i] = acc[i] + v
                else:
                    st[i] = v

            self._items(pattern, x[("t",)] * d, outer, lambda v, mm: x[("m", v, mm)], get,
                        local.__setitem__, add, lambda: acc, tok)
            return (acc, {key: local[key] for key in slot_vals}, tok.dep), \
                ({k: local[k] for k in keep}, st)

        (acc, slot_vals, dep), (ys, st) = jax.lax.scan(body, init, xs, length=r)
        token.dep = dep
        env.acc.update(acc)
        for (k, s, m), v in slot_vals.items():
            env.single[(k, s, m + (r - 1) * d)] = v
        for key in keep:
            k, s, m = key
            env.rows.setdefault((k, s), []).append((m, r, d, ys[key]))
        m0 = {}  # the first microbatch each part is added at
        for it in pattern:
            if it[0] == "run":
                for i in _parts_of(cs, it[1], it[2]):
                    m0.setdefault(i, it[3])
        for i in stacked:
            env.stack_rows.setdefault(i, []).append((m0[i], r, d, st[i]))

    def _final_parts(self, env, idx):
        """The loop's outputs ``idx``: parts reduced (mean, sum or stack)."""
        cs = self.cs
        return {i: final_part(cs.parts[i], env.acc.get(i),
                              lambda i=i: env.stacked_part(i, cs.M), cs.M) for i in idx}

    def _whole_mb(self, outer, split):
        cs = self.cs

        def whole_mb(v):  # the loop input as [M, batch/M, ...]
            if v not in split:
                x = jnp.asarray(outer(v))
                x = x.reshape((cs.M, x.shape[0] // cs.M, *x.shape[1:]))
                spec = cs.mesh.batch_spec(x.shape[1:])  # each microbatch over the batch axes
                if spec:
                    x = jax.lax.with_sharding_constraint(
                        x, cs.mesh.sharding(self.rank, PartitionSpec(None, *spec)))
                split[v] = x
            return split[v]

        return whole_mb


def _ring_aval(a):
    """How an array of ``a`` is kept in a ring slot: typed keys as their key data, float0 as
    bool (no widening: a ring holds values, not messages)."""
    if jc._is_key(a.dtype) or a.dtype == jax.dtypes.float0:
        return jc.wire_aval(a)
    return jax.ShapeDtypeStruct(tuple(a.shape), a.dtype)


def _ring_in(x):
    if jc._is_key(x.dtype):
        return jax.random.key_data(x)
    if x.dtype == jax.dtypes.float0:
        return jnp.zeros(x.shape, jnp.bool_)
    return x


def table_steps(items) -> list[tuple[list[Item], Item | None]]:
    """A rank's items as table steps: each task with the stretch of transfers before it (a
    stretch after the last task is a step without a task)."""
    out, cur = [], []
    for it in items:
        if it[0] == "run":
            out.append((cur, it))
            cur = []
        else:
            cur.append(it)
    if cur:
        out.append((cur, None))
    return out


def _symbolic(items) -> tuple[tuple, list[int]]:
    """``items`` with each microbatch replaced by its symbol (0, 1, ... in order of first
    appearance), and the microbatch of each symbol."""
    sym: dict[int, int] = {}
    pat = tuple((op, k, s, sym.setdefault(m, len(sym)), peer) for op, k, s, m, peer in items)
    return pat, list(sym)


def buffer_lives(cs, steps) -> dict[tuple[str, int], dict[int, tuple[int, int]]]:
    """When each ringed buffer lives: ``(kind, stage)`` -> microbatch -> (position of its
    write, position of its last read). A step's transfers are position 2i, its task 2i+1; a
    buffer nothing reads lives at its write only. Only kinds a later unit reads are ringed
    (a buffer only sent is handed from its task to the stretch after it by value)."""
    read_kinds = {(k, s) for st, task in steps for it in st + ([task] if task else [])
                  for k, s, _ in item_reads(cs, it)}
    life: dict[tuple[str, int], dict[int, list[int]]] = {}
    for i, (st, task) in enumerate(steps):
        for pos, its in ((2 * i, st), (2 * i + 1, [task] if task else [])):
            for it in its:
                for k, s, m in item_writes(cs, it):
                    if (k, s) in read_kinds:
                        life.setdefault((k, s), {})[m] = [pos, pos]
                for k, s, m in item_reads(cs, it):
                    iv = life[(k, s)][m]
                    iv[1] = max(iv[1], pos)
    return {ks: {m: (w, last) for m, (w, last) in iv.items()} for ks, iv in life.items()}


def ring_slots(lives, pool_of, M: int) -> tuple[dict, dict]:
    """Rings for buffers: kinds with the same ``pool_of[(kind, stage)]`` (the same avals)
    share one ring. Returns (``(kind, stage)`` -> int32 [M], the slot of each microbatch's
    buffer; pool -> its number of slots). No buffer may be written into a slot between
    another buffer's write and its last read, both included (so a unit never reads and
    writes one slot). Slots are given greedily in order of the writes, each buffer the lowest
    slot free at its write: for intervals that is optimal, so a ring has exactly as many
    slots as the most buffers of its pool ever live at once. Sharing one ring among the
    kinds of equal shape (a rank's boundary activations and gradients; the stashes of a
    rank's two stages in a V schedule) brings a table's buffers to the schedule's live peak
    for most schedules, where per-kind rings held the sum of each kind's peak
    (``bench/results/table_memory.md``)."""
    slots = {ks: np.zeros(M, np.int32) for ks in lives}
    ends: dict = {}  # pool -> per slot, the last position its buffer is read
    order = sorted((w, ks, m, last) for ks, iv in lives.items() for m, (w, last) in iv.items())
    for w, ks, m, last in order:
        e = ends.setdefault(pool_of[ks], [])
        j = next((j for j, x in enumerate(e) if x < w), len(e))
        if j == len(e):
            e.append(last)
        else:
            e[j] = last
        slots[ks][m] = j
    sizes = {pool: len(e) for pool, e in ends.items()}
    return slots, sizes


class SingleProgram(_LoopProgram):
    """A one-rank ``CompiledStep`` as one jitted program (see the module docstring)."""

    def __init__(self, cs):
        if cs.num_ranks != 1:
            raise ValueError("internal: SingleProgram needs a one-rank plan")
        self.tasks = task_list(cs)
        # no stacked buffers between loops (XLA would zero-fill them, see stacked_buffers):
        # runs that would need them stay unrolled (GPipe's forwards)
        super().__init__(cs, 0, [("run", k, s, m, -1) for k, s, m in self.tasks],
                         stacked=False)
        # donated step inputs (baton.jit(donate_argnums=...)), each matched to a step output
        # of its shape and dtype, enter as the first argument, which XLA may overwrite
        tr = cs.traced
        made = [v for v in tr.step_outputs if v not in tr.literals and v not in tr.step_inputs]
        self.donate = list(donatable(tr.avals, tr.step_inputs, made, cs.donated,
                                     set(tr.step_outputs)))
        n = len(tr.step_inputs)
        keep = [i for i in range(n) if i not in set(self.donate)]

        def program(given, kept):
            args = [None] * n
            for i, x in zip(self.donate, given):
                args[i] = x
            for i, x in zip(keep, kept):
                args[i] = x
            return self._program(args)

        self.kept = keep
        self.fn = jax.jit(program, donate_argnums=0)

    def _split(self, args):  # (donated, kept) as ``fn`` takes them
        return [args[i] for i in self.donate], [args[i] for i in self.kept]

    def lowered_text(self, flat_args) -> str:
        """The program's StableHLO for these step inputs (tests inspect its custom calls)."""
        return self.fn.lower(*self._split(list(flat_args))).as_text()

    def __call__(self, flat_args):
        cs = self.cs
        args = cs.place(cs.traced.step_inputs, list(flat_args), 0)
        outs = self.fn(*self._split(args))
        tr = cs.traced
        it = iter(outs)
        return [tr.literals[v] if v in tr.literals else next(it) for v in tr.step_outputs]

    def _program(self, flat_args):
        cs = self.cs
        tr = cs.traced
        lits = tr.literals
        vals: dict[Any, Any] = dict(zip(tr.step_inputs, flat_args))
        for seg in cs.pre_segments:
            for v, x in zip(seg.outputs, seg.fn(*[vals[v] for v in seg.inputs])):
                vals[v] = x

        def outer(v):
            o, _ = cs.loop_src[v]
            return vals[o] if o in vals else lits[o]

        env = _Env()
        self._loop(env, outer, self._whole_mb(outer, {}), _Token(None))
        # the loop's outputs: parts reduced, then combined per outer value (as _combine)
        final = self._final_parts(env, range(len(cs.parts)))
        for o, idx in cs.by_outer.items():
            total = None
            for i in idx:
                total = final[i] if total is None else total + final[i]
            vals[o] = total
        for seg in cs.post_segments:
            for v, x in zip(seg.outputs, seg.fn(*[vals[v] for v in seg.inputs])):
                vals[v] = x
        return [vals[v] for v in tr.step_outputs if v not in lits]


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
    import os

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
