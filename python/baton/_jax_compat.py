"""Every private / ``jax.extend`` / ``jax.interpreters`` use in Baton, in one place.

``jax.extend`` and ``jax.interpreters`` carry no compatibility promise, and the
jaxpr data structures changed between the JAX versions Baton supports (0.11:
``ClosedJaxpr`` wraps a ``Jaxpr``; 0.12: one ``Jaxpr`` class carries its
consts). The rest of Baton only calls the small functions below, which read
jaxprs through the attributes both versions share (``.jaxpr.eqns``,
``.jaxpr.invars``, ``.jaxpr.constvars``, ``.jaxpr.outvars``, ``.consts``).
The runtime's rendezvous uses :func:`distributed_client` (``jax._src.distributed``).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

Primitive = jex_core.Primitive
Literal = jex_core.Literal
Var = jex_core.Var

__all__ = [
    "Primitive",
    "Literal",
    "Var",
    "new_primitive",
    "register_identity_rules",
    "register_abstract_eval",
    "is_literal",
    "literal_value",
    "jaxpr_parts",
    "sub_jaxprs",
    "is_remat",
    "open_jaxpr",
    "replace_body",
    "eval_eqn",
    "map_eqn_params",
    "is_drop_var",
    "instantiate_zeros",
    "jax_version",
    "distributed_client",
    "source_summary",
    "wire_aval",
    "to_wire",
    "from_wire",
]

jax_version = tuple(int(x) for x in jax.__version__.split(".")[:2])


def new_primitive(name: str, multiple_results: bool = True) -> Primitive:
    p = Primitive(name)
    p.multiple_results = multiple_results
    return p


def instantiate_zeros(ct):
    return ad.instantiate_zeros(ct)


def register_identity_rules(prim: Primitive, transpose_params) -> None:
    """Rules of an identity primitive on several operands.

    ``transpose_params(params) -> params`` gives the parameters the transpose
    binds with (the backward marker of a forward marker and vice versa).
    """
    prim.def_impl(lambda *args, **params: list(args))
    prim.def_abstract_eval(lambda *avals, **params: list(avals))
    mlir.register_lowering(prim, lambda ctx, *args, **params: list(args))

    def transpose(cts, *args, **params):
        cts = [ad.instantiate_zeros(ct) for ct in cts]
        return prim.bind(*cts, **transpose_params(params))

    ad.deflinear2(prim, transpose)

    def batcher(args, dims, **params):
        return prim.bind(*args, **params), dims

    batching.primitive_batchers[prim] = batcher


def register_abstract_eval(prim: Primitive, rule, impl=None) -> None:
    prim.def_abstract_eval(rule)
    if impl is not None:
        prim.def_impl(impl)


def get_aval(value: Any) -> Any:
    """The abstract value of a concrete value (``jax.core.get_aval``)."""
    return jax.core.get_aval(value)


def shaped_array(shape, dtype) -> Any:
    """An abstract array of ``shape`` and ``dtype`` (``jax.core.ShapedArray``)."""
    return jax.core.ShapedArray(tuple(shape), dtype)


def is_literal(atom: Any) -> bool:
    return isinstance(atom, Literal)


def literal_value(atom: Any) -> Any:
    return atom.val


def is_drop_var(v: Any) -> bool:
    return type(v).__name__ == "DropVar"


def jaxpr_parts(closed: Any) -> tuple[list, list, list, list, list]:
    """``(constvars, consts, invars, outvars, eqns)`` of a (closed) jaxpr."""
    j = closed.jaxpr
    consts = list(getattr(closed, "consts", []) or [])
    return list(j.constvars), consts, list(j.invars), list(j.outvars), list(j.eqns)


def sub_jaxprs(eqn: Any) -> list:
    """The jaxprs in an equation's parameters (scan bodies, jit callees, ...)."""
    out = []
    for v in eqn.params.values():
        vs = v if isinstance(v, (tuple, list)) else [v]
        for x in vs:
            if hasattr(x, "eqns") or (hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns")):
                out.append(x)
    return out


def is_remat(eqn: Any) -> bool:
    """Whether ``eqn`` is a ``jax.checkpoint`` region (primitive ``remat2``/``checkpoint``)."""
    return eqn.primitive.name in ("checkpoint", "remat2") and "jaxpr" in eqn.params


def open_jaxpr(j: Any) -> Any:
    """The open ``Jaxpr`` of ``j`` (itself, or the ``.jaxpr`` of 0.11's ``ClosedJaxpr``)."""
    return j if hasattr(j, "eqns") else j.jaxpr


def replace_body(j: Any, eqns: list, outvars: list) -> Any:
    """``j`` (a ``Jaxpr`` or 0.11's ``ClosedJaxpr``) with new equations and outputs."""
    if hasattr(j, "eqns"):
        return j.replace(eqns=eqns, outvars=outvars)
    return j.replace(jaxpr=j.jaxpr.replace(eqns=eqns, outvars=outvars))


def call_jaxpr(eqn: Any):
    """The callee of a jit call equation (``pjit``/``jit``), else None."""
    if eqn.primitive.name in ("pjit", "jit", "closed_call", "core_call"):
        j = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        return j
    return None


def map_eqn_params(name: str, params: dict, fix) -> dict:
    """``params`` of a ``name`` equation with ``fix(name, params) -> params`` applied to it
    and to every equation of the jaxprs nested in it (scan bodies, checkpoint, jit callees),
    rebuilt with ``replace`` (``Jaxpr``, ``JaxprEqn``, 0.11's ``ClosedJaxpr``). Returns the
    same dict when nothing changed."""

    def jaxpr(j):
        if hasattr(j, "eqns"):
            eqns = []
            changed = False
            for e in j.eqns:
                p = map_eqn_params(e.primitive.name, e.params, fix)
                changed |= p is not e.params
                eqns.append(e.replace(params=p) if p is not e.params else e)
            return j.replace(eqns=eqns) if changed else j
        if hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):  # ClosedJaxpr (0.11)
            inner = jaxpr(j.jaxpr)
            return j.replace(jaxpr=inner) if inner is not j.jaxpr else j
        return j

    out = {}
    changed = False
    for k, v in params.items():
        if isinstance(v, (tuple, list)) and any(hasattr(x, "eqns") or hasattr(x, "jaxpr")
                                                for x in v):
            nv = type(v)(jaxpr(x) for x in v)
            changed |= any(a is not b for a, b in zip(nv, v))
        else:
            nv = jaxpr(v)
            changed |= nv is not v
        out[k] = nv
    base = out if changed else params
    fixed = fix(name, base)
    return fixed


