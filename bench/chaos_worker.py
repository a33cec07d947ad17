"""One process of a chaos / soak training run (started by bench/chaos.py or bench/soak.py with
the ``BATON_*`` launcher variables set, one process per pipeline rank, Gloo).

A 12-layer tanh MLP (dim 16) cut into one stage per process (2, 3 or 4), 1F1B, AdamW; the
batch of step i is a function of i alone, so a resumed run sees the batches a run that never
stopped saw. Checkpoints (``baton.checkpoint``) every ``--ckpt-every`` steps, asynchronous as
in examples/train_lm.py: the save of step i is started after step i and committed (its
``wait``) after step i + 1, so the write overlaps a step.

Markers on stdout (one line each, flushed), which the driver uses to place its faults:
``CHAOS <phase>-begin`` / ``CHAOS <phase>-end`` for the phases ``compile`` (connecting,
tracing and compiling the step), ``restore`` (reading the newest committed checkpoint),
``save`` (from the save call to its commit); ``CHAOS step <i> <loss as float.hex>`` after each
step; ``CHAOS done <sha256 of the gathered final state>``. A Baton error ends the process with
code 3 and the line ``CHAOS error <type>: <message>``.

Test-only hook: ``CHAOS_SAVE_HOOK=<event>:<step>:<signal>`` makes this process send itself
``signal`` (KILL or STOP) at ``event`` (``writing``, ``written`` or ``commit``, the points of
``baton.checkpoint.commit._test_hook``) of the save of ``step``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import baton  # noqa: E402
from baton import checkpoint as ckpt  # noqa: E402

LAYERS, DIM, M = 12, 16, 4
OPT = optax.adamw(1e-2, eps=1e-6, weight_decay=0.01)


def mark(text: str) -> None:
    os.write(1, f"CHAOS {text}\n".encode())


def init_params():
    ks = jax.random.split(jax.random.PRNGKey(0), LAYERS)
    return {"layers": [{"w": jax.random.normal(k, (DIM, DIM)) / np.sqrt(DIM),
                        "b": jnp.zeros((DIM,))} for k in ks]}


def batch(i):
    kx, ky = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(42), i))
    return jax.random.normal(kx, (4 * M, DIM)), jnp.sin(jax.random.normal(ky, (4 * M, DIM)))


def make_step(stages):
    def loss_fn(params, b):
        x, y = b
        for i, p in enumerate(params["layers"]):
            x = jnp.tanh(x @ p["w"] + p["b"])
            if (i + 1) % (LAYERS // stages) == 0 and i < LAYERS - 1:
                x = baton.stage_boundary(x)
        return jnp.mean((x - y) ** 2)

    vg = jax.value_and_grad(loss_fn)

    def step(params, opt_state, b):
        loss, grads = baton.accumulate(vg, params, batch=b)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def install_save_hook(spec: str) -> None:
    event, step, sig = spec.split(":")
    signum = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}[sig]

    def hook(ev, **info):
        if ev == event and info.get("step") == int(step):
            mark(f"hook {ev} {step} {sig}")
            os.kill(os.getpid(), signum)

    ckpt.commit._test_hook = hook


def digest(tree) -> str:
    h = hashlib.sha256()
    for x in jax.tree.leaves(tree):
        a = np.asarray(x)
        h.update(str((a.dtype, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def run(a) -> None:
    from baton.running.distributed import process_group

    mark("compile-begin")
    world = process_group(connect_timeout=a.timeout).world_size
    ps = baton.jit(make_step(world), schedule=baton.OneFOneB(), microbatches=M,
                   timeout=a.timeout)
    p = init_params()
    state = (p, OPT.init(p))
    ps.compile(*state, batch(0))
    mark("compile-end")
    start = 0
    if a.ckpt and a.resume:
        last = ckpt.latest_step(a.ckpt)
        if last is not None:
            mark(f"restore-begin {last}")
            state = ckpt.restore(a.ckpt, last, fn=ps)
            mark("restore-end")
            start = last
    mark(f"start {start}")
    pending = None
    for i in range(start + 1, a.steps + 1):
        *state, loss = ps(*state, batch(i))
        mark(f"step {i} {float(loss).hex()}")
        if pending is not None:
            pending.wait()
            mark(f"save-end {pending.step}")
            pending = None
        if a.ckpt and a.ckpt_every and i % a.ckpt_every == 0 and i < a.steps:
            mark(f"save-begin {i}")
            pending = ckpt.save(a.ckpt, i, tuple(state), ps, overwrite=True)
    if pending is not None:
        pending.wait()
        mark(f"save-end {pending.step}")
    full = ps.gather(tuple(state))
    mark(f"done {digest(full)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ckpt", help="checkpoint directory")
    ap.add_argument("--ckpt-every", type=int, default=3)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--timeout", type=float, default=10.0,
                    help="seconds a transfer (and the connect) may wait")
    a = ap.parse_args(argv)
    if os.environ.get("CHAOS_SAVE_HOOK"):
        install_save_hook(os.environ["CHAOS_SAVE_HOOK"])
    try:
        run(a)
    except baton.BatonError as e:
        msg = " ".join(str(e).split())
        mark(f"error {type(e).__name__}: {msg}")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
