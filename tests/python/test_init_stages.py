"""Per-stage initialization (``baton.init_stages``): a step compiled from abstract arguments,
each process making only the parameters and optimizer state of its own stages.

In one process (4 CPU devices, one rank each): the leaves equal a full ``jax.jit(init)``, each
on its rank's device; Flax linen's init and an NNX model's state work as is; an init whose leaves differ from what the
step was compiled for is refused naming the leaf. Launched (4 processes, one rank each): the
model's training state is 4 x a process's share and each process's measured peak resident
memory stays within its own share plus a stated margin, and the trained parameters equal plain
JAX's.
"""

from __future__ import annotations

import os
import pathlib
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from launched import run_workers  # noqa: E402

STAGES = 4
OPT = optax.sgd(0.05, momentum=0.9)


def make(width: int, layers_per_stage: int = 1):
    """(init, step, batch spec) of a tanh MLP of STAGES stages of square layers."""
    n = STAGES * layers_per_stage

    def init(key):
        ks = jax.random.split(key, n)
        p = {"layers": [{"w": jax.random.normal(k, (width, width)) / np.sqrt(width),
                         "b": jnp.zeros(width)} for k in ks]}
        return p, OPT.init(p)

    def loss(p, b):
        x = b["x"]
        for i, layer in enumerate(p["layers"]):
            x = jnp.tanh(x @ layer["w"] + layer["b"])
            if (i + 1) % layers_per_stage == 0 and i < n - 1:
                x = baton.stage_boundary(x)
        return jnp.mean((x - b["y"]) ** 2)

    def step(p, s, b):
        v, g = baton.accumulate(jax.value_and_grad(loss), p, batch=b)
        u, s = OPT.update(g, s, p)
        return optax.apply_updates(p, u), s, v

    spec = {k: jax.ShapeDtypeStruct((8, width), jnp.float32) for k in ("x", "y")}
    return init, step, spec


def batch_of(width: int, i: int) -> dict:
    k = jax.random.PRNGKey(100 + i)
    return {"x": jax.random.normal(k, (8, width)), "y": jnp.zeros((8, width)) + 0.1}


def test_init_stages_one_process():
    init, step, spec = make(16)
    fn = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:4], ranks=4), microbatches=4)
    key = jax.random.PRNGKey(0)
    fn.compile(*baton.abstract_state(init, key), spec)
    state = baton.init_stages(fn, init, key)
    full = jax.jit(init)(key)
    homes = baton.leaf_homes(fn, 2)
    for (path, x), y, h in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                               jax.tree.leaves(full), homes):
        assert np.array_equal(np.asarray(x), np.asarray(y)), path
        assert x.sharding.device_set == {jax.devices()[h.owner]}, (path, h)
    # layer i's weights and their momentum live on stage i's rank
    assert [h.stages for h in homes] == [(0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,)] * 2
    assert homes[8].path == "[1][0].trace['layers'][0]['b']"
    p, s, v = fn(*state, batch_of(16, 0))
    ref = jax.jit(lambda p, s, b: step(p, s, b))  # (accumulate is a lax.scan outside)
    rp, rs, rv = ref(*full, batch_of(16, 0))
    np.testing.assert_allclose(np.asarray(v), np.asarray(rv), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(rp)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_init_stages_refuses_other_shapes():
    init, step, spec = make(16)
    fn = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:4], ranks=4), microbatches=4)
    key = jax.random.PRNGKey(0)
    with pytest.raises(baton.ConfigError, match="compile it from abstract arguments"):
        baton.init_stages(fn, init, key)
    fn.compile(*baton.abstract_state(init, key), spec)
    wide, _, _ = make(24)
    with pytest.raises(baton.ConfigError,
                       match=r"leaf \[0\]\['layers'\]\[0\]\['b'\] .* float32\[24\] but the step "
                             r"was compiled for float32\[16\]"):
        baton.init_stages(fn, wide, key)
    with pytest.raises(baton.ConfigError, match="structure"):
        baton.init_stages(fn, lambda k: ({"layers": []}, ()), key)


def test_init_stages_flax_linen():
    """A Flax linen model's own ``init``, restricted to each stage's leaves."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(2):
                x = jnp.tanh(nn.Dense(8, name=f"d{i}")(x))
                if i == 0:
                    x = baton.stage_boundary(x)
            return x

    model = Block()
    x0 = jnp.ones((4, 8))
    opt = optax.sgd(0.1)

    def init(key):
        p = model.init(key, x0)
        return p, opt.init(p)

    def step(p, s, b):
        v, g = baton.accumulate(jax.value_and_grad(
            lambda p, b: jnp.mean((model.apply(p, b["x"]) - b["y"]) ** 2)), p, batch=b)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, v

    fn = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:2], ranks=2), microbatches=2)
    key = jax.random.PRNGKey(3)
    fn.compile(*baton.abstract_state(init, key),
               {"x": jax.ShapeDtypeStruct((4, 8), jnp.float32),
                "y": jax.ShapeDtypeStruct((4, 8), jnp.float32)})
    state = baton.init_stages(fn, init, key)
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(jax.jit(init)(key))):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    devs = {jax.tree_util.keystr(p): x.sharding.device_set
            for p, x in jax.tree_util.tree_flatten_with_path(state[0])[0]}
    assert devs["['params']['d0']['kernel']"] == {jax.devices()[0]}
    assert devs["['params']['d1']['kernel']"] == {jax.devices()[1]}



def test_init_stages_flax_nnx():
    """An NNX model's state (``nnx.state(Model(rngs=nnx.Rngs(key)), nnx.Param)``) from a typed
    key, each layer made on its own rank."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(8, 8, rngs=rngs)
            self.b = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.b(baton.stage_boundary(jnp.tanh(self.a(x)))))

    graphdef = nnx.graphdef(Model(nnx.Rngs(0)))

    def init(key):
        return nnx.state(Model(nnx.Rngs(key)), nnx.Param)

    def step(p, b):
        def loss(p, b):
            return jnp.mean((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2)

        v, g = baton.accumulate(jax.value_and_grad(loss), p, batch=b)
        return jax.tree.map(lambda a, d: a - 0.1 * d, p, g), v

    fn = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:2], ranks=2), microbatches=2)
    key = jax.random.key(1)
    fn.compile(baton.abstract_state(init, key),
               {k: jax.ShapeDtypeStruct((4, 8), jnp.float32) for k in ("x", "y")})
    state = baton.init_stages(fn, init, key)
    devs = {}
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                            jax.tree.leaves(jax.jit(init)(key))):
        assert np.array_equal(np.asarray(x), np.asarray(y)), path
        devs[jax.tree_util.keystr(path)] = x.sharding.device_set
    assert devs["['a']['kernel'].value"] == {jax.devices()[0]}
    assert devs["['b']['kernel'].value"] == {jax.devices()[1]}