def eval_eqn(prim: Primitive, params: dict, ctx: Any, vals: list) -> list:
    """Binds one equation's primitive on ``vals`` like ``jax.core.eval_jaxpr`` does."""
    bp = prim.get_bind_params(params)
    if isinstance(bp, tuple) and len(bp) == 2 and isinstance(bp[0], list):
        subfuns, bp = bp
        args = [*subfuns, *vals]
    else:
        args = vals
    if ctx is not None and hasattr(ctx, "manager"):
        with ctx.manager:
            out = prim.bind(*args, **bp)
    else:
        out = prim.bind(*args, **bp)
    return list(out) if prim.multiple_results else [out]


def distributed_client():
    """The key-value client of ``jax.distributed`` (None before ``jax.distributed.initialize``).

    Private API (``jax._src.distributed.global_state.client``); it offers
    ``key_value_set_bytes(key, value)`` and ``blocking_key_value_get_bytes(key, timeout_ms)``.
    """
    from jax._src import distributed

    return getattr(distributed.global_state, "client", None)


def source_summary(source_info) -> str:
    """``file:line (function)`` of an equation's user frame, for messages; "?" if unknown
    (``jax._src.source_info_util``, private)."""
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(source_info)
    except Exception:  # noqa: BLE001
        return "?"


# -- values on the wire ------------------------------------------------------------------
# The transports move plain bytes. Typed PRNG key arrays (``jax.random.key``: an extended
# dtype numpy cannot describe) travel as their key data (uint32, trailing key dimensions),
# 4-bit integers as 8-bit ones (XLA may pack them; one byte each on the wire), and float0
# (the cotangent of an integer or key value: no data) as the bools XLA holds for it.
_WIDE = {"int4": "int8", "uint4": "uint8", "int2": "int8", "uint2": "uint8"}


def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def wire_aval(aval) -> Any:
    """The (shape, dtype) a value of ``aval`` has on the wire."""
    if _is_key(aval.dtype):
        impl = aval.dtype._impl  # the PRNG implementation behind a key dtype (private)
        return jax.ShapeDtypeStruct(tuple(aval.shape) + tuple(impl.key_shape), jax.numpy.uint32)
    if aval.dtype == jax.dtypes.float0:
        return jax.ShapeDtypeStruct(tuple(aval.shape), jax.numpy.bool_)
    wide = _WIDE.get(str(aval.dtype))
    return jax.ShapeDtypeStruct(tuple(aval.shape), wide or aval.dtype)


def to_wire(x) -> Any:
    """``x`` as the transports carry it (see wire_aval)."""
    if _is_key(x.dtype):
        return jax.random.key_data(x)
    if x.dtype == jax.dtypes.float0:
        return jax.numpy.zeros(x.shape, jax.numpy.bool_)
    wide = _WIDE.get(str(x.dtype))
    return x if wide is None else x.astype(wide)


def from_wire(x, dtype) -> Any:
    """A value received as ``x`` (wire_aval) back in its own ``dtype``."""
    if _is_key(dtype):
        return jax.random.wrap_key_data(x, impl=dtype._impl)
    if dtype == jax.dtypes.float0:
        import numpy as np

        return np.zeros(x.shape, dtype)
    return x if x.dtype == dtype else x.astype(dtype)
