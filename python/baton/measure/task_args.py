"""Each task's arguments, derived from the plan without running the loop.

``baton.profile`` times every task's jit alone, and the memory model compiles every task
and every segment after the loop for their output layouts and XLA temporaries. Both need
what a task is handed inside a step: its arguments' shapes, dtypes and layouts on its
rank's devices, not their values. ``task_args`` derives them by dataflow over one
microbatch (every microbatch's arguments have the same layouts):

* invariant inputs: the outer value (a step argument, a literal, or a value the code before
  the loop made) in its placement on the task's rank (``CompiledStep.placement``), as both
  engines place them;
* microbatch inputs: one microbatch split over the rank's batch axes
  (``PipelineMesh.batch_sharded``);
* buffers: the layout of the task that makes them. The tasks are compiled on abstract
  arguments (``exe.fn.lower(*layouts).compile()``: ``jax.ShapeDtypeStruct``s with their
  shardings) in an order in which every buffer a task reads has been made; a buffer's
  layout is the producing task's outputs (``compiled.output_shardings``), grouped by
  ``TaskExe.split`` as the engines group them. A B the partition runs as I then W
  (``task_exes``) hands I's weight stash straight to W. A buffer from another rank
  arrives as the step's engine hands it over: the compiled engine (the default) splits it
  over the batch axes of the receiving rank's sub-mesh (``mesh.batch_spec``, as
  ``RankTransfers.specs`` lays out what crosses); the interpreter (``engine="interpreter"``)
  places it in the producer's layout on the receiver's devices (``PipelineMesh.like``), in one
  process, and replicated when it came from another process (a host array);
* running sums, for a task that adds weight gradients into them (``exe.acc_parts``) and is
  not the first task of its stage to add them (the interpreter's first call of such a task
  makes the sums; every later call adds, through ``fn_acc``): the layout of its
  weight-gradient outputs;
* ``post``: the argument layouts of each segment after the loop (the memory model's update
  phase): step arguments in their placement, values the code before the loop made in their
  compiled output layouts, the loop's outputs in the layout of the task outputs that make
  them (replicated on their home rank when several stages' parts are summed), values of
  earlier segments in those segments' compiled output layouts.

Why compile abstract layouts instead of running each task once on zeros: compiling gives
every output layout without executing a task or holding any of its buffers (the memory
model needs no arrays at all: ``arrays=False``), the programs compiled here are in JAX's
caches for the calls that follow, and zeros handed to a task stay finite (a task run on
zeros can make infinities or NaNs, e.g. a log, which its consumers would then be timed on).
With ``arrays=True`` (``baton.profile``) the layouts are materialized: invariant and
microbatch inputs from the step's own arguments (placed as the engines place them; a
placed argument is not copied), every other argument (buffers, values the code before the
loop made, running sums) as zeros in its layout. Nothing here runs the loop, or the code
before or after it.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .. import _core
from .. import _jax_compat as jc
from ..errors import ConfigError
from ..running.distributed import Remote
from ..planning.tasks import MB, BufKind, buffer_reads, kind_name, task_exes

__all__ = ["task_args"]

G = _core.graph

# buffer kinds that cross ranks (Buffers.layout has their avals)
_CROSSING = (BufKind.Act, BufKind.Grad, BufKind.Skip, BufKind.SkipGrad)


def _sds(aval, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(aval.shape), aval.dtype, sharding=sharding)


def _compile(fn, args) -> list[jax.ShapeDtypeStruct]:
    """``fn`` compiled on ``args`` (layouts): its outputs as layouts."""
    lowered = fn.lower(*args)
    comp = lowered.compile()
    shs = jax.tree.leaves(comp.output_shardings,
                          is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    return [_sds(a, sh) for a, sh in zip(jax.tree.leaves(lowered.out_info), shs)]


def _zeros(sds):
    """Zeros of ``sds`` in its sharding (typed PRNG keys: zero key data wrapped; float0:
    the numpy zeros jax takes for it)."""
    if sds.dtype == jax.dtypes.float0:
        return np.zeros(tuple(sds.shape), sds.dtype)
    w = jc.wire_aval(sds)
    return jc.from_wire(jax.device_put(np.zeros(tuple(w.shape), w.dtype), sds.sharding),
                        sds.dtype)


def _order(step) -> tuple[list, dict]:
    """The tasks the plan runs, (kind, stage) as ``Buffers.tasks_of`` names them (a
    ``TaskKind``, or ``FUSED_FB``), in first-run order; and, per task function
    (``task_exes``: a B may run as I then W), whether it is ever handed running sums: some
    task of its stage added into the same sums before one of its calls (each rank's actions
    run in order, and a stage's tasks all run on its rank)."""
    units: list = []
    sums: dict = {}
    added: set = set()
    for r in range(step.num_ranks):
        for a in range(len(step.rank_actions[r])):
            for kind, s, _ in step.buffers.tasks_of(r, a):
                if (kind, s) not in units:
                    units.append((kind, s))
                for exe in task_exes(step.tasks, kind, s):
                    key = (exe.kind, exe.stage)
                    had = bool(exe.acc_parts) and exe.acc_parts[0] in added
                    sums[key] = sums.get(key, False) or had
                    added.update(exe.acc_parts)
    return units, sums


class _Derive:
    """The dataflow of ``task_args`` (see the module docstring)."""

    def __init__(self, step, flat_args, ranks, group):
        self.step = step
        self.group = group
        self.ranks = set(range(step.num_ranks)) if ranks is None else set(ranks)
        self.vals: dict = dict(zip(step.traced.step_inputs, flat_args))
        self.made: dict = {}  # value made outside the loop -> its layout (None: elsewhere)
        self.bufs: dict = {}  # (kind, stage or edge) -> (rank, layouts)
        self.parts: dict = {}  # loop-output part -> its per-microbatch layout
        self.args: dict = {}  # (kind, stage) -> (sums or None, [(layout, source)])

    # -- values outside the loop -------------------------------------------------------
    def placement(self, v, rank):
        """The sharding value ``v`` has once placed on ``rank`` (``CompiledStep.placement``,
        for a layout as well as an array: a value a segment made is committed to its rank's
        devices)."""
        step = self.step
        x = (self.made[v] if v in self.made
             else self.vals[v] if v in self.vals else step.traced.literals[v])
        return step.placement(v, x, rank)

    def segments(self, segs, out: list | None = None) -> None:
        """The layouts of what ``segs`` make (compiled on their argument layouts); only
        those of ``self.ranks`` are compiled, the others' values marked as made elsewhere.
        ``out``: each segment's argument layouts appended."""
        step = self.step
        avals = step.traced.avals
        for seg in segs:
            rank = step.stage_rank[seg.stage]
            if rank not in self.ranks:
                for v in seg.outputs:
                    self.made.setdefault(v, None)
                continue
            args = [_sds(avals[v], self.placement(v, rank)) for v in seg.inputs]
            if out is not None:
                out.append(args)
            for v, x in zip(seg.outputs, _compile(seg.fn, args)):
                self.made[v] = x

    # -- a task's arguments --------------------------------------------------------------
    def inputs(self, exe, rank) -> list:
        """(layout, source) of a task's invariant and microbatch inputs: source ``("inv",
        v)`` / ``("mb", v)`` where the step's arguments give the value, else None (zeros)."""
        step = self.step
        avals = step.traced.avals
        out = []
        for v in exe.in_groups[0]:
            o = step.loop_src[v][0]
            real = o not in self.made and not isinstance(self.vals.get(o), Remote)
            out.append((_sds(avals[v], self.placement(o, rank)), ("inv", o) if real else None))
        for v in exe.in_groups[1]:
            o = step.loop_src[v][0]
            real = o not in self.made and not isinstance(self.vals.get(o), Remote)
            sh = step.mesh.batch_sharded(rank, tuple(avals[v].shape))
            out.append((_sds(avals[v], sh), ("mb", o) if real else None))
        return out

    def received(self, rank, x, local: bool):
        """The sharding on ``rank`` of a buffer's array ``x`` made on another rank (see the
        module docstring); ``local``: its producer is in this process."""
        mesh = self.step.mesh
        if self.step.engine_name == "compiled":
            return mesh.batch_sharded(rank, tuple(x.shape))
        return mesh.like(rank, x) if local else mesh.replicated(rank)

    def buffer(self, key, rank, producer) -> list | None:
        """The layouts of buffer ``key`` (kind, stage or edge) as a task on ``rank`` reads
        it; None while it is not known yet."""
        if key in self.bufs:
            at, xs = self.bufs[key]
            if at == rank:
                return xs
            return [_sds(x, self.received(rank, x, self.group is None)) for x in xs]
        if producer.get(key, rank) in self.ranks or key[0] not in _CROSSING:
            return None
        # made by another process's rank: its avals, as received
        return [_sds(a, self.received(rank, a, False))
                for a in self.step.buffers.layout(*key)]

    def task(self, kind, s, producer, sums) -> bool:
        """Compiles task (kind, s) (a B: I then W where the partition split it) on its
        arguments' layouts and records them and the buffers it makes; False while a buffer
        it reads is not known yet."""
        step = self.step
        rank = step.stage_rank[s]
        exes = task_exes(step.tasks, kind, s)
        exe = exes[0]
        args = self.inputs(exe, rank)
        for bk, bs, _ in buffer_reads(exe, step.buffers.reads(kind, s, 0)):
            xs = self.buffer((bk, bs), rank, producer)
            if xs is None:
                return False
            args += [(x, None) for x in xs]
        got = exe.split(self.call(exe, args, sums))
        self.keep_parts(exe, got)
        if len(exes) == 2:  # B as I then W: I's weight stash goes straight to W
            we = exes[1]
            wargs = self.inputs(we, rank) + [(x, None) for x in got[BufKind.WStash]]
            wgot = we.split(self.call(we, wargs, sums))
            self.keep_parts(we, wgot)
            got[BufKind.WGrad] = wgot[BufKind.WGrad]
        for key, value in step.buffers.outputs(kind, s, 0, got):
            self.bufs.setdefault(key[:2], (rank, value))
        return True

    def call(self, exe, args, sums) -> list:
        """Compiles one task function on ``args`` ((layout, source) pairs), records them (and
        its running sums' layouts where it is handed some: those of its summed outputs), and
        returns its outputs' layouts."""
        outs = _compile(exe.fn, [x for x, _ in args])
        acc = None
        if sums.get((exe.kind, exe.stage)):
            acc = [outs[j] for j in exe.acc_pos]
        self.args.setdefault((exe.kind, exe.stage), (acc, args))
        return outs

    def keep_parts(self, exe, got) -> None:
        """The layouts of the loop-output parts a task's outputs (by group) make."""
        for g, idx in ((BufKind.WGrad, exe.body[0]), (MB, exe.body[1])):
            for i, x in zip(idx, got.get(g, ())):
                self.parts.setdefault(i, x)

    def loop(self, units, sums) -> None:
        """Every task of ``self.ranks`` in an order in which the buffers it reads are
        known."""
        step = self.step
        producer: dict = {}
        for kind, s in units:
            for bk, bs, _ in step.buffers.writes(kind, s, 0):
                producer.setdefault((bk, bs), step.stage_rank[s])
        todo = [u for u in units if step.stage_rank[u[1]] in self.ranks]
        while todo:
            left = [u for u in todo if not self.task(*u, producer, sums)]
            if len(left) == len(todo):
                raise ConfigError(
                    "internal: the buffers tasks "
                    + ", ".join(f"{kind_name(k)}{s}" for k, s in left)
                    + " read are made by no task the plan runs")
            todo = left

    # -- the loop's outputs -------------------------------------------------------------
    def outputs(self) -> None:
        """The layouts of the loop's combined outputs (``CompiledStep.combine``)."""
        step = self.step
        avals = step.traced.avals
        for outer, idx in step.by_outer.items():
            home = step.home(idx)
            if len(idx) > 1:
                self.made[outer] = _sds(avals[outer], step.mesh.replicated(home))
                continue
            x = self.parts[idx[0]]
            sh = x.sharding
            if step.parts[idx[0]].reduce == G.Reduce.Stack:  # the microbatches' values stacked
                spec = getattr(sh, "spec", None)
                sh = (jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(None, *spec))
                      if spec is not None else step.mesh.replicated(home))
            self.made[outer] = _sds(avals[outer], sh)

    # -- arrays ----------------------------------------------------------------------
    def arrays(self) -> dict:
        """The arguments as arrays (see the module docstring); one array per distinct input
        value or layout of zeros."""
        step = self.step
        cache: dict = {}

        def make(x, src, rank):
            key = (src, rank) if src is not None else ("zeros", tuple(x.shape), str(x.dtype),
                                                       x.sharding)
            got = cache.get(key)
            if got is None:
                if src is None:
                    got = _zeros(x)
                else:
                    o = src[1]
                    y = self.vals[o] if o in self.vals else step.traced.literals[o]
                    if src[0] == "inv":
                        got = step.place([o], [y], rank)[0]
                    else:  # the first microbatch, split over the batch axes
                        got = step.put(y[: np.shape(y)[0] // step.M], rank, batch=True)
                cache[key] = got
            return got

        out = {}
        for (kind, s), (acc, args) in self.args.items():
            rank = step.stage_rank[s]
            out[(kind, s)] = (None if acc is None else [make(x, None, rank) for x in acc],
                              [make(x, src, rank) for x, src in args])
        return out


def task_args(step, flat_args: list[Any], ranks=None, group: Any = None,
              post: list | None = None, arrays: bool = True) -> dict:
    """Each task's arguments on the step's arguments ``flat_args``: (kind, stage) -> (running
    sums or None, arguments), for the tasks of ``ranks`` (default: every rank); layouts
    (``jax.ShapeDtypeStruct``s with shardings), or arrays with ``arrays`` (see the module
    docstring). ``group``: the process group the step runs in (a buffer from another
    process's rank then arrives as a host array). ``post`` (a list; every rank): each
    segment after the loop's argument layouts are appended."""
    if post is not None and ranks is not None:
        raise ConfigError("task_args: the segments after the loop need every rank's tasks")
    d = _Derive(step, flat_args, ranks, group)
    units, sums = _order(step)
    with jc.without_mesh_context():
        d.segments(step.pre_segments)
        d.loop(units, sums)
        if post is not None:
            d.outputs()
            d.segments(step.post_segments, post)
        if not arrays:
            return {k: (acc, [x for x, _ in args]) for k, (acc, args) in d.args.items()}
        return d.arrays()


def capture(step, flat_args: list[Any], group: Any = None, post: list | None = None,
            arrays: bool = True) -> dict:
    """Each task's first arguments of ``step`` (a ``CompiledStep``), (kind, stage) ->
    (running sums or None, args), as the loop hands them (``baton.profile`` times each task
    alone on them; the memory model compiles each on their layouts), derived from the plan
    without running anything: layouts, or arrays with ``arrays``. ``group``: this process's
    ranks' tasks only. ``post`` (a list): each segment after the loop's argument layouts are
    appended."""
    if group is not None and step.mesh.spans:
        raise ConfigError(
            "baton.profile: each task is timed alone on the ranks of one process each; "
            "ranks that span processes cannot be (measure them with baton.trace)")
    ranks = None if group is None else step.mesh.ranks_of(group.rank)
    return task_args(step, flat_args, ranks, group, post, arrays)
