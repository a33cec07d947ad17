"""Fitting a hardware file's efficiency multiplier to measured steps (docs/SCALE.md,
"Calibrating the hardware file from measured steps"): one factor on every modelled
compute rate (GEMM table, attention, memory-bound work); communication constants are
measured separately (nccl-tests bus bandwidths)."""

from __future__ import annotations

import dataclasses
import math

from .plan import evaluate_cluster, load_cluster


@dataclasses.dataclass
class Measurement:
    """One measured configuration: a model (name, config or profile dict), its degrees,
    schedule and microbatches, and the measured seconds per step."""
    model: object
    pp: int
    tp: int
    dp: int
    global_batch: int
    schedule: str
    microbatches: int
    step_time: float
    virtual_stages: int = 1
    remat: str = "keep"
    fsdp: bool = False
    fp8: bool = False
    seq: int | None = None

    @classmethod
    def from_profile(cls, profile, **config) -> "Measurement":
        """From a ``baton.profile(...)`` result (its median measured step) and the
        configuration it ran (every field but ``step_time``)."""
        return cls(step_time=float(profile.measured["step_time"]), **config)


def _log_error(hw: dict, ms: list, eff: float) -> float:
    total = 0.0
    for m in ms:
        p = evaluate_cluster(m.model, hw, pp=m.pp, tp=m.tp, dp=m.dp,
                             global_batch=m.global_batch, schedule=m.schedule,
                             microbatches=m.microbatches, virtual_stages=m.virtual_stages,
                             remat=m.remat, fsdp=m.fsdp, fp8=m.fp8, seq=m.seq, efficiency=eff)
        total += math.log(p.step_time / m.step_time) ** 2
    return total / len(ms)


def calibrate(cluster, measurements: list, lo: float = 0.02, hi: float = 1.0) -> dict:
    """The hardware dict of ``cluster`` with ``efficiency`` set to the value in [lo, hi]
    minimising the mean squared log-ratio of predicted to measured step time (golden
    section search; the error is unimodal in the efficiency: predictions fall as it grows)."""
    if not measurements:
        raise ValueError("calibrate: no measurements")
    for k, m in enumerate(measurements):
        if not (m.step_time > 0 and math.isfinite(m.step_time)):
            raise ValueError(f"calibrate: measurements[{k}].step_time must be > 0 "
                             f"(got {m.step_time})")
    hw = load_cluster(cluster)
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = _log_error(hw, measurements, c), _log_error(hw, measurements, d)
    for _ in range(40):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = _log_error(hw, measurements, c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = _log_error(hw, measurements, d)
    eff = (a + b) / 2
    out = dict(hw, efficiency=eff)
    out["efficiency_note"] = (f"calibrate(): fitted on {len(measurements)} measured step(s), "
                              f"rms log error {math.sqrt(_log_error(hw, measurements, eff)):.3f}")
    return out
