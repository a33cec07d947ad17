"""Frontend unit tests: the stage_boundary primitive, accumulate, tracing, errors."""

import os
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402
from baton import _core  # noqa: E402
from baton.tracing.trace import trace_step  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import mlp  # noqa: E402


def _f(x):
    h = jnp.tanh(x * 2.0)
    h = baton.stage_boundary(h)
    return jnp.sum(jnp.sin(h) ** 2)


def _f_plain(x):
    return jnp.sum(jnp.sin(jnp.tanh(x * 2.0)) ** 2)


X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)


def test_stage_boundary_is_identity_on_pytrees():
    tree = {"a": X, "b": (X + 1, jnp.ones(2))}
    out = baton.stage_boundary(tree)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
        np.testing.assert_array_equal(a, b)
    assert baton.stage_boundary({}) == {}


def test_stage_boundary_survives_transformations():
    ref_v, ref_g = jax.value_and_grad(_f_plain)(X)
    v, g = jax.jit(jax.value_and_grad(_f))(X)
    np.testing.assert_allclose(v, ref_v, rtol=1e-6)
    np.testing.assert_allclose(g, ref_g, rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(_f)(X), jax.vmap(_f_plain)(X), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(jax.checkpoint(_f))(X), ref_g, rtol=1e-6)
    np.testing.assert_allclose(jax.jvp(_f, (X,), (X,))[1], jax.jvp(_f_plain, (X,), (X,))[1],
                               rtol=1e-6)

    def scanned(x):
        return jax.lax.scan(lambda c, r: (c + _f(r), None), 0.0, x)[0]

    np.testing.assert_allclose(jax.grad(scanned)(X), jax.grad(
        lambda x: jax.lax.scan(lambda c, r: (c + _f_plain(r), None), 0.0, x)[0])(X), rtol=1e-6)


def test_transpose_binds_backward_marker_with_same_id():
    jaxpr = jax.make_jaxpr(jax.grad(_f))(X)
    marks = [e for e in jaxpr.eqns if e.primitive.name == "stage_boundary"]
    assert [m.params["backward"] for m in marks] == [False, True]
    assert marks[0].params["uid"] == marks[1].params["uid"]


