"""Schedule specifications.

A spec names a pipeline schedule without fixing its sizes, the way users pass it
to ``baton.jit``::

    baton.ZBH1()                           # sizes come later
    baton.Interleaved1F1B(virtual_stages=2)
    baton.ScheduleFile("my_schedule.txt")  # the documented text format

``spec.stages(ranks)`` says how many pipeline stages the model must be cut into
and ``spec.build(ranks, microbatches)`` returns the C++ ``baton.Schedule``.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from typing import ClassVar

from . import _core
from .errors import ConfigError, ScheduleError

__all__ = [
    "ScheduleSpec",
    "GPipe",
    "OneFOneB",
    "Eager1F1B",
    "Interleaved1F1B",
    "ZBH1",
    "ZBH2",
    "ZBV",
    "VMin",
    "VHalf",
    "DualPipeV",
    "ScheduleFile",
    "schedule_from_name",
    "schedule_names",
    "schedule_aliases",
    "load_schedule",
    "save_schedule",
]


def _positive_int(value, what: str) -> int:
    """``value`` as an int >= 1, or a ConfigError naming ``what``."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a positive integer (got {value!r})")
    try:
        n = operator.index(value)
    except TypeError:
        raise ConfigError(f"{what} must be a positive integer (got {value!r})") from None
    if n < 1:
        raise ConfigError(f"{what} must be a positive integer (got {n})")
    return n


class ScheduleSpec:
    """Base class of schedule specs: a generator name plus its options."""

    #: the C++ generator's name (see ``baton.schedule_names()``)
    generator: ClassVar[str] = ""

    def stages(self, ranks: int) -> int:
        """Number of pipeline stages this schedule runs on ``ranks`` ranks."""
        return _positive_int(ranks, "ranks")

    def build(self, ranks: int, microbatches: int) -> _core.Schedule:
        """The C++ schedule for ``ranks`` ranks and ``microbatches`` microbatches."""
        p = _positive_int(ranks, "ranks")
        m = _positive_int(microbatches, "microbatches")
        return _core.make_schedule(self.generator, p, m, 1)


@dataclasses.dataclass(frozen=True)
class GPipe(ScheduleSpec):
    """All forwards, then all backwards (one stage per rank)."""

    generator: ClassVar[str] = "gpipe"


@dataclasses.dataclass(frozen=True)
class OneFOneB(ScheduleSpec):
    """1F1B (PipeDream-Flush): warm-up forwards, then alternate F and B."""

    generator: ClassVar[str] = "1f1b"


@dataclasses.dataclass(frozen=True)
class Eager1F1B(ScheduleSpec):
    """1F1B with a longer warm-up so that sends go out earlier."""

    generator: ClassVar[str] = "eager1f1b"


@dataclasses.dataclass(frozen=True)
class Interleaved1F1B(ScheduleSpec):
    """Interleaved 1F1B: ``virtual_stages`` stages per rank, stage s on rank s mod p."""

    generator: ClassVar[str] = "interleaved"
    virtual_stages: int = 2

    def __post_init__(self):
        _positive_int(self.virtual_stages, "virtual_stages")

    def stages(self, ranks: int) -> int:
        return _positive_int(ranks, "ranks") * self.virtual_stages

    def build(self, ranks: int, microbatches: int) -> _core.Schedule:
        p = _positive_int(ranks, "ranks")
        m = _positive_int(microbatches, "microbatches")
        return _core.make_schedule(self.generator, p, m, operator.index(self.virtual_stages))


@dataclasses.dataclass(frozen=True)
class ZBH1(ScheduleSpec):
    """Zero Bubble H1: backward split into I and W; W fills the bubbles."""

    generator: ClassVar[str] = "zbh1"


@dataclasses.dataclass(frozen=True)
class ZBH2(ScheduleSpec):
    """Zero Bubble H2: more warm-up forwards, W deferred (about 2x 1F1B's memory)."""

    generator: ClassVar[str] = "zbh2"


class _VShape(ScheduleSpec):
    def stages(self, ranks: int) -> int:
        return 2 * _positive_int(ranks, "ranks")


@dataclasses.dataclass(frozen=True)
class ZBV(_VShape):
    """Zero Bubble V: two stages per rank in a V (rank r holds r and 2p-1-r)."""

    generator: ClassVar[str] = "zbv"


@dataclasses.dataclass(frozen=True)
class VMin(_VShape):
    """V-Min (controllable-memory V schedule): about a third of 1F1B's activation memory.

    Same V placement and I/W split as ZB-V; a microbatch enters every six chunk
    tasks, so stashes live only along their own chain (docs/SCHEDULES.md).
    """

    generator: ClassVar[str] = "vmin"


