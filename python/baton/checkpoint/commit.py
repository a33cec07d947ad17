"""Saves in flight and the commit protocol: a :class:`SaveHandle` waits for this process's
Orbax write, exchanges every process's status over Baton's process group, and process 0 writes
``COMMITTED``."""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import time

from ..errors import ExecutionError
from ..running.distributed import Router
from .layout import COMMIT, _step_dir, doomed_steps
from .store import _saver

_log = logging.getLogger("baton")


def _test_hook(event: str, **info) -> None:
    """Called at points of a save (tests replace it to kill a process there): ``"writing"``
    (this process's Orbax write has started), ``"written"`` (it finished, before the commit
    exchange), ``"commit"`` (process 0, every item written, before ``COMMITTED``)."""


class SaveHandle:
    """A save in flight. ``wait()`` (collective in multi-process mode: call it in every
    process) finishes this process's write and commits the checkpoint; returns the step
    directory. ``done`` tells whether it was committed."""

    def __init__(self, path, step, group, timeout, process, expected_items, writing,
                 failed="", retain=None):
        self.path = os.fspath(path)
        self.step = int(step)
        self.dir = _step_dir(path, step)
        self.group = group
        self.timeout = timeout
        self.process = process
        self.expected_items = expected_items
        self.writing = writing
        self.failed = failed  # this process's Orbax save did not start: why
        self.retain = retain  # (max_to_keep, keep_period): applied by process 0 once committed
        self.done = False
        self.error: BaseException | None = None

    def wait(self) -> str:
        if self.done:
            return self.dir
        if self.error is not None:
            raise self.error
        try:
            return self._finish()
        except BaseException as e:
            self.error = e
            raise
        finally:
            if self in _PENDING:
                _PENDING.remove(self)

    wait_until_finished = wait

    def _finish(self) -> str:
        status = self.failed or "ok"
        if self.writing:
            try:
                _saver().wait_until_finished()
            except Exception as e:  # noqa: BLE001  (reported to every process)
                status = f"{type(e).__name__}: {e}"
        _test_hook("written", step=self.step, process=self.process)
        statuses = _exchange(self.group, status, self.timeout)
        bad = [(p, s) for p, s in enumerate(statuses) if s != "ok"]
        if bad:
            raise ExecutionError(
                f"baton.checkpoint.save: step {self.step} under {self.path} was not committed: "
                + "; ".join(f"process {p}: {s}" for p, s in bad))
        if self.process == 0:
            missing = [n for n in self.expected_items
                       if not os.path.exists(os.path.join(self.dir, n))]
            if missing:
                raise ExecutionError(f"baton.checkpoint.save: step {self.step}: items {missing} "
                                     f"are missing under {self.dir}; not committed")
            _test_hook("commit", step=self.step, process=self.process)
            _write_atomic(os.path.join(self.dir, COMMIT),
                          json.dumps({"step": self.step, "time": time.time()}) + "\n")
            if self.retain is not None:
                for old in doomed_steps(self.path, *self.retain):
                    gone = _step_dir(self.path, old)
                    os.remove(os.path.join(gone, COMMIT))  # (uncommitted first: never half)
                    shutil.rmtree(gone, ignore_errors=True)
        _exchange(self.group, "committed", self.timeout)  # every process sees the marker
        self.done = True
        return self.dir


_PENDING: list[SaveHandle] = []


def wait_until_finished() -> None:
    """Finishes and commits every save in flight in this process (collective in
    multi-process mode)."""
    while _PENDING:
        _PENDING[0].wait()


def _at_exit():
    """A save still in flight at exit cannot be committed any more (Orbax finishes its writes
    on threads, and Python starts no thread once it is shutting down): says so."""
    for h in _PENDING:
        _log.warning("baton.checkpoint: step %d under %s was not committed (the program ended "
                     "before handle.wait() or baton.checkpoint.wait_until_finished()); "
                     "latest_step and restore ignore it", h.step, h.path)


atexit.register(_at_exit)


def _write_atomic(name: str, text: str) -> None:
    tmp = f"{name}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, name)
    try:
        fd = os.open(os.path.dirname(name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _exchange(group, blob: str, timeout: float) -> list[str]:
    """Every process's ``blob`` (a barrier that carries a status); ``[blob]`` in one
    process."""
    if group is None:
        return [blob]
    router = Router(group, timeout)
    out = router.allgather(blob)
    router.finish()
    return out