def test_accumulate_outside_pipeline_matches_full_batch():
    key = jax.random.PRNGKey(0)
    params = mlp.init_params(key, 2)
    batch = mlp.synthetic_batch(key, 16)
    loss_fn = mlp.make_loss(aux=True)
    vg = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, aux), grads = jax.jit(
        lambda p, b: baton.accumulate(vg, p, batch=b, microbatches=4,
                                      reduce=(("mean", "stack"), "mean")))(params, batch)
    (ref_loss, _), ref_grads = vg(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert aux.shape == (4,)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # sum = microbatches * mean
    s = baton.accumulate(lambda b: jnp.mean(b[0]), batch=batch, microbatches=4, reduce="sum")
    np.testing.assert_allclose(s, 4 * jnp.mean(batch[0]), rtol=1e-5)
    with pytest.raises(baton.ConfigError, match="divisible"):
        baton.accumulate(lambda b: jnp.mean(b[0]), batch=batch, microbatches=3)
    with pytest.raises(baton.ConfigError, match="reduce"):
        baton.accumulate(lambda b: jnp.mean(b[0]), batch=batch, microbatches=4, reduce="max")


def _mlp_step(stages=3):
    key = jax.random.PRNGKey(1)
    params = mlp.init_params(key, stages)
    opt = optax.sgd(0.1)
    step, _ = mlp.make_steps(mlp.make_loss(), opt)
    return step, (params, opt.init(params), mlp.synthetic_batch(key, 8))


def test_trace_exports_program_and_partition():
    step, args = _mlp_step(3)
    tr = trace_step(step, args, 4)
    assert tr.num_stages == 3 and tr.microbatches == 4
    text = tr.program.to_text()
    assert "stage_boundary[bwd 1]" in text and "[post]" in text
    for split, kinds in ((False, "FB"), (True, "FIW")):
        part = _core.graph.partition(tr.program, split)
        got = sorted((t.kind, t.stage) for t in part.tasks)
        assert got == sorted((k, s) for k in kinds for s in range(3))
        f0 = [t for t in part.tasks if (t.kind, t.stage) == ("F", 0)][0]
        assert len(f0.act_out) == 1 and f0.microbatch_in and f0.invariant_in
        last = [t for t in part.tasks if (t.kind, t.stage) == ("F", 2)][0]
        assert len(last.mb_out) == 1  # the loss
    # parameters of stage s are updated on stage s
    post_stages = {s for s, op in zip(part.op_stage, tr.ops)
                   if op.region == _core.graph.Region.Post}
    assert post_stages == {0, 1, 2}


# --- errors -----------------------------------------------------------------------

def _mesh(r):
    return baton.PipelineMesh(jax.devices()[:r], ranks=r)


def test_error_no_boundary_and_no_loop():
    key = jax.random.PRNGKey(0)
    params = mlp.init_params(key, 1)
    batch = mlp.synthetic_batch(key, 8)

    def step(p, b):
        return baton.accumulate(jax.value_and_grad(mlp.make_loss()), p, batch=b)

    # No boundary runs as one stage (tests/python/test_one_rank.py), but 2 ranks need 2.
    with pytest.raises(baton.TraceError, match="no stage_boundary .* needs 2 stages"):
        baton.jit(step, mesh=_mesh(2), schedule=baton.GPipe(), microbatches=2)(params, batch)
    with pytest.raises(baton.TraceError, match="no microbatch loop"):
        baton.jit(lambda p, b: mlp.make_loss()(p, b), mesh=_mesh(2), schedule=baton.GPipe(),
                  microbatches=2)(params, batch)


def test_error_boundary_outside_accumulate():
    def step(x):
        x = baton.stage_boundary(x * 2)
        return baton.accumulate(lambda b: jnp.mean(b), batch=x)

    with pytest.raises(baton.TraceError, match="outside baton.accumulate"):
        baton.jit(step, mesh=_mesh(2), schedule=baton.GPipe(), microbatches=2)(jnp.ones((4, 2)))


def test_error_stage_count_mismatch_and_divisibility():
    step, args = _mlp_step(3)
    with pytest.raises(baton.TraceError, match="3 stages .* needs 2 stages"):
        baton.jit(step, mesh=_mesh(2), schedule=baton.OneFOneB(), microbatches=4)(*args)
    step, args = _mlp_step(2)
    with pytest.raises(baton.ConfigError, match="divisible"):
        baton.jit(step, mesh=_mesh(2), schedule=baton.OneFOneB(), microbatches=3)(*args)


def test_error_empty_stage():
    """(A skip across stages is not an error: see test_stage_graph.py.)"""
    def loss_empty(p, b):
        h = baton.stage_boundary(jnp.tanh(b @ p))
        h = baton.stage_boundary(h)
        return jnp.mean(jnp.tanh(h @ p))

    def step(p, bb):
        return baton.accumulate(jax.value_and_grad(loss_empty), p, batch=bb)

    with pytest.raises(baton.TraceError, match="stage 1 has no work"):
        baton.jit(step, mesh=_mesh(3), schedule=baton.GPipe(), microbatches=2)(
            jnp.eye(4), jnp.ones((8, 4)))


def test_error_pytree_structure_change():
    step, (params, opt_state, batch) = _mlp_step(2)
    ps = baton.jit(step, mesh=_mesh(2), schedule=baton.GPipe(), microbatches=2)
    ps(params, opt_state, batch)
    with pytest.raises(baton.TraceError, match="structure"):
        ps(params, opt_state, {"x": batch[0], "y": batch[1]})


def test_retrace_cache_by_shape():
    step, (params, opt_state, batch) = _mlp_step(2)
    ps = baton.jit(step, mesh=_mesh(2), schedule=baton.GPipe(), microbatches=2)
    ps(params, opt_state, batch)
    first = ps.last
    ps(params, opt_state, batch)
    assert ps.last is first  # same shapes: reused
    ps(params, opt_state, (jnp.concatenate([batch[0]] * 2), jnp.concatenate([batch[1]] * 2)))
    assert ps.last is not first and len(ps._cache) == 2


def test_compile_cache_key_per_leaf():
    """The compile cache tells leaves apart by shape and dtype (arrays of every kind, numpy
    scalars, Python scalars by JAX's weak types), and agrees across array kinds."""
    import ml_dtypes

    from baton.frontend.arguments import leaf_key as _leaf_key

    f32 = jnp.ones((2, 3), jnp.float32)
    assert _leaf_key(f32) == _leaf_key(np.ones((2, 3), np.float32))
    assert _leaf_key(f32) == _leaf_key(jax.ShapeDtypeStruct((2, 3), jnp.float32))
    assert _leaf_key(f32) != _leaf_key(jnp.ones((3, 2), jnp.float32))
    assert _leaf_key(f32) != _leaf_key(jnp.ones((2, 3), jnp.bfloat16))
    assert _leaf_key(jnp.ones((2,), ml_dtypes.bfloat16)) == _leaf_key(
        np.ones((2,), ml_dtypes.bfloat16))
    assert _leaf_key(np.float32(1.0)) == ((), np.dtype(np.float32))
    assert _leaf_key(1.0) != _leaf_key(1)
    assert _leaf_key(1.0) == _leaf_key(2.5)


def test_pipeline_mesh():
    m = baton.PipelineMesh(jax.devices()[:8], ranks=4)
    assert m.num_ranks == 4 and m.devices_per_rank() == 2
    with pytest.raises(baton.ConfigError):
        baton.PipelineMesh(jax.devices()[:6], ranks=4)
    jm = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("pipe", "data"))
    m2 = baton.PipelineMesh(jm)
    assert m2.rank_devices == m.rank_devices
    # a mesh of the pipe axis alone: one device per rank
    pipe_only = baton.PipelineMesh(jax.sharding.Mesh(np.array(jax.devices()[:4]), ("pipe",)))
    assert pipe_only.num_ranks == 4 and pipe_only.devices_per_rank() == 1
    assert pipe_only.rank_devices == [[d] for d in jax.devices()[:4]]


