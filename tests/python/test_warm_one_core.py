"""The code after the loop, compiled ahead on a process with one core (``emit/warm.py``).

One launch of 2 processes (one pipeline rank each, Gloo), each pinned to one core before JAX
starts: the process builds its rank program and then compiles its segments after the loop
in the same thread (``Warmup(background=False)``, no warm-up thread), so the step's first
call compiles nothing once its loop is done. The losses and new parameters equal plain JAX's.
"""

from __future__ import annotations

import json
import os
import pathlib

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
OPT = optax.adamw(1e-2, weight_decay=0.01)


def loss_fn(params, batch):
    import baton

    x, y = batch
    h = jnp.tanh(x @ params[0])
    h = baton.stage_boundary(h)
    h = jnp.tanh(h @ params[1])
    return jnp.mean((h - y) ** 2)


def make_args():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(3), 3)
    params = [jax.random.normal(k1, (16, 32)) * 0.1, jax.random.normal(k2, (32, 16)) * 0.1]
    batch = (jax.random.normal(k3, (8, 16)), jnp.zeros((8, 16)))
    return params, OPT.init(params), batch


def worker_main(out: str) -> None:
    import baton
    from baton.running import step as step_mod
    from baton.emit import warm

    p = int(os.environ["BATON_RANK"])
    background, post_compiles, in_post = [], [], [False]
    init = warm.Warmup.__init__

    def record(self, *a, **kw):
        background.append(kw.get("background", True))
        init(self, *a, **kw)

    warm.Warmup.__init__ = record
    run_segments = step_mod.CompiledStep._run_segments

    def segments(step, segs, *a, **kw):
        in_post[0] = segs is step.post_segments
        try:
            return run_segments(step, segs, *a, **kw)
        finally:
            in_post[0] = False

    step_mod.CompiledStep._run_segments = segments
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: post_compiles.append(name)
        if in_post[0] and ("backend_compile" in name or "cache_retrieval" in name) else None)

    def step(params, opt_state, batch):
        loss, grads = baton.accumulate(jax.value_and_grad(loss_fn), params, batch=batch)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    fn = baton.jit(step, schedule=baton.OneFOneB(), microbatches=4, timeout=60)
    params, opt_state, loss = fn(*make_args())
    params = fn.gather(params)
    res = {"cores": len(os.sched_getaffinity(0)), "background": background,
           "post_compiles": post_compiles, "loss": float(jax.device_get(fn.gather(loss))),
           "params": [np.asarray(q).tolist() for q in params]}
    pathlib.Path(out, f"process{p}.json").write_text(json.dumps(res))


WORKER = f"""
import os, sys
os.sched_setaffinity(0, {{int(os.environ["BATON_RANK"]) % os.cpu_count()}})
sys.path.insert(0, {str(HERE)!r})
import test_warm_one_core as T
T.worker_main(sys.argv[1])
"""


def test_one_core_process_compiles_the_code_after_the_loop_before_its_loop(tmp_path):
    from baton import _jax_compat as jc

    from launched import run_workers

    res = run_workers(tmp_path, WORKER)

    def plain(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), loss

    want_params, want_loss = jax.jit(plain)(*make_args())
    for r in res:
        assert r["cores"] == 1 and r["background"] == [False], r["background"]
        if jc.jax_version >= (0, 12):  # (JAX 0.11: no warm-up, warm.py)
            assert r["post_compiles"] == [], r["post_compiles"]
        np.testing.assert_allclose(r["loss"], float(want_loss), rtol=1e-6)
        for got, want in zip(r["params"], want_params):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
