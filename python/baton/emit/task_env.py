"""What a loop program traces its tasks with: the step's values while it is traced
(``_Env``), one task's call (``_run_task``) and the token that orders a rank program's tasks
and transfers (``_Token``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .. import _core
from .rolling import _exes
from ..planning.tasks import MB, BufKind, buffer_reads, parts_of

G = _core.graph


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
        got[BufKind.WGrad] = we.split(call(we.plain, wargs + got[BufKind.WStash]))[BufKind.WGrad]
        wgrad_parts = we.body[0]
    for key, v in cs.buffers.outputs(kind, s, m, got):
        if key[0] != BufKind.WGrad:  # (summed below)
            put(key, v)
    for i, x in zip(wgrad_parts, got[BufKind.WGrad]):
        add(i, m, x)
    for i, x in zip(mb_parts, got[MB]):
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
