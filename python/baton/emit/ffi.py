"""The transfers of a rank program as XLA FFI custom calls (``baton._core.ffi``).

``comm`` binds one ``baton_comm`` call: a group of sends, receive posts and receive waits
run in order by the C++ ``RankComm`` whose id is the call's ``comm`` attribute; ``drain``
binds ``baton_drain`` (wait for every posted send); ``offload`` / ``fetch`` bind
``baton_offload`` / ``baton_fetch`` (an offloaded buffer into and out of the context's host
slots). All take and return the program's token (an int32 scalar), which orders them against
each other and against the tasks, and all are marked as having side effects, so XLA neither
removes nor merges them.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import threading

import jax
import jaxlib
import jax.numpy as jnp
import numpy as np

from .. import _core

_lock = threading.Lock()
_registered = False
_TOKEN = jax.ShapeDtypeStruct((), jnp.int32)


@dataclasses.dataclass(frozen=True)
class FfiApi:
    """A jaxlib and the XLA FFI API version (``XLA_FFI_API_MAJOR``/``MINOR``) of its headers."""

    jaxlib_version: str
    major: int
    minor: int


def ffi_api_mismatch(built: FfiApi, running: FfiApi) -> str | None:
    """Why handlers compiled against ``built``'s FFI headers cannot be registered with the
    ``running`` jaxlib, or None when they can. XLA accepts handlers of its own major API
    version whose minor version is not newer than its own (xla/ffi/api/c_api.h)."""
    if built.major == running.major and built.minor <= running.minor:
        return None
    return (
        f"baton._core was built against jaxlib {built.jaxlib_version}'s XLA FFI headers "
        f"(FFI API {built.major}.{built.minor}), but the installed jaxlib "
        f"{running.jaxlib_version} has FFI API {running.major}.{running.minor}, which rejects "
        "these handlers. Rebuild baton against the installed jaxlib: "
        "pip install --no-build-isolation --force-reinstall --no-deps . "
        "(from the source tree, in this environment)"
    )


def built_ffi_api() -> FfiApi:
    """The jaxlib whose FFI headers ``_core`` was compiled against."""
    info = _core.ffi.build_info()
    return FfiApi(str(info["jaxlib_version"]), int(info["ffi_api_major"]),
                  int(info["ffi_api_minor"]))


def running_ffi_api() -> FfiApi:
    """The installed jaxlib and the FFI API version of the headers it ships."""
    header = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
    with open(header, encoding="utf-8") as f:
        text = f.read()
    found = {}
    for part in ("MAJOR", "MINOR"):
        m = re.search(rf"^#define XLA_FFI_API_{part} (\d+)\s*$", text, re.MULTILINE)
        if m is None:
            raise RuntimeError(f"XLA_FFI_API_{part} not found in {header}")
        found[part] = int(m.group(1))
    return FfiApi(jaxlib.__version__, found["MAJOR"], found["MINOR"])


def check_ffi_api() -> None:
    """Raises RuntimeError naming both versions when the installed jaxlib's FFI API cannot
    take the handlers ``_core`` was built with."""
    why = ffi_api_mismatch(built_ffi_api(), running_ffi_api())
    if why is not None:
        raise RuntimeError(why)


def register() -> None:
    """Registers the handlers with XLA (once per process): the CPU ones (``RankComm``), and
    the CUDA ones (``NcclRankComm``) when ``_core`` was built with CUDA and NCCL. Refuses
    first, by name, a jaxlib whose FFI API differs from the one ``_core`` was built with."""
    global _registered
    with _lock:
        if _registered:
            return
        check_ffi_api()
        for name, capsule in _core.ffi.handlers().items():
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        if has_cuda():
            for name, capsule in _core.ffi.handlers_cuda().items():
                jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
            # every NcclRankComm closed at exit, at once, before JAX's client goes away
            # (atexit runs last-registered first; JAX registers its own at import)
            atexit.register(_core.ffi.close_all_cuda)
        _registered = True


def has_cuda() -> bool:
    """True when ``_core`` has the CUDA handlers (built with CUDA and NCCL headers)."""
    return bool(getattr(_core.ffi, "has_cuda", lambda: False)())


def is_nccl(comm) -> bool:
    """True for a CUDA transfer context (``NcclRankComm``)."""
    return type(comm).__name__ == "NcclRankComm"


def transfer_counts(items, channel) -> list[tuple[int, int, bool, int]]:
    """(channel, stage, send, count) per kind of transfer of a rank's step (its items: sends
    and posted receives): ``NcclRankComm.reserve``'s counts form (every transfer of the step
    at once; ``in_flight`` gives what is in flight at once)."""
    counts: dict[tuple[int, int, bool], int] = {}
    for op, k, s, _, _ in items:
        if op in (_core.ItemOp.SEND, _core.ItemOp.POST):
            key = (channel(k, s), s, op == _core.ItemOp.SEND)
            counts[key] = counts.get(key, 0) + 1
    return [(c, s, send, n) for (c, s, send), n in sorted(counts.items())]


def in_flight(prog) -> list[tuple[int, int, bool, int, int]]:
    """(channel, stage, send, from, to) per transfer of a rank's step, from its rank program
    (``RankProgram``, docs/RANK_IR.md): in flight from its group's POST (instruction ``from``)
    to ``to``, a receive's WAIT or the FREE that waits for a send's completion (-1: none, the
    step's end), for ``NcclRankComm.reserve``: it reserves the most in flight at once."""
    out = []
    for t in prog.transfers:
        out.append((int(t.channel), int(prog.buffers[t.buffer].key.stage),
                    t.dir == _core.TransferDir.SEND, int(prog.groups[t.group].post),
                    int(t.wait)))
    return out


def most_in_flight(transfers, nbytes) -> tuple[int, int]:
    """(sends, receives): the most bytes in flight at once per direction over ``transfers``
    (``in_flight``'s tuples; ``nbytes(channel, stage)`` a transfer's packed bytes), counted
    per packed size as the staging pool is: what ``NcclRankComm.reserved_bytes`` reports."""
    end = 1 + max([max(f, t) for *_, f, t in transfers] or [0])
    top: dict[tuple[bool, int], int] = {}
    for send in (True, False):
        sizes = {nbytes(c, s) for c, s, d, _, _ in transfers if d == send}
        for size in sizes:
            ivs = [(f, end if t < 0 else t) for c, s, d, f, t in transfers
                   if d == send and nbytes(c, s) == size]
            top[send, size] = max(sum(f <= x <= t for f, t in ivs) for x, _ in ivs)
    return tuple(sum(size * n for (d, size), n in top.items() if d == send)
                 for send in (True, False))


def comm(comm_id: int, ops: list[tuple[int, int, int, int]], token, sends: list, outs: list):
    """One transfer group: ``ops`` are (kind, a ``_core.runtime.CommOpKind`` value, peer,
    channel, stage);
    ``sends`` the SEND operations' arrays in order; ``outs`` the WAIT operations' result
    shapes in order. Returns (token, received arrays)."""
    cols = np.asarray(ops, np.int32).reshape(len(ops), 4).T
    call = jax.ffi.ffi_call("baton_comm", (_TOKEN, *outs), has_side_effect=True)
    res = call(token, *sends, comm=np.int64(comm_id), kinds=cols[0], peers=cols[1],
               channels=cols[2], stages=cols[3])
    return res[0], list(res[1:])


def drain(comm_id: int, token):
    """Waits for every send posted so far; returns the token."""
    call = jax.ffi.ffi_call("baton_drain", _TOKEN, has_side_effect=True)
    return call(token, comm=np.int64(comm_id))


def mark(comm_id: int, phase: int, token, after=()):
    """A task boundary (phase 0: start, 1: end), recorded while the context records; it runs
    once the arrays ``after`` (read by nothing: a run-time dependency) are computed."""
    call = jax.ffi.ffi_call("baton_mark", _TOKEN, has_side_effect=True)
    return call(token, *after, comm=np.int64(comm_id), phase=np.int32(phase))


def offload(comm_id: int, slot, token, xs: list):
    """OFFLOAD of one buffer: array j of ``xs`` into host slot ``slot + j`` (``slot`` an
    int32 scalar, traced inside a scan) of the context's host memory, after ``token``;
    returns the token."""
    call = jax.ffi.ffi_call("baton_offload", _TOKEN, has_side_effect=True)
    return call(token, jnp.asarray(slot, jnp.int32), *xs, comm=np.int64(comm_id))


def fetch(comm_id: int, slot, token, avals: list):
    """FETCH of one buffer: host slots ``slot + j`` as new arrays of ``avals`` (after
    ``token``; the slots are released); returns (token, the arrays)."""
    call = jax.ffi.ffi_call("baton_fetch", (_TOKEN, *avals), has_side_effect=True)
    t, *xs = call(token, jnp.asarray(slot, jnp.int32), comm=np.int64(comm_id))
    return t, xs
