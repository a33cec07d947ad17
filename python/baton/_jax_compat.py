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
import numpy as np
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
    "eqn_ctx_mesh",
    "eqn_ctx_with_mesh",
    "value_with_sharding",
    "without_mesh_context",
    "context_mesh",
    "explicit_axis_type",
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


def map_eqn_params(name: str, params: dict, fix, fix_ctx=None, fix_value=None,
                   fix_aval=None, drop=None) -> dict:
    """``params`` of a ``name`` equation with ``fix(name, params) -> params`` applied to it
    and to every equation of the jaxprs nested in it (scan bodies, checkpoint, jit callees,
    ``shard_map`` bodies), rebuilt with ``replace`` (``Jaxpr``, ``JaxprEqn``, 0.11's
    ``ClosedJaxpr``). When given, in every nested jaxpr: ``fix_ctx(ctx) -> ctx`` replaces
    each equation's context (see ``eqn_ctx_with_mesh``), ``fix_value(x) -> x`` the value of
    each literal operand (see ``value_with_sharding``), ``fix_aval(aval) -> aval`` the
    type of each variable (a new ``Var``: a jit callee's output types are its call's), and
    an equation for which ``drop(name, fixed params)`` is true is removed, its outputs
    replaced by its inputs (an identity: as many inputs as outputs, of equal types).
    Returns the same dict when nothing changed."""
    fixes = (fix, fix_ctx, fix_value, fix_aval, drop)
    out = {}
    changed = False
    for k, v in params.items():
        if isinstance(v, (tuple, list)) and any(hasattr(x, "eqns") or hasattr(x, "jaxpr")
                                                for x in v):
            nv = type(v)(_map_jaxpr(x, fixes) for x in v)
            changed |= any(a is not b for a, b in zip(nv, v))
        else:
            nv = _map_jaxpr(v, fixes)
            changed |= nv is not v
        out[k] = nv
    base = out if changed else params
    fixed = fix(name, base)
    return fixed


class _JaxprMap:
    """One jaxpr's atoms under ``map_eqn_params``'s fixes: each variable mapped once."""

    def __init__(self, fix_value, fix_aval):
        self.fix_value, self.fix_aval = fix_value, fix_aval
        self.vars: dict = {}

    def atom(self, v):
        if is_literal(v):
            if self.fix_value is None:
                return v
            x = self.fix_value(v.val)
            return v if x is v.val else Literal(x, getattr(x, "aval", v.aval))
        got = self.vars.get(v)
        if got is None:
            aval = self.fix_aval(v.aval) if self.fix_aval is not None else v.aval
            got = self.vars[v] = v if aval is v.aval else _new_var(v, aval)
        return got

    def atoms(self, vs):
        new = [self.atom(v) for v in vs]
        return new if any(a is not b for a, b in zip(new, vs)) else None


def _new_var(v, aval):
    """A fresh variable of ``v``'s class (``Var`` or ``DropVar``) of type ``aval``."""
    try:
        return type(v)(aval)
    except TypeError:  # JAX versions whose variables also take a name suffix
        return type(v)(getattr(v, "suffix", ""), aval)


def _map_jaxpr(j, fixes):
    fix, fix_ctx, fix_value, fix_aval, drop = fixes
    if not hasattr(j, "eqns"):
        if hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):  # ClosedJaxpr (0.11)
            inner = _map_jaxpr(j.jaxpr, fixes)
            return j.replace(jaxpr=inner) if inner is not j.jaxpr else j
        return j
    m = _JaxprMap(fix_value, fix_aval)
    top = {k: m.atoms(list(getattr(j, k))) for k in ("constvars", "invars")}
    eqns = []
    changed = any(x is not None for x in top.values())
    for e in j.eqns:
        new = {}
        p = map_eqn_params(e.primitive.name, e.params, *fixes)
        if drop is not None and drop(e.primitive.name, p):
            _forward_identity(m, e)
            changed = True
            continue
        if p is not e.params:
            new["params"] = p
        c = fix_ctx(e.ctx) if fix_ctx is not None and hasattr(e, "ctx") else None
        if c is not None and c is not e.ctx:
            new["ctx"] = c
        for k in ("invars", "outvars"):
            vs = m.atoms(list(getattr(e, k)))
            if vs is not None:
                new[k] = vs
        changed |= bool(new)
        eqns.append(e.replace(**new) if new else e)
    outs = m.atoms(list(j.outvars))
    if not changed and outs is None:
        return j
    new = {k: v for k, v in top.items() if v is not None}
    return j.replace(eqns=eqns, outvars=outs if outs is not None else j.outvars, **new)


def _forward_identity(m: _JaxprMap, e: Any) -> None:
    """Removes identity equation ``e`` from the jaxpr ``m`` maps: each output variable
    becomes the (mapped) input at its position."""
    if len(e.invars) != len(e.outvars) or any(
            (a.aval.shape, a.aval.dtype) != (b.aval.shape, b.aval.dtype)
            for a, b in zip(e.invars, e.outvars)):
        raise ValueError(f"{e.primitive.name}: not an identity of its operands, cannot drop")
    for a, b in zip(e.invars, e.outvars):
        if not is_drop_var(b):
            m.vars[b] = m.atom(a)


def eqn_ctx_mesh(ctx: Any) -> Any:
    """The abstract mesh an equation was traced under (``JaxprEqnContext.cur_abstract_mesh``:
    the mesh of ``jax.set_mesh`` / ``shard_map``; an empty mesh outside them), or None when
    this JAX's equation context has none."""
    if ctx is None:
        return None
    if hasattr(ctx, "cur_abstract_mesh"):
        return ctx.cur_abstract_mesh
    i = _ctx_config_index(ctx, _MESH_CONFIG)
    return ctx.configs[i] if i is not None else None


