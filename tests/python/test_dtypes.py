"""Typed PRNG keys and narrow dtypes in pipelined steps.

Typed key arrays (``jax.random.key``) in the batch drive dropout inside the stages, and a key
crosses a stage boundary with the activations; a float8 and an int4 value cross a boundary
too. Gradients, losses and updated parameters match plain JAX with the same keys (rtol 1e-5),
in one process and across three processes (``python -m baton.launch``).
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
import optax  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
D = 16
OPT = optax.adamw(1e-2, eps=1e-6, weight_decay=0.01)


def dropout(keys, x, rate=0.25):
    """Inverted dropout with one typed key per example."""
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1 - rate, x.shape[1:]))(keys)
    return jnp.where(keep, x / (1 - rate), 0.0)


def dropout_loss(params, batch):
    """Three stages. Each example's key is split in stage 0; one half drops out there, the
    other crosses the boundary with the activations and drops out in stage 1; stage 1 also
    sends a float8 copy of its activations and an int4 quantisation of them to stage 2."""
    k0, k1 = jax.vmap(lambda k: tuple(jax.random.split(k)))(batch["key"])
    x = dropout(k0, jnp.tanh(batch["x"] @ params["w"][0]))
    x, k1 = baton.stage_boundary((x, k1))
    x = dropout(k1, jnp.tanh(x @ params["w"][1]))
    q = jnp.clip(jnp.round(x * 7), -8, 7).astype(jnp.int4)  # no gradient through it
    x8 = x.astype(jnp.float8_e4m3fn)  # a gradient flows back through the cast
    x, x8, q = baton.stage_boundary((x, x8, q))
    x = jnp.tanh(x @ params["w"][2]) + x8.astype(jnp.float32) * q.astype(jnp.float32) / 7
    return ((x @ params["out"] - batch["y"]) ** 2).mean()


def init(key):
    ks = jax.random.split(key, 4)
    return {"w": [jax.random.normal(k, (D, D)) / np.sqrt(D) for k in ks[:3]],
            "out": jax.random.normal(ks[3], (D, 1)) / np.sqrt(D)}


def make_batch(n=16):
    ks = jax.random.split(jax.random.key(7), 3)
    return {"x": jax.random.normal(ks[0], (n, D)), "y": jax.random.normal(ks[1], (n, 1)),
            "key": jax.random.split(ks[2], n)}  # typed keys, one per example


def train_step(params, opt_state, batch):
    loss, grads = baton.accumulate(jax.value_and_grad(dropout_loss), params, batch=batch)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads


def reference_step(params, opt_state, batch):
    """Plain JAX over the same 4 microbatches (``accumulate`` outside ``baton.jit`` is a
    ``lax.scan``): the float8 cotangent rounds at the scale of a microbatch's mean, so the
    full-batch gradient differs from any microbatched one by float8 rounding."""
    loss, grads = baton.accumulate(jax.value_and_grad(dropout_loss), params, batch=batch,
                                   microbatches=4)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads


def run(fn, steps=2):
    params = init(jax.random.PRNGKey(0))
    st, batch = OPT.init(params), make_batch()
    out = []
    for _ in range(steps):
        params, st, loss, grads = fn(params, st, batch)
        out.append((loss, grads))
    return out, params


def compare(got, want):
    (hist_a, pa), (hist_b, pb) = got, want
    for (la, ga), (lb, gb) in zip(hist_a, hist_b, strict=True):
        np.testing.assert_allclose(np.asarray(la), np.asarray(lb), rtol=1e-5)
        for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_dropout_dies_without_keys():
    """The model really uses its keys: other keys, another loss."""
    params, batch = init(jax.random.PRNGKey(0)), make_batch()
    other = dict(batch, key=jax.random.split(jax.random.key(8), 16))
    assert float(dropout_loss(params, batch)) != float(dropout_loss(params, other))


@pytest.mark.parametrize("schedule,ranks", [(baton.OneFOneB(), 3), (baton.ZBH1(), 3),
                                            (baton.Interleaved1F1B(3), 1)],
                         ids=["1f1b", "zbh1", "interleaved-one-rank"])
def test_typed_keys_and_narrow_dtypes_one_process(schedule, ranks):
    mesh = baton.PipelineMesh(jax.devices()[:ranks], ranks=ranks)
    ps = baton.jit(train_step, mesh=mesh, schedule=schedule, microbatches=4)
    compare(run(ps), run(jax.jit(reference_step)))


WORKER = f"""
import os, sys
sys.path.insert(0, {str(HERE)!r})
import numpy as np, jax, baton
import test_dtypes as T
ps = baton.jit(T.train_step, schedule=baton.ZBH1(), microbatches=4, timeout=120)
hist, params = T.run(ps)
full = ps.gather(([g for _, g in hist], params))
rank = int(os.environ["BATON_RANK"])
if rank == 0:
    leaves = [np.asarray(l) for l, _ in hist] + [np.asarray(x) for x in jax.tree.leaves(full)]
    np.savez(os.path.join(sys.argv[1], "out.npz"), *leaves)
print(f"rank {{rank}} ok", flush=True)
"""


def test_typed_keys_across_processes(tmp_path):
    """Three ranks in three processes (Gloo): the key and the narrow values cross processes."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="1", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-m", "baton.launch", "--nprocs", "3", "--timeout",
                        "200", str(script), str(tmp_path)],
                       capture_output=True, text=True, timeout=240, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    got = np.load(tmp_path / "out.npz")
    hist, params = run(jax.jit(reference_step))
    want = [np.asarray(l) for l, _ in hist] + [np.asarray(x) for x in jax.tree.leaves(
        ([g for _, g in hist], params))]
    assert len(got.files) == len(want)
    for j, w in enumerate(want):
        np.testing.assert_allclose(got[f"arr_{j}"], w, rtol=1e-5, atol=1e-6, err_msg=f"leaf {j}")
