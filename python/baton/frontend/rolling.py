"""A rank's program as items.

An item is one thing a rank's loop does: a task it runs, or a transfer (a send, a receive
posted, a receive waited on). ``task_list`` and ``rank_items`` read a rank's items from the
plan and the C++ rank program; ``item_reads`` / ``item_writes`` say which buffers each one
reads and makes. The runs of a repeating pattern that the straight lowering traces as
``lax.scan`` are the C++ pass's (``_core.roll_rank``, ``loop_program.py``).
"""

from __future__ import annotations

from typing import NamedTuple

from .. import _core
from .tasks import buffer_reads, task_exes


class Item(NamedTuple):
    """One step of a rank's program as the emitter lowers it. ``op`` "run": ``kind`` a task
    kind (F, B, I, W, FB), ``peer`` -1; "send" / "post" (a receive posted) / "wait" (a
    receive waited on): ``kind`` a buffer kind, ``peer`` the other rank."""

    op: str
    kind: str
    stage: int
    mb: int
    peer: int


def task_list(cs, rank: int = 0) -> list[tuple[str, int, int]]:
    """A rank's tasks in program order: (kind, stage, microbatch); fused F+B as ``FB``."""
    b = cs.buffers
    return [t for a in range(len(b.rank_actions[rank])) for t in b.tasks_of(rank, a)]


def _exes(cs, kind, s):
    return task_exes(cs.tasks, kind, s)


def reads(cs, kind, s, m) -> list[tuple[str, int, int]]:
    """Buffers (kind, stage, microbatch) a task passes to its function (``buffer_reads``
    of the plan's reads)."""
    return buffer_reads(_exes(cs, kind, s)[0], cs.buffers.reads(kind, s, m))


def writes(cs, kind, s, m) -> list[tuple[str, int, int]]:
    """Buffers a task makes (the plan's, ``Buffers.writes``), but its weight gradients: a
    program adds them to its sums directly."""
    return [key for key in cs.buffers.writes(kind, s, m) if key[0] != "WGrad"]


def item_reads(cs, it: Item) -> list[tuple[str, int, int]]:
    op, k, s, m, _ = it
    if op == "run":
        return reads(cs, k, s, m)
    return [(k, s, m)] if op == "send" else []


def item_writes(cs, it: Item) -> list[tuple[str, int, int]]:
    op, k, s, m, _ = it
    if op == "run":
        return writes(cs, k, s, m)
    return [(k, s, m)] if op == "wait" else []


def rank_items(cs, rank: int) -> list[Item]:
    """A rank's program as items, read from the C++ rank program (``cs.rank_ir()``,
    docs/RANK_IR.md), which says where each group of transfers is posted (its receives where
    the plan posts them: before the RUN that precedes the RECV) and where each receive is
    waited on (just before the first task that reads it). The C++ verifier checks what the
    FFI transfers need: each wait follows its post, and the waits of one (peer, channel) come
    in post order."""
    prog = cs.rank_ir().programs[rank]
    bufs = cs.buffers
    items: list[Item] = []

    def key(b):
        return bufs.key(prog.buffers[b].id)

    for ins in prog.instrs:
        if ins.op == _core.RankOp.POST:
            for t in prog.groups[ins.group].transfers:
                x = prog.transfers[t]
                op = "send" if x.dir == _core.TransferDir.SEND else "post"
                items.append(Item(op, *key(x.buffer), x.peer))
        elif ins.op == _core.RankOp.WAIT:
            x = prog.transfers[ins.transfer]
            items.append(Item("wait", *key(x.buffer), x.peer))
        elif ins.op == _core.RankOp.RUN:
            for kind, s, m in bufs.tasks_of(rank, prog.units[ins.unit].action):
                items.append(Item("run", kind, s, m, -1))
    return items
