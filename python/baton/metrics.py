"""Training metrics of a pipelined step, and small writers for TensorBoard and W&B.

Per step (``StepMetrics``):

* ``step_time``: the caller's wall-clock seconds for the step (from before the call until its
  outputs are ready); ``tokens_per_second`` = tokens in the step's batch / ``step_time``.
* ``model_flops``: the floating-point operations of the step's matrix multiplications
  (``dot_general``: 2 x output elements x contracted size) in the traced step: the
  microbatch loop's forward and backward (counted once per microbatch) plus the code outside
  the loop. Element-wise work is not counted (the usual MFU convention: Megatron-LM, PaLM's
  appendix B). Rematerialization Baton adds (``remat=True``) is not counted; a model's own
  ``jax.checkpoint`` is part of its traced backward and is.
* ``mfu`` = ``model_flops / (step_time x peak_flops x devices)`` where ``peak_flops`` is the
  per-device peak rate the caller states (the accelerator's datasheet figure for the dtype
  used); ``None`` when no peak was given.
* ``idle`` (per rank): measured, from a traced step (``baton.trace``): 1 - the rank's busy
  time / the span from its first task's start to its last task's end (``Trace.bubble``).
* ``memory_peak`` (per rank, bytes): the allocator's ``peak_bytes_in_use`` of the rank's
  devices (the largest over them) where the backend reports one (GPU, TPU); on the CPU
  backend, which reports none, the bytes of live arrays on the rank's devices after the step
  (parameters, optimizer state, outputs) plus the traced step's peak of pipeline buffers
  (activations, stashes, gradients between tasks, at the measured event times:
  ``Trace.peak_total``). ``memory_source`` says which. A rank of another process: -1 (each
  process writes its own ranks').

``MetricsWriter`` is the hook: ``TensorBoardWriter(logdir)`` (tensorboardX) and
``WandbWriter(project=...)`` (wandb, imported when made) write a ``StepMetrics`` as scalars
named ``step/time_s``, ``step/tokens_per_s``, ``step/mfu``, ``rank<r>/idle``,
``rank<r>/memory_peak_bytes`` (and ``loss`` when given).
"""

from __future__ import annotations

import dataclasses
import resource
import types
from typing import Any, Sequence

import jax

from . import _core
from . import _jax_compat as jc
from .errors import ConfigError

G = _core.graph

__all__ = ["StepMetrics", "model_flops", "step_metrics", "measured_matmul_flops",
           "MetricsWriter", "TensorBoardWriter", "WandbWriter", "writers"]

_MATMUL = ("dot_general",)


def _matmul_flops_of_jaxpr(jaxpr) -> float:
    eqns = jaxpr.eqns if hasattr(jaxpr, "eqns") else jaxpr.jaxpr.eqns
    return sum(_matmul_flops(e.primitive.name, e.params, e.outvars, e.invars) for e in eqns)


def _matmul_flops(name: str, params: dict, outvars, invars) -> float:
    if name in _MATMUL:
        (lc, _), _ = params["dimension_numbers"]
        lhs = invars[0].aval.shape
        k = 1
        for d in lc:
            k *= int(lhs[d])
        out = 1
        for d in outvars[0].aval.shape:
            out *= int(d)
        return 2.0 * out * k
    subs = jc.sub_jaxprs(types.SimpleNamespace(params=params))
    if not subs:
        return 0.0
    inner = sum(_matmul_flops_of_jaxpr(s) for s in subs)
    return inner * float(params.get("length", 1))  # a scan runs its body `length` times


def model_flops(fn: Any) -> float:
    """Matrix-multiply FLOPs of one step of ``fn`` (a ``baton.jit`` function that has been
    called or compiled): the loop's per-microbatch FLOPs x microbatches, plus the rest."""
    step = getattr(fn, "last", None)
    if step is None:
        raise ConfigError("baton.metrics.model_flops: the step has not been compiled yet "
                          "(call it, or fn.compile(*args), first)")
    traced = step.traced
    loop = other = 0.0
    for op in traced.ops:
        if op.kind != G.OpKind.Compute:
            continue
        f = _matmul_flops_of_op(op)
        if op.region == G.Region.Loop:
            loop += f
        else:
            other += f
    return loop * traced.microbatches + other


def _matmul_flops_of_op(op) -> float:
    if op.prim.name in _MATMUL:
        return float(op.cost)  # trace._eqn_cost: 2 x output elements x contracted size
    return _matmul_flops(op.prim.name, op.params, (), ())


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """One step's measures (module docstring for the definitions)."""

    step: int
    step_time: float  # seconds
    tokens: int
    tokens_per_second: float
    model_flops: float
    mfu: float | None
    idle: tuple[float, ...]  # per rank
    memory_peak: tuple[int, ...]  # per rank, bytes
    memory_source: str  # "allocator peak" or "live arrays + traced buffer peak"
    host_peak_rss: int  # this process's peak resident set (bytes, getrusage)
    loss: float | None = None

    def scalars(self) -> dict[str, float]:
        """Name -> value, as the writers log them."""
        out = {"step/time_s": self.step_time, "step/tokens_per_s": self.tokens_per_second,
               "step/model_flops": self.model_flops,
               "host/peak_rss_bytes": float(self.host_peak_rss)}
        if self.mfu is not None:
            out["step/mfu"] = self.mfu
        if self.loss is not None:
            out["loss"] = self.loss
        for r, v in enumerate(self.idle):
            out[f"rank{r}/idle"] = v
        for r, v in enumerate(self.memory_peak):
            out[f"rank{r}/memory_peak_bytes"] = float(v)
        return out


