"""A rank's table and its rings: the items as table steps, the ring slot of each buffer as
the rank program assigns it (``ring_layout``), and how an array is kept in a ring slot."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as jc
from .rolling import Item, ItemOp


def _ring_aval(a):
    """How an array of ``a`` is kept in a ring slot: typed keys as their key data, float0 as
    bool (no widening: a ring holds values, not messages)."""
    if jc._is_key(a.dtype) or a.dtype == jax.dtypes.float0:
        return jc.wire_aval(a)
    return jax.ShapeDtypeStruct(tuple(a.shape), a.dtype)


def _ring_in(x):
    if jc._is_key(x.dtype):
        return jax.random.key_data(x)
    if x.dtype == jax.dtypes.float0:
        return jnp.zeros(x.shape, jnp.bool_)
    return x


def table_steps(items) -> list[tuple[list[Item], Item | None]]:
    """A rank's items as table steps: each task with the stretch of transfers before it (a
    stretch after the last task is a step without a task)."""
    out, cur = [], []
    for it in items:
        if it.op == ItemOp.RUN:
            out.append((cur, it))
            cur = []
        else:
            cur.append(it)
    if cur:
        out.append((cur, None))
    return out


def _symbolic(items) -> tuple[tuple, list[int]]:
    """``items`` with each microbatch replaced by its symbol (0, 1, ... in order of first
    appearance), and the microbatch of each symbol."""
    sym: dict[int, int] = {}
    pat = tuple(it._replace(mb=sym.setdefault(it.mb, len(sym))) for it in items)
    return pat, list(sym)


@dataclass
class RingLayout:
    """A rank's ringed buffers as its C++ rank program places them (``assign_slots``, checked
    by the rank-IR verifier): ``kinds``, the ringed ``(kind, stage)`` (rows some later
    instruction on the rank reads); ``pool_of``, each kind's pool (kinds of one pool share a
    ring); ``slots``, each kind's slot per microbatch; ``sizes``, each pool's slots (the most
    of its buffers held at once); ``held``, each ringed buffer's ``(kind, stage)`` and the
    instructions where the program puts it into its slot and last reads it."""

    kinds: list[tuple]  # (BufKind, stage)
    pool_of: dict
    slots: dict[tuple, np.ndarray]
    sizes: dict
    held: list[tuple[tuple, int, int]]


def ring_layout(cs, rank: int, pool_of: dict | None = None) -> RingLayout:
    """Rank ``rank``'s rings: the step's rank program (built once with its plan,
    ``_core.build_step``) with its slots given again by ``pool_of`` (``(kind, stage)`` -> a
    pool label; kinds of one label share slots; ``_core.with_pools``: the slot pass alone);
    without it, the step's own slots (one pool per kind)."""
    M = cs.M
    bufs = cs.buffers
    labels = None
    if pool_of:
        n_rows = cs.core_plan.num_buffer_rows()
        names = sorted({repr(v) for v in pool_of.values()})
        labels = list(range(n_rows))  # rows without a label: a pool of their own
        for (k, s), v in pool_of.items():
            labels[cs.core_plan.buffer_row(bufs.id(k, s, 0))] = n_rows + names.index(repr(v))
    prog = cs.rank_ir(labels).programs[rank]
    row_keys = (cs.core_plan.row_key(row) for pool in prog.pools for row in pool.rows)
    kinds = sorted({(k.kind, k.stage) for k in row_keys})
    chosen = dict(pool_of) if pool_of else {ks: ks for ks in kinds}
    slots = {ks: np.zeros(M, np.int32) for ks in kinds}
    sizes: dict = {}
    held = []
    for b in prog.buffers:
        if b.pool < 0:
            continue
        k, s, m = bufs.key(b.id)
        slots[(k, s)][m] = b.slot
        held.append(((k, s), b.held_from, b.held_to))
        label = chosen[(k, s)]
        sizes[label] = max(sizes.get(label, 0), prog.pools[b.pool].slots)
    return RingLayout(kinds, {ks: chosen[ks] for ks in kinds}, slots, sizes, held)
