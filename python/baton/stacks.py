"""Layer stacks under ``lax.scan``, cut into pipeline stages.

Large JAX models keep their layers' parameters stacked (one array per kind of weight with a
leading layer axis) and run them with ``lax.scan``. :func:`scan_stages` is that scan, cut into
stage groups: each group of consecutive layers stays a ``lax.scan`` inside its stage, and a
``stage_boundary`` ends every group but the last::

    def loss_fn(params, batch):
        x = embed(params, batch)
        x = baton.scan_stages(block, x, params["layers"], stages=4)   # was: lax.scan
        return head(params, x, batch)

With plain stacked arrays every stage reads its layers from the whole stack (so every rank
that runs a group holds the whole stack and a whole-sized gradient for it). Wrap the stacked
leaves with :func:`split_stacks` first and each stage owns only its own layers: a
:class:`Stacked` leaf is one pytree node whose children are the per-stage pieces, so the
pieces are separate arrays for Baton (placed on the rank that runs them) and for the
optimizer (``tree_map`` updates each piece), while the model still sees the stack.
``Stacked.full()`` / :func:`join_stacks` give the stacked arrays back.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from .errors import ConfigError
from .tracing.primitives import stage_boundary

__all__ = ["Stacked", "scan_stages", "split_stacks", "join_stacks"]


@jax.tree_util.register_pytree_node_class
class Stacked:
    """A layer-stacked array held as consecutive pieces along its layer axis (``axis``, the
    leading one unless a model stacks its layers elsewhere)."""

    def __init__(self, pieces, axis: int = 0):
        self.pieces = tuple(pieces)
        self.axis = int(axis)

    def tree_flatten(self):
        return self.pieces, self.axis

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children, aux)

    @property
    def sizes(self) -> list[int]:
        """Layers per piece."""
        return [int(jnp.shape(p)[self.axis]) for p in self.pieces]

    @property
    def shape(self) -> tuple:
        shape = list(jnp.shape(self.pieces[0]))
        shape[self.axis] = sum(self.sizes)
        return tuple(shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.pieces[0].dtype

    def full(self):
        """The stacked array (a concatenation of the pieces). Concrete pieces that live on
        different ranks' devices are brought to the first piece's devices first."""
        pieces = self.pieces
        if not any(isinstance(p, jax.core.Tracer) for p in pieces) and all(
                isinstance(p, jax.Array) for p in pieces):
            home = pieces[0].sharding
            pieces = [p if p.sharding.device_set == home.device_set else jax.device_put(p, home)
                      for p in pieces]
        return jnp.concatenate(pieces, axis=self.axis)

    def __repr__(self) -> str:
        return f"Stacked(shape={self.shape}, sizes={self.sizes}, axis={self.axis})"


def _groups(n: int, stages: int) -> list[tuple[int, int]]:
    """``stages`` consecutive groups of ``n`` layers, sizes differing by at most one (the
    first groups take the extra layers)."""
    base, extra = divmod(n, stages)
    out, a = [], 0
    for g in range(stages):
        b = a + base + (g < extra)
        out.append((a, b))
        a = b
    return out


def _is_stacked(x) -> bool:
    return isinstance(x, Stacked)


def group_bounds(leaves: list, stages: int | None, who: str) -> list[tuple[int, int]]:
    """``(first, end)`` layer ranges of the stage groups of a stack's flattened ``leaves``
    (flattened with :class:`Stacked` as leaves): the pieces of :class:`Stacked` leaves, or
    ``stages`` groups of plain arrays. ``who`` names the caller in errors."""
    if not leaves:
        raise ConfigError(f"{who}: no stacked layer parameters")
    split = [x for x in leaves if _is_stacked(x)]
    if split:
        sizes = split[0].sizes
        if any(x.sizes != sizes for x in split) or len(split) != len(leaves):
            shapes = [x.sizes if _is_stacked(x) else "plain array" for x in leaves]
            raise ConfigError(f"{who}: the stacked leaves are split differently: {shapes}")
        if stages is not None and stages != len(sizes):
            raise ConfigError(
                f"{who}: stages={stages} but the Stacked leaves have {len(sizes)} pieces")
        bounds, a = [], 0
        for s in sizes:
            bounds.append((a, a + s))
            a += s
        return bounds
    if stages is None:
        raise ConfigError(f"{who}: pass stages= (or split the leaves with split_stacks)")
    if any(jnp.ndim(x) == 0 for x in leaves):
        raise ConfigError(f"{who}: a stacked leaf is a scalar (no leading layer axis)")
    n_layers = int(jnp.shape(leaves[0])[0])
    if any(int(jnp.shape(x)[0]) != n_layers for x in leaves):
        raise ConfigError(f"{who}: the stacked leaves have different layer counts "
                          f"{sorted({int(jnp.shape(x)[0]) for x in leaves})}")
    if not 1 <= stages <= n_layers:
        raise ConfigError(f"{who}: {stages} stages for {n_layers} layers")
    return _groups(n_layers, stages)


def group_leaves(leaves: list, g: int, a: int, b: int) -> list:
    """Group ``g`` (layers ``a:b``) of every leaf: a :class:`Stacked` leaf's piece ``g``, a
    plain array's rows ``a:b``."""
    return [x.pieces[g] if _is_stacked(x) else x[a:b] for x in leaves]


