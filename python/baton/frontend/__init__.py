"""The JAX frontend: annotate a model, pipeline its training step.

``stage_boundary`` and ``accumulate`` mark the model; ``PipelineMesh`` groups
devices into pipeline ranks; ``jit`` traces the step, cuts it into per-stage
tasks (C++ passes in ``baton._core.graph``), plans a schedule and runs it.
"""

from .api import PipelinedFunction, jit
from ..planning.step_costs import cost_model_of
from ..running.distributed import Remote
from ..mesh import PipelineMesh
from ..tracing.primitives import accumulate, stage_boundary

__all__ = ["PipelinedFunction", "PipelineMesh", "Remote", "accumulate", "cost_model_of", "jit",
           "stage_boundary"]
