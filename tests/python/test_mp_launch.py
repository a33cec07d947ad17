"""Multi-process runtime tests: `python -m baton.launch` starts real processes that talk over
Gloo (TCP loopback). Every process-starting test has a timeout."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import baton
import numpy as np
import pytest
from scalar_pipeline import worker_prelude

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
    info = rendezvous.rank_info()
    rank = info.rank
    t = rendezvous.init_transport("gloo", connect_timeout=30)
    K = _core.BufKind

    def fake_tasks(plan, acc, fail_at=None):
        core = plan.core
        runs = [0]
        def run(r, a, in_ids, ins, out_ids):
            if runs[0] == fail_at:
                raise RuntimeError("injected task failure")
            runs[0] += 1
            env = {b: float(v[0].reshape(-1)[0]) for b, v in zip(in_ids, ins)}
            apply_action(core, r, a, env)
            return [[np.array([env[b]], np.float64)] for b in out_ids]
        def accumulate(r, b, v):
            s = core.buffer_key(b).stage
            acc[s] = acc.get(s, 0.0) + float(v[0][0])
        return rt.make_tasks(run, accumulate, to_jax=False)

    def run_plan(plan, steps=1, fail_at=None, timeout=30.0):
        acc = {}
        ex = rt.Executor(plan.rank_ir(), rank, t, fake_tasks(plan, acc, fail_at), timeout=timeout)
        ex.handshake(20.0)
        for _ in range(steps):
            ex.run()
        return acc

    try:
        if mode == "dtypes":
            dts = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.int32,
                   np.int64, np.uint8, np.bool_]
            arrays = [(np.arange(12).reshape(3, 4) % 5).astype(d) for d in dts]
            if rank == 0:
                t.send(1, 1, arrays, timeout=30)
                back = t.recv(1, 2, timeout=30)
                for a, b in zip(arrays, back):
                    assert b.dtype == a.dtype and b.shape == a.shape, (a.dtype, b.dtype)
                    np.testing.assert_array_equal((a.astype(np.float64) * 2).astype(a.dtype), b)
            else:
                got = t.recv(0, 1, timeout=30)
                for a, b in zip(arrays, got):
                    np.testing.assert_array_equal(a, b)
                    assert b.ctypes.data % 64 == 0
                t.send(0, 2, [(g.astype(np.float64) * 2).astype(g.dtype) for g in got],
                       timeout=30)
        elif mode == "kill":
            if rank == 1:
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGKILL)
            t.recv(1, 5, timeout=60)  # never sent: rank 1 dies instead
        elif mode == "executor":
            plan = baton.plan("zbv", ranks=2, microbatches=4)
            acc = run_plan(plan, steps=2)
            for s, v in acc.items():
                want = expected_accumulator(plan.num_stages, 4, s, steps=2)
                assert abs(v - want) < 1e-9, (s, v, want)
            assert len(acc) == 2
        elif mode == "raise":
            run_plan(baton.plan("1f1b", ranks=2, microbatches=4), fail_at=2 if rank == 1 else None)
        elif mode == "mismatch":
            run_plan(baton.plan("1f1b", ranks=2, microbatches=4 + 2 * rank))
        elif mode == "other_schedule":
            run_plan(baton.plan("gpipe" if rank == 1 else "1f1b", ranks=2, microbatches=4))
        else:
            raise SystemExit(f"unknown mode {mode}")
    except baton.ExecutionError as e:
        os.write(1, (f"rank {rank} ERROR: {e}" + chr(10)).encode())  # one write: lines never interleave
        t.close()
        sys.exit(3)
    print(f"rank {rank} OK", flush=True)
    t.close()
''')


def launch(tmp_path, mode, nprocs=2, timeout=120, grace=20):
    script = tmp_path / "worker.py"
    script.write_text(worker_prelude() + WORKER)
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "baton.launch", "--nprocs", str(nprocs), "--grace", str(grace),
         "--timeout", str(timeout - 10), str(script), mode],
        capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def test_launch_gloo_send_recv_dtypes(tmp_path):
    p, _ = launch(tmp_path, "dtypes")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "rank 0 OK" in p.stdout and "rank 1 OK" in p.stdout


def test_launch_executor_across_processes(tmp_path):
    p, _ = launch(tmp_path, "executor")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "rank 0 OK" in p.stdout and "rank 1 OK" in p.stdout


def test_sigkill_of_one_rank_stops_the_other(tmp_path):
    p, elapsed = launch(tmp_path, "kill")
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "rank 0 ERROR" in out and "rank 1" in out.split("rank 0 ERROR", 1)[1], out
    assert "lost" in out, out
    assert elapsed < 30, f"took {elapsed:.1f} s"


def test_task_failure_in_one_process_stops_all(tmp_path):
    p, elapsed = launch(tmp_path, "raise")
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "rank 1 ERROR" in out and "injected task failure" in out, out
    line0 = [ln for ln in out.splitlines() if ln.startswith("rank 0 ERROR")]
    assert line0 and "rank 1 failed" in line0[0], out
    assert elapsed < 30


@pytest.mark.parametrize("mode,differs", [("mismatch", "microbatches="),
                                           ("other_schedule", "gpipe")])
def test_handshake_mismatch_stops_all(tmp_path, mode, differs):
    p, _ = launch(tmp_path, mode)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    for r in (0, 1):
        line = [ln for ln in out.splitlines() if ln.startswith(f"rank {r} ERROR")]
        assert line and "ranks disagree" in line[0] and differs in line[0], out


def test_launch_reports_failing_rank_code(tmp_path):
    script = tmp_path / "exit.py"
    script.write_text("import os, sys\nsys.exit(7 if os.environ['BATON_RANK'] == '1' else 0)\n")
    p = subprocess.run([sys.executable, "-m", "baton.launch", "--nprocs", "2", str(script)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 7
    assert "rank 1 exited with code 7" in p.stderr


@pytest.mark.parametrize("argv", [["--nprocs", "0", "x.py"]])
def test_launch_rejects_bad_nprocs(argv):
    p = subprocess.run([sys.executable, "-m", "baton.launch", *argv], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2


SPANNING = textwrap.dedent('''
    import os, sys
    os.environ["JAX_NUM_CPU_DEVICES"] = "2"
    import jax
    import numpy as np
    from jax.sharding import Mesh
    import baton

    me = int(os.environ["BATON_RANK"])
    jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", num_processes=2, process_id=me)
    assert len(jax.devices()) == 4 and len(jax.local_devices()) == 2
    # pipe 2 x data 2 where process p's devices are data position p of both ranks: each
    # rank's sub-mesh spans both processes
    devs = np.array(jax.devices()).reshape(2, 2).T
    try:
        baton.jit(lambda x: x, mesh=Mesh(devs, ("pipe", "data")), microbatches=2)
    except baton.ConfigError as e:
        print(f"process {me} refused: {e}", flush=True)
    else:
        print(f"process {me} accepted", flush=True)
    jax.distributed.shutdown()
''')


def test_process_holding_two_ranks_is_refused(tmp_path):
    """Under jax.distributed a mesh whose ranks span processes but give a process devices
    of two ranks gets a clear refusal in every process (not a hang or a wrong placement);
    a valid spanning layout runs (test_mp_e2e.py::test_ranks_spanning_processes)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "spanning.py"
    script.write_text(SPANNING)
    p = subprocess.run([sys.executable, "-m", "baton.launch", "--nprocs", "2", "--timeout",
                        "100", str(script), str(port)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    for me in (0, 1):
        assert (f"process {me} refused: baton.jit: process 0 holds devices of ranks 0 and 1: "
                f"when ranks span processes, each process belongs to one rank") in p.stdout, \
            p.stdout + p.stderr


def _fake_mesh(procs_per_rank):
    """A stand-in for a PipelineMesh whose rank r's sub-mesh positions live on the processes
    ``procs_per_rank[r]`` (one entry per position)."""
    from types import SimpleNamespace

    return SimpleNamespace(meshes=[SimpleNamespace(devices=np.array(
        [SimpleNamespace(process_index=p) for p in ps])) for ps in procs_per_rank])


@pytest.mark.parametrize("layout,me,error", [
    ([[0, 0, 1, 1], [2, 2, 3, 3]], 0, None),
    ([[0, 1, 0, 1], [3, 2, 3, 2]], 2, None),  # slots ordered by their first position
    ([[0, 0, 1, 1], [1, 1, 2, 2]], 0, "process 1 holds devices of ranks 0 and 1"),
    ([[0, 0, 1, 1], [2, 3, 3, 3]], 0, "ranks 0 and 1 split their sub-meshes over processes"),
    ([[0, 0, 1, 1], [2, 2, 2, 2]], 0, "ranks 0 and 1 split their sub-meshes over processes"),
    ([[0, 0, 1, 1], [2, 2, 3, 3]], 4, "process 4 holds none of the mesh's ranks"),
])
def test_spanning_layout(layout, me, error):
    """Slots of ranks that span processes, and the layouts refused by name."""
    from baton.running.distributed import spanning_layout

    mesh = _fake_mesh(layout)
    if error is None:
        procs = spanning_layout(mesh, me)
        assert procs == [sorted(set(ps), key=ps.index) for ps in layout]
    else:
        with pytest.raises(baton.ConfigError, match=error):
            spanning_layout(mesh, me)


def test_spanning_ranks_refused_where_cached_collectives_hang(monkeypatch):
    """A JAX release that hangs running cross-process collectives loaded from its persistent
    compilation cache: with the cache on, a mesh whose ranks span processes is refused on the
    CPU by name, before anything compiles; with the cache off, or on another platform, not."""
    from types import SimpleNamespace

    import jax

    from baton import _jax_compat
    from baton.running import distributed

    monkeypatch.setattr(_jax_compat, "_CACHED_CROSS_PROCESS_HANG", frozenset({jax.__version__}))
    mesh = SimpleNamespace(rank_devices=[[SimpleNamespace(platform="cpu")]],
                           rank_procs=[[0], [1, 2]])
    was = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
    try:
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", "/tmp/baton-test-cache")
        assert not _jax_compat.cached_cross_process_collectives_hang("gpu")
        with pytest.raises(baton.ConfigError, match=r"rank 1 spans processes \[1, 2\].*"
                           r"JAX_ENABLE_COMPILATION_CACHE=false"):
            distributed._check_cache_for_spanning(mesh)
        jax.config.update("jax_enable_compilation_cache", False)
        distributed._check_cache_for_spanning(mesh)
    finally:
        jax.config.update("jax_enable_compilation_cache", was[0])
        jax.config.update("jax_compilation_cache_dir", was[1])
