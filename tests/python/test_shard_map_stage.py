"""``shard_map`` and sharding constraints inside pipeline stages, on pipe 2 x tensor 2 x
data 2, against plain JAX.

Each stage is a Megatron-style MLP block written by hand: a column-parallel matmul
(``w1`` split over ``tensor``), a sharding constraint on the hidden activation, and a
row-parallel matmul written with ``jax.shard_map`` whose partial products are summed with
``psum`` over ``tensor``. The mesh the model names is, per case:

* ``full``: the user's mesh, with the pipe axis;
* ``rank``: a mesh shaped like one rank's sub-mesh (no pipe axis; rank 0's devices);
* ``context``: no mesh at all in the model (bare ``PartitionSpec``s, ``shard_map`` without
  ``mesh=``), the step called under ``jax.set_mesh`` of the full mesh.

Baton moves each onto every rank's own sub-mesh (``baton.tracing.retarget``). Losses,
gradients, parameters and optimizer state over 3 AdamW steps match ``jax.jit`` of the same
step (the batch in one piece) within float tolerance. In one process, ranks of several
devices run on the interpreter (``engine="interpreter"``; the compiled engine refuses them
by name, tested here); across processes under ``jax.distributed`` (2 processes of 4
devices, one rank each; 4 processes of 2 devices, each rank spanning two) each rank's
program is compiled. Explicit mesh axes are refused by name.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import baton  # noqa: E402
from launched import distributed_env  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
D, H, BATCH, MICRO, STEPS = 8, 16, 16, 4, 3
OPT = optax.adamw(3e-2, eps=1e-6, weight_decay=0.01)
SCHEDULES = {"1f1b": baton.OneFOneB, "zbh1": baton.ZBH1}
KINDS = ("full", "rank", "context")


def full_mesh(devices=None) -> Mesh:
    devs = np.array(jax.devices()[:8] if devices is None else devices)
    return Mesh(devs.reshape(2, 2, 2), ("pipe", "tensor", "data"))


def model_mesh(kind: str, mesh: Mesh):
    """The mesh the model names (None: the mesh context's)."""
    if kind == "full":
        return mesh
    if kind == "rank":
        return Mesh(mesh.devices[0], ("tensor", "data"))
    return None


def make_loss(mesh):
    """The loss of a 2-stage MLP whose blocks are tensor-parallel (see the module)."""
    def sharded(spec):
        return spec if mesh is None else NamedSharding(mesh, spec)

    def row_parallel(h, w2, b2):
        def body(h, w, b):
            return jax.lax.psum(jax.nn.relu(h) @ w, "tensor") + b

        kw = {} if mesh is None else {"mesh": mesh}
        return jax.shard_map(body, in_specs=(P("data", "tensor"), P("tensor", None), P()),
                             out_specs=P("data", None), **kw)(h, w2, b2)

    def block(x, p):
        h = x @ p["w1"]
        h = jax.lax.with_sharding_constraint(h, sharded(P("data", "tensor")))
        return x + row_parallel(h, p["w2"], p["b2"])

    def loss_fn(params, batch):
        x = batch["x"]
        for i, p in enumerate(params):
            x = block(x, p)
            if i < len(params) - 1:
                x = baton.stage_boundary(x)
        return jnp.mean((x - batch["y"]) ** 2)

    return loss_fn


def inputs(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 8)
    params = [{"w1": jax.random.normal(k[3 * i], (D, H)) * 0.3,
               "w2": jax.random.normal(k[3 * i + 1], (H, D)) * 0.3,
               "b2": jax.random.normal(k[3 * i + 2], (D,)) * 0.1} for i in range(2)]
    batch = {"x": jax.random.normal(k[6], (BATCH, D)), "y": jax.random.normal(k[7], (BATCH, D))}
    return params, OPT.init(params), batch


SPECS = [{"w1": P(None, "tensor"), "w2": P("tensor", None), "b2": P()}] * 2


def steps(mesh):
    """(pipelined train step, plain reference step) for the model naming ``mesh``."""
    loss_fn = make_loss(mesh)

    def train_step(params, opt_state, batch):
        loss, grads = baton.accumulate(jax.value_and_grad(loss_fn), params, batch=batch)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    def ref_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return train_step, ref_step


def run(fn, params, st, batch):
    """STEPS steps of ``fn``: the losses and gradients of each, the final state."""
    hist = []
    for _ in range(STEPS):
        params, st, loss, grads = fn(params, st, batch)
        hist.append((loss, grads))
    return hist, params, st


def flat(hist, params, st) -> dict:
    out = {}
    for i, (loss, grads) in enumerate(hist):
        out[f"loss{i}"] = np.asarray(loss)
        out.update({f"grad{i}_{j}": np.asarray(g) for j, g in enumerate(jax.tree.leaves(grads))})
    out.update({f"param_{j}": np.asarray(x) for j, x in enumerate(jax.tree.leaves(params))})
    out.update({f"opt_{j}": np.asarray(x) for j, x in enumerate(jax.tree.leaves(st))})
    return out


def assert_close(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        # psum over tensor and the data-parallel gradient sum add in another order than one
        # device's matmul: rounding of float32 sums, relative to each array's scale
        scale = float(np.max(np.abs(want[k]))) if want[k].size else 0.0
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6 * max(scale, 1.0),
                                   err_msg=k)


def context(kind: str, mesh: Mesh):
    return jax.set_mesh(mesh) if kind == "context" else contextlib.nullcontext()


def reference(kind: str, mesh: Mesh) -> dict:
    _, ref_step = steps(model_mesh(kind, mesh))
    with context(kind, mesh):
        return flat(*run(jax.jit(ref_step), *inputs()))


@pytest.fixture(autouse=True)
def eight_devices():
    # (a fixture, not a skip at import: the launched processes import this module before
    # jax.distributed.initialize, which must come before JAX's backend starts)
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (JAX_NUM_CPU_DEVICES=8)")


# every mesh kind with 1F1B, ZB-H1 with the full mesh; the other ZB-H1 cases are ``heavy``
CASES = [pytest.param(s, k, marks=() if s == "1f1b" or k == "full" else pytest.mark.heavy,
                      id=f"{s}-{k}") for s in SCHEDULES for k in KINDS]


@pytest.mark.parametrize("schedule,kind", CASES)
def test_shard_map_in_stages_matches_plain_jax(schedule, kind):
    mesh = full_mesh()
    train_step, _ = steps(model_mesh(kind, mesh))
    ps = baton.jit(train_step, mesh=baton.PipelineMesh(mesh), schedule=SCHEDULES[schedule](),
                   microbatches=MICRO, param_shardings=SPECS, engine="interpreter")
    with context(kind, mesh):
        got = run(ps, *inputs())
    assert_close(flat(*got), reference(kind, mesh))
    # the parameters stayed split over tensor on each rank's four devices
    _, params, _ = got
    for r, p in enumerate(params):
        w = p["w2"]
        assert w.sharding.spec == P("tensor") and len(w.sharding.device_set) == 4
        assert w.sharding.device_set == set(mesh.devices[r].flat)


def test_compiled_engine_refuses_ranks_of_several_devices_in_one_process():
    """XLA:CPU runs one multi-device program at a time per process: the compiled engine
    (the default) refuses these ranks by name instead of running them elsewhere."""
    mesh = full_mesh()
    train_step, _ = steps(mesh)
    ps = baton.jit(train_step, mesh=baton.PipelineMesh(mesh), schedule=baton.OneFOneB(),
                   microbatches=MICRO, param_shardings=SPECS)
    with pytest.raises(baton.ConfigError, match="rank 0 has 4 devices.*one process per rank"):
        ps(*inputs())


def test_a_mesh_unlike_the_ranks_names_the_primitive():
    mesh = full_mesh()
    other = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("tensor", "data"))  # no pipe
    train_step, _ = steps(other)
    ps = baton.jit(train_step, mesh=baton.PipelineMesh(mesh), schedule=baton.OneFOneB(),
                   microbatches=MICRO, param_shardings=SPECS, engine="interpreter")
    with pytest.raises(baton.ConfigError,
                       match=r"with_sharding_constraint: mesh \(tensor=4, data=2\) is neither.*"
                             r"rank 0's sub-mesh is \(tensor=2, data=2\)"):
        ps(*inputs())