def _rank_devices(fn) -> list[list]:
    mesh = getattr(fn, "mesh", None)
    groups = getattr(mesh, "rank_devices", None)
    if groups is None:
        raise ConfigError("baton.metrics: the step's mesh has no ranks yet (call it first)")
    return [list(g) for g in groups]


def _memory_peaks(fn, trace) -> tuple[tuple[int, ...], str]:
    groups = _rank_devices(fn)
    me = jax.process_index()
    peaks = []
    for g in groups:
        local = [d for d in g if d.process_index == me]
        stats = [d.memory_stats() for d in local]
        if not local:
            peaks.append(-1)  # another process's rank: that process writes it
        elif all(s and "peak_bytes_in_use" in s for s in stats):
            peaks.append(max(int(s["peak_bytes_in_use"]) for s in stats))
        else:
            peaks = None
            break
    if peaks is not None:
        return tuple(peaks), "allocator peak"
    live: dict = {}
    for a in jax.live_arrays():
        for sh in a.addressable_shards:
            live[sh.device] = live.get(sh.device, 0) + sh.data.nbytes
    out = []
    for r, g in enumerate(groups):
        if not any(d.process_index == me for d in g):
            out.append(-1)
            continue
        resident = max((live.get(d, 0) for d in g), default=0)
        buffers = trace.peak_total[r] if trace is not None and r < len(trace.peak_total) else 0
        out.append(int(resident + buffers))
    return tuple(out), "live arrays + traced buffer peak"


def step_metrics(fn: Any, step: int, step_time: float, tokens: int, trace: Any = None,
                 peak_flops: float | None = None, loss: float | None = None) -> StepMetrics:
    """The ``StepMetrics`` of a step of ``fn`` that took ``step_time`` seconds on a batch of
    ``tokens`` tokens. ``trace``: the step's ``baton.Trace`` (``baton.trace(fn, *args)``),
    for the measured idle fractions (without it they are NaN) and the buffer peaks.
    ``peak_flops``: per-device peak FLOP/s for the MFU."""
    if not step_time > 0:
        raise ConfigError(f"baton.metrics: step_time must be positive (got {step_time!r})")
    if peak_flops is not None and not peak_flops > 0:
        raise ConfigError(f"baton.metrics: peak_flops must be positive (got {peak_flops!r})")
    flops = model_flops(fn)
    groups = _rank_devices(fn)
    devices = sum(len(g) for g in groups)
    mfu = None if peak_flops is None else flops / (step_time * peak_flops * devices)
    idle = (tuple(float(b) for b in trace.bubble) if trace is not None
            else tuple(float("nan") for _ in groups))
    mem, source = _memory_peaks(fn, trace)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return StepMetrics(step=int(step), step_time=float(step_time), tokens=int(tokens),
                       tokens_per_second=tokens / step_time, model_flops=flops, mfu=mfu,
                       idle=idle, memory_peak=mem, memory_source=source, host_peak_rss=rss,
                       loss=None if loss is None else float(loss))


class MetricsWriter:
    """The hook: ``write(metrics)`` after a step, ``close()`` at the end."""

    def write(self, m: StepMetrics) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class TensorBoardWriter(MetricsWriter):
    """Scalars into a TensorBoard event file under ``logdir`` (tensorboardX)."""

    def __init__(self, logdir: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError("baton.metrics.TensorBoardWriter needs tensorboardX "
                              "(pip install tensorboardX)") from None
        self.writer = SummaryWriter(logdir)

    def write(self, m: StepMetrics) -> None:
        for name, v in m.scalars().items():
            self.writer.add_scalar(name, v, m.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter(MetricsWriter):
    """Scalars to Weights & Biases (``wandb.init(**kwargs)``); wandb is imported here."""

    def __init__(self, **kwargs):
        try:
            import wandb
        except ImportError:
            raise ConfigError("baton.metrics.WandbWriter needs wandb (pip install wandb)") \
                from None
        self.run = wandb.init(**kwargs)

    def write(self, m: StepMetrics) -> None:
        self.run.log(m.scalars(), step=m.step)

    def close(self) -> None:
        self.run.finish()


def measured_matmul_flops(device: Any = None, n: int = 1024, repeats: int = 8) -> float:
    """FLOP/s of an ``n x n`` float32 matrix multiply on ``device`` (default: the first
    local device), timed over ``repeats`` calls after one warm-up: a measured stand-in for
    ``peak_flops`` where no datasheet figure applies (a CPU). MFU against it is the share of
    this machine's achievable matmul rate, not of a datasheet peak."""
    import time

    import jax.numpy as jnp
    dev = device or jax.local_devices()[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), dev)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(repeats):
        out = mm(a)
    out.block_until_ready()
    return 2.0 * n ** 3 * repeats / (time.perf_counter() - t)


def writers(specs: Sequence[MetricsWriter]) -> "MetricsWriter":
    """One writer that writes to each of ``specs``."""
    return _Fanout(list(specs))


class _Fanout(MetricsWriter):
    def __init__(self, ws):
        self.ws = ws

    def write(self, m):
        for w in self.ws:
            w.write(m)

    def close(self):
        for w in self.ws:
            w.close()