# the name of the mesh among a JAX >= 0.12.1 equation context's configuration values
_MESH_CONFIG = "abstract_mesh_context_manager"


def _ctx_config_index(ctx: Any, name: str) -> int | None:
    """The position of configuration ``name`` in ``ctx.configs`` (JAX >= 0.12.1 keeps an
    equation's context as the tuple of the values of the configurations named by
    ``jax._src.config.jaxpr_eqn_ctx_names()``), or None on a JAX whose context has fields."""
    if not isinstance(getattr(ctx, "configs", None), tuple):
        return None
    from jax._src import config as jconfig

    names = getattr(jconfig, "jaxpr_eqn_ctx_names", None)
    names = names() if names is not None else ()
    return names.index(name) if name in names else None


def eqn_ctx_with_mesh(ctx: Any, mesh: Any) -> Any:
    """``ctx`` (a ``JaxprEqnContext``) with its abstract mesh replaced by ``mesh``: evaluating
    an equation enters its context, and a primitive checks that the context mesh is the
    mesh of its operands' types. The context is an interned, immutable record whose fields
    differ between JAX versions: rebuilt through its interning constructor (``_create``,
    the fields by parameter name), else copied field by field."""
    import inspect

    cur = eqn_ctx_mesh(ctx)
    if cur is None or cur == mesh:
        return ctx
    cls = type(ctx)
    i = _ctx_config_index(ctx, _MESH_CONFIG)
    if i is not None:  # JAX >= 0.12.1: _create(xla_metadata as sorted items, configs)
        configs = ctx.configs[:i] + (mesh,) + ctx.configs[i + 1:]
        xm = ctx.xla_metadata
        return cls._create(None if xm is None else tuple(sorted(xm.items())), configs)
    create = getattr(cls, "_create", None)
    if create is not None:
        try:
            names = list(inspect.signature(create).parameters)
        except (TypeError, ValueError):
            names = None
        if names is not None and all(hasattr(ctx, n) for n in names):
            args = []
            for n in names:
                v = mesh if n == "cur_abstract_mesh" else getattr(ctx, n)
                if n == "xla_metadata" and isinstance(v, dict):
                    v = tuple(sorted(v.items()))  # the constructor's (hashable) form
                args.append(v)
            return create(*args)
    new = object.__new__(cls)
    for n in getattr(cls, "__slots__", ()):
        if n != "__weakref__" and hasattr(ctx, n):
            object.__setattr__(new, n, getattr(ctx, n))
    if hasattr(ctx, "__dict__"):
        new.__dict__.update(ctx.__dict__)
    object.__setattr__(new, "cur_abstract_mesh", mesh)
    return new


def value_with_sharding(x: Any, fix) -> Any:
    """``x`` with the sharding its own type carries replaced by ``fix(sharding)``, for the
    host arrays JAX 0.12 keeps as literals (``TypedNdArray``: a numpy array holding its
    abstract value, whose sharding names the mesh it was traced under); any other value
    (plain numbers and arrays) is returned as is."""
    aval = getattr(x, "_aval", None) if isinstance(x, np.ndarray) else None
    sh = getattr(aval, "sharding", None)
    mesh = getattr(sh, "mesh", None)
    if mesh is None or not mesh.axis_names:
        return x
    new = fix(sh)
    if new is sh:
        return x
    return type(x)(np.asarray(x), aval.update(sharding=new))


def one_device_sharding(device) -> Any:
    """The sharding of a value on ``device`` alone (``jax.sharding.make_single_device_sharding``
    on JAX >= 0.12.1, which deprecates constructing ``SingleDeviceSharding``)."""
    make = getattr(jax.sharding, "make_single_device_sharding", None)
    return make(device) if make is not None else jax.sharding.SingleDeviceSharding(device)


def context_mesh() -> Any:
    """The abstract mesh of the caller's mesh context (``jax.set_mesh``), or None."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    return get() if get is not None else None


def explicit_axis_type() -> Any:
    """``jax.sharding.AxisType.Explicit``, or None on a JAX without axis types."""
    types = getattr(jax.sharding, "AxisType", None)
    return getattr(types, "Explicit", None)


def without_mesh_context():
    """A context in which no mesh is set (``jax.set_mesh(None)``; this thread's), for code
    that places its values on devices itself; nothing to do on a JAX without
    ``jax.set_mesh``."""
    import contextlib

    setter = getattr(jax, "set_mesh", None)
    return setter(None) if setter is not None else contextlib.nullcontext()


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
        return np.zeros(x.shape, dtype)
    return x if x.dtype == dtype else x.astype(dtype)


def saved_residuals(f, *args) -> list:
    """(aval, description) of every value ``jax.vjp(f, *args)`` keeps for the backward,
    as ``jax.ad_checkpoint.print_saved_residuals`` lists them (arguments included)."""
    from jax._src.ad_checkpoint import saved_residuals as _saved
    return list(_saved(f, *args))


# JAX releases whose CPU client hangs running a collective across processes from an executable
# it loaded from the persistent compilation cache: the processes' Gloo all-reduces never meet.
# Found with two processes of two CPU devices each running one jitted all-reduce twice over one
# cache directory: JAX 0.11.0 and 0.12.0 finish the second run, 0.12.1 hangs in it.
_CACHED_CROSS_PROCESS_HANG = frozenset({"0.12.1"})


def cached_cross_process_collectives_hang(platform: str) -> bool:
    """Whether this JAX hangs, on ``platform``, running a cross-process collective loaded
    from the persistent compilation cache, with that cache turned on."""
    return (platform == "cpu" and jax.__version__ in _CACHED_CROSS_PROCESS_HANG
            and bool(jax.config.jax_enable_compilation_cache)
            and bool(jax.config.jax_compilation_cache_dir))
