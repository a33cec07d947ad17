"""The plan's facts about buffers (``Buffers``): ids and keys, which buffers a task reads and
writes, the tasks of a rank's action, transfer channels, and the layout a receiver expects."""

from __future__ import annotations

from .. import _core
from .tasks import FUSED_FB, BufKind, TaskKind, buffer_group, task_kind
from ..tracing.trace import Traced


class Buffers:
    """The plan's facts about buffers, asked of the C++ plan once and cached: ids and keys
    ``(BufKind, stage, microbatch)``, which buffers a task (a ``TaskKind``, or
    ``FUSED_FB``: F and B fused) reads and writes (``Plan.action_inputs`` /
    ``action_outputs``), the tasks of a rank's action, and the layout (avals) a receiver
    expects."""

    def __init__(self, core_plan, traced: Traced, partition, tasks):
        self.plan = core_plan
        sched = core_plan.schedule
        self.rank_actions = [list(a) for a in sched.rank_actions]
        self._tasks = tasks
        self._key: dict[int, tuple] = {}
        self._id: dict[tuple, int] = {}
        self._io: dict[tuple, tuple[list, list]] = {}
        self._actions: dict[tuple, list] = {}
        # What crosses ranks: Act(s, m) holds F(s)'s act outputs, Grad(s, m) B(s)'s (or
        # I(s)'s) input gradients; their avals are the layouts receivers expect.
        self._avals: dict[tuple, list] = {}
        for t in partition.tasks:
            kind = task_kind(t.kind)
            if kind == TaskKind.F:
                self._avals[(BufKind.Act, t.stage)] = [traced.avals[v] for v in t.act_out]
                for e, vs in t.skip_out:
                    self._avals[(BufKind.Skip, e)] = [traced.avals[v] for v in vs]
            elif kind in (TaskKind.B, TaskKind.I):
                self._avals[(BufKind.Grad, t.stage)] = [traced.avals[v] for v in t.grad_out]
                for e, vs in t.skip_grad_out:
                    self._avals[(BufKind.SkipGrad, e)] = [traced.avals[v] for v in vs]

    def key(self, b: int) -> tuple:
        """Buffer ``b``'s key: ``(BufKind, stage, microbatch)`` (``Plan.buffer_key``)."""
        k = self._key.get(b)
        if k is None:
            bk = self.plan.buffer_key(b)
            k = self._key[b] = (bk.kind, bk.stage, bk.microbatch)
        return k

    def id(self, kind, stage: int, m: int) -> int:
        """The id of the ``kind`` (a ``BufKind``) buffer of ``stage``, microbatch ``m``."""
        key = (kind, stage, m)
        b = self._id.get(key)
        if b is None:
            b = self._id[key] = self.plan.buffer_id(kind, stage, m)
        return b

    def _task_io(self, kind, s: int) -> tuple[list, list]:
        """(reads, writes) of a task at microbatch 0 as (kind, stage) pairs."""
        io = self._io.get((kind, s))
        if io is None:
            if kind == FUSED_FB:
                act = _core.Action(*(_core.Task(k, s, 0) for k in FUSED_FB))
            else:
                act = _core.Action(_core.Task(kind, s, 0), None)
            io = self._io[(kind, s)] = (
                [self.key(b)[:2] for b in self.plan.action_inputs(act)],
                [self.key(b)[:2] for b in self.plan.action_outputs(act)])
        return io

    def reads(self, kind, s: int, m: int) -> list[tuple]:
        """The buffers a task reads (an ``FB`` reads none of the stash it makes). Its
        function takes the ones of them it has groups for (``buffer_reads``)."""
        return [(k, bs, m) for k, bs in self._task_io(kind, s)[0]]

    def writes(self, kind, s: int, m: int) -> list[tuple]:
        """The buffers a task makes: Act, Grad, Stash, WStash, WGrad, a skip edge's (an
        ``FB``'s stash is empty: it never leaves the task)."""
        return [(k, bs, m) for k, bs in self._task_io(kind, s)[1]]

    def outputs(self, kind, s: int, m: int, got: dict) -> list[tuple[tuple, list]]:
        """``(buffer, value)`` for each buffer the task writes, from its outputs by group
        (``TaskExe.split``; the FB stash: empty)."""
        out = []
        for key in self.writes(kind, s, m):
            out.append((key, [] if kind == FUSED_FB and key[0] == BufKind.Stash
                        else got[buffer_group(key)]))
        return out

    def tasks_of(self, rank: int, a: int) -> list[tuple]:
        """The tasks of action ``a`` of ``rank``: (``TaskKind``, stage, microbatch); F+B of
        one microbatch fused as one ``(FUSED_FB, stage, microbatch)`` where the step has that
        task."""
        key = (rank, a)
        ts = self._actions.get(key)
        if ts is None:
            act = self.rank_actions[rank][a]
            raw = [act.first] + ([act.second] if act.is_fused else [])
            ts = [(t.kind, t.stage, t.microbatch) for t in raw]
            if (len(ts) == 2 and (ts[0][0], ts[1][0]) == FUSED_FB and ts[0][1:] == ts[1][1:]
                    and (FUSED_FB, ts[0][1]) in self._tasks):
                ts = [(FUSED_FB, ts[0][1], ts[0][2])]
            self._actions[key] = ts
        return ts

    def channel(self, kind, stage: int) -> int:
        """The ordered transfer channel of a ``kind`` buffer of ``stage`` (of edge ``stage``
        for Skip / SkipGrad): ``Plan.channel``, as the verifier's FIFO model has it."""
        return self.plan.channel(self.id(kind, stage, 0))

    def layout(self, kind, stage: int) -> list:
        """The avals of a ``kind`` buffer of ``stage`` as its receiver gets them (the byte
        transports send no header; NCCL needs them)."""
        return self._avals.get((kind, stage), [])
