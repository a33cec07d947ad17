"""Plans: a schedule lowered to per-rank instruction streams, verified and simulated.

    p = baton.plan(baton.ZBV(), ranks=4, microbatches=8)
    p.verify()                      # raises VerifyError on a bad plan
    print(p.summary())              # step time, bubble and peak memory per rank
    p.to_trace(path="trace.json")   # open in https://ui.perfetto.dev

The plan wraps the C++ ``Plan``, the single source of truth: what is verified
and simulated here is what the executor runs.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from .. import _core
from ..errors import ConfigError, VerifyError
from ..schedules import ScheduleFile, ScheduleSpec, _positive_int, save_schedule, schedule_from_name

__all__ = ["Plan", "plan", "as_cost_model", "autoplan_segments", "parse_memory", "AutoplanRows"]


def _json_text(costs: Any, dict_what: str, file_what: str) -> str | None:
    """The JSON text of ``costs`` given as a dict, JSON text or a path to a JSON file;
    ``None`` for any other type. ``dict_what`` and ``file_what`` name the input in
    the ``ConfigError`` raised for a dict that is not JSON-serialisable or a file
    that cannot be read."""
    if isinstance(costs, dict):
        try:
            return json.dumps(costs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{dict_what} is not JSON-serialisable: {e}") from None
    if isinstance(costs, (str, os.PathLike)):
        if isinstance(costs, str) and costs.lstrip().startswith("{"):
            return costs
        path = os.fspath(costs)
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise ConfigError(f"cannot read {file_what} {path!r}: {e.strerror or e}") from None
    return None


def as_cost_model(costs: Any = None) -> _core.CostModel:
    """A validated C++ ``CostModel`` from ``costs``.

    ``costs`` may be ``None`` (uniform default: F=1, B=2, I=W=1, unit bytes),
    a ``CostModel``, a dict in the cost JSON layout, a JSON string, or a path
    to a JSON file. Raises ``FormatError`` on bad JSON and ``ConfigError`` on
    bad values.
    """
    if costs is None:
        model = _core.CostModel()
    elif isinstance(costs, _core.CostModel):
        model = costs
    elif (text := _json_text(costs, "cost model dict", "cost file")) is not None:
        model = _core.CostModel.from_json(text)
    else:
        raise ConfigError(
            "costs must be None, a CostModel, a dict, JSON text or a path "
            f"(got {type(costs).__name__})"
        )
    model.validate()
    return model


def _build_schedule(schedule: Any, ranks: int | None, microbatches: int | None) -> _core.Schedule:
    if isinstance(schedule, _core.Schedule):
        for what, asked, have in (
            ("ranks", ranks, schedule.num_ranks),
            ("microbatches", microbatches, schedule.num_microbatches),
        ):
            if asked is not None and _positive_int(asked, what) != have:
                raise ConfigError(
                    f"schedule {schedule.name!r} has {what}={have}, but {what}={asked} was given"
                )
        return schedule
    if isinstance(schedule, str):
        schedule = schedule_from_name(schedule)
    if not isinstance(schedule, ScheduleSpec):
        raise ConfigError(
            "schedule must be a schedule spec (e.g. baton.ZBV()), a schedule name or a "
            f"baton.Schedule (got {type(schedule).__name__})"
        )
    if isinstance(schedule, ScheduleFile):  # sizes come from the file
        return schedule.build(ranks, microbatches)
    missing = [n for n, v in (("ranks", ranks), ("microbatches", microbatches)) if v is None]
    if missing:
        raise ConfigError(f"{schedule!r} needs {' and '.join(missing)} to build a plan")
    return schedule.build(ranks, microbatches)


class Plan:
    """A lowered schedule: per-rank programs, verification, simulation, pictures."""

    def __init__(self, core: _core.Plan, report: _core.VerifyReport | None = None,
                 rank_ir: _core.RankIR | None = None):
        """``report`` / ``rank_ir``: what a step build (``_core.build_step``) made of this plan
        already, its verifier's report and its rank programs without offloads; kept, so
        ``verify`` and ``rank_ir`` do not verify or build again."""
        if not isinstance(core, _core.Plan):
            raise ConfigError(f"Plan wraps a baton._core.Plan (got {type(core).__name__})")
        self._core = core
        self._report = report
        self._rank_ir = rank_ir

    @classmethod
    def from_schedule(cls, schedule: _core.Schedule) -> Plan:
        return cls(_core.lower(schedule))

    # -- the lowered program ---------------------------------------------------------
    @property
    def core(self) -> _core.Plan:
        """The C++ plan (what the executor runs)."""
        return self._core

    @property
    def schedule(self) -> _core.Schedule:
        return self._core.schedule

    @property
    def num_ranks(self) -> int:
        return self._core.schedule.num_ranks

    @property
    def num_stages(self) -> int:
        return self._core.schedule.num_stages

    @property
    def num_microbatches(self) -> int:
        return self._core.schedule.num_microbatches

    @property
    def programs(self) -> list[list[_core.Instr]]:
        return self._core.programs

    def program(self, rank: int) -> list[tuple[str, int, int, int]]:
        """Rank's program as (opcode, action, buffer, peer) tuples."""
        return self._core.program(rank)

    @property
    def fingerprint(self) -> str:
        """Deterministic digest of schedule and programs (equal plans, equal digests)."""
        return self._core.fingerprint()

    def to_text(self) -> str:
        return self._core.to_text()

    def describe(self, rank: int, index: int) -> str:
        return self._core.describe(rank, index)

    def describe_buffer(self, buffer: int) -> str:
        return self._core.describe_buffer(buffer)

    def task_inputs(self, task: _core.Task) -> list[int]:
        return self._core.task_inputs(task)

    def task_outputs(self, task: _core.Task) -> list[int]:
        return self._core.task_outputs(task)

    def buffer_id(self, kind, stage: int, microbatch: int) -> int:
        return self._core.buffer_id(kind, stage, microbatch)

    def buffer_key(self, buffer: int) -> _core.BufferKey:
        return self._core.buffer_key(buffer)

    def save(self, path: str | os.PathLike | None = None) -> str:
        """The schedule in the text format; written to ``path`` when given."""
        return save_schedule(self._core.schedule, path)

    # -- checks ------------------------------------------------------------------------
    def verify(self, raise_on_error: bool = True) -> _core.VerifyReport:
        """Runs every verifier check; raises ``VerifyError`` on a violation unless told not to."""
        if self._report is None:
            self._report = _core.verify(self._core)
        report = self._report
        if raise_on_error and not report.ok:
            raise VerifyError(report.to_string())
        return report

    def check_deadlock(self, fifo: bool = False) -> _core.VerifyReport:
        model = _core.CommModel.Fifo if fifo else _core.CommModel.Blocking
        return _core.check_deadlock(self._core, model)

    # -- what runs ---------------------------------------------------------------------------
    def rank_ir(self) -> _core.RankIR:
        """Every rank's program (``_core.RankIR``: units, transfer groups with their post and
        wait points and channels, buffer slots, share classes), built from this plan and
        verified in C++; ``.to_text()`` prints it (docs/RANK_IR.md)."""
        if self._rank_ir is None:
            self._rank_ir = _core.build_rank_ir(self._core)
        return self._rank_ir

    def simulate_rank_ir(self, costs: Any = None) -> _core.SimResult:
        """The simulated step over the rank programs (what runs); equal to ``simulate`` in
        step time, runs, transfers and memory. Its instruction indices are the rank
        programs'. The pictures and ``summary`` are drawn from it."""
        return _core.simulate_rank_ir(self.rank_ir(), as_cost_model(costs))

    def _drawn(self, costs: Any) -> _core.SimResult:
        """What the pictures show: the rank programs simulated, or, for a plan that fails
        verification (it has none), the plan simulated."""
        if self.verify(raise_on_error=False).ok:
            return self.simulate_rank_ir(costs)
        return self.simulate(costs)

    # -- simulation and pictures ---------------------------------------------------------
    def simulate(self, costs: Any = None, early_receives: bool = True) -> _core.SimResult:
        """Simulated step: time, bubbles, memory (``costs``: see ``as_cost_model``).
        ``early_receives``: each RECV is posted when its rank reaches the RUN before it, as
        Baton's executor does over Gloo and in one process; ``False``: at the RECV (NCCL)."""
        return _core.simulate(self._core, as_cost_model(costs), early_receives)

    def to_svg(self, costs: Any = None, path: str | os.PathLike | None = None) -> str:
        """SVG timeline of the simulated step; written to ``path`` when given."""
        return _write(path, _core.to_svg(self._core, self._drawn(costs)))

    def to_trace(
        self,
        costs: Any = None,
        path: str | os.PathLike | None = None,
        time_unit_us: float = 1000.0,
    ) -> str:
        """Chrome/Perfetto trace JSON of the simulated step; written to ``path`` when given."""
        return _write(path, _core.to_chrome_trace(self._core, self._drawn(costs), time_unit_us))

    def to_grid(self, costs: Any = None, width: int = 0) -> str:
        """Text picture of the simulated step: one row per rank."""
        return _core.to_text_grid(self._core, self._drawn(costs), width)

    def summary(self, costs: Any = None, rank_ir: Any = None) -> str:
        """Table of step time, per-rank bubble and peak memory (device, and host when the
        rank programs offload), and the verification result. ``rank_ir``: the rank programs
        to simulate (a step's own, with its offloads; default: this plan's). A plan that
        fails verification has no rank programs (nothing runs it): its table comes from the
        plan simulator, when that completes."""
        report = self.verify(raise_on_error=False)
        try:
            if rank_ir is not None and report.ok:
                result = _core.simulate_rank_ir(rank_ir, as_cost_model(costs))
            else:
                result = self.simulate_rank_ir(costs) if report.ok else self.simulate(costs)
        except VerifyError:
            if report.ok:
                raise
            raise VerifyError(report.to_string()) from None
        return _core.summary_table(self._core, result, report)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        s = self._core.schedule
        return (
            f"Plan(schedule={s.name!r}, ranks={s.num_ranks}, stages={s.num_stages}, "
            f"microbatches={s.num_microbatches}, fingerprint={self.fingerprint})"
        )


