"""Baton: MPMD pipeline parallelism for JAX with a C++ compiler and runtime core."""

from .errors import (  # noqa: F401
    BatonError,
    ConfigError,
    ExecutionError,
    FormatError,
    ScheduleError,
    TraceError,
    VerifyError,
)

# --- planner API (schedules, plans, verification, simulation) ---
# (filled in by python/baton/schedules.py and planning.py)

# --- JAX frontend (stage_boundary, PipelineMesh, accumulate, jit) ---
# (filled in by python/baton/frontend/)

__version__ = "0.1.0"
