"""The compiled engine: runs a ``CompiledStep``'s loop as XLA programs (``program.py``).

* one rank: the whole step as one program (``SingleProgram``);
* several ranks in one process: one ``RankProgram`` per rank on its devices, each launched
  from its own thread so the ranks overlap, transfers through an in-process ``LocalHub``
  from inside the programs (FFI calls);
* one process per rank: this rank's ``RankProgram`` over the process group's transport.

Programs are compiled before their first run (a rank never waits on another's compile).
A step the engine cannot run raises ``ConfigError`` saying why (``refusal``); there is no
fallback to the interpreter.
"""

from __future__ import annotations

from typing import Any

from .. import _core
from ..errors import ConfigError
from .interpreter import on_rank_threads


def refusal(step, rank: int, transport_kind: str = "local") -> str | None:
    """Why the compiled engine cannot run ``rank`` of ``step``, or None."""
    devs = step.mesh.rank_devices[rank]
    if len(devs) > 1 and step.num_ranks > 1:
        return (f"rank {rank} has {len(devs)} devices: the compiled engine moves a rank's "
                f"values whole, and a value sharded over several devices would cross "
                f"through one of them; use one device per rank, or the interpreter "
                f"(baton.jit(..., single_program=False))")
    platforms = {d.platform for d in devs}
    if step.num_ranks > 1 and platforms != {"cpu"}:
        return (f"rank {rank} runs on {', '.join(sorted(platforms))}: the compiled engine's "
                f"transfer handlers for several ranks in one step run on CPU transports "
                f"(the CUDA handlers in baton._core.ffi are built but not yet wired to "
                f"baton.jit); use the interpreter (baton.jit(..., single_program=False))")
    if transport_kind not in ("local", "gloo"):
        return (f"the compiled engine's transfers run on CPU transports (local, gloo), "
                f"not {transport_kind!r}; use the interpreter "
                f"(baton.jit(..., single_program=False))")
    return None


def check(step, rank: int, transport_kind: str = "local") -> None:
    why = refusal(step, rank, transport_kind)
    if why is not None:
        raise ConfigError(f"baton.jit: {why}")


class ProgramEngine:
    """The compiled programs of one ``CompiledStep`` (built on first use, kept)."""

    def __init__(self, step):
        self.step = step
        self.single = None  # SingleProgram (one rank)
        self.local_progs = None  # one process, several ranks: RankProgram per rank
        self._local_hub = None  # their in-process transports
        self.rank_prog = None  # one process per rank: this rank's RankProgram

    # -- one rank -----------------------------------------------------------------------
    def run_single(self, flat_args) -> list[Any]:
        from .program import SingleProgram

        if self.single is None:
            self.single = SingleProgram(self.step)
        outs = self.single(flat_args)
        # no interpreter ran: no measured live-buffer peaks (traced steps have them)
        self.step.last_stats = {"single_program": self.single.describe()}
        return outs

    # -- one process, several ranks -------------------------------------------------------
    def _local_programs(self, vals, timeout):
        """This step's rank programs over an in-process hub (built on the first call, and
        again after a failed step: a failed hub stays failed)."""
        from .program import RankProgram

        step = self.step
        R = step.num_ranks
        if self.local_progs is None:
            for r in range(R):
                check(step, r)
            comms = [_core.runtime.RankComm(r, float(timeout)) for r in range(R)]
            progs = [RankProgram(step, r, comms[r], timeout) for r in range(R)]
            for p in progs:  # all compiled before any runs (a rank never waits on a compile)
                p.compile(vals)
            self.local_progs = progs
            self._local_hub = None
        progs = self.local_progs
        if self._local_hub is None:
            hub = _core.runtime.LocalHub(R)
            self._local_hub = [hub.transport(r) for r in range(R)]
            for p, t in zip(progs, self._local_hub):
                p.comm.attach(t)
        for p in progs:
            p.set_timeout(timeout)
        return progs

    def run_local(self, vals, timeout) -> dict[int, Any]:
        """Every rank's loop as its own program, launched from one thread per rank; returns
        every loop output part."""
        step = self.step
        progs = self._local_programs(vals, timeout)
        R = step.num_ranks
        finals: list[dict | None] = [None] * R
        for p in progs:
            p.comm.record(step.record)

        def go(r):
            finals[r] = progs[r](vals)

        errors = on_rank_threads(R, go)
        if any(e is not None for e in errors):
            for p in progs:
                p.comm.detach()
            for t in self._local_hub or ():
                t.close()
            self._local_hub = None
            origins = [getattr(e, "failed_rank", r) for r, e in enumerate(errors) if e]
            first = next((e for r, e in enumerate(errors) if e is not None and r in origins),
                         next(e for e in errors if e is not None))
            raise first
        if step.record:
            step.last_events = [p.events() for p in progs]
            step.last_offsets = [0] * R
        step.last_stats = {"rank_program": [p.describe() for p in progs]}
        final: dict[int, Any] = {}
        for f in finals:
            final.update(f)
        return final

    # -- one process per rank -------------------------------------------------------------
    def run_rank(self, group, router, vals, timeout) -> dict[int, Any]:
        """This rank's loop as its program over the group's transport; returns its loop
        output parts. A program that cannot be built or compiled raises ``ConfigError``; the
        ranks first exchange whether they could, so every rank raises instead of waiting on
        the others."""
        step = self.step
        rp = self.rank_prog
        if rp is None or rp.transport is not group.transport:
            rp = self._build_rank(group, router, vals, timeout)
        rp.set_timeout(timeout)
        rp.comm.record(step.record)
        final = rp(vals)
        step.last_stats = {"rank_program": rp.describe()}
        if step.record:
            from .tracing import gather_events

            step.last_events, step.last_offsets = gather_events(group, rp.events(), timeout)
        return final

    def _build_rank(self, group, router, vals, timeout):
        from .program import RankProgram

        me = group.rank
        why = refusal(self.step, me, group.transport.kind) or ""
        rp = None
        if not why:
            try:
                comm = _core.runtime.RankComm(me, float(timeout))
                comm.attach(group.transport)
                rp = RankProgram(self.step, me, comm, timeout)
                rp.transport = group.transport
                rp.compile(vals)
            except Exception as e:  # noqa: BLE001  (raised below, on every rank)
                why = f"building its program failed: {type(e).__name__}: {e}"
        whys = router.allgather(why.replace("\n", " "))
        bad = [(q, w) for q, w in enumerate(whys) if w]
        if bad:
            self.rank_prog = None
            raise ConfigError("baton.jit: the compiled engine cannot run this step: "
                              + "; ".join(f"rank {q}: {w}" for q, w in bad))
        self.rank_prog = rp
        return rp
