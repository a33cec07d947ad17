"""MaxText benchmark: Baton's schedules vs MaxText's own pipeline parallelism on one MaxText
model and 4 CPU devices. Prints a markdown table (and writes it with --md).

    .venv-maxtext/bin/python bench/maxtext.py [--steps 5] [--md bench/results/maxtext.md]

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
        progs = step.last.engine.local_progs or []
        temps = [int(pr.compiled.memory_analysis().temp_size_in_bytes) for pr in progs]
        out.append(dict(name=f"Baton {sched}", stages=sched.stages(RANKS), step=t,
                        bubble_meas=meas, bubble_pred=pred, temp=max(temps) if temps else None,
                        live=_state_bytes(state), compile=compile_s))
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


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
    if part == "maxtext-pp":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + NO_CONCURRENT_SCHED).strip()
    cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--steps", str(args.steps),
           "--schedules", args.schedules]
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
    args = ap.parse_args()
    if args.part == "baton":
        print(json.dumps(part_baton(args)))
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
