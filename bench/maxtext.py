"""MaxText benchmark: Baton's schedules vs MaxText's own pipeline parallelism on one MaxText
model and 4 CPU devices. Prints a markdown table (and writes it with --md).

    .venv-maxtext/bin/python bench/maxtext.py [--steps 5] [--md bench/results/maxtext.md]
    .venv-maxtext/bin/python bench/maxtext.py --phases [--schedules 1f1b,interleaved] [--repeat 2]
    .venv-maxtext/bin/python bench/maxtext.py --bubble [--schedules 1f1b,interleaved] [--steps 3]

``--phases`` (JSON lines, one per process): the first call split phase by phase, persistent
compilation cache off. MaxText's pipelined ``train_step`` through JAX's ahead-of-time API
(trace, lower, compile, first run); Baton's first call with its functions timed as they run
(``_Clock``: trace, plan, partition, code before the loop, rank programs built, lowered and
compiled, the loop, code after the loop), wall and process CPU seconds and XLA's compile
events per phase. ``--bubble``: per schedule, the bubble measured (compiled programs, and the
interpreter) and predicted from flop-based costs and from ``baton.profile``'s (inside steps,
and alone), with the cores the process used per step.

Model: MaxText's llama2-7b config shrunk (``baton.integrations.maxtext.LLAMA2_TINY`` with 8
decoder layers, emb 128, MLP 512, 4 heads of 32, sequence 64, vocab 256), float32, MaxText's
loss, AdamW and gradient clipping; a batch of 16 sequences in 8 microbatches. Each part runs
in its own process with ``JAX_NUM_CPU_DEVICES=4``:

* **Baton** (``pipeline_step``, one device per rank), at MaxText's default ``scan_layers=True``:
  1F1B, ZB-H1 and GPipe cut the scanned 8-layer stack into 4 stages of 2 (one scan each);
  interleaved 1F1B (2 virtual stages per rank) into 8 stages of 1; the stack split per stage
  (``init_params(stages=)``), so each rank holds its own layers.
* **MaxText ICI PP**: MaxText's own ``train_step`` set up as its trainer does
  (``train_utils.setup_train_loop``, ``jit_train_and_eval_step``) with
  ``ici_pipeline_parallelism=4``, ``num_pipeline_microbatches=8``, one layer per stage and
  circular repeats (8 layers = 4 stages x 2 repeats), ``scan_layers=True``. XLA:CPU needs
  ``--xla_cpu_enable_concurrency_optimized_scheduler=false`` for it (else a collective-permute
  rendezvous times out on fake CPU devices).
* **MaxText, 1 device**: MaxText's ``train_step`` without pipelining (the same step as
  ``reference_step``, ``scan_layers=True``), for scale.

Columns:

* ``step ms``: median wall time of ``--steps`` calls after two warm-up calls (whole step,
  optimizer included, blocking on the outputs).
* ``bubble %``: the idle fraction 1 - busy / (ranks x loop span). Baton: measured from a traced
  step (``baton.trace``; median of 3) and predicted by Baton's simulator with its default
  (flop-based) costs. MaxText: its formula (S-1)/(R·M+S-1) for S stages, R repeats, M
  microbatches (MaxText's SPMD pipeline runs every stage in every iteration; idle stages compute
  on padding, so it cannot be traced per rank).
* ``XLA temp MiB``: the largest per-device temporary buffer size XLA's compiler reports
  (``compiled.memory_analysis().temp_size_in_bytes``) of the programs holding the microbatch
  loop: Baton, each rank's loop program; MaxText, the train step (per device, SPMD). This is
  where activations and stashes live.
* ``state MiB``: the largest per-device sum of the bytes of the training state a step returns
  (parameters and optimizer state: Baton keeps each stage's on its rank; MaxText's pipeline
  shards the layers over its ``stage`` axis).

A benchmark, not a test. The machine is small (2 CPUs, shared): 4 ranks share them, so no
pipeline can beat one device here; the table compares what each schedule costs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

# This file is bench/maxtext.py: keep its folder off the path, or `import maxtext` finds it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [q for q in sys.path if os.path.abspath(q or ".") != _HERE]

MODEL = dict(base_num_decoder_layers=8, base_emb_dim=128, base_mlp_dim=512, head_dim=32,
             max_target_length=64)
BATCH = 16
MICROBATCHES = 8
RANKS = 4
SCHEDULES = ["1f1b", "zbh1", "interleaved", "gpipe"]
NO_CONCURRENT_SCHED = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _median_time(fn, steps: int) -> float:
    """Median of ``steps`` timed calls after 2 warm-up calls (``timing.median_step``)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from timing import median_step

    return median_step(fn, steps, warmup=2)


