"""The first-contact GPU check's plumbing on CPU (bench/gpu_check.py): its HLO host-sync
finder on programs XLA compiled here, and both modes run as processes: the dry run reaches
every row in order, in the ROW format, and exits 0 (the rows of two processes sharing a GPU
run their processes on CPU over Gloo and compare with jax.jit; the failure rows find their
checks in gpu_check_faults.py); the real mode on a machine without a GPU fails every GPU row
by name and exits 1. The last line lists what the check cannot test."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402

ROW = re.compile(r"^ROW (?P<name>[^|]+)\|(?P<status>PASS|FAIL|INFO)\|(?P<detail>[^|]*)$")


def test_host_syncs_finds_conditionals_and_unknown_trip_counts():
    fixed = jax.jit(lambda x: jax.lax.fori_loop(0, 8, lambda i, c: c * 2 + 1, x))
    found = gpu_check.host_syncs(fixed.lower(jnp.ones(4)).compile().as_text())
    assert found.loops == 1 and found.syncs == [], found
    dyn = jax.jit(lambda x, n: jax.lax.while_loop(lambda c: c[1] < n,
                                                  lambda c: (c[0] * 2, c[1] + 1), (x, 0))[0])
    found = gpu_check.host_syncs(dyn.lower(jnp.ones(4), 3).compile().as_text())
    assert found.loops == 1 and "while without a known trip count" in found.syncs[0], found
    cond = jax.jit(lambda x, p: jax.lax.cond(p > 0, lambda y: y * 2, lambda y: y - 1, x))
    found = gpu_check.host_syncs(cond.lower(jnp.ones(4), 1).compile().as_text())
    assert found.syncs and found.syncs[0].startswith("conditional"), found


def _run(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2", BATON_QUIET="1")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), *args],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    rows = [ROW.match(ln) for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
    assert all(rows), p.stdout  # every ROW line in the format
    return p, rows


def test_dry_run_reaches_every_row_and_exits_0():
    p, rows = _run("--dry-run")
    assert p.returncode == 0, p.stdout + p.stderr
    assert [m["name"] for m in rows] == [r.name for r in gpu_check.ROWS]
    assert all(m["status"] == "INFO" for m in rows), p.stdout
    scan = rows[[r.name for r in gpu_check.ROWS].index("scan loop: no host syncs in the HLO")]
    assert "no conditional" in scan["detail"], scan["detail"]
    by_name = {m["name"]: m["detail"] for m in rows}
    for sched in ("1F1B", "ZB-H1", "interleaved"):  # two launched processes, on CPU here
        d = by_name[f"two processes on one GPU: {sched}"]
        assert d.startswith("dry run (CPU, Gloo") and "equal to jax.jit" in d, d
        assert "(rtol 1e-5, atol 1e-4) True" in d, d
    for name, key in (("failure: wait before its send", "wait"),
                      ("failure: abort from another thread mid-run", "abort"),
                      ("failure: close with transfers pending", "close"),
                      ("memory: XLA_PYTHON_CLIENT_MEM_FRACTION=.95", "mem95")):
        assert f"gpu_check_faults.py {key} ('{name}')" in by_name[name], by_name[name]
    cmdbuf = by_name["scan loop under command buffers"]
    assert "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CONDITIONAL," \
           "WHILE" in cmdbuf and "--scan-results" in cmdbuf, cmdbuf
    staging = by_name["memory: staging reservation"]
    assert "in flight at once (sends/receives) 32.00/32.00 MiB, the step's 256.01/128.00 MiB" \
        in staging, staging
    assert p.stdout.splitlines()[-1].startswith("UNTESTED: two GPUs and more"), p.stdout


def test_staging_row_arithmetic_is_the_rank_irs_in_flight_maximum():
    """Rank 0 of a 2-rank 1F1B step of 8 microbatches: one activation sent and two gradients
    received at once, of the step's eight each."""
    fl = gpu_check.staging_program()
    assert len(fl) == 16
    (sends, recvs), (step_s, step_r) = gpu_check.staging_arithmetic(fl)
    act = gpu_check._packed(gpu_check.STAGING_LAYOUTS[0, 0])
    grad = gpu_check._packed(gpu_check.STAGING_LAYOUTS[1, 1])
    assert act == (32 << 20) + 1000 and grad == 16 << 20  # 32 MiB is 256-aligned
    assert (sends, recvs) == (act, 2 * grad)
    assert (step_s, step_r) == (8 * act, 8 * grad)


def test_scan_results_rerun_matches_in_processes_of_their_own(tmp_path):
    """The command-buffer row's plumbing on CPU: the scan-loop step run in two processes under
    the two XLA_FLAGS (the GPU flags are accepted and do nothing here), results saved and
    equal, the HLO count line printed."""
    import numpy as np

    got = {}
    for name, flags in (("off", gpu_check.COMMAND_BUFFERS_OFF),
                        ("on", gpu_check.COMMAND_BUFFERS_ON)):
        cmd, env = gpu_check.scan_command(str(tmp_path / f"{name}.npz"), 2, flags)
        assert flags in env["XLA_FLAGS"]
        env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2", BATON_QUIET="1")
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
        assert p.returncode == 0, p.stdout + p.stderr
        assert p.stdout.splitlines()[-1].startswith("command_buffer mentions: "), p.stdout
        with np.load(tmp_path / f"{name}.npz") as z:
            got[name] = [z[f"arr_{i}"] for i in range(len(z.files))]
    assert len(got["on"]) == len(got["off"]) > 0
    assert all(np.array_equal(a, b) for a, b in zip(got["on"], got["off"]))


def test_a_fault_row_without_its_check_fails():
    ctx = gpu_check.Context(dry=True, gpu=False)
    assert gpu_check.row_fault("close")(ctx).status == "INFO"
    res = gpu_check.row_fault("no-such-check")(ctx)
    assert res.status == "FAIL" and "no check 'no-such-check'" in res.detail, res


def test_without_a_gpu_every_gpu_row_fails_and_the_exit_is_1():
    p, rows = _run()
    assert p.returncode == 1, p.stdout + p.stderr
    by_name = {m["name"]: m for m in rows}
    assert list(by_name) == [r.name for r in gpu_check.ROWS]
    assert by_name["environment"]["status"] == "FAIL"
    assert "no CUDA device" in by_name["environment"]["detail"]
    for r in gpu_check.ROWS:
        if r.gpu:
            assert by_name[r.name]["status"] == "FAIL", by_name[r.name]
            assert "did not run: no CUDA device" in by_name[r.name]["detail"]
    assert p.stdout.splitlines()[-1].startswith("UNTESTED: "), p.stdout