def test_explicit_axes_are_refused_by_name():
    from jax.sharding import AxisType

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("pipe", "tensor", "data"),
                axis_types=(AxisType.Explicit,) * 3)
    train_step, _ = steps(None)
    ps = baton.jit(train_step, mesh=baton.PipelineMesh(mesh), schedule=baton.OneFOneB(),
                   microbatches=MICRO, param_shardings=SPECS, engine="interpreter")
    with pytest.raises(baton.ConfigError, match=r"PipelineMesh has Explicit axes \['tensor', "
                                                r"'data'\]"):
        ps(*inputs())
    auto = full_mesh()
    ps = baton.jit(train_step, mesh=baton.PipelineMesh(auto), schedule=baton.OneFOneB(),
                   microbatches=MICRO, param_shardings=SPECS, engine="interpreter")
    with jax.set_mesh(mesh), pytest.raises(baton.ConfigError,
                                           match=r"mesh context \(jax.set_mesh\) has Explicit"):
        ps(*inputs())


# -- across processes ---------------------------------------------------------------------

LAYOUTS = {"one": (2, 4), "span": (4, 2)}  # processes, devices per process


def worker_main(layout: str, outdir: str) -> None:
    """One process of the launch (``LAYOUTS``), joined by ``jax.distributed``: ``one``, each
    rank one process of 4 devices; ``span``, each rank two processes of 2 devices (its
    tensor axis across them). The model names the global mesh (``full``) and a mesh shaped
    like a rank (``rank``: rank 0's devices); 1F1B and ZB-H1, compiled."""
    procs, _ = LAYOUTS[layout]
    proc = int(os.environ["BATON_RANK"])
    jax.distributed.initialize(os.environ["BATON_TEST_COORD"], num_processes=procs,
                               process_id=proc)
    mesh = full_mesh(jax.devices())
    rank = proc // (procs // 2)
    for kind in ("full", "rank"):
        for name, sched in SCHEDULES.items():
            train_step, _ = steps(model_mesh(kind, mesh))
            ps = baton.jit(train_step, mesh=baton.PipelineMesh(mesh), schedule=sched(),
                           microbatches=MICRO, param_shardings=SPECS)
            assert ps.ranks == [rank], ps.ranks
            got = ps.gather(run(ps, *inputs()))
            how = ps.last_run.stats.get("rank_program", "")
            assert how, f"process {proc}: the step did not run as a compiled program"
            if proc == 0:
                np.savez(os.path.join(outdir, f"{kind}-{name}.npz"), **flat(*got))
    print(f"process {proc} ok", flush=True)


WORKER = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
import test_shard_map_stage as T
T.worker_main(sys.argv[1], sys.argv[2])
"""



@pytest.mark.heavy
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shard_map_in_stages_across_processes(tmp_path, layout):
    procs, devices = LAYOUTS[layout]
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu",
               **distributed_env())
    p = subprocess.run([sys.executable, "-m", "baton.launch", "--nprocs", str(procs),
                        "--grace", "20", "--timeout", "285", str(script), layout,
                        str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    mesh = full_mesh()
    for kind in ("full", "rank"):
        want = reference(kind, mesh)
        for name in SCHEDULES:
            assert_close(dict(np.load(tmp_path / f"{kind}-{name}.npz")), want)
