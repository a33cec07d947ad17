"""The rings of table rank programs, for the memory model (``memory.py``).

On the compiled engine a rank of one device runs its loop as a table (``rank_table.py``),
whose buffers live in rings allocated for the whole loop: one ring per set of buffer kinds of
equal avals, with as many slots as the rank program's slots of that pool
(``rings.ring_layout``, the C++ rank IR built with those pools). Ranks that share one
compiled program (``shared.py``) hold rings sized for every member. So what such a rank
holds for its buffers is its rings' bytes, whatever the moment in the loop: the model takes
that instead of the simulator's live peak, and while a task runs, besides its temporaries and
new sums, the buffers it slices out of rings of several slots (a ring of one slot is read
whole; its outputs are written into the rings in place) (``table_loop``).
"""

from __future__ import annotations

import jax
import numpy as np

from ..emit.rank_program import RankProgram, loop_form
from ..emit.rings import _ring_aval, ring_layout
from ..emit.share_match import share_groups
from ..planning.tasks import FUSED_FB, MB, BufKind, task_exes


def table_ranks(step) -> list[int]:
    """The ranks the compiled engine runs as tables: every rank of one device (not on GPUs)
    of a multi-rank step on the compiled engine."""
    if step.engine_name != "compiled" or step.num_ranks < 2:
        return []
    return [r for r in range(step.num_ranks)
            if len(step.mesh.rank_devices[r]) == 1 and loop_form(step, r) == "table"]


def buffer_outputs(compiled):
    """``((kind, stage or edge), items)`` for each plan buffer a compiled task makes (its
    output ``(sharding, shape, dtype)`` items; weight gradients, stacked outputs and a fused
    FB's internal stash left out)."""
    for (kind, s), (groups, _, _) in compiled.items():
        for g, items in groups.items():
            if g in (BufKind.WGrad, MB) or (kind == FUSED_FB and g == BufKind.Stash) or not items:
                continue
            # the group of a kind of buffer of the stage, or a skip edge's (its kind, edge)
            yield (g if isinstance(g, tuple) else (g, s)), items


def _kind_avals(step, compiled) -> dict:
    """(kind, stage or edge) -> the ring avals of one buffer of it, from the compiled
    tasks' outputs (a received kind has its producer's avals)."""
    return {key: [_ring_aval(jax.ShapeDtypeStruct(shape, dt)) for _, shape, dt in items]
            for key, items in buffer_outputs(compiled)}


def _nbytes(avals) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in avals)


def _signature(avals) -> tuple:
    return tuple((tuple(a.shape), np.dtype(a.dtype).str) for a in avals)


def _ring_slots(step, avals) -> dict[int, dict]:
    """Rank -> ``(kind, stage)`` -> the slots of its ring (``table_ranks``): its pool's slots,
    the most any member of its shared program needs."""
    ranks = table_ranks(step)
    sizes: dict[int, dict] = {}  # rank -> pool label -> slots
    pools: dict[int, dict] = {}  # rank -> (kind, stage) -> pool label
    for r in ranks:
        lay = ring_layout(step, r)
        pool_of = {ks: _signature(avals[ks]) for ks in lay.kinds}
        lay = ring_layout(step, r, pool_of)
        sizes[r] = dict(lay.sizes)
        pools[r] = dict(lay.pool_of)
    for group in _share_groups(step, ranks):
        most: dict = {}
        for r in group:
            for label, n in sizes[r].items():
                most[label] = max(most.get(label, 0), n)
        for r in group:
            sizes[r] = {label: most[label] for label in sizes[r]}
    return {r: {ks: sizes[r][label] for ks, label in pools[r].items()} for r in ranks}


def _ring_bytes(step, avals, slots) -> dict[int, int]:
    """Device id -> bytes of the rings of its table rank, from each rank's ``_ring_slots``:
    per pool, its slots x the bytes of one buffer (one device: a buffer is whole on it;
    kinds of one pool share its slots, counted once)."""
    out = {}
    for r, per in slots.items():
        per_pool = {_signature(avals[ks]): n * _nbytes(avals[ks]) for ks, n in per.items()}
        out[step.mesh.rank_devices[r][0].id] = sum(per_pool.values())
    return out


def _share_groups(step, ranks) -> list[list[int]]:
    """The ranks that run one shared program (``share_groups`` over the step's rank
    programs, built without a transport when the step has not run)."""
    if not step.engine.share or step.transport == "nccl" or len(ranks) < 2:
        return []
    progs = step.engine.local_progs
    if progs is None:
        from .. import _core

        progs = [RankProgram(step, r, _core.runtime.RankComm(r), 10.0)
                 for r in range(step.num_ranks)]
    return [[sh.prog.rank for sh in g] for g in share_groups(progs) if len(g) > 1]


def table_loop(step, compiled, acc) -> tuple[dict, dict, dict]:
    """Per device of a table rank: (its rings, its loop peak, its largest transient). The
    loop holds the rings and every running sum throughout, plus one task at a time: its XLA
    temporaries and new sums (``compiled``) and the buffers it reads out of rings of several
    slots (a dynamic slice XLA materializes; a ring of one slot is read whole, the slice
    simplified away)."""
    if not table_ranks(step):
        return {}, {}, {}
    avals = _kind_avals(step, compiled)
    slots = _ring_slots(step, avals)
    rings = _ring_bytes(step, avals, slots)
    loop, transient = {}, {}
    for r in table_ranks(step):
        d = step.mesh.rank_devices[r][0].id
        units = {(k, s) for a in range(len(step.buffers.rank_actions[r]))
                 for k, s, _ in step.buffers.tasks_of(r, a)}
        most = 0
        for kind, s in units:
            io = sum(_nbytes(avals.get(key[:2], [])) for key in step.buffers.reads(kind, s, 0)
                     if slots[r].get(key[:2], 0) > 1)
            for exe in task_exes(step.tasks, kind, s):
                _, temp, new = compiled[(exe.kind, exe.stage)]
                most = max(most, temp + new.get(d, 0) + io)
        transient[d] = most
        loop[d] = rings[d] + acc.get(d, 0) + most
    return rings, loop, transient
