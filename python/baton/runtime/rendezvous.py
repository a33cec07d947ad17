"""Who am I, how many are we, where do we meet: from the launcher's environment.

Sources, first match wins:

* ``python -m baton.launch``: ``BATON_RANK``, ``BATON_WORLD_SIZE``, ``BATON_LOCAL_RANK``,
  ``BATON_STORE`` (``file:///dir`` or ``jax``);
* SLURM: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``;
* Open MPI: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``;
* an initialized ``jax.distributed`` (``jax.process_index()``, ``jax.process_count()``).

The store: ``BATON_STORE=file:///dir`` (processes on one host), otherwise ``jax``: the
``jax.distributed`` key-value store (call ``jax.distributed.initialize`` first; it reads the
SLURM / Open MPI variables itself). Its keys live under the job's namespace and every Gloo
transport runs the admission hello before use (:mod:`baton.runtime.admission`).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket

from ..errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    store: str  # "file:///dir" or "jax"
    source: str  # which environment supplied it


def _int(env, name):
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"environment variable {name}={env[name]!r} is not an integer") from None


def rank_info(env=None) -> RankInfo:
    """Rank, world size, local rank and store address from the environment."""
    env = os.environ if env is None else env
    store = env.get("BATON_STORE", "")
    for source, r, w, lr in (
        ("baton.launch", "BATON_RANK", "BATON_WORLD_SIZE", "BATON_LOCAL_RANK"),
        ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
        ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ):
        if r in env and w in env:
            rank, world = _int(env, r), _int(env, w)
            local = _int(env, lr) if lr in env else 0
            if not 0 <= rank < world:
                raise ConfigError(f"{source}: rank {rank} is outside world size {world}")
            return RankInfo(rank, world, local, store or "jax", source)
    try:
        import jax

        if jax.process_count() > 1:
            return RankInfo(jax.process_index(), jax.process_count(), 0, store or "jax",
                            "jax.distributed")
    except Exception:  # jax absent or no backend: fall through
        pass
    raise ConfigError(
        "cannot tell this process's rank: start it with `python -m baton.launch --nprocs N`, "
        "under SLURM or Open MPI, or after jax.distributed.initialize()")


def local_gpu(local_rank: int, env=None) -> int:
    """The CUDA device index (among the visible ones) of the process with ``local_rank`` on
    its host: 0 when the launcher pinned one GPU to it (``CUDA_VISIBLE_DEVICES`` names one:
    ``python -m baton.launch``, the sbatch recipe's one-process-per-GPU variant), else its
    local rank (every process sees every GPU)."""
    env = os.environ if env is None else env
    visible = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    if len(visible) == 1:
        return 0
    if visible and local_rank >= len(visible):
        raise ConfigError(f"local rank {local_rank} has no GPU: CUDA_VISIBLE_DEVICES="
                          f"{env['CUDA_VISIBLE_DEVICES']!r} names {len(visible)}")
    return local_rank


def _jax_kv_client():
    # The key-value client of jax.distributed (private API: lives in baton._jax_compat).
    from .._jax_compat import distributed_client

    client = distributed_client()
    if client is None:
        raise ConfigError("BATON_STORE=jax needs jax.distributed.initialize() to be called first")
    return client


def make_store(address: str, namespace: str | None = None):
    """A rendezvous store for ``address`` (``file:///dir`` or ``jax``), its keys under
    ``namespace`` (default: this job's, :func:`admission.job_namespace`; "" for none):
    a file store's sub-directory, a prefix of the ``jax`` store's keys."""
    from . import callback_store, file_store
    from .admission import job_namespace, job_token

    ns = job_namespace(job_token()) if namespace is None else namespace
    if address.startswith("file://"):
        path = address[len("file://"):]
        if ns:
            path = os.path.join(path, ns)
        os.makedirs(path, exist_ok=True)
        return file_store(path)
    if address == "jax":
        client = _jax_kv_client()
        pre = f"{ns}/" if ns else ""

        def set_(key, value: bytes):
            client.key_value_set_bytes(pre + key, value)

        def get(key, timeout_s):
            return client.blocking_key_value_get_bytes(pre + key, max(1, int(timeout_s * 1000)))

        return callback_store(set_, get)
    raise ConfigError(f"unknown store address {address!r} (use file:///dir or jax)")


def init_transport(kind: str = "gloo", *, info: RankInfo | None = None, hostname: str | None = None,
                   connect_timeout: float = 60.0, device: int | None = None,
                   prefix: str = "baton"):
    """Connects this process's transport (``"gloo"`` or ``"nccl"``) to every other rank.
    ``prefix``: the Gloo context's store key namespace (``info``'s rank and world size with
    another prefix make another context on the same store).

    The transport is closed at interpreter exit (or call ``close()``): a rank that leaves
    without closing looks failed to the others.
    """
    from . import gloo_transport, nccl_transport
    from .admission import admit, job_namespace, job_token

    info = info or rank_info()
    token = job_token()
    ns = job_namespace(token)
    store = make_store(info.store, ns)
    if kind == "gloo":
        if hostname is None:
            hostname = os.environ.get("BATON_HOSTNAME")
        if hostname is None:
            hostname = ("127.0.0.1" if info.store.startswith("file://")
                        else socket.gethostbyname(socket.gethostname()))
        t = gloo_transport(info.rank, info.world_size, store, hostname=hostname,
                           connect_timeout=connect_timeout, prefix=prefix)
        if token:  # the hello, over the new connections, before any data moves
            try:
                admit(t, info.rank, info.world_size, token, f"{ns}/{prefix}", connect_timeout)
            except ConfigError as e:
                t.abort(str(e))  # (the peers' waits end, naming this rank's refusal)
                t.close()
                raise
    elif kind == "nccl":
        t = nccl_transport(info.rank, info.world_size,
                           local_gpu(info.local_rank) if device is None else device, store)
    else:
        raise ConfigError(f"unknown transport {kind!r} (use 'gloo' or 'nccl')")
    atexit.register(t.close)
    return t
