"""Mistakes a new user makes, each refused with an error of a stated type whose message
names the problem (what, and which argument / stage / rank / value). One tiny model, one
process (8 CPU devices), tracing only where possible (``PipelinedFunction.compile`` builds
the plan without compiling XLA programs); the one mistake that needs several processes
(the launcher's world size against the model) is a separate, heavy test.

The table of these mistakes and their messages is in docs/RELIABILITY.md ("Wrong uses").
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import baton  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
D = jax.devices()


def mesh(r=2):
    return baton.PipelineMesh(D[:r], ranks=r)


def loss_fn(params, batch):
    x, y = batch
    h = x
    for i, w in enumerate(params):
        h = jnp.tanh(h @ w)
        if i < len(params) - 1:
            h = baton.stage_boundary(h)
    return jnp.mean((h - y) ** 2)


def step(params, batch):
    loss, g = baton.accumulate(jax.value_and_grad(loss_fn), params, batch=batch)
    return jax.tree.map(lambda p, q: p - 0.1 * q, params, g), loss


def step_of(lf, **acc):
    def st(p, b):
        return baton.accumulate(jax.value_and_grad(lf), p, batch=b, **acc)
    return st


def params(n=2, d=8):
    return [jnp.eye(d) * 0.5 for _ in range(n)]


def batch(b=8, d=8):
    return (jnp.ones((b, d)), jnp.zeros((b, d)))


def jit(fn=step, **kw):
    kw = {"mesh": mesh(), "microbatches": 2, **kw}
    return baton.jit(fn, **kw)


SCHED = "baton-schedule 1\nranks 2\nstages 2\nmicrobatches 1\nplacement 0 1\n"


# -- the mistakes ------------------------------------------------------------------------
def batch_not_divisible():
    jit(microbatches=4).compile(params(), batch(6))


def scalar_batch_leaf():
    jit(step_of(lambda p, b: loss_fn(p, b[:2]) * b[2])).compile(
        params(), (*batch(), jnp.float32(1)))


def pytree_changes_between_calls():
    f = jit()
    f.compile(params(), batch())
    x, y = batch()
    f.compile(params(), {"x": x, "y": y})


def stages_do_not_match_schedule():
    jit().compile(params(3), batch())


def interleaved_needs_ranks_times_v_stages():
    jit(schedule=baton.Interleaved1F1B(virtual_stages=2)).compile(params(2), batch())


def zbv_with_odd_stages():
    jit(schedule=baton.ZBV()).compile(params(3), batch())


def no_stage_boundary():
    jit(step_of(lambda p, b: jnp.mean(jnp.tanh(b[0] @ p[0])))).compile(params(1), batch())


def more_ranks_than_devices():
    baton.PipelineMesh(D[:2], ranks=4)


def devices_not_divisible_into_ranks():
    baton.PipelineMesh(D[:3], ranks=2)


def zero_ranks():
    baton.PipelineMesh(D[:2], ranks=0)


def param_shardings_missing_axis():
    jit(param_shardings=[P("tensor"), P()]).compile(params(), batch())


def param_shardings_wrong_pytree():
    jit(param_shardings={"a": P()}).compile(params(), batch())


def boundary_inside_scan():
    def lf(p, b):
        h, _ = jax.lax.scan(lambda h, w: (baton.stage_boundary(jnp.tanh(h @ w)), None),
                            b[0], jnp.stack(p))
        return jnp.mean(h)
    jit(step_of(lf)).compile(params(), batch())


def boundary_inside_cond():
    def lf(p, b):
        h = jax.lax.cond(b[0][0, 0] > 0, lambda h: baton.stage_boundary(h @ p[0]),
                         lambda h: h @ p[0], b[0])
        return jnp.mean(h @ p[1])
    jit(step_of(lf)).compile(params(), batch())


def mesh_without_pipe_axis():
    baton.PipelineMesh(Mesh(np.array(D[:2]), ("data",)))


def no_mesh():
    baton.jit(step, microbatches=2)


def microbatches_zero():
    jit(microbatches=0)


def microbatches_not_int():
    jit(microbatches=2.0)


def unknown_schedule_name():
    jit(schedule="1f1bb")


def schedule_class_not_instance():
    jit(schedule=baton.OneFOneB)


def schedule_text_missing_backward():
    baton.load_schedule(SCHED + "rank 0: F0.0 B0.0\nrank 1: F1.0\n")


def schedule_text_bad_token():
    baton.load_schedule(SCHED + "rank 0: F0.0 X0.0\nrank 1: F1.0 B1.0\n")


def schedule_file_other_microbatches():
    text = SCHED + "rank 0: F0.0 B0.0\nrank 1: F1.0 B1.0\n"
    jit(schedule=baton.ScheduleFile(text)).compile(params(), batch())


def accumulate_twice():
    def st(p, b):
        l1, _ = baton.accumulate(jax.value_and_grad(loss_fn), p, batch=b)
        l2, _ = baton.accumulate(jax.value_and_grad(loss_fn), p, batch=b)
        return l1 + l2
    jit(st).compile(params(), batch())


def accumulate_not_called():
    jit(lambda p, b: jax.value_and_grad(loss_fn)(p, b)).compile(params(), batch())


def accumulate_not_called_no_boundary():
    jit(lambda p, b: jax.value_and_grad(lambda p, b: jnp.mean(b[0] @ p[0]))(p, b)).compile(
        params(1), batch())


def accumulate_microbatches_disagree():
    jit(step_of(loss_fn, microbatches=3)).compile(params(), batch(12))


def unknown_reduce():
    jit(step_of(loss_fn, reduce="median")).compile(params(), batch())


def string_leaf_in_batch():
    jit().compile(params(), (batch()[0], "labels"))


def no_gradient():
    jit(lambda p, b: baton.accumulate(loss_fn, p, batch=b)).compile(params(), batch())


def first_stage_without_parameters():
    def lf(p, b):
        h = baton.stage_boundary(jnp.tanh(b[0]))
        return jnp.mean(jnp.tanh(h @ p[0]) - b[1])
    jit(step_of(lf)).compile(params(1), batch())


def auto_impossible_memory_budget():
    auto = baton.Auto(memory_per_device=10, microbatches=(2,), families=("1f1b",),
                      remat=("keep",), runs=1)
    jit(schedule=auto).compile(params(), batch())


def virtual_stages_zero():
    baton.Interleaved1F1B(virtual_stages=0)


def unknown_transport():
    jit(transport="tcp")


def nccl_on_cpu():
    jit(transport="nccl").compile(params(), batch())


def negative_donate_argnums():
    jit(donate_argnums=-1)


def negative_timeout():
    jit(timeout=-1)


def boundaries_out_of_range():
    jit(boundaries=[5]).compile(params(), batch())


def batch_axis_not_in_mesh():
    baton.PipelineMesh(D[:2], ranks=2, batch_axes=("fsdp",))


def restore_another_models_checkpoint(tmp):
    f = jit()
    p = params()
    f.compile(p, batch())
    baton.checkpoint.save(tmp, 1, p, f, wait=True)
    g = jit()
    g.compile(params(2, 4), batch(8, 4))
    baton.checkpoint.restore(tmp, fn=g)


def restore_onto_fewer_ranks_than_stages(tmp):
    f = jit(mesh=mesh(4), microbatches=4)
    p = params(4)
    f.compile(p, batch())
    baton.checkpoint.save(tmp, 1, p, f, wait=True)
    g = jit(mesh=mesh(2))  # the 4-stage model on 2 devices, one stage per rank
    g.compile(p, batch())
    baton.checkpoint.restore(tmp, fn=g)


def restore_a_step_never_saved(tmp):
    baton.checkpoint.restore(tmp, 3)


def save_negative_step(tmp):
    baton.checkpoint.save(tmp, -1, params())


def launcher_rank_outside_world():
    from baton.runtime import rendezvous
    rendezvous.rank_info({"BATON_RANK": "2", "BATON_WORLD_SIZE": "2"})


def unknown_engine():
    jit(engine="executor")


def unknown_loop_form():
    jit(loop_form="straight")


def engine_and_single_program_both():
    jit(engine="compiled", single_program=False)


def table_loop_form_with_offload():
    jit(microbatches=2, offload="stash", loop_form="table").compile(params(), batch())


def launcher_rank_not_a_number():
    from baton.runtime import rendezvous
    rendezvous.rank_info({"BATON_RANK": "one", "BATON_WORLD_SIZE": "2"})


E, T, S, F = baton.ConfigError, baton.TraceError, baton.ScheduleError, baton.FormatError
# (mistake, error type, parts of the message)
CASES = [
    (batch_not_divisible, E, ["shape (6, 8)", "4 microbatches", "divisible"]),
    (scalar_batch_leaf, E, ["shape ()", "2 microbatches"]),
    (pytree_changes_between_calls, T, ["structure of the arguments changed", "{'x': *"]),
    (stages_do_not_match_schedule, T, ["3 stages", "OneFOneB on 2 ranks needs 2 stages"]),
    (interleaved_needs_ranks_times_v_stages, T, ["2 stages", "on 2 ranks needs 4 stages"]),
    (zbv_with_odd_stages, T, ["3 stages", "ZBV on 2 ranks needs 4 stages"]),
    (no_stage_boundary, T, ["no stage_boundary", "needs 2 stages", "baton.stage_boundary(x)"]),
    (more_ranks_than_devices, E, ["2 devices cannot be split into 4 equal ranks"]),
    (devices_not_divisible_into_ranks, E, ["3 devices cannot be split into 2 equal ranks"]),
    (zero_ranks, E, ["ranks must be a positive integer (got 0)"]),
    (param_shardings_missing_axis, E, ["argument [0][0]", "names axis 'tensor'",
                                       "do not have"]),
    (param_shardings_wrong_pytree, E, ["param_shardings does not match the structure",
                                       "first argument"]),
    (boundary_inside_scan, T, ["stage_boundary is inside a 'scan'", "top level"]),
    (boundary_inside_cond, T, ["stage_boundary is inside a 'cond'"]),
    (mesh_without_pipe_axis, E, ["no 'pipe' axis", "('data',)"]),
    (no_mesh, E, ["pass mesh=baton.PipelineMesh"]),
    (microbatches_zero, E, ["microbatches must be a positive integer (got 0)"]),
    (microbatches_not_int, E, ["microbatches must be a positive integer (got 2.0)"]),
    (unknown_schedule_name, S, ["unknown schedule '1f1bb'", "1f1b", "zbv"]),
    (schedule_class_not_instance, E, ["schedule=OneFOneB is the class",
                                      "schedule=baton.OneFOneB()"]),
    (schedule_text_missing_backward, S, ["line 7", "stage 1 microbatch 0 needs one B",
                                         "rank 1"]),
    (schedule_text_bad_token, F, ["line 6, column 14", "'X0.0'"]),
    (schedule_file_other_microbatches, S, ["is for microbatches=1",
                                           "microbatches=2 was requested"]),
    (accumulate_twice, T, ["one baton.accumulate loop per step"]),
    (accumulate_not_called, T, ["stage_boundary outside baton.accumulate"]),
    (accumulate_not_called_no_boundary, T, ["no microbatch loop", "baton.accumulate"]),
    (accumulate_microbatches_disagree, E, ["accumulate(microbatches=3) disagrees with "
                                           "baton.jit(microbatches=2)"]),
    (unknown_reduce, E, ["reduce must be one of", "'median'"]),
    (string_leaf_in_batch, E, ["argument [1][1] is a str ('labels')", "not an array"]),
    (no_gradient, T, ["no gradient flows back across stage boundary 0",
                      "jax.value_and_grad"]),
    (first_stage_without_parameters, T, ["stage boundary 0 (between stages 0 and 1)",
                                         "stages 0..0 have no parameters"]),
    (auto_impossible_memory_budget, E, ["no candidate fits the memory budget of 10B",
                                        "smallest peak found"]),
    (virtual_stages_zero, E, ["virtual_stages must be a positive integer (got 0)"]),
    (unknown_transport, E, ["transport must be", "(got 'tcp')"]),
    (nccl_on_cpu, E, ["rank 0 runs on CPU", "not 'nccl'"]),
    (negative_donate_argnums, E, ["donate_argnums must be non-negative", "(got -1)"]),
    (negative_timeout, E, ["timeout must be a positive number of seconds (got -1)"]),
    (boundaries_out_of_range, T, ["boundaries=[5]", "1 stage_boundary calls", "0..0"]),
    (batch_axis_not_in_mesh, E, ["batch axis 'fsdp' is not an axis"]),
    (restore_another_models_checkpoint, E, ["restore: [0] is float32[8, 8] in the checkpoint",
                                            "float32[4, 4] in the target model"]),
    (restore_onto_fewer_ranks_than_stages, T, ["4 stages", "on 2 ranks needs 2 stages",
                                               "Interleaved1F1B(virtual_stages=2)"]),
    (restore_a_step_never_saved, E, ["no checkpoint of step 3", "committed steps: []"]),
    (save_negative_step, E, ["step must be a non-negative integer (got -1)"]),
    (launcher_rank_outside_world, E, ["rank 2 is outside world size 2"]),
    (launcher_rank_not_a_number, E, ["BATON_RANK='one' is not an integer"]),
    (unknown_engine, E, ["engine must be one of 'compiled', 'interpreter'", "(got 'executor')"]),
    (unknown_loop_form, E, ["loop_form must be one of 'auto', 'table', 'rolled'",
                            "(got 'straight')"]),
    (engine_and_single_program_both, E, ["give engine='compiled' or the deprecated "
                                         "single_program=False, not both"]),
    (table_loop_form_with_offload, E, ["table loop form does not offload",
                                       "loop_form='rolled'"]),
]


def run_case(fn, tmp_path):
    """Runs one mistake; returns the exception it raised (None when it raised nothing)."""
    try:
        if fn.__code__.co_argcount:
            fn(str(tmp_path / "ckpt"))
        else:
            fn()
    except Exception as e:  # noqa: BLE001 (checked by the caller)
        return e
    return None


@pytest.mark.parametrize("fn, kind, parts", CASES, ids=[c[0].__name__ for c in CASES])
def test_wrong_use_is_named(fn, kind, parts, tmp_path):
    e = run_case(fn, tmp_path)
    assert e is not None, f"{fn.__name__}: accepted"
    assert type(e) is kind, f"{fn.__name__}: {type(e).__name__}: {e}"
    assert isinstance(e, baton.BatonError)
    for part in parts:
        assert part in str(e), f"{fn.__name__}: {part!r} not in: {e}"


def test_launcher_refuses_zero_processes(capsys):
    from baton import launch

    assert launch.main(["--nprocs", "0", "x.py"]) == 2
    assert "--nprocs must be >= 1" in capsys.readouterr().err


WORLD = f"""
import os, sys, pathlib
sys.path.insert(0, {str(HERE)!r})
import jax, baton
import test_wrong_uses as T
p = os.environ["BATON_RANK"]
try:  # 2 launched processes x 2 ranks = 4 ranks, for a model of 2 stages
    fn = baton.jit(T.step, mesh=baton.PipelineMesh(jax.local_devices()[:2], ranks=2),
                   microbatches=2, timeout=60)
    fn.compile(T.params(2), T.batch())
    msg = "accepted"
except baton.BatonError as e:
    msg = type(e).__name__ + ": " + str(e)
pathlib.Path(sys.argv[1], "p" + p).write_text(msg)
"""


@pytest.mark.heavy
def test_launcher_world_size_not_matching_the_model(tmp_path):
    """Launched with --nprocs 2, each process a mesh of 2 ranks, for a 2-stage model: every
    process refuses, naming the rank count and where it came from."""
    script = tmp_path / "w.py"
    script.write_text(WORLD)
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="2", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-m", "baton.launch", "--nprocs", "2", "--timeout", "150",
                        str(script), str(tmp_path)], capture_output=True, text=True, timeout=180,
                       env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    for q in (0, 1):
        msg = (tmp_path / f"p{q}").read_text()
        assert msg.startswith("TraceError: the model has 2 stages"), msg
        assert "on 4 ranks (2 launched processes x 2 ranks each" in msg, msg
        assert "needs 4 stages" in msg, msg