@dataclasses.dataclass(frozen=True)
class VHalf(_VShape):
    """V-Half: V-Min after a burst of ceil(ranks/3) forwards; about half of 1F1B's memory."""

    generator: ClassVar[str] = "vhalf"


@dataclasses.dataclass(frozen=True)
class DualPipeV(_VShape):
    """DualPipeV: V placement with F of one microbatch fused with B of another."""

    generator: ClassVar[str] = "dualpipev"


def _read_schedule_source(source: str | os.PathLike) -> str:
    """The schedule text of ``source``: a path, or the text itself."""
    if isinstance(source, os.PathLike):
        path = os.fspath(source)
    elif isinstance(source, str):
        if "\n" in source or source.lstrip().startswith(("baton-schedule", "#")):
            return source
        path = source
    else:
        raise ConfigError(
            f"a schedule file must be a path or schedule text (got {type(source).__name__})"
        )
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read schedule file {path!r}: {e.strerror or e}") from None


def load_schedule(path_or_text: str | os.PathLike) -> _core.Schedule:
    """Parses and validates a schedule in the text format, from a path or a string.

    Raises ``FormatError`` (with ``line`` and ``column``) on syntax errors and
    ``ScheduleError`` on an invalid schedule.
    """
    return _core.load_schedule(_read_schedule_source(path_or_text))


def save_schedule(schedule: _core.Schedule, path: str | os.PathLike | None = None) -> str:
    """The text form of ``schedule``; also written to ``path`` when given."""
    text = _core.save_schedule(schedule)
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text


@dataclasses.dataclass(frozen=True)
class ScheduleFile(ScheduleSpec):
    """A user schedule in the documented text format (a path or the text itself).

    Its sizes are fixed by the file: ``build`` checks that the requested ranks
    and microbatches match (``None`` takes the file's).
    """

    generator: ClassVar[str] = "custom"
    source: str

    def __post_init__(self):
        if isinstance(self.source, os.PathLike):
            object.__setattr__(self, "source", os.fspath(self.source))

    def load(self) -> _core.Schedule:
        """The parsed schedule (re-read on every call, so file edits are seen)."""
        return load_schedule(self.source)

    def stages(self, ranks: int | None = None) -> int:
        s = self.load()
        if ranks is not None:
            self._check("ranks", ranks, s.num_ranks)
        return s.num_stages

    def build(self, ranks: int | None = None, microbatches: int | None = None) -> _core.Schedule:
        s = self.load()
        if ranks is not None:
            self._check("ranks", ranks, s.num_ranks)
        if microbatches is not None:
            self._check("microbatches", microbatches, s.num_microbatches)
        return s

    def _check(self, what: str, asked, have: int) -> None:
        n = _positive_int(asked, what)
        if n != have:
            raise ScheduleError(
                f"schedule file {self._label()} is for {what}={have}, but {what}={n} was requested"
            )

    def _label(self) -> str:
        return "<text>" if "\n" in self.source else repr(self.source)

    def __repr__(self) -> str:
        if "\n" in self.source:
            return f"ScheduleFile(<text, {self.source.count(chr(10)) + 1} lines>)"
        return f"ScheduleFile({self.source!r})"


_SPECS: dict[str, type[ScheduleSpec]] = {
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "onefoneb": OneFOneB,
    "eager1f1b": Eager1F1B,
    "interleaved": Interleaved1F1B,
    "interleaved1f1b": Interleaved1F1B,
    "zbh1": ZBH1,
    "zbh2": ZBH2,
    "zbv": ZBV,
    "vmin": VMin,
    "vhalf": VHalf,
    "dualpipev": DualPipeV,
}


# Other systems' spellings of the same schedules. torchtitan passes its
# ``pipeline_parallel_schedule`` to ``torch.distributed.pipelining``'s
# ``get_schedule_class`` (class names without the "Schedule" prefix); Megatron-LM picks
# ``forward_backward_pipelining_without_interleaving`` (1F1B) or ``..._with_interleaving``
# (interleaved 1F1B, when ``virtual_pipeline_model_parallel_size`` is set) in
# ``megatron.core.pipeline_parallel.schedules``; its zero-bubble variants are named after
# the paper's ZB-H1 / ZB-H2 / ZB-V.
_ALIASES: dict[str, str] = {
    # torchtitan / torch.distributed.pipelining
    "schedulegpipe": "gpipe",
    "schedule1f1b": "1f1b",
    "scheduleinterleaved1f1b": "interleaved",
    "zbvzerobubble": "zbv",
    "schedulezbvzerobubble": "zbv",
    "scheduledualpipev": "dualpipev",
    # Megatron-LM
    "forwardbackwardpipeliningwithoutinterleaving": "1f1b",
    "forwardbackwardpipeliningwithinterleaving": "interleaved",
    "pipedreamflush": "1f1b",
    "zerobubbleh1": "zbh1",
    "zerobubbleh2": "zbh2",
    "zerobubblev": "zbv",
}

