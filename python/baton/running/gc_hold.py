"""Python's cyclic garbage collector held back while a step is built (``held``).

Building a step (tracing the model, lowering its programs, compiling the code around the loop)
allocates millions of short-lived Python objects. At CPython's default gen-0 threshold (700
allocations) the collector then runs over a hundred times in a MaxText step's first call, and
its full collections walk every object the process holds (JAX's, Flax's, MaxText's; measured
in `bench/results/maxtext.md`). While a
build runs, the gen-0 threshold is raised to ``BUILD_THRESHOLD`` and put back after, so the
collector still runs, a few times at most; what the build leaves behind is collected at the
next collection after it.

The threshold is process-wide: builds on several threads share one hold (a count under a
lock), and the last one out restores the threshold the first one found.
"""

from __future__ import annotations

import contextlib
import gc
import threading

BUILD_THRESHOLD = 50_000  # gen-0 allocations between collections while building

_lock = threading.Lock()
_holders = 0
_saved: tuple[int, ...] | None = None


@contextlib.contextmanager
def held(on: bool = True):
    """Raises the collector's gen-0 threshold to ``BUILD_THRESHOLD`` inside the block (when
    ``on`` and the threshold is lower), restoring it when the last concurrent block ends."""
    global _holders, _saved
    if not on:
        yield
        return
    with _lock:
        if _holders == 0:
            cur = gc.get_threshold()
            # (a threshold of 0 turns automatic collection off: left so)
            _saved = cur if 0 < cur[0] < BUILD_THRESHOLD else None
            if _saved is not None:
                gc.set_threshold(BUILD_THRESHOLD, *cur[1:])
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _saved is not None:
                gc.set_threshold(*_saved)
                _saved = None
