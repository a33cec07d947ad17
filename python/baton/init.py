"""Per-stage initialization: each process makes only the parameters and optimizer state its
own pipeline ranks read.

The flow (``docs/USAGE.md``, "Initializing only your own stages")::

    init = lambda key: (p := model.init(key, x), opt.init(p))   # the user's own init
    state = baton.abstract_state(init, key)                      # jax.eval_shape: no arrays
    step.compile(*state, batch_spec)                             # traced from shapes alone
    params, opt_state = baton.init_stages(step, init, key)       # this process's leaves only

:func:`init_stages` runs the user's init function as one ``jax.jit`` whose outputs are only
the leaves this process's ranks read, one jit per rank, each leaf with its placement on its
rank (``out_shardings``): XLA removes every computation no kept output depends on, so the other
stages' parameters are never made, and the kept ones have the values a full init gives (the
same program, only its unused outputs dropped). A leaf no rank of this process reads comes
back as a ``baton.Remote`` placeholder naming its owner rank, which the step accepts as it
accepts the placeholders it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from .errors import ConfigError
from .frontend.api import PipelinedFunction
from .running.distributed import Remote


@dataclass(frozen=True)
class LeafHome:
    """Where the step keeps one leaf of its leading arguments: the stages that read it, its
    owner rank (the rank of its first stage; rank 0 when no stage reads it), and whether a
    rank of this process reads it (``local``)."""

    path: str
    stages: tuple[int, ...]
    owner: int
    local: bool
    rank: int  # the rank of this process it is placed on (``owner`` when not ``local``)


def abstract_state(init: Callable, *init_args) -> Any:
    """The state ``init(*init_args)`` would make, as ``jax.ShapeDtypeStruct``s
    (``jax.eval_shape``: nothing is allocated). Pass them to ``step.compile`` (with the
    other arguments, arrays or ``ShapeDtypeStruct``s) to compile the step before any
    parameter exists."""
    return jax.eval_shape(init, *init_args)


def _compiled(fn, what: str):
    if not isinstance(fn, PipelinedFunction):
        raise ConfigError(f"baton.{what}: the first argument must be a baton.jit step "
                          f"(got {type(fn).__name__})")
    if fn.last is None or fn._tree is None:
        raise ConfigError(f"baton.{what}: the step has not been compiled yet: compile it from "
                          f"abstract arguments first, e.g. step.compile(*baton.abstract_state("
                          f"init, key), batch_spec)")
    return fn.last


def leaf_homes(fn, parts: int | None = None) -> list[LeafHome]:
    """Per leaf of the compiled step's first ``parts`` arguments (default: all), where the
    step keeps it (:class:`LeafHome`)."""
    from .checkpoint.leaves import _input_stages

    cs = _compiled(fn, "leaf_homes")
    want = fn._tree.children()
    parts = len(want) if parts is None else parts
    dummy = tuple(jax.tree.unflatten(t, [0] * t.num_leaves) for t in want[:parts])
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]
    in_stages = _input_stages(cs)
    mine = set(fn.ranks) if fn.multi else None
    out = []
    for i, path in enumerate(paths):
        st = tuple(in_stages[cs.traced.step_inputs[i]])
        ranks = sorted({int(cs.stage_rank[s]) for s in st}) or [0]
        owner = ranks[0]
        if mine is None:
            out.append(LeafHome(path, st, owner, True, owner))
            continue
        here = sorted(mine.intersection(ranks))
        out.append(LeafHome(path, st, owner, bool(here),
                            owner if owner in mine or not here else here[0]))
    return out


def _as_args(state):
    """(the leading arguments, wrapped?): a tuple is the leading arguments, anything else the
    first argument (as ``baton.checkpoint``)."""
    return (state, False) if type(state) is tuple else ((state,), True)


def _check_shapes(fn, cs, args, what: str) -> None:
    """``args`` (the init's output as leading arguments) has the structure, shapes and dtypes
    the step was compiled for; raises ``ConfigError`` naming the first leaf that differs."""
    want = fn._tree.children()
    if len(args) > len(want):
        raise ConfigError(f"baton.{what}: the init function returns {len(args)} parts but the "
                          f"step takes {len(want)} arguments")
    pos = 0
    for k, (part, t) in enumerate(zip(args, want)):
        got = jax.tree.structure(part)
        if got != t:
            have = {jax.tree_util.keystr(p) for p, _ in
                    jax.tree_util.tree_flatten_with_path(part)[0]}
            dummy = jax.tree.unflatten(t, [0] * t.num_leaves)
            need = {jax.tree_util.keystr(p) for p, _ in
                    jax.tree_util.tree_flatten_with_path(dummy)[0]}
            diff = sorted(need - have) or sorted(have - need)
            raise ConfigError(
                f"baton.{what}: the init function's part {k} does not have the structure of the "
                f"step's argument {k}" + (f" (first difference at [{k}]{diff[0]})" if diff
                                          else f" (init: {got}; step: {t})"))
        for path, x in jax.tree_util.tree_flatten_with_path(part)[0]:
            aval = cs.traced.avals[cs.traced.step_inputs[pos]]
            shape, dtype = tuple(np.shape(x)), jax.numpy.dtype(x.dtype)
            if shape != tuple(aval.shape) or dtype != aval.dtype:
                raise ConfigError(
                    f"baton.{what}: leaf [{k}]{jax.tree_util.keystr(path)} of the init function "
                    f"is {dtype}{list(shape)} but the step was compiled for "
                    f"{aval.dtype}{list(aval.shape)}")
            pos += 1


def _replicable(x):
    """An init argument as a jit over several processes' devices takes it: a host value
    (a typed PRNG key as its key data, rewrapped inside)."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return ("key", np.asarray(jax.random.key_data(x)), jax.random.key_impl(x))
    if isinstance(x, jax.Array):
        return ("array", np.asarray(x), None)
    return ("value", x, None)


def init_stages(fn, init: Callable, *init_args) -> Any:
    """This process's share of the training state: ``init(*init_args)`` (the user's own init:
    a plain function of a key, ``lambda k: model.init(k, x)`` for Flax linen,
    ``lambda k: nnx.state(Model(rngs=nnx.Rngs(k)))`` for NNX, optionally returning a tuple
    ``(params, opt_state)``) restricted to the leaves the ranks of this process read.

    ``fn``: a ``baton.jit`` step compiled already (``fn.compile`` with
    :func:`abstract_state`'s shapes, or called once); ``init``'s output is its leading
    arguments (a tuple: as many as it returns; one pytree: the first). Returns that output
    with every leaf a rank of this process reads as an array placed on that rank (with the
    step's sharding) and, in multi-process mode, every other leaf a ``baton.Remote``
    placeholder; in one process every leaf is made, each on its own rank. The values equal
    a full ``jax.jit(init)(*init_args)``. Collective only where ranks span processes (every
    process of a rank runs that rank's jit). An init whose leaves differ in structure, shape
    or dtype from what the step was compiled for raises ``ConfigError`` naming the leaf.
    """
    cs = _compiled(fn, "init_stages")
    shapes = jax.eval_shape(init, *init_args)
    args, wrapped = _as_args(shapes)
    _check_shapes(fn, cs, args, "init_stages")
    homes = leaf_homes(fn, len(args))
    flat_shapes, treedef = jax.tree.flatten(args)
    keep = [i for i, h in enumerate(homes) if h.local]
    out_sh = [cs.sharding(cs.traced.step_inputs[i], homes[i].rank) for i in keep]

    spanning = any(not sh.is_fully_addressable for sh in out_sh)
    call_args = init_args
    if spanning:  # a jit over several processes' devices takes host values
        packed = [_replicable(x) for x in jax.tree.leaves(init_args)]
        arg_tree = jax.tree.structure(init_args)
        call_args = tuple(p[1] for p in packed)

        def unpack(*xs):
            vals = [jax.random.wrap_key_data(x, impl=p[2]) if p[0] == "key" else x
                    for x, p in zip(xs, packed)]
            return jax.tree.unflatten(arg_tree, vals)
    else:
        def unpack(*xs):
            return xs

    def kept(*xs):
        leaves = jax.tree.leaves(_as_args(init(*unpack(*xs)))[0])
        return [leaves[i] for i in keep]

    out: list[Any] = [None] * len(flat_shapes)
    by_rank: dict[int, list[int]] = {}  # one jit per rank: a program runs on one device set
    for j, i in enumerate(keep):
        by_rank.setdefault(homes[i].rank, []).append(j)
    for js in by_rank.values():
        def on_rank(*xs, js=js):
            made = kept(*xs)
            return [made[j] for j in js]

        for j, x in zip(js, jax.jit(on_rank, out_shardings=[out_sh[j] for j in js])(
                *call_args)):
            out[keep[j]] = x
    for i, h in enumerate(homes):
        if not h.local:
            s = flat_shapes[i]
            out[i] = Remote(tuple(s.shape), np.dtype(s.dtype), h.owner)
    state = jax.tree.unflatten(treedef, out)
    return state[0] if wrapped else state
