"""The pipeline layout as configuration (``baton.Layout``, ``baton.PipelineConfig``): one model
that marks every layer end, run under 1F1B, ZB-V and DualPipeV by configuration alone and
equal to plain JAX; other systems' schedule names; microbatch size; bad input named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import baton

LAYERS = 8
DIM = 8


def params_of(seed=0):
    key = jax.random.PRNGKey(seed)
    return [{"w": jax.random.normal(jax.random.fold_in(key, i), (DIM, DIM)) / DIM ** 0.5,
             "b": jnp.zeros((DIM,))} for i in range(LAYERS)]


def loss_fn(params, batch):
    x, y = batch
    for i, p in enumerate(params):
        x = jnp.tanh(x @ p["w"] + p["b"])
        if i < len(params) - 1:
            x = baton.stage_boundary(x)  # every layer end: the layout picks the cuts
    return jnp.mean((x - y) ** 2)


OPT = optax.sgd(0.1)


def step(params, opt_state, batch):
    loss, grads = baton.accumulate(jax.value_and_grad(loss_fn), params, batch=batch)
    upd, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, upd), opt_state, loss


def batch_of(n=8):
    k = jax.random.PRNGKey(7)
    return (jax.random.normal(k, (n, DIM)), jnp.sin(jax.random.normal(jax.random.fold_in(k, 1),
                                                                        (n, DIM))))


def reference(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    upd, _ = OPT.update(grads, OPT.init(params), params)
    return optax.apply_updates(params, upd), loss



def mesh():
    return baton.PipelineMesh(jax.devices()[:2], ranks=2)


def run(config: dict, batch=None):
    cfg = baton.PipelineConfig.from_dict(config)
    fn = baton.jit(step, mesh=mesh(), **cfg.jit_kwargs())
    p = params_of()
    new, _, loss = fn(p, OPT.init(p), batch if batch is not None else batch_of())
    return fn, new, loss


def test_schedule_switch_by_config_only_equals_jax():
    """1F1B (2 stages) -> ZB-V -> DualPipeV (4 stages): the same model, only the config
    changes (torchtitan's key and schedule names); each equals plain JAX."""
    want_p, want_loss = reference(params_of(), batch_of())
    results = {}
    for name in ("1F1B", "ZBVZeroBubble", "DualPipeV"):
        fn, new, loss = run({"pipeline_parallel_schedule": name,
                             "pipeline_parallel_microbatch_size": 2})
        assert fn.microbatches == 4
        assert fn.last.num_stages == {"1F1B": 2}.get(name, 4)
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(want_p)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        results[name] = jax.tree.leaves(new)
    for a, b in zip(results["ZBVZeroBubble"], results["DualPipeV"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_uneven_first_and_last_stage():
    """Megatron's first/last stage counts: 1 layer on stage 0, 1 on stage 3, 3 on each middle
    stage; the cut falls where asked and the result equals plain JAX."""
    fn, new, loss = run({"schedule": "zbv", "microbatches": 4,
                         "num_layers_in_first_pipeline_stage": 1,
                         "num_layers_in_last_pipeline_stage": 1})
    assert fn.last.num_stages == 4
    _, want_loss = reference(params_of(), batch_of())
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)


def test_layout_arithmetic():
    L = baton.Layout
    assert L().boundaries(7, 2) == [3]
    assert L().boundaries(7, 4) == [1, 3, 5]
    assert L().stage_layers(10, 4) == [2, 3, 3, 2]  # extras to the middle stages
    assert L(layers_per_stage=2).boundaries(7, 4) == [1, 3, 5]
    assert L(layers_per_stage=[1, 3, 3, 1]).boundaries(7, 4) == [0, 3, 6]
    assert L(first_stage_layers=1, last_stage_layers=1).stage_layers(8, 4) == [1, 3, 3, 1]
    assert L(first_stage_layers=2).stage_layers(8, 4) == [2, 2, 2, 2]
    assert L(split_points=[2, 5, 7]).stage_layers(8, 4) == [2, 3, 2, 1]
    assert L(split_points=[2, 5, 7]).boundaries(7, 4) == [1, 4, 6]


@pytest.mark.parametrize("layout, stages, words", [
    (dict(layers_per_stage=3), 4, ["layers_per_stage=3", "12 layers", "model has 8 layers"]),
    (dict(layers_per_stage=[2, 2, 2, 3]), 4, ["adds up to 9", "model has 8 layers"]),
    (dict(layers_per_stage=[4, 4]), 4, ["2 entries", "needs 4 stages"]),
    (dict(first_stage_layers=2, last_stage_layers=3), 4, ["leave 3 layers", "2 stages"]),
    (dict(split_points=[5, 3, 7]), 4, ["increase strictly"]),
    (dict(), 9, ["needs 9 stages", "8 layers"]),
])
def test_bad_layouts_named(layout, stages, words):
    with pytest.raises(baton.ConfigError) as e:
        baton.Layout(**layout).stage_layers(8, stages)
    for w in words:
        assert w in str(e.value)


def test_bad_layout_at_jit_names_the_model():
    """A layout that does not add up fails at the first call, naming both counts."""
    fn = baton.jit(step, mesh=mesh(), schedule="1F1B", microbatches=2,
                   layout=baton.Layout(layers_per_stage=3))
    p = params_of()
    with pytest.raises(baton.ConfigError, match=r"2 stages = 6 layers.*model has 8 layers"):
        fn(p, OPT.init(p), batch_of())


def test_schedule_names_of_other_systems():
    s = baton.schedule_from_name
    assert s("GPipe") == baton.GPipe()
    assert s("1F1B") == baton.OneFOneB()
    assert s("Interleaved1F1B") == baton.Interleaved1F1B(virtual_stages=2)
    assert s("ZBVZeroBubble") == baton.ZBV()
    assert s("DualPipeV") == baton.DualPipeV()
    assert s("forward_backward_pipelining_with_interleaving", 3) == \
        baton.Interleaved1F1B(virtual_stages=3)
    assert s("forward_backward_pipelining_without_interleaving") == baton.OneFOneB()
    for name in baton.schedule_aliases():
        s(name)
    with pytest.raises(baton.ScheduleError) as e:
        s("ZigZag1F1B")
    assert "unknown schedule 'ZigZag1F1B'" in str(e.value)
    assert "ZBVZeroBubble" in str(e.value) and "dualpipev" in str(e.value)
    with pytest.raises(baton.ScheduleError, match="InterleavedZeroBubble.*no Baton generator"):
        s("InterleavedZeroBubble")


def test_microbatch_size_that_does_not_split_the_batch():
    fn = baton.jit(step, mesh=mesh(), schedule="1f1b", microbatch_size=3,
                   layout=baton.Layout())
    p = params_of()
    with pytest.raises(baton.ConfigError, match=r"microbatch_size=3.*batch has 8 rows"):
        fn(p, OPT.init(p), batch_of())


@pytest.mark.parametrize("kw, words", [
    (dict(microbatches=2, microbatch_size=2), "not both"),
    (dict(layout=baton.Layout(), boundaries=[1]), "layout= or boundaries="),
    (dict(layout={"layers_per_stage": 2}), "layout must be a baton.Layout"),
    (dict(microbatch_size=0), "microbatch_size must be a positive integer"),
])
def test_bad_jit_options(kw, words):
    with pytest.raises(baton.ConfigError, match=words):
        baton.jit(step, mesh=mesh(), **kw)


def test_config_unknown_key():
    with pytest.raises(baton.ConfigError, match="unknown key 'pipeline_schedule'"):
        baton.PipelineConfig.from_dict({"pipeline_schedule": "1F1B"})
