"""baton.jit's single-process mode with several ranks: on the compiled engine (one XLA program
per rank, launched from one thread per rank; transfers are FFI calls into the in-process
transport) and on the interpreter (one C++ executor thread per rank). (Numerical equality with plain JAX for every schedule:
test_e2e.py; multi-process mode: test_mp_e2e.py.)"""

from __future__ import annotations

import os
import sys
import threading
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402
from baton.planning.tasks import FUSED_FB  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import mlp  # noqa: E402


def small(schedule=None, ranks=2, microbatches=4, engine="compiled"):
    key = jax.random.PRNGKey(0)
    stages = (schedule or baton.OneFOneB()).stages(ranks)
    params = mlp.init_params(key, stages)
    batch = mlp.synthetic_batch(key, 4 * microbatches)
    vg = jax.value_and_grad(mlp.make_loss())
    ps = baton.jit(lambda p, b: baton.accumulate(vg, p, batch=b),
                   mesh=baton.PipelineMesh(jax.devices()[:ranks], ranks=ranks),
                   schedule=schedule or baton.OneFOneB(), microbatches=microbatches,
                   engine=engine)
    return ps, params, batch


def test_each_rank_runs_in_its_own_executor_thread():
    ps, params, batch = small(ranks=4, engine="interpreter")
    step = ps.compile(params, batch)
    seen = {}
    for (kind, s), exe in step.tasks.items():
        def spy(*args, _fn=exe.fn, _s=s):
            seen.setdefault(_s, set()).add(threading.current_thread().name)
            return _fn(*args)
        exe.fn = spy
    ps(params, batch)
    assert seen == {s: {f"baton-rank-{step.stage_rank[s]}"} for s in range(4)}
    # measured by the executors (C++ stats), one entry per rank
    assert len(ps.last_run.stats["peak_bytes"]) == 4
    assert all(b > 0 for b in ps.last_run.stats["peak_buffers"])


def test_each_rank_runs_its_own_program():
    """The compiled engine: every rank's loop is one program; each runs on its own thread."""
    ps, params, batch = small(ranks=4)
    ps(params, batch)
    step = ps.last
    assert len(ps.last_run.stats["rank_program"]) == 4
    assert all("F" in d for d in ps.last_run.stats["rank_program"])


@pytest.mark.parametrize("program", [True, False], ids=["compiled", "interpreter"])
@pytest.mark.parametrize("schedule", [baton.OneFOneB(), baton.ZBV()], ids=["1f1b", "zbv"])
def test_task_exception_in_one_rank_stops_all(schedule, program):
    ps, params, batch = small(schedule, engine="compiled" if program else "interpreter")
    want = ps(params, batch)
    step = ps.last
    last = step.num_stages - 1
    rank = step.stage_rank[last]
    # 1F1B fuses the last stage's F and B of a microbatch into one task ("FB")
    fused = any(a.is_fused for a in step.rank_actions[rank])
    exe = step.tasks[(FUSED_FB if fused else baton.TaskKind.F, last)]
    good = exe.fn, exe.plain

    def raise_at_run(x):
        raise ValueError("injected failure")

    def failing(*args):  # the rank's program fails while it runs (a host callback raises)
        outs = good[1](*args)
        flag = jax.pure_callback(raise_at_run, jax.ShapeDtypeStruct((), jnp.int32), jnp.int32(0))
        return [outs[0] + flag.astype(outs[0].dtype)] + list(outs[1:])

    def boom(*args):
        raise ValueError("injected failure")

    if program:
        exe.plain = failing
        step.engine.local_progs = None  # rebuilt with the failing task
    else:
        exe.fn = boom
    t0 = time.monotonic()
    with pytest.raises(baton.ExecutionError) as info:
        ps(params, batch)
    assert time.monotonic() - t0 < 20  # every other rank stopped; nothing waited out a timeout
    msg = str(info.value)
    assert "injected failure" in msg, msg
    if program:
        assert msg.startswith(f"rank {rank}: "), msg
    else:
        assert f"rank {rank} #" in msg and "RUN F" in msg, msg
        assert isinstance(info.value.__cause__, ValueError)
    assert info.value.failed_rank == rank
    # a fresh in-process transport after a failure: the next step runs normally
    exe.fn, exe.plain = good
    step.engine.local_progs = None
    got = ps(params, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gather_in_single_process_mode_is_device_get():
    ps, params, batch = small()
    loss, grads = ps(params, batch)
    host = ps.gather(grads)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host))
    assert ps.rank is None


def test_transport_argument_is_checked():
    with pytest.raises(baton.ConfigError, match="transport must be"):
        baton.jit(lambda p: p, mesh=baton.PipelineMesh(jax.devices()[:2], ranks=2),
                  transport="mpi")
    with pytest.raises(baton.ConfigError, match="pass mesh="):
        baton.jit(lambda p: p, transport="local")


def test_gloo_without_a_launcher_says_how_to_start(monkeypatch):
    for k in ("BATON_RANK", "BATON_WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(k, raising=False)
    ps, params, batch = small()
    gl = baton.jit(ps.fn, schedule=baton.OneFOneB(), microbatches=4, transport="gloo")
    with pytest.raises(baton.ConfigError, match="baton.launch"):
        gl(params, batch)


def test_remote_placeholder():
    r = baton.Remote((3, 4), np.dtype("float32"), 1)
    assert r.ndim == 2 and r.size == 12 and "rank 1" in repr(r)
    assert jax.tree.leaves([r]) == [r]  # a leaf: keeps the pytree structure of the step