def _state_bytes(tree) -> int:
    """The largest per-device sum of the bytes of ``tree``'s arrays (their shards)."""
    import jax

    per = {}
    for a in jax.tree.leaves(tree):
        for s in getattr(a, "addressable_shards", ()):
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return max(per.values()) if per else 0


def _bubble(runs, ranks: int) -> float:
    """1 - busy / (ranks x span) over (rank, start, end) triples."""
    runs = list(runs)
    if not runs:
        return 0.0
    span = max(e for _, _, e in runs) - min(s for _, s, _ in runs)
    busy = sum(e - s for _, s, e in runs)
    return max(0.0, 1.0 - busy / (ranks * span)) if span > 0 else 0.0


def part_baton(args) -> list[dict]:
    import jax

    import baton
    from baton.integrations import maxtext as bmt

    m = bmt.build("llama2", batch=BATCH, **MODEL)
    mesh = bmt.pipeline_mesh(m, RANKS)
    batch = m.make_batch(0)
    out = []
    for name in args.schedules.split(","):
        sched = (baton.Interleaved1F1B(virtual_stages=2) if name == "interleaved"
                 else baton.schedule_from_name(name))
        t0 = time.perf_counter()
        step = m.pipeline_step(mesh, sched, microbatches=MICROBATCHES)
        p = m.init_params(stages=sched.stages(RANKS))  # each rank holds its scanned layers
        o = m.init_opt_state(p)
        state = jax.block_until_ready(step(p, o, batch))[:2]
        compile_s = time.perf_counter() - t0
        t = _median_time(lambda: step(p, o, batch), args.steps)
        traces = sorted((baton.trace(step, p, o, batch) for _ in range(3)),
                        key=lambda tr: tr.step_time)
        tr = traces[1]
        sim = step.simulate(p, o, batch)
        pred = _bubble(((r.rank, r.start, r.end) for r in sim.runs), RANKS)
        meas = _bubble(((r["rank"], r["start"], r["end"]) for r in tr.runs), RANKS)
        # the compiled programs: a group of ranks that share one program compiles it once
        # (its SharedProgram; the members' RankPrograms hold no executable of their own)
        units = step.last.engine.local_units or []
        temps = [int(u.compiled.memory_analysis().temp_size_in_bytes) for u in units]
        out.append(dict(name=f"Baton {sched}", stages=sched.stages(RANKS), step=t,
                        bubble_meas=meas, bubble_pred=pred, temp=max(temps) if temps else None,
                        live=_state_bytes(state), compile=compile_s))
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


# -- first call, phase by phase (--phases) ---------------------------------------------------

_COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
                   "/jax/core/compile/backend_compile_duration": "xla"}


