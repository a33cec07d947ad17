"""End-to-end: pipelined training steps match single-device JAX + Optax.

Reference: the same step with jax.value_and_grad on the full batch (no
microbatching) and the same optimizer. float32, each of 3 AdamW steps checked from
the state it starts from: rtol 1e-5 on its loss and gradients against the reference
step's, and on its parameters and optimizer state against the optimizer applied to
its gradients (run_mlp says why). Every schedule runs on 2, 4 and 8 CPU devices (one rank each).
Not bit-identical to the full-batch reference: the mean of microbatch means
rounds differently (test_gradients_bit_identical_to_scan shows the pipelined
gradients equal, bit for bit, a lax.scan over the same microbatches).
"""

import os
import re
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import explain  # noqa: E402
import gpt  # noqa: E402
import mlp  # noqa: E402

# AdamW with eps=1e-6: with the default 1e-8 a gradient entry of ~1e-9 (e.g. float
# noise of a mathematically-zero gradient) makes Adam's update sign noise.
OPT = optax.adamw(1e-2, eps=1e-6, weight_decay=0.01)


def apply_opt(params, opt_state, grads):
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def on_host(tree):
    return jax.tree.map(np.asarray, tree)


def close(a, b, rtol=1e-5, atol=1e-6):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def mesh(ranks, per_rank=1):
    assert len(jax.devices()) >= ranks * per_rank, "run with JAX_NUM_CPU_DEVICES=8"
    return baton.PipelineMesh(jax.devices()[: ranks * per_rank], ranks=ranks)


def run_mlp(schedule, ranks, microbatches=4, steps=3, per_rank=1, remat=False, scan=False,
            aux=False, layers_per_stage=1, engine="compiled", transport=None):
    stages = schedule.stages(ranks)
    key = jax.random.PRNGKey(stages)
    params = mlp.init_params(key, stages, layers_per_stage, scan=scan)
    batch = mlp.synthetic_batch(key, 4 * microbatches)
    loss_fn = mlp.make_loss(remat=remat, scan=scan, aux=aux)
    step, ref = make_steps(loss_fn, aux)
    ps = baton.jit(step, mesh=mesh(ranks, per_rank), schedule=schedule, microbatches=microbatches,
                   engine=engine, transport=transport)
    ref = jax.jit(ref)
    opt = jax.jit(apply_opt)
    p1 = params
    s1 = OPT.init(params)
    # Each step is checked from the state the pipelined step starts from: its loss and
    # gradients against the reference step's, its parameters and optimizer state against
    # the optimizer applied (in plain JAX) to its own gradients. Adam divides each gradient
    # entry by about |g| + eps, so the float noise of an entry near zero (2.79e-8 pipelined
    # against 2.88e-8 in the reference, DualPipeV on 8 ranks) moves its parameter by up to
    # lr / eps times that noise: compared with the reference's parameters, rtol 1e-5 would
    # test the rounding of near-zero gradients, not the pipeline.
    for i in range(steps):
        if aux and i == 0:  # expected per-microbatch aux of the first step
            xs = [jax.tree.map(lambda a: a.reshape(microbatches, -1, *a.shape[1:])[m], batch)
                  for m in range(microbatches)]
            want_aux = jnp.stack([loss_fn(p1, mb)[1] for mb in xs])
        p0, s0 = on_host(p1), on_host(s1)
        p1, s1, out1, g1 = ps(p1, s1, batch)
        _, _, out2, g2 = ref(p0, s0, batch)
        p2, s2 = opt(p0, s0, on_host(g1))
        if aux:
            (l1, a1), (l2, _) = out1, out2
            if i == 0:
                np.testing.assert_allclose(a1, want_aux, rtol=1e-5)
        else:
            l1, l2 = out1, out2
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
        close(g1, g2, atol=1e-7)  # every gradient of every step
        close(p1, p2)  # every updated parameter after every step
        close(s1, s2, atol=1e-6)
    # parameters come back on the rank that owns their stage (and stay there)
    step = ps.last
    for st in range(stages):
        want = set(step.mesh.rank_devices[step.stage_rank[st]])
        for leaf in jax.tree.leaves(p1[st]):
            assert leaf.sharding.device_set == want, (st, leaf.sharding)
    ps.final_params = p1
    ps.last_args = (p1, s1, batch)
    return ps


