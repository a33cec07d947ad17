"""Ranks spanning processes: pipe 2 x data 2 over 4 processes of one CPU device joined by
``jax.distributed`` (each rank's sub-mesh spans two processes; the weights split over them, the
biases replicated). ``baton.init_stages`` makes only each rank's leaves, in the processes of
that rank; two steps equal plain JAX's; the state and each process's data position are saved
with ``baton.checkpoint.save``, restored in every process onto the step, and a third step from
the restored state equals the third step of the live one and plain JAX's; the checkpoint read
back by one plain process holds the state plain JAX has after two steps."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from baton import checkpoint as ckpt  # noqa: E402
from launched import distributed_env, run_workers  # noqa: E402

WORKER = '''
import json, os, sys
import numpy as np
import jax, jax.numpy as jnp, optax
import baton
from baton import checkpoint as ckpt
from baton.running.distributed import process_group
from jax.sharding import Mesh, PartitionSpec as P

out = sys.argv[1]
me = process_group().rank
jax.distributed.initialize(os.environ["BATON_TEST_COORD"], num_processes=4, process_id=me)
W, OPT = 8, optax.sgd(0.1, momentum=0.9)

def init(key):
    ks = jax.random.split(key, 2)
    p = {"layers": [{"w": jax.random.normal(k, (W, W)) / np.sqrt(W), "b": jnp.zeros(W)}
                    for k in ks]}
    return p, OPT.init(p)

def loss(p, b):
    x = jnp.tanh(b["x"] @ p["layers"][0]["w"] + p["layers"][0]["b"])
    x = baton.stage_boundary(x)
    x = jnp.tanh(x @ p["layers"][1]["w"] + p["layers"][1]["b"])
    return jnp.mean((x - b["y"]) ** 2)

def step(p, s, b):
    v, g = baton.accumulate(jax.value_and_grad(loss), p, batch=b)
    u, s = OPT.update(g, s, p)
    return optax.apply_updates(p, u), s, v

def batch(i):
    k = jax.random.PRNGKey(i)
    return {"x": np.asarray(jax.random.normal(k, (8, W))), "y": np.full((8, W), 0.1, np.float32)}

mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("pipe", "data"))
specs = {"layers": [{"w": P("data", None), "b": P()}] * 2}
fn = baton.jit(step, mesh=baton.PipelineMesh(mesh, axis="pipe"), schedule="1f1b",
               microbatches=2, param_shardings=specs)
key = jax.random.PRNGKey(0)
fn.compile(*baton.abstract_state(init, key),
           {k: jax.ShapeDtypeStruct((8, W), jnp.float32) for k in ("x", "y")})
state = baton.init_stages(fn, init, key)
held = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
        if not isinstance(x, baton.Remote)]
losses = []
for i in range(2):
    *state, v = fn(*state, batch(i))
    state = tuple(state)
    losses.append(float(np.asarray(v)))
full = fn.gather(state)
path = os.path.join(out, "ckpt")
ckpt.save(path, 2, state, fn, data={"next": 2, "process": me}, wait=True)
back = ckpt.restore(path, fn=fn)
data = ckpt.restore_data(path, fn=fn)
same = [bool(np.array_equal(np.asarray(a), np.asarray(b)))
        for a, b in zip(jax.tree.leaves(fn.gather(back)), jax.tree.leaves(full))]
*_, live = fn(*state, batch(2))
*_, resumed = fn(*back, batch(2))
if me == 0:
    np.savez(os.path.join(out, "state.npz"),
             **{f"x{j}": np.asarray(x) for j, x in enumerate(jax.tree.leaves(full))})
json.dump(dict(losses=losses, ranks=fn.ranks, held=held, same=same, data=data,
               third=[float(np.asarray(live)), float(np.asarray(resumed))]),
          open(os.path.join(out, f"process{me}.json"), "w"))
jax.distributed.shutdown()
'''



def test_ranks_spanning_processes_init_checkpoint_and_restore(tmp_path, monkeypatch):
    for name, value in distributed_env().items():
        monkeypatch.setenv(name, value)
    got = run_workers(tmp_path, WORKER, nprocs=4)
    assert [g["ranks"] for g in got] == [[0], [0], [1], [1]]
    # each process made only its rank's leaves: layer 0 and its momentum on rank 0's two
    # processes, layer 1 on rank 1's
    for g in got:
        layer = g["ranks"][0]
        assert g["held"] and all(f"['layers'][{layer}]" in p for p in g["held"]), g["held"]
    for p, g in enumerate(got):
        # every leaf restored bit for bit; this process's own data position back
        assert g["same"] and all(g["same"]), (p, g["same"])
        assert g["data"] == {"next": 2, "process": p}, (p, g["data"])
        live, resumed = g["third"]
        assert live == resumed, (p, live, resumed)
    init, step, batch = _plain()
    state = jax.jit(init)(jax.random.PRNGKey(0))
    losses = []
    for i in range(3):
        *state, v = jax.jit(step)(*state, batch(i))
        losses.append(float(v))
        if i == 1:
            two = tuple(state)
    np.testing.assert_allclose(got[0]["losses"] + [got[0]["third"][1]], losses, rtol=1e-6)
    saved = np.load(tmp_path / "state.npz")
    plain = ckpt.restore(tmp_path / "ckpt", 2)  # every process's item, read by one process
    for j, (x, y) in enumerate(zip(jax.tree.leaves(two), jax.tree.leaves(plain))):
        np.testing.assert_allclose(saved[f"x{j}"], np.asarray(x), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(y), saved[f"x{j}"])


def _plain():
    """The worker's init, step and batches, run as plain JAX here."""
    ns: dict = {}
    src = WORKER[WORKER.index("W, OPT ="):WORKER.index("mesh = Mesh(")]
    exec("import numpy as np, jax, jax.numpy as jnp, optax, baton\n" + src, ns)
    return ns["init"], ns["step"], ns["batch"]
