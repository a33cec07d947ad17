"""Runtime bindings: executor with Python tasks, in-process and Gloo transports (threads),
DLPack transfers of every dtype, failure propagation, rendezvous from the environment."""

from __future__ import annotations

import threading
import time

import ml_dtypes
import numpy as np
import pytest

import baton
from baton import _core
from baton import runtime as rt
from baton.runtime import rendezvous

from scalar_pipeline import apply_action, expected_accumulator  # noqa: E402


def fake_tasks(plan, rank, acc, *, make=np.asarray, fail_at=None, to_jax=False):
    """Tasks mirroring the C++ tests: F: act = in + 1, stash = in; B/I: grad = 2 g,
    wgrad|wstash = stash * g; W: wgrad = wstash; ACCUMULATE sums wgrad per stage.
    A value is a one-element list holding an array."""
    core = plan.core
    runs = [0]

    def run(r, a, in_ids, ins, out_ids):
        assert r == rank
        if runs[0] == fail_at:
            raise ValueError("boom from the task")
        runs[0] += 1
        env = {b: float(np.asarray(v[0]).reshape(-1)[0]) for b, v in zip(in_ids, ins)}
        apply_action(core, r, a, env)
        return [[make(np.array([env[b]], dtype=np.float32))] for b in out_ids]

    def accumulate(r, b, v):
        s = core.buffer_key(b).stage
        acc[s] = acc.get(s, 0.0) + float(np.asarray(v[0]).reshape(-1)[0])

    return rt.make_tasks(run, accumulate, to_jax=to_jax)


def expected(plan, stage):
    sch = plan.core.schedule
    return expected_accumulator(sch.num_stages, sch.num_microbatches, stage)


def run_threads(fns):
    """Runs fns[r]() on one thread each; returns per-rank exceptions (None when fine)."""
    errors = [None] * len(fns)

    def wrap(r):
        try:
            fns[r]()
        except BaseException as e:  # noqa: BLE001
            errors[r] = e

    th = [threading.Thread(target=wrap, args=(r,)) for r in range(len(fns))]
    for t in th:
        t.start()
    for t in th:
        t.join(60)
        assert not t.is_alive(), "a rank thread hung"
    return errors


def gloo_pair(p=2):
    store = rt.hash_store()
    ts = [None] * p

    def mk(r):
        ts[r] = rt.gloo_transport(r, p, store)

    assert run_threads([lambda r=r: mk(r) for r in range(p)]) == [None] * p
    return ts


def close_all(ts):
    run_threads([t.close for t in ts])


def run_plan(plan, transports, *, steps=1, timeout=30.0, fail=None, to_jax=False,
             make=np.asarray):
    p = plan.num_ranks
    accs = [dict() for _ in range(p)]
    execs = [None] * p

    def body(r):
        tasks = fake_tasks(plan, r, accs[r], fail_at=fail.get(r) if fail else None,
                           to_jax=to_jax, make=make)
        ex = rt.Executor(plan.rank_ir(), r, transports[r], tasks, timeout=timeout,
                         record_events=True)
        execs[r] = ex
        ex.handshake(10.0)
        for _ in range(steps):
            ex.run()

    errors = run_threads([lambda r=r: body(r) for r in range(p)])
    return accs, execs, errors


def check(plan, accs, steps=1):
    sch = plan.core.schedule
    for s in range(sch.num_stages):
        assert accs[sch.stage_rank[s]][s] == pytest.approx(steps * expected(plan, s))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zbh1", "zbv", "dualpipev"])
def test_local_executor_every_schedule(name):
    plan = baton.plan(name, ranks=2, microbatches=4)
    hub = rt.LocalHub(2)
    ts = [hub.transport(r) for r in range(2)]
    accs, execs, errors = run_plan(plan, ts, steps=2)
    assert errors == [None, None]
    check(plan, accs, steps=2)
    for ex in execs:
        st = ex.stats()
        assert st["peak_live_buffers"] > 0 and st["instructions"] > 0
        ev = ex.events()
        assert len(ev) == len(plan.core.programs[ex.rank])
        assert all(e[4] <= e[6] for e in ev)  # posted <= completed


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_gloo_executor_with_jax_values(name):
    import jax.numpy as jnp

    plan = baton.plan(name, ranks=2, microbatches=4)
    ts = gloo_pair()
    try:
        accs, _, errors = run_plan(plan, ts, steps=2, to_jax=True, make=jnp.asarray)
        assert errors == [None, None], errors
        check(plan, accs, steps=2)
    finally:
        close_all(ts)


DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.int16, np.int32,
          np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.bool_]


def test_gloo_send_recv_every_dtype_zero_copy():
    import jax
    import jax.numpy as jnp

    ts = gloo_pair()
    try:
        rng = np.random.default_rng(0)
        arrays = [(rng.standard_normal((3, 4)) * 10).astype(d) for d in DTYPES]
        arrays += [np.zeros((0, 3), np.float32), jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)]
        got = {}
        errs = run_threads([lambda: ts[0].send(1, 7, arrays, timeout=20),
                            lambda: got.setdefault("v", ts[1].recv(0, 7, timeout=20))])
        assert errs == [None, None]
        out = got["v"]
        assert len(out) == len(arrays)
        for a, b in zip(arrays, out):
            a = np.asarray(a)
            assert b.dtype == a.dtype and b.shape == a.shape
            np.testing.assert_array_equal(b, a)
            assert b.ctypes.data % 64 == 0
        # The received host buffer becomes a jax.Array without a copy.
        x = jax.dlpack.from_dlpack(out[0], copy=False)
        assert x.unsafe_buffer_pointer() == out[0].ctypes.data
        np.testing.assert_array_equal(np.asarray(x), np.asarray(arrays[0]))
    finally:
        close_all(ts)


def test_gloo_known_layout_sends_no_header_and_checks_the_value():
    """Both ends pass ``layout=``: the tensors cross alone (a receive without the layout would
    wait for a header that never comes); a value that does not match fails naming both."""
    import jax.numpy as jnp

    ts = gloo_pair()
    try:
        arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.zeros((0, 2), np.int32),
                  jnp.ones((2, 2), jnp.bfloat16)]
        layout = [(np.asarray(a).dtype, np.shape(a)) for a in arrays]
        got = {}
        errs = run_threads([lambda: ts[0].send(1, 5, arrays, timeout=20, layout=layout),
                            lambda: got.setdefault("v", ts[1].recv(0, 5, timeout=20,
                                                                   layout=layout))])
        assert errs == [None, None]
        for a, b in zip(arrays, got["v"]):
            np.testing.assert_array_equal(b, np.asarray(a))
        # A headerless send is not a message a header-reading receive can match.
        r = ts[1].irecv(0, 6)
        ts[0].isend(1, 6, [arrays[0]], layout=layout[:1])
        ts[0].flush()
        with pytest.raises(baton.ExecutionError, match="timed out"):
            r.wait(0.5)
    finally:
        close_all(ts)
    ts = gloo_pair()
    try:
        with pytest.raises(baton.ExecutionError,
                           match=r"the value is \[float32\[3,4\]\] but the receiver expects "
                                 r"\[float32\[3,5\]\]"):
            ts[0].send(1, 9, [np.zeros((3, 4), np.float32)], timeout=10,
                       layout=[(np.float32, (3, 5))])
    finally:
        close_all(ts)


def test_host_tensors_zero_copy_and_unsupported_dtype():
    a = np.ones((4, 4), np.float32)
    (info,) = rt._rt._host_tensors([a])
    assert info == ("float32", [4, 4], a.ctypes.data, 64)
    with pytest.raises(baton.ExecutionError, match="unsupported dtype"):
        rt._rt._host_tensors([np.ones(2, np.complex64)])
    with pytest.raises(baton.ExecutionError, match="cannot transfer an object of type str"):
        rt._rt._host_tensors(["not an array"])


def test_unsupported_dtype_send_fails_clearly():
    ts = gloo_pair()
    try:
        with pytest.raises(baton.ExecutionError, match="unsupported dtype"):
            ts[0].send(1, 3, [np.ones(2, np.complex64)], timeout=10)
    finally:
        close_all(ts)


