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
from ._core import (  # noqa: F401,E402
    Action,
    BufferKey,
    BufKind,
    CommModel,
    CostModel,
    Instr,
    LinkCost,
    OpCode,
    Schedule,
    SimResult,
    StageCost,
    Task,
    TaskKind,
    VerifyReport,
    Violation,
    fuse_forward_backward,
)
from .planning.plan import Plan, as_cost_model, plan  # noqa: F401,E402
from .schedules import (  # noqa: F401,E402
    ZBH1,
    ZBH2,
    ZBV,
    DualPipeV,
    Eager1F1B,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    ScheduleFile,
    ScheduleSpec,
    VHalf,
    VMin,
    load_schedule,
    save_schedule,
    schedule_aliases,
    schedule_from_name,
    schedule_names,
)
from .layout import Layout, PipelineConfig  # noqa: F401,E402

# --- JAX frontend (stage_boundary, PipelineMesh, accumulate, jit) ---
from .frontend import (  # noqa: F401,E402
    PipelinedFunction,
    PipelineMesh,
    Remote,
    accumulate,
    jit,
    stage_boundary,
)

# --- layer stacks under lax.scan, cut into stages ---
from .stacks import Stacked, join_stacks, scan_stages, split_stacks  # noqa: F401,E402
from .nnx_stacks import nnx_scan_stages, nnx_stack_groups  # noqa: F401,E402

# --- stage boundaries proposed by Baton; automatic planning ---
from .autoplan import Auto, autoplan, costs_at, measure_segments, search_segments  # noqa: F401,E402
from .autostage import auto_stage  # noqa: F401,E402

# --- measurement (traces of real steps, profile-driven costs) ---
from .measure.profile import Profile, profile  # noqa: F401,E402
from .measure.traces import Trace, trace  # noqa: F401,E402

# --- planning at cluster scale (abstract model profiles, hardware files; docs/SCALE.md) ---
from .scale import evaluate_cluster, plan_cluster  # noqa: F401,E402

# --- checkpoints on Orbax (baton.checkpoint.save / restore / latest_step) ---
from . import checkpoint  # noqa: F401,E402

# --- per-stage initialization and data read where it is consumed ---
from .init import abstract_state, init_stages, leaf_homes  # noqa: F401,E402
from . import data  # noqa: F401,E402

__version__ = "0.1.0"