def test_boundary_inside_nested_jit_is_found_and_inside_scan_is_rejected():
    @jax.jit
    def block(w, h):
        return baton.stage_boundary(jnp.tanh(h @ w))

    def loss_jit(w, b):
        return jnp.mean(jnp.tanh(block(w, b) @ w))

    def loss_scan(w, b):
        h, _ = jax.lax.scan(lambda c, _: (baton.stage_boundary(jnp.tanh(c @ w)), None), b,
                            None, length=2)
        return jnp.mean(h)

    w, b = jnp.eye(4), jnp.ones((8, 4))

    def step_of(fn):
        return lambda p, bb: baton.accumulate(jax.value_and_grad(fn), p, batch=bb)

    tr = trace_step(step_of(loss_jit), (w, b), 2)
    assert tr.num_stages == 2
    with pytest.raises(baton.TraceError, match="inside a 'scan' equation"):
        trace_step(step_of(loss_scan), (w, b), 2)


def _two_rank_step(**kw):
    """A 2-rank MLP step (1F1B, 4 microbatches) made with ``baton.jit(**kw)``."""
    key = jax.random.PRNGKey(0)
    params = mlp.init_params(key, 2)
    batch = mlp.synthetic_batch(key, 16)
    vg = jax.value_and_grad(mlp.make_loss())
    ps = baton.jit(lambda p, b: baton.accumulate(vg, p, batch=b),
                   mesh=baton.PipelineMesh(jax.devices()[:2], ranks=2),
                   schedule=baton.OneFOneB(), microbatches=4, **kw)
    return ps, params, batch


def test_engine_and_loop_form_are_declared_and_single_program_is_a_deprecated_alias():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ps, params, batch = _two_rank_step()
        step = ps.compile(params, batch)
    assert (step.engine_name, step.loop_form) == ("compiled", "auto")
    with pytest.raises(AttributeError):
        step.engine_name = "interpreter"
    with pytest.raises(AttributeError):
        step.loop_form = "table"
    ps, params, batch = _two_rank_step(engine="interpreter", loop_form="rolled")
    step = ps.compile(params, batch)
    assert (step.engine_name, step.loop_form) == ("interpreter", "rolled")
    for flag, name in ((False, "interpreter"), (True, "compiled")):
        with pytest.warns(DeprecationWarning,
                          match=f"single_program={flag} is deprecated; use engine='{name}'"):
            ps, params, batch = _two_rank_step(single_program=flag)
        assert ps.compile(params, batch).engine_name == name


@pytest.mark.parametrize("engine", ["compiled", "interpreter"])
def test_run_returns_its_record_and_leaves_none_on_the_step(engine):
    from baton.running.run_options import RunOptions
    from baton.running.step_run import StepRun

    ps, params, batch = _two_rank_step(engine=engine)
    step = ps.compile(params, batch)
    flat = jax.tree.leaves((params, batch))
    run = step.run(flat, opts=RunOptions(record=True, block=True))
    assert isinstance(run, StepRun)
    assert len(run.outputs) == len(step.traced.step_outputs)
    assert len(run.events) == 2 and all(len(ev) > 0 for ev in run.events)
    assert run.offsets == [0, 0]
    assert ("rank_program" if engine == "compiled" else "peak_bytes") in run.stats
    plain = step.run(flat)
    assert plain.events is None and plain.offsets is None
    for a, b in zip(run.outputs, plain.outputs, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for name in ("last_events", "last_offsets", "last_stats", "memory_model"):
        assert not hasattr(step, name), name
    # the baton.jit function keeps the last call's record, without its outputs
    tr = baton.trace(ps, params, batch)
    assert ps.last_run.outputs == [] and len(ps.last_run.events) == 2
    assert tr.num_ranks == 2
    ps(params, batch)
    assert ps.last_run.events is None and ps.last_run.stats
