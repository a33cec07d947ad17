"""Compiling the code after the loop while the loop's programs compile (``Warmup``).

A process's segments after the loop (``CompiledStep.post_segments``) are per-stage jits,
compiled at their first call. With several processes they form a chain: the gradient-norm
segment of one stage waits for another process's partial sums, whose segment only then
compiles, and so on, so their compiles run one after another across processes. There
(``engine.ProgramEngine._build_rank``) a ``Warmup`` compiles this process's segments ahead,
on background threads, from the values' avals and the placement they will have on the rank
(``CompiledStep.sharding``); XLA compiles without the GIL, so this overlaps the rank
program's compile and the loop, and the segment's first call finds its executable in JAX's
in-memory compilation cache. The warm-up changes no result: a segment whose arguments end
up laid out otherwise than guessed (only ranks of one device are warmed) compiles again at
its call. In one process the code after the loop compiles at its first call: there the rank
programs already compile in parallel on every core, the warm-up's tracing holds the GIL
against their lowering, and the segments' arguments may carry the model's own meshes, which
the guess misses (the trial on MaxText's model is in `bench/results/maxtext.md`).
On a process with one core (a rank pinned to its core) the compiles run in the building
thread right after the rank program's (``run``): two XLA compiles time-sliced on one core take
longer than the same two one after the other (`bench/results/maxtext.md`), and there is no
second core to overlap with.
On JAX 0.11 the warm-up is off: its AOT compile does not fill the cache that jit calls use.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import jax

from .. import _jax_compat as jc


class _Job(NamedTuple):
    seg: Any  # a segment after the loop (``segments.Segment``)
    rank: int  # the rank it runs on


class Warmup:
    """Compiles ahead of their first call the segments of ``segs`` placed on ``ranks`` of
    ``step`` (the ranks of one device among them): on background threads started here, or,
    with ``background=False``, in the thread that calls ``run``; ``join`` waits for the
    threads. A failed compile is dropped: the segment's own call compiles it again and
    raises there."""

    def __init__(self, step: Any, segs: list, ranks: list[int], background: bool = True):
        self.threads: list[threading.Thread] = []
        self.step = step
        self.jobs: list[_Job] = []  # not yet compiled or started
        if jc.jax_version < (0, 12):  # its AOT compile does not fill the cache jit calls use
            return
        one = {r for r in ranks if len(step.mesh.rank_devices[r]) == 1}
        for seg in segs:
            rank = step.stage_rank[seg.stage]
            if rank in one:
                self.jobs.append(_Job(seg, rank))
        if not background:
            return
        for job in self.jobs:
            # not a daemon: a process that stops while they compile (after an error, or after
            # `compile` without a call) waits for them at exit; a daemon thread inside XLA's
            # compiler while the interpreter finalizes crashes the process (SIGSEGV or
            # std::terminate; test_engine.py)
            t = threading.Thread(target=self._compile, args=(step, job.seg, job.rank),
                                 name=f"baton-warm-s{job.seg.stage}")
            t.start()
            self.threads.append(t)
        self.jobs = []

    def run(self) -> None:
        """Compiles the segments not started on threads, here, one after another."""
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            self._compile(self.step, job.seg, job.rank)

    @staticmethod
    def _spec(step: Any, v: int, rank: int) -> jax.ShapeDtypeStruct:
        a = step.traced.avals[v]
        return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=bool(getattr(a, "weak_type", 0)),
                                    sharding=step.sharding(v, rank))

    @classmethod
    def _compile(cls, step: Any, seg: Any, rank: int) -> None:
        try:
            seg.fn.lower(*[cls._spec(step, v, rank) for v in seg.inputs]).compile()
        except Exception:  # noqa: BLE001  (the segment's own call compiles and raises)
            pass

    def join(self) -> None:
        for t in self.threads:
            t.join()
        self.threads = []