class _Clock:
    """Wall time of named phases, and the seconds JAX's compile events (tracing to a jaxpr,
    lowering to MLIR, XLA's backend compile) report during each. ``wrap`` replaces a function
    by one that times it and calls it unchanged (nothing else differs)."""

    def __init__(self):
        import jax

        self.events = {"trace": 0.0, "lower": 0.0, "xla": 0.0, "xla_n": 0, "cpu": 0.0}
        self.compiles: list[tuple[str, float]] = []  # (function, XLA compile seconds)
        self.wall: dict[str, list[float]] = {}  # phase -> seconds per call
        self.during: dict[str, dict] = {}  # phase -> event seconds during its calls
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, duration, fun_name=None, **_):
        k = _COMPILE_EVENTS.get(event)
        if k is not None:
            self.events[k] += duration
            if k == "xla":
                self.events["xla_n"] += 1
                self.compiles.append((str(fun_name), round(duration, 3)))

    @staticmethod
    def cpu() -> float:
        """CPU seconds this process used so far (every thread: user + system)."""
        import resource

        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime

    def _now(self) -> dict:
        return dict(self.events, cpu=self.cpu())

    def span(self, name, fn, *a, **kw):
        before = self._now()
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            self.wall.setdefault(name, []).append(time.perf_counter() - t0)
            d = self.during.setdefault(name, dict.fromkeys(self.events, 0))
            for k, v in self._now().items():
                d[k] += v - before[k]

    def wrap(self, owner, attr, name):
        orig = getattr(owner, attr)
        names = name if isinstance(name, (list, tuple)) else None

        def timed(*a, **kw):
            n = name
            if names:  # successive calls get successive names (the last one repeats)
                calls = sum(len(self.wall.get(x, ())) for x in names)
                n = names[min(calls, len(names) - 1)]
            return self.span(n, orig, *a, **kw)

        setattr(owner, attr, timed)

    def get(self, name) -> float:
        return sum(self.wall.get(name, ()))

    def ev(self, name, k) -> float:
        return self.during.get(name, {}).get(k, 0.0)


def _no_persistent_cache():
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    return dict(jax_enable_compilation_cache=bool(jax.config.jax_enable_compilation_cache),
                jax_compilation_cache_dir=jax.config.jax_compilation_cache_dir,
                env_cache_dir=os.environ.get("JAX_COMPILATION_CACHE_DIR"))


def part_phases_baton(args) -> dict:
    """One schedule's first call (a fresh process): the setup (the jitted step object, the
    per-stage parameters, the optimizer state) and then the step's first call split into
    Baton's phases by timing its functions (``_Clock.wrap``; they run unchanged)."""
    cache = _no_persistent_cache()
    import jax

    import baton
    from baton.frontend import api
    from baton.running import engine
    from baton.running import step as step_mod
    from baton.emit.rank_program import RankProgram
    from baton.emit.shared import SharedProgram
    from baton.integrations import maxtext as bmt

    clk = _Clock()
    clk.wrap(api, "trace_step", "trace")
    clk.wrap(api.PipelinedFunction, "_build", "build")
    clk.wrap(step_mod.CompiledStep, "__init__", "partition")
    clk.wrap(step_mod.CompiledStep, "_run_segments", ["pre", "post"])
    clk.wrap(engine.ProgramEngine, "_local_programs", "programs")
    clk.wrap(engine, "compile_all", "compile_all")
    clk.wrap(RankProgram, "lower", "lower")
    clk.wrap(SharedProgram, "lower", "lower")
    clk.wrap(engine.ProgramEngine, "_launch", "loop")

    name = args.schedules.split(",")[0]
    sched = (baton.Interleaved1F1B(virtual_stages=2) if name == "interleaved"
             else baton.schedule_from_name(name))
    t0 = time.perf_counter()
    m = bmt.build("llama2", batch=BATCH, **MODEL)
    mesh = bmt.pipeline_mesh(m, RANKS)
    batch = m.make_batch(0)
    t_model = time.perf_counter() - t0
    ev0 = clk._now()
    t0 = time.perf_counter()
    step = m.pipeline_step(mesh, sched, microbatches=MICROBATCHES)
    p = m.init_params(stages=sched.stages(RANKS))
    o = jax.block_until_ready(m.init_opt_state(p))
    t_setup = time.perf_counter() - t0
    ev1 = clk._now()
    first = clk.span("first", lambda: jax.block_until_ready(step(p, o, batch)))
    del first
    t_first = clk.get("first")
    cs = step.last
    units = cs.engine.local_units or []

    def split(get):
        """The first call's phases from ``get(wrapped name)`` (wall or event seconds)."""
        ph = {
            "trace": get("trace"),
            "plan": get("build") - get("trace") - get("partition"),
            "partition": get("partition"),
            "pre": get("pre"),
            "programs_build": get("programs") - get("compile_all"),
            "programs_lower": get("lower"),
            "programs_compile": get("compile_all") - get("lower"),
            "loop": get("loop"),
            "post": get("post"),
        }
        ph["other"] = get("first") - sum(ph.values())
        return ph

    ph = split(clk.get)
    cpu = split(lambda k: clk.ev(k, "cpu"))
    xla = split(lambda k: clk.ev(k, "xla"))
    res = dict(name=f"Baton {sched}", schedule=name, model_s=t_model, setup_s=t_setup,
               setup_events={k: ev1[k] - ev0[k] for k in ev0}, first_s=t_first, phases=ph,
               phases_cpu=cpu, phases_xla=xla, events_first=clk.during.get("first"),
               compiles=clk.compiles,
               programs=len(cs.engine.local_progs or []), compiled_units=len(units),
               shared=[type(u).__name__ for u in units],
               pre_segments=len(cs.pre_segments), post_segments=len(cs.post_segments),
               cache=cache)
    print(json.dumps(res), file=sys.stderr, flush=True)
    return res


