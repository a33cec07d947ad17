"""What one call of ``CompiledStep.run`` returns (``StepRun``), and what an engine's loop
hands back with its outputs (``LoopRecord``). The step keeps none of it: a call's results
are the caller's."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class LoopRecord:
    """What an engine reports about the loop it ran: ``events`` (per rank, the recorded
    instructions; None unless ``RunOptions.record``), ``offsets`` (per rank, its clock's
    offset to rank 0 in ns, with ``events``) and ``stats`` (the engine's own facts: the
    compiled engine's ``{"single_program": ...}`` or ``{"rank_program": ...}``
    descriptions, the interpreter's measured ``peak_bytes`` and ``peak_buffers`` per
    rank)."""

    events: list | None = None
    offsets: list | None = None
    stats: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepRun:
    """One step's results: ``outputs`` (the step's flat outputs) and its loop's
    ``LoopRecord`` fields ``events``, ``offsets`` and ``stats``."""

    outputs: list
    events: list | None = None
    offsets: list | None = None
    stats: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, outputs: list, record: LoopRecord) -> "StepRun":
        return cls(outputs, record.events, record.offsets, record.stats)

    def without_outputs(self) -> "StepRun":
        """This record with no outputs (kept after the call without holding its arrays)."""
        return dataclasses.replace(self, outputs=[])


__all__ = ["LoopRecord", "StepRun"]
