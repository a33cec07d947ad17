"""Rank threads of one process: every rank's part of a call on a thread of its own, and the
error of the rank where a failure started. The engines (``interpreter.py``, ``engine.py``)
and the multi-process rendezvous (``distributed.py``) run their ranks through these."""

from __future__ import annotations

import threading


def on_rank_threads(num_ranks: int, fn, inline: bool = False) -> list[BaseException | None]:
    """Runs ``fn(r)`` for every rank on its own thread ("baton-rank-r") and returns each
    rank's exception (None where it returned); ``inline``: one rank runs on this thread."""
    errors: list[BaseException | None] = [None] * num_ranks
    if inline and num_ranks == 1:
        try:
            fn(0)
        except BaseException as e:  # noqa: BLE001  (the caller re-raises)
            errors[0] = e
        return errors

    def go(r):
        try:
            fn(r)
        except BaseException as e:  # noqa: BLE001  (the caller re-raises)
            errors[r] = e

    threads = [threading.Thread(target=go, args=(r,), name=f"baton-rank-{r}", daemon=True)
               for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def raise_first(errors, causes=None):
    """Raises the error of the rank where the failure started (``causes``: rank -> its
    Python exception, raised as the cause); the other ranks' errors only say that rank
    failed."""
    errs = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not errs:
        return
    origin = None
    for _, e in errs:
        fr = getattr(e, "failed_rank", -1)
        if isinstance(fr, int) and fr >= 0:
            origin = fr
            break
    chosen = next((e for r, e in errs if r == origin), errs[0][1])
    cause = (causes or {}).get(origin if origin is not None else errs[0][0])
    if cause is not None and cause is not chosen:
        raise chosen from cause
    raise chosen


__all__ = ["on_rank_threads", "raise_first"]
