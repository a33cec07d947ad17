"""``CheckpointManager``: periodic saves under one directory with a retention policy and the
data-iterator state, in the manner of Orbax's ``CheckpointManager``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .commit import wait_until_finished
from .layout import all_steps, latest_step
from .restoring import metadata, restore, restore_data
from .saving import save


@dataclass(frozen=True)
class CheckpointManagerOptions:
    """``save_interval_steps``: ``save`` writes only steps that are multiples of it (unless
    forced); ``max_to_keep``: committed steps kept (None: all); ``keep_period``: steps that
    are multiples of it are never removed."""

    save_interval_steps: int = 1
    max_to_keep: int | None = None
    keep_period: int | None = None

    def __post_init__(self):
        for name in ("save_interval_steps", "max_to_keep", "keep_period"):
            v = getattr(self, name)
            if v is None and name != "save_interval_steps":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"baton.checkpoint.CheckpointManagerOptions: {name} must be "
                                  f"a positive integer (got {v!r})")


@dataclass
class Restored:
    """What :meth:`CheckpointManager.restore` read: the step, the training state and this
    process's data-iterator state (None when the checkpoint has none for it)."""

    step: int
    state: Any
    data: Any


class CheckpointManager:
    """Checkpoints of a ``baton.jit`` step (``fn``) under ``directory``: ``save(step, state,
    data=...)`` (collective in multi-process mode), ``restore(step=None)``, ``latest_step()``,
    ``all_steps()``, ``wait_until_finished()``."""

    def __init__(self, directory, fn: Any = None,
                 options: CheckpointManagerOptions | None = None):
        self.directory = directory
        self.fn = fn
        self.options = options or CheckpointManagerOptions()

    def should_save(self, step: int) -> bool:
        return step % self.options.save_interval_steps == 0

    def save(self, step: int, state: Any, *, data: Any = None, force: bool = False):
        """Saves step ``step`` (with this process's data state ``data``) when
        :meth:`should_save` or ``force``; returns the ``SaveHandle``, or None when skipped.
        The retention policy applies once the save is committed."""
        if not force and not self.should_save(step):
            return None
        o = self.options
        return save(self.directory, step, state, self.fn, data=data, max_to_keep=o.max_to_keep,
                    keep_period=o.keep_period)

    def restore(self, step: int | None = None, *, target: Any = None,
                data: bool = True) -> Restored:
        """The state (placed for ``fn``, or plain JAX) and, with ``data``, this process's data
        state of ``step`` (None: the latest committed)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise ConfigError(f"baton.checkpoint.CheckpointManager: no committed checkpoint "
                              f"under {self.directory}")
        state = restore(self.directory, step, target=target, fn=self.fn)
        got = restore_data(self.directory, step, fn=self.fn) if data else None
        return Restored(int(step), state, got)

    def latest_step(self) -> int | None:
        wait_until_finished()
        return latest_step(self.directory)

    def all_steps(self) -> list[int]:
        wait_until_finished()
        return all_steps(self.directory)

    def metadata(self, step: int | None = None) -> dict:
        return metadata(self.directory, step)

    def wait_until_finished(self) -> None:
        wait_until_finished()
