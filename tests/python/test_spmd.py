"""Pipelines composed with SPMD inside stages: named meshes, the user's parameter shardings
(Megatron-style tensor parallelism, FSDP), the batch over data axes, shard-to-shard transfers
between ranks of several devices. Every run is checked against plain JAX
(``jax.value_and_grad`` on one device, the unsharded model) over 3 AdamW steps.

In one process XLA:CPU runs one multi-device program at a time, so ranks of several devices
run here on the interpreter (chosen: ``engine="interpreter"``; the compiled engine refuses
them by name); the compiled engine runs them one process per rank
(``test_mp_e2e.py::test_moe_experts_across_processes``) or several processes per rank
(``test_mp_e2e.py::test_ranks_spanning_processes``), and its lowered program is inspected
here."""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import baton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import gpt  # noqa: E402

if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (JAX_NUM_CPU_DEVICES=8)", allow_module_level=True)


FOUR = [baton.OneFOneB(), baton.Interleaved1F1B(2), baton.ZBH1(), baton.DualPipeV()]
FOUR_IDS = ["1f1b", "interleaved", "zbh1", "dualpipev"]


def four(*light):
    """FOUR as pytest parameters; all but the ``light`` ones are marked ``heavy``
    (``scripts/test.sh`` and the oldest-JAX pass of ``.ci/run`` run ``-m "not heavy"``:
    every configuration, fewer schedules; ``.ci/run`` runs the heavy ones in a pass of their
    own)."""
    return [pytest.param(s, id=i, marks=() if i in light else pytest.mark.heavy)
            for s, i in zip(FOUR, FOUR_IDS)]


def named_mesh(pipe, **axes):
    names = ("pipe", *axes)
    shape = (pipe, *axes.values())
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def run_gpt(mesh, schedule, tensor=None, fsdp=None, steps=3, microbatches=4, mb=4,
            engine="interpreter"):
    """Trains the GPT pipelined and plainly; returns the pipelined function and the final
    parameters and optimizer state (after asserting they match)."""
    pm = baton.PipelineMesh(mesh)
    stages = schedule.stages(pm.num_ranks)
    cfg = gpt.GPTConfig(vocab=64, seq=16, dim=32, heads=4, layers=stages, stages=stages)
    model, params, opt, opt_state, train_step, ref_step = gpt.make(cfg, eps=1e-6)
    batch = gpt.synthetic_batch(cfg, mb * microbatches)
    specs = gpt.param_specs(params, tensor=tensor, fsdp=fsdp)
    ps = baton.jit(train_step, mesh=pm, schedule=schedule, microbatches=microbatches,
                   param_shardings=specs, engine=engine)
    check_gradients(pm, schedule, microbatches, specs, engine, params, batch,
                    lambda p, b: gpt.loss_fn(model, p, b))
    ref = jax.jit(ref_step)
    p1 = p2 = params
    s1 = s2 = opt_state
    for i in range(steps):
        p1, s1, l1 = ps(p1, s1, batch)
        p2, s2, l2 = ref(p2, s2, batch)
        np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), rtol=1e-5,
                                   err_msg=f"loss of step {i}")
        # rtol 1e-5, with an atol of 5e-5 of each array's largest magnitude: SPMD sums in
        # another order, so an element much smaller than its array's scale (a gradient near
        # zero, its Adam moments) carries the array's rounding (seen: 1.1e-5 of the scale, an
        # Adam moment of pipe 4 x data 2 interleaved under jax 0.11.0; a wrong gradient is off
        # by 1e-2 or more); for the parameters at least 5e-5 absolute (5% of one lr=1e-3
        # step: Adam's g / (sqrt(v) + eps) of a near-zero g moves with the last bits of g;
        # seen: 1.1e-5)
        for what, got, want in (("optimizer state", s1, s2), ("parameters", p1, p2)):
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                a, b = np.asarray(a), np.asarray(b)
                scale = float(np.max(np.abs(b))) if b.size else 0.0
                atol = max(5e-5 * scale, 5e-5 if what == "parameters" else 0.0)
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol,
                                           err_msg=f"{what}, step {i}")
    return ps, p1, s1, specs


