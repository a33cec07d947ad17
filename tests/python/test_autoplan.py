"""Automatic planning end to end (``baton.autoplan``, ``baton.Auto``).

A model with a heavy first and last layer and a boundary marked after every layer (6
segments); Baton measures the segments once (cached on disk), searches cuts x schedules x
microbatches x remat on 2 ranks, and the chosen plan trains like plain JAX.
"""

import os
import re

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402

D, WIDE = 16, 256
OPT = optax.adamw(1e-2, eps=1e-6, weight_decay=0.01)


def loss_fn(params, batch):
    x = jnp.tanh(batch["x"] @ params["first"] @ params["first_out"])  # heavy
    for w in params["mid"]:
        x = baton.stage_boundary(x)
        x = x + jnp.tanh(x @ w)
    x = baton.stage_boundary(x)
    x = jnp.tanh(x @ params["last"]) @ params["last_out"]  # heavy
    return ((x - batch["y"]) ** 2).mean()


def init():
    ks = jax.random.split(jax.random.PRNGKey(0), 8)
    return {"first": jax.random.normal(ks[0], (D, WIDE)) / 8,
            "first_out": jax.random.normal(ks[1], (WIDE, D)) / 8,
            "mid": [jax.random.normal(k, (D, D)) / 4 for k in ks[2:6]],
            "last": jax.random.normal(ks[6], (D, WIDE)) / 8,
            "last_out": jax.random.normal(ks[7], (WIDE, 1)) / 8}


def batch_of(n=16):
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    return {"x": jax.random.normal(k1, (n, D)), "y": jax.random.normal(k2, (n, 1))}


def train_step(params, opt_state, batch):
    loss, grads = baton.accumulate(jax.value_and_grad(loss_fn), params, batch=batch)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def reference_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _check_trains_like_jax(ps):
    params, batch = init(), batch_of()
    ref = jax.jit(reference_step)
    p1 = p2 = params
    s1 = s2 = OPT.init(params)
    for _ in range(2):
        p1, s1, l1 = ps(p1, s1, batch)
        p2, s2, l2 = ref(p2, s2, batch)
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
    # AdamW divides by the gradient's running scale, so a near-zero gradient's float32 rounding
    # from another summation order (microbatches, schedule) moves a parameter by up to a few
    # 1e-6 after two steps of lr 1e-2; a wrong gradient moves it by about the learning rate
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.heavy  # test_jit_with_auto_schedule plans and trains through the same search
def test_autoplan_ranks_plans_and_the_best_one_trains(tmp_path):
    params, batch = init(), batch_of()
    args = (params, OPT.init(params), batch)
    rows = baton.autoplan(train_step, *args, ranks=2, microbatches=[2, 4, 8],
                          measure_at=(4,), runs=2, cache_dir=tmp_path)
    assert len(rows.segments["segments"]) == 6
    # the cost model's calibrated pieces (at the one count measured): a positive scale of the
    # isolated task times, the per-task saving of merged segments, each segment's share of
    # the update after the loop
    cal = rows.segments["measured"]["calibration"]["4"]
    assert cal["scale"] > 0 and cal["task_overhead"] >= 0
    assert rows.segments["task_overhead"] == cal["task_overhead"]
    assert list(rows.segments["by_microbatches"]) == ["4"]
    assert all(g["update"] >= 0 for g in rows.segments["segments"])
    assert rows and all(r.fits for r in rows)
    times = [r.step_time for r in rows]
    assert times == sorted(times)
    for r in rows:  # contiguous cuts over the 6 segments, one stage list per plan
        assert r.cuts[0] == 0 and r.cuts == sorted(set(r.cuts)) and r.cuts[-1] < 6
        assert len(r.cuts) == r.spec().stages(2)
    assert "| schedule |" in str(rows)
    best = rows.best
    _check_trains_like_jax(best.jit(train_step, baton.PipelineMesh(jax.devices()[:2], ranks=2)))
    # the measured costs are cached by the traced program: a second plan reads them
    again = baton.autoplan(train_step, *args, ranks=2, microbatches=[2, 4, 8],
                           measure_at=(4,), runs=2, cache_dir=tmp_path)
    assert again.segments.get("cached")
    assert [r.cuts for r in again] == [r.cuts for r in rows]
    # finalists measured on the mesh: the two best predicted, ranked first by measured time
    mesh = baton.PipelineMesh(jax.devices()[:2], ranks=2)
    timed = baton.autoplan(train_step, *args, ranks=2, microbatches=[2, 4, 8],
                           measure_at=(4,), runs=2, cache_dir=tmp_path, measure_top=2,
                           mesh=mesh, steps=2)
    key = lambda c: (c.schedule, c.microbatches, tuple(c.cuts), tuple(c.remat))  # noqa: E731
    assert {key(c) for c in timed[:2]} == {key(c) for c in rows[:2]}
    assert all(c.measured_step > 0 for c in timed[:2])
    assert timed[0].measured_step <= timed[1].measured_step
    assert all(c.measured_step is None for c in timed[2:])
    assert [key(c) for c in timed[2:]] == [key(c) for c in rows[2:]]
    assert "| measured (ms) |" in str(timed) and timed.stats["finalists_seconds"] > 0
    with pytest.raises(baton.ConfigError, match="measure_top needs the mesh"):
        baton.autoplan(train_step, *args, ranks=2, microbatches=[2, 4, 8], measure_at=(4,),
                       runs=2, cache_dir=tmp_path, measure_top=2)
    # a budget nothing meets names the smallest peak and its rank
    with pytest.raises(baton.ConfigError, match="rank"):
        baton.autoplan(train_step, *args, ranks=2, memory_per_device=1000,
                       microbatches=[2, 4, 8], measure_at=(4,), runs=2, cache_dir=tmp_path)


