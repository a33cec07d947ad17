"""``baton.jit``: pipeline a training step over a ``PipelineMesh``."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np

from .. import _core
from ..errors import ConfigError, TraceError
from .executor import CompiledStep
from .mesh import PipelineMesh
from .trace import trace_step


def _schedule_spec(schedule: Any):
    from .. import schedules as S  # planner API (H4)

    if isinstance(schedule, str):
        return S.schedule_from_name(schedule)
    return schedule


class PipelinedFunction:
    """The result of ``baton.jit``. Call it like the step; inspect ``.plan``, ``.summary()``."""

    def __init__(self, fn: Callable, mesh: PipelineMesh, schedule: Any, microbatches: int):
        if not isinstance(mesh, PipelineMesh):
            mesh = PipelineMesh(mesh)
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ConfigError(
                f"baton.jit: microbatches must be a positive integer (got {microbatches!r})"
            )
        self.fn = fn
        self.mesh = mesh
        self.spec = _schedule_spec(schedule)
        self.microbatches = microbatches
        self._cache: dict[Any, CompiledStep] = {}
        self._tree = None
        self.last: CompiledStep | None = None
        functools.update_wrapper(self, fn)

    def _key(self, flat, tree):
        return (tree, tuple((np.shape(x), str(jax.numpy.result_type(x))) for x in flat))

    def compile(self, *args) -> CompiledStep:
        flat, tree = jax.tree.flatten(args)
        if self._tree is not None and tree != self._tree:
            raise TraceError(
                f"baton.jit: the structure of the arguments changed between calls "
                f"(was {self._tree}, now {tree}); a pipelined step keeps one pytree structure"
            )
        key = self._key(flat, tree)
        step = self._cache.get(key)
        if step is None:
            step = self._build(args)
            self._cache[key] = step
            self._tree = tree
        self.last = step
        return step

    def _build(self, args) -> CompiledStep:
        from ..planning import plan as make_plan

        traced = trace_step(self.fn, args, self.microbatches)
        ranks = self.mesh.num_ranks
        want = self.spec.stages(ranks)
        if traced.num_stages != want:
            raise TraceError(
                f"the model has {traced.num_stages} stages ({traced.num_stages - 1} "
                f"stage_boundary calls) but schedule {type(self.spec).__name__} on {ranks} ranks "
                f"needs {want} stages ({want - 1} boundaries)"
            )
        plan = make_plan(self.spec, ranks, self.microbatches)
        sched = plan.core.schedule if hasattr(plan, "core") else plan.schedule
        if sched.num_ranks != ranks or sched.num_microbatches != self.microbatches:
            raise ConfigError(
                f"the schedule has {sched.num_ranks} ranks and {sched.num_microbatches} "
                f"microbatches but the mesh has {ranks} ranks and baton.jit was given "
                f"microbatches={self.microbatches}"
            )
        plan.verify()  # raises baton.VerifyError with the report
        return CompiledStep(traced, plan, self.mesh, bool(sched.split_backward()))

    def __call__(self, *args):
        step = self.compile(*args)
        self.last = step
        flat = jax.tree.leaves(args)
        outs = step.run(flat)
        return jax.tree.unflatten(step.traced.out_tree, outs)

    # -- inspection ----------------------------------------------------------------
    def cost_model(self, *args) -> Any:
        step = self.compile(*args) if args else self.last
        if step is None:
            raise ConfigError("call the step (or pass example arguments) first")
        return cost_model_of(step)

    def summary(self, *args) -> str:
        step = self.compile(*args) if args else self.last
        if step is None:
            raise ConfigError("call the step (or pass example arguments) first")
        return step.plan.summary(cost_model_of(step))

    def simulate(self, *args):
        step = self.compile(*args) if args else self.last
        return step.plan.simulate(cost_model_of(step))


def cost_model_of(step: CompiledStep):
    """Simulator costs from the traced task costs (flops, normalized) and real byte sizes."""
    costs = step.stage_costs()
    scale = max(max(c["f"] for c in costs), 1.0)
    cm = _core.CostModel()
    stages = []
    # A task with no ops (stage 0's I) still allocates its outputs before its
    # inputs are freed: give every task a small positive duration so that the
    # simulator's memory timeline sees that moment too.
    tiny = 1e-3
    for c in costs:
        sc = _core.StageCost()
        sc.f = max(c["f"] / scale, tiny)
        sc.b = max(c["b"] / scale, tiny)
        sc.i = max(c["i"] / scale, tiny)
        sc.w = max(c["w"] / scale, tiny)
        sc.act_bytes = int(c["act_bytes"])
        sc.stash_bytes = int(c["stash_bytes"])
        sc.grad_bytes = int(c["grad_bytes"])
        sc.wstash_bytes = int(c["wstash_bytes"])
        sc.wgrad_bytes = int(c["wgrad_bytes"])
        stages.append(sc)
    cm.stages = stages
    return cm


def jit(
    fn: Callable | None = None,
    *,
    mesh: Any = None,
    schedule: Any = "1f1b",
    microbatches: int = 1,
):
    """Pipelines ``fn`` (a training step containing one ``baton.accumulate``).

    Usable as ``baton.jit(step, mesh=..., schedule=..., microbatches=...)`` or
    as a decorator ``@baton.jit(mesh=..., ...)``.
    """
    if mesh is None:
        raise ConfigError("baton.jit: pass mesh=baton.PipelineMesh(devices, ranks=R)")

    def wrap(f):
        return PipelinedFunction(f, mesh, schedule, microbatches)

    return wrap if fn is None else wrap(fn)