@pytest.mark.parametrize("transport", ["local", "gloo"])
def test_task_exception_stops_every_rank(transport):
    plan = baton.plan("1f1b", ranks=2, microbatches=4)
    if transport == "local":
        hub = rt.LocalHub(2)
        ts = [hub.transport(r) for r in range(2)]
    else:
        ts = gloo_pair()
    try:
        t0 = time.monotonic()
        _, _, errors = run_plan(plan, ts, timeout=30.0, fail={1: 2})
        assert time.monotonic() - t0 < 10  # failure propagation, not the 30 s timeout
        assert isinstance(errors[1], baton.ExecutionError)
        assert "boom from the task" in str(errors[1]) and "rank 1 #" in str(errors[1])
        assert isinstance(errors[0], baton.ExecutionError)
        assert "rank 1 failed" in str(errors[0]), str(errors[0])
        assert errors[0].failed_rank == 1
    finally:
        if transport == "gloo":
            close_all(ts)


def test_timeout_names_peer_buffer_stage_microbatch():
    plan = baton.plan("gpipe", ranks=2, microbatches=2)
    hub = rt.LocalHub(2)
    t1 = hub.transport(1)
    ex = rt.Executor(plan.rank_ir(), 1, t1, fake_tasks(plan, 1, {}), timeout=0.3)
    with pytest.raises(baton.ExecutionError) as e:
        ex.run()  # rank 0 never runs
    msg = str(e.value)
    assert "timed out" in msg and "act(s0,m0) from rank 0" in msg and "rank 1 #" in msg


def test_handshake_mismatch_names_difference():
    a = baton.plan("1f1b", ranks=2, microbatches=4)
    b = baton.plan("gpipe", ranks=2, microbatches=4)
    hub = rt.LocalHub(2)
    ts = [hub.transport(r) for r in range(2)]
    plans = [a, b]
    errors = run_threads([
        lambda r=r: rt.Executor(plans[r].rank_ir(), r, ts[r],
                                fake_tasks(plans[r], r, {})).handshake(5.0)
        for r in range(2)])
    for r in range(2):
        assert isinstance(errors[r], baton.ExecutionError)
        assert "ranks disagree" in str(errors[r]) and "schedule=" in str(errors[r])