def _write(path: str | os.PathLike | None, text: str) -> str:
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text


def plan(schedule: Any, ranks: int | None = None, microbatches: int | None = None) -> Plan:
    """Builds and lowers a schedule.

    ``schedule`` is a spec (``baton.ZBV()``; needs ``ranks`` and
    ``microbatches`` unless it is a ``ScheduleFile``), a generator name
    ("zbv"), or a built ``baton.Schedule``. The plan is not verified here:
    call ``.verify()``.
    """
    return Plan(_core.lower(_build_schedule(schedule, ranks, microbatches)))


# --- automatic planning over measured segment costs ---------------------------

_MEMORY_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_MEMORY_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_memory(memory: Any) -> int:
    """Bytes from ``memory``: ``None`` or 0 (unlimited: 0), an int, or a string
    like ``"20GiB"``, ``"1.5GB"``, ``"512MiB"``, ``"1e9"`` (KB/MB/GB/TB are
    powers of 1000, KiB/MiB/GiB/TiB of 1024). Raises ``ConfigError``."""
    if memory is None:
        return 0
    if isinstance(memory, bool):
        raise ConfigError(f"memory must be bytes or a string like '20GiB' (got {memory!r})")
    if isinstance(memory, int):
        if memory < 0:
            raise ConfigError(f"memory must be >= 0 (got {memory})")
        return memory
    if isinstance(memory, float):
        if not memory >= 0 or memory != memory or memory == float("inf"):
            raise ConfigError(f"memory must be finite and >= 0 (got {memory})")
        return int(round(memory))
    if isinstance(memory, str):
        m = _MEMORY_RE.match(memory)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _MEMORY_UNITS:
            raise ConfigError(
                f"cannot parse memory {memory!r} (e.g. '20GiB', '512MB', '1e9'; units "
                "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            )
        return int(round(float(m.group(1)) * _MEMORY_UNITS[unit]))
    raise ConfigError(f"memory must be bytes or a string like '20GiB' (got {type(memory).__name__})")


class AutoplanRows(list):
    """The ranked plans (dicts, best first) of :func:`autoplan_segments`; the
    search statistics are in ``.stats`` (configurations, refused, partitions,
    candidates, simulated, pruned, seconds, exact, gap)."""

    stats: dict

    def table(self) -> str:
        """A plain-text table of the rows."""
        head = f"{'#':>3}  {'schedule':<11} {'v':>2} {'M':>4} {'step_time':>12} {'bubble':>7}  cuts / remat / peak per rank"
        lines = [head]
        for k, r in enumerate(self, 1):
            lines.append(
                f"{k:>3}  {r['schedule']:<11} {r['virtual_stages']:>2} {r['microbatches']:>4} "
                f"{r['step_time']:>12.6g} {100 * r['bubble_fraction']:>6.1f}%  "
                f"{','.join(map(str, r['cuts']))} / {','.join(r['remat'])} / "
                f"{','.join(str(b) for b in r['peak_memory'])}"
            )
        return "\n".join(lines)


def autoplan_segments(
    costs: Any,
    ranks: int,
    memory_per_device: Any = None,
    *,
    top: int = 10,
    families: list[str] | None = None,
    microbatches: list[int] | None = None,
    remat: list[str] | None = None,
    interleaved_v: list[int] | None = None,
    max_microbatches: int = 0,
    gap: float = 0.0,
    node_budget: int = 20000,
    update_in_place: bool = False,
    offload: bool = False,
    host_memory: Any = None,
    fetch_lookahead: int = 1,
) -> AutoplanRows:
    """Chooses stage cuts, schedule, microbatch count and per-stage remat.

    ``costs``: segment costs (the layout of ``SegmentCosts`` in
    ``cpp/include/baton/autoplan.h``) as a dict, JSON text or a path to a JSON
    file. ``memory_per_device``: bytes or a string like ``"20GiB"`` (``None``:
    unlimited). Returns the best plan of each (schedule, v, microbatches),
    best first, at most ``top`` rows; each row is a dict with ``schedule``,
    ``virtual_stages``, ``microbatches``, ``cuts`` (first segment of each
    stage), ``remat`` (per stage), ``step_time``, ``bubble_fraction``,
    ``peak_memory`` (bytes per rank) and ``fits``. ``gap`` > 0 trades
    exactness for speed (the best row is then within ``1 + gap`` of the
    optimum). ``node_budget`` bounds the depth-first nodes per configuration
    (0: no limit); beyond it the result is approximate and ``rows.stats``
    holds ``exact=False`` and the certified ``gap``. ``update_in_place``: the step donates
    its parameters and optimizer state, so the update after the loop writes the new ones in
    place; otherwise a rank's peak is also at least its static bytes plus its stages' new
    parameters and optimizer state. ``offload``: a candidate over the budget may offload
    its ranks' stashes to host memory (rows then carry ``offload``, per stage "none" or
    "stash", and ``peak_host``, bytes per rank), simulated as its rank programs with the
    copies on the costs' ``host_link_bandwidth`` (required), within ``host_memory`` per rank
    (bytes or a string; None: unlimited). Raises ``ConfigError`` when no plan fits (naming the
    smallest peak found and its rank), ``FormatError`` on malformed costs.
    """
    text = _json_text(costs, "segment costs dict", "segment cost file")
    if text is None:
        raise ConfigError(
            f"segment costs must be a dict, JSON text or a path (got {type(costs).__name__})"
        )
    plans, stats = _core.autoplan(
        text,
        _positive_int(ranks, "ranks"),
        parse_memory(memory_per_device),
        _positive_int(top, "top"),
        None if families is None else [str(f) for f in families],
        None if microbatches is None else [int(m) for m in microbatches],
        None if remat is None else [str(r) for r in remat],
        None if interleaved_v is None else [int(v) for v in interleaved_v],
        int(max_microbatches),
        float(gap),
        int(node_budget),
        bool(update_in_place),
        bool(offload),
        parse_memory(host_memory),
        _positive_int(fetch_lookahead, "fetch_lookahead"),
    )
    rows = AutoplanRows(plans)
    rows.stats = dict(stats)
    return rows