WIDTH = 3072  # three 3072 x 3072 fp32 layers per stage: 108 MB of parameters, 216 MB with momentum
STEPS = 3

WORKER = f'''
import json, os, sys
import numpy as np


def hwm_mb():
    """This process's peak resident memory so far (VmHWM), MB."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024


import jax
import baton
sys.path.insert(0, {str(pathlib.Path(__file__).resolve().parent)!r})
from test_init_stages import STEPS, WIDTH, batch_of, make

out = sys.argv[1]
init, step, spec = make(WIDTH, layers_per_stage=3)
fn = baton.jit(step, schedule="1f1b", microbatches=4, donate_argnums=(0, 1),
               retain_host_memory=False)
key = jax.random.PRNGKey(0)
jax.block_until_ready(jax.jit(lambda k: k + 1)(jax.numpy.zeros(2)))
base = hwm_mb()                      # JAX imported, its CPU client up
fn.compile(*baton.abstract_state(init, key), spec)
compiled = hwm_mb()                  # traced and planned from shapes alone
state = baton.init_stages(fn, init, key)
jax.block_until_ready([x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)])
inited = hwm_mb()
read = []
for i in range(STEPS):
    b = baton.data.feed(fn, 2, lambda: read.append(i) or batch_of(WIDTH, i))
    *state, loss = fn(*state, b)
    state = tuple(state)
trained = hwm_mb()
me = fn.rank
mine = {{jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
        if not isinstance(x, baton.Remote)}}
np.savez(os.path.join(out, f"leaves{{me}}.npz"), **{{f"x{{j}}": v for j, v in
                                                     enumerate(mine.values())}})
own = sum(v.nbytes for v in mine.values())
json.dump(dict(rank=me, base=base, compiled=compiled, inited=inited, trained=trained,
               own_mb=own / 2**20, paths=list(mine), read=read),
          open(os.path.join(out, f"process{{me}}.json"), "w"))
'''


def test_launched_memory_stays_per_stage(tmp_path):
    """4 processes, one rank (stage) each. The training state (parameters + SGD's momentum,
    864 MB) is 4 x a process's share (216 MB); measured against VmHWM:

    * after ``init_stages``: peak growth over the compiled-from-shapes baseline <= 2 x own
      share + 16 MB (the init's own temporaries: random bits, XLA:CPU at the tests' O0;
      measured 1.9 x; a full init would add at least the whole state, 4 x);
    * after 3 steps (XLA compiles, gradients, the update in place): peak growth over the
      baseline after JAX started <= 3 x own share (the state, its gradients) + 160 MB (stated
      margin for XLA:CPU's compiler and the runtime): 808 MB, less than the whole state's
      864 MB (measured: 555-582 MB; glibc returns freed memory: retain_host_memory=False).

    The processes that do not read the batch (middle stages) never call the reader, and the
    trained parameters equal plain JAX's."""
    got = run_workers(tmp_path, WORKER, nprocs=4)
    init, step, _ = make(WIDTH, layers_per_stage=3)
    full_state = jax.jit(init)(jax.random.PRNGKey(0))
    total_mb = sum(x.nbytes for x in jax.tree.leaves(full_state)) / 2**20
    for g in got:
        own = g["own_mb"]
        assert total_mb > 3.9 * own, (total_mb, g)
        cap = 3 * own + 160
        assert cap < total_mb, (cap, total_mb)
        assert g["inited"] - g["compiled"] <= 2 * own + 16, g
        assert g["trained"] - g["base"] <= cap, g
    # the first stage reads the inputs, the last the targets; the middle stages nothing
    assert [g["read"] for g in got] == [[0, 1, 2], [], [], [0, 1, 2]]
    ref = jax.jit(step)
    state = full_state
    for i in range(STEPS):
        *state, _ = ref(*state, batch_of(WIDTH, i))
    paths = {jax.tree_util.keystr(p): np.asarray(x)
             for p, x in jax.tree_util.tree_flatten_with_path(tuple(state))[0]}
    seen = set()
    for g in got:
        leaves = np.load(tmp_path / f"leaves{g['rank']}.npz")
        for j, p in enumerate(g["paths"]):
            np.testing.assert_allclose(leaves[f"x{j}"], paths[p], rtol=1e-5, atol=1e-6,
                                       err_msg=p)
            seen.add(p)
    assert seen == set(paths)
