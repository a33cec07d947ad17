"""baton.checkpoint: Orbax checkpoints of pipelined training state.

A 4-layer MLP (``{"layers": [{"w", "b"}] * 4}``) whose stage boundaries depend only on the
number of stages, so one parameter tree runs as 4 stages (1F1B on 4 ranks, interleaved 1F1B
on 2), 2 stages (1F1B on 2 ranks) or plain JAX. Each step reads its own batch (same data
order in every run), AdamW.

* Saved by 4 ranks in 2 processes (``baton.launch --nprocs 2``, each process 2 ranks of one
  device: ``PipelineMesh(jax.local_devices()[:2], ranks=2)``), restored there (resume), on 2
  ranks in one process, and as plain JAX: parameters and optimizer state bit-identical to what
  the run held (``step.gather``).
* Resuming from step 3 of 6 gives the uninterrupted run's losses and final state bit for bit
  (2 processes x 2 ranks; 2 ranks in one process, also onto another schedule).
* A checkpoint that does not match the target model raises ``baton.ConfigError`` naming the
  parameter path.
* A process SIGKILLed in the middle of a save (its Orbax write in flight; or process 0 just
  before the commit marker) leaves the previous checkpoint restorable and the partial one
  ignored (and replaced by the next save of that step).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402
from baton import checkpoint as ckpt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
OPT = optax.adamw(1e-2, eps=1e-6, weight_decay=0.01)
DIM, LAYERS, M, STEPS, SAVE_AT = 16, 4, 4, 6, 3


def init_params(layers=LAYERS, dim=DIM):
    ks = jax.random.split(jax.random.PRNGKey(0), layers)
    return {"layers": [{"w": jax.random.normal(k, (dim, dim)) / np.sqrt(dim),
                        "b": jnp.zeros((dim,))} for k in ks]}


def batch(i, dim=DIM):
    kx, ky = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(42), i))
    return jax.random.normal(kx, (4 * M, dim)), jnp.sin(jax.random.normal(ky, (4 * M, dim)))


def make_step(stages, microbatches=None):
    def loss_fn(params, b):
        x, y = b
        n = len(params["layers"])
        for i, p in enumerate(params["layers"]):
            x = jnp.tanh(x @ p["w"] + p["b"])
            if (i + 1) % (n // stages) == 0 and i < n - 1:
                x = baton.stage_boundary(x)
        return jnp.mean((x - y) ** 2)

    vg = jax.value_and_grad(loss_fn)

    def step(params, opt_state, b):
        loss, grads = baton.accumulate(vg, params, batch=b, microbatches=microbatches)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def pipelined(ranks, schedule=None, first=0):
    """A baton.jit step on ``ranks`` ranks of this process, compiled (not run)."""
    schedule = schedule or baton.OneFOneB()
    ps = baton.jit(make_step(schedule.stages(ranks)), schedule=schedule, microbatches=M,
                   mesh=baton.PipelineMesh(jax.devices()[first:first + ranks], ranks=ranks))
    p = init_params()
    ps.compile(p, OPT.init(p), batch(0))
    return ps


def train(ps, state, start, stop, path=None):
    """Steps ``start + 1 .. stop`` (step i reads batch(i)); saves after step SAVE_AT."""
    losses = []
    for i in range(start + 1, stop + 1):
        *state, loss = ps(*state, batch(i))
        losses.append(np.asarray(loss))
        if path is not None and i == SAVE_AT:
            ckpt.save(path, i, tuple(state), ps)  # async: committed by the next save / wait
    return tuple(state), np.array(losses)


def leaves_equal(got, want, what):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want), what
    for j, (g, w) in enumerate(zip(got, want)):
        assert np.asarray(g).dtype == np.asarray(w).dtype, (what, j)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{what} leaf {j}")


# -- launched workers ------------------------------------------------------------------------
def worker_main(mode: str, outdir: str, k: int) -> None:
    """Process ``me`` of ``world``, running ``k`` ranks (global ranks me*k .. me*k+k-1)."""
    from baton.running.distributed import process_group

    me, world = process_group().rank, process_group().world_size
    out = pathlib.Path(outdir)
    path = out / "ckpt"
    ps = baton.jit(make_step(world * k), schedule=baton.OneFOneB(), microbatches=M, timeout=30,
                   mesh=baton.PipelineMesh(jax.local_devices()[:k], ranks=k))
    p = init_params()
    state = (p, OPT.init(p))
    if mode == "train":
        state3, l1 = train(ps, state, 0, SAVE_AT, path)
        full3 = ps.gather(state3)
        state6, l2 = train(ps, state3, SAVE_AT, STEPS)
        t0 = time.monotonic()
        h = ckpt.save(path, STEPS, state6, ps)
        h.wait()
        save_s = time.monotonic() - t0
        full6 = ps.gather(state6)
        # resume: restore step 3 onto this layout (other ranks' leaves are Remote)
        ps.compile(*state, batch(0))
        restored = ckpt.restore(path, SAVE_AT, fn=ps)
        for j, x in enumerate(jax.tree.leaves(restored[0])):
            held = not isinstance(x, baton.Remote)
            # layer j // 2 is stage j // 2's, on rank j // 2, of process j // 2 // k
            assert held == (j // 2 // k == me), (me, j, x)
            assert held or x.rank == j // 2, (me, j, x)
        leaves_equal(ps.gather(restored), full3, "restored in place")
        resumed, l3 = train(ps, restored, SAVE_AT, STEPS)
        ckpt.save(path, 60, resumed, ps)
        ckpt.wait_until_finished()  # (a save in flight when the program ends is not committed)
        np.save(out / f"losses-process{me}.npy", np.concatenate([l1, l2]))
        np.save(out / f"resumed-process{me}.npy", l3)
        if me == 0:
            np.savez(out / "step3.npz", *[np.asarray(x) for x in jax.tree.leaves(full3)])
            np.savez(out / "step6.npz", *[np.asarray(x) for x in jax.tree.leaves(full6)])
        print(f"process {me} ok (save + commit of step 6: {save_s:.2f} s)", flush=True)
        return
    # kill-<event>-<rank>: step 1 saved and committed; during the save of step 2 process
    # <rank> kills itself at <event> of the save
    _, event, victim = mode.split("-")
    state, _ = train(ps, state, 0, 1)
    ckpt.save(path, 1, state, ps, wait=True)
    full1 = ps.gather(state)
    if me == 0:
        np.savez(out / "step1.npz", *[np.asarray(x) for x in jax.tree.leaves(full1)])
    state, _ = train(ps, state, 1, 2)

    def hook(ev, **info):
        if ev == event and me == int(victim):
            os.write(1, f"rank {me} killing itself at {ev}\n".encode())
            os.kill(os.getpid(), 9)

    ckpt.commit._test_hook = hook
    ckpt.save(path, 2, state, ps, wait=True)
    print(f"rank {me} saved step 2 (unexpected)", flush=True)


WORKER = f"""
import os, sys
sys.path.insert(0, {str(HERE)!r})
import baton
import test_checkpoint as T
try:
    T.worker_main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
