"""Activation offload (``baton.jit(offload=...)``): every schedule family with every stage's
stash offloaded to host memory gives the loss and gradients of plain ``jax.jit`` over the same
microbatches bit for bit, and the same AdamW steps; the rank programs carry one
``baton_offload`` and one ``baton_fetch`` call per offloaded buffer, the host slots hold the
bytes between them, and XLA's buffer assignment of the offloading rank holds less; choices
the rank programs do not lower are refused by name."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402
from baton import _core  # noqa: E402
from baton.frontend.api import cost_model_of  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import mlp  # noqa: E402

OPT = optax.adamw(1e-2, eps=1e-6, weight_decay=0.01)
SCHEDULES = {
    "gpipe": baton.GPipe(),
    "1f1b": baton.OneFOneB(),
    "interleaved": baton.Interleaved1F1B(virtual_stages=2),
    "zbh1": baton.ZBH1(),
    "zbv": baton.ZBV(),
    "dualpipev": baton.DualPipeV(),
    "vhalf": baton.VHalf(),
    "vmin": baton.VMin(),
}


def _mesh(ranks):
    return baton.PipelineMesh(jax.devices()[:ranks], ranks=ranks)


def _step(m):
    vg = jax.value_and_grad(mlp.make_loss())

    def step(params, opt_state, batch):
        loss, grads = baton.accumulate(vg, params, batch=batch, microbatches=m)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return step


def _programs(ps):
    return ps.last.engine.local_progs


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_offloading_matches_plain_jax(name):
    """Two AdamW steps on 2 ranks, every stage's stash offloaded: loss and gradients equal
    plain jax.jit's (accumulate a lax.scan over the same microbatches) bit for bit, the
    parameters and optimizer state to rtol 1e-6 (the fused update rounds differently); each
    offloaded buffer is one OFFLOAD and one FETCH call in its rank's program, and the host
    slots held bytes during the step and hold none after it."""
    sched = SCHEDULES[name]
    stages = sched.stages(2)
    m = 2 * stages
    key = jax.random.PRNGKey(stages)
    params = mlp.init_params(key, stages)
    batch = mlp.synthetic_batch(key, 4 * m)
    step = _step(m)
    ps = baton.jit(step, mesh=_mesh(2), schedule=sched, microbatches=m, offload="stash")
    ref = jax.jit(step)
    got_state = want_state = (params, OPT.init(params))
    for _ in range(2):
        *got_state, got_loss, got_grads = ps(*got_state, batch)
        *want_state, want_loss, want_grads = ref(*want_state, batch)
        for a, b in zip(jax.tree.leaves((got_loss, got_grads)),
                        jax.tree.leaves((want_loss, want_grads))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    ir = ps.last.rank_ir()
    offloaded = 0
    for prog in _programs(ps):
        n = sum(1 for b in ir.programs[prog.rank].buffers if b.host_pool >= 0)
        offloaded += n
        text = prog.compiled.as_text()
        assert prog.form == "rolled"
        calls = (text.count('custom_call_target="baton_offload"'),
                 text.count('custom_call_target="baton_fetch"'))
        held, peak = prog.comm.host_bytes()
        assert held == 0, (prog.rank, held)
        # one call per OFFLOAD / FETCH item of the rolled program (in a scan, one call
        # serves every repetition)
        want = tuple(sum(1 for pattern, _, _ in prog.runs for it in pattern if it.op == op)
                     for op in (_core.ItemOp.OFFLOAD, _core.ItemOp.FETCH))
        assert calls == want, (prog.rank, calls, want)
        if n:
            assert want[0] > 0 and want[1] > 0 and peak > 0
        else:
            assert calls == (0, 0) and peak == 0
    assert offloaded > 0


def test_offloading_rank_holds_less_in_xla_and_the_bytes_in_host_slots():
    """GPipe's ranks stash every microbatch's activations before their first backward:
    offloaded, XLA's buffer assignment (temporary bytes) of the largest rank's program is
    smaller than the largest of the same rolled programs without offload, and the host
    slots held the stashes (at least one microbatch's) and hold nothing after the step."""
    m = 8
    key = jax.random.PRNGKey(0)
    params = mlp.init_params(key, 2, dim=64)
    batch = mlp.synthetic_batch(key, 64 * m, dim=64)
    vg = jax.value_and_grad(mlp.make_loss())

    def run(offload):
        ps = baton.jit(lambda p, b: baton.accumulate(vg, p, batch=b), mesh=_mesh(2),
                       schedule="gpipe", microbatches=m, offload=offload, loop_form="rolled")
        return ps, ps(params, batch)

    plain, got_plain = run(None)
    off, got_off = run("stash")
    for a, b in zip(jax.tree.leaves(got_plain), jax.tree.leaves(got_off)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    temp = {p.rank: p.compiled.memory_analysis().temp_size_in_bytes
            for p in _programs(plain)}
    temp_off = {p.rank: p.compiled.memory_analysis().temp_size_in_bytes
                for p in _programs(off)}
    # the largest rank's: rank 1 holds every microbatch's stash without offload; rank 0's
    # own program rolls into scans once offloaded, whose microbatch inputs are copied
    # (bench/results/offload.md)
    assert max(temp_off.values()) < 0.8 * max(temp.values()), (temp, temp_off)
    rank0 = next(p for p in _programs(off) if p.rank == 0)
    held, peak = rank0.comm.host_bytes()
    stash = 64 * 64 * 4  # one microbatch's activations of one layer, float32
    assert held == 0 and peak >= stash, peak
    # the summary simulates the step's own rank programs: device and host bytes per rank
    text = off.summary(params, batch)
    assert "peak host" in text and "peak host" not in plain.summary(params, batch)
    sim = _core.simulate_rank_ir(off.last.rank_ir(), cost_model_of(off.last))
    assert all(b > 0 for b in sim.peak_host_bytes), list(sim.peak_host_bytes)
    assert max(sim.peak_total) < max(plain.last.plan.simulate_rank_ir(
        cost_model_of(plain.last)).peak_total)
    # the memory model by memory kind: the host bytes it predicts are what the slots held
    mem = off.memory(params, batch, measure=True)
    assert set(mem.measured_host) == set(mem.host) and "measured host KiB" in mem.table()
    for d, held_most in mem.measured_host.items():
        assert held_most > 0 and mem.host[d] == held_most, (mem.host, mem.measured_host)
    assert not plain.memory(params, batch).host


@pytest.mark.parametrize("offload,error", [
    ("all", "offload must be None, 'stash' or a dict"),
    ({-1: "stash"}, "offload names stage -1"),
    ({0: "weights"}, r"offload\[0\] = 'weights'"),
])
def test_bad_offload_choices_are_refused(offload, error):
    with pytest.raises(baton.ConfigError, match=error):
        baton.jit(lambda p, b: p, mesh=_mesh(2), schedule="1f1b", microbatches=2,
                  offload=offload)


def test_offload_refused_where_not_lowered():
    """A stage the schedule does not have, one rank, the interpreter and a forced table:
    refused at the first call, naming what."""
    key = jax.random.PRNGKey(0)
    vg = jax.value_and_grad(mlp.make_loss())
    batch = mlp.synthetic_batch(key, 8)

    def call(ranks, **kw):
        ps = baton.jit(lambda p, b: baton.accumulate(vg, p, batch=b), mesh=_mesh(ranks),
                       schedule="1f1b", microbatches=2, **kw)
        return ps(mlp.init_params(key, ranks), batch)

    with pytest.raises(baton.ConfigError, match="offload names stage 5, but the schedule "
                                                "has 2 stages"):
        call(2, offload={5: "stash"})
    with pytest.raises(baton.ConfigError, match="two or more ranks"):
        call(1, offload="stash")
    with pytest.raises(baton.ConfigError, match="interpreter"):
        call(2, offload="stash", engine="interpreter")
    with pytest.raises(baton.ConfigError, match="table loop form does not offload"):
        call(2, offload="stash", loop_form="table")


def test_rank_items_carry_offload_and_fetch():
    """The C++ item pass gives OFFLOAD after the forward that makes a stash and FETCH before
    the backward that reads it (as the rank IR places them); FETCH makes the buffer again,
    so no scan keeps the forward's value on the device for the backward."""
    p = baton.plan("gpipe", ranks=2, microbatches=4)
    ir = _core.build_rank_ir(p.core, offload=[_core.Offload.STASH] * 2)
    items = list(_core.rank_items(p.core, ir.programs[0], _core.RollOptions()))
    ops = [(x.op, x.microbatch) for x in items if x.op in (_core.ItemOp.OFFLOAD,
                                                            _core.ItemOp.FETCH)]
    assert sorted(m for op, m in ops if op == _core.ItemOp.OFFLOAD) == [0, 1, 2, 3]
    assert sorted(m for op, m in ops if op == _core.ItemOp.FETCH) == [0, 1, 2, 3]
    pos = {(x.op, x.microbatch): i for i, x in enumerate(items)}
    for m in range(4):
        assert pos[(_core.ItemOp.OFFLOAD, m)] < pos[(_core.ItemOp.FETCH, m)]
    # the forwards' scan hands no stash to the items after it: the backwards read the
    # FETCHes' values
    rolled = _core.roll_rank(p.core, ir.programs[0], _core.RollOptions())
    assert any(r.repetitions > 1 for r in rolled.runs)
    assert all(k.kind != _core.BufKind.Stash for r in rolled.runs for k in r.stacked)
