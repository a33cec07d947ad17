"""Data read where it is consumed: a batch argument's leaves are read only in the processes
whose ranks' stages read them; the other processes pass ``baton.Remote`` placeholders.

``consumers(step, argnum)`` says, per leaf of a step argument, which stages and ranks read it
(the first stage reads the inputs, the last the targets; the middle stages neither).
``feed(step, argnum, read)`` calls ``read()`` only in a process that consumes some leaf of
that argument and replaces the leaves it does not consume by placeholders; a process that
consumes none gets placeholders without calling ``read`` at all. :class:`GrainFeed` does this
for a Grain pipeline, whose iterator advances only where the batch is consumed and whose
state (:meth:`GrainFeed.get_state`) goes into ``baton.checkpoint.save(..., data=...)``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from .errors import ConfigError
from .running.distributed import Remote
from .init import LeafHome, _compiled, leaf_homes


def consumers(fn, argnum: int) -> list[LeafHome]:
    """Per leaf of the compiled step's argument ``argnum``: the stages that read it, its owner
    rank and whether a rank of this process reads it (:class:`baton.init.LeafHome`; paths
    relative to the argument)."""
    _compiled(fn, "data.consumers")
    n = len(fn._tree.children())
    if isinstance(argnum, bool) or not isinstance(argnum, int) or not -n <= argnum < n:
        raise ConfigError(f"baton.data: argnum must name one of the step's {n} arguments "
                          f"(got {argnum!r})")
    argnum %= n
    homes = leaf_homes(fn)
    sizes = [t.num_leaves for t in fn._tree.children()]
    start = sum(sizes[:argnum])
    prefix = f"[{argnum}]"
    return [LeafHome(h.path[len(prefix):] if h.path.startswith(prefix) else h.path, h.stages,
                     h.owner, h.local, h.rank)
            for h in homes[start:start + sizes[argnum]]]


def consumed_here(fn, argnum: int) -> bool:
    """A rank of this process reads some leaf of argument ``argnum``."""
    return any(h.local for h in consumers(fn, argnum))


def feed(fn, argnum: int, read: Callable[[], Any]) -> Any:
    """Argument ``argnum`` of the next call of ``fn`` for this process: ``read()`` (the whole
    batch, arrays) with every leaf no rank of this process reads replaced by a
    ``baton.Remote`` placeholder, or, when this process reads none of them, placeholders only
    and ``read`` is not called. In one process every leaf is consumed: ``read()`` as is. A
    batch whose leaves differ in structure, shape or dtype from the compiled step's raises
    ``ConfigError`` naming the leaf."""
    cs = _compiled(fn, "data.feed")
    homes = consumers(fn, argnum)
    argnum %= len(fn._tree.children())
    tree = fn._tree.children()[argnum]
    start = sum(t.num_leaves for t in fn._tree.children()[:argnum])
    avals = [cs.traced.avals[cs.traced.step_inputs[start + i]] for i in range(len(homes))]
    if not any(h.local for h in homes):
        return jax.tree.unflatten(tree, [Remote(tuple(a.shape), np.dtype(a.dtype), h.owner)
                                         for a, h in zip(avals, homes)])
    batch = read()
    if jax.tree.structure(batch) != tree:
        raise ConfigError(f"baton.data.feed: the batch read has structure "
                          f"{jax.tree.structure(batch)} but the step's argument {argnum} has "
                          f"{tree}")
    out = []
    for x, a, h in zip(jax.tree.leaves(batch), avals, homes):
        if tuple(np.shape(x)) != tuple(a.shape) or np.dtype(x.dtype) != np.dtype(a.dtype):
            raise ConfigError(f"baton.data.feed: batch leaf {h.path or '<root>'} is "
                              f"{np.dtype(x.dtype)}{list(np.shape(x))} but the step was "
                              f"compiled for {a.dtype}{list(a.shape)}")
        out.append(x if h.local else Remote(tuple(a.shape), np.dtype(a.dtype), h.owner))
    return jax.tree.unflatten(tree, out)


class GrainFeed:
    """A Grain pipeline (``grain.MapDataset`` / ``grain.IterDataset`` yielding the step's
    batch argument ``argnum``, or any iterable whose iterator has ``get_state`` /
    ``set_state``) fed where it is consumed: ``next(feed)`` is :func:`feed` with the
    pipeline's next batch, so the iterator advances only in processes whose ranks read the
    batch. ``get_state()`` (None where nothing is read) goes into
    ``baton.checkpoint.save(..., data=...)``; ``set_state(baton.checkpoint.restore_data(...))``
    resumes at the same batch."""

    def __init__(self, fn, argnum: int, dataset: Any):
        self.fn = fn
        self.argnum = argnum
        self._it = iter(dataset)
        if not (hasattr(self._it, "get_state") and hasattr(self._it, "set_state")):
            raise ConfigError(f"baton.data.GrainFeed: the iterator of {type(dataset).__name__} "
                              f"has no get_state / set_state (pass a grain dataset)")

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        return feed(self.fn, self.argnum, lambda: next(self._it))

    def get_state(self) -> Any:
        """The iterator's state where this process reads the batch, else None."""
        return self._it.get_state() if consumed_here(self.fn, self.argnum) else None

    def set_state(self, state: Any) -> None:
        """Restores the iterator's state (None: nothing to restore, e.g. a process that does
        not read the batch)."""
        if state is not None:
            self._it.set_state(state)