def test_jit_with_auto_schedule(tmp_path, monkeypatch):
    import importlib

    ap = importlib.import_module("baton.autoplan")  # (baton.autoplan is the function)

    # measure_top reaches the finalists' measurement with the step's mesh (measured for real
    # in test_autoplan_ranks_plans_and_the_best_one_trains; here the second of the two is
    # made the faster, so the chosen plan is the measured best, not the predicted best)
    seen = []

    def fake(rows, fn, args, mesh, k, steps=5):
        seen.append((mesh, k, steps))
        for j, c in enumerate(rows[:k]):
            c.measured_step = 2.0 - j
        rows[:k] = rows[:k][::-1]

    monkeypatch.setattr(ap, "measure_finalists", fake)
    auto = baton.Auto(microbatches=[4, 8], runs=2, cache_dir=tmp_path,
                      families=["1f1b", "zbh1", "gpipe"], measure_top=2)
    mesh = baton.PipelineMesh(jax.devices()[:2], ranks=2)
    ps = baton.jit(train_step, mesh=mesh, schedule=auto)
    _check_trains_like_jax(ps)
    assert seen == [(ps.mesh, 2, 2)]
    assert auto.chosen is not None and auto.chosen.schedule in ("1f1b", "zbh1", "gpipe")
    assert auto.chosen is auto.candidates[0] and auto.chosen.measured_step == 1.0
    assert ps.last.num_stages == 2 and ps.last.M == auto.chosen.microbatches


