"""The skips a test run may have, in one place.

scripts/test.sh loads this plugin (``-p skip_policy``): every skipped case or module whose
reason matches none of ``EXPECTED`` makes the run fail, listed by node id and reason at the
end. A case that skips because the machine lacks what it needs (a CUDA device, a library the
suite does not install) is expected; a case that skips for want of something the harness
provides (eight CPU devices: test.sh sets ``JAX_NUM_CPU_DEVICES=8``; Flax's NNX; git) is a
failure under the harness, never a silent pass.

Outside scripts/test.sh (a plain ``pytest``) the plugin is not loaded and nothing changes.
"""

from __future__ import annotations

import re

import pytest

# Reasons a skip may give under scripts/test.sh (regular expressions, searched).
EXPECTED: dict[str, str] = {
    # this machine has no NVIDIA GPU, or has one (the GPU row of bench/gpu_check.py covers it)
    "no CUDA device": r"needs a CUDA device|no CUDA device|a GPU is present",
    # Baton built without the CUDA toolkit / nccl.h (no CUDA handlers to test)
    "CUDA not built": r"built without CUDA",
    # no NCCL library on this machine's loader path
    "no libnccl": r"no libnccl",
    # the CPU handlers' test when JAX's default backend is a GPU
    "CPU backend only": r"the CPU handlers run on the CPU backend",
    # the user turned the network-namespace tests off (BATON_NO_NETNS=1)
    "netns disabled": r"BATON_NO_NETNS=1",
}

_PATTERN = re.compile("|".join(f"(?:{p})" for p in EXPECTED.values()))


def expected(reason: str) -> bool:
    """Whether a skip with this reason is one of EXPECTED's."""
    return _PATTERN.search(reason) is not None


def _reason(report) -> str:
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


class SkipPolicy:
    def __init__(self) -> None:
        self.unexpected: list[tuple[str, str]] = []

    def _note(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = _reason(report)
            if not expected(reason):
                self.unexpected.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report) -> None:
        self._note(report)

    def pytest_collectreport(self, report) -> None:
        self._note(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if self.unexpected and exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.unexpected:
            return
        tr = terminalreporter
        tr.section("unexpected skips (tests/python/skip_policy.py)", red=True)
        for nodeid, reason in self.unexpected:
            tr.line(f"UNEXPECTED SKIP {nodeid}: {reason}")
        tr.line(f"{len(self.unexpected)} unexpected skip(s): the run fails")


def pytest_configure(config) -> None:
    # The controller sees every report (its workers' too, under pytest-xdist): count there.
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(SkipPolicy(), "baton_skip_policy_checker")
