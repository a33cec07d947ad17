"""Ranks of one process that do the same work share one compiled program
(``emit/shared.py``): an SPMD program over their devices, each device its own rank's
table, ring slots and parameters, its transfers routed to its own rank's context."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import baton
from baton.emit.shared import SharedProgram
from mlp_step import make, make_train
from test_engine import targets

R = baton._core.graph.Region


def _run(schedule, ranks, share, **kw):
    ps, params, batch = make(schedule, ranks, 2 * schedule.stages(ranks),
                             share_programs=share, **kw)
    return ps, params, batch, ps(params, batch)


def _shared(ps):
    units = ps.last.engine.local_units
    return units, [u for u in units if isinstance(u, SharedProgram)]


@pytest.mark.parametrize("ranks,schedule", [
    (4, baton.ZBV()), (8, baton.OneFOneB()),
    pytest.param(8, baton.Interleaved1F1B(2), marks=pytest.mark.heavy)],
    ids=["4-zbv", "8-1f1b", "8-interleaved"])
def test_middle_ranks_share_one_program_bit_identical(ranks, schedule):
    """The middle ranks (equal blocks, shifted stages and peers, different tables: 1F1B's
    warm-up depth differs per rank; ZB-V's second stage on a rank runs the other way) run as
    one program; the first and last rank (the loss)
    as their own. Results equal one program per rank, bit for bit."""
    ps, _, _, got = _run(schedule, ranks, True)
    units, shared = _shared(ps)
    assert len(shared) == 1 and [p.rank for p in shared[0].progs] == list(range(1, ranks - 1))
    assert len(units) == 3 and ps.last.engine.local_progs[0] is units[0]
    # one program, FFI transfers, no Python callback
    found = targets(shared[0].lowered_text())
    assert {"baton_comm", "baton_drain"} <= found and not any("callback" in t for t in found)
    ps1, _, _, want = _run(schedule, ranks, False)
    assert len(_shared(ps1)[0]) == ranks and not _shared(ps1)[1]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_shared_program_traces_every_rank():
    """A traced step runs the shared executable (nothing compiled for it); every rank's
    trace has its own tasks in its plan's order and its transfers."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name)
        if "backend_compile" in name or "cache_retrieval" in name else None)
    ps, params, batch, _ = _run(baton.OneFOneB(), 4, True)
    step = ps.last
    exe = _shared(ps)[1][0].compiled
    compiles.clear()
    tr = baton.trace(ps, params, batch)
    assert compiles == [] and _shared(ps)[1][0].compiled is exe
    for r in range(4):
        assert tr.rank_order(r) == [str(a) for a in step.rank_actions[r]]
    peers = {(t["src"], t["dst"]) for t in tr.transfers}
    assert {(1, 2), (2, 1), (2, 3), (3, 2)} <= peers, peers


def test_failure_on_a_shared_rank_names_it():
    """A task that raises on rank 2 only (its device runs the shared program's code with
    rank 2's parameters) stops every rank within the step's timeout; the error is the task's,
    naming the shared program's ranks (XLA does not say which device's part failed)."""
    ps, params, batch, want = _run(baton.OneFOneB(), 4, True, timeout=5.0)
    step = ps.last
    exes = [step.tasks[(baton.TaskKind.F, 1)], step.tasks[(baton.TaskKind.F, 2)]]
    o = step.loop_src[exes[1].in_groups[0][0]][0]
    assert o in step.traced.step_inputs
    leaf = jax.tree.leaves((params, batch))[step.traced.step_inputs.index(o)]
    target = float(np.asarray(leaf, np.float64).sum())

    def check(x):  # the same function on both stages: their jaxprs stay equal
        if abs(float(x) - target) <= 1e-6 * max(1.0, abs(target)):
            raise ValueError("injected failure")
        return np.int32(0)

    good = [e.plain for e in exes]

    def failing(plain):
        def fn(*args):
            outs = plain(*args)
            flag = jax.pure_callback(check, jax.ShapeDtypeStruct((), jnp.int32),
                                     jnp.sum(args[0].astype(jnp.float32)))
            return [outs[0] + flag.astype(outs[0].dtype)] + list(outs[1:])
        return fn

    for e, g in zip(exes, good):
        e.plain = failing(g)
    step.engine.local_progs = None  # rebuilt with the failing task
    try:
        t0 = time.monotonic()
        with pytest.raises(baton.ExecutionError) as info:
            ps(params, batch)
        # bounded by the step's timeout: XLA returns the shared program's error once every
        # device's part stopped, and the parts that wait on rank 2 stop at their timeout.
        # The call also compiles the rebuilt programs (with XLA's optimizations on, on a
        # loaded 2-core machine, up to about 20 s), hence the margin; a hang never returns.
        assert time.monotonic() - t0 < 5.0 + 60
        assert _shared(ps)[1], "the patched stages no longer share a program"
        msg = str(info.value)
        assert "injected failure" in msg and msg.startswith("ranks 1, 2 (one shared"), msg
        assert info.value.failed_rank == 1
    finally:
        for e, g in zip(exes, good):
            e.plain = g
    step.engine.local_progs = None
    got = ps(params, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _adamw_run(share, ranks=4, steps=2):
    import optax

    ps, p, s, batch = make_train(baton.OneFOneB(), ranks, optax.adamw(1e-2), seed=5,
                                 share_programs=share)
    for _ in range(steps):
        p, s, loss = ps(p, s, batch)
    return ps, (p, s, loss)


def test_optimizer_updates_of_shared_ranks_run_as_one_program():
    """After the loop, the shared ranks' optimizer updates (the same function of equal
    avals) run as one program too; the results equal one program per rank, bit for bit."""
    ps, got = _adamw_run(True)
    post = ps.last.engine.post_groups()
    assert post is not None and len(post.starts) >= 1
    segs = ps.last.post_segments
    for group, _ in post.starts.values():
        assert sorted(ps.last.stage_rank[segs[j].stage] for j in group) == [1, 2]
    ps1, want = _adamw_run(False)
    assert ps1.last.engine.post_groups() is None
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_constants_compared_for_sharing_include_prng_keys():
    """Stages whose constants are typed PRNG keys (a model's RNG streams, e.g. MaxText's
    dropout keys) are compared by key data, not refused by NumPy."""
    from baton.emit.share_match import _same_literal

    k0, k1 = jax.random.key(0), jax.random.key(1)
    assert _same_literal(k0, jax.random.key(0)) and not _same_literal(k0, k1)
    assert not _same_literal(k0, jax.random.key_data(k0))  # a key is not its raw data
    assert not _same_literal(jax.random.split(k0, 2), k0)
    assert _same_literal(np.arange(3), np.arange(3)) and not _same_literal(np.ones(2), np.zeros(2))


# -- models whose stages name devices or slice stacked values ----------------------------------
D = 8


def _pipe_mesh(ranks=4):
    """The user's mesh: ``ranks`` ranks of one CPU device each (pipe x data)."""
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:ranks]).reshape(ranks, 1), ("pipe", "data"))


