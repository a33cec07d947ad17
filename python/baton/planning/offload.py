"""Activation offload: ``baton.jit(offload=...)``, what each stage offloads, and the checks
that refuse what is not lowered.

A stage that offloads its stash (``"stash"``) has each of its stash buffers that another
task runs between its forward and its backward copied to host memory after the forward and
back ahead of the backward: the rank IR's OFFLOAD and FETCH instructions, placed and verified
in C++ (``_core.build_rank_ir(..., offload=...)``; docs/RANK_IR.md, "Offload"). The rank
program lowers them as the XLA FFI calls ``baton_offload`` / ``baton_fetch`` into host slots
the C++ runtime holds (``RankComm.host_bytes``; ``rank_transfers.py``): on the CPU, where
JAX lowers a transfer between memory kinds inside ``jit`` to nothing (its memory kinds are
one memory), this is what takes the bytes out of XLA's buffers.

Refused by name, since not lowered: offload on a rank of several devices, on a GPU, with one
rank, in the interpreter, and with the table loop form.
"""

from __future__ import annotations

from typing import Any

from .. import _core
from ..errors import ConfigError

CHOICES = ("stash",)  # what a stage can offload


def offload_option(value: Any) -> Any:
    """``baton.jit``'s ``offload`` checked: None (nothing), ``"stash"`` (every stage's
    stash) or a mapping {stage: "stash" or None}. Stages are checked against the schedule's
    at the first call (``stage_offloads``)."""
    if value is None or value == "stash":
        return value
    if isinstance(value, dict):
        for s, what in value.items():
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ConfigError(f"baton.jit: offload names stage {s!r}: stages are "
                                  f"non-negative integers")
            if what is not None and what not in CHOICES:
                raise ConfigError(f"baton.jit: offload[{s}] = {what!r}: a stage offloads "
                                  f"one of {CHOICES} or None")
        return dict(value)
    raise ConfigError(f"baton.jit: offload must be None, 'stash' or a dict {{stage: "
                      f"'stash'}} (got {value!r})")


def stage_offloads(option: Any, num_stages: int) -> list:
    """The rank IR's per-stage choice (``_core.Offload``) of ``option`` for a schedule of
    ``num_stages`` stages; raises ``ConfigError`` for a stage the schedule does not have."""
    none, stash = _core.Offload.NONE, _core.Offload.STASH
    if option is None:
        return []
    if option == "stash":
        return [stash] * num_stages
    bad = sorted(s for s in option if s >= num_stages)
    if bad:
        raise ConfigError(f"baton.jit: offload names stage {bad[0]}, but the schedule has "
                          f"{num_stages} stages (0..{num_stages - 1})")
    return [stash if option.get(s) == "stash" else none for s in range(num_stages)]


def check_lowered(cs) -> None:
    """Refuses, by name, an offloading step the compiled rank programs do not lower."""
    if not any(o == _core.Offload.STASH for o in cs.offload):
        return
    if cs.num_ranks < 2:
        raise ConfigError("baton.jit: offload needs a pipeline of two or more ranks (one "
                          "rank runs the whole step as one XLA program, which XLA schedules)")
    if cs.engine_name != "compiled":
        raise ConfigError("baton.jit: offload runs in the compiled rank programs; the "
                          "interpreter (engine='interpreter') does not offload")
    if cs.loop_form == "table":
        raise ConfigError("baton.jit: the table loop form does not offload; offload lowers "
                          "the loop rolled (loop_form='rolled' or 'auto')")
    for r, devs in enumerate(cs.mesh.rank_devices):
        if len(devs) > 1:
            raise ConfigError(f"baton.jit: offload is lowered for ranks of one device; rank "
                              f"{r} has {len(devs)}")
        platforms = {d.platform for d in devs}
        if platforms != {"cpu"}:
            raise ConfigError(f"baton.jit: offload is lowered on CPU ranks (into host slots "
                              f"of Baton's runtime); rank {r} is on {sorted(platforms)}")
