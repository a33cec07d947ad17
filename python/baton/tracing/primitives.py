"""The two annotations a user writes: ``stage_boundary`` and ``accumulate``.

``stage_boundary(x)`` is an identity on pytrees, bound as one primitive over
all leaves. It is linear: its transpose binds the same primitive flagged as
backward with the same id, so one ``value_and_grad`` of a model with n
boundaries yields n forward and n backward markers that the graph passes use
to cut stages. It has abstract eval, lowering (identity), batching, JVP and
transpose rules, so it survives ``jit``, ``grad``, ``vmap``, ``checkpoint`` and
``scan``, and is a no-op outside a pipeline.

``accumulate(fn, *args, batch=...)`` is the microbatch loop: split ``batch``
along its leading axis into microbatches, run ``fn(*args, microbatch)`` on each,
and reduce each output over microbatches (``'mean'`` by default, ``'sum'``, or
``'stack'``). Outside ``baton.jit`` it is a ``lax.scan`` (the same math);
inside, it is traced once on one microbatch to a loop-body jaxpr held by an
``accumulate`` primitive that only the pipeline compiler interprets.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as jc
from ..errors import ConfigError, TraceError

_uids = itertools.count()

stage_boundary_p = jc.new_primitive("stage_boundary")
jc.register_identity_rules(
    stage_boundary_p, lambda params: dict(params, backward=not params["backward"])
)


def stage_boundary(x: Any) -> Any:
    """Ends a pipeline stage at ``x`` (any pytree of arrays); returns ``x``."""
    leaves, tree = jax.tree.flatten(x)
    if not leaves:
        return x
    out = stage_boundary_p.bind(*leaves, uid=next(_uids), backward=False)
    return jax.tree.unflatten(tree, out)


# --- accumulate -------------------------------------------------------------

REDUCTIONS = ("sum", "mean", "stack")


class _TraceContext(threading.local):
    def __init__(self):
        self.microbatches: int | None = None
        self.microbatch_size: int | None = None  # baton.jit(microbatch_size=...)
        self.loops: list = []


_ctx = _TraceContext()


class tracing_pipeline:
    """Context manager: ``accumulate`` calls record a loop body instead of a scan."""

    def __init__(self, microbatches: int, microbatch_size: int | None = None):
        self.microbatches = microbatches
        self.microbatch_size = microbatch_size  # when given: the count is batch / size

    def __enter__(self):
        self._saved = (_ctx.microbatches, _ctx.microbatch_size, _ctx.loops)
        _ctx.microbatches = self.microbatches
        _ctx.microbatch_size = self.microbatch_size
        _ctx.loops = []
        return _ctx.loops

    def __exit__(self, *exc):
        _ctx.microbatches, _ctx.microbatch_size, _ctx.loops = self._saved
        return False


accumulate_p = jc.new_primitive("baton_accumulate")


def _accumulate_abstract(*avals, body, reduce, microbatches, **_):
    outs = []
    for v, r in zip(body.out_avals, reduce):
        if r == "stack":
            outs.append(jc.shaped_array((microbatches, *v.shape), v.dtype))
        else:
            outs.append(jc.shaped_array(v.shape, v.dtype))
    return outs


def _accumulate_impl(*operands, **_):
    raise TraceError("the baton_accumulate primitive only runs inside baton.jit")


jc.register_abstract_eval(accumulate_p, _accumulate_abstract, _accumulate_impl)


class LoopBody:
    """The traced loop body: a closed jaxpr over (invariants..., microbatch leaves...)."""

    def __init__(self, closed, out_avals, fun, num_primal=-1):
        self.closed = closed
        self.out_avals = out_avals
        self.fun = fun
        # leading outputs that are primal (the value of a value_and_grad), -1 unknown
        self.num_primal = num_primal

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other


def _split_batch(leaves, m):
    out = []
    for x in leaves:
        shape = np.shape(x)
        if not shape:
            raise ConfigError(
                "accumulate: batch leaves must have a leading batch axis (got a scalar)"
            )
        if shape[0] % m:
            raise ConfigError(
                f"accumulate: batch size {shape[0]} is not divisible by microbatches={m}"
            )
        out.append(jnp.reshape(x, (m, shape[0] // m, *shape[1:])))
    return out


def _scan_loop(fun, invariants, mb_leaves, reduce, m):
    """Runs ``fun(*invariants, *microbatch_leaves)`` over m microbatches with lax.scan."""
    split = _split_batch(mb_leaves, m)
    mb_structs = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in split]
    out_shapes = jax.eval_shape(lambda *a: fun(*invariants, *a), *mb_structs)
    init = [jnp.zeros(s.shape, s.dtype) for s, r in zip(out_shapes, reduce) if r != "stack"]

    def step(carry, xs):
        outs = fun(*invariants, *xs)
        summed = [o for o, r in zip(outs, reduce) if r != "stack"]
        acc = [c + o for c, o in zip(carry, summed)]
        stacked = [o for o, r in zip(outs, reduce) if r == "stack"]
        return acc, stacked

    acc, stacked = jax.lax.scan(step, init, split)
    acc_it, st_it = iter(acc), iter(stacked)
    res = []
    for r in reduce:
        if r == "stack":
            res.append(next(st_it))
        else:
            a = next(acc_it)
            res.append(a / m if r == "mean" else a)
    return res


def _expand_reduce(reduce, out_tree_struct, out_leaves_n):
    if isinstance(reduce, str):
        if reduce not in REDUCTIONS:
            raise ConfigError(f"accumulate: reduce must be one of {REDUCTIONS} (got {reduce!r})")
        return (reduce,) * out_leaves_n
    try:
        full = jax.tree.broadcast(reduce, out_tree_struct, is_leaf=lambda x: isinstance(x, str))
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            f"accumulate: reduce {reduce!r} does not match the outputs: {e}"
        ) from None
    flat = jax.tree.leaves(full)
    for r in flat:
        if r not in REDUCTIONS:
            raise ConfigError(f"accumulate: reduce must be one of {REDUCTIONS} (got {r!r})")
    return tuple(flat)


def _num_primal(out, args) -> int:
    """How many leading output leaves of the loop function are primal: for the
    ``(value, grads)`` of ``jax.value_and_grad`` (grads shaped like the first argument) the
    leaves of ``value``; -1 when the outputs do not have that form (the graph passes then
    find the primal outputs by program order)."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and args):
        return -1
    value, grads = out
    params = args[0]
    if jax.tree.structure(grads) != jax.tree.structure(params):
        return -1
    same = [np.shape(g) == np.shape(q) for g, q in zip(jax.tree.leaves(grads),
                                                        jax.tree.leaves(params))]
    if not all(same):
        return -1
    return len(jax.tree.leaves(value))