def _constrained_loss(mesh):
    """Four equal stages of two layers under ``lax.scan``, each layer's output constrained
    onto the user's mesh (inside the scan body) and the stage's output again (top level):
    ``with_sharding_constraint`` as MaxText's ``nn.with_logical_constraint`` leaves it."""
    from jax.sharding import NamedSharding, PartitionSpec

    rows = NamedSharding(mesh, PartitionSpec("data", None))

    def layer(h, p):
        h = jnp.tanh(h @ p["w"] + p["b"])
        return jax.lax.with_sharding_constraint(h, rows), None

    def loss_fn(params, batch):
        x, y = batch
        for s, p in enumerate(params):
            x, _ = jax.lax.scan(layer, x, p)
            x = jax.lax.with_sharding_constraint(x, rows)
            if s < len(params) - 1:
                x = baton.stage_boundary(x)
        return jnp.mean((x - y) ** 2)

    return loss_fn


def _stage_params(key, stages=4, layers=2):
    ks = jax.random.split(key, 2 * stages)
    return [{"w": jax.random.normal(ks[2 * s], (layers, D, D)) / np.sqrt(D),
             "b": 0.1 * jax.random.normal(ks[2 * s + 1], (layers, D))} for s in range(stages)]


def _batch(key, rows=32):
    kx, ky = jax.random.split(jax.random.fold_in(key, 99))
    return jax.random.normal(kx, (rows, D)), jnp.sin(jax.random.normal(ky, (rows, D)))


def _pipelined(loss_fn, mesh, share):
    vg = jax.value_and_grad(loss_fn)
    return baton.jit(lambda p, b: baton.accumulate(vg, p, batch=b),
                     mesh=baton.PipelineMesh(mesh), schedule=baton.OneFOneB(), microbatches=8,
                     share_programs=share)


