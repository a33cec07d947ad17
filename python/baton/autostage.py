"""Stage boundaries Baton proposes itself, for a model written without any.

    loss = baton.auto_stage(loss_fn, stages=4)         # or stages=None: every candidate
    step = baton.jit(train_step_using(loss), ...)
    print(loss.cuts)                                  # where the boundaries went

``auto_stage`` traces the (primal) function once per argument shapes, finds the *cut points*
of its data flow and evaluates it again with a ``stage_boundary`` at the chosen ones. Because
the boundaries are inserted before differentiation, ``jax.value_and_grad(auto_stage(f))`` gets
their transposes like hand-written markers.

Cut points. The first argument is the parameters; values that depend on the other arguments
(the batch) through at least one expensive equation (anything that is not cheap elementwise or
shape work: matrix products, gathers, reductions, ...) are *activations*. After each top-level
equation (calls of jitted functions are inlined) the live activations are those defined so far
and read later. A position is a cut point when exactly one activation is live there and it has
the shape that such single live activations have most often (the residual stream between the
blocks of a layer stack); cheap values computed from the batch alone (masks, positions) are
recomputed by the stages that read them and do not count. With ``stages=k`` the k-1 cut points
that best balance the estimated flops before and after each cut are chosen (exact dynamic
programming over the candidates, minimising the largest stage); with ``stages=None`` every
candidate becomes a boundary (for ``baton.Auto`` / ``baton.autoplan``, which choose among them).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from . import _core
from . import _jax_compat as jc
from .errors import TraceError
from .tracing.primitives import stage_boundary
from .tracing.trace import _eqn_cost

__all__ = ["auto_stage", "AutoStaged", "Cut"]


@dataclasses.dataclass
class Cut:
    position: int  # top-level equations (calls inlined) before the boundary
    after: str  # the primitive whose output is cut
    shape: tuple
    flops_before: float  # estimated flops of the equations before the cut
    where: str  # source line of that equation, when JAX recorded one

    def __str__(self) -> str:
        return (f"after equation {self.position} ({self.after} -> {list(self.shape)}, "
                f"{self.flops_before:.3g} flops before) at {self.where}")


@dataclasses.dataclass
class _Eq:
    prim: Any
    params: dict
    ctx: Any
    ins: list  # value keys, or ("lit", value)
    outs: list  # value keys
    avals: list
    source: Any
    cost: float


def _flatten(closed, in_keys) -> tuple[list[_Eq], list]:
    constvars, consts, invars, outvars, eqns = jc.jaxpr_parts(closed)
    env: dict = {}
    for v, c in zip(constvars, consts):
        env[v] = ("lit", c)
    for v, k in zip(invars, in_keys):
        env[v] = k

    def read(a):
        return ("lit", jc.literal_value(a)) if jc.is_literal(a) else env[a]

    out: list[_Eq] = []
    for e in eqns:
        ins = [read(a) for a in e.invars]
        callee = jc.call_jaxpr(e)
        if callee is not None:
            sub, outs = _flatten(callee, ins)
            out += sub
            for o, k in zip(e.outvars, outs):
                env[o] = k
            continue
        outs = [object() for _ in e.outvars]
        for o, k in zip(e.outvars, outs):
            env[o] = k
        out.append(_Eq(e.primitive, dict(e.params), getattr(e, "ctx", None), ins, outs,
                       [o.aval for o in e.outvars], getattr(e, "source_info", None),
                       _eqn_cost(e)))
    return out, [read(a) for a in outvars]


def _is_key(k) -> bool:
    return not (isinstance(k, tuple) and len(k) == 2 and k[0] == "lit")


def _candidates(eqns: list[_Eq], batch_keys: set) -> list[tuple[int, Any, Any]]:
    """(position, value key, aval) of every cut point (see the module docstring)."""
    batch = set(batch_keys)
    act = set()
    for e in eqns:
        ins = [k for k in e.ins if _is_key(k)]
        if any(k in act for k in ins) or (
                any(k in batch for k in ins) and not (
                    len(e.outs) == 1 and _core.graph.is_cheap(e.prim.name))):
            act.update(e.outs)
        elif any(k in batch for k in ins):
            batch.update(e.outs)
    last_use: dict = {}
    for i, e in enumerate(eqns):
        for k in e.ins:
            if _is_key(k):
                last_use[k] = i
    aval_of, made = {}, {}
    for i, e in enumerate(eqns):
        for k, a in zip(e.outs, e.avals):
            aval_of[k] = a
            made[k] = i
    live: set = set()
    singles = []
    for i, e in enumerate(eqns):
        live.update(k for k in e.outs if k in act and last_use.get(k, -1) > i)
        live = {k for k in live if last_use.get(k, -1) > i}
        if len(live) == 1:
            (k,) = live
            singles.append((i + 1, k, aval_of[k]))
    if not singles:
        return []
    shapes: dict = {}
    for _, _, a in singles:
        shapes[(tuple(a.shape), str(a.dtype))] = shapes.get((tuple(a.shape), str(a.dtype)), 0) + 1
    common = max(shapes, key=shapes.get)
    return [(p, k, a) for p, k, a in singles
            if (tuple(a.shape), str(a.dtype)) == common and made[k] == p - 1]


def _balanced(prefix: list[float], total: float, cands: list[int], stages: int) -> list[int]:
    """Indices into ``cands`` of the stages-1 cuts minimising the largest stage's flops
    (dynamic programming over the candidates)."""
    n = len(cands)
    inf = float("inf")
    # best[j][c]: smallest max-stage cost covering up to candidate c with j cuts, c the last
    best = [[inf] * n for _ in range(stages)]
    prev = [[-1] * n for _ in range(stages)]
    for c in range(n):
        best[1][c] = prefix[c]
    for j in range(2, stages):
        for c in range(n):
            for b in range(c):
                v = max(best[j - 1][b], prefix[c] - prefix[b])
                if v < best[j][c]:
                    best[j][c], prev[j][c] = v, b
    end, last = inf, -1
    for c in range(n):
        v = max(best[stages - 1][c], total - prefix[c])
        if v < end:
            end, last = v, c
    out = []
    j = stages - 1
    while j >= 1 and last >= 0:
        out.append(last)
        last = prev[j][last]
        j -= 1
    return sorted(out)


class AutoStaged:
    """``fn`` with stage boundaries at cut points Baton chose (see the module docstring)."""

    def __init__(self, fn: Callable, stages: int | None):
        self.fn = fn
        self.stages = stages
        self._plans: dict = {}
        self.cuts: list[Cut] = []  # of the last call

    def _plan(self, args):
        flat, tree = jax.tree.flatten(args)
        key = (tree, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in flat))
        if key in self._plans:
            return self._plans[key]
        n_params = len(jax.tree.leaves(args[0])) if args else 0
        structs = [jax.ShapeDtypeStruct(np.shape(x), getattr(x, "dtype", None)
                                        or jax.numpy.result_type(x)) for x in flat]

        box = []

        def flat_fn(*xs):
            leaves, out_tree = jax.tree.flatten(self.fn(*jax.tree.unflatten(tree, xs)))
            box[:] = [out_tree]
            return leaves

        closed = jax.make_jaxpr(flat_fn)(*structs)
        in_keys = [object() for _ in flat]
        eqns, outs = _flatten(closed, in_keys)
        cands = _candidates(eqns, set(in_keys[n_params:]))
        if self.stages is not None and len(cands) < self.stages - 1:
            raise TraceError(
                f"auto_stage: found {len(cands)} cut points (a single live activation between "
                f"equations), fewer than the {self.stages - 1} that {self.stages} stages need")
        costs = np.cumsum([e.cost for e in eqns])
        prefix = [float(costs[p - 1]) if p else 0.0 for p, _, _ in cands]
        total = float(costs[-1]) if len(costs) else 0.0
        if self.stages is None:
            chosen = list(range(len(cands)))
        elif self.stages == 1:
            chosen = []
        else:
            chosen = _balanced(prefix, total, [p for p, _, _ in cands], self.stages)
        cut_at = {cands[c][0]: cands[c][1] for c in chosen}
        cuts = []
        for c in chosen:
            p, _, aval = cands[c]
            src = eqns[p - 1].source
            cuts.append(Cut(p, eqns[p - 1].prim.name, tuple(aval.shape), prefix[c],
                            jc.source_summary(src)))
        plan = (box[0], in_keys, eqns, outs, cut_at, cuts)
        self._plans[key] = plan
        return plan

    def __call__(self, *args):
        out_tree, in_keys, eqns, outs, cut_at, cuts = self._plan(args)
        self.cuts = cuts
        env = dict(zip(in_keys, jax.tree.leaves(args)))

        def read(k):
            return k[1] if not _is_key(k) else env[k]

        for i, e in enumerate(eqns):
            vals = jc.eval_eqn(e.prim, e.params, e.ctx, [read(k) for k in e.ins])
            for k, v in zip(e.outs, vals):
                env[k] = v
            if i + 1 in cut_at:
                k = cut_at[i + 1]
                env[k] = stage_boundary(env[k])
        return jax.tree.unflatten(out_tree, [read(k) for k in outs])


def auto_stage(fn: Callable, stages: int | None = None) -> AutoStaged:
    """``fn`` (a loss function ``fn(params, *batch_args)``) with ``stage_boundary`` calls at
    cut points Baton finds in its data flow: ``stages`` balanced stages, or every cut point
    when ``stages`` is None. ``.cuts`` says where they went."""
    if stages is not None and stages < 1:
        raise TraceError(f"auto_stage: stages must be >= 1 (got {stages})")
    return AutoStaged(fn, stages)
