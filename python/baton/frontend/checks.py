"""Checks of what the user passed to ``baton.jit`` that name the mistake (used by
:mod:`baton.frontend.api`; the mistakes are tested in tests/python/test_wrong_uses.py)."""

from __future__ import annotations

import jax
import numpy as np

from .. import _core
from ..errors import ConfigError, TraceError
from ..running.distributed import Remote

G = _core.graph


def stages_hint(stages: int, ranks: int, want: int) -> str:
    if stages > ranks and stages % ranks == 0:
        v = stages // ranks
        vs = " or baton.ZBV() / baton.DualPipeV()" if v == 2 else ""
        return (f"; with fewer ranks than stages, use a schedule with {v} stages per rank: "
                f"baton.Interleaved1F1B(virtual_stages={v}){vs}, or a mesh of {stages} ranks")
    if stages < want:
        return f"; add stage_boundary calls or use a mesh of {stages} ranks"
    return ""


def check_backward(traced) -> None:
    """A pipeline needs a gradient back across every stage boundary (the step trains and
    the stages before it have parameters); raises ``TraceError`` naming the first without."""
    fwd = {op.boundary for op in traced.ops if op.kind == G.OpKind.Boundary and not op.backward}
    bwd = {op.boundary for op in traced.ops if op.kind == G.OpKind.Boundary and op.backward}
    missing = sorted(fwd - bwd)
    if not missing:
        return
    j = missing[0]
    raise TraceError(
        f"no gradient flows back across stage boundary {j} (between stages {j} and {j + 1}): "
        f"either the function given to baton.accumulate computes no gradient (pass e.g. "
        f"jax.value_and_grad(loss_fn): Baton pipelines training steps; for a forward-only "
        f"step use jax.jit), or stages 0..{j} have no parameters the loss depends on (move "
        f"the boundary after the first layer with parameters)")


def _is_leaf_value(x) -> bool:
    return (isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, Remote,
                           int, float, complex, bool))
            or (hasattr(x, "shape") and hasattr(x, "dtype")))


def check_leaves(flat, args) -> None:
    """Every argument leaf is an array (or a number, a ShapeDtypeStruct, a Remote); raises
    ``ConfigError`` naming the first that is not, by its path."""
    if all(_is_leaf_value(x) for x in flat):
        return
    for path, x in jax.tree_util.tree_flatten_with_path(args)[0]:
        if not _is_leaf_value(x):
            raise ConfigError(
                f"baton.jit: argument {jax.tree_util.keystr(path)} is a "
                f"{type(x).__name__} ({x!r:.60}), not an array: every leaf of the step's "
                f"arguments must be an array or a number (keep strings and other Python "
                f"objects out of the arguments, e.g. in a closure)")


__all__ = ["check_backward", "check_leaves", "stages_hint"]
