"""The microbatch loop of one rank as traced code (``_LoopProgram``): its items rolled into
``lax.scan`` runs, each run's carry slots, sums and stacked outputs, and the items outside
runs called in place. The items, the runs, their slots and stacked outputs are the C++ pass's
over the rank program (``_core.roll_rank``, ``cpp/include/baton/roll.h``):

* weight-gradient sums are a run's carry (zeros, ``+``, ``/ M``);
* a buffer read one repetition after the one that made it is a carry slot, written where it
  is made and read where the next repetition reads it;
* microbatch slices are its ``xs``;
* buffers read after the run and stacked per-microbatch outputs are its ``ys``.

``SingleProgram`` (single_program.py) and ``RankProgram`` (rank_program.py) build on it."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .. import _core
from .rolling import Item, ItemOp, _exes, as_item, roll_options
from .task_env import _parts_of, _run_task, _Token
from ..planning.tasks import final_part, kind_name

G = _core.graph
_TRANSFERS = (ItemOp.SEND, ItemOp.POST, ItemOp.WAIT)
_MOVES = (ItemOp.OFFLOAD, ItemOp.FETCH)


def _key(k) -> tuple:
    return (k.kind, k.stage, k.microbatch)


class _LoopProgram:
    """The microbatch loop of one rank as traced code: items rolled into scans (see the
    module docstring). ``max_period``: the longest pattern (None: the pass's default);
    ``stacked`` False: no run hands stacked buffers to later items. Subclasses give the
    transfers of a rank of several."""

    marks = False  # task boundary markers (RankProgram: baton_mark calls)

    def __init__(self, cs, rank, max_period=None, stacked=True):
        self.cs = cs
        self.rank = rank
        # the rank's items and their runs (C++: baton/roll.h, over the rank program)
        rolled = _core.roll_rank(cs.core_plan, cs.rank_ir().programs[rank],
                                 roll_options(cs, max_period, stacked))
        self.items = [as_item(x) for x in rolled.items]
        self.runs = [(self.items[r.first:r.first + r.period], r.repetitions, r.delta)
                     for r in rolled.runs]
        self._slots = [[_key(k) for k in r.slots] for r in rolled.runs]  # per run: carry slots
        # per run: the buffers it makes that later items read (its ys)
        self._keep = [[_key(k) for k in r.stacked] for r in rolled.runs]

    def stacked_buffers(self) -> list[str]:
        """Buffer kinds a scan hands to later items stacked over its microbatches (GPipe's
        stashes). Such a program is slower than the executor: XLA zero-fills each stacked
        output before the loop writes it, where the executor keeps per-microbatch buffers
        (bench/results/one_rank.md)."""
        return sorted({f"{k.name}{s}" for keep in self._keep for k, s, _ in keep})

    def describe(self) -> str:
        """The runs, e.g. ``scan 8 x [FB0]`` or ``scan 8 x [F0]; [B0]; ...``; transfers
        as ``>Act0`` (send), ``+Grad1`` (receive posted), ``<Grad1`` (received)."""
        sym = {ItemOp.SEND: ">", ItemOp.POST: "+", ItemOp.WAIT: "<", ItemOp.OFFLOAD: "^",
               ItemOp.FETCH: "v"}

        def name(it):
            if it.op == ItemOp.RUN:
                return f"{kind_name(it.kind)}{it.stage}"
            return f"{sym[it.op]}{it.kind.name}{it.stage}"

        out = []
        for pat, r, d in self.runs:
            head = f"scan {r} x " if r > 1 else ""
            step = f"/{d}" if r > 1 and d > 1 else ""
            out.append(head + "[" + " ".join(name(it) for it in pat) + "]" + step)
        return "; ".join(out)

    # -- transfers and offload (RankProgram) ----------------------------------------------
    def _move(self, it, base, get, put, token):
        """An OFFLOAD or FETCH item (``RankProgram``: into and out of host slots)."""
        raise NotImplementedError(f"rank {self.rank}: this program does not offload")

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
            if it.op == ItemOp.RUN:
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
            elif it.op in _MOVES:
                self._move(it, base, get, put, token)
                i += 1
            else:
                j = i
                while j < len(items) and items[j][0] in _TRANSFERS:
                    j += 1
                self._comm(items[i:j], base, get, put, token)
                i = j

    def _scan(self, pattern, r, d, keep, slots, env, outer, whole_mb, token):
        cs = self.cs
        slot_read = {(k, s, m - d): (k, s, m) for k, s, m in slots}  # read key -> slot
        # xs: microbatch slices and the repetition index (a pattern reads no buffer made before
        # the run except through a carry slot, roll.h)
        xs: dict[tuple, Any] = {("t",): jnp.arange(r, dtype=jnp.int32)}
        for it in pattern:
            if it.op == ItemOp.RUN:
                for exe in _exes(cs, it.kind, it.stage):
                    for v in exe.in_groups[1]:
                        xs[("m", v, it.mb)] = whole_mb(v)[it.mb:it.mb + (r - 1) * d + 1:d]
        # carry: the sums the pattern adds to, the slots, the token
        parts = set()
        for it in pattern:
            if it.op == ItemOp.RUN:
                parts.update(_parts_of(cs, it.kind, it.stage))
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
            if it.op == ItemOp.RUN:
                for i in _parts_of(cs, it.kind, it.stage):
                    m0.setdefault(i, it.mb)
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