def _widened(shapes, reduce, dtype) -> list:
    """Per output of the loop body: the type its sum over microbatches is kept in when that
    differs from its own (a summed or averaged float narrower than ``dtype``), else None."""
    if dtype is None:
        return [None] * len(shapes)
    dtype = jnp.dtype(dtype)
    out = []
    for s, r in zip(shapes, reduce):
        d = jnp.dtype(s.dtype)
        narrow = (r != "stack" and jnp.issubdtype(d, jnp.floating)
                  and d.itemsize < dtype.itemsize)
        out.append(dtype if narrow else None)
    return out


def _count_of_size(leaves, size: int) -> int:
    """The microbatch count of a batch cut into microbatches of ``size`` rows
    (``baton.jit(microbatch_size=...)``), or a ConfigError naming the batch size."""
    b = np.shape(leaves[0])[0] if np.shape(leaves[0]) else 0
    if b < size or b % size:
        raise ConfigError(
            f"baton.jit(microbatch_size={size}): the batch has {b} rows, which do not split "
            f"into microbatches of {size} (the batch size must be a multiple of it)")
    return b // size


def accumulate(
    fn: Callable,
    *args: Any,
    batch: Any = None,
    microbatches: int | None = None,
    reduce: Any = "mean",
    accumulate_dtype: Any = "float32",
) -> Any:
    """Runs ``fn(*args, microbatch)`` over the microbatches of ``batch`` and reduces.

    ``batch`` (a pytree of arrays with a common leading axis) defaults to the
    last positional argument. ``reduce`` is ``'mean'`` (default), ``'sum'`` or
    ``'stack'``, or a pytree prefix of ``fn``'s output with one of those per
    subtree. Gradients of a mean loss: use ``'mean'`` and the result equals the
    full-batch gradient. Inside ``baton.jit`` the microbatch count comes from
    ``baton.jit(microbatches=...)``; outside it defaults to ``microbatches`` (or 1).
    ``accumulate_dtype``: summed and averaged outputs in a narrower float type (bfloat16,
    float16 gradients of bfloat16 parameters) are summed over the microbatches in this
    type (default float32) and the result cast back to the output's own type; ``None``
    sums them in their own type. Wider types (float32, float64) are summed as they are.
    """
    if batch is None:
        if not args:
            raise ConfigError("accumulate: no batch given")
        *args, batch = args
    args = tuple(args)
    inv_leaves, inv_tree = jax.tree.flatten(args)
    mb_leaves, mb_tree = jax.tree.flatten(batch)
    if not mb_leaves:
        raise ConfigError("accumulate: the batch has no arrays")
    m = _ctx.microbatches if _ctx.microbatches is not None else (microbatches or 1)
    if _ctx.microbatches is not None and _ctx.microbatch_size is not None:
        m = _count_of_size(mb_leaves, _ctx.microbatch_size)
    if _ctx.microbatches is not None and microbatches is not None and microbatches != m:
        raise ConfigError(
            f"accumulate(microbatches={microbatches}) disagrees with baton.jit(microbatches={m})"
        )
    for x in mb_leaves:
        shape = np.shape(x)
        if not shape or shape[0] % m:
            raise ConfigError(
                f"accumulate: batch leaf of shape {tuple(shape)} cannot be split into {m} "
                f"microbatches (batch size must be divisible by microbatches)"
            )
    n_inv = len(inv_leaves)

    out_tree_box = []

    def flat_fun(*flat):
        a = jax.tree.unflatten(inv_tree, flat[:n_inv])
        b = jax.tree.unflatten(mb_tree, flat[n_inv:])
        out = fn(*a, b)
        leaves, tree = jax.tree.flatten(out)
        out_tree_box[:] = [tree, out]
        return leaves

    mb_structs = [
        jax.ShapeDtypeStruct((np.shape(x)[0] // m, *np.shape(x)[1:]), jnp.result_type(x))
        for x in mb_leaves
    ]
    inv_structs = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in inv_leaves]
    shapes = jax.eval_shape(flat_fun, *inv_structs, *mb_structs)
    out_tree, out_example = out_tree_box
    red = _expand_reduce(reduce, out_example, len(shapes))
    wide = _widened(shapes, red, accumulate_dtype)
    fun = flat_fun
    if any(w is not None for w in wide):
        def fun(*flat):  # the narrow sums widened inside the body
            return [o.astype(w) if w is not None else o for o, w in zip(flat_fun(*flat), wide)]

        narrow = [s.dtype for s in shapes]
        shapes = [jax.ShapeDtypeStruct(s.shape, w) if w is not None else s
                  for s, w in zip(shapes, wide)]

    def narrowed(res):
        if not any(w is not None for w in wide):
            return res
        return [r.astype(d) if w is not None else r for r, w, d in zip(res, wide, narrow)]

    if _ctx.microbatches is None:
        res = _scan_loop(fun, list(inv_leaves), list(mb_leaves), red, m)
        return jax.tree.unflatten(out_tree, narrowed(res))

    # Inside baton.jit: trace the body once on one microbatch.
    if _ctx.loops:
        raise TraceError("baton.jit supports one baton.accumulate loop per step (found a second)")
    closed = jax.make_jaxpr(fun)(*inv_structs, *mb_structs)
    constvars, consts, invars, outvars, eqns = jc.jaxpr_parts(closed)
    out_avals = [jc.shaped_array(s.shape, s.dtype) for s in shapes]
    body = LoopBody(closed, out_avals, None, _num_primal(out_example, args))
    operands = [*consts, *inv_leaves, *mb_leaves]
    _ctx.loops.append(body)
    outs = accumulate_p.bind(
        *operands,
        body=body,
        reduce=red,
        microbatches=m,
        n_invariant=len(consts) + n_inv,
    )
    return jax.tree.unflatten(out_tree, narrowed(list(outs)))
