"""Shared pytest setup for Baton's Python tests."""

import os
import pathlib
import sysconfig

# Several CPU devices for the JAX tests; must be set before JAX starts its backend.
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import pytest  # noqa: E402

try:
    from hypothesis import HealthCheck, settings

    # No per-example deadline: the machine is shared and JIT compiles are slow.
    settings.register_profile(
        "baton", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "baton"))
except ImportError:  # hypothesis is a test dependency; tests that use it will fail loudly
    pass


@pytest.fixture(scope="session")
def baton_plan_exe() -> pathlib.Path:
    """The installed baton-plan command (in the interpreter's scripts directory)."""
    exe = pathlib.Path(sysconfig.get_path("scripts")) / "baton-plan"
    assert exe.is_file(), f"baton-plan is not installed next to python in {exe.parent}"
    return exe


# test_maxtext.py needs MaxText, which lives in its own virtual environment
# (scripts/setup_maxtext.sh): the default run does not collect it; naming it (or
# `scripts/test.sh --maxtext`) runs it, and without MaxText it fails saying how to install.
MAXTEXT_TESTS = "test_maxtext.py"


def pytest_ignore_collect(collection_path, config):
    if collection_path.name == MAXTEXT_TESTS:
        named = any(MAXTEXT_TESTS in str(a) for a in config.args)
        return None if named else True
    return None


# Files whose tests launch several JAX processes: the longest cases of the run.
LAUNCHING = {"test_mp_e2e.py", "test_multi_rank_process.py", "test_train_lm.py",
             "test_twohost.py", "test_program_handshake.py"}


def pytest_collection_modifyitems(session, config, items):
    """The longest cases first (marked ``heavy``, or launching processes), the rest in file
    order: with pytest-xdist's workers a long case picked up last leaves the other worker
    idle while it runs (a stable sort, the same order in every worker)."""
    def long_first(item):
        return 0 if (item.get_closest_marker("heavy") or item.path.name in LAUNCHING) else 1

    items.sort(key=long_first)
