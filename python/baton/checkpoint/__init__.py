"""Checkpoints of pipelined training state on Orbax.

``save(path, step, state, fn)`` writes the training state (the step's leading arguments, e.g.
``(params, opt_state)``) of a ``baton.jit`` step; ``restore(path, step, fn=...)`` reads it back
placed for a pipelined step of any layout (other ranks, another schedule: every array is found
by its path), or, without ``fn``, as a plain JAX pytree.

On disk, under ``path``::

    <step>/                      one directory per checkpointed step (the integer)
        baton.json               Baton's metadata (process 0): plan, stage map, tree, leaves
        data-process-<p>.json    process p's data-iterator state (``save(..., data=...)``)
        process-<p>/             an Orbax PyTree item: the arrays process p wrote,
                                 {"rank<r>": {"a<i>": leaf i}} for each rank r it runs
        COMMITTED                written last, by process 0, once every item is finalized

Each process writes only the leaves its own ranks hold (no gather), asynchronously (Orbax's
``AsyncCheckpointer``). The commit is collective: ``SaveHandle.wait()`` (or the next
``save``, ``wait_until_finished()`` or ``restore``; not interpreter exit, so call one before
the program ends) waits for this process's write, exchanges every process's status over
Baton's process group, and then process 0 writes ``COMMITTED``. A step directory without it
is not a checkpoint: ``latest_step`` and ``restore`` skip it, and the next ``save`` of that
step replaces it. Killing a run at any point of a save leaves the previous checkpoint as it
was.

In multi-process mode every process is its own JAX world (``jax.process_count() == 1``), so
Orbax's own multi-host coordination has nothing to do: each process's item is a complete
one-process Orbax checkpoint (written to a temporary directory and renamed by Orbax), and
Baton's commit marker makes the set of items one checkpoint.

Ranks spanning processes (``jax.distributed``, each process its own Orbax primary host): a
leaf split over a rank's processes is gathered by all of them (collective, in leaf order) and
written by one, its owner rank's first process, as an array on that process's device (Orbax
writes host leaves from JAX process 0 only); on restore every process of the rank reads the
whole value and places its own shards. ``max_to_keep`` / ``keep_period`` (or
:class:`CheckpointManager`) prune old steps once a save is committed.

Modules: ``layout`` (the directory layout, committed steps, retention), ``leaves`` (the state's leaves and
the step's stage map), ``store`` (Orbax's checkpointers), ``commit`` (saves in flight and the
commit protocol; ``commit._test_hook``), ``saving`` (``save``) and ``restoring`` (``restore``,
``metadata``, ``restore_data``), ``manager`` (``CheckpointManager``).
"""

from .commit import SaveHandle, wait_until_finished
from .layout import COMMIT, FORMAT, METADATA, all_steps, committed, latest_step
from .manager import CheckpointManager, CheckpointManagerOptions, Restored
from .restoring import metadata, restore, restore_data
from .saving import save

__all__ = [
    "COMMIT", "FORMAT", "METADATA", "CheckpointManager", "CheckpointManagerOptions", "Restored",
    "SaveHandle", "all_steps", "committed", "latest_step", "metadata", "restore", "restore_data",
    "save", "wait_until_finished",
]