# Names other systems use for schedules Baton has no generator for: recognised, refused
# with the nearest Baton schedule.
_UNSUPPORTED: dict[str, str] = {
    "loopedbfs": "torchtitan's LoopedBFS (several stages per rank, all forwards of a stage "
                 "before the next) has no Baton generator; the nearest is 'Interleaved1F1B'",
    "scheduleloopedbfs": "torchtitan's LoopedBFS has no Baton generator; the nearest is "
                         "'Interleaved1F1B'",
    "interleavedzerobubble": "torchtitan's InterleavedZeroBubble (ZB-H1 over stages placed "
                             "round-robin, several per rank) has no Baton generator; the "
                             "nearest are 'ZBVZeroBubble' (zbv: two stages per rank in a V) "
                             "and 'ZBH1' (one stage per rank)",
    "scheduleinterleavedzerobubble": "torchtitan's InterleavedZeroBubble has no Baton "
                                     "generator; the nearest are 'ZBVZeroBubble' (zbv) and "
                                     "'ZBH1'",
    "pipelineschedulesingle": "PipelineScheduleSingle is torch's base class; a schedule as "
                              "data is baton.ScheduleFile(path) (the text format)",
    "pipelineschedulemulti": "PipelineScheduleMulti is torch's base class; a schedule as "
                             "data is baton.ScheduleFile(path) (the text format)",
}


def schedule_names() -> list[str]:
    """Names accepted by ``schedule_from_name`` (canonical generator names)."""
    return ["gpipe", "1f1b", "eager1f1b", "interleaved", "zbh1", "zbh2", "zbv", "vmin", "vhalf",
            "dualpipev"]


def schedule_aliases() -> dict[str, str]:
    """Other systems' spellings accepted by ``schedule_from_name``, with the Baton name each
    stands for (torchtitan's ``Interleaved1F1B``, ``ZBVZeroBubble``, ``DualPipeV``;
    Megatron-LM's ``forward_backward_pipelining_with_interleaving`` ...)."""
    shown = {"GPipe": "gpipe", "1F1B": "1f1b", "Interleaved1F1B": "interleaved",
             "ZBVZeroBubble": "zbv", "DualPipeV": "dualpipev", "OneFOneB": "1f1b",
             "ZBH1": "zbh1", "ZBH2": "zbh2", "ZBV": "zbv", "Eager1F1B": "eager1f1b",
             "forward_backward_pipelining_without_interleaving": "1f1b",
             "forward_backward_pipelining_with_interleaving": "interleaved",
             "PipeDreamFlush": "1f1b", "ZeroBubbleH1": "zbh1", "ZeroBubbleH2": "zbh2",
             "ZeroBubbleV": "zbv"}
    return shown


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "").replace(" ", "")


def schedule_from_name(name: str, virtual_stages: int | None = None) -> ScheduleSpec:
    """The spec for a schedule name in Baton's, torchtitan's or Megatron-LM's spelling
    ("zbv", "1F1B", "dual-pipe-v", "ZBVZeroBubble", "Interleaved1F1B",
    "forward_backward_pipelining_with_interleaving", ...; ``schedule_aliases()``).

    Case, spaces, '-' and '_' are ignored. ``virtual_stages`` applies to "interleaved"
    only (``None`` takes its default, 2); other schedules accept only ``None`` or 1.
    A name no system uses raises ``ScheduleError`` listing the accepted names.
    """
    if not isinstance(name, str):
        raise ScheduleError(f"schedule name must be a string (got {type(name).__name__})")
    key = _key(name)
    if key in _UNSUPPORTED:
        raise ScheduleError(f"schedule {name!r}: {_UNSUPPORTED[key]}")
    cls = _SPECS.get(key) or _SPECS.get(_ALIASES.get(key, ""))
    if cls is None:
        raise ScheduleError(
            f"unknown schedule {name!r}; Baton's names: {', '.join(schedule_names())}; also "
            f"accepted (torchtitan, Megatron-LM): {', '.join(schedule_aliases())}")
    v = None if virtual_stages is None else _positive_int(virtual_stages, "virtual_stages")
    if cls is Interleaved1F1B:
        return Interleaved1F1B() if v is None else Interleaved1F1B(virtual_stages=v)
    if v not in (None, 1):
        raise ScheduleError(
            f"schedule {name!r} has no virtual stages (got virtual_stages={v}); "
            "only 'interleaved' takes virtual_stages"
        )
    return cls()
