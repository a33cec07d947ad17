"""Tracing: a training step -> jaxpr -> a JAX-free ``Program`` for the C++ passes.

One op per jaxpr equation. Calls of jitted functions (``pjit``) are inlined so
that boundaries and optimizer code inside them are visible; other higher-order
equations (``scan``, ``checkpoint``, ``custom_jvp_call``, ...) stay opaque ops
and must not contain a ``stage_boundary``, with one exception: a boundary on the
edge of a ``jax.checkpoint`` region (a model whose layers are rematerialized and
end in a boundary) is moved out of it (see ``_Exporter.emit_remat``). Literals
and closed-over constants become ``Literal`` values whose contents stay here, in
``Traced.literals``. A static slice in the loop of a loop-invariant array without
gradients (a scanned stack's per-layer RNG keys) moves before the loop
(``_Exporter.hoist_slice``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import numpy as np

from .. import _core
from .. import _jax_compat as jc
from ..errors import TraceError
from .primitives import accumulate_p, stage_boundary_p, tracing_pipeline

G = _core.graph


@dataclasses.dataclass
class OpInfo:
    prim: Any
    params: dict
    ctx: Any
    inputs: list[int]
    outputs: list[int]
    region: Any  # _core.graph.Region: Pre, Loop or Post
    kind: Any = G.OpKind.Compute  # _core.graph.OpKind: Compute, Boundary or AddAny
    uid: int = -1
    backward: bool = False
    boundary: int = -1
    cost: float = 0.0


@dataclasses.dataclass
class Traced:
    program: Any  # _core.graph.Program
    ops: list[OpInfo]
    literals: dict[int, Any]
    avals: list[Any]
    step_inputs: list[int]
    step_outputs: list[int]
    loop_inputs: list[tuple[int, int, bool]]  # (body, outer, is_microbatch)
    loop_outputs: list[tuple[int, int, str]]  # (body, outer, reduce)
    in_tree: Any
    out_tree: Any
    microbatches: int
    num_stages: int


def _nbytes(aval) -> int:
    try:
        return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
    except Exception:  # noqa: BLE001  (tokens, extended dtypes)
        return 0


def _eqn_cost(eqn) -> float:
    """Rough flop count of one equation (consistent, not exact)."""
    out_elems = sum(int(math.prod(getattr(v.aval, "shape", ()))) for v in eqn.outvars)
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        k = int(math.prod(lhs[d] for d in lc)) if lc else 1
        return 2.0 * out_elems * k
    subs = jc.sub_jaxprs(eqn)
    if subs:
        total = 0.0
        for sj in subs:
            for e in jc.jaxpr_parts(sj)[4]:
                total += _eqn_cost(e)
        return total * float(eqn.params.get("length", 1))
    return float(max(out_elems, 1))


def _no_gradient(dtype) -> bool:
    """Values of ``dtype`` have no gradient: PRNG keys, integers, booleans."""
    return (jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
            or np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.bool_))


def _contains_marker(closed) -> bool:
    for e in jc.jaxpr_parts(closed)[4]:
        if e.primitive is stage_boundary_p or e.primitive is accumulate_p:
            return True
        if any(_contains_marker(s) for s in jc.sub_jaxprs(e)):
            return True
    return False


class _Exporter:
    def __init__(self):
        self.avals: list[Any] = []
        self.kinds: list[Any] = []
        self.literals: dict[int, Any] = {}
        self.ops: list[OpInfo] = []
        self.loop_inputs: list[tuple[int, int, bool]] = []
        self.loop_outputs: list[tuple[int, int, str]] = []
        self.microbatches = 0
        self.seen_loop = False
        self.invariant: dict[int, int] = {}  # the loop's invariant inputs: body -> outer
        self.hoisted: dict[tuple, int] = {}  # (outer, slice params) -> its loop input
        self.loop_at = 0  # where the loop's ops start in ``ops``

    def new_value(self, aval, kind) -> int:
        self.avals.append(aval)
        self.kinds.append(kind)
        return len(self.avals) - 1

    def literal(self, value, aval=None) -> int:
        if aval is None:
            aval = jc.get_aval(value)
        i = self.new_value(aval, G.ValueKind.Literal)
        self.literals[i] = value
        return i

    def read(self, env, atom) -> int:
        if jc.is_literal(atom):
            return self.literal(jc.literal_value(atom), atom.aval)
        try:
            return env[atom]
        except KeyError:
            raise TraceError(f"internal: variable {atom} used before definition") from None

    def emit(self, eqns, env, region: Any) -> Any:
        for eqn in eqns:
            callee = jc.call_jaxpr(eqn)
            if callee is not None:
                constvars, consts, invars, outvars, sub = jc.jaxpr_parts(callee)
                senv = {}
                for v, c in zip(constvars, consts):
                    senv[v] = self.literal(c, v.aval)
                for v, a in zip(invars, eqn.invars):
                    senv[v] = self.read(env, a)
                region = self.emit(sub, senv, region)
                for o, so in zip(eqn.outvars, outvars):
                    if not jc.is_drop_var(o):
                        env[o] = self.read(senv, so)
                continue
            if eqn.primitive is accumulate_p:
                if region != G.Region.Pre or self.seen_loop:
                    raise TraceError("baton.jit supports one baton.accumulate loop per step")
                self.emit_loop(eqn, env)
                self.seen_loop = True
                region = G.Region.Post
                continue
            if region == G.Region.Loop and self.hoist_slice(eqn, env):
                continue
            if eqn.primitive is stage_boundary_p and region != G.Region.Loop:
                raise TraceError(
                    "stage_boundary outside baton.accumulate: boundaries must be inside the "
                    "function that accumulate runs per microbatch"
                )
            if jc.is_remat(eqn) and region == G.Region.Loop and any(
                    _contains_marker(sj) for sj in jc.sub_jaxprs(eqn)):
                self.emit_remat(eqn, env, region)
                continue
            for sj in jc.sub_jaxprs(eqn):
                if _contains_marker(sj):
                    raise TraceError(
                        f"a stage_boundary is inside a '{eqn.primitive.name}' equation "
                        "(scan, checkpoint, cond, custom_jvp/vjp ...); put boundaries at the top "
                        "level of the per-microbatch function"
                    )
            outs = self.emit_op(eqn, [self.read(env, a) for a in eqn.invars], region)
            for o, i in zip(eqn.outvars, outs):
                if not jc.is_drop_var(o):
                    env[o] = i
        return region

    def emit_op(self, eqn, ins: list[int], region: Any, params: dict | None = None) -> list[int]:
        """One op for ``eqn`` on the values ``ins``; returns its output values."""
        outs = [self.new_value(o.aval, G.ValueKind.Intermediate) for o in eqn.outvars]
        info = OpInfo(
            prim=eqn.primitive,
            params=dict(eqn.params if params is None else params),
            ctx=getattr(eqn, "ctx", None),
            inputs=ins,
            outputs=outs,
            region=region,
            cost=_eqn_cost(eqn),
        )
        if eqn.primitive is stage_boundary_p:
            info.kind = G.OpKind.Boundary
            info.uid = eqn.params["uid"]
            info.backward = eqn.params["backward"]
        elif eqn.primitive.name == "add_any":
            info.kind = G.OpKind.AddAny
        self.ops.append(info)
        return outs

    def hoist_slice(self, eqn, env) -> bool:
        """Whether loop equation ``eqn`` is a static ``slice`` of a loop-invariant input whose
        values have no gradient (PRNG keys, integers, booleans), moved before the loop: the
        slice is the same in every microbatch, so it is emitted once on the input's outer
        value (the op inserted where the loop's ops start) and the loop reads the result as
        an invariant input of its own (one per distinct slice). A stage then takes its part of
        a scanned stack's per-layer RNG keys like its parameters, and stages that differ only
        by where their part starts run equal task functions (``share_match``). (A slice with
        a gradient stays in the loop, next to its transpose.)"""
        if eqn.primitive.name != "slice" or jc.is_literal(eqn.invars[0]):
            return False
        outer = self.invariant.get(env.get(eqn.invars[0], -1))
        if outer is None or not _no_gradient(eqn.invars[0].aval.dtype):
            return False
        key = (outer, *(None if v is None else tuple(v) for v in (
            eqn.params["start_indices"], eqn.params["limit_indices"],
            eqn.params.get("strides"))))
        body = self.hoisted.get(key)
        if body is None:
            [piece] = self.emit_op(eqn, [outer], G.Region.Pre)
            self.ops.insert(self.loop_at, self.ops.pop())
            self.loop_at += 1
            body = self.hoisted[key] = self.new_value(eqn.outvars[0].aval,
                                                      G.ValueKind.LoopInvariant)
            self.loop_inputs.append((body, piece, False))
            self.invariant[body] = piece
        if not jc.is_drop_var(eqn.outvars[0]):
            env[eqn.outvars[0]] = body
        return True

    def emit_remat(self, eqn, env, region: Any) -> None:
        """A ``jax.checkpoint`` (remat) equation whose region has stage boundaries on its
        edge: each is moved out of the region, where it is the same identity. A marker on
        region inputs (the backward marker a boundary at the end of a rematerialized
        layer gets: JAX differentiates the region as one equation that recomputes the
        forward and then transposes, starting from the incoming cotangent) is emitted on
        the operands before the region; a marker on region outputs (a forward boundary
        of a region that is not differentiated) after it, on its results. The region
        keeps its remat (the equation stays one opaque op) and no longer holds a marker.
        A boundary inside the region, between its ops, cannot be moved out: an error."""
        body = eqn.params["jaxpr"]
        j = jc.open_jaxpr(body)
        pos = {v: k for k, v in enumerate(j.invars)}
        outset = set(v for v in j.outvars if isinstance(v, jc.Var))
        sub: dict = {}
        pre, post, keep = [], [], []

        def subst(v):
            return sub.get(v, v) if isinstance(v, jc.Var) else v

        for e in j.eqns:
            if e.primitive is stage_boundary_p:
                if all(isinstance(v, jc.Var) and v in pos for v in e.invars):
                    pre.append(e)
                elif all(o in outset for o in e.outvars):
                    post.append(e)
                else:
                    raise TraceError(
                        "a stage_boundary is inside a jax.checkpoint region, between its ops: "
                        "put the boundary on the region's output (end the checkpointed "
                        "function with it) or outside the checkpointed function"
                    )
                for o, i in zip(e.outvars, e.invars):
                    sub[o] = subst(i)
                continue
            if any(_contains_marker(s) for s in jc.sub_jaxprs(e)):
                raise TraceError(
                    f"a stage_boundary is inside a '{e.primitive.name}' equation within a "
                    "jax.checkpoint region; put boundaries on the region's edge"
                )
            keep.append(e.replace(invars=[subst(v) for v in e.invars]))
        stripped = jc.replace_body(body, keep, [subst(v) for v in j.outvars])
        # Markers on the inputs, emitted on the outer operands.
        operands = [self.read(env, a) for a in eqn.invars]
        for m in pre:
            outs = self.emit_op(m, [operands[pos[v]] for v in m.invars], region)
            for v, o in zip(m.invars, outs):
                operands[pos[v]] = o
        results = self.emit_op(eqn, operands, region, dict(eqn.params, jaxpr=stripped))
        # Markers on the outputs, emitted on the results.
        for m in post:
            where = {}
            for k, ov in enumerate(j.outvars):
                where.setdefault(ov, k)
            outs = self.emit_op(m, [results[where[o]] for o in m.outvars], region)
            marked = dict(zip(m.outvars, outs))
            results = [marked.get(ov, r) if isinstance(ov, jc.Var) else r
                       for ov, r in zip(j.outvars, results)]
        for o, i in zip(eqn.outvars, results):
            if not jc.is_drop_var(o):
                env[o] = i

    def emit_loop(self, eqn, env):
        p = eqn.params
        body = p["body"]
        constvars, consts, invars, outvars, beqns = jc.jaxpr_parts(body.closed)
        all_in = [*constvars, *invars]
        n_inv = p["n_invariant"]
        self.microbatches = p["microbatches"]
        self.num_primal = body.num_primal
        benv = {}
        # The body's own consts come first among the operands.
        operands = list(eqn.invars)
        if len(all_in) != len(operands):
            raise TraceError("internal: loop operand count mismatch")
        for i, (v, a) in enumerate(zip(all_in, operands)):
            outer = self.read(env, a)
            is_mb = i >= n_inv
            kind = G.ValueKind.LoopMicrobatch if is_mb else G.ValueKind.LoopInvariant
            b = self.new_value(v.aval, kind)
            benv[v] = b
            self.loop_inputs.append((b, outer, is_mb))
            if not is_mb:
                self.invariant[b] = outer
        self.loop_at = len(self.ops)
        if consts:
            # make_jaxpr kept closed-over constants as consts: they are the
            # leading operands already (see accumulate).
            pass
        self.emit(beqns, benv, G.Region.Loop)
        for i, (ov, o) in enumerate(zip(outvars, eqn.outvars)):
            b = self.read(benv, ov)
            outer = self.new_value(o.aval, G.ValueKind.Intermediate)
            if not jc.is_drop_var(o):
                env[o] = outer
            self.loop_outputs.append((b, outer, p["reduce"][i]))


def _number_markers(ops: list[OpInfo]) -> int:
    """Numbers the forward markers 0..n-1 in program order and gives each backward marker
    the number of its forward marker (same ``uid``). One ``stage_boundary`` call can bind
    several markers with one uid when JAX reuses a cached trace (a ``jax.checkpoint`` or
    ``jax.jit`` function called once per layer with the same shapes): the boundaries of a
    pipeline form a chain, and JAX transposes in reverse program order, so the k-th
    backward marker of that uid (program order) belongs to its k-th last forward marker."""
    fwd = [op for op in ops if op.kind == G.OpKind.Boundary and not op.backward]
    index: dict[int, list[int]] = {}
    for k, op in enumerate(fwd):
        index.setdefault(op.uid, []).append(k)
        op.boundary = k
    bwd: dict[int, list[OpInfo]] = {}
    for op in ops:
        if op.kind == G.OpKind.Boundary and op.backward:
            if op.uid not in index:
                raise TraceError(
                    "a backward stage_boundary has no forward counterpart in the loop body "
                    "(was the boundary applied outside the differentiated function?)"
                )
            bwd.setdefault(op.uid, []).append(op)
    for uid, bops in bwd.items():
        ks = index[uid]
        if len(ks) == 1:
            for op in bops:
                op.boundary = ks[0]
        elif len(bops) == len(ks):
            for op, k in zip(bops, reversed(ks)):
                op.boundary = k
        else:
            raise TraceError(
                f"one stage_boundary call was traced {len(ks)} times in the loop body (a "
                f"cached trace reused) but has {len(bops)} backward markers; give each "
                "boundary its own stage_boundary call"
            )
    return len(fwd)


_REDUCE = {"sum": G.Reduce.Sum, "mean": G.Reduce.Mean, "stack": G.Reduce.Stack}


def trace_step(fn: Callable, args: tuple, microbatches: int,
               boundaries: Any = None, microbatch_size: int | None = None) -> Traced:
    """``boundaries``: which stage_boundary calls (0-based, forward order) end stages; the
    others are identities (candidate cut points the planner did not choose). None: all; a
    callable: called with the step's number of stage_boundary calls, returns the indices
    (``baton.Layout``). ``microbatch_size``: the microbatch count is the batch size over it
    (``microbatches`` is then ignored; ``Traced.microbatches`` has the count)."""
    flat, in_tree = jax.tree.flatten(args)
    structs = [jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)) for x in flat]
    box = []

    def flat_fn(*xs):
        out = fn(*jax.tree.unflatten(in_tree, xs))
        leaves, tree = jax.tree.flatten(out)
        box[:] = [tree]
        return leaves

    with tracing_pipeline(microbatches, microbatch_size):
        closed = jax.make_jaxpr(flat_fn)(*structs)
    out_tree = box[0]
    constvars, consts, invars, outvars, eqns = jc.jaxpr_parts(closed)
    ex = _Exporter()
    env = {}
    for v, c in zip(constvars, consts):
        env[v] = ex.literal(c, v.aval)
    step_inputs = []
    for v in invars:
        i = ex.new_value(v.aval, G.ValueKind.StepInput)
        env[v] = i
        step_inputs.append(i)
    ex.emit(eqns, env, G.Region.Pre)
    if not ex.seen_loop:
        raise TraceError(
            "the step has no microbatch loop: call baton.accumulate(fn, *args, batch=...) inside "
            "the function given to baton.jit"
        )
    step_outputs = [ex.read(env, o) for o in outvars]
    n_markers = _number_markers(ex.ops)
    if callable(boundaries):
        boundaries = boundaries(n_markers)
    if boundaries is not None:
        n_markers = _keep_boundaries(ex.ops, boundaries, n_markers)
    prog = _program(ex, step_outputs)
    return Traced(
        program=prog,
        ops=ex.ops,
        literals=ex.literals,
        avals=ex.avals,
        step_inputs=step_inputs,
        step_outputs=step_outputs,
        loop_inputs=ex.loop_inputs,
        loop_outputs=ex.loop_outputs,
        in_tree=in_tree,
        out_tree=out_tree,
        microbatches=ex.microbatches,
        num_stages=n_markers + 1,
    )


def _keep_boundaries(ops, boundaries, n_markers: int) -> int:
    """Keeps the stage_boundary calls ``boundaries`` (renumbered in order) and makes the others
    identities; returns the number kept."""
    keep = sorted(set(int(b) for b in boundaries))
    if keep and (keep[0] < 0 or keep[-1] >= n_markers):
        raise TraceError(f"boundaries={list(boundaries)}: the step has {n_markers} "
                         f"stage_boundary calls (indices 0..{n_markers - 1})")
    index = {b: j for j, b in enumerate(keep)}
    for op in ops:
        if op.kind == G.OpKind.Boundary:
            if op.boundary in index:
                op.boundary = index[op.boundary]
            else:  # an identity: runs inside its stage's task
                op.kind, op.boundary = G.OpKind.Compute, -1
    return len(keep)


def _program(ex, step_outputs) -> G.Program:
    """The C++ program of an exported step: values, ops, loop inputs and outputs, validated."""
    prog = G.Program()
    for aval, kind in zip(ex.avals, ex.kinds):
        shape = [int(d) for d in getattr(aval, "shape", ())]
        dtype = str(getattr(aval, "dtype", "token"))
        prog.add_value(kind, shape, dtype, _nbytes(aval))
    for op in ex.ops:
        prog.add_op(
            op.kind,
            op.region,
            op.prim.name,
            op.inputs,
            op.outputs,
            op.cost,
            op.boundary,
            op.backward,
        )
    for b, o, _ in ex.loop_inputs:
        prog.add_loop_input(b, o)
    for b, o, r in ex.loop_outputs:
        prog.add_loop_output(b, o, _REDUCE[r])
    prog.step_outputs = step_outputs
    prog.num_primal_outputs = getattr(ex, "num_primal", -1)
    prog.validate()
    return prog