def make_steps(loss_fn, aux=False):
    """mlp.make_steps, also returning the (accumulated) gradients of the step."""
    vg = jax.value_and_grad(loss_fn, has_aux=aux)
    reduce = (("mean", "stack"), "mean") if aux else "mean"

    def update(params, opt_state, out, grads):
        return (*apply_opt(params, opt_state, grads), out, grads)

    def train_step(params, opt_state, batch):
        return update(params, opt_state, *baton.accumulate(vg, params, batch=batch,
                                                            reduce=reduce))

    def reference_step(params, opt_state, batch):
        return update(params, opt_state, *vg(params, batch))

    return train_step, reference_step


def check_memory(ps, interpreter=False):
    """Peak memory per rank within the simulator's prediction, and not far below it: the trace
    of a compiled step replayed with the plan's buffer sizes at its measured times (at least
    0.6 of the prediction: another order of a buffer or two at the peak; seen 0.83-1.0); with
    ``interpreter``, also the live bytes the interpreter measures on one more step (it counts
    every buffer's arrays; the compiled engine's buffers are XLA's), at least half of the
    prediction (it counts a receive from its completion, the model from its post: seen
    0.67-1.0)."""
    if "peak_bytes" not in ps.last_run.stats:
        tr = baton.trace(ps, *ps.last_args)
        for r, (m, p) in enumerate(zip(tr.peak_total, ps.simulate().peak_total)):
            assert 0.6 * p <= m <= p, f"rank {r}: replayed peak {m} B, predicted {p} B"
        if not interpreter:
            return
        # the same step on the interpreter (the engine is chosen when the step is made)
        args = ps.last_args
        ps = baton.jit(ps.fn, mesh=ps.mesh, schedule=ps.spec, microbatches=ps.microbatches,
                       transport=ps.transport, engine="interpreter")
        ps(*args)
    sim = ps.simulate()
    measured = ps.last_run.stats["peak_bytes"]
    predicted = list(sim.peak_total)
    assert len(measured) == len(predicted)
    for r, (m, p) in enumerate(zip(measured, predicted)):
        assert 0.5 * p <= m <= p, f"rank {r}: measured peak {m} B, predicted {p} B"
    assert max(measured) > 0


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule", [baton.GPipe(), baton.OneFOneB()], ids=["gpipe", "1f1b"])
def test_mlp_matches_reference_one_microbatch_per_stage(schedule, ranks):
    """As many microbatches as stages: the pipeline fills and drains with no steady state
    (test_every_schedule runs the longer pipelines)."""
    ps = run_mlp(schedule, ranks, microbatches=ranks)
    check_memory(ps, interpreter=True)


