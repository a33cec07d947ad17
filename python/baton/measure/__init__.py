"""Measuring a built step by running its compiled programs: memory (``memory.py``, the model;
``memory_live.py``, what a run holds), traces (``traces.py``, ``baton.trace``) and task
profiles (``profile.py``, ``baton.profile``). Imports only ``running`` and the layers below
it."""
