"""``CompiledStep``: one traced training step (one set of shapes) made runnable.

It holds the C++ partition and plan, the task functions (``tasks.build_tasks``), the code
before and after the loop as per-stage segments (``segments.Segments``), the plan's buffer
facts (``buffers.Buffers``), and two engines that run the loop:

* ``engine`` (``engine.ProgramEngine``, the default): each rank's loop as one XLA program
  whose transfers are FFI calls into the C++ transports (``rank_program.py``);
* ``interpreter`` (``interpreter.Interpreter``, the reference engine): the C++ executor
  calling the jitted tasks; it runs only when chosen with ``engine="interpreter"`` (a
  debugging engine).

Which one runs is ``engine_name``, and how the compiled engine lowers its ranks' loops is
``loop_form``: both declared at construction and read-only.

Each task's arguments (for ``baton.profile``'s isolated timings and the memory model) are
derived from the plan without running either engine (``measure/task_args.py``, ``capture``).

Every call runs the step's own engine; what a call measures or records is an explicit
``RunOptions`` (``run_options.py``), never a flag on the step, and what it produced comes
back as a ``StepRun`` (``step_run.py``: outputs, events, clock offsets, engine stats).

``run`` does the code outside the loop, hands the loop to an engine, and combines the loop's
outputs: in one process for every rank, or (``group``) for this process's ranks, moving the
values that cross ranks outside the loop with a ``distributed.Router``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .. import _core
from .. import _jax_compat as jc
from ..emit.rank_program import check_loop_form
from ..errors import ConfigError
from ..mesh import PipelineMesh
from ..planning import step_costs
from ..planning.buffers import Buffers
from ..planning.offload import check_lowered
from ..planning.plan import Plan
from ..planning.segments import Segments
from ..planning.tasks import build_tasks, combine_parts
from ..tracing.retarget import on_rank
from ..tracing.trace import Traced
from . import engine as engine_mod
from . import step_group
from .around_loop import Route, run_around
from .engine import ProgramEngine
from .interpreter import Interpreter
from .run_options import PLAIN, PostSegment, RunOptions
from .step_run import StepRun

G = _core.graph

# the engines a step can run on: its compiled programs, or the C++ interpreter (debugging)
ENGINES = ("compiled", "interpreter")


def check_engine(engine: Any) -> str:
    """``engine`` if it names an engine (``ENGINES``), else ``ConfigError`` naming it."""
    if not isinstance(engine, str) or engine not in ENGINES:
        raise ConfigError(f"baton.jit: engine must be one of {', '.join(map(repr, ENGINES))} "
                          f"(got {engine!r})")
    return engine


def _placed(x, sh) -> bool:
    """``x`` is a jax.Array committed to ``sh`` already (device_put would be a no-op). An
    uncommitted array (``jnp.asarray`` of the first call's parameters) is moved, i.e.
    committed, even on the right device: jit caches key on committedness, so passing it
    as is would compile every program again on the second call, whose inputs (the first
    call's outputs) are committed."""
    return isinstance(x, jax.Array) and getattr(x, "committed", True) and (
        x.sharding is sh or x.sharding.is_equivalent_to(sh, x.ndim))


def _movable(x, sh):
    """``x`` as ``jax.device_put`` can move it to ``sh``: an array held by this process alone
    goes through host memory to a sharding over several processes' devices (a rank spanning
    processes: every process of the rank gives the same value, each places its shards)."""
    if (isinstance(x, jax.Array) and x.is_fully_addressable
            and not sh.is_fully_addressable):
        return np.asarray(x)
    return x


class CompiledStep:
    def __init__(self, traced: Traced, schedule: Any, mesh: PipelineMesh,
                 split_backward: bool, remat: bool = True, engine: str = "compiled",
                 loop_form: str = "auto",
                 transport: str = "local", in_specs: list | None = None,
                 donated: frozenset = frozenset(), share_programs: bool = True,
                 offload: list | None = None, fuse_forward_backward: bool = False):
        """``schedule``: the step's ``_core.Schedule``. Its plan is built here, once: the
        partition's skip edges known, ``_core.build_step`` fuses F+B (when asked), lowers,
        verifies (``VerifyError`` with the report) and builds the rank programs. ``engine``:
        ``"compiled"`` or ``"interpreter"`` (``ENGINES``); ``loop_form``: how the compiled
        engine lowers a rank's loop (``"auto"``, ``"table"`` or ``"rolled"``;
        ``rank_program.loop_form``); ``share_programs``: ranks doing the same work run one
        shared program (``emit/shared.py``)."""
        self._engine_name = check_engine(engine)
        self._loop_form = check_loop_form(loop_form)
        self.traced = traced
        self.runs = 0  # calls completed (the first one builds the programs: gc_hold.py)
        # step inputs the caller gives up (baton.jit(donate_argnums=...)): the optimizer
        # update after the loop writes the new values into their buffers
        self.donated = frozenset(donated)
        self.mesh = mesh
        # The partition comes first: its skip edges (values between stages that are not
        # neighbours) are part of the plan. It needs only whether the backward is split,
        # which F+B fusion does not change.
        self.partition = G.partition(traced.program, split_backward, remat)
        self.num_stages = schedule.num_stages
        self.num_ranks = schedule.num_ranks
        self.M = schedule.num_microbatches
        # per stage, what it offloads to host memory (_core.Offload; empty: nothing)
        self.offload = list(offload or [])
        check_lowered(self)  # (an offload the programs do not lower: refused by name first)
        # lower -> verify -> rank IR, each once (docs/ARCHITECTURE.md, "The plan")
        self.step_build = _core.build_step(schedule, list(self.partition.skips),
                                      fuse_forward_backward=bool(fuse_forward_backward),
                                      offload=self.offload)
        core = self.step_build.plan
        self._rank_ir = self.step_build.rank_ir
        # baton.Plan (python wrapper) asking the build's report and, without offloads, its
        # rank programs
        self.plan = Plan(core, self.step_build.report, None if self.offload else self._rank_ir)
        self.core_plan = core
        sched = core.schedule
        self.stage_rank = list(sched.stage_rank)
        # A readable, immutable copy of the per-rank programs the executor runs: (opcode as
        # _core.OpCode, action, buffer, peer) per instruction.
        self.programs = tuple(tuple((i.op, i.action, i.buffer, i.peer) for i in prog)
                              for prog in core.programs)
        self.parts = list(self.partition.parts)
        fixes = {r: on_rank(mesh, r) for r in set(self.stage_rank)}
        fix_of = (lambda s: fixes[self.stage_rank[s]])  # noqa: E731
        self.tasks = build_tasks(traced, self.partition, self.parts, self.num_stages, fix_of)
        self.buffers = Buffers(core, traced, self.partition, self.tasks)
        self.rank_actions = self.buffers.rank_actions
        self.op_stage = list(self.partition.op_stage)
        segs = Segments(traced, self.op_stage, self.num_stages, fix_of, self.donated)
        self.pre_segments, self.post_segments = segs.pre, segs.post
        # step input value -> its PartitionSpec on the ranks' sub-meshes (the user's
        # shardings: baton.jit(param_shardings=...) or the input arrays' own); every other
        # value is replicated when it has to be moved
        self.in_specs = {v: sp for v, sp in zip(traced.step_inputs, in_specs or ())
                         if sp is not None}
        # loop input value -> (the outer value it reads, per microbatch?)
        self.loop_src = {b: (o, mb) for b, o, mb in traced.loop_inputs}
        # outer value -> the loop-output parts summed into it
        self.by_outer: dict[int, list[int]] = {}
        for i, part in enumerate(self.parts):
            self.by_outer.setdefault(part.outer, []).append(i)
        # Loop inputs (outer values) each rank's tasks read; outputs every process receives
        # in multi-process mode (per-microbatch outputs: the loss, aux values).
        self.loop_needs: list[list[int]] = []
        for r in range(self.num_ranks):
            need = set()
            for (kind, s), exe in self.tasks.items():
                if self.stage_rank[s] == r:
                    need.update(self.loop_src[v][0] for v in exe.in_groups[0] + exe.in_groups[1])
            self.loop_needs.append(sorted(need))
        self._broadcast = {self.parts[i].outer for t in self.partition.tasks for i in t.mb_out}
        # the last baton.profile's costs (measure/profile.py); the simulator uses them when
        # set (planning/step_costs.cost_model_of); set through use_profile
        self.profiled = None
        # the loop's transport: "local" (one process), "gloo" (CPU processes), "nccl" (GPUs)
        self.transport = transport
        self.engine = ProgramEngine(self, share=bool(share_programs))
        self.interpreter = Interpreter(self)

    # -- declared options ----------------------------------------------------------------------
    @property
    def engine_name(self) -> str:
        """The engine every call runs: ``"compiled"`` or ``"interpreter"``."""
        return self._engine_name

    @property
    def loop_form(self) -> str:
        """How the compiled engine lowers a rank's loop: ``"auto"`` (per platform),
        ``"table"`` or ``"rolled"`` (``rank_program.loop_form``)."""
        return self._loop_form

    def use_profile(self, prof: Any) -> None:
        """Makes ``prof`` (a ``baton.profile`` result, or None for the traced flop costs)
        the costs ``simulate()`` and ``summary()`` use (``profiled``)."""
        self.profiled = prof

    # -- what runs ---------------------------------------------------------------------------
    def rank_ir(self, pool_of: list[int] | None = None) -> Any:
        """The rank programs of this step's plan (``_core.RankIR``, built and verified in
        C++; docs/RANK_IR.md); ``pool_of``: a pool label per plan row (rows of one label
        share slots; ``rings.ring_layout``)."""
        if not pool_of:  # the step's own, built with its plan (_core.build_step)
            return self._rank_ir
        key = tuple(pool_of)
        irs = self.__dict__.setdefault("_pooled_irs", {})
        if key not in irs:  # the slot pass again on those programs, with the pools
            irs[key] = _core.with_pools(self._rank_ir, list(key))
        return irs[key]

    def rank_programs(self) -> list:
        """Each rank's program (``_core.RankProgram``), rank by rank."""
        return list(self.rank_ir().programs)

    # -- placement --------------------------------------------------------------------------
    def put(self, x, rank, batch=False):
        if batch:
            sh = self.mesh.batch_sharded(rank, np.shape(x))
        else:
            sh = self.mesh.replicated(rank)
        return x if _placed(x, sh) else jax.device_put(_movable(x, sh), sh)

    def sharding(self, v, rank):
        """Where value ``v`` lives on ``rank`` when it has to be moved there: its user spec
        (a step input), else replicated."""
        sp = self.in_specs.get(v)
        return self.mesh.sharding(rank, sp) if sp is not None else self.mesh.replicated(rank)

    def placement(self, v, x, rank):
        """The sharding value ``v`` (array ``x``, or its layout: a ``jax.ShapeDtypeStruct``
        with a sharding, ``task_args``) has once placed on ``rank`` (``place``): a step input
        with a spec in that sharding; any other value already on the rank's devices as XLA
        laid it out (a sharded gradient stays sharded for the optimizer); the rest
        replicated."""
        sh = self.sharding(v, rank)
        if v in self.in_specs or _placed(x, sh):
            return sh
        held = (x.sharding if isinstance(x, jax.Array) and getattr(x, "committed", True)
                else getattr(x, "sharding", None) if isinstance(x, jax.ShapeDtypeStruct)
                else None)
        if held is not None and held.device_set == set(self.mesh.meshes[rank].devices.flat):
            return held
        return sh

    def place(self, vs, xs, rank):
        """Values ``xs`` (ids ``vs``) on ``rank``, each in its ``placement``. Arrays already
        in place cost nothing (``device_put`` has a per-array cost even then,
        bench/results/code_notes.md); the rest moves in one batched ``device_put``."""
        out = list(xs)
        move, to = [], []
        for i, (v, x) in enumerate(zip(vs, out)):
            sh = self.placement(v, x, rank)
            if _placed(x, sh):
                continue
            move.append(i)
            to.append(sh)
        if move:
            for i, y in zip(move, jax.device_put([_movable(out[i], sh) for i, sh in
                                                  zip(move, to)], to)):
                out[i] = y
        return out

    def _run_segments(self, segs, vals, free: bool = False, shared=None, opts=PLAIN,
                       route=None):
        """Runs ``segs`` in order on ``vals``. ``route`` (``around_loop.Route``): brings each
        segment's inputs to its rank's processes, which alone run it (None: all here).
        ``free`` (the segments after the loop): a value
        the step does not return leaves ``vals`` after the last segment that reads it (or at
        once if none does), so a stage's summed gradients go once its update ran, not at the
        end of the step. With ``opts.live``, the live arrays are sampled once a
        segment's outputs exist (its inputs still held; its XLA temporaries are
        ``PostSegment(j)`` in the sampler's table). ``shared`` (``shared.SharedSegments``): the
        segments that run as one program for several ranks, at the first one's index."""
        last: dict = {}
        if free:
            keep = set(self.traced.step_outputs)
            for j, seg in enumerate(segs):
                for v in seg.inputs:
                    if v not in keep:
                        last[v] = j
            for v in [v for v in vals if v not in keep and v not in last]:
                del vals[v]  # values only the loop read (what the segments before it made)
        for j, seg in enumerate(segs):
            if shared is not None and j in shared.starts:  # (the group's segments, at once)
                shared.starts[j][1](vals)
            elif (shared is None or j not in shared.skip) and (
                    route is None or route.ready(seg, vals)):
                rank = self.stage_rank[seg.stage]
                args = self.place(seg.inputs, [vals[v] for v in seg.inputs], rank)
                outs = seg.fn(*args)
                del args
                for v, x in zip(seg.outputs, outs):
                    vals[v] = x
                if opts.live is not None and free:
                    jax.block_until_ready(outs)
                    opts.live.sample(rank, PostSegment(j))
                del outs
            if route is not None:
                route.ran(seg)
            for v in seg.inputs:
                if last.get(v) == j:
                    vals.pop(v, None)

    # -- the loop's outputs --------------------------------------------------------------------
    def home(self, idx):
        """The rank that holds a loop output made of parts ``idx`` (its smallest stage)."""
        return self.stage_rank[self.parts[min(idx, key=lambda i: self.parts[i].stage)].stage]

    def combine(self, idx, final):
        """The outer value made of parts ``idx`` (their sum, on its home rank)."""
        home = self.mesh.replicated(self.home(idx))
        return combine_parts([final[i] for i in idx], lambda x: jax.device_put(x, home))

    # -- one step ------------------------------------------------------------------------------
    def engine_refusal(self, rank: int, transport_kind: str | None = None) -> str | None:
        """Why the compiled engine cannot run ``rank`` of this step, or None."""
        return engine_mod.refusal(self, rank, transport_kind)

    def run(self, flat_args: list[Any], group: Any = None, timeout: float = 120.0,
            opts: RunOptions = PLAIN) -> StepRun:
        """One step; returns its ``StepRun`` (the flat outputs, and what the engine recorded:
        events and clock offsets when ``opts.record``, the engine's stats). ``group`` None:
        every rank in this process; a :class:`~baton.running.distributed.ProcessGroup`: this
        process's ranks only, over its transports (see ``_run_group``). The step's engine
        (``engine_name``) runs it: the compiled programs, or the interpreter; ``opts``
        (``RunOptions``: tracing, memory sampling) never changes which.

        Runs outside the caller's mesh context (``jax.set_mesh``): the traced equations
        carry it, moved onto each rank's sub-mesh (``retarget``), and Baton's own programs
        place their values on the ranks' devices themselves."""
        with jc.without_mesh_context():
            outs, record = self._run(flat_args, group, timeout, opts,
                                     self._engine_name == "interpreter")
        return StepRun.of(outs, record)

    def _run(self, flat_args, group, timeout, opts, interp):
        """(the flat outputs, the loop's ``LoopRecord``)."""
        if group is not None:
            return self._run_group(flat_args, group, timeout, opts, interp)
        if not interp and self.num_ranks == 1:
            return self.engine.run_single(flat_args, opts)
        runner = self.interpreter if interp else self.engine
        shared = None
        if not interp and opts.live is None:
            shared = self.engine.post_groups
        return run_around(self, flat_args, lambda vals: runner.run_local(vals, timeout, opts),
                          Route(self), opts, shared=shared)

    # -- several processes ------------------------------------------------------------
    def _run_group(self, flat_args, group, timeout, opts, interp):
        """This process's ranks of the step (``step_group.run_group``): (the flat outputs,
        the loop's ``LoopRecord``)."""
        return step_group.run_group(self, flat_args, group, timeout, opts, interp)

    # -- planning data (step_costs.py) ----------------------------------------------
    def skip_costs(self) -> list:
        """Bytes per microbatch of each skip edge's transfers (``_core.SkipCost``)."""
        return step_costs.skip_costs(self)

    def stage_costs(self) -> list[dict]:
        """Each stage's traced task costs (flops) and buffer bytes."""
        return step_costs.stage_costs(self)
