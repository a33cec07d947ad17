"""A step run by a process group (``run_group``): this process's ranks, over its transports.

This process (``group.rank``) runs ranks ``mesh.ranks_of(p)``: the code outside the loop of
their stages, their loops (the step's engine), and the transfers of values that cross
processes outside the loop (``distributed.Router``)."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, ExecutionError
from .around_loop import Route, run_around
from .distributed import Router
from .step_run import LoopRecord


def run_group(step, flat_args, group, timeout, opts, interp) -> tuple[list[Any], LoopRecord]:
    """One step of this process's ranks (``_run_group_body``): its flat outputs and the
    loop's ``LoopRecord``; an error outside the loop
    aborts the other processes' ranks instead of letting them wait out the timeout."""
    try:
        return _run_group_body(step, flat_args, group, timeout, opts, interp)
    except ExecutionError:
        raise
    except BaseException as e:
        group.abort_all(f"rank {step.mesh.ranks_of(group.rank)[0]}: "
                        f"{type(e).__name__}: {e}")
        raise


def _run_group_body(step, flat_args, group, timeout, opts, interp):
    """This process (``group.rank``) runs ranks ``mesh.ranks_of(p)`` (``p*k .. p*k+k-1``,
    or the one rank it holds a slot of when ranks span processes): the code outside the
    loop of their stages (``around_loop.run_around``, values that cross processes moved by a
    ``distributed.Router``), and their loops (``engine.run_rank``). When ranks span
    processes, the code outside the loop of a rank runs as multi-controller jits in every
    process of the rank, its values ``jax.Array``s over the rank's sub-mesh, and a value
    needed on a rank goes to each of its processes."""
    if interp and step.mesh.spans:
        raise ConfigError(
            "baton.jit: the interpreter (engine='interpreter') runs ranks held by one "
            "process each; ranks that span processes run on the compiled engine only")
    router = Router(group, timeout)
    runner = step.interpreter if interp else step.engine
    return run_around(step, flat_args,
                      lambda vals: runner.run_rank(group, router, vals, timeout, opts),
                      Route(step, router, group.rank), opts,
                      before_post=None if interp else step.engine.join_warmup)
