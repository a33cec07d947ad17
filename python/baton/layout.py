"""The pipeline layout as configuration: which layer marks end stages, which schedule, how
many microbatches.

The model marks every layer end once with ``baton.stage_boundary`` (K marks split it into
K + 1 *layers*: what comes before the first mark, between two marks, after the last mark).
A ``Layout`` chooses which marks end stages for the stage count the schedule needs, so the
same model runs under 1F1B (p stages on p ranks), ZB-V or DualPipeV (2p stages) by
configuration alone::

    baton.jit(step, mesh=mesh, schedule="ZBVZeroBubble", microbatch_size=2,
              layout=baton.Layout())                        # layers split evenly
    baton.Layout(layers_per_stage=2)                        # 2 per stage (checked)
    baton.Layout(layers_per_stage=[1, 3, 3, 1])             # one count per stage
    baton.Layout(first_stage_layers=1, last_stage_layers=1) # the rest split evenly
    baton.Layout(split_points=[2, 5, 8])                    # layers that start stages 1, 2, 3

These follow Megatron-LM's ``num_layers_in_first_pipeline_stage`` /
``num_layers_in_last_pipeline_stage``, torchtitan's ``pipeline_parallel_layers_per_stage``
and ``pipeline_parallel_split_points`` and MaxText's ``num_layers_per_pipeline_stage``.
``PipelineConfig`` holds the schedule, the microbatch count or size and the layout in one
record, read from a dict with Baton's or torchtitan's key names (``PipelineConfig.from_dict``),
and gives ``baton.jit``'s keyword arguments (``jit_kwargs``).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping, Sequence

from .errors import ConfigError

__all__ = ["Layout", "PipelineConfig"]


def _count(value, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"layout: {what} must be an integer (got {value!r})")
    try:
        n = operator.index(value)
    except TypeError:
        raise ConfigError(f"layout: {what} must be an integer (got {value!r})") from None
    if n < minimum:
        raise ConfigError(f"layout: {what} must be >= {minimum} (got {n})")
    return n


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which of the model's layer marks end pipeline stages (module docstring).

    At most one of ``layers_per_stage`` (an int: every stage; a sequence: one count per
    stage), ``split_points`` (the indices of the layers that start stages 1, 2, ...) and the
    pair ``first_stage_layers`` / ``last_stage_layers`` (either or both; the other stages
    split the rest evenly). Nothing given: the layers split as evenly as possible, the
    extra layers going to the middle stages (the first stage also holds the embedding and
    the last the head and loss).
    """

    layers_per_stage: int | Sequence[int] | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    split_points: Sequence[int] | None = None

    def __post_init__(self):
        lps = self.layers_per_stage
        if lps is not None and not isinstance(lps, int):
            object.__setattr__(self, "layers_per_stage",
                               tuple(_count(n, "layers_per_stage entries") for n in lps))
        elif lps is not None:
            _count(lps, "layers_per_stage")
        if self.split_points is not None:
            object.__setattr__(self, "split_points",
                               tuple(_count(i, "split_points entries") for i in self.split_points))
        for name in ("first_stage_layers", "last_stage_layers"):
            v = getattr(self, name)
            if v is not None:
                _count(v, name)
        given = [n for n, on in (("layers_per_stage", lps is not None),
                                 ("split_points", self.split_points is not None),
                                 ("first_stage_layers/last_stage_layers",
                                  self.first_stage_layers is not None
                                  or self.last_stage_layers is not None)) if on]
        if len(given) > 1:
            raise ConfigError(f"layout: give one of layers_per_stage, split_points, "
                              f"first_stage_layers/last_stage_layers (got {', '.join(given)})")

    def stage_layers(self, layers: int, stages: int) -> list[int]:
        """The number of layers of each of ``stages`` stages of a model of ``layers`` layers;
        a ``ConfigError`` naming the mismatch when they do not add up."""
        layers = _count(layers, "the model's layer count")
        stages = _count(stages, "the stage count")
        if stages > layers:
            raise ConfigError(
                f"layout: the schedule needs {stages} stages but the model has {layers} layers "
                f"({layers - 1} stage_boundary marks); mark more layer ends or pick a schedule "
                f"with fewer stages")
        lps = self.layers_per_stage
        if isinstance(lps, int):
            counts = [lps] * stages
            if lps * stages != layers:
                raise ConfigError(
                    f"layout: layers_per_stage={lps} x {stages} stages = {lps * stages} layers, "
                    f"but the model has {layers} layers ({layers - 1} stage_boundary marks)")
            return counts
        if lps is not None:
            counts = list(lps)
            if len(counts) != stages:
                raise ConfigError(
                    f"layout: layers_per_stage has {len(counts)} entries but the schedule needs "
                    f"{stages} stages")
            if sum(counts) != layers:
                raise ConfigError(
                    f"layout: layers_per_stage={counts} adds up to {sum(counts)} layers, but "
                    f"the model has {layers} layers ({layers - 1} stage_boundary marks)")
            return counts
        if self.split_points is not None:
            pts = list(self.split_points)
            if len(pts) != stages - 1:
                raise ConfigError(
                    f"layout: split_points={pts} makes {len(pts) + 1} stages but the schedule "
                    f"needs {stages}")
            if pts != sorted(set(pts)) or pts[-1] >= layers:
                raise ConfigError(
                    f"layout: split_points={pts} must increase strictly and lie in 1.."
                    f"{layers - 1} (the model has {layers} layers)")
            edges = [0, *pts, layers]
            return [b - a for a, b in zip(edges, edges[1:])]
        first, last = self.first_stage_layers, self.last_stage_layers
        fixed = [s for s, v in ((0, first), (stages - 1, last)) if v is not None]
        if fixed and stages == 1:
            raise ConfigError("layout: first_stage_layers/last_stage_layers need at least "
                              "two stages")
        rest = layers - (first or 0) - (last or 0)
        n_rest = stages - len(fixed)
        if fixed and (rest < n_rest or (n_rest == 0 and rest != 0)):
            raise ConfigError(
                f"layout: first_stage_layers={first}, last_stage_layers={last} leave {rest} of "
                f"the model's {layers} layers for {n_rest} other stages")
        if fixed and n_rest and rest % n_rest:
            raise ConfigError(
                f"layout: first_stage_layers={first}, last_stage_layers={last} leave {rest} "
                f"layers, which do not split evenly over the other {n_rest} stages; give "
                f"layers_per_stage=[...] to place them")
        if fixed:
            counts = [rest // n_rest if n_rest else 0] * stages
            if first is not None:
                counts[0] = first
            if last is not None:
                counts[-1] = last
            return counts
        base, extra = divmod(layers, stages)
        counts = [base] * stages
        # extra layers to the middle stages first (the ends hold embedding and head)
        order = list(range(1, stages - 1)) + [0, stages - 1] if stages > 2 else list(range(stages))
        for s in order[:extra]:
            counts[s] += 1
        return counts

    def boundaries(self, marks: int, stages: int) -> list[int]:
        """The indices (forward order) of the ``stage_boundary`` marks that end stages, for a
        model with ``marks`` marks (``marks + 1`` layers) cut into ``stages`` stages."""
        counts = self.stage_layers(_count(marks, "stage_boundary marks", 0) + 1, stages)
        out, end = [], -1
        for n in counts[:-1]:
            end += n
            out.append(end)
        return out


# torchtitan's [parallelism] keys, and Baton's own, for PipelineConfig.from_dict
_KEYS = {
    "schedule": "schedule",
    "pipeline_parallel_schedule": "schedule",
    "microbatches": "microbatches",
    "num_microbatches": "microbatches",
    "microbatch_size": "microbatch_size",
    "pipeline_parallel_microbatch_size": "microbatch_size",
    "micro_batch_size": "microbatch_size",
    "virtual_stages": "virtual_stages",
    "virtual_pipeline_model_parallel_size": "virtual_stages",
    "layers_per_stage": "layers_per_stage",
    "pipeline_parallel_layers_per_stage": "layers_per_stage",
    "num_layers_per_pipeline_stage": "layers_per_stage",
    "first_stage_layers": "first_stage_layers",
    "num_layers_in_first_pipeline_stage": "first_stage_layers",
    "last_stage_layers": "last_stage_layers",
    "num_layers_in_last_pipeline_stage": "last_stage_layers",
    "split_points": "split_points",
    "pipeline_parallel_split_points": "split_points",
}


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Schedule, microbatches (a count or a size) and layout: ``baton.jit``'s pipeline
    settings as one record (``jit_kwargs()``), e.g. from a run's config file."""

    schedule: Any = "1f1b"
    microbatches: int | None = None
    microbatch_size: int | None = None
    virtual_stages: int | None = None
    layout: Layout = dataclasses.field(default_factory=Layout)

    def __post_init__(self):
        if self.microbatches is not None and self.microbatch_size is not None:
            raise ConfigError("pipeline config: give microbatches or microbatch_size, not both")
        for name in ("microbatches", "microbatch_size", "virtual_stages"):
            v = getattr(self, name)
            if v is not None:
                _count(v, name)
        if not isinstance(self.layout, Layout):
            raise ConfigError(f"pipeline config: layout must be a baton.Layout "
                              f"(got {type(self.layout).__name__})")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PipelineConfig":
        """From a mapping with Baton's keys (``schedule``, ``microbatches``,
        ``microbatch_size``, ``virtual_stages``, ``layers_per_stage``,
        ``first_stage_layers``, ``last_stage_layers``, ``split_points``) or torchtitan's /
        Megatron-LM's / MaxText's (``pipeline_parallel_schedule``,
        ``pipeline_parallel_microbatch_size``, ``pipeline_parallel_layers_per_stage``,
        ``pipeline_parallel_split_points``, ``num_layers_in_first_pipeline_stage``,
        ``num_layers_per_pipeline_stage`` ...). Unknown keys are an error."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"pipeline config: expected a mapping (got {type(d).__name__})")
        got: dict[str, Any] = {}
        for k, v in d.items():
            name = _KEYS.get(k)
            if name is None:
                raise ConfigError(f"pipeline config: unknown key {k!r}; accepted: "
                                  f"{', '.join(sorted(_KEYS))}")
            if name in got:
                raise ConfigError(f"pipeline config: {name} given twice (key {k!r})")
            got[name] = v
        lay = {k: got.pop(k) for k in ("layers_per_stage", "first_stage_layers",
                                       "last_stage_layers", "split_points") if k in got}
        return cls(layout=Layout(**lay), **got)

    def spec(self):
        """The schedule spec (names in Baton's, torchtitan's or Megatron-LM's spelling)."""
        from .schedules import ScheduleSpec, schedule_from_name
        if isinstance(self.schedule, ScheduleSpec):
            if self.virtual_stages is not None:
                raise ConfigError("pipeline config: virtual_stages applies to a schedule "
                                  "given by name")
            return self.schedule
        return schedule_from_name(self.schedule, self.virtual_stages)

    def jit_kwargs(self) -> dict:
        """``schedule``, ``layout`` and ``microbatches`` or ``microbatch_size`` for
        ``baton.jit(step, mesh=..., **config.jit_kwargs())``."""
        kw: dict[str, Any] = {"schedule": self.spec(), "layout": self.layout}
        if self.microbatch_size is not None:
            kw["microbatch_size"] = self.microbatch_size
        else:
            kw["microbatches"] = self.microbatches or 1
        return kw
