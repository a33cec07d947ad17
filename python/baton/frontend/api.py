"""``baton.jit``: pipeline a training step over a ``PipelineMesh``."""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Callable

import jax

from .. import runtime as rt
from .. import schedules as S
from ..auto_schedule import Auto
from ..errors import ConfigError, TraceError
from ..measure import task_args
from ..measure.traces import buffer_bytes, build_trace
from ..mesh import PipelineMesh
from ..planning.offload import offload_option, stage_offloads
from ..planning.plan import _build_schedule as build_schedule
from ..planning.step_costs import cost_model_of
from ..running.distributed import (Remote, Router, agree_ranks_per_process,
                                   agree_spanning_mesh, gather, launched_world_size,
                                   local_devices, process_group, process_mesh,
                                   ranks_per_process)
from ..running.gc_hold import held
from ..running.handshake import agree_program, describe, error_text
from ..running.run_options import RunOptions
from ..emit.rank_program import check_loop_form
from ..running.step import CompiledStep, check_engine
from ..running.step_run import StepRun
from ..tracing.retarget import check_axis_types
from ..tracing.trace import trace_step
from .arguments import donated_inputs, input_specs, leaf_key
from .checks import check_backward, check_leaves, stages_hint
from .inspection import StepInspection


def _layout_options(layout, boundaries, microbatch_size, schedule):
    """``baton.jit``'s ``layout`` and ``microbatch_size``, checked (``baton.Layout``)."""
    from ..layout import Layout
    if layout is not None:
        if not isinstance(layout, Layout):
            raise ConfigError(f"baton.jit: layout must be a baton.Layout (got "
                              f"{type(layout).__name__}: {layout!r:.80})")
        if boundaries is not None:
            raise ConfigError("baton.jit: give layout= or boundaries=, not both (a layout "
                              "chooses the boundaries)")
        if isinstance(schedule, Auto):
            raise ConfigError("baton.jit: schedule=baton.Auto(...) chooses the cuts itself; "
                              "it takes no layout=")
    if microbatch_size is not None:
        if (isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int)
                or microbatch_size < 1):
            raise ConfigError(f"baton.jit: microbatch_size must be a positive integer "
                              f"(got {microbatch_size!r})")
        if isinstance(schedule, Auto):
            raise ConfigError("baton.jit: schedule=baton.Auto(...) chooses the microbatches "
                              "itself; it takes no microbatch_size=")
    return layout, microbatch_size


def _engine_option(engine, single_program) -> str:
    """``baton.jit``'s ``engine``, or the engine the deprecated ``single_program`` names
    (``True``: ``"compiled"``, ``False``: ``"interpreter"``; with a ``DeprecationWarning``);
    ``"compiled"`` when neither is given."""
    if single_program is None:
        return check_engine("compiled" if engine is None else engine)
    if engine is not None:
        raise ConfigError(f"baton.jit: give engine={engine!r} or the deprecated "
                          f"single_program={single_program!r}, not both")
    if not isinstance(single_program, bool):
        raise ConfigError(f"baton.jit: single_program must be True or False "
                          f"(got {single_program!r}); it is deprecated: use engine='compiled' "
                          f"or engine='interpreter'")
    name = "compiled" if single_program else "interpreter"
    warnings.warn(f"baton.jit: single_program={single_program} is deprecated; use "
                  f"engine={name!r}", DeprecationWarning, stacklevel=3)
    return name


def _schedule_spec(schedule: Any):
    if isinstance(schedule, str):
        return S.schedule_from_name(schedule)
    if isinstance(schedule, type) and issubclass(schedule, S.ScheduleSpec):
        raise ConfigError(f"baton.jit: schedule={schedule.__name__} is the class; pass an "
                          f"instance: schedule=baton.{schedule.__name__}()")
    if not isinstance(schedule, S.ScheduleSpec):
        raise ConfigError(f"baton.jit: schedule must be a schedule name, a baton schedule "
                          f"(e.g. baton.OneFOneB()) or baton.Auto(...) "
                          f"(got {type(schedule).__name__}: {schedule!r:.80})")
    return schedule


