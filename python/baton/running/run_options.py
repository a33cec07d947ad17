"""What one step run is asked to do besides computing (``RunOptions``), passed explicitly to
``CompiledStep.run``. Options never choose the engine: the step's engine (the compiled
programs, or the interpreter with ``baton.jit(..., engine="interpreter")``) runs every call,
traced, profiled and measured ones included."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """``record``: the engine records per-instruction events (the run's ``StepRun.events``:
    per rank; ``offsets``: clock offsets to rank 0 in ns). ``block``: the interpreter
    waits for every task's outputs, so a RUN spans its compute. ``live``
    (``memory.LivePeak``): the live arrays per device are sampled while the step runs
    (``PipelinedFunction.memory(measure=True)``)."""

    record: bool = False
    block: bool = False
    live: Any = None


class PostSegment(NamedTuple):
    """What a live sample taken after segment ``index`` of the code after the loop is keyed
    by (a sample inside a task is keyed by the task's ``(TaskKind, stage)``)."""

    index: int


PLAIN = RunOptions()

__all__ = ["RunOptions", "PLAIN", "PostSegment"]
