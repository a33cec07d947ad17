"""Two "hosts" on one machine: two Linux network namespaces joined by a veth pair.

Each rank runs in its own namespace (``ip netns exec``), so it sees only its own loopback and its
end of the veth link (10.231.7.1/30 <-> 10.231.7.2/30, addresses that exist only inside these
namespaces; no traffic leaves the machine). The ranks rendezvous through a FileStore (the
namespaces share the filesystem, not the network) and talk Gloo over the veth addresses, exactly as
two hosts would over their NICs.

Needs root and iproute2 (``scripts/setup.sh`` installs it). Without them the tests FAIL with a
message; they are skipped only when ``BATON_NO_NETNS=1`` is set explicitly. Every subprocess has a
timeout and the namespaces are deleted in a ``finally`` block.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from scalar_pipeline import worker_prelude

ADDRS = ("10.231.7.1", "10.231.7.2")  # a private /30 that exists only inside the two namespaces

WORKER = textwrap.dedent('''
    import os, signal, sys, time
    import numpy as np
    import ml_dtypes
    import baton
    from baton import _core
    from baton import runtime as rt
    from baton.runtime import rendezvous
    from scalar_pipeline import apply_action, expected_accumulator

    mode = sys.argv[1]
    if mode == "jaxdist":
        # Rank and store come from jax.distributed alone: its coordinator listens on rank 0's
        # veth address, and Baton's rendezvous uses its key-value store (BATON_STORE=jax).
        import jax
        r = int(os.environ.pop("BATON_RANK"))
        del os.environ["BATON_WORLD_SIZE"], os.environ["BATON_STORE"]
        jax.distributed.initialize(coordinator_address=sys.argv[3], num_processes=2,
                                   process_id=r, initialization_timeout=30)
    info = rendezvous.rank_info()
    if mode == "jaxdist":
        assert (info.source, info.store, info.rank) == ("jax.distributed", "jax", r), info
    rank = info.rank
    t = rendezvous.init_transport("gloo", connect_timeout=30)  # BATON_HOSTNAME: the veth address
    K = _core.BufKind
    N = 4096  # elements per transferred array: real bytes cross the link

    def tasks_for(plan, acc, die_after=None):
        """Fake tasks with a closed-form result: F adds 1 per stage, B/I double the gradient."""
        core = plan.core
        runs = [0]

        def scalar(b, v):
            a = np.asarray(v[0])
            if a.shape != (N,) or not np.all(a == a[0]):
                raise RuntimeError(f"buffer {b}: corrupted payload {a.shape} {a[:4]}")
            return float(a[0])

        def run(r, ai, in_ids, ins, out_ids):
            if die_after is not None and runs[0] == die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            runs[0] += 1
            env = {b: scalar(b, v) for b, v in zip(in_ids, ins)}
            apply_action(core, r, ai, env)
            return [[np.full(N, env[b], np.float64)] for b in out_ids]

        def accumulate(r, b, v):
            s = core.buffer_key(b).stage
            acc[s] = acc.get(s, 0.0) + scalar(b, v)

        return rt.make_tasks(run, accumulate, to_jax=False)

    def check_schedules(names, steps=2, M=4):
        for name in names:
            plan = baton.plan(name, ranks=2, microbatches=M)
            acc = {}
            ex = rt.Executor(plan.rank_ir(), rank, t, tasks_for(plan, acc), timeout=30.0)
            ex.handshake(20.0)
            for _ in range(steps):
                ex.run()
            mine = {a.first.stage for a in plan.core.schedule.rank_actions[rank]}
            assert set(acc) == mine, (name, sorted(acc), sorted(mine))
            for s, v in acc.items():
                want = expected_accumulator(plan.num_stages, M, s, steps=steps)
                assert abs(v - want) < 1e-9, (name, s, v, want)
            print(f"rank {rank} {name} ok stages={sorted(mine)}", flush=True)

    try:
        if mode in ("schedules", "jaxdist"):
            check_schedules(sys.argv[2].split(","))
        elif mode == "bulk":
            rng = np.random.default_rng(7)
            arrays = [rng.standard_normal((1024, 2048)).astype(np.float32),  # 8 MiB
                      rng.standard_normal(1000).astype(ml_dtypes.bfloat16),
                      np.arange(777, dtype=np.int64), np.array(True)]
            if rank == 0:
                t0 = time.perf_counter()
                t.send(1, 11, arrays, timeout=60)
                back = t.recv(1, 12, timeout=60)
                dt = time.perf_counter() - t0
                for a, b in zip(arrays, back):
                    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype)
                    np.testing.assert_array_equal(a, b)
                print(f"rank 0 round trip of 2 x {sum(a.nbytes for a in arrays)} bytes: "
                      f"{dt * 1e3:.1f} ms", flush=True)
            else:
                got = t.recv(0, 11, timeout=60)
                assert all(g.ctypes.data % 64 == 0 for g in got)
                t.send(0, 12, got, timeout=60)
        elif mode == "kill":
            plan = baton.plan("1f1b", ranks=2, microbatches=8)
            ex = rt.Executor(plan.rank_ir(), rank, t, tasks_for(plan, {}, 3 if rank == 1 else None),
                             timeout=60.0)
            ex.handshake(20.0)
            ex.run()
        else:
            raise SystemExit(f"unknown mode {mode}")
    except baton.ExecutionError as e:
        os.write(1, (f"rank {rank} ERROR: {e}" + chr(10)).encode())
        t.close()
        sys.exit(3)
    print(f"rank {rank} OK", flush=True)
    t.close()
    if mode == "jaxdist":
        jax.distributed.shutdown()
''')


def _require_netns():
    """Fails (never silently skips) when the machine cannot make network namespaces."""
    if os.environ.get("BATON_NO_NETNS") == "1":
        pytest.skip("BATON_NO_NETNS=1: two-host tests over network namespaces disabled")
    problems = []
    if os.geteuid() != 0:
        problems.append("not running as root (network namespaces need CAP_NET_ADMIN)")
    if shutil.which("ip") is None:
        problems.append("`ip` (iproute2) not found; run scripts/setup.sh")
    if problems:
        pytest.fail("two-host test cannot run: " + "; ".join(problems) +
                    ". Set BATON_NO_NETNS=1 to skip it explicitly.", pytrace=False)


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@pytest.fixture(scope="module")
def netns_pair():
    """Two namespaces joined by a veth pair; yields [(namespace, address), ...] per rank."""
    _require_netns()
    tag = f"{os.getpid() % 100000}"
    names = [f"baton{tag}r0", f"baton{tag}r1"]
    veths = [f"bt{tag}v0", f"bt{tag}v1"]  # interface names: at most 15 characters
    try:
        for n in names:
            _ip("netns", "add", n)
        _ip("link", "add", veths[0], "netns", names[0], "type", "veth", "peer", "name", veths[1],
            "netns", names[1])
        for n, v, a in zip(names, veths, ADDRS):
            _ip("-n", n, "addr", "add", f"{a}/30", "dev", v)
            _ip("-n", n, "link", "set", "lo", "up")
            _ip("-n", n, "link", "set", v, "up")
        yield list(zip(names, ADDRS))
    except subprocess.CalledProcessError as e:
        pytest.fail(f"cannot set up network namespaces: {e.cmd}: {e.stderr}", pytrace=False)
    finally:
        for n in names:  # deleting a namespace deletes its end of the veth pair (and the peer)
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=20)


def run_two(netns_pair, tmp_path, *args, timeout=120, worker=WORKER, devices=None):
    """Runs the worker as rank 0 and rank 1, one per namespace; returns (codes, output, seconds)."""
    script = tmp_path / "worker.py"
    script.write_text(worker_prelude() + worker)
    store = tmp_path / "store"
    store.mkdir()
    procs = []
    t0 = time.monotonic()
    try:
        for r, (ns, addr) in enumerate(netns_pair):
            env = dict(os.environ, BATON_RANK=str(r), BATON_WORLD_SIZE="2",
                       BATON_LOCAL_RANK="0", BATON_STORE=f"file://{store}",
                       BATON_HOSTNAME=addr, JAX_PLATFORMS="cpu")
            if devices is not None:
                env["JAX_NUM_CPU_DEVICES"] = str(devices)
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, str(script), *args], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = []
        for p in procs:
            left = max(1.0, timeout - (time.monotonic() - t0))
            outs.append(p.communicate(timeout=left)[0])
        return [p.returncode for p in procs], "\n".join(outs), time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def test_namespaces_are_isolated(netns_pair):
    """Each rank sees only its own address: the other one is reachable only over the veth."""
    (ns0, a0), (ns1, a1) = netns_pair
    out0 = subprocess.run(["ip", "-n", ns0, "-4", "addr"], capture_output=True, text=True,
                          timeout=20).stdout
    assert a0 in out0 and a1 not in out0, out0
    host = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, timeout=20).stdout
    assert a0 not in host and a1 not in host, "the /30 leaked into the host namespace"


@pytest.mark.parametrize("schedules", ["gpipe,1f1b,zbh1", "interleaved,zbv,dualpipev"])
def test_twohost_executor_schedules(netns_pair, tmp_path, schedules):
    codes, out, _ = run_two(netns_pair, tmp_path, "schedules", schedules)
    assert codes == [0, 0], out
    for r in (0, 1):
        for name in schedules.split(","):
            assert f"rank {r} {name} ok" in out, out


def test_twohost_rendezvous_through_jax_distributed(netns_pair, tmp_path):
    """No baton.launch variables: rank, world size and store all come from jax.distributed,
    whose coordinator listens on rank 0's veth address."""
    coordinator = f"{netns_pair[0][1]}:29517"
    codes, out, _ = run_two(netns_pair, tmp_path, "jaxdist", "1f1b,zbv", coordinator)
    assert codes == [0, 0], out
    for r in (0, 1):
        assert f"rank {r} 1f1b ok" in out and f"rank {r} zbv ok" in out, out