def test_rank_info_sources():
    info = rendezvous.rank_info({"BATON_RANK": "1", "BATON_WORLD_SIZE": "3",
                                 "BATON_STORE": "file:///tmp/x"})
    assert (info.rank, info.world_size, info.store, info.source) == (1, 3, "file:///tmp/x",
                                                                    "baton.launch")
    info = rendezvous.rank_info({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"})
    assert (info.rank, info.world_size, info.store) == (2, 4, "jax")
    info = rendezvous.rank_info({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    assert info.source == "openmpi"
    with pytest.raises(baton.ConfigError, match="outside world size"):
        rendezvous.rank_info({"BATON_RANK": "5", "BATON_WORLD_SIZE": "2"})
    with pytest.raises(baton.ConfigError, match="not an integer"):
        rendezvous.rank_info({"BATON_RANK": "x", "BATON_WORLD_SIZE": "2"})


def test_posted_requests_and_groups():
    ts = gloo_pair()
    try:
        a, b = np.arange(5, dtype=np.int32), np.full((2, 2), 3.5, np.float64)
        r1 = ts[1].irecv(0, 11)
        r2 = ts[1].irecv(0, 12)
        s2 = ts[0].isend(1, 12, [b])  # posted out of order: matched by tag
        s1 = ts[0].isend(1, 11, [a])
        ts[0].flush()
        ts[1].flush()
        np.testing.assert_array_equal(r2.wait(10)[0], b)
        np.testing.assert_array_equal(r1.wait(10)[0], a)
        assert s1.wait(10) is None and s2.wait(10) is None and s1.done()
        r3 = ts[1].irecv(0, 13)
        with pytest.raises(baton.ExecutionError, match="timed out after 0.2 s waiting to receive"):
            r3.wait(0.2)
        assert ts[1].failure() is not None and ts[1].failure()[0] == 1
        deadline = time.monotonic() + 5
        while ts[0].failure() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ts[0].failure()[0] == 1  # the timed-out rank told its peer
    finally:
        close_all(ts)


def test_layout_argument_is_checked():
    hub = rt.LocalHub(2)
    t0, t1 = hub.transport(0), hub.transport(1)
    r = t1.irecv(0, 1, layout=[("bfloat16", (2, 3)), np.zeros((4,), np.int32)])
    t0.isend(1, 1, [np.ones(2)])
    assert r.wait(5)[0].shape == (2,)  # local transport hands the value over as is
    with pytest.raises(baton.ConfigError, match="unsupported dtype 'complex64'"):
        t1.irecv(0, 2, layout=[("complex64", (2,))])


def test_nccl_without_gpu_is_a_clear_error():
    import jax

    if jax.default_backend() == "gpu":  # bench/gpu_check.sh covers NCCL on a GPU
        t = rt.nccl_transport(0, 1, 0, rt.hash_store())
        assert t.kind == "nccl"
        t.close()
        return
    with pytest.raises(baton.BatonError, match="NCCL|CUDA"):
        rt.nccl_transport(0, 1, 0, rt.hash_store())


def test_local_executor_runs_jitted_tasks_on_each_ranks_device():
    """The shape of the frontend hook: JAX computations as task callbacks, values are lists of
    jax.Arrays, `received` moves a value onto the receiving rank's device."""
    import jax
    import jax.numpy as jnp

    devs = jax.devices()
    if len(devs) < 2:
        pytest.skip("needs 2 devices (JAX_NUM_CPU_DEVICES)")
    plan = baton.plan("zbh1", ranks=2, microbatches=4)
    hub = rt.LocalHub(2)
    ts = [hub.transport(r) for r in range(2)]
    accs = [dict() for _ in range(2)]
    seen_devices = [set(), set()]

    execs = []
    core = plan.core

    def tasks_for(rank):
        def run(r, a, in_ids, ins, out_ids):
            for v in ins:
                seen_devices[r].update(d.id for d in v[0].devices())
            env = {b: v[0] for b, v in zip(in_ids, ins)}
            apply_action(core, r, a, env,
                         const=lambda c: jax.device_put(jnp.float32(c), devs[r]))
            return [[env[b]] for b in out_ids]

        def accumulate(r, b, v):
            s = core.buffer_key(b).stage
            accs[r][s] = accs[r].get(s, 0.0) + float(v[0])

        return rt.Tasks(run=run, accumulate=accumulate,
                        received=lambda r, b, v: [jax.device_put(x, devs[r]) for x in v])

    def body(r):
        ex = rt.Executor(plan.rank_ir(), r, ts[r], tasks_for(r), timeout=30)
        execs.append(ex)
        ex.run()

    errors = run_threads([lambda r=r: body(r) for r in range(2)])
    assert errors == [None, None], errors
    check(plan, accs)
    assert seen_devices[0] == {devs[0].id} and seen_devices[1] == {devs[1].id}


def test_sized_buffer_values_are_pytrees():
    """The frontend hands the runtime each buffer's arrays as a sized list: jax must see its
    arrays (block_until_ready waits on them; a list subclass would otherwise be one opaque
    leaf that nothing waits for), and the size survives tree functions."""
    import jax
    import jax.numpy as jnp

    from baton.running.interpreter import _Sized, _sized_unflatten

    a, b = jnp.ones((2, 3)), jnp.zeros((4,), jnp.int32)
    v = _sized_unflatten(a.nbytes + b.nbytes, [a, b])
    assert isinstance(v, list) and v.nbytes == 40
    assert jax.tree.leaves([v]) == [a, b]
    assert jax.block_until_ready([v])[0][1] is b
    w = jax.tree.map(lambda x: x * 2, v)
    assert isinstance(w, _Sized) and w.nbytes == 40 and float(w[0][0, 0]) == 2.0
