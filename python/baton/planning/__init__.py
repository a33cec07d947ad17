"""Planning, the Python side of the C++ build: plans and schedules (``plan.py``), what each
stage's tasks compute (``tasks.py``), the code before and after the microbatch loop
(``segments.py``), the plan's buffer facts (``buffers.py``), each stage's costs
(``step_costs.py``) and what it offloads (``offload.py``). Imports only ``tracing`` and the base
modules."""