def part_phases_maxtext(args) -> dict:
    """MaxText's pipelined ``train_step`` (as ``part_maxtext`` builds it), its first call
    split with JAX's ahead-of-time API: ``.trace`` (jaxpr), ``.lower()`` (StableHLO),
    ``.compile()`` (XLA), then the compiled step's first run; the same work as a plain first
    call, whose phases JAX runs in this order."""
    cache = _no_persistent_cache()
    import jax
    from flax.core.spmd import logical_axis_rules
    from maxtext.utils import sharding

    from baton.integrations import maxtext as bmt

    clk = _Clock()
    cfg = bmt.load_config("llama2", batch=BATCH, ici_pipeline_parallelism=RANKS,
                          ici_fsdp_parallelism=1, num_pipeline_microbatches=MICROBATCHES,
                          num_layers_per_pipeline_stage=1, **{**MODEL, "scan_layers": True})
    ev0 = clk._now()
    t0 = time.perf_counter()
    step_fn, state, mesh = _maxtext_trainer(cfg)
    data_sharding = sharding.get_input_data_sharding(cfg, mesh, rules=cfg.logical_axis_rules)
    batch = jax.device_put(bmt.synthetic_batch(cfg, 0), data_sharding)
    state = jax.block_until_ready(state)
    t_setup = time.perf_counter() - t0
    ev1 = clk._now()
    with jax.set_mesh(mesh), logical_axis_rules(cfg.logical_axis_rules):
        if args.plain:
            out = clk.span("first", lambda: jax.block_until_ready(step_fn(state, batch)))
            ph = {}
        else:
            traced = clk.span("trace", step_fn.trace, state, batch)
            lowered = clk.span("lower", traced.lower)
            compiled = clk.span("compile", lowered.compile)
            out = clk.span("run", lambda: jax.block_until_ready(compiled(state, batch)))
            ph = {k: clk.get(k) for k in ("trace", "lower", "compile", "run")}
            clk.wall["first"] = [sum(ph.values())]
            clk.during["first"] = {k: sum(clk.during[n][k] for n in ph) for k in clk.events}
    del out
    res = dict(name="MaxText ICI PP (circular)", plain=bool(args.plain), setup_s=t_setup,
               setup_events={k: ev1[k] - ev0[k] for k in ev0}, first_s=clk.get("first"),
               phases=ph, phases_cpu={k: clk.ev(k, "cpu") for k in ph},
               events_first=clk.during.get("first"), compiles=clk.compiles, cache=cache)
    print(json.dumps(res), file=sys.stderr, flush=True)
    return res


# -- the bubble with profiled costs (--bubble) ---------------------------------------------


