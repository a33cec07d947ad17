"""scripts/test.sh's skip policy (skip_policy.py) and per-case timeout: a skip whose reason is
not expected fails the run and is named, an expected one does not, and a hanging case names
itself. Each case runs pytest on a small file of its own in a subprocess (no JAX import)."""

import os
import subprocess
import sys
from pathlib import Path

import skip_policy

HERE = Path(__file__).resolve().parent


def _pytest(tmp_path, body: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_cases.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=str(HERE))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-p",
         "skip_policy", "--rootdir", str(tmp_path), *args, str(tmp_path / "test_cases.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_expected_reasons_are_the_machine_ones():
    assert skip_policy.expected("NcclRankComm needs a CUDA device")
    assert skip_policy.expected("_core built without CUDA/nccl.h (no CUDA handlers)")
    assert not skip_policy.expected("needs 8 devices (JAX_NUM_CPU_DEVICES=8)")
    assert not skip_policy.expected("needs 2 devices (JAX_NUM_CPU_DEVICES)")


def test_a_device_count_skip_fails_the_run_and_is_named(tmp_path):
    p = _pytest(tmp_path, (
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_cuda():\n    pytest.skip('needs a CUDA device')\n"
        "def test_eight():\n    pytest.skip('needs 8 devices (JAX_NUM_CPU_DEVICES=8)')\n"))
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "UNEXPECTED SKIP test_cases.py::test_eight: needs 8 devices" in out, out
    assert "test_cuda" not in out.split("unexpected skips")[1], out
    assert "SKIPPED" in out  # -rs: the reasons are printed


def test_a_module_level_skip_fails_the_run(tmp_path):
    p = _pytest(tmp_path, (
        "import pytest\n"
        "pytest.skip('needs 8 devices', allow_module_level=True)\n"
        "def test_never():\n    pass\n"))
    assert p.returncode != 0, p.stdout + p.stderr
    assert "UNEXPECTED SKIP test_cases.py: needs 8 devices" in p.stdout, p.stdout


def test_only_expected_skips_pass(tmp_path):
    p = _pytest(tmp_path, (
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "@pytest.mark.skipif(True, reason='built without CUDA/nccl.h')\n"
        "def test_cuda():\n    pass\n"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "unexpected skips" not in p.stdout


def test_a_hanging_case_names_itself(tmp_path):
    p = _pytest(tmp_path, (
        "import time\n"
        "def test_hangs():\n    time.sleep(60)\n"), "--timeout=2", "--timeout-method=thread")
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "Timeout" in out and "test_hangs" in out, out