class PipelinedFunction(StepInspection):
    """The result of ``baton.jit``. Call it like the step; inspect ``.plan``, ``.summary()``."""

    def __init__(self, fn: Callable, mesh: Any, schedule: Any, microbatches: int,
                 transport: str | None = None, timeout: float = 120.0, trace: bool = False,
                 remat: bool = True, fuse_forward_backward: bool = True,
                 retain_host_memory: bool = True, engine: str = "compiled",
                 param_shardings: Any = None, boundaries: Any = None,
                 donate_argnums: Any = (), share_programs: bool = True, hold_gc: bool = True,
                 layout: Any = None, microbatch_size: int | None = None,
                 offload: Any = None, loop_form: str = "auto"):
        self.param_shardings = param_shardings
        self.offload = offload_option(offload)
        self.layout, self.microbatch_size = _layout_options(layout, boundaries, microbatch_size,
                                                            schedule)
        self.hold_gc = bool(hold_gc)
        nums = (donate_argnums,) if isinstance(donate_argnums, int) else donate_argnums
        try:
            nums = tuple(nums)
        except TypeError:
            nums = (nums,)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in nums):
            raise ConfigError(f"baton.jit: donate_argnums must be non-negative argument "
                              f"indices (got {donate_argnums!r})")
        self.donate_argnums = tuple(sorted(set(nums)))
        self.boundaries = None if boundaries is None else [int(b) for b in boundaries]
        if transport not in (None, "local", "gloo", "nccl"):
            raise ConfigError(
                f"baton.jit: transport must be None (automatic), 'local', 'gloo' or 'nccl' "
                f"(got {transport!r})")
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ConfigError(
                f"baton.jit: microbatches must be a positive integer (got {microbatches!r})"
            )
        # Multi-process mode: this process runs k ranks (launched with several processes, or
        # transport="gloo"); its group's Gloo transport carries what crosses processes
        # outside the loop. The loop's transport: NCCL between GPUs, else Gloo across processes and
        # the in-process transport in one process.
        self.multi = transport == "gloo" or (transport != "local" and launched_world_size() > 1)
        self.transport = transport  # None: chosen from the devices (loop_transport)
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not timeout > 0):
            raise ConfigError(f"baton.jit: timeout must be a positive number of seconds "
                              f"(got {timeout!r})")
        self.timeout = float(timeout)
        self.group = None  # ProcessGroup, connected at the first call (multi-process mode)
        if not self.multi:
            if mesh is None:
                raise ConfigError("baton.jit: pass mesh=baton.PipelineMesh(devices, ranks=R)")
            if not isinstance(mesh, PipelineMesh):
                mesh = PipelineMesh(mesh)
        else:
            mesh = local_devices(mesh)  # this process's ranks; made a mesh at the first call
        self.fn = fn
        self.mesh = mesh
        self.auto = schedule if isinstance(schedule, Auto) else None
        if self.auto is not None and self.multi:
            raise ConfigError(
                "baton.jit: schedule=baton.Auto(...) plans in one process; with several "
                "processes, plan with baton.autoplan in one process and pin the chosen "
                "schedule, microbatches, remat and boundaries (Candidate.jit_kwargs())")
        self.spec = None if self.auto is not None else _schedule_spec(schedule)
        self.microbatches = microbatches
        self.remat = bool(remat)
        self.fuse_fb = bool(fuse_forward_backward)
        self.retain_host_memory = bool(retain_host_memory)
        self.engine_name = check_engine(engine)  # the engine every call runs (CompiledStep)
        self.loop_form = check_loop_form(loop_form)  # how its rank loops are lowered
        if not isinstance(share_programs, bool):
            raise ConfigError(f"baton.jit: share_programs must be True or False "
                              f"(got {share_programs!r})")
        self.share_programs = share_programs
        self._cache: dict[Any, CompiledStep] = {}
        self._tree = None
        self.last: CompiledStep | None = None
        # the last call's record (events, clock offsets, engine stats; its outputs dropped)
        self.last_run: StepRun | None = None
        self.memory_models: dict[CompiledStep, Any] = {}  # step -> its last memory()
        self.trace = bool(trace)  # record a Trace of every call (tracing.py)
        self.last_trace = None
        functools.update_wrapper(self, fn)

    def _key(self, flat, tree):
        return (tree, tuple(map(leaf_key, flat)))

    def loop_transport(self) -> str:
        """The transport of the loop's transfers: ``transport=`` when given, else ``"nccl"``
        when the ranks run on GPUs, ``"gloo"`` across CPU processes, ``"local"`` in one
        process."""
        if self.transport is not None:
            return self.transport
        devs = (self.mesh.rank_devices[0] if isinstance(self.mesh, PipelineMesh)
                else list(self.mesh))
        if devs and all(d.platform in ("gpu", "cuda") for d in devs):
            return "nccl"
        return "gloo" if self.multi else "local"

    def _check_nccl(self) -> None:
        """transport='nccl' on CPU ranks: named before tracing (the engine would only find
        it when the step first runs)."""
        if self.transport != "nccl" or not isinstance(self.mesh, PipelineMesh):
            return
        for r, devs in enumerate(self.mesh.rank_devices):
            if any(d.platform == "cpu" for d in devs):
                raise ConfigError(
                    f"baton.jit: rank {r} runs on CPU, whose transfers go over the 'local' (one "
                    f"process) or 'gloo' (several) transports, not 'nccl'")

    def _connect(self):
        if self.multi and self.group is None:
            group = process_group("gloo")
            if isinstance(self.mesh, PipelineMesh) and any(
                    d.process_index != jax.process_index()
                    for g in self.mesh.rank_devices for d in g):
                agree_spanning_mesh(group, self.mesh, self.timeout)
            else:
                agree_ranks_per_process(group, ranks_per_process(self.mesh), self.timeout)
            self.mesh = process_mesh(self.mesh, group.world_size)
            self.group = group
        return self.group

    def _ranks_note(self) -> str:
        """How the ranks came about, with several processes."""
        g = self.group
        if g is None or not isinstance(self.mesh, PipelineMesh):
            return ""
        k = self.mesh.ranks_per_process or 1
        return (f" ({g.world_size} launched processes x {k} rank{'s' * (k > 1)} each; "
                f"the launcher's world size sets the rank count)")

    def compile(self, *args) -> CompiledStep:
        self._connect()
        flat, tree = jax.tree.flatten(args)
        check_leaves(flat, args)
        if self._tree is not None and tree != self._tree:
            raise TraceError(
                f"baton.jit: the structure of the arguments changed between calls "
                f"(was {self._tree}, now {tree}); a pipelined step keeps one pytree structure"
            )
        key = self._key(flat, tree)
        step = self._cache.get(key)
        if step is None:
            with held(self.hold_gc):
                step = self._build_agreed(args)
            self._cache[key] = step
            self._tree = tree
        self.last = step
        return step

    def _build_agreed(self, args) -> CompiledStep:
        """``_build``; with several processes, then the handshake over the whole program
        (``handshake.agree_program``): every process takes part, a process whose build
        failed with its error, so the others stop naming it instead of waiting for it."""
        if not self.multi:
            return self._build(args)
        try:
            step = self._build(args)
        except Exception as e:  # (re-raised below, after the others learned of it)
            router = Router(self.group, self.timeout)
            try:
                agree_program(router, None, error_text(e))
            except ConfigError:
                pass  # (this process's own error is the one to raise here)
            finally:
                router.finish()
            raise e
        router = Router(self.group, self.timeout)
        try:
            agree_program(router, describe(self, step))
        finally:
            router.finish()
        return step

    def _build(self, args) -> CompiledStep:
        # Remote placeholders (multi-process mode) trace as their shape and dtype.
        args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
                            if isinstance(x, Remote) else x, args)
        # (a bad sharding is named before tracing)
        in_specs = input_specs(self.mesh, self.param_shardings, args)
        check_axis_types(self.mesh)  # (explicit sharding mode: refused by name)
        self._check_nccl()
        if self.auto is not None and self.spec is None:  # plan once, at the first call
            # a donating step's update writes in place (the planner's update term)
            best = self.auto.plan(self.fn, args, self.mesh.num_ranks,
                                  update_in_place=bool(self.donate_argnums), mesh=self.mesh)
            kw = best.jit_kwargs()
            self.spec, self.microbatches = kw["schedule"], kw["microbatches"]
            self.remat, self.boundaries = kw["remat"], kw["boundaries"]
            if self.offload is None:  # an offload the caller forces stays
                self.offload = offload_option(kw["offload"])
        ranks = self.mesh.num_ranks
        want = self.spec.stages(ranks)
        bounds = self.boundaries
        if self.layout is not None:  # the layout picks the marks that end `want` stages
            bounds = functools.partial(self.layout.boundaries, stages=want)
        traced = trace_step(self.fn, args, self.microbatches, bounds, self.microbatch_size)
        if self.microbatch_size is not None:  # the count of this batch size
            self.microbatches = traced.microbatches
        check_backward(traced)
        if traced.num_stages == 1 and want != 1:
            raise TraceError(
                f"the model has no stage_boundary (one stage) but schedule "
                f"{type(self.spec).__name__} on {ranks} ranks needs {want} stages: mark where "
                f"each stage ends with baton.stage_boundary(x) ({want - 1} boundaries "
                f"inside baton.accumulate)"
            )
        if traced.num_stages != want:
            raise TraceError(
                f"the model has {traced.num_stages} stages ({traced.num_stages - 1} "
                f"stage_boundary calls) but schedule {type(self.spec).__name__} on {ranks} ranks"
                f"{self._ranks_note()} needs {want} stages ({want - 1} boundaries)"
                + stages_hint(traced.num_stages, ranks, want))
        # the schedule only: the step lowers, verifies and builds its rank programs once
        # (CompiledStep: _core.build_step, with the step's skip edges and F+B fusion)
        sched = build_schedule(self.spec, ranks, self.microbatches)
        if sched.num_ranks != ranks or sched.num_microbatches != self.microbatches:
            raise ConfigError(
                f"the schedule has {sched.num_ranks} ranks and {sched.num_microbatches} "
                f"microbatches but the mesh has {ranks} ranks and baton.jit was given "
                f"microbatches={self.microbatches}"
            )
        if self.retain_host_memory:
            rt.retain_host_memory()
        # (raises baton.VerifyError with the verifier's report when the plan fails)
        return CompiledStep(traced, sched, self.mesh, bool(sched.split_backward()),
                            fuse_forward_backward=self.fuse_fb,
                            remat=self.remat, engine=self.engine_name, loop_form=self.loop_form,
                            share_programs=self.share_programs,
                            offload=stage_offloads(self.offload, sched.num_stages),
                            transport=self.loop_transport(),
                            in_specs=in_specs,
                            donated=donated_inputs(args, traced, self.donate_argnums))

    def __call__(self, *args):
        return self._call(args, self.trace)

    def kept(self, args) -> tuple:
        """``args`` with the donated ones copied, so a measuring call leaves the caller's
        arrays valid."""
        if not self.donate_argnums:
            return args
        return tuple(jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, a)
                     if i in self.donate_argnums else a for i, a in enumerate(args))

    def capture_task_args(self, args, post: list | None = None, arrays: bool = True) -> dict:
        """Each task's first arguments on ``args`` (``measure/task_args.py``, ``capture``:
        derived from the plan, nothing runs)."""
        step = self.compile(*args)
        return task_args.capture(step, jax.tree.leaves(args), self.group, post, arrays)

    def _call(self, args, record: bool = False, keep_args: bool = False, live=None):
        """One step. ``record``: traced (``last_trace``); ``live`` (``memory.LivePeak``): the
        live arrays sampled as it runs. ``keep_args``: the measuring tools (``baton.profile``,
        ``memory``) run steps on the caller's arguments more than once, so donated arguments
        are copied first and the caller's stay valid."""
        if keep_args:
            args = self.kept(args)
        step = self.compile(*args)
        self.last = step
        flat = jax.tree.leaves(args)
        # In one process the interpreter waits for every task's outputs (XLA's queue never
        # runs ahead of the instruction stream: measured faster, and traced and untraced
        # steps then run alike); across processes a SEND already waits for its value.
        opts = RunOptions(record=bool(record), block=bool(record) or not self.multi,
                          live=live)
        with held(self.hold_gc and step.runs == 0):  # (the first run builds the programs)
            run = step.run(flat, self.group, self.timeout, opts)
        step.runs += 1
        outs = run.outputs
        self.last_run = run.without_outputs()
        del run
        if record:
            self.last_trace = build_trace(step.core_plan, self.last_run.events,
                                          buffer_bytes(step.core_plan, cost_model_of(step)),
                                          self.last_run.offsets)
            logging.getLogger("baton").info(
                "traced step %s: %.3f ms, bubble per rank %s", step.plan.schedule.name,
                self.last_trace.step_time * 1e3,
                " ".join(f"{b:.1%}" for b in self.last_trace.bubble))
        return jax.tree.unflatten(step.traced.out_tree, outs)

    @property
    def rank(self) -> int | None:
        """This process's pipeline rank in multi-process mode with one rank per process
        (None in single-process mode; a process of several ranks: see ``ranks``)."""
        if not self.multi:
            return None
        ranks = self.ranks
        if len(ranks) != 1:
            raise ConfigError(f"baton.jit: this process runs ranks {ranks}: use .ranks "
                              f"(.rank is the one rank of a one-rank process)")
        return ranks[0]

    @property
    def ranks(self) -> list[int]:
        """The global pipeline ranks this process runs (process p of k ranks each: ``p*k ..
        p*k+k-1``; every rank in single-process mode)."""
        if not self.multi:
            return list(range(self.mesh.num_ranks))
        g = self._connect()
        return self.mesh.ranks_of(g.rank)

    def gather(self, tree: Any) -> Any:
        """Full values of ``tree`` as numpy arrays, e.g. parameters for checking or
        checkpointing. Multi-process mode: a collective (call it in every process); each
        ``Remote`` leaf is fetched from the process that holds it. Single-process mode:
        ``jax.device_get(tree)``."""
        if not self.multi:
            return jax.device_get(tree)
        return gather(self._connect(), tree, self.timeout)