def part_bubble_baton(args) -> dict:
    """One schedule (a fresh process): the bubble measured (median of 3 traced steps, as the
    main table) and predicted by the simulator with the default flop-based costs, with
    ``baton.profile``'s costs (``costs="step"``: each task's mean span inside traced steps,
    the transfers' latency inside them) and with its isolated costs (each task timed alone);
    the CPU time the process used per untraced step (how many of the cores the ranks kept
    busy); the tasks' summed time inside a step and alone."""
    import resource
    import statistics

    import jax

    import baton
    from baton import _core
    from baton.measure import profile as prof_mod
    from baton.frontend.api import cost_model_of
    from baton.planning.tasks import task_name
    from baton.integrations import maxtext as bmt

    def named(by_task: dict) -> dict:  # JSON keys: "F0", "B1", "FB3"
        return {task_name(k): v for k, v in by_task.items()}

    name = args.schedules.split(",")[0]
    sched = (baton.Interleaved1F1B(virtual_stages=2) if name == "interleaved"
             else baton.schedule_from_name(name))
    m = bmt.build("llama2", batch=BATCH, **MODEL)
    mesh = bmt.pipeline_mesh(m, RANKS)
    batch = m.make_batch(0)
    step = m.pipeline_step(mesh, sched, microbatches=MICROBATCHES)
    p = m.init_params(stages=sched.stages(RANKS))
    o = m.init_opt_state(p)
    for _ in range(3):
        jax.block_until_ready(step(p, o, batch))

    def cpu():
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime

    walls, cpus = [], []
    for _ in range(args.steps):
        c0, t0 = cpu(), time.perf_counter()
        jax.block_until_ready(step(p, o, batch))
        walls.append(time.perf_counter() - t0)
        cpus.append(cpu() - c0)
    cores_used = statistics.median(c / w for c, w in zip(cpus, walls))

    def runs_of(tr):
        return [(r["rank"], r["start"], r["end"]) for r in tr.runs]

    traces = sorted((baton.trace(step, p, o, batch) for _ in range(3)),
                    key=lambda tr: tr.step_time)
    tr = traces[1]
    sim_flop = step.simulate(p, o, batch)
    pred_flop = _bubble(((r.rank, r.start, r.end) for r in sim_flop.runs), RANKS)
    meas = _bubble(runs_of(tr), RANKS)

    prof = baton.profile(step, p, o, batch, runs=args.steps)  # costs="step"
    sim_prof = step.simulate(p, o, batch)  # the profiled costs from now on
    pred_prof = _bubble(((r.rank, r.start, r.end) for r in sim_prof.runs), RANKS)
    span = lambda runs: max(e for _, _, e in runs) - min(s for _, s, _ in runs)  # noqa: E731
    prof_runs = runs_of(prof.trace)
    meas_prof = _bubble(prof_runs, RANKS)
    # the same plan on the isolated costs (each task alone, link by device_put)
    split = step.last.partition.split_backward
    cs = step.last
    saved, cs.profiled = cs.profiled, None
    flop_stages = cost_model_of(cs).stages
    cs.profiled = saved
    cm = _core.CostModel()
    cm.stages = [prof_mod._stage_cost(s, fc, prof.task_times_isolated, split)
                 for s, fc in enumerate(flop_stages)]
    cm.skips = prof.cost_model.skips
    lc = _core.LinkCost()
    lc.latency = float(prof.link_isolated["latency"])
    lc.bandwidth = float(prof.link_isolated["bandwidth"])
    cm.link = lc
    sim_iso = cs.plan.simulate(cm)
    iso_runs = [(r.rank, r.start, r.end) for r in sim_iso.runs]
    pred_iso = _bubble(iso_runs, RANKS)
    # the same step run by the interpreter (the C++ executor calling each task's jit, which
    # baton.profile's capture compiled): a traced interpreted step waits for every task's
    # outputs, so its RUN spans hold the tasks' whole compute; the compiled programs' spans
    # are between markers XLA may schedule work around
    cs.single_program = False
    try:
        itr = sorted((baton.trace(step, p, o, batch) for _ in range(3)),
                     key=lambda t: t.step_time)[1]
    finally:
        cs.single_program = True
    meas_interp = _bubble(runs_of(itr), RANKS)
    # the loop's task time in the measured step vs the same tasks alone
    busy = sum(e - s for _, s, e in runs_of(tr))
    alone = 0.0
    for r in tr.runs:
        k = prof_mod._task_key(r)
        if k is not None:
            alone += prof.task_times_isolated.get(k, 0.0)
    sim_span = lambda sim: (max(r.end for r in sim.runs)  # noqa: E731
                            - min(r.start for r in sim.runs))
    res = dict(name=f"Baton {sched}", schedule=name, stages=sched.stages(RANKS),
               bubble_meas=meas, bubble_meas_profile_trace=meas_prof,
               bubble_pred_flop=pred_flop, bubble_pred_profile=pred_prof,
               bubble_pred_isolated=pred_iso,
               bubble_meas_interpreter=meas_interp, loop_span_interpreter=span(runs_of(itr)),
               busy_interpreter=sum(e - s for _, s, e in runs_of(itr)),
               bubble_meas_per_rank=list(tr.bubble), bubble_pred_profile_per_rank=list(
                   prof.predicted["bubble"]),
               loop_span_meas=span(runs_of(tr)), loop_span_pred_profile=sim_span(sim_prof),
               loop_span_pred_isolated=sim_span(sim_iso), step_time_trace=tr.step_time,
               busy_meas=busy, busy_alone=alone, step_wall=statistics.median(walls),
               cores_used=cores_used, task_times=named(prof.task_times),
               task_times_isolated=named(prof.task_times_isolated), link=prof.link,
               link_isolated=prof.link_isolated)
    print(json.dumps(res), file=sys.stderr, flush=True)
    return res


