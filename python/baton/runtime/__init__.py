"""Baton's runtime: per-rank executor and transports (C++ core, ``baton._core.runtime``).

* :class:`Executor` runs one rank's instruction stream of a :class:`baton.Plan`; tasks are
  Python callbacks (:class:`Tasks`), values are any Python objects (e.g. lists of
  ``jax.Array``). ``Executor.run`` releases the GIL; transfers move on transport threads
  while tasks run.
* Transports: :class:`LocalHub` (executors in one process hand values over),
  :func:`gloo_transport` (TCP between processes/hosts), :func:`nccl_transport` (GPUs; only
  when built with CUDA). Host arrays cross as DLPack views (see :mod:`.dlpack`).
* :mod:`.rendezvous` builds a store and a transport from the launcher's environment
  (``python -m baton.launch``, SLURM, Open MPI, ``jax.distributed``).

Failures: a rank that fails tells every other rank; a rank waiting longer than ``timeout``
stops. Both raise :class:`baton.ExecutionError` naming the rank, the instruction, the buffer
(stage, microbatch) and, when known, the failed rank (``failed_rank``).
"""

from __future__ import annotations

from .._core import runtime as _rt
from .dlpack import from_host, to_host  # noqa: F401

Executor = _rt.Executor
Tasks = _rt.Tasks
Transport = _rt.Transport
LocalHub = _rt.LocalHub
Store = _rt.Store
hash_store = _rt.hash_store
file_store = _rt.file_store
callback_store = _rt.callback_store
gloo_transport = _rt.gloo_transport
nccl_transport = _rt.nccl_transport
nccl_available = _rt.nccl_available
runtime_version = _rt.runtime_version
handshake_blob = _rt.handshake_blob
dtype_names = _rt.dtype_names
retain_host_memory = _rt.retain_host_memory


def make_tasks(run=None, accumulate=None, received=None, *, to_jax: bool = True,
               recv_layout=None) -> Tasks:
    """Tasks whose values are lists of arrays.

    ``run(rank, action, input_ids, inputs, output_ids) -> outputs`` (one per output id); ``accumulate(rank, buffer, value)``;
    ``received(rank, buffer, value) -> value`` (e.g. ``jax.device_put`` onto the rank's
    devices). Across byte transports a value travels as its list of arrays; with ``to_jax``
    the receiver gets ``jax.Array``s (zero-copy DLPack views of the aligned receive buffers).
    ``recv_layout(rank, buffer) -> [(dtype, shape), ...]`` (or ShapeDtypeStructs) sizes NCCL
    receives, which carry no header; over Gloo a known layout also drops the header (the
    receiver posts its tensor receives at once) and senders check their values against it.
    """
    return Tasks(run=run, accumulate=accumulate, received=received, to_host=to_host,
                 from_host=from_host if to_jax else None, recv_layout=recv_layout)


__all__ = [
    "Executor", "Tasks", "Transport", "LocalHub", "Store", "hash_store", "file_store",
    "callback_store", "gloo_transport", "nccl_transport", "nccl_available", "runtime_version",
    "handshake_blob", "dtype_names", "make_tasks", "to_host", "from_host", "retain_host_memory",
]
