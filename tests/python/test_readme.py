"""The README's pipelining example runs as written and matches plain JAX."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _example_source() -> str:
    text = README.read_text()
    section = text[text.index("## Pipelining a JAX training step"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_pipelining_example_matches_reference():
    k = jax.random.split(jax.random.key(0), 6)
    params = {"layers": [jax.random.normal(k[i], (16, 16)) * 0.3 for i in range(4)]}
    batch = {"x": jax.random.normal(k[4], (32, 16)), "y": jax.random.normal(k[5], (32, 16))}
    opt_state = optax.adamw(1e-3).init(params)
    ns = {"params": params, "opt_state": opt_state, "batch": batch}
    exec(compile(_example_source(), str(README), "exec"), ns)  # noqa: S102 - our own README

    def ref_loss(p, b):
        x = b["x"]
        for layer in p["layers"]:
            x = jax.nn.relu(x @ layer)
        return ((x - b["y"]) ** 2).mean()

    loss, grads = jax.value_and_grad(ref_loss)(params, batch)
    opt = optax.adamw(1e-3)
    updates, _ = opt.update(grads, opt.init(params), params)
    ref_params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(ns["loss"], loss, rtol=1e-5)
    for got, want in zip(ns["params"]["layers"], ref_params["layers"]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert "verification: OK" in ns["train_step"].summary(params, opt_state, batch)
    assert jnp.isfinite(ns["loss"])
