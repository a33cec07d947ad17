"""A rank's table and its rings: the items as table steps, when each ringed buffer lives
(``buffer_lives``) and the ring slot each buffer takes (``ring_slots``), and how an array is
kept in a ring slot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_compat as jc
from .rolling import Item, item_reads, item_writes


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
        if it.op == "run":
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


def buffer_lives(cs, steps) -> dict[tuple[str, int], dict[int, tuple[int, int]]]:
    """When each ringed buffer lives: ``(kind, stage)`` -> microbatch -> (position of its
    write, position of its last read). A step's transfers are position 2i, its task 2i+1; a
    buffer nothing reads lives at its write only. Only kinds a later unit reads are ringed
    (a buffer only sent is handed from its task to the stretch after it by value)."""
    read_kinds = {(k, s) for st, task in steps for it in st + ([task] if task else [])
                  for k, s, _ in item_reads(cs, it)}
    life: dict[tuple[str, int], dict[int, list[int]]] = {}
    for i, (st, task) in enumerate(steps):
        for pos, its in ((2 * i, st), (2 * i + 1, [task] if task else [])):
            for it in its:
                for k, s, m in item_writes(cs, it):
                    if (k, s) in read_kinds:
                        life.setdefault((k, s), {})[m] = [pos, pos]
                for k, s, m in item_reads(cs, it):
                    iv = life[(k, s)][m]
                    iv[1] = max(iv[1], pos)
    return {ks: {m: (w, last) for m, (w, last) in iv.items()} for ks, iv in life.items()}


def ring_slots(lives, pool_of, M: int) -> tuple[dict, dict]:
    """Rings for buffers: kinds with the same ``pool_of[(kind, stage)]`` (the same avals)
    share one ring. Returns (``(kind, stage)`` -> int32 [M], the slot of each microbatch's
    buffer; pool -> its number of slots). No buffer may be written into a slot between
    another buffer's write and its last read, both included (so a unit never reads and
    writes one slot). Slots are given greedily in order of the writes, each buffer the lowest
    slot free at its write: for intervals that is optimal, so a ring has exactly as many
    slots as the most buffers of its pool ever live at once. Sharing one ring among the
    kinds of equal shape (a rank's boundary activations and gradients; the stashes of a
    rank's two stages in a V schedule) brings a table's buffers to the schedule's live peak
    for most schedules, where per-kind rings held the sum of each kind's peak
    (``bench/results/table_memory.md``)."""
    slots = {ks: np.zeros(M, np.int32) for ks in lives}
    ends: dict = {}  # pool -> per slot, the last position its buffer is read
    order = sorted((w, ks, m, last) for ks, iv in lives.items() for m, (w, last) in iv.items())
    for w, ks, m, last in order:
        e = ends.setdefault(pool_of[ks], [])
        j = next((j for j, x in enumerate(e) if x < w), len(e))
        if j == len(e):
            e.append(last)
        else:
            e[j] = last
        slots[ks][m] = j
    sizes = {pool: len(e) for pool, e in ends.items()}
    return slots, sizes