def test_search_on_given_costs():
    """The search on costs the caller gives or edits (no JAX work): step_overhead moves every
    prediction by itself, a segment's update counts on its rank, task_overhead makes merged
    stages cheaper, and a count measured on its own (by_microbatches) is searched with its
    own times."""
    seg = {"f": 1e-3, "b": 2e-3, "act_bytes": 64, "param_bytes": 100}
    costs = {"batch": 8, "ref_microbatch": 1,
             "segments": [dict(seg) for _ in range(3)] + [dict(seg, f=4e-3, b=8e-3)]}
    kw = dict(microbatches=[2, 4], families=["1f1b"], remat=("keep",))
    base = baton.search_segments(costs, 2, **kw)
    slow = baton.search_segments(dict(costs, step_overhead=0.01), 2, **kw)
    assert [r.cuts for r in slow] == [r.cuts for r in base]
    for a, b in zip(base, slow):
        assert b.step_time == pytest.approx(a.step_time + 0.01)
    # the heavy last segment alone on rank 1; its update after the loop joins rank 1's
    # time, so a large one moves the best cut to balance the updates instead
    assert base.best.cuts == [0, 3]
    upd = dict(costs, segments=[dict(g, update=0.0) for g in costs["segments"][:3]]
               + [dict(costs["segments"][3], update=0.05)])
    assert baton.search_segments(upd, 2, **kw).best.step_time > 0.05
    merged = baton.search_segments(dict(costs, task_overhead=5e-4), 2, **kw)
    assert merged.best.step_time < base.best.step_time
    # M = 2 measured on its own, twice as slow as the reference times scaled: its rows
    # change, M = 4's do not; costs_at scales the activation bytes to the microbatch
    times = [[2 * g["f"] * 4, 2 * g["b"] * 4, 2 * g["b"] * 4, 0.0, 0.0]
             for g in costs["segments"]]
    own = dict(costs, by_microbatches={"2": {"task_overhead": 0.0, "times": times}})
    at2 = baton.costs_at(own, 2)
    assert at2["ref_microbatch"] == 4 and at2["segments"][0]["act_bytes"] == 64 * 4
    assert at2["segments"][0]["f"] == pytest.approx(8e-3)
    both = baton.search_segments(own, 2, **kw)
    plain = {(r.microbatches, tuple(r.cuts)): r.step_time for r in base}
    for r in both:
        key = (r.microbatches, tuple(r.cuts))
        if r.microbatches == 4 and key in plain:
            assert r.step_time == pytest.approx(plain[key])
        if r.microbatches == 2 and key in plain:
            assert r.step_time > plain[key]


def test_update_copies_count_unless_the_step_donates():
    """Without donation the update after the loop allocates each stage's new parameters and
    optimizer state beside the old ones: a rank's peak is at least static + those bytes, which
    can exceed the loop's peak; a donating step (update_in_place) writes them in place."""
    seg = {"f": 1e-3, "b": 2e-3, "act_bytes": 64, "stash_bytes": 128, "param_bytes": 4000,
           "opt_bytes": 8000}
    costs = {"batch": 8, "ref_microbatch": 1, "segments": [dict(seg) for _ in range(4)]}
    kw = dict(microbatches=[4], families=["1f1b"], remat=("keep",))
    plain = baton.search_segments(costs, 2, **kw).best
    donated = baton.search_segments(costs, 2, update_in_place=True, **kw).best
    assert plain.cuts == donated.cuts == [0, 2]
    static = 2 * (2 * 4000 + 8000)  # two segments per rank: params, their grads, opt state
    for r in range(2):
        assert plain.peak_memory[r] == static + 2 * (4000 + 8000)  # the new copies
        assert static < donated.peak_memory[r] < plain.peak_memory[r]  # the loop's buffers
    # a budget between the two: only the donating step fits
    budget = max(donated.peak_memory)
    assert baton.search_segments(costs, 2, memory_per_device=budget,
                                 update_in_place=True, **kw).best.fits
    with pytest.raises(baton.ConfigError, match="no candidate fits") as e:
        baton.search_segments(costs, 2, memory_per_device=budget, **kw)
    # one message: the smallest peak over every search (remat mode, microbatch count), its rank
    msg = str(e.value)
    assert msg.count("no candidate fits") == 1 and re.search(r"smallest peak found is .* on "
                                                             r"rank \d", msg), msg
    assert "searches" in msg, msg