def _check_middle_ranks_share(loss_fn, mesh, params, batch):
    """Ranks 1 and 2 run one shared program; the results equal one program per rank bit for
    bit, and plain JAX (the whole batch at once) within float tolerance."""
    from test_e2e import close

    ps = _pipelined(loss_fn, mesh, True)
    got = ps(params, batch)
    units, shared = _shared(ps)
    assert len(shared) == 1 and [p.rank for p in shared[0].progs] == [1, 2], units
    assert len(units) == 3
    want = _pipelined(loss_fn, mesh, False)(params, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    close(got, jax.jit(jax.value_and_grad(loss_fn))(params, batch))


def test_sharding_constraints_on_one_device_ranks_share():
    """Stages holding sharding constraints on the user's mesh: on ranks of one device a
    constraint is the identity, removed from the rank's tasks, so the middle ranks' tasks
    are equal and share one program (before, a task holding a constraint never shared)."""
    mesh = _pipe_mesh()
    key = jax.random.key(3)
    _check_middle_ranks_share(_constrained_loss(mesh), mesh, _stage_params(key), _batch(key))


def test_constraints_removed_only_on_one_device_ranks():
    """``OnRank.drop``: a constraint onto a ``NamedSharding`` in the device's own memory on a
    rank of one device is removed; on a rank of two devices, into host memory, or with
    another kind of sharding it stays (and a task holding it does not share)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from baton._jax_compat import one_device_sharding
    from baton.tracing.retarget import on_rank

    P = PartitionSpec
    one = on_rank(baton.PipelineMesh(_pipe_mesh()), 1)
    two = on_rank(baton.PipelineMesh(jax.devices()[:8], ranks=4), 1)
    sub1 = one.sub

    def params(sh):
        return {"sharding": sh, "layout": None, "unconstrained_dims": frozenset(),
                "context_mesh": None}

    assert one.drop("sharding_constraint", params(NamedSharding(sub1, P("data"))))
    assert one.drop("sharding_constraint", params(NamedSharding(sub1, P())))
    assert not one.drop("sharding_constraint",
                        params(NamedSharding(sub1, P(), memory_kind="pinned_host")))
    assert not one.drop("sharding_constraint",
                        params(one_device_sharding(sub1.devices.flat[0])))
    assert not one.drop("sharding_constraint",
                        dict(params(NamedSharding(sub1, P())), layout=object()))
    assert not one.drop("copy_p", {})
    assert two.sub.devices.size == 2
    assert not two.drop("sharding_constraint", params(NamedSharding(two.sub, P("data"))))
    assert not two.drop("sharding_constraint",
                        params(NamedSharding(Mesh(two.sub.devices, ("data",)), P())))


def _dropout_loss(keys):
    """Four equal stages of two layers under ``lax.scan`` with dropout, each layer's RNG key
    one row of ``keys`` (a stack of 8 keys closed over, as MaxText's scanned layers hold
    their per-layer RNG streams): stage s slices rows ``2s:2s+2``. The mask is per feature,
    so the whole batch at once draws the same masks as each microbatch."""

    def layer(h, pk):
        p, k = pk
        keep = jax.random.bernoulli(k, 0.75, (D,))
        return jnp.where(keep, jnp.tanh(h @ p["w"] + p["b"]) / 0.75, 0.0), None

    def loss_fn(params, batch):
        x, y = batch
        for s, p in enumerate(params):
            k = jax.lax.slice_in_dim(keys, 2 * s, 2 * s + 2)
            x, _ = jax.lax.scan(layer, x, (p, k))
            if s < len(params) - 1:
                x = baton.stage_boundary(x)
        return jnp.mean((x - y) ** 2)

    return loss_fn


def test_stacked_rng_keys_sliced_per_stage_share():
    """The stages slice a stacked array of RNG keys at their own offsets: the slices move
    before the loop (``trace._Exporter.hoist_slice``) and each stage reads its keys like its
    parameters, so the middle ranks' tasks are equal and share one program, each device with
    its own rank's keys (the results equal plain JAX, whose every stage draws its own
    masks)."""
    mesh = _pipe_mesh()
    key = jax.random.key(4)
    loss_fn = _dropout_loss(jax.random.split(jax.random.key(7), 8))
    _check_middle_ranks_share(loss_fn, mesh, _stage_params(key), _batch(key))


def test_only_slices_without_gradients_move_before_the_loop():
    """Static slices of loop-invariant keys and integers leave the loop (one op per distinct
    slice, before the loop; a slice of such a slice too: ``k[1]`` is a slice of ``k``); a
    slice of a float parameter, whose gradient the loop makes, and a slice of a
    per-microbatch value stay."""
    from baton.tracing.trace import trace_step

    keys = jax.random.split(jax.random.key(0), 4)
    ids = jnp.arange(4, dtype=jnp.int32)

    def loss_fn(w, batch):
        k = jax.lax.slice_in_dim(keys, 1, 3)
        k2 = jax.lax.slice_in_dim(keys, 1, 3)  # the same slice again: the same input
        i = jax.lax.slice_in_dim(ids, 2, 4)
        x = batch * jax.lax.slice_in_dim(w, 0, 2).sum() + batch[:1].sum()
        noise = jax.random.normal(k[1], x.shape) + jax.random.normal(k2[0], x.shape)
        return jnp.mean(x * noise * i.sum())

    w = jnp.ones((4,))
    tr = trace_step(lambda w, b: baton.accumulate(jax.value_and_grad(loss_fn), w, batch=b),
                    (w, jnp.ones((8, 2))), 2)
    pre = [op for op in tr.ops if op.region == R.Pre and op.prim.name == "slice"]
    loop = [op for op in tr.ops if op.region == R.Loop and op.prim.name == "slice"]
    assert [tuple(op.params["start_indices"]) for op in pre] == [(1,), (2,), (1,), (0,)]
    assert {tr.avals[op.inputs[0]].dtype for op in loop} == {jnp.dtype(jnp.float32)}
    assert len(loop) == 2  # w's rows and the batch's first row
    first = min(i for i, op in enumerate(tr.ops) if op.region == R.Loop)
    assert all(tr.ops.index(op) < first for op in pre)
    hoisted = {o for _, o, mb in tr.loop_inputs if not mb} & {op.outputs[0] for op in pre}
    assert len(hoisted) == 4