def assert_trees_close(got, want, what, rtol=1e-5, rel_atol=5e-5):
    """Leaf by leaf, named by its path: rtol, and an atol of ``rel_atol`` of each array's
    largest magnitude (SPMD sums in another order; see run_gpt)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(want)
    leaves = jax.tree.leaves(got)
    assert len(leaves) == len(flat), (what, len(leaves), len(flat))
    for a, (path, b) in zip(leaves, flat):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, (what, jax.tree_util.keystr(path), a.shape, b.shape)
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rel_atol * scale,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


def check_gradients(pm, schedule, microbatches, specs, engine, params, batch, loss,
                    per_microbatch=False):
    """The gradients themselves, not only what AdamW makes of them: ``baton.accumulate`` of
    ``jax.value_and_grad(loss)`` pipelined with the same shardings against plain JAX at
    ``params``: the gradient of the whole batch (the loss is a mean over equal microbatches),
    or with ``per_microbatch`` the same accumulation outside ``baton.jit`` (a ``lax.scan``)."""
    def grad_step(params, batch):
        return baton.accumulate(jax.value_and_grad(loss), params, batch=batch,
                                microbatches=microbatches if per_microbatch else None)

    pg = baton.jit(grad_step, mesh=pm, schedule=schedule, microbatches=microbatches,
                   param_shardings=specs, engine=engine)
    l1, g1 = pg(params, batch)
    if per_microbatch:
        l2, g2 = jax.jit(grad_step)(params, batch)
    else:
        l2, g2 = jax.jit(jax.value_and_grad(lambda p: loss(p, batch)))(params)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), rtol=1e-5, err_msg="loss")
    assert_trees_close(g1, g2, "gradient")
    # not vacuous: every gradient leaf is a real array and some are far from zero
    assert max(float(np.max(np.abs(np.asarray(g)))) for g in jax.tree.leaves(g2)) > 1e-3


def test_named_mesh_ranks_keep_their_axes():
    pm = baton.PipelineMesh(named_mesh(2, data=2, tensor=2))
    assert pm.num_ranks == 2 and pm.axis_names == ("data", "tensor")
    assert pm.batch_axes == ("data",)
    assert [d.id for d in pm.rank_devices[1]] == [4, 5, 6, 7]
    assert pm.meshes[1].shape == {"data": 2, "tensor": 2}
    assert pm.batch_spec((8, 3)) == P("data") and pm.batch_spec((3, 3)) == P()
    pm = baton.PipelineMesh(named_mesh(2, fsdp=2, expert=2))
    assert pm.batch_axes == ("fsdp", "expert") and pm.batch_spec((8,)) == P(("fsdp", "expert"))
    short = baton.PipelineMesh(jax.devices()[:8], ranks=4)
    assert short.axis_names == ("data",) and short.devices_per_rank() == 2
    assert pm.spec_on_ranks(P("pipe", "fsdp")) == P(None, "fsdp")


def test_a_sharding_naming_a_missing_axis_or_not_dividing_names_the_parameter():
    mesh = named_mesh(2, data=2, tensor=2)
    cfg = gpt.GPTConfig(vocab=64, seq=16, dim=32, heads=4, layers=2, stages=2)
    model, params, opt, opt_state, train_step, _ = gpt.make(cfg)
    batch = gpt.synthetic_batch(cfg, 8)
    bad = gpt.param_specs(params, tensor="model")
    ps = baton.jit(train_step, mesh=baton.PipelineMesh(mesh), schedule=baton.OneFOneB(),
                   microbatches=2, param_shardings=bad)
    with pytest.raises(baton.ConfigError, match=r"\['block0'\].*'model'"):
        ps(params, opt_state, batch)
    cfg = gpt.GPTConfig(vocab=66, seq=16, dim=32, heads=4, layers=2, stages=2)
    model, params, opt, opt_state, train_step, _ = gpt.make(cfg)
    bad = gpt.param_specs(params, tensor="tensor")  # the vocabulary (66) over tensor=2: fine
    bad["embed"]["embedding"] = P(("data", "tensor"))  # 66 rows over 4 devices: not
    ps = baton.jit(train_step, mesh=baton.PipelineMesh(mesh), schedule=baton.OneFOneB(),
                   microbatches=2, param_shardings=bad)
    with pytest.raises(baton.ConfigError,
                       match=r"\['embed'\]\['embedding'\].*dimension 0 .*size 4 of axis "
                             r"data.tensor"):
        ps.compile(params, opt_state, gpt.synthetic_batch(cfg, 8))


@pytest.mark.parametrize("schedule", four("1f1b", "dualpipev"))
def test_pipe2_data2_tensor2_matches_plain_jax(schedule):
    ps, p1, _, _ = run_gpt(named_mesh(2, data=2, tensor=2), schedule, tensor="tensor")
    # the parameters stayed in the user's shardings on their rank's devices
    w = p1["block0"]["Dense_0"]["kernel"]
    assert w.sharding.spec == P(None, "tensor") and len(w.sharding.device_set) == 4


def test_one_process_compiled_engine_refuses_multi_device_ranks_by_name():
    pm = baton.PipelineMesh(named_mesh(2, data=2, tensor=2))
    cfg = gpt.GPTConfig(vocab=64, seq=16, dim=32, heads=4, layers=2, stages=2)
    model, params, opt, opt_state, train_step, _ = gpt.make(cfg)
    ps = baton.jit(train_step, mesh=pm, schedule=baton.OneFOneB(), microbatches=2)
    with pytest.raises(baton.ConfigError, match="rank 0 has 4 devices.*one process per rank"):
        ps(params, opt_state, gpt.synthetic_batch(cfg, 8))


def test_boundary_values_cross_shard_to_shard():
    """In a rank program of several devices, each transfer is a per-device call
    (``shard_map``) on the device's shard: the custom call sees local shapes, and nothing
    gathers the activation first. An activation replicated over the tensor axis is split
    over it too (each device sends its part, not all of it)."""
    from baton.emit.rank_program import RankProgram

    pm = baton.PipelineMesh(named_mesh(2, data=2, tensor=2))
    cfg = gpt.GPTConfig(vocab=64, seq=16, dim=32, heads=4, layers=2, stages=2)
    model, params, opt, opt_state, train_step, _ = gpt.make(cfg)
    ps = baton.jit(train_step, mesh=pm, schedule=baton.OneFOneB(), microbatches=4,
                   param_shardings=gpt.param_specs(params, tensor="tensor"),
                   engine="interpreter")
    step = ps.compile(params, opt_state, gpt.synthetic_batch(cfg, 16))
    for r in range(2):
        comm = baton._core.runtime.RankComm(r, 10.0)
        prog = RankProgram(step, r, comm, 10.0)
        assert comm.shards == [d.id for d in pm.meshes[r].devices.flat]
        text = prog.lowered_text()
        calls = [ln for ln in text.splitlines() if "@baton_comm" in ln]
        # microbatch 4 x seq 16 x dim 32, split over data=2 and, where the batch axes leave
        # it replicated, over tensor=2 as well (its block of 2 divides): each device moves
        # 1 x 16 x 32, a quarter of it
        joined = "\n".join(calls)
        assert "1x16x32xf32" in joined, joined[:2000]
        assert "4x16x32xf32" not in joined and "2x16x32xf32" not in joined, joined[:2000]


def test_wire_spec_splits_what_the_batch_axes_leave_replicated():
    from baton.emit.rank_transfers import wire_spec

    axes = {"data": 2, "tensor": 2}
    assert wire_spec(P("data"), axes, (4, 16, 32)) == P(("data", "tensor"))  # 4 / 2 divides
    assert wire_spec(P("data"), axes, (2, 16, 32)) == P("data", "tensor")
    assert wire_spec(P("data"), axes, (2, 3, 32)) == P("data", None, "tensor")
    assert wire_spec(P("data"), axes, (2, 3)) == P("data")  # nothing divides: as it was
    assert wire_spec(P(), axes, (3, 4)) == P(None, ("data", "tensor"))  # (3: no batch split)
    assert wire_spec(P(), axes, ()) == P()
    assert wire_spec(P("data"), {"data": 2, "tensor": 1}, (4, 16)) == P("data")


@pytest.mark.parametrize("schedule", four("zbh1"))
def test_pipe2_fsdp4_shards_parameters_and_optimizer_state(schedule):
    ps, p1, s1, specs = run_gpt(named_mesh(2, fsdp=4), schedule, fsdp="fsdp")
    # per-device bytes of parameters + optimizer state = total / 4 (the fsdp axis), within 1%
    total = sum(x.nbytes for x in jax.tree.leaves((p1, s1)))
    per_dev: dict = {}
    for x in jax.tree.leaves((p1, s1)):
        for sh in x.addressable_shards:
            per_dev[sh.device] = per_dev.get(sh.device, 0) + sh.data.nbytes
    # each parameter lives on its stage's rank (4 devices): over all 8 devices the bytes sum
    # to the total, and each rank's 4 devices hold equal quarters of that rank's part
    assert abs(sum(per_dev.values()) - total) <= 0.01 * total
    for r, devs in enumerate(ps.last.mesh.rank_devices):
        got = [per_dev.get(d, 0) for d in devs]
        assert max(got) <= 1.01 * min(got), (r, got)


@pytest.mark.parametrize("schedule", four())
def test_pipe4_data2_matches_plain_jax(schedule):
    # DualPipeV needs microbatches >= 2 x ranks
    m = 8 if isinstance(schedule, baton.DualPipeV) else 4
    run_gpt(named_mesh(4, data=2), schedule, microbatches=m, mb=2)


def test_an_expert_count_the_expert_axis_does_not_divide_names_the_parameter():
    """3 experts over expert=2: a ConfigError naming an expert weight's path and the axis,
    before tracing."""
    import moe_gpt

    mesh = named_mesh(2, expert=2, data=2)
    cfg = moe_gpt.MoEConfig(expert_axis="expert", experts=3)
    model, params, opt, st, train_step, _ = moe_gpt.make(cfg)  # (initialized unsharded)
    moe_gpt.use_mesh(mesh)
    try:
        ps = baton.jit(train_step, mesh=baton.PipelineMesh(mesh), schedule=baton.OneFOneB(),
                       microbatches=4, param_shardings=moe_gpt.param_specs(params))
        with pytest.raises(baton.ConfigError,
                           match=r"\['w[12]'\].*dimension 0 of shape \(3, .*axis expert"):
            ps.compile(params, st, moe_gpt.synthetic_batch(cfg, 16))
    finally:
        moe_gpt.use_mesh(None)


@pytest.mark.parametrize("schedule", four("1f1b"))
def test_moe_gpt_pipe2_expert2_data2_matches_plain_jax(schedule):
    """The MoE GPT (examples/moe_gpt.py): top-2 routing over 4 experts split over the expert
    axis (the dispatch and combine einsums become all-to-alls inside each stage), the router's
    load-balancing loss added to the loss, against plain JAX's gradient accumulation over the
    same microbatches (``baton.accumulate`` outside ``baton.jit`` is a ``lax.scan``; the
    load-balancing loss is per microbatch, so a whole-batch step would differ). The gradients
    themselves: Adam's first moment after one step is ``(1 - b1) * grad``."""
    import moe_gpt

    mesh = named_mesh(2, expert=2, data=2)
    pm = baton.PipelineMesh(mesh)
    assert pm.batch_axes == ("expert", "data")
    stages = schedule.stages(pm.num_ranks)
    # capacity 2 x tokens x 2 / 4: no drops
    cfg = moe_gpt.MoEConfig(expert_axis="expert", layers=stages, stages=stages)
    moe_gpt.use_mesh(mesh)
    try:
        model, params, opt, st, train_step, _ = moe_gpt.make(cfg)
        batch = moe_gpt.synthetic_batch(cfg, 16)
        ps = baton.jit(train_step, mesh=pm, schedule=schedule, microbatches=4,
                       param_shardings=moe_gpt.param_specs(params), engine="interpreter")
        p1, s1 = params, st
        mus = []
        for _ in range(3):
            p1, s1, l1 = ps(p1, s1, batch)
            mus.append(s1[0].mu)
    finally:
        moe_gpt.use_mesh(None)
    ref = jax.jit(train_step_scan(model, opt, 4))
    p2, s2 = params, st
    for i in range(3):
        p2, s2, l2 = ref(p2, s2, batch)
        if i == 0:
            assert_trees_close(mus[0], s2[0].mu, "gradient (Adam's first moment after step 1)")
            # not vacuous: some gradient entries are far from zero
            assert max(float(np.max(np.abs(np.asarray(g))))
                       for g in jax.tree.leaves(s2[0].mu)) > 1e-4
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), rtol=1e-5)
    for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5,
                                   atol=max(1e-5 * float(np.max(np.abs(b))), 5e-5 * (b.size > 1)))
    w1 = p1["block0"]["MoE_0"]["w1"]
    assert w1.sharding.spec == P("expert") and len(w1.sharding.device_set) == 4


