"""The rows :func:`baton.autoplan` ranks: a :class:`Candidate` plan (stage cuts, schedule,
microbatches, rematerialization, predicted time and memory) and the :class:`Candidates` table."""

from __future__ import annotations

import dataclasses

from .frontend.api import jit
from .schedules import schedule_from_name


@dataclasses.dataclass
class Candidate:
    """One ranked plan: the stage cuts (first segment of each stage), schedule, microbatches
    and rematerialization, with the simulator's step time, bubble and peak memory per rank."""

    schedule: str
    virtual_stages: int
    microbatches: int
    cuts: list
    remat: list
    step_time: float
    bubble: float
    peak_memory: list
    fits: bool
    # seconds per step measured on the mesh (``autoplan(measure_top=k)``), else None
    measured_step: float | None = None
    # per stage "none" or "stash" (what it offloads to host memory; empty: nothing), and per
    # rank the host bytes held at once
    offload: list = dataclasses.field(default_factory=list)
    peak_host: list = dataclasses.field(default_factory=list)

    @property
    def boundaries(self) -> list[int]:
        """The candidate ``stage_boundary`` calls (indices) that end stages."""
        return [c - 1 for c in self.cuts[1:]]

    def spec(self):
        v = self.virtual_stages if self.schedule == "interleaved" else None
        return schedule_from_name(self.schedule, v)

    def jit_kwargs(self) -> dict:
        """``baton.jit`` arguments that run this plan (pin them in a script)."""
        return {"schedule": self.spec(), "microbatches": self.microbatches,
                "remat": all(r == "min" for r in self.remat), "boundaries": self.boundaries,
                "offload": {s: "stash" for s, o in enumerate(self.offload) if o == "stash"}
                or None}

    def jit(self, fn, mesh, **kwargs):
        return jit(fn, mesh=mesh, **self.jit_kwargs(), **kwargs)


class Candidates(list):
    """Ranked :class:`Candidate` rows (best first), with ``segments`` (the measured costs)
    and ``stats`` (search statistics, planning seconds)."""

    segments: dict
    stats: dict

    @property
    def best(self) -> Candidate:
        return self[0]

    def __str__(self) -> str:
        head = ("| # | schedule | M | stage cuts (first segment) | remat | step (ms) | measured "
                "(ms) | bubble | peak per rank (MiB) | fits |\n"
                "|---|---|---|---|---|---|---|---|---|---|")
        rows = []
        for k, c in enumerate(self):
            name = c.schedule + (f" v{c.virtual_stages}" if c.schedule == "interleaved" else "")
            meas = "" if c.measured_step is None else f"{c.measured_step * 1e3:.2f}"
            rows.append(
                f"| {k} | {name} | {c.microbatches} | {c.cuts} | {c.remat[0]}"
                f"{_offloaded(c)} | "
                f"{c.step_time * 1e3:.2f} | {meas} | {c.bubble:.1%} | "
                f"{', '.join(f'{b / 2**20:.1f}' for b in c.peak_memory)} | "
                f"{'yes' if c.fits else 'no'} |")
        return "\n".join([head, *rows])


def _offloaded(c: Candidate) -> str:
    """", offload stages 0, 1 (host MiB per rank)" for a candidate that offloads, else ""."""
    stages = [s for s, o in enumerate(c.offload) if o == "stash"]
    if not stages:
        return ""
    return (f", offload stages {', '.join(map(str, stages))} (host "
            f"{', '.join(f'{b / 2**20:.1f}' for b in c.peak_host)} MiB)")
