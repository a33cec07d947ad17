"""Baton's exception hierarchy.

Every error Baton raises on bad input or a failed check is a ``BatonError``.
Errors about what the user passed are also ``ValueError``s; errors found while
checking or running a program are also ``RuntimeError``s. The C++ core's
``baton::Error`` subclasses are translated to the matching class here by the
bindings (see ``cpp/python``).
"""


class BatonError(Exception):
    """Base class of every error Baton raises."""


class ScheduleError(BatonError, ValueError):
    """A schedule generator refused its arguments, or a schedule is malformed."""


class FormatError(BatonError, ValueError):
    """A schedule text or cost JSON could not be parsed (names line and column)."""


class ConfigError(BatonError, ValueError):
    """Bad options: cost model, mesh, microbatch count, ..."""


class VerifyError(BatonError, RuntimeError):
    """A lowered plan failed verification (deadlock, missing data, bad buffer lifetime)."""


class TraceError(BatonError, ValueError):
    """The traced JAX step cannot be pipelined as written (names the stage / equation)."""


class ExecutionError(BatonError, RuntimeError):
    """A pipelined step failed while running (names the rank and instruction)."""
