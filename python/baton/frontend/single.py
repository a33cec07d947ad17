"""One-rank steps as one XLA program (``baton.jit(single_program=...)``).

When every stage of a plan is on one rank there is nothing to overlap: the executor would only
add a host round trip per task (dispatch, output allocation, the optimizer as its own call). As
Megatron-LM does for a pipeline of size 1, Baton then compiles the whole step (the code before
the loop, the rank's tasks in the schedule's order, the reductions and the code after the loop)
into one jitted function. The schedule still decides the order and so the memory profile: GPipe
runs every forward before any backward and keeps every stash, 1F1B (fused) one microbatch at a
time, ZB-H1 F, I and W.

The task list is rolled into loops: ``roll`` splits it into runs of a repeating pattern whose
microbatch index grows by one per repetition (``[FB0]`` x 8 for fused 1F1B; ``[F0]`` x 8 then
``[B0]`` x 8 for GPipe) and each run of two or more repetitions becomes a ``lax.scan``: weight
gradient sums are its carry, microbatch slices and buffers made by earlier runs its ``xs``,
buffers read after the run and stacked per-microbatch outputs its ``ys``. A pattern is rolled
only when every buffer a repetition reads is made earlier in the same repetition or before the
run. Tasks outside any run are called in place.

Tracing and profiling (``record``/``capture``) need per-instruction events, so those steps run
on the executor as before.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .. import _core
from .executor import buffer_reads

G = _core.graph
_MAX_PERIOD_PER_STAGE = 4


def task_list(cs) -> list[tuple[str, int, int]]:
    """Rank 0's tasks in program order: (kind, stage, microbatch); fused F+B as ``FB``."""
    return [t for a in range(len(cs.rank_actions[0])) for t in cs._tasks_of(0, a)]


def _exes(cs, kind, s):
    """The task executables a task runs: one, or I then W for a B the partition split."""
    if kind == "B" and ("B", s) not in cs.tasks:
        return [cs.tasks[("I", s)], cs.tasks[("W", s)]]
    return [cs.tasks[(kind, s)]]


def reads(cs, kind, s, m) -> list[tuple[str, int, int]]:
    """Buffers (kind, stage, microbatch) a task reads (as ``CompiledStep._task_args``)."""
    return buffer_reads(_exes(cs, kind, s)[0], s, m)


def writes(cs, kind, s, m) -> list[tuple[str, int, int]]:
    """Buffers a task makes (as ``CompiledStep._run_task``)."""
    last = cs.num_stages - 1
    out = []
    if kind in ("F", "FB") and s < last:
        out.append(("Act", s, m))
    if kind == "F":
        out.append(("Stash", s, m))
    if kind in ("FB", "B", "I") and s > 0:
        out.append(("Grad", s, m))
    if kind == "I":
        out.append(("WStash", s, m))
    return out


def _valid(cs, pattern) -> bool:
    """Every buffer a repetition of ``pattern`` reads is made earlier in the same repetition
    or by none of its tasks (then it was made before the run)."""
    made: dict[tuple[str, int], int] = {}
    for kind, s, m in pattern:
        for k, bs, bm in reads(cs, kind, s, m):
            if (k, bs) in made and made[(k, bs)] != bm:
                return False
        for k, bs, bm in writes(cs, kind, s, m):
            if (k, bs) in made:  # two makers of one buffer kind: a repetition spans microbatches
                return False
            made[(k, bs)] = bm
    # a read of a buffer kind that a later task of the pattern makes: made in another repetition
    seen: set[tuple[str, int]] = set()
    for kind, s, m in pattern:
        for k, bs, _ in reads(cs, kind, s, m):
            if (k, bs) in made and (k, bs) not in seen:
                return False
        seen.update((k, bs) for k, bs, _ in writes(cs, kind, s, m))
    return True


