"""``baton.Auto``: the schedule argument of ``baton.jit`` that plans on the first call.

This module depends on no other part of Baton, so ``frontend.api`` imports it at the top. The
planner it runs (``baton.autoplan.autoplan``, which measures pipelined probes and so depends on
``frontend.api``) registers itself here with :func:`set_planner` when ``baton.autoplan`` is
imported (``import baton`` does).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

_PLANNER: Callable[..., Any] | None = None


def set_planner(planner: Callable[..., Any]) -> None:
    """The function :meth:`Auto.plan` calls: ``planner(fn, *args, ranks=..., **options)``
    returning ranked candidates (best first, ``.best``)."""
    global _PLANNER
    _PLANNER = planner


@dataclasses.dataclass
class Auto:
    """``baton.jit(schedule=baton.Auto(...))``: plan on the first call (``autoplan`` with these
    arguments and the mesh's rank count) and run the best plan. ``.chosen`` holds it."""

    memory_per_device: Any = None
    microbatches: Any = None
    families: Any = None
    remat: tuple = ("keep", "min")
    runs: int = 3
    cache_dir: Any = None
    # run the k best predicted plans on the mesh (``runs`` timed steps each) and keep the
    # fastest measured (0: the best predicted)
    measure_top: int = 0
    # plans over the budget may offload stashes to host memory (``autoplan(offload=...)``),
    # within ``host_memory`` per rank (None: unlimited)
    offload: bool = False
    host_memory: Any = None
    chosen: Any = None
    candidates: Any = None

    def plan(self, fn, args, ranks: int, update_in_place: bool = False, mesh: Any = None):
        """Plans ``fn`` on ``args`` for ``ranks`` ranks; returns the chosen ``Candidate``."""
        if _PLANNER is None:  # pragma: no cover  (import baton registers it)
            raise RuntimeError("baton.Auto: no planner registered (import baton.autoplan)")
        self.candidates = _PLANNER(fn, *args, ranks=ranks,
                                   memory_per_device=self.memory_per_device,
                                   microbatches=self.microbatches, families=self.families,
                                   remat=self.remat, runs=self.runs, cache_dir=self.cache_dir,
                                   update_in_place=update_in_place,
                                   measure_top=self.measure_top, mesh=mesh,
                                   steps=max(self.runs, 1), offload=self.offload,
                                   host_memory=self.host_memory)
        self.chosen = self.candidates.best
        return self.chosen
