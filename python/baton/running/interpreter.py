"""The reference engine: each rank's program of the step's rank IR (``step.rank_ir()``, the
instruction stream the compiled engine lowers: POST, WAIT, RUN, FREE, ACCUMULATE) run by the
C++ ``Executor`` (``baton._core.runtime``), with the step's jitted tasks as its ``Tasks``
callbacks.

* run          calls the action's jitted task(s) on the rank's devices;
* received     ``jax.device_put``s a received value to the consuming rank's sharding;
* accumulate   adds a WGrad into the stage's accumulator.

It runs only when chosen, with ``baton.jit(..., engine="interpreter")`` (for debugging:
every task is its own call); ``baton.profile`` and the memory model get each task's arguments
without it (``task_args.py``). Single process: one executor
per rank over an in-process transport, each in its own thread; a task that raises stops
every rank and the call raises the failing rank's ``ExecutionError`` (never hangs: every
wait is bounded). One process per rank: this process's executor over its transport
(``run_rank``). The executors' measured peak live bytes per rank come back in the run's
``LoopRecord.stats``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _core
from .. import runtime as rt
from ..runtime import to_host
from ..planning.tasks import MB, OUT_GROUPS, BufKind, buffer_reads, final_part, task_exes
from .step_run import LoopRecord
from .threads import on_rank_threads, raise_first
from .events import gather_events

G = _core.graph


@jax.jit
def _add_lists(a, b):
    return [x + y for x, y in zip(a, b)]


@jax.jit
def _final_list(a, c):
    return [x / jnp.asarray(c, x.dtype) for x in a]


@jax.jit
def _stack(xs):
    return jnp.stack(xs)


@functools.partial(jax.jit, static_argnums=1)
def _split(x, m):
    x = jnp.asarray(x)
    x = x.reshape((m, x.shape[0] // m, *x.shape[1:]))
    return [x[i] for i in range(m)]


class _Sized(list):
    """A buffer's value (list of arrays) with its byte size, which the runtime reads for its
    live-bytes accounting instead of asking every array (jax's ``nbytes`` is a Python
    property: ~900 reads per GPT step). A pytree like a list (so ``jax.block_until_ready``
    and tree functions see its arrays, not one opaque leaf)."""

    __slots__ = ("nbytes",)


def _sized_unflatten(nbytes, xs):
    out = _Sized(xs)
    out.nbytes = nbytes
    return out


jax.tree_util.register_pytree_node(_Sized, lambda v: (list(v), v.nbytes), _sized_unflatten)


class _StepState:
    """What the task callbacks of one step share: step values, placed loop inputs,
    accumulators (part index -> running sum), stacks, and the first Python exception
    raised per rank (the cause of the ExecutionError)."""

    def __init__(self, vals, opts):
        self.vals = vals
        self.opts = opts  # the run's RunOptions
        self.inv_cache: dict = {}
        self.split_cache: dict = {}
        self.acc: dict = {}
        self.adds: dict = {}  # first summed part of a task -> microbatches summed so far
        self.scaled: set = set()  # mean parts already divided by the microbatch count
        self.stack: dict = {}
        self.errors: dict = {}


def _to_host(value):
    """A value (list of jax.Arrays) as host-transferable arrays: one-device arrays cross as
    DLPack views, arrays sharded over several devices are gathered with numpy."""
    out = []
    for x in value:
        sh = getattr(x, "sharding", None)
        if sh is not None and len(sh.device_set) > 1:
            x = np.asarray(x)
        out.append(x)
    return to_host(out)


class Interpreter:
    """Runs a ``CompiledStep``'s plan on the C++ executor (see the module docstring)."""

    def __init__(self, step):
        self.step = step
        self._state: _StepState | None = None
        self._bytes: dict[tuple, int] = {}
        self._group_exec = None  # (ProcessGroup, Executor, record) in multi-process mode

    def forget_group(self) -> None:
        """Drops the executor of a process group (it is being closed)."""
        self._group_exec = None

    # -- the Tasks callbacks (called by the C++ executor, one thread per rank) --
    def _invariant(self, v, rank):
        st = self._state
        key = (v, rank)
        if key not in st.inv_cache:
            o, _ = self.step.loop_src[v]
            x = st.vals[o] if o in st.vals else self.step.traced.literals[o]
            st.inv_cache[key] = self.step.place([o], [x], rank)[0]
        return st.inv_cache[key]

    def _microbatch(self, v, m, rank):
        st = self._state
        if v not in st.split_cache:
            o, _ = self.step.loop_src[v]
            x = st.vals[o] if o in st.vals else self.step.traced.literals[o]
            st.split_cache[v] = _split(x, self.step.M)
        return self.step.put(st.split_cache[v][m], rank, batch=True)

    def _add_parts(self, idx, xs, m):
        st = self._state
        parts = self.step.parts
        summed = [(i, x) for i, x in zip(idx, xs)
                  if parts[i].reduce != G.Reduce.Stack and x is not None]
        for i, x in zip(idx, xs):
            if parts[i].reduce == G.Reduce.Stack:
                st.stack.setdefault(i, [None] * self.step.M)[m] = x
        if not summed:
            return
        if summed[0][0] not in st.acc:
            for i, x in summed:
                st.acc[i] = x
        else:
            new = _add_lists([st.acc[i] for i, _ in summed], [x for _, x in summed])
            for (i, _), x in zip(summed, new):
                st.acc[i] = x

    def _args(self, exe, kind, s, m, rank, env):
        args = [self._invariant(v, rank) for v in exe.in_groups[0]]
        args += [self._microbatch(v, m, rank) for v in exe.in_groups[1]]
        for bk, bs, bm in buffer_reads(exe, self.step.buffers.reads(kind, s, m)):
            args += env[self.step.buffers.id(bk, bs, bm)]
        return args

    def _run_task(self, kind, s, m, rank, env):
        """Runs one task and puts the buffers it makes (``Buffers.outputs``) into ``env``."""
        exes = task_exes(self.step.tasks, kind, s)
        exe = exes[0]
        got = exe.split(self._call(exe, self._args(exe, kind, s, m, rank, env), rank))
        if len(exes) == 2:  # B as I then W: I's WStash goes straight to W
            we = exes[1]
            wargs = [self._invariant(v, rank) for v in we.in_groups[0]]
            wargs += [self._microbatch(v, m, rank) for v in we.in_groups[1]]
            wg = we.split(self._call(we, wargs + got[BufKind.WStash], rank))[BufKind.WGrad]
            got[BufKind.WGrad] = wg
        bufs = self.step.buffers
        for key, value in bufs.outputs(kind, s, m, got):
            env[bufs.id(*key)] = value
        self._add_parts(exe.body[1], got[MB], m)

    def _call(self, exe, args, rank):
        """Runs a task. A task with weight gradients adds them to the running sums itself
        (inside its program, see tasks._with_acc) and returns None in their places; the
        ACCUMULATE of its WGrad buffer then has nothing left to add. With the run's ``live`` on,
        the live arrays are sampled once its outputs exist (its inputs and old sums still
        held)."""
        st = self._state
        step = self.step
        opts = st.opts
        key = (exe.kind, exe.stage)
        acc = None
        if exe.acc_parts and exe.acc_parts[0] in st.acc:
            acc = [st.acc.pop(i) for i in exe.acc_parts]
        if not exe.acc_parts:
            outs = exe.fn(*args)
            if opts.live is not None:
                jax.block_until_ready(outs)
                opts.live.sample(rank, key)
            return outs
        first = exe.acc_parts[0]
        added = st.adds.get(first, 0)
        st.adds[first] = added + 1
        if acc is None:
            outs = exe.fn(*args)
        elif added + 1 == step.M and exe.fn_acc_mean is not None:  # the last microbatch
            outs = exe.fn_acc_mean(float(step.M), acc, *args)
            st.scaled.update(i for i, mn in zip(exe.acc_parts, exe.acc_mean) if mn)
        else:
            outs = exe.fn_acc(acc, *args)
        outs = list(outs)
        if opts.block:  # the RUN spans the task's compute, sums included
            jax.block_until_ready(outs)
        if opts.live is not None:
            jax.block_until_ready(outs)
            opts.live.sample(rank, key)
        for j, i in zip(exe.acc_pos, exe.acc_parts):
            st.acc[i] = outs[j]
            outs[j] = None
        return outs

    def _sized(self, b, value):
        """``value`` (buffer ``b``'s arrays) as a _Sized list. The size is measured on the first
        value of each buffer kind and stage and reused: a compiled step has one set of shapes,
        so every microbatch's Act(s, .) (Grad, Stash, ...) has the same bytes."""
        kind, s, _ = self.step.buffers.key(b)
        n = self._bytes.get((kind, s))
        if n is None:
            n = self._bytes[(kind, s)] = sum(int(x.nbytes) for x in value if x is not None)
        out = _Sized(value)
        out.nbytes = n
        return out

    def _cb_run(self, rank, action, in_ids, ins, out_ids):
        try:
            env = dict(zip(in_ids, ins))
            for kind, s, m in self.step.buffers.tasks_of(rank, action):
                self._run_task(kind, s, m, rank, env)
            outs = [env[b] for b in out_ids]
            opts = self._state.opts
            if opts.block:
                jax.block_until_ready(outs)
            if opts.live is not None:
                opts.live.sample()
            return [self._sized(b, v) for b, v in zip(out_ids, outs)]
        except BaseException as e:
            self._state.errors.setdefault(rank, e)
            raise

    def _cb_accumulate(self, rank, b, value):
        try:
            _, s, m = self.step.buffers.key(b)
            TK = _core.TaskKind
            exe = self.step.tasks[(TK.W if self.step.partition.split_backward else TK.B, s)]
            self._add_parts(exe.body[0], value, m)
        except BaseException as e:
            self._state.errors.setdefault(rank, e)
            raise

    def _cb_received(self, rank, b, value):
        out = self._sized(b, [jax.device_put(x, self.step.mesh.like(rank, x)) for x in value])
        live = self._state.opts.live
        if live is not None:
            jax.block_until_ready(out)
            live.sample()
        return out

    def _recv_layout(self, rank, b):
        kind, s, _ = self.step.buffers.key(b)
        return self.step.buffers.layout(kind, s)

    def _tasks(self):
        return rt.Tasks(run=self._cb_run, accumulate=self._cb_accumulate,
                        received=self._cb_received, to_host=_to_host,
                        from_host=rt.from_host, recv_layout=self._recv_layout)

    # -- single process: one executor thread per rank over the in-process hub ---
    def run_local(self, vals, timeout, opts) -> tuple[dict[int, Any], LoopRecord]:
        """The loop of every rank (``vals``: the step's values before the loop; ``opts``:
        the run's ``RunOptions``); returns every loop output part and the ``LoopRecord``."""
        step = self.step
        st = self._state = _StepState(vals, opts)
        R = step.num_ranks
        hub = rt.LocalHub(R)
        transports = [hub.transport(r) for r in range(R)]
        tasks = self._tasks()
        exes = [rt.Executor(step.rank_ir(), r, transports[r], tasks, timeout=timeout,
                            record_events=opts.record)
                for r in range(R)]
        if opts.live is not None:
            opts.live.sample()
        errors = on_rank_threads(R, lambda r: exes[r].run())
        stats = [e.stats() for e in exes]
        events = [e.events() for e in exes] if opts.record else None
        del exes
        for t in transports:
            t.close()
        self._state = None  # (its exceptions would tie this step to their tracebacks)
        raise_first(errors, st.errors)
        record = LoopRecord(events, [0] * R if opts.record else None,
                            {"peak_bytes": [s["peak_live_bytes"] for s in stats],
                             "peak_buffers": [s["peak_live_buffers"] for s in stats]})
        return self._reduce_parts(st, range(len(step.parts))), record

    # -- several processes ------------------------------------------------------------
    def run_rank(self, group, router, vals, timeout, opts) -> tuple[dict[int, Any], LoopRecord]:
        """The loops of this process's ranks, one executor per rank over its transport
        (``group.rank_transports``), each on its own thread (inline for one); returns their
        loop output parts and the ``LoopRecord`` (events gathered from every process when
        recording)."""
        step = self.step
        k = step.mesh.ranks_per_process
        ranks = group.ranks(k)
        st = self._state = _StepState(vals, opts)
        if (self._group_exec is None or self._group_exec[0] is not group
                or self._group_exec[2] != opts.record):
            self._group_exec = None
            exes = [rt.Executor(step.rank_ir(), r, t, self._tasks(), timeout=timeout,
                                record_events=opts.record)
                    for r, t in zip(ranks, group.rank_transports(k, timeout))]
            errors = on_rank_threads(k, lambda j: exes[j].handshake(timeout), inline=True)
            if any(errors):
                del exes
                raise_first(errors)
            self._group_exec = (group, exes, opts.record)
            if step not in group.steps:
                group.steps.append(step)
        exes = self._group_exec[1]
        errors = [None] * step.num_ranks
        errors[ranks[0]:ranks[-1] + 1] = on_rank_threads(k, lambda j: exes[j].run(),
                                                         inline=True)
        self._state = None
        raise_first(errors, st.errors)
        mine = " ".join(f"{s['peak_live_bytes']} {s['peak_live_buffers']}"
                        for s in (e.stats() for e in exes))
        peaks = [int(x) for p in router.allgather(mine) for x in p.split()]
        events = offsets = None
        if opts.record:
            events, offsets = gather_events(group, [e.events() for e in exes], timeout)
        record = LoopRecord(events, offsets,
                            {"peak_bytes": peaks[0::2], "peak_buffers": peaks[1::2]})
        return self._reduce_parts(st, [i for i, p in enumerate(step.parts)
                                       if step.stage_rank[p.stage] in ranks]), record

    def _reduce_parts(self, st, idx):
        """Final value of each loop-output part in ``idx`` (``tasks.final_part``); the means
        not divided by their last task divided in one jitted call per stage."""
        parts = self.step.parts
        per_stage: dict[int, list[int]] = {}
        final: dict[int, Any] = {}
        for i in idx:
            part = parts[i]
            if part.reduce == G.Reduce.Mean and i in st.scaled:  # by its last task
                final[i] = st.acc[i]
            elif part.reduce == G.Reduce.Mean:
                per_stage.setdefault(part.stage, []).append(i)
            else:
                final[i] = final_part(part, st.acc.get(i), lambda i=i: _stack(st.stack[i]),
                                      self.step.M)
        for ids in per_stage.values():  # one jitted call per stage
            for i, x in zip(ids, _final_list([st.acc[i] for i in ids], float(self.step.M))):
                final[i] = x
        return final


__all__ = ["Interpreter", "OUT_GROUPS"]