def test_offload_chosen_over_recompute_when_the_host_link_hides_it_and_trains():
    """GPipe holds every microbatch's stash on both ranks: keeping them does not fit the
    budget, recomputing (min) does, and so does offloading them. With a host link fast
    against the compute the search keeps the stashes and offloads them (faster than
    recomputing); with a slow one it recomputes. The chosen plan runs through
    ``baton.jit(offload=...)`` and trains like plain JAX on this file's six-segment model."""
    seg = {"f": 1e-3, "b": 2e-3, "act_bytes": 64, "stash_bytes": 4096, "min_stash_bytes": 256,
           "min_recompute": 1e-3, "param_bytes": 100}
    costs = {"batch": 16, "ref_microbatch": 2, "segments": [dict(seg) for _ in range(6)]}
    kw = dict(microbatches=[8], families=["gpipe"], memory_per_device=60000)
    plain = baton.search_segments(costs, 2, **kw).best
    assert plain.remat[0] == "min" and not plain.offload
    with pytest.raises(baton.ConfigError, match="host_link_bandwidth"):
        baton.search_segments(costs, 2, offload=True, **kw)
    fast = baton.search_segments(dict(costs, host_link_bandwidth=1e9), 2, offload=True, **kw)
    best = fast.best
    assert best.remat[0] == "keep" and best.offload == ["stash", "stash"], str(fast)
    assert best.step_time < plain.step_time and max(best.peak_memory) <= 60000
    assert min(best.peak_host) > 0 and "offload stages 0, 1" in str(fast)
    assert best.jit_kwargs()["offload"] == {0: "stash", 1: "stash"}
    assert plain.jit_kwargs()["offload"] is None
    # the host memory each rank may hold bounds it
    capped = baton.search_segments(dict(costs, host_link_bandwidth=1e9), 2, offload=True,
                                   host_memory=min(best.peak_host) - 1, **kw).best
    assert not capped.offload and capped.remat[0] == "min"
    slow = baton.search_segments(dict(costs, host_link_bandwidth=1e5), 2, offload=True, **kw)
    assert not slow.best.offload and slow.best.remat[0] == "min"
    _check_trains_like_jax(best.jit(train_step, baton.PipelineMesh(jax.devices()[:2], ranks=2)))


def test_nothing_fits_names_the_smallest_peak_of_all_searches():
    from baton.autoplan import _smallest_peak_error

    def err(peak, rank):
        return (f"autoplan: no candidate fits the memory budget of 1.00KiB (1024 bytes) per "
                f"rank; the smallest peak found is x ({peak} bytes) on rank {rank} (1f1b)")

    msg = _smallest_peak_error([err(9000, 0), err(2000, 1), err(5000, 0)])
    assert "(2000 bytes) on rank 1" in msg and "9000" not in msg and "3 searches" in msg
    assert _smallest_peak_error(["a", "b"]) == "autoplan: no plan fits: a; b"


def test_outside_times_time_each_segment_on_zeros_of_its_inputs():
    """The update after the loop is timed per stage on zeros of each segment's inputs, typed
    PRNG keys included (a key split before the loop); every stage's segments are summed."""
    import importlib
    import types

    sc = importlib.import_module("baton.segment_costs")
    keys = jax.random.split(jax.random.key(1), 4)
    avals = {1: jax.core.ShapedArray((4,), keys.dtype),
             2: jax.core.ShapedArray((3,), np.float32)}
    seen = []

    def upd(k, x):
        seen.append((k.dtype, x.dtype))
        return jax.random.key_data(k).sum(), x * 2

    segs = [types.SimpleNamespace(stage=s, inputs=[1, 2], fn=jax.jit(upd)) for s in (0, 0, 1)]
    step = types.SimpleNamespace(traced=types.SimpleNamespace(avals=avals, literals={}),
                                 pre_segments=segs[:1], post_segments=segs[1:])
    got = sc._outside_times(step, jax.devices()[0], 3)
    assert sorted(got) == [0, 1] and all(t > 0 for t in got.values())
    assert seen and seen[0][0] == keys.dtype  # traced once per distinct input signature