def _maxtext_trainer(config):
    """MaxText's own training step as its trainer builds it (``train_utils.setup_train_loop``
    and ``train_loop``, less the data pipeline and checkpointing): the model and optimizer
    state initialized with MaxText's shardings on its mesh, ``train_step`` jitted by
    ``jit_train_and_eval_step``. Returns (p_train_step, state, mesh)."""
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.common import train_state_nnx
    from maxtext.trainers.pre_train import train
    from maxtext.utils import maxtext_utils, model_creation_utils, sharding, train_utils

    mesh = maxtext_utils.get_mesh_from_config(config)
    create_model, abstract = model_creation_utils.create_nnx_abstract_model(config, mesh)
    _, tx = train_utils.create_training_optimizer(config, abstract, mesh=mesh)

    def init_state_fn():
        model = create_model()
        return train_state_nnx.TrainStateNNX(model, nnx.Optimizer(model, tx, wrt=nnx.Param))

    state, _, state_mesh_shardings, _, _ = maxtext_utils.setup_training_state(
        None, config, mesh, None, init_state_fn)
    with logical_axis_rules(config.logical_axis_rules):
        graphdef = nnx.graphdef(nnx.eval_shape(init_state_fn))
    jit_model, state = nnx.split(nnx.merge(graphdef, state))
    params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_mesh_shardings)
    p_train_step, _ = train_utils.jit_train_and_eval_step(
        config, jit_model, mesh, state, state_mesh_shardings, train.train_step, train.eval_step,
        None, params_shardings)
    return p_train_step, state, mesh


def part_maxtext(args, pipelined: bool) -> dict:
    import jax
    from flax.core.spmd import logical_axis_rules
    from maxtext.utils import sharding

    from baton.integrations import maxtext as bmt

    if pipelined:
        cfg = bmt.load_config("llama2", batch=BATCH, ici_pipeline_parallelism=RANKS,
                              ici_fsdp_parallelism=1, num_pipeline_microbatches=MICROBATCHES,
                              num_layers_per_pipeline_stage=1, **{**MODEL, "scan_layers": True})
    else:
        cfg = bmt.load_config("llama2", batch=BATCH, **MODEL)
    t0 = time.perf_counter()
    if pipelined:
        step_fn, state, mesh = _maxtext_trainer(cfg)
        data_sharding = sharding.get_input_data_sharding(cfg, mesh, rules=cfg.logical_axis_rules)
        batch = jax.device_put(bmt.synthetic_batch(cfg, 0), data_sharding)
    else:
        m = bmt.MaxTextModel("llama2", batch=BATCH, **MODEL)
        ref = m.reference_step()  # MaxText's train_step, jitted on one device
        state, batch = m.reference_state(), m.make_batch(0)

    box = {"state": state}

    def call():
        if pipelined:
            with jax.set_mesh(mesh), logical_axis_rules(cfg.logical_axis_rules):
                box["state"], metrics = step_fn(box["state"], batch)
            return metrics["scalar"]["learning/loss"]
        box["state"], loss = ref(box["state"], batch)
        return loss

    jax.block_until_ready(call())
    compile_s = time.perf_counter() - t0
    t = _median_time(call, args.steps)
    temp = None
    if pipelined:
        with jax.set_mesh(mesh), logical_axis_rules(cfg.logical_axis_rules):
            ma = step_fn.lower(box["state"], batch).compile().memory_analysis()
        temp = int(ma.temp_size_in_bytes)
    S, R, M = RANKS, int(cfg.num_pipeline_repeats), MICROBATCHES
    res = dict(name="MaxText ICI PP (circular)" if pipelined else "MaxText, 1 device",
               stages=f"{S}x{R} repeats" if pipelined else 1, step=t,
               bubble_pred=(S - 1) / (R * M + S - 1) if pipelined else None,
               bubble_meas=None, temp=temp, live=_state_bytes(box["state"]), compile=compile_s,
               repeats=R if pipelined else None)
    print(json.dumps(res), file=sys.stderr, flush=True)
    return res


