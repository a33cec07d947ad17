"""What a ``baton.jit`` function tells about its step (``StepInspection``, a base of
``PipelinedFunction``): its costs, rank programs, summary, memory model, simulation and last
trace."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..measure.memory import memory as memory_model
from ..planning.step_costs import cost_model_of


class StepInspection:
    """Inspection methods; the class using it provides ``compile(*args)``, ``last`` (the last
    ``CompiledStep``), ``last_trace`` and ``memory_models`` (``CompiledStep`` -> its last
    ``memory`` result, which ``summary`` shows)."""

    def write_trace(self, path) -> str:
        """Writes the last traced call's Chrome/Perfetto trace (``baton.jit(..., trace=True)``
        or ``baton.trace``) to ``path``; returns the JSON text."""
        if self.last_trace is None:
            raise ConfigError("no traced call yet: use baton.jit(..., trace=True) or baton.trace")
        return self.last_trace.write(path)

    def _step(self, args):
        step = self.compile(*args) if args else self.last
        if step is None:
            raise ConfigError("call the step (or pass example arguments) first")
        return step

    def cost_model(self, *args) -> Any:
        """The simulator's costs (``step_costs.cost_model_of``)."""
        return cost_model_of(self._step(args))

    def rank_ir(self, *args) -> Any:
        """The step's rank programs as they run (``_core.RankIR``; ``.to_text()``,
        ``.programs``; docs/RANK_IR.md)."""
        return self._step(args).rank_ir()

    def summary(self, *args) -> str:
        """The plan's summary (step time, bubble, device and, when the step offloads, host
        memory per rank, simulated over the step's own rank programs), with the profile's
        and the memory model's tables once measured."""
        step = self._step(args)
        text = step.plan.summary(cost_model_of(step), rank_ir=step.rank_ir())
        if step.profiled is not None:
            text += "\n" + step.profiled.summary()
        mem = self.memory_models.get(step)
        if mem is not None:
            text += "\nmemory per device (step.memory):\n" + mem.table()
        return text

    def memory(self, *args, measure: bool = False):
        """The per-rank, per-device memory model of the step on ``args``: a
        ``baton.measure.memory.Memory`` (static arguments, copies, running sums, pipeline
        buffers, XLA temporaries; ``.table()``), shown by ``summary()`` from then on.
        ``measure``: also run one step sampling the live jax arrays per device
        (``Memory.measured``) on the step's own engine. Compiles each task on the arguments
        the loop hands it (their layouts, ``measure/task_args.capture``); one process
        only. See docs/ARCHITECTURE.md, "Measurement and memory"."""
        mem = memory_model(self, args, measure)
        self.memory_models[self._step(args)] = mem
        return mem

    def simulate(self, *args):
        """The simulated step (``Plan.simulate`` with ``cost_model``)."""
        step = self._step(args)
        return step.plan.simulate(cost_model_of(step))