def roll(cs, tasks) -> list[tuple[list[tuple[str, int, int]], int]]:
    """``tasks`` as runs ``(pattern, repetitions)``: repetition t runs the pattern's tasks at
    microbatch ``m + t``. Greedy from the front: the period covering the most tasks (at least
    two repetitions), the shortest on ties; a task no period covers is a run of one."""
    n = len(tasks)
    max_p = max(1, _MAX_PERIOD_PER_STAGE * cs.num_stages)
    runs = []
    i = 0
    while i < n:
        best = (1, 1)  # (period, repetitions)
        for p in range(1, min(max_p, (n - i) // 2) + 1):
            pat = tasks[i:i + p]
            r = 1
            while i + (r + 1) * p <= n and all(
                    tasks[i + r * p + j] == (k, s, m + r) for j, (k, s, m) in enumerate(pat)):
                r += 1
            if r >= 2 and r * p > best[0] * best[1] and _valid(cs, pat):
                best = (p, r)
        p, r = best
        runs.append((list(tasks[i:i + p]), r))
        i += p * r
    return runs


class _Env:
    """Values of one step while it is traced: buffers per (kind, stage, microbatch), either
    single or rows of a scan's stacked output; part sums; stacked parts."""

    def __init__(self):
        self.single: dict[tuple, list] = {}
        self.rows: dict[tuple[str, int], list[tuple[int, int, list]]] = {}  # -> (m0, r, ys)
        self.acc: dict[int, Any] = {}
        self.stack_single: dict[int, dict[int, Any]] = {}
        self.stack_rows: dict[int, list[tuple[int, int, Any]]] = {}

    def get(self, key):
        if key in self.single:
            return self.single[key]
        k, s, m = key
        for m0, r, ys in self.rows.get((k, s), ()):
            if m0 <= m < m0 + r:
                return [y[m - m0] for y in ys]
        raise KeyError(f"internal: buffer {key} is read before it is made")

    def get_range(self, key, r):
        """Buffer ``key``'s values for microbatches m..m+r-1, stacked (a scan's ``xs``)."""
        k, s, m = key
        for m0, rr, ys in self.rows.get((k, s), ()):
            if m0 <= m and m + r <= m0 + rr:
                return [y if (m0, rr) == (m, r) else y[m - m0:m - m0 + r] for y in ys]
        vals = [self.get((k, s, m + t)) for t in range(r)]
        return [jnp.stack(xs) for xs in zip(*vals)]

    def add(self, cs, i, m, x):
        if cs.parts[i].reduce == G.Reduce.Stack:
            self.stack_single.setdefault(i, {})[m] = x
        else:
            self.acc[i] = x if i not in self.acc else self.acc[i] + x

    def stacked_part(self, i, M):
        rows = self.stack_rows.get(i, [])
        if len(rows) == 1 and rows[0][:2] == (0, M):
            return rows[0][2]
        per = dict(self.stack_single.get(i, {}))
        for m0, r, y in rows:
            for t in range(r):
                per[m0 + t] = y[t]
        return jnp.stack([per[m] for m in range(M)])


def _run_task(cs, kind, s, m, inv, mb, get, put, add):
    """Calls one task's function(s) (plain, traced into the enclosing program)."""
    exes = _exes(cs, kind, s)
    exe = exes[0]
    args = [inv(v) for v in exe.in_groups[0]] + [mb(v, m) for v in exe.in_groups[1]]
    for key in buffer_reads(exe, s, m):
        args += get(key)
    got = exe.split(exe.plain(*args))
    wgrad_parts, mb_parts = exe.body
    if len(exes) == 2:  # B as I then W: I's WStash goes straight to W
        we = exes[1]
        wargs = [inv(v) for v in we.in_groups[0]] + [mb(v, m) for v in we.in_groups[1]]
        got["wgrad"] = we.split(we.plain(*(wargs + got["wstash"])))["wgrad"]
        wgrad_parts = we.body[0]
    for k, bs, bm in writes(cs, kind, s, m):
        put((k, bs, bm), got["act"] if k == "Act" else got["grad"] if k == "Grad"
            else got["stash"] if k == "Stash" else got["wstash"])
    for i, x in zip(wgrad_parts, got["wgrad"]):
        add(i, m, x)
    for i, x in zip(mb_parts, got["mb"]):
        add(i, m, x)


class SingleProgram:
    """A one-rank ``CompiledStep`` as one jitted program (see the module docstring)."""

    def __init__(self, cs):
        if cs.num_ranks != 1:
            raise ValueError("internal: SingleProgram needs a one-rank plan")
        self.cs = cs
        self.tasks = task_list(cs)
        self.runs = roll(cs, self.tasks)
        # last position that reads each buffer: a run's buffers read after it leave as ys
        last_read: dict[tuple, int] = {}
        for pos, (kind, s, m) in enumerate(self.tasks):
            for key in reads(cs, kind, s, m):
                last_read[key] = pos
        self._keep = []  # per run: the buffers it makes that later tasks read (its ys)
        pos = 0
        for pattern, r in self.runs:
            end = pos + len(pattern) * r
            made = {key for kind, s, m in pattern for key in writes(cs, kind, s, m)}
            self._keep.append(sorted(
                key for key in made
                if r > 1 and any(last_read.get((key[0], key[1], key[2] + t), -1) >= end
                                 for t in range(r))))
            pos = end
        self.fn = jax.jit(self._program)

    def stacked_buffers(self) -> list[str]:
        """Buffer kinds a scan hands to later tasks stacked over its microbatches (GPipe's
        stashes). Such a program is slower than the executor: XLA zero-fills each stacked
        output before the loop writes it (about 216 MB per step for the GPT of
        bench/one_rank.py, 632 against 599 ms), where the executor keeps per-microbatch
        buffers."""
        return sorted({f"{k}{s}" for keep in self._keep for k, s, _ in keep})

    def describe(self) -> str:
        """The runs, e.g. ``scan 8 x [FB0]`` or ``scan 8 x [F0]; scan 8 x [B0]``."""
        return "; ".join((f"scan {r} x " if r > 1 else "") + "["
                         + " ".join(f"{k}{s}" for k, s, _ in pat) + "]" for pat, r in self.runs)

    def __call__(self, flat_args):
        cs = self.cs
        args = cs._put_all(list(flat_args), 0)
        outs = self.fn(args)
        tr = cs.traced
        it = iter(outs)
        return [tr.literals[v] if v in tr.literals else next(it) for v in tr.step_outputs]

    # -- the traced program -----------------------------------------------------------
    def _program(self, flat_args):
        cs = self.cs
        tr = cs.traced
        lits = tr.literals
        vals: dict[Any, Any] = dict(zip(tr.step_inputs, flat_args))
        for seg in cs.pre_segments:
            for v, x in zip(seg.outputs, seg.fn(*[vals[v] for v in seg.inputs])):
                vals[v] = x
        M = cs.M
        split: dict[int, Any] = {}

        def outer(v):
            o, _ = cs._loop_src[v]
            return vals[o] if o in vals else lits[o]

        def whole_mb(v):  # the loop input as [M, batch/M, ...]
            if v not in split:
                x = jnp.asarray(outer(v))
                x = x.reshape((M, x.shape[0] // M, *x.shape[1:]))
                devs = cs.mesh.rank_devices[0]
                if len(devs) > 1 and x.shape[1] % len(devs) == 0:
                    from jax.sharding import NamedSharding, PartitionSpec

                    from .mesh import DATA_AXIS

                    x = jax.lax.with_sharding_constraint(
                        x, NamedSharding(cs.mesh.meshes[0], PartitionSpec(None, DATA_AXIS)))
                split[v] = x
            return split[v]

        env = _Env()
        for (pattern, r), keep in zip(self.runs, self._keep):
            if r == 1:
                kind, s, m = pattern[0]
                _run_task(cs, kind, s, m, outer, lambda v, mm: whole_mb(v)[mm], env.get,
                          env.single.__setitem__, lambda i, mm, x: env.add(cs, i, mm, x))
            else:
                self._scan(pattern, r, keep, env, outer, whole_mb)

        # the loop's outputs: parts reduced, then combined per outer value (as _combine)
        final: dict[int, Any] = {}
        for i, part in enumerate(cs.parts):
            if part.reduce == G.Reduce.Stack:
                final[i] = env.stacked_part(i, M)
            elif part.reduce == G.Reduce.Mean:
                final[i] = env.acc[i] / M
            else:
                final[i] = env.acc[i]
        for o, idx in cs._by_outer.items():
            total = None
            for i in idx:
                total = final[i] if total is None else total + final[i]
            vals[o] = total
        for seg in cs.post_segments:
            for v, x in zip(seg.outputs, seg.fn(*[vals[v] for v in seg.inputs])):
                vals[v] = x
        return [vals[v] for v in tr.step_outputs if v not in lits]

    def _scan(self, pattern, r, keep, env, outer, whole_mb):
        cs = self.cs
        made = {key for kind, s, m in pattern for key in writes(cs, kind, s, m)}
        # xs: buffers made before the run, microbatch slices
        xs: dict[tuple, Any] = {}
        for kind, s, m in pattern:
            for key in reads(cs, kind, s, m):
                if key not in made:
                    xs[("b",) + key] = env.get_range(key, r)
            for exe in _exes(cs, kind, s):
                for v in exe.in_groups[1]:
                    xs[("m", v, m)] = whole_mb(v)[m:m + r]
        # carry: the sums the pattern adds to
        parts = set()
        for kind, s, _ in pattern:
            for exe in _exes(cs, kind, s):
                parts.update(exe.body[0])
                parts.update(exe.body[1])
        summed = sorted(i for i in parts if cs.parts[i].reduce != G.Reduce.Stack)
        stacked = sorted(i for i in parts if cs.parts[i].reduce == G.Reduce.Stack)
        init = {}
        for i in summed:
            if i in env.acc:
                init[i] = env.acc[i]
            else:
                aval = cs.traced.avals[cs.parts[i].body]
                init[i] = jnp.zeros(aval.shape, aval.dtype)

        def body(carry, x):
            local: dict[tuple, list] = {}
            acc = dict(carry)
            st: dict[int, Any] = {}

            def get(key):
                return local[key] if key in local else x[("b",) + key]

            def add(i, m, v):
                if i in acc:
                    acc[i] = acc[i] + v
                else:
                    st[i] = v

            for kind, s, m in pattern:
                _run_task(cs, kind, s, m, outer, lambda v, mm: x[("m", v, mm)], get,
                          local.__setitem__, add)
            return acc, ({k: local[k] for k in keep}, st)

        acc, (ys, st) = jax.lax.scan(body, init, xs, length=r)
        env.acc.update(acc)
        for key in keep:
            k, s, m = key
            env.rows.setdefault((k, s), []).append((m, r, ys[key]))
        m0 = {}
        for kind, s, m in pattern:
            for exe in _exes(cs, kind, s):
                for i in list(exe.body[0]) + list(exe.body[1]):
                    m0.setdefault(i, m)
        for i in stacked:
            env.stack_rows.setdefault(i, []).append((m0[i], r, st[i]))
