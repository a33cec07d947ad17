"""Orbax's checkpointers: this process's ``AsyncCheckpointer`` for saves and a synchronous one
for restores, each told not to coordinate with other JAX processes."""

from __future__ import annotations

import jax

from ..errors import ConfigError


def _ocp():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover
        raise ConfigError("baton.checkpoint needs orbax-checkpoint "
                          "(pip install orbax-checkpoint)") from e
    return ocp


def _mp_options(ocp) -> dict:
    """Each process writes and reads its own items: under ``jax.distributed`` (several JAX
    processes) Orbax must not coordinate with the others (every process its own primary host,
    barriers among itself only). Empty in Baton's own multi-process mode, where each process
    is a one-process JAX world."""
    if jax.process_count() <= 1:
        return {}
    me = jax.process_index()
    return dict(multiprocessing_options=ocp.options.MultiprocessingOptions(
        primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"baton{me}"))


def _handler_options(ocp) -> dict:
    """The PyTree handler's options: under ``jax.distributed``, its array handler writes the
    arrays' metadata from this process (its own primary host) and keeps no per-process array
    metadata store (whose check expects every JAX process in one checkpoint), and it writes
    each array whole from its replica 0 (not split over replicas: the other replicas of a
    leaf's array are in processes that do not write this item); the leaves are arrays
    (``saving._writable``)."""
    opts = _mp_options(ocp)
    if opts:
        arrays = ocp.type_handlers.ArrayHandler(primary_host=jax.process_index(),
                                                array_metadata_store=None,
                                                use_replica_parallel=False)
        opts["type_handler_registry"] = ocp.type_handlers.create_type_handler_registry(
            (jax.Array, arrays))
    return opts


_SAVER = None


def _saver():
    """This process's Orbax ``AsyncCheckpointer`` (one save in flight at a time). Under
    ``jax.distributed`` it creates its directories before writing, not asynchronously:
    Orbax's asynchronous creation signals through keys of the shared ``jax.distributed``
    key-value store named by an operation id that counts saves per process, so processes
    saving on their own (each its own primary host) share those keys, and one process's
    cleanup of them can leave another waiting for a signal that is gone (a rare hang)."""
    global _SAVER
    if _SAVER is None:
        ocp = _ocp()
        mp = _mp_options(ocp)
        if mp:
            mp["async_options"] = ocp.options.AsyncOptions(
                create_directories_asynchronously=False)
        _SAVER = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(**_handler_options(ocp)),
                                       **mp)
    return _SAVER


def _reader():
    ocp = _ocp()
    mp = _mp_options(ocp)
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**_handler_options(ocp)), **mp)
