"""A step run by a process group (``run_group``): this process's ranks, over its transports.

This process (``group.rank``) runs ranks ``mesh.ranks_of(p)``: the code outside the loop of
their stages, their loops (the step's engine), and the transfers of values that cross
processes outside the loop (``distributed.Router``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError, ExecutionError
from .distributed import Remote, Router
from .run_options import PLAIN
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
    loop of their stages, their loops (``engine.run_rank``), and the transfers of values
    that cross processes outside the loop (inputs another process holds, partial sums of
    a value shared by stages on several processes, per-microbatch outputs sent to every
    process). ``where`` says which processes hold a value; every process walks the same
    sequence of transfers, so they pair up. When ranks span processes, the code outside the
    loop of a rank runs as multi-controller jits in every process of the rank, its values
    ``jax.Array``s over the rank's sub-mesh, and a value needed on a rank goes to each of
    its processes."""
    tr = step.traced
    lits = tr.literals
    me = group.rank
    router = Router(group, timeout)
    vals: dict[Any, Any] = {}
    where = router.holders(tr.step_inputs, flat_args, vals)
    made: dict[Any, int] = {}  # value -> the rank that made it (named by Remote)
    procs = step.mesh.procs
    _group_segments(step, step.pre_segments, vals, where, router, me, made)
    for r in range(step.num_ranks):
        router.need([o for o in step.loop_needs[r] if o not in lits], procs(r), vals, where)
    if not interp:
        final, record = step.engine.run_rank(group, router, vals, timeout, opts)
    elif step.mesh.spans:
        raise ConfigError(
            "baton.jit: the interpreter (engine='interpreter') runs ranks held by one "
            "process each; ranks that span processes run on the compiled engine only")
    else:
        final, record = step.interpreter.run_rank(group, router, vals, timeout, opts)
    for i, p in enumerate(step.parts):
        where[("part", i)] = set(procs(step.stage_rank[p.stage]))
        if i in final:
            vals[("part", i)] = final[i]
    for outer, idx in step.by_outer.items():
        home = step.home(idx)
        if len(idx) > 1:
            router.need([("part", i) for i in idx], procs(home), vals, where)
        if me in procs(home):
            vals[outer] = step.combine(idx, {i: vals[("part", i)] for i in idx})
        where[outer], made[outer] = set(procs(home)), home
    if not interp:
        step.engine.join_warmup()
    _group_segments(step, step.post_segments, vals, where, router, me, made, opts)
    seen = set()
    for v in tr.step_outputs:
        if v in step._broadcast and v not in seen:
            seen.add(v)
            for q in range(group.world_size):
                router.need([v], q, vals, where)
    outs = []
    for v in tr.step_outputs:
        if v in lits:
            outs.append(lits[v])
        elif me in where[v]:
            outs.append(vals[v])
        else:
            aval = tr.avals[v]
            outs.append(Remote(tuple(aval.shape), np.dtype(aval.dtype),
                               made.get(v, step.mesh.ranks_of(min(where[v]))[0])))
    router.finish()
    return outs, record

def _group_segments(step, segs, vals, where, router, me, made, opts=PLAIN):
    lits = step.traced.literals
    for seg in segs:
        r = step.stage_rank[seg.stage]
        procs = step.mesh.procs(r)
        router.need([v for v in seg.inputs if v not in lits], procs, vals, where)
        if me in procs:
            step._run_segments([seg], vals, opts=opts)
        for v in seg.outputs:  # a value copied on several stages is held by each
            where.setdefault(v, set()).update(procs)
            made.setdefault(v, r)