def train_step_scan(model, opt, microbatches):
    import optax

    import moe_gpt

    def step(params, opt_state, batch):
        loss, grads = baton.accumulate(
            jax.value_and_grad(lambda p, b: moe_gpt.loss_fn(model, p, b)), params, batch=batch,
            microbatches=microbatches)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def test_moe_dispatch_is_an_all_to_all_inside_the_rank_program():
    """XLA partitions the MoE dispatch and combine (tokens split over expert x data, expert
    weights over expert) into all-to-alls within each rank: the compiled rank program has
    them."""
    import moe_gpt
    from baton.emit.rank_program import RankProgram

    mesh = named_mesh(2, expert=2, data=2)
    moe_gpt.use_mesh(mesh)
    try:
        cfg = moe_gpt.MoEConfig(expert_axis="expert")
        model, params, opt, st, step, _ = moe_gpt.make(cfg)
        batch = moe_gpt.synthetic_batch(cfg, 16)
        ps = baton.jit(step, mesh=baton.PipelineMesh(mesh), schedule=baton.OneFOneB(),
                       microbatches=4, param_shardings=moe_gpt.param_specs(params),
                       engine="interpreter")
        s = ps.compile(params, st, batch)
        prog = RankProgram(s, 0, baton._core.runtime.RankComm(0, 10.0), 10.0)
        vals = dict(zip(s.traced.step_inputs, jax.tree.leaves((params, st, batch))))
        text = prog.lower(vals).compile().as_text()
    finally:
        moe_gpt.use_mesh(None)
    assert "all-to-all" in text
