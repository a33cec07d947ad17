"""Stage boundaries on the edge of a ``jax.checkpoint`` region (a rematerialized layer that ends
in a boundary, as in MaxText, where every decoder layer runs inside ``jax.checkpoint``): the
tracer moves the markers out of the region, the region stays one rematerialized op, and the
pipelined step equals plain ``jax.value_and_grad``. Also a ``stage_boundary`` call whose trace
JAX reuses for several layers (a cached ``jax.checkpoint`` / ``jax.jit`` function)."""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402
from baton.tracing.trace import trace_step  # noqa: E402


def _layer(w, x):
    return baton.stage_boundary(jnp.tanh(x @ w))


def _loss_of(wrap):
    f = wrap(_layer)  # one function for every layer: JAX reuses its trace (one marker uid)

    def loss(ws, b):
        x = b["x"]
        for w in ws[:-1]:
            x = f(w, x)
        return jnp.mean((jnp.tanh(x @ ws[-1]) - b["y"]) ** 2)

    return loss


def _data(n=4, dim=8, batch=16):
    key = jax.random.PRNGKey(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (dim, dim)) * 0.5 for i in range(n)]
    b = {"x": jax.random.normal(key, (batch, dim)),
         "y": jax.random.normal(jax.random.fold_in(key, 99), (batch, dim))}
    return ws, b


def _step(loss):
    return lambda p, bb: baton.accumulate(jax.value_and_grad(loss), p, batch=bb)


@pytest.mark.parametrize("policy", [None, "dots_saveable"])
@pytest.mark.parametrize("schedule", [baton.OneFOneB(), baton.ZBH1()], ids=str)
def test_rematerialized_layers_ending_in_a_boundary_match_plain_jax(policy, schedule):
    pol = None if policy is None else getattr(jax.checkpoint_policies, policy)
    loss = _loss_of(lambda f: jax.checkpoint(f, policy=pol))
    ws, b = _data()
    want = jax.value_and_grad(_loss_of(lambda f: f))(ws, b)
    step = baton.jit(_step(loss), mesh=baton.PipelineMesh(jax.devices()[:4], ranks=4),
                     schedule=schedule, microbatches=4)
    got = step(ws, b)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_markers_leave_the_remat_region_and_the_region_stays_one_op():
    ws, b = _data()
    tr = trace_step(_step(_loss_of(jax.checkpoint)), (ws, b), 4)
    assert tr.num_stages == 4
    marks = [(op.backward, op.boundary) for op in tr.ops
             if op.kind == baton._core.graph.OpKind.Boundary]
    # one uid for all three (a cached trace), numbered by position; backward in reverse
    assert marks == [(False, 0), (False, 1), (False, 2), (True, 2), (True, 1), (True, 0)]
    remats = [op for op in tr.ops if op.prim.name in ("remat2", "checkpoint")]
    assert len(remats) == 3  # the backward of each rematerialized layer, still a remat op
    for op in remats:
        body = op.params["jaxpr"]
        eqns = body.eqns if hasattr(body, "eqns") else body.jaxpr.eqns
        assert all(e.primitive.name != "stage_boundary" for e in eqns)


def test_a_reused_jit_block_is_paired_in_reverse_order():
    ws, b = _data()
    want = jax.value_and_grad(_loss_of(lambda f: f))(ws, b)
    step = baton.jit(_step(_loss_of(jax.jit)), mesh=baton.PipelineMesh(jax.devices()[:4], ranks=4),
                     schedule=baton.OneFOneB(), microbatches=4)
    got = step(ws, b)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_a_boundary_between_the_ops_of_a_remat_region_is_an_error():
    def inner(w, x):
        h = baton.stage_boundary(jnp.tanh(x @ w))
        return jnp.tanh(h @ w)

    def loss(ws, b):
        return jnp.mean(jax.checkpoint(inner)(ws[0], b["x"]) ** 2)

    ws, b = _data()
    with pytest.raises(baton.TraceError, match="between its ops"):
        trace_step(_step(loss), (ws, b), 2)


def test_a_forward_only_remat_region_has_its_boundary_moved_after_it():
    def loss(ws, b):
        return jnp.mean(jax.checkpoint(_layer)(ws[0], b["x"]) @ ws[1])

    ws, b = _data()
    tr = trace_step(lambda p, bb: baton.accumulate(loss, p, batch=bb), (ws, b), 2)
    assert tr.num_stages == 2
    marker = baton._core.graph.OpKind.Boundary
    kinds = [op.kind if op.kind == marker else op.prim.name for op in tr.ops]
    k = kinds.index(marker)
    assert kinds[k - 1] in ("remat2", "checkpoint")  # the marker follows its region
