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