def jit(
    fn: Callable | None = None,
    *,
    mesh: Any = None,
    schedule: Any = "1f1b",
    microbatches: int | None = None,
    transport: str | None = None,
    timeout: float = 120.0,
    trace: bool = False,
    remat: bool = True,
    fuse_forward_backward: bool = True,
    retain_host_memory: bool = True,
    engine: str | None = None,
    param_shardings: Any = None,
    boundaries: Any = None,
    donate_argnums: Any = (),
    share_programs: bool = True,
    hold_gc: bool = True,
    layout: Any = None,
    microbatch_size: int | None = None,
    offload: Any = None,
    loop_form: str = "auto",
    single_program: bool | None = None,
):
    """Pipelines ``fn`` (a training step containing one ``baton.accumulate``); usable as
    ``baton.jit(step, mesh=..., ...)`` or as a decorator ``@baton.jit(mesh=..., ...)``.

    ``transport``: how activations and gradients move between ranks: ``"local"`` (every rank
    in this process, ``mesh`` a ``PipelineMesh``), ``"gloo"`` (this process is one rank of a
    multi-process pipeline over TCP; ``mesh``: its devices, default ``jax.local_devices()``),
    ``"nccl"`` (GPUs; one NCCL context per device slot, in one process or one per rank or per
    GPU). ``None``: ``"nccl"`` on GPUs, else ``"gloo"`` when launched with several processes
    (``python -m baton.launch``, SLURM, Open MPI, ``jax.distributed``), else ``"local"``; an
    impossible choice raises ``baton.ConfigError`` at the first call. ``timeout``: seconds one
    instruction may wait for a transfer. ``trace``: record every call (``.last_trace``,
    ``.write_trace(path)``; ``baton.trace``).
    ``remat``: shrink each stage's stash by recomputing cheap forward ops in the backward task
    (a minimum cut over the stash bytes); ``False`` stashes every residual JAX keeps.
    ``fuse_forward_backward``: where a rank runs B(s,m) right after F(s,m), run both as one
    program that keeps no stash. ``retain_host_memory``: at the first compile, make glibc keep
    freed memory for reuse (``baton.runtime.retain_host_memory``, process-wide): XLA:CPU
    allocates each call's buffers anew, and glibc's default maps and page-faults them every
    time.
    ``param_shardings``: ``PartitionSpec``s (or ``NamedSharding``s, None: replicated) with the
    structure of the first argument (the parameters), naming axes of the ranks' sub-meshes
    (the pipe axis, if named, is dropped); every sub-tree of the other arguments with that
    structure (optax's ``mu``, ``nu``) takes the same. Without it, ``NamedSharding``-ed
    arguments keep their specs and the rest is replicated on each rank.
    ``engine``: ``"compiled"`` (default): the compiled engine (one rank: the whole step as one
    XLA program; several: each rank's loop one XLA program whose transfers are FFI calls into
    the C++ transports); a step it cannot run raises ``baton.ConfigError``. ``"interpreter"``:
    the C++ executor, one Python callback per task, for debugging. ``single_program``:
    deprecated spelling of it (``True``: ``"compiled"``, ``False``: ``"interpreter"``).
    ``loop_form``: how the compiled engine lowers a rank's loop: ``"auto"`` (default: rolled
    on GPUs, a table elsewhere), ``"table"`` (each task compiled once, a switch per unit) or
    ``"rolled"`` (the stream in order, repeating runs rolled into scans; an offloading step
    is always rolled).
    ``share_programs``: ranks of this process doing the same work on different parameters run
    one compiled SPMD program (``emit/shared.py``), whose kernels may round differently
    from one rank's; ``False``: one program per rank.
    ``boundaries``: the indices (forward order) of the ``stage_boundary`` calls that end stages;
    the others are identities (``baton.autoplan`` chooses them). Default: all.
    ``donate_argnums``: arguments the caller gives up, as in ``jax.jit``: the optimizer update
    writes the new parameters and optimizer state into their buffers.
    ``hold_gc``: while a call builds the step (tracing, planning, lowering and compiling its
    programs: the first call, and a call with new shapes), Python's garbage collector runs
    every 50,000 allocations instead of CPython's 700 (``gc.set_threshold``, process-wide,
    restored after; ``running/gc_hold.py``); ``False`` leaves the collector alone.
    ``microbatch_size``: rows per microbatch instead of a count (``microbatches`` is then
    the batch size over it, per batch shape); give one of the two (default: 1 microbatch).
    ``layout``: a ``baton.Layout``: the model marks every layer end with ``stage_boundary``
    and the layout chooses which marks end the schedule's stages (layers per stage, first
    and last stage counts, split points; ``baton/layout.py``), so the schedule changes
    without editing the model.
    ``offload``: activations offloaded to host memory between a microbatch's forward and its
    backward: ``"stash"`` (every stage's stash), ``{stage: "stash"}`` (those stages), None
    (nothing). Each offloaded stash buffer is copied out after its forward and back one task
    ahead of its backward (the rank IR's OFFLOAD and FETCH; ``planning/offload.py``); lowered
    on CPU ranks of one device.
    """
    if microbatches is not None and microbatch_size is not None:
        raise ConfigError(f"baton.jit: give microbatches={microbatches} or microbatch_size="
                          f"{microbatch_size}, not both")
    microbatches = 1 if microbatches is None else microbatches
    if mesh is None and (transport == "local" or
                         (transport in (None, "nccl") and launched_world_size() <= 1)):
        raise ConfigError("baton.jit: pass mesh=baton.PipelineMesh(devices, ranks=R)")

    engine = _engine_option(engine, single_program)

    def wrap(f):
        return PipelinedFunction(f, mesh, schedule, microbatches, transport, timeout, trace,
                                 remat, fuse_forward_backward, retain_host_memory,
                                 engine, param_shardings, boundaries, donate_argnums,
                                 share_programs, hold_gc, layout, microbatch_size, offload,
                                 loop_form)

    return wrap if fn is None else wrap(fn)
