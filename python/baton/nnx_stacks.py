"""Flax NNX layer stacks cut into pipeline stages.

An NNX model keeps a stack of identical layers as one module whose variables carry a leading
layer axis (made with ``nnx.vmap``) and runs it with an ``nnx.scan``-transformed function.
:func:`nnx_scan_stages` calls that same function once per stage group, on a module holding
the group's layers only, with a ``stage_boundary`` after every group but the last; each
stage's layers stay one scan::

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
        return Block(rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = make_blocks(rngs)
        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def forward(x, block):
                return block(x)
            # was: return forward(x, self.blocks)
            return baton.nnx_scan_stages(forward, x, self.blocks, stages=4)

Outside ``baton.jit`` the boundaries are identities and the result equals one ``forward``
over the whole stack. :func:`baton.split_stacks` applies to the stack's part of an
``nnx.State`` (``params["blocks"] = baton.split_stacks(params["blocks"], 4)``) as to any pytree:
each rank then holds only its stage's layers, and the groups are the pieces.

Variables the function changes (an RNG stream's count, a batch statistic) are written back to
the stack, group by group. Variables it *creates* inside the stack (``sow``) have no layer
rows to go back to: :func:`nnx_scan_stages` raises a ``ConfigError`` naming them.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from .errors import ConfigError
from .tracing.primitives import stage_boundary
from .stacks import Stacked, group_bounds, group_leaves

__all__ = ["nnx_stack_groups", "nnx_scan_stages"]

_WHO = "nnx_scan_stages"


def _is_stacked(x) -> bool:
    return isinstance(x, Stacked)


def _split(stack):
    from flax import nnx

    if not isinstance(stack, nnx.Module):
        raise ConfigError(f"{_WHO}: the stack must be an nnx.Module whose variables have a "
                          f"leading layer axis (got {type(stack).__name__})")
    graphdef, state = nnx.split(stack)
    leaves, tree = jax.tree.flatten(state, is_leaf=_is_stacked)
    return graphdef, leaves, tree


def nnx_stack_groups(stack: Any, stages: int | None = None) -> list:
    """The stage groups of ``stack`` (an NNX module with a leading layer axis on every
    variable) as modules of their own: ``stages`` groups of consecutive layers, or the pieces
    when the stack's variables are :class:`Stacked` (then ``stages`` may be omitted)."""
    from flax import nnx

    graphdef, leaves, tree = _split(stack)
    bounds = group_bounds(leaves, stages, _WHO)
    return [nnx.merge(graphdef, jax.tree.unflatten(tree, group_leaves(leaves, g, a, b)))
            for g, (a, b) in enumerate(bounds)]


def _write_back(stack, leaves, tree, groups, inputs) -> None:
    """Puts the variables ``groups`` changed back into ``stack`` (rows of their group)."""
    from flax import nnx

    outs = []
    for g, module in enumerate(groups):
        out, out_tree = jax.tree.flatten(nnx.state(module), is_leaf=_is_stacked)
        if out_tree != tree:
            new = sorted({jax.tree_util.keystr(p) for p, _ in
                          jax.tree_util.tree_flatten_with_path(nnx.state(module))[0]}
                         - {jax.tree_util.keystr(p) for p, _ in
                            jax.tree_util.tree_flatten_with_path(nnx.state(stack))[0]})
            raise ConfigError(
                f"{_WHO}: stage group {g} created variables inside the stack ({new or 'a '
                'changed structure'}), e.g. with sow; return such values through the scan's "
                f"carry or outputs instead")
        outs.append(out)
    changed = [any(outs[g][i] is not inputs[g][i] for g in range(len(groups)))
               for i in range(len(leaves))]
    if not any(changed):
        return
    new_leaves = []
    for i, x in enumerate(leaves):
        if not changed[i]:
            new_leaves.append(x)
        elif _is_stacked(x):
            new_leaves.append(Stacked([o[i] for o in outs], x.axis))
        else:
            new_leaves.append(jnp.concatenate([o[i] for o in outs]))
    nnx.update(stack, jax.tree.unflatten(tree, new_leaves))


def nnx_scan_stages(scan_fn: Callable, carry: Any, stack: Any,
                    stages: int | None = None) -> Any:
    """``scan_fn(carry, stack)`` (an ``nnx.scan``-transformed function over the stack's
    layer axis that returns the new carry) as ``stages`` groups of consecutive layers:
    ``carry = scan_fn(carry, group)`` for each group module
    (:func:`nnx_stack_groups`), a ``stage_boundary`` on the carry after every group but the
    last. Returns the final carry; see the module docstring."""
    from flax import nnx

    graphdef, leaves, tree = _split(stack)
    bounds = group_bounds(leaves, stages, _WHO)
    groups, inputs = [], []
    for g, (a, b) in enumerate(bounds):
        part = group_leaves(leaves, g, a, b)
        module = nnx.merge(graphdef, jax.tree.unflatten(tree, part))
        inputs.append(jax.tree.flatten(nnx.state(module), is_leaf=_is_stacked)[0])
        carry = scan_fn(carry, module)
        if g < len(bounds) - 1:
            carry = stage_boundary(carry)
        groups.append(module)
    _write_back(stack, leaves, tree, groups, inputs)
    return carry