def split_stacks(tree: Any, stages: int, axis: int | Callable[[Any, Any], int] = 0) -> Any:
    """``tree`` with every array leaf split into ``stages`` pieces along its layer axis, as
    :class:`Stacked` leaves. Apply it to the stacked layer parameters only (e.g.
    ``params["layers"]``). ``axis``: the layer axis (default the leading one), or a function
    ``(path, leaf) -> axis`` for stacks whose leaves hold it in different places."""
    if stages < 1:
        raise ConfigError(f"split_stacks: stages must be >= 1 (got {stages})")

    def split(path, x):
        ax = int(axis(path, x) if callable(axis) else axis)
        where = jax.tree_util.keystr(path) or "the leaf"
        if not 0 <= ax < max(jnp.ndim(x), 1):
            raise ConfigError(f"split_stacks: {where} (shape {jnp.shape(x)}) has no axis {ax}")
        n = int(jnp.shape(x)[ax]) if jnp.ndim(x) else 0
        if n < stages:
            raise ConfigError(f"split_stacks: {where} has {n} layers (axis {ax}), fewer than "
                              f"the {stages} stages")
        return Stacked([jax.lax.slice_in_dim(x, a, b, axis=ax) for a, b in _groups(n, stages)],
                       ax)

    return jax.tree_util.tree_map_with_path(split, tree)


def join_stacks(tree: Any) -> Any:
    """``tree`` with every :class:`Stacked` leaf joined back into one stacked array."""
    return jax.tree.map(lambda x: x.full() if isinstance(x, Stacked) else x, tree,
                        is_leaf=lambda x: isinstance(x, Stacked))


def scan_stages(layer_fn: Callable, carry: Any, stacked: Any, stages: int | None = None,
                unroll: int = 1) -> Any:
    """``carry = layer_fn(carry, layer)`` for every layer of ``stacked`` in order (a pytree
    whose leaves share a leading layer axis), as ``stages`` groups of consecutive layers,
    each group a ``lax.scan`` and a ``stage_boundary`` after every group but the last.
    Returns the final carry. With :class:`Stacked` leaves (:func:`split_stacks`) the groups
    are their pieces and ``stages`` may be omitted; with plain arrays ``stages`` is required.
    Outside ``baton.jit`` the boundaries are identities: the result equals one ``lax.scan``
    over all layers."""
    leaves, tree = jax.tree.flatten(stacked, is_leaf=_is_stacked)
    if any(_is_stacked(x) and x.axis != 0 for x in leaves):
        raise ConfigError("scan_stages: lax.scan runs over the leading axis; these Stacked "
                          "leaves hold their layers on another axis")
    bounds = group_bounds(leaves, stages, "scan_stages")

    def body(c, layer):
        return layer_fn(c, layer), None

    for g, (a, b) in enumerate(bounds):
        group = jax.tree.unflatten(tree, group_leaves(leaves, g, a, b))
        carry, _ = jax.lax.scan(body, carry, group, unroll=unroll)
        if g < len(bounds) - 1:
            carry = stage_boundary(carry)
    return carry