except baton.BatonError as e:
    os.write(1, f"rank {{os.environ['BATON_RANK']}} ERROR {{type(e).__name__}}: {{e}}\\n".encode())
    os._exit(3)
"""


def launch(tmp_path, nprocs, mode, k=1, timeout=240):
    """``nprocs`` processes of ``k`` ranks (one CPU device each)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(k), JAX_PLATFORMS="cpu")
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "baton.launch", "--nprocs", str(nprocs), "--grace", "20",
         "--timeout", str(timeout - 15), str(script), mode, str(tmp_path), str(k)],
        capture_output=True, text=True, timeout=timeout, env=env)
    return p, time.monotonic() - t0


def reference(steps):
    """Plain JAX: ``accumulate`` outside baton.jit is a lax.scan over the same microbatches."""
    ref = jax.jit(make_step(1, microbatches=M))
    p = init_params()
    state, losses = (p, OPT.init(p)), []
    for i in range(1, steps + 1):
        *state, loss = ref(*state, batch(i))
        losses.append(np.asarray(loss))
    return tuple(state), np.array(losses)


def test_save_on_four_ranks_restore_on_two_ranks_and_plain_jax(tmp_path):
    """Saved by 4 ranks in 2 processes (2 ranks each)."""
    p, elapsed = launch(tmp_path, 2, "train", k=2)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    path = tmp_path / "ckpt"
    assert ckpt.all_steps(path) == [SAVE_AT, STEPS, 60]  # 60: the resumed run's step 6
    meta = ckpt.metadata(path, STEPS)
    assert meta["plan"]["ranks"] == 4 and meta["processes"] == 2
    assert meta["items"] == ["process-0", "process-1"]  # each wrote its own stages
    assert meta["stage_map"]["2"][:2] == ["[0]['layers'][2]['b']", "[0]['layers'][2]['w']"]
    by_path = {m["path"]: m for m in meta["leaves"]}
    for layer in range(LAYERS):  # under the item of the rank of its stage, in its process
        m = by_path[f"[1][0].mu['layers'][{layer}]['w']"]
        assert (m["rank"], m["process"]) == (layer, layer // 2), m
    # resumed in the 2 processes from step 3: the uninterrupted losses, bit for bit
    losses = np.load(tmp_path / "losses-process0.npy")
    for q in range(2):
        np.testing.assert_array_equal(np.load(tmp_path / f"losses-process{q}.npy"), losses)
        np.testing.assert_array_equal(np.load(tmp_path / f"resumed-process{q}.npy"),
                                      losses[SAVE_AT:])
    saved = {s: list(np.load(tmp_path / f"step{s}.npz").values()) for s in (SAVE_AT, STEPS)}
    p0 = init_params()
    # the resumed run's final state (saved as step 60) is the uninterrupted one's
    leaves_equal(ckpt.restore(path, 60, target=(p0, OPT.init(p0))), saved[STEPS], "resumed")
    for s in (SAVE_AT, STEPS):
        # plain JAX, in the target's structure, and with no target (nested dicts and lists)
        leaves_equal(ckpt.restore(path, s, target=(p0, OPT.init(p0))), saved[s], f"plain {s}")
        full = ckpt.restore(path, s)
        assert len(full) == 2 and len(full[0]["layers"]) == LAYERS
        leaves_equal(full[0], saved[s][: 2 * LAYERS], f"untyped {s}")
    # 2 ranks in this process (2 stages: layers re-split), from step 3: bit-identical state,
    # placed on the rank of each layer's stage; then 3 more steps
    ps2 = pipelined(2)
    state = ckpt.restore(path, SAVE_AT, fn=ps2)
    leaves_equal(state, saved[SAVE_AT], "2 ranks")
    for j, layer in enumerate(state[0]["layers"]):
        dev = ps2.mesh.rank_devices[j // 2][0]
        assert layer["w"].sharding.device_set == {dev}, (j, layer["w"].sharding)
        assert state[1][0].mu["layers"][j]["w"].sharding.device_set == {dev}
    state, l2 = train(ps2, state, SAVE_AT, STEPS)
    np.testing.assert_allclose(l2, losses[SAVE_AT:], rtol=1e-6)
    # plain JAX (jax.value_and_grad, one device) over the same 6 steps
    ref_state, ref_losses = reference(STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for g, w in zip(saved[STEPS], jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(g, np.asarray(w), rtol=1e-5, atol=1e-6)
    print(f"2 processes x 2 ranks: {elapsed:.1f} s; {out.strip().splitlines()[-1]}")


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """6 steps on 2 ranks (1F1B) in this process, saved after step 3 and step 6."""
    path = tmp_path_factory.mktemp("ckpt2")
    ps = pipelined(2)
    p = init_params()
    state3, l1 = train(ps, (p, OPT.init(p)), 0, SAVE_AT, path)
    state6, l2 = train(ps, state3, SAVE_AT, STEPS)
    ckpt.save(path, STEPS, state6, ps, wait=True)
    return path, ps, jax.device_get(state3), np.concatenate([l1, l2])


def test_resume_from_step_3_of_6_bit_identical(two_rank_run):
    path, _, state3, losses = two_rank_run
    assert ckpt.latest_step(path) == STEPS
    for sched in (baton.OneFOneB(), baton.Interleaved1F1B(virtual_stages=2)):
        ps = pipelined(2, sched, first=2)  # a fresh step (another schedule, other devices)
        state = ckpt.restore(path, SAVE_AT, fn=ps)
        leaves_equal(state, state3, type(sched).__name__)
        _, resumed = train(ps, state, SAVE_AT, STEPS)
        np.testing.assert_array_equal(resumed, losses[SAVE_AT:], err_msg=type(sched).__name__)


def test_mismatched_model_raises_config_error(two_rank_run):
    path, _, _, _ = two_rank_run
    # a 3-layer model (3 stages): the checkpoint has a layer it lacks
    ps3 = baton.jit(make_step(3), schedule=baton.OneFOneB(), microbatches=M,
                    mesh=baton.PipelineMesh(jax.devices()[:3], ranks=3))
    p3 = init_params(layers=3)
    ps3.compile(p3, OPT.init(p3), batch(0))
    with pytest.raises(baton.ConfigError, match=r"\[0\]\['layers'\]\[3\]\['b'\]"):
        ckpt.restore(path, fn=ps3)
    # another width: the shape names the path
    p8 = init_params(dim=8)
    with pytest.raises(baton.ConfigError,
                       match=r"\[0\]\['layers'\]\[0\]\['b'\] is float32\[16\] in the checkpoint "
                             r"but float32\[8\]"):
        ckpt.restore(path, target=(p8, OPT.init(p8)))
    # a parameter the checkpoint does not have
    p4 = init_params()
    p4["layers"][1]["scale"] = jnp.ones((DIM,))
    with pytest.raises(baton.ConfigError,
                       match=r"\[0\]\['layers'\]\[1\]\['scale'\] of the target model is not in "
                             r"the checkpoint of step 6 .* "
                             r"\(it has e\.g\. \[0\]\['layers'\]\[1\]\['b'\]"):
        ckpt.restore(path, target=(p4, OPT.init(p4)))
    # the same tree cut into 4 stages: restorable (re-split), but not with same_stages
    ps4 = pipelined(2, baton.Interleaved1F1B(virtual_stages=2))
    ckpt.restore(path, fn=ps4)
    with pytest.raises(baton.ConfigError,
                       match=r"stage map does not match: \[0\]\['layers'\]\[1\]\['b'\] was saved "
                             r"from stage\(s\) \[0\] but the target step reads it on stage\(s\) "
                             r"\[1\]"):
        ckpt.restore(path, fn=ps4, same_stages=True)
    # a step that has not been compiled, a step that was never saved
    with pytest.raises(baton.ConfigError, match="not been compiled"):
        ckpt.restore(path, fn=baton.jit(make_step(2), schedule=baton.OneFOneB(), microbatches=M,
                                        mesh=baton.PipelineMesh(jax.devices()[:2], ranks=2)))
    with pytest.raises(baton.ConfigError, match="no checkpoint of step 4"):
        ckpt.restore(path, 4)


@pytest.mark.parametrize("event,victim", [("writing", 1), ("commit", 0)])
def test_killed_during_save_leaves_previous_checkpoint(tmp_path, event, victim):
    """Process ``victim`` of 2 SIGKILLs itself while saving step 2: during its Orbax write, or
    (process 0) with every item written, just before the commit marker."""
    p, elapsed = launch(tmp_path, 2, f"kill-{event}-{victim}", timeout=180)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and f"rank {victim} killing itself at {event}" in out, out[-6000:]
    assert "saved step 2 (unexpected)" not in out, out[-6000:]
    assert elapsed < 100, f"took {elapsed:.1f} s"
    path = tmp_path / "ckpt"
    assert (path / "2").is_dir()  # the partial step is there, and ignored
    assert ckpt.all_steps(path) == [1] and ckpt.latest_step(path) == 1
    with pytest.raises(baton.ConfigError, match="step 2 .* was not committed"):
        ckpt.restore(path, 2)
    p0 = init_params()
    step1 = list(np.load(tmp_path / "step1.npz").values())
    leaves_equal(ckpt.restore(path, target=(p0, OPT.init(p0))), step1, "step 1")
    # the next save of step 2 replaces the partial one
    ckpt.save(path, 2, (p0, OPT.init(p0)), wait=True)
    assert ckpt.latest_step(path) == 2
    leaves_equal(ckpt.restore(path, target=(p0, OPT.init(p0))), (p0, OPT.init(p0)), "step 2")


def test_restore_into_tensor_parallel_ranks(two_rank_run, tmp_path):
    """Onto pipe 2 x tensor 2 (each weight split over its rank's two devices): every array in
    the step's own sharding, bit-identical; saved from there (sharded arrays) and read back as
    plain JAX, bit-identical again."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    path, _, state3, _ = two_rank_run
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("pipe", "tensor"))
    specs = {"layers": [{"w": P(None, "tensor"), "b": P("tensor")}] * LAYERS}
    ps = baton.jit(make_step(2), schedule=baton.OneFOneB(), microbatches=M,
                   mesh=baton.PipelineMesh(mesh), param_shardings=specs, engine="interpreter")
    p = init_params()
    ps.compile(p, OPT.init(p), batch(0))
    state = ckpt.restore(path, SAVE_AT, fn=ps)
    leaves_equal(state, state3, "tensor parallel")
    for j, layer in enumerate(state[0]["layers"]):
        for x in (layer["w"], state[1][0].nu["layers"][j]["w"]):
            sh = x.sharding
            assert isinstance(sh, NamedSharding) and sh.spec == P(None, "tensor"), sh
            assert sh.device_set == set(ps.mesh.rank_devices[j // 2]), (j, sh)
    ckpt.save(tmp_path, SAVE_AT, state, ps, wait=True)
    assert ckpt.metadata(tmp_path)["items"] == ["process-0"]
    leaves_equal(ckpt.restore(tmp_path, target=(p, OPT.init(p))), state3, "saved sharded")


def test_tied_weight_stage_map(tmp_path):
    """A weight tied across stages (read by the first stage and by the last, like a GPT's
    embedding and LM head) and Adam's step count (read by every stage's update) are on every
    stage that reads them in the stage map, and restored on the first one's rank. (Compiled
    steps, not run: saving and restoring need the plan, not a call.)"""
    def loss_fn(params, b):
        x, y = b
        x = x @ params["embed"]
        for i, p in enumerate(params["layers"]):
            x = jnp.tanh(x @ p["w"] + p["b"])
            if i < len(params["layers"]) - 1:
                x = baton.stage_boundary(x)
        return jnp.mean((x @ params["embed"].T - y) ** 2)

    vg = jax.value_and_grad(loss_fn)

    def step(params, opt_state, b):
        loss, grads = baton.accumulate(vg, params, batch=b)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = dict(init_params(layers=2), embed=jnp.eye(DIM) * 0.5)
    st = OPT.init(params)
    ps = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:2], ranks=2),
                   schedule=baton.OneFOneB(), microbatches=M)
    ps.compile(params, st, batch(0))
    ckpt.save(tmp_path, 0, (params, st), ps, wait=True)
    meta = {m["path"]: m for m in ckpt.metadata(tmp_path)["leaves"]}
    assert meta["[0]['embed']"]["stages"] == [0, 1]
    assert meta["[1][0].count"]["stages"] == [0, 1]
    assert meta["[0]['layers'][1]['w']"]["stages"] == [1]
    assert meta["[1][0].mu['embed']"]["stages"] == [0]  # the update runs on the owner's rank
    ps2 = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[2:4], ranks=2),
                    schedule=baton.ZBH1(), microbatches=M)
    ps2.compile(params, st, batch(0))
    got = ckpt.restore(tmp_path, fn=ps2)
    leaves_equal(got, (params, st), "tied")
    assert got[0]["embed"].sharding.device_set == {jax.devices()[2]}
    assert got[0]["layers"][1]["w"].sharding.device_set == {jax.devices()[3]}
    # the parameters alone (one pytree: the step's first argument)
    ckpt.save(tmp_path, 1, params, ps, wait=True)
    got = ckpt.restore(tmp_path, 1, fn=ps2)
    assert isinstance(got, dict) and got["embed"].sharding.device_set == {jax.devices()[2]}
    leaves_equal(got, params, "params alone")
    assert ckpt.metadata(tmp_path, 1)["leaves"][0]["path"] == "['embed']"


def test_readme_checkpoints_example(tmp_path):
    """The README's "Checkpoints" example, as written, after its pipelining example."""
    import re

    text = (HERE.parent.parent / "README.md").read_text()

    def block(heading):
        return re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S).group(1)

    k = jax.random.split(jax.random.key(0), 6)
    params = {"layers": [jax.random.normal(k[i], (16, 16)) * 0.3 for i in range(4)]}
    b = {"x": jax.random.normal(k[4], (32, 16)), "y": jax.random.normal(k[5], (32, 16))}
    ns = {"params": params, "opt_state": optax.adamw(1e-3).init(params), "batch": b,
          "path": str(tmp_path)}
    exec(block("## Pipelining a JAX training step"), ns)  # noqa: S102 - our own README
    trained = jax.device_get((ns["params"], ns["opt_state"]))
    exec(block("## Checkpoints"), ns)  # noqa: S102
    assert ns["step"] == 6 and ckpt.all_steps(tmp_path) == [3, 6]
    leaves_equal((ns["params"], ns["opt_state"]), ckpt.restore(tmp_path, 6, target=trained),
                 "readme")
    leaves_equal(ns["full"][0], ns["params"], "readme full")


def test_retention_and_data_state(tmp_path):
    """``max_to_keep`` / ``keep_period`` prune committed steps once a save commits (Orbax's
    conventions); the data-iterator state comes back with the step; a checkpoint without one
    is refused by name. ``CheckpointManager`` does both, saving every ``save_interval_steps``."""
    ps = pipelined(2)
    p = init_params()
    state = (p, OPT.init(p))
    for i in range(1, 6):
        ckpt.save(tmp_path / "a", i, state, ps, data={"next_index": 10 * i}, max_to_keep=2,
                  keep_period=2, wait=True)
    assert ckpt.all_steps(tmp_path / "a") == [2, 4, 5]
    assert ckpt.restore_data(tmp_path / "a", 4, fn=ps) == {"next_index": 40}
    assert ckpt.metadata(tmp_path / "a")["data_processes"] == [0]
    ckpt.save(tmp_path / "b", 1, state, ps, wait=True)
    with pytest.raises(baton.ConfigError, match="step 1 .* has no data-iterator state"):
        ckpt.restore_data(tmp_path / "b", fn=ps)
    with pytest.raises(baton.ConfigError, match="max_to_keep must be a positive integer"):
        ckpt.save(tmp_path / "b", 2, state, ps, max_to_keep=0)
    with pytest.raises(baton.ConfigError, match="JSON-serializable"):
        ckpt.save(tmp_path / "b", 3, state, ps, data=object())
    mgr = ckpt.CheckpointManager(tmp_path / "c", ps, ckpt.CheckpointManagerOptions(
        save_interval_steps=2, max_to_keep=2))
    for i in range(1, 8):
        mgr.save(i, state, data={"i": i})
    assert mgr.all_steps() == [4, 6] and mgr.latest_step() == 6
    got = mgr.restore()
    assert got.step == 6 and got.data == {"i": 6}
    leaves_equal(got.state, state, "manager restore")
