"""A checkpoint directory's layout: ``path/<step>/`` with ``baton.json``, one Orbax item per
process (``process-<p>/``) and the ``COMMITTED`` marker; the committed steps under a path."""

from __future__ import annotations

import os

FORMAT = "baton-checkpoint/1"
METADATA = "baton.json"
COMMIT = "COMMITTED"


def _step_dir(path, step: int) -> str:
    return os.path.join(os.fspath(path), str(int(step)))


def _item_name(process: int) -> str:
    return f"process-{process}"


def committed(path, step: int) -> bool:
    """``path/<step>`` is a committed checkpoint."""
    return os.path.isfile(os.path.join(_step_dir(path, step), COMMIT))


def all_steps(path) -> list[int]:
    """The committed steps under ``path``, ascending (uncommitted step directories skipped)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return []
    return sorted(int(n) for n in os.listdir(path)
                  if n.isdigit() and committed(path, int(n)))


def latest_step(path) -> int | None:
    """The newest committed step under ``path`` (None when there is none); a step whose save
    did not finish (no ``COMMITTED`` marker) is skipped."""
    steps = all_steps(path)
    return steps[-1] if steps else None


def _data_name(process: int) -> str:
    """The file of process ``process``'s data-iterator state in a step directory."""
    return f"data-process-{process}.json"


def doomed_steps(path, max_to_keep: int | None, keep_period: int | None = None) -> list[int]:
    """The committed steps a retention policy removes (Orbax ``CheckpointManager``'s
    conventions): all but the newest ``max_to_keep`` (None: keep all), except those that are a
    multiple of ``keep_period``, which are kept for good."""
    if max_to_keep is None:
        return []
    steps = all_steps(path)
    old = steps[:-max_to_keep] if max_to_keep > 0 else steps
    return [s for s in old if not (keep_period and s % keep_period == 0)]
