"""A one-rank step as one XLA program (``SingleProgram``: the compiled engine on one rank).

When every stage of a plan is on one rank there is nothing to overlap: the executor would
only add a host round trip per task (dispatch, output allocation, the optimizer as its own
call). As Megatron-LM does for a pipeline of size 1, Baton then compiles the whole step (the
code before the loop, the rank's tasks in the schedule's order, the reductions and the code
after the loop) into one jitted function. The schedule still decides the order and so the
memory profile: GPipe runs every forward before any backward and keeps every stash, 1F1B
(fused) one microbatch at a time, ZB-H1 F, I and W. The rank program's tasks are rolled into
loops (``_core.roll_rank``, lowered by ``loop_program._LoopProgram``).

A traced one-rank step (``baton.trace``, ``baton.profile``) runs the same program with task
markers (``baton_mark`` calls, as every rank program has; ``comm`` given): the markers tie
each task's outputs to a token, so XLA keeps the tasks in the schedule's order and the
recorded spans are the tasks' own. The untraced program has none, so XLA may schedule
across task boundaries.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import ffi
from .loop_program import _LoopProgram
from .rank_transfers import RankTransfers, recorded_events
from .rolling import task_list
from .task_env import _Env, _Token
from ..planning.segments import donatable
from ..planning.tasks import combine_parts


class SingleProgram(_LoopProgram):
    """A one-rank ``CompiledStep`` as one jitted program (see the module docstring)."""

    def __init__(self, cs, comm=None):
        if cs.num_ranks != 1:
            raise ValueError("internal: SingleProgram needs a one-rank plan")
        self.tasks = task_list(cs)
        # traced: task markers on ``comm`` (a ``RankComm`` of rank 0; it records their times)
        self.comm = comm
        self.marks = comm is not None
        if comm is not None:
            ffi.register()
            sub = cs.mesh.meshes[0]
            if sub.devices.size > 1:
                comm.set_shards([int(d.id) for d in sub.devices.flat])
            self.transfers = RankTransfers(cs, comm, sub, 0)
        # no stacked buffers between loops (XLA would zero-fill them, see stacked_buffers):
        # runs that would need them stay unrolled (GPipe's forwards)
        super().__init__(cs, 0, stacked=False)
        # donated step inputs (baton.jit(donate_argnums=...)), each matched to a step output
        # of its shape and dtype, enter as the first argument, which XLA may overwrite
        tr = cs.traced
        made = [v for v in tr.step_outputs if v not in tr.literals and v not in tr.step_inputs]
        self.donate = list(donatable(tr.avals, tr.step_inputs, made, cs.donated,
                                     set(tr.step_outputs)))
        n = len(tr.step_inputs)
        keep = [i for i in range(n) if i not in set(self.donate)]

        def program(given, kept):
            args = [None] * n
            for i, x in zip(self.donate, given):
                args[i] = x
            for i, x in zip(keep, kept):
                args[i] = x
            return self._program(args)

        self.kept = keep
        self.fn = jax.jit(program, donate_argnums=0)
        self.compiled = None  # the executable, compiled when its memory is measured

    def _mark(self, phase, dep, after):
        return self.transfers.mark(phase, dep, after)

    def events(self) -> list[tuple]:
        """The last traced call's events in the interpreter's format (``recorded_events``);
        empty when untraced or the comm did not record."""
        if self.comm is None:
            return []
        return recorded_events(self.cs, 0, self.comm, {})

    def _split(self, args):  # (donated, kept) as ``fn`` takes them
        return [args[i] for i in self.donate], [args[i] for i in self.kept]

    def lowered_text(self, flat_args) -> str:
        """The program's StableHLO for these step inputs (tests inspect its custom calls)."""
        return self.fn.lower(*self._split(list(flat_args))).as_text()

    def __call__(self, flat_args, live=None):
        """One step; ``live`` (``memory.LivePeak``): sampled as the program starts, its
        arguments placed, the program's own allocation added."""
        cs = self.cs
        args = self._split(cs.place(cs.traced.step_inputs, list(flat_args), 0))
        if live is not None:  # (the same program as the jit's own: its memory analysis)
            if self.compiled is None:
                self.compiled = self.fn.lower(*args).compile()
            live.sample_programs([([0], self.compiled)])
        outs = self.fn(*args)
        del args
        if self.marks:  # (the last marker's token: the markers are not dead code)
            outs = outs[:-1]
        tr = cs.traced
        it = iter(outs)
        return [tr.literals[v] if v in tr.literals else next(it) for v in tr.step_outputs]

    def _program(self, flat_args):
        cs = self.cs
        tr = cs.traced
        lits = tr.literals
        vals: dict[Any, Any] = dict(zip(tr.step_inputs, flat_args))
        for seg in cs.pre_segments:
            for v, x in zip(seg.outputs, seg.fn(*[vals[v] for v in seg.inputs])):
                vals[v] = x

        def outer(v):
            o, _ = cs.loop_src[v]
            return vals[o] if o in vals else lits[o]

        env = _Env()
        token = _Token(jnp.zeros((), jnp.int32) if self.marks else None)
        self._loop(env, outer, self._whole_mb(outer, {}), token)
        # the loop's outputs: parts reduced, then combined per outer value
        final = self._final_parts(env, range(len(cs.parts)))
        for o, idx in cs.by_outer.items():
            vals[o] = combine_parts([final[i] for i in idx])
        for seg in cs.post_segments:
            for v, x in zip(seg.outputs, seg.fn(*[vals[v] for v in seg.inputs])):
                vals[v] = x
        outs = [vals[v] for v in tr.step_outputs if v not in lits]
        return outs + [token.dep] if self.marks else outs

