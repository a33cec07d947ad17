"""A rank's program as items.

An item is one thing a rank's loop does: a task it runs, or a transfer (a send, a receive
posted, a receive waited on). The items of a rank, and the runs of a repeating pattern that
the rolled lowering traces as ``lax.scan``, are the C++ passes' over the rank program
(``_core.rank_items`` / ``_core.roll_rank``, ``baton/roll.h``); ``rank_items`` and
``as_item`` give them to Python as ``Item`` records. ``item_reads`` / ``item_writes`` say
which buffers an item passes to its function and makes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .. import _core
from ..planning.tasks import FUSED_FB, BufKind, buffer_reads, task_exes


ItemOp = _core.ItemOp  # the item level's vocabulary (roll.h; docs/RANK_IR.md, "Vocabularies")


class Item(NamedTuple):
    """One step of a rank's program as the emitter lowers it. ``op`` ``ItemOp.RUN``:
    ``kind`` a task kind (a ``_core.TaskKind``, or ``FUSED_FB`` for F+B fused), ``peer``
    -1; ``SEND`` / ``POST`` (a receive posted) / ``WAIT`` (a receive waited on): ``kind`` a
    buffer kind (a ``_core.BufKind``), ``peer`` the other rank."""

    op: "_core.ItemOp"
    kind: Any  # RUN: a _core.TaskKind or FUSED_FB; otherwise a _core.BufKind
    stage: int
    mb: int
    peer: int


def task_list(cs, rank: int = 0) -> list[tuple]:
    """A rank's tasks in program order: (kind, stage, microbatch); fused F+B as
    ``FUSED_FB``."""
    b = cs.buffers
    return [t for a in range(len(b.rank_actions[rank])) for t in b.tasks_of(rank, a)]


def _exes(cs, kind, s):
    return task_exes(cs.tasks, kind, s)


def reads(cs, kind, s, m) -> list[tuple]:
    """Buffers (kind, stage, microbatch) a task passes to its function (``buffer_reads``
    of the plan's reads)."""
    return buffer_reads(_exes(cs, kind, s)[0], cs.buffers.reads(kind, s, m))


def writes(cs, kind, s, m) -> list[tuple]:
    """Buffers a task makes (the plan's, ``Buffers.writes``), but its weight gradients: a
    program adds them to its sums directly."""
    return [key for key in cs.buffers.writes(kind, s, m) if key[0] != BufKind.WGrad]


def item_reads(cs, it: Item) -> list[tuple]:
    op, k, s, m, _ = it
    if op == ItemOp.RUN:
        return reads(cs, k, s, m)
    return [(k, s, m)] if op == ItemOp.SEND else []


def item_writes(cs, it: Item) -> list[tuple]:
    op, k, s, m, _ = it
    if op == ItemOp.RUN:
        return writes(cs, k, s, m)
    return [(k, s, m)] if op == ItemOp.WAIT else []


def roll_options(cs, max_period=None, stacked=True) -> "_core.RollOptions":
    """Options of the C++ item and run passes (``baton/roll.h``). ``max_period``: the longest
    pattern (None: the pass's default); ``stacked`` False: no run hands stacked buffers to
    later items. A fused F+B action is one FB item when the step has a fused function: it
    has one for every stage with an F and a B task, so for none when the partition split
    the backward (``build_tasks``)."""
    opts = _core.RollOptions()
    opts.max_period = int(max_period or 0)
    opts.stacked = bool(stacked)
    opts.fuse_fb = any(kind == FUSED_FB for kind, _ in cs.tasks)
    return opts


def as_item(x) -> Item:
    """A ``_core.RollItem`` as an ``Item``."""
    if x.op == ItemOp.RUN:
        return Item(x.op, FUSED_FB if x.fused else x.task, x.stage, x.microbatch, -1)
    return Item(x.op, x.buffer, x.stage, x.microbatch, x.peer)


def rank_items(cs, rank: int) -> list[Item]:
    """A rank's program as items: the C++ pass over its rank program (``_core.rank_items``,
    ``baton/roll.h``, over ``cs.rank_ir()``, docs/RANK_IR.md), which says where each group
    of transfers is posted and where each receive is waited on (just before the first task
    that reads it). The C++ verifier checks what the FFI transfers need: each wait follows
    its post, and the waits of one (peer, channel) come in post order."""
    prog = cs.rank_ir().programs[rank]
    return [as_item(x) for x in _core.rank_items(cs.core_plan, prog, roll_options(cs))]
