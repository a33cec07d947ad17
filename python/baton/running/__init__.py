"""Running a built step: ``CompiledStep`` (``step.py``) and what a call of it returns
(``step_run.py``: ``StepRun``), the engines that run its loop
(``engine.py``: the emitted programs; ``interpreter.py``: the C++ executor), a process group's
share of a step (``step_group.py``, ``distributed.py``, ``handshake.py``) and the rank threads
(``threads.py``). Imports only ``emit`` and the layers below it."""
