"""Tracing: the user's training step (with its ``stage_boundary`` and ``accumulate`` marks) to
a JAX-free ``Program`` for the C++ passes (``trace.py``), and the model's mesh names moved onto
one rank's sub-mesh (``retarget.py``). Imports only Baton's base modules."""