# A real model: multi-process baton.jit (the worker of test_mp_e2e.py, imported unchanged), one
# rank per namespace; the results are compared here with single-process mode and plain JAX.
MODEL_WORKER = f"""
import os, sys
sys.path.insert(0, {str(pathlib.Path(__file__).resolve().parent)!r})
import test_mp_e2e as T
T.worker_main(sys.argv[1], sys.argv[2])
print(f"rank {{os.environ['BATON_RANK']}} OK", flush=True)
"""


def test_twohost_real_model_matches_plain_jax(netns_pair, tmp_path):
    import test_mp_e2e as T

    names = ["1f1b", "zbv"]
    codes, out, _ = run_two(netns_pair, tmp_path, ",".join(names), str(tmp_path), timeout=240,
                            worker=MODEL_WORKER, devices=1)
    assert codes == [0, 0], out[-6000:]
    for name in names:
        T.check_against_single_process(tmp_path, name, 2, 1, exact=True)


def test_twohost_bulk_transfer_roundtrip(netns_pair, tmp_path):
    codes, out, _ = run_two(netns_pair, tmp_path, "bulk")
    assert codes == [0, 0], out
    assert "rank 0 round trip" in out and "rank 1 OK" in out, out


def test_twohost_peer_death_is_detected(netns_pair, tmp_path):
    codes, out, elapsed = run_two(netns_pair, tmp_path, "kill")
    assert codes[1] == -9, out  # rank 1 SIGKILLed itself in the middle of the step
    assert codes[0] == 3, out
    line = [ln for ln in out.splitlines() if ln.startswith("rank 0 ERROR")]
    assert line and "rank 1" in line[0], out
    assert elapsed < 45, f"took {elapsed:.1f} s to notice the dead peer"