def test_mlp_gradients_match():
    key = jax.random.PRNGKey(3)
    params = mlp.init_params(key, 4)
    batch = mlp.synthetic_batch(key, 16)
    vg = jax.value_and_grad(mlp.make_loss())
    ps = baton.jit(lambda p, b: baton.accumulate(vg, p, batch=b), mesh=mesh(4),
                   schedule=baton.ZBH1(), microbatches=4)
    loss, grads = ps(params, batch)
    ref_loss, ref_grads = vg(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    close(grads, ref_grads, atol=1e-7)
    # gradients of stage s stay on the rank of stage s
    for s in range(4):
        assert jax.tree.leaves(grads[s])[0].devices() == {jax.devices()[s]}


# Every schedule allows 2, 4 and 8 ranks. Interleaved1F1B(v=2), ZB-V and DualPipeV
# have two stages per rank: 16 stages (one small layer each) on 8 ranks.
SCHEDULES = [
    ("gpipe", baton.GPipe(), [2, 4, 8]),
    ("1f1b", baton.OneFOneB(), [2, 4, 8]),
    ("eager1f1b", baton.Eager1F1B(), [2, 4, 8]),
    ("interleaved", baton.Interleaved1F1B(virtual_stages=2), [2, 4, 8]),
    ("zbh1", baton.ZBH1(), [2, 4, 8]),
    ("zbh2", baton.ZBH2(), [2, 4, 8]),
    ("zbv", baton.ZBV(), [2, 4, 8]),
    ("vmin", baton.VMin(), [2]),
    ("vhalf", baton.VHalf(), [4]),  # on 2 or 3 ranks V-Half is V-Min's order
    ("dualpipev", baton.DualPipeV(), [2, 4, 8]),
]


def every_schedule_microbatches(schedule, ranks):
    if ranks < 8:
        return max(2 * schedule.stages(ranks), 4)
    # 8 ranks: one microbatch per rank keeps the 16-stage cases small; DualPipeV
    # needs at least two per rank (interleaved: a multiple of the rank count).
    return 2 * ranks if isinstance(schedule, baton.DualPipeV) else ranks


@pytest.mark.parametrize(
    "schedule,ranks",
    [pytest.param(s, r, id=f"{n}-{r}") for n, s, rs in SCHEDULES for r in rs],
)
def test_every_schedule(schedule, ranks):
    """Loss and gradients of each of 3 AdamW steps, and the parameters and optimizer
    state after each, match the full-batch reference; measured peak memory per rank is
    within the simulator's prediction."""
    ps = run_mlp(schedule, ranks, microbatches=every_schedule_microbatches(schedule, ranks))
    assert ps.last.num_stages == schedule.stages(ranks)
    assert ps.last.num_ranks == ranks
    check_memory(ps)


def test_gpt_tied_embedding_adamw():
    """GPT (tied LM head) on 4 ranks with ZB-H1 (I/W split): gradients, then 3 AdamW steps."""
    cfg = gpt.GPTConfig(stages=4, layers=4)
    model, params, opt, st, step, ref = gpt.make(cfg, eps=1e-6)
    batch = gpt.synthetic_batch(cfg, 8)
    m = mesh(4)
    ps = baton.jit(step, mesh=m, schedule=baton.ZBH1(), microbatches=4)
    ref = jax.jit(ref)
    p1 = p2 = params
    s1 = s2 = st
    for i in range(3):
        p1, s1, l1 = ps(p1, s1, batch)
        p2, s2, l2 = ref(p2, s2, batch)
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
        if i == 0:
            # Adam's first moment after one step is (1 - b1) * grad: the gradients match.
            close(s1[0].mu, s2[0].mu, rtol=1e-5, atol=1e-8)
    # Adam divides by sqrt(v): gradient entries near zero turn float rounding
    # differences into parameter differences of a fraction of one step (lr=1e-3).
    close(p1, p2, atol=1e-5)
    # the tied embedding's gradient has one part on the first and one on the last stage
    stages_of = {}
    for p in ps.last.parts:
        stages_of.setdefault(p.outer, set()).add(p.stage)
    assert {0, 3} in stages_of.values()
    ps.last_args = (p1, s1, batch)
    check_memory(ps)


def test_data_parallel_inside_stage():
    """Ranks of two devices run on the interpreter (chosen explicitly: the compiled engine
    refuses them, see test_compiled_engine_refuses_multi_device_ranks)."""
    ps = run_mlp(baton.OneFOneB(), 4, per_rank=2, engine="interpreter")
    # rank r owns devices 2r, 2r+1: its microbatches are split over both and its
    # parameters (updated on the rank) are replicated over both.
    devs = jax.devices()
    for s in range(4):
        w = ps.final_params[s][0]["w"]
        assert w.sharding.device_set == {devs[2 * s], devs[2 * s + 1]}
    assert len(ps.last.mesh.batch_sharded(1, (4, 16)).device_set) == 2
    check_memory(ps)


def test_compiled_engine_refuses_multi_device_ranks():
    with pytest.raises(baton.ConfigError, match="rank 0 has 2 devices.*engine='interpreter'"):
        run_mlp(baton.OneFOneB(), 2, per_rank=2, steps=1)


def test_compiled_engine_names_a_rank_it_cannot_run():
    """What the engine refuses is said before anything runs (here: a GPU rank, faked)."""
    ps = run_mlp(baton.OneFOneB(), 2, steps=1)
    step = ps.last
    assert step.engine_refusal(0) is None and step.engine_refusal(1, "gloo") is None
    assert "'nccl'" in step.engine_refusal(0, "nccl")

    class FakeGpu:
        platform = "gpu"

    gpu = FakeGpu()
    step.mesh.rank_devices[1] = [gpu]
    assert "rank 1 runs on a GPU" in step.engine_refusal(1)
    assert "not 'local'" in step.engine_refusal(1)
    if baton.emit.ffi.has_cuda():  # the NCCL handlers are built: a GPU per rank runs
        assert step.engine_refusal(1, "nccl") is None
        step.mesh.rank_devices[0] = [gpu]
        assert "ranks 0 and 1 of this process share GPU" in step.engine_refusal(1, "nccl")
    else:
        assert "no CUDA transfer handlers" in step.engine_refusal(1, "nccl")


def test_nccl_transport_on_cpus_is_refused_by_name():
    with pytest.raises(baton.ConfigError, match="rank 0 runs on CPU.*not 'nccl'"):
        run_mlp(baton.OneFOneB(), 2, steps=1, transport="nccl")


def test_checkpoint_and_scan_inside_stage_and_aux():
    run_mlp(baton.OneFOneB(), 4, remat=True, layers_per_stage=2)
    run_mlp(baton.ZBH1(), 2, scan=True, layers_per_stage=3)
    run_mlp(baton.GPipe(), 2, aux=True)


def test_schedule_from_text_format(tmp_path):
    text = baton.save_schedule(baton.OneFOneB().build(2, 4))
    path = tmp_path / "my.sched"
    path.write_text(text)
    run_mlp(baton.ScheduleFile(str(path)), 2)


def test_pre_loop_code_and_closed_over_values():
    """Code before the loop runs on the stage that consumes it; the loop body may close
    over values computed in the step."""
    key = jax.random.PRNGKey(7)
    params = mlp.init_params(key, 2)
    batch = mlp.synthetic_batch(key, 8)
    loss_fn = mlp.make_loss()

    def step(params, batch, scale):
        shifted = jax.tree.map(lambda w: w * 0.5, params)  # before the loop
        factor = scale * 2.0

        def scaled(p, b):
            return loss_fn(p, b) * factor  # closes over a traced value

        return baton.accumulate(jax.value_and_grad(scaled), shifted, batch=batch)

    ps = baton.jit(step, mesh=mesh(2), schedule=baton.OneFOneB(), microbatches=4)
    scale = jnp.float32(1.5)
    loss, grads = ps(params, batch, scale)
    ref_loss, ref_grads = jax.jit(step)(params, batch, scale)  # plain jit: accumulate = 1 mb
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    close(grads, ref_grads, atol=1e-7)
    assert len(ps.last.pre_segments) >= 1


@pytest.mark.parametrize("schedule", [pytest.param(s, id=n) for n, s, _ in SCHEDULES])
def test_gradients_bit_identical_to_scan(schedule):
    """Loss and gradients equal, bit for bit, the same step under plain jax.jit, where
    accumulate is a lax.scan over the same microbatches: each task computes exactly
    what the scan body computes, and every schedule accumulates a stage's microbatches
    in order. (Versus the full-batch reference they agree to rtol 1e-5 only: the
    mean of microbatch means rounds differently.)"""
    ranks = 2
    stages = schedule.stages(ranks)
    m = 2 * stages
    key = jax.random.PRNGKey(11)
    params = mlp.init_params(key, stages)
    batch = mlp.synthetic_batch(key, 4 * m)
    vg = jax.value_and_grad(mlp.make_loss())
    ps = baton.jit(lambda p, b: baton.accumulate(vg, p, batch=b), mesh=mesh(ranks),
                   schedule=schedule, microbatches=m)
    got = ps(params, batch)
    want = jax.jit(lambda p, b: baton.accumulate(vg, p, batch=b, microbatches=m))(params, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_stalled_rank_is_reported_instead_of_hanging():
    """Rank 1's forward stalls (a host callback that sleeps past the executor's timeout):
    rank 0, waiting for rank 1's gradient, stops with an error naming what it waited on,
    and the call returns instead of hanging."""
    import time

    def sleep_then_identity(v):
        time.sleep(3.0)
        return v

    @jax.custom_jvp
    def stall(x):
        return jax.pure_callback(sleep_then_identity, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    @stall.defjvp
    def _stall_jvp(primals, tangents):
        return stall(primals[0]), tangents[0]

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w0"])
        h = baton.stage_boundary(h)
        h = stall(h) @ p["w1"]
        return jnp.mean((h - b["y"]) ** 2)

    key = jax.random.PRNGKey(5)
    params = {"w0": jax.random.normal(key, (4, 4)), "w1": jax.random.normal(key, (4, 2))}
    batch = {"x": jnp.ones((4, 4)), "y": jnp.zeros((4, 2))}
    ps = baton.jit(lambda p, b: baton.accumulate(jax.value_and_grad(loss), p, batch=b),
                   mesh=mesh(2), schedule=baton.GPipe(), microbatches=2, timeout=1.0)
    with pytest.raises(baton.ExecutionError, match=r"rank 0\b.*grad\(s1,m0\).*rank 1"):
        ps(params, batch)


def test_worked_example_of_the_architecture_doc(capsys):
    """examples/explain.py (the worked example in docs/WORKED_EXAMPLE.md) runs, checks itself
    against the full-batch reference, and still shows what the document describes. (Value
    ids and primitive names depend on the JAX version, so only the structure is checked.)"""
    assert explain.main([]) == 0
    out = capsys.readouterr().out
    one_f_one_b, zbh1 = out.split("schedule ZBH1")
    assert re.search(r"stage_boundary\[backward=True uid=\d+\]", one_f_one_b)  # the jaxpr
    # markers are in no task; the SGD update of stage s's parameters runs on stage s
    assert re.search(r"loop cut +v\d+ = stage_boundary\[0\] ", one_f_one_b)
    assert re.search(r"loop cut +v\d+ = stage_boundary\[0, backward\] ", one_f_one_b)
    assert re.search(r"post stage 0 +v\d+ = sub in0 ", one_f_one_b)
    assert re.search(r"post stage 1 +v\d+ = sub in3 ", one_f_one_b)
    for task in ["F0", "B0", "F1", "B1"]:
        assert re.search(rf"^{task}: ops \[\d", one_f_one_b, re.M), task
    assert re.search(r"^F1: .*\n( .*\n)*    out output ", one_f_one_b, re.M)  # the loss
    assert re.search(r"^B1: .*\n( .*\n)*    out grad ", one_f_one_b, re.M)
    # send-backward/receive-forward group on rank 1 (the plan does not depend on JAX)
    assert "  #7 SEND grad(s1,m0)->0\n  #8 RECV act(s0,m1)<-0" in one_f_one_b
    assert "I0: ops []\n" in zbh1  # stage 0 sends no gradient: all of its backward is W
    for task in ["I1", "W0", "W1"]:
        assert re.search(rf"^{task}: ops \[\d", zbh1, re.M), task
    assert "  #12 SEND grad(s1,m1)->0\n  #13 FREE grad(s1,m1)\n  #14 RUN W1.0" in zbh1
    assert out.count("ran one step") == 2