def _sub(part: str, args) -> list[dict]:
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(RANKS))
    if part in ("maxtext-pp", "phases-maxtext"):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + NO_CONCURRENT_SCHED).strip()
    cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--steps", str(args.steps),
           "--schedules", args.schedules] + (["--plain"] if args.plain else [])
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if p.returncode:
        return [dict(name=part, error=f"exit {p.returncode}")]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _mib(x) -> str:
    return "" if x is None else f"{x / 2**20:.1f}"


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--md", default=None, help="also write the table to this markdown file")
    ap.add_argument("--phases", action="store_true",
                    help="instead: the first call phase by phase, MaxText's pipeline and each "
                    "of --schedules in its own process, --repeat times (JSON lines)")
    ap.add_argument("--bubble", action="store_true",
                    help="instead: each of --schedules' bubble measured and predicted with "
                    "flop-based and profiled costs (JSON lines)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    parts = {"baton": part_baton, "phases-baton": part_phases_baton,
             "phases-maxtext": part_phases_maxtext, "bubble-baton": part_bubble_baton}
    if args.part in parts:
        res = parts[args.part](args)
        print(json.dumps(res if isinstance(res, list) else [res]))
        return
    if args.phases or args.bubble:
        import copy

        for _ in range(args.repeat):
            for name in (["maxtext"] if args.phases else []) + args.schedules.split(","):
                one = copy.copy(args)
                one.schedules = name
                part = ("phases-maxtext" if name == "maxtext" else
                        "phases-baton" if args.phases else "bubble-baton")
                for r in _sub(part, one):
                    print(json.dumps(r), flush=True)
        return
    if args.part in ("maxtext-pp", "maxtext-1"):
        print(json.dumps([part_maxtext(args, args.part == "maxtext-pp")]))
        return
    rows = _sub("maxtext-1", args) + _sub("maxtext-pp", args) + _sub("baton", args)
    head = ("| step | stages | step ms | bubble meas % | bubble pred % | XLA temp MiB | state MiB "
            "| first call s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | n/a: {r['error']} | | | | | | |")
            continue
        lines.append(f"| {r['name']} | {r['stages']} | {r['step'] * 1e3:.1f} "
                     f"| {_pct(r['bubble_meas'])} | {_pct(r['bubble_pred'])} | {_mib(r['temp'])} "
                     f"| {_mib(r['live'])} | {r['compile']:.0f} |")
    import jax

    text = "\n".join([
        "# MaxText: Baton's schedules vs MaxText's own pipeline parallelism",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs (shared), "
        f"Python {platform.python_version()}, JAX {jax.__version__}, MaxText 0.2.5; "
        f"{RANKS} CPU devices",
        f"- model: MaxText llama2-7b shrunk: {MODEL['base_num_decoder_layers']} layers, emb "
        f"{MODEL['base_emb_dim']}, MLP {MODEL['base_mlp_dim']}, 4 heads of {MODEL['head_dim']}, "
        f"seq {MODEL['max_target_length']}, vocab 256, float32; batch {BATCH} in {MICROBATCHES} "
        "microbatches; MaxText's AdamW + clipping",
        f"- command: `.venv-maxtext/bin/python bench/maxtext.py --steps {args.steps}"
        + (f" --md {args.md}`" if args.md else "`"),
        "- method: see the docstring of bench/maxtext.py (bubble: Baton measured from a trace and "
        "predicted by its simulator; MaxText: its formula (S-1)/(R·M+S-1))",
        "",
        *lines,
        "",
    ])
    print(text)
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
