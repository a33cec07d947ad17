"""Multi-process mode: P processes talking over Gloo, each running k pipeline ranks.

A process started by ``python -m baton.launch`` (or under SLURM / Open MPI, or after
``jax.distributed.initialize``) runs k pipeline ranks: its local devices (one rank, k = 1)
or a ``PipelineMesh`` of its local devices with k ranks. Process p holds the global ranks
``p*k .. p*k+k-1``; every process must use the same k (checked at the first call,
:func:`agree_ranks_per_process`). :func:`process_group` connects the process-level transport
once per process and every ``baton.jit`` function in the process shares it; with k > 1 the
loops' transfers go over one more Gloo context per global rank (``ProcessGroup.rank_transports``).

Values that cross processes outside the instruction streams (an input another process holds,
the partial sums of a value shared by stages on several processes, per-microbatch outputs
sent to every process) move with :class:`Router` over the process-level transport: every
process walks the same sequence of ``need`` calls, so sends and receives pair up (tags from
one counter, above the executor's). A leaf a process does not hold is a :class:`Remote`
placeholder naming a rank of the process that does.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
from typing import Any, Sequence

import jax
import numpy as np

from .._jax_compat import cached_cross_process_collectives_hang
from ..errors import ConfigError
from ..runtime import rendezvous
from ..mesh import BATCH_AXES, DATA_AXIS, PipelineMesh
from .threads import on_rank_threads

_TAG_BASE = 1 << 44  # executor tags are step * num_buffer_ids + buffer: far below
_TAG_SPAN = 1 << 40


@dataclasses.dataclass(frozen=True)
class Remote:
    """Placeholder for a value that lives on another process (``rank``).

    A multi-process ``baton.jit`` step returns one for every output leaf this process does
    not hold (parameters and optimizer state of stages on other ranks). Pass it back in
    the next call unchanged; ``step.gather(tree)`` fetches the real values.
    """

    shape: tuple
    dtype: Any
    rank: int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __repr__(self) -> str:
        return f"Remote({np.dtype(self.dtype).name}{list(self.shape)} on rank {self.rank})"


@dataclasses.dataclass
class ProcessGroup:
    """This process's index (``rank``), the number of processes (``world_size``), and the
    transport to the other processes."""

    rank: int
    world_size: int
    transport: Any
    source: str = ""
    # Compiled steps holding an executor on this transport: released before it closes.
    steps: list = dataclasses.field(default_factory=list)
    # k -> this process's k per-rank Gloo contexts (k > 1 ranks per process); ("slot", j) ->
    # the slot context of a process holding slot j of a rank that spans processes
    rank_ts: dict = dataclasses.field(default_factory=dict)

    def ranks(self, k: int) -> list[int]:
        """The global pipeline ranks this process runs with ``k`` ranks per process."""
        return list(range(self.rank * k, self.rank * k + k))

    def rank_transports(self, k: int, connect_timeout: float = 60.0) -> list:
        """One transport per rank of :meth:`ranks`: the process's own with k = 1, else one
        Gloo context per global rank (world ``world_size * k``, rank id = global rank, store
        keys under ``baton/ranks<k>``), connected once (every process connects its k at once,
        on k threads: the connection is collective)."""
        if k == 1:
            return [self.transport]
        ts = self.rank_ts.get(k)
        if ts is None:
            info = rendezvous.rank_info()
            ts = [None] * k

            def connect(j):
                ts[j] = rendezvous.init_transport(
                    "gloo", info=dataclasses.replace(info, rank=self.rank * k + j,
                                                     world_size=self.world_size * k),
                    connect_timeout=connect_timeout, prefix=f"baton/ranks{k}")

            errors = on_rank_threads(k, connect)
            bad = [(j, e) for j, e in enumerate(errors) if e is not None]
            if bad:
                for t in ts:
                    if t is not None:
                        t.close()
                raise ConfigError("baton.jit: connecting the per-rank transports failed: " +
                                  "; ".join(f"rank {self.rank * k + j}: {type(e).__name__}: "
                                            f"{e}" for j, e in bad)) from bad[0][1]
            self.rank_ts[k] = ts
            atexit.register(self.release)  # (runs before these transports' close: LIFO)
        return ts

    def loop_transports(self, mesh: Any, connect_timeout: float = 60.0) -> list:
        """The transports of this process's ranks' loops (:meth:`rank_transports`), or, when
        ranks span processes, this process's *slot* context: one Gloo context per slot j
        joining slot j of every rank (world = the number of ranks, rank id = the pipeline
        rank, store keys under ``baton/slot<j>``), so a rank's transfers address peers by
        pipeline rank as before, and shard i goes from the process holding it on one rank
        to the process holding it on the other."""
        if not mesh.spans:
            return self.rank_transports(mesh.ranks_per_process, connect_timeout)
        (r,) = mesh.ranks_of(self.rank)
        j = mesh.procs(r).index(self.rank)
        key = ("slot", j)
        ts = self.rank_ts.get(key)
        if ts is None:
            info = rendezvous.rank_info()
            try:
                t = rendezvous.init_transport(
                    "gloo", info=dataclasses.replace(info, rank=r, world_size=mesh.num_ranks),
                    connect_timeout=connect_timeout, prefix=f"baton/slot{j}")
            except Exception as e:
                raise ConfigError(f"baton.jit: connecting slot {j} of rank {r} (process "
                                  f"{self.rank}) to the other ranks failed: "
                                  f"{type(e).__name__}: {e}") from e
            ts = self.rank_ts[key] = [t]
            atexit.register(self.release)
        return ts

    def abort_all(self, msg: str) -> None:
        """Aborts the process transport and every per-rank one (the peers' waits fail)."""
        for t in [self.transport] + [t for ts in self.rank_ts.values() for t in ts]:
            if not t.closed:
                t.abort(msg)

    def release(self) -> None:
        """Drops every executor built on the transport (then closing it says goodbye to the
        peers instead of leaving executors alive at interpreter exit)."""
        for step in self.steps:
            step.interpreter.forget_group()
        self.steps.clear()


_GROUP: ProcessGroup | None = None


def launched_world_size() -> int:
    """World size from the launcher's environment (1 when there is none)."""
    try:
        return rendezvous.rank_info().world_size
    except ConfigError:
        return 1


def process_group(kind: str = "gloo", connect_timeout: float = 60.0) -> ProcessGroup:
    """This process's group (connected on first use, then shared)."""
    global _GROUP
    if _GROUP is None or _GROUP.transport.closed:
        info = rendezvous.rank_info()
        t = rendezvous.init_transport(kind, info=info, connect_timeout=connect_timeout)
        _GROUP = ProcessGroup(info.rank, info.world_size, t, info.source)
        atexit.register(_GROUP.release)  # runs before init_transport's close (LIFO)
    return _GROUP


def local_devices(mesh: Any) -> Any:
    """This process's ranks: ``None`` -> ``jax.local_devices()`` (one rank); a list of
    devices (one rank); a ``jax.sharding.Mesh`` of this process's devices with named axes
    (one rank, the mesh its sub-mesh; with a ``"pipe"`` axis: a ``PipelineMesh`` of that many
    ranks); a ``PipelineMesh`` of this process's devices with k ranks; or a mesh over every
    process's devices (``jax.distributed``) whose ranks span processes
    (:func:`spanning_layout`)."""
    from jax.sharding import Mesh

    if mesh is None:
        return list(jax.local_devices())
    if isinstance(mesh, Mesh):
        devs = list(mesh.devices.flat)
    elif isinstance(mesh, PipelineMesh):
        devs = [d for g in mesh.rank_devices for d in g]
    else:
        devs = list(mesh)
    me = jax.process_index()
    foreign = sorted({d.process_index for d in devs if d.process_index != me})
    if foreign:
        if isinstance(mesh, Mesh) and "pipe" in mesh.axis_names:
            mesh = PipelineMesh(mesh)
        if not isinstance(mesh, PipelineMesh):
            raise ConfigError(
                f"baton.jit: the mesh holds devices of processes {foreign} besides this "
                f"process ({me}) but has no pipeline axis: pass a mesh of this process's own "
                f"devices, or a mesh over every process's devices with a 'pipe' axis "
                f"(baton.PipelineMesh(mesh, axis=...)) whose ranks span processes")
        spanning_layout(mesh, me)
        return mesh
    if isinstance(mesh, Mesh):
        return PipelineMesh(mesh) if "pipe" in mesh.axis_names else mesh
    if isinstance(mesh, PipelineMesh):
        return mesh
    return devs


def spanning_layout(mesh: Any, me: int) -> list[list[int]]:
    """Per rank of ``mesh`` (a ``PipelineMesh`` over several processes' devices), the
    processes that hold it, ordered by the first sub-mesh position each holds: process
    ``procs[r][j]`` is *slot* j of rank r. Raises ``ConfigError`` unless every rank has the
    same number of processes, no process holds devices of two ranks, process ``me`` holds a
    rank, and slot j holds the same sub-mesh positions in every rank (then slot j of two
    ranks holds the same shards of any value laid out by the same spec, and a transfer
    between the ranks goes from slot j to slot j)."""
    procs, pos = [], []
    owner: dict[int, int] = {}
    for r, sub in enumerate(mesh.meshes):
        at: dict[int, list[int]] = {}
        for i, d in enumerate(sub.devices.flat):
            at.setdefault(d.process_index, []).append(i)
        for p in at:
            if owner.setdefault(p, r) != r:
                raise ConfigError(
                    f"baton.jit: process {p} holds devices of ranks {owner[p]} and {r}: when "
                    f"ranks span processes, each process belongs to one rank")
        order = sorted(at, key=lambda p: at[p][0])
        procs.append(order)
        pos.append([at[p] for p in order])
    if me not in owner:
        raise ConfigError(f"baton.jit: process {me} holds none of the mesh's ranks")
    for r in range(1, len(procs)):
        if pos[r] != pos[0]:
            raise ConfigError(
                f"baton.jit: ranks 0 and {r} split their sub-meshes over processes differently "
                f"(rank 0: processes {procs[0]} hold positions {pos[0]}; rank {r}: processes "
                f"{procs[r]} hold {pos[r]}): every rank needs the same number of processes, "
                f"each holding the same positions of its sub-mesh")
    return procs


def ranks_per_process(local: Any) -> int:
    """k: the number of pipeline ranks in ``local`` (what :func:`local_devices` returned)."""
    return local.num_ranks if isinstance(local, PipelineMesh) else 1


def agree_ranks_per_process(group: ProcessGroup, k: int, timeout: float) -> None:
    """Every process's k (one all-gather over the process transport); raises ``ConfigError``
    naming every process and its k, in every process, when they differ."""
    router = Router(group, timeout)
    ks = router.allgather(str(k))
    router.finish()
    if len(set(ks)) != 1:
        raise ConfigError(
            "baton.jit: every process must run the same number of pipeline ranks (its "
            "PipelineMesh's ranks), but " + ", ".join(
                f"process {p} has {q}" for p, q in enumerate(ks)))


def agree_spanning_mesh(group: ProcessGroup, mesh: Any, timeout: float) -> None:
    """For a mesh whose ranks span processes: checks that this process's index in the
    launcher's group is its ``jax.process_index()`` (the mesh names processes by the latter,
    the transfers by the former) and that every process passed the same mesh (one
    all-gather); raises ``ConfigError`` in every process otherwise."""
    router = Router(group, timeout)
    key = json.dumps([jax.process_index(), [[d.id for d in g] for g in mesh.rank_devices],
                      list(mesh.axis_names), list(mesh.batch_axes)])
    blobs = router.allgather(key)
    router.finish()
    got = [json.loads(b) for b in blobs]
    bad = [p for p, g in enumerate(got) if g[0] != p]
    if bad:
        raise ConfigError(
            "baton.jit: the launcher's process numbers differ from jax.process_index() (" +
            ", ".join(f"process {p} is JAX process {got[p][0]}" for p in bad) + "): start "
            "jax.distributed with process_id = the launcher's rank (BATON_RANK)")
    if any(g[1:] != got[0][1:] for g in got):
        raise ConfigError(
            "baton.jit: the processes passed different meshes: " + "; ".join(
                f"process {p}: ranks {g[1]} axes {g[2]}" for p, g in enumerate(got)))


def process_mesh(local: Any, world_size: int):
    """The PipelineMesh of ``world_size`` processes of k ranks each: global rank ``p*k + j``
    is this process's rank j (a process only ever places values for its own ranks).
    ``local``: a list of devices (one rank, one ``"data"`` axis), a ``jax.sharding.Mesh``
    (one rank, its named axes), or a ``PipelineMesh`` of k ranks. A ``PipelineMesh`` whose
    ranks span processes is the mesh itself (each process runs the rank it holds a slot
    of); it must cover every process."""
    import copy

    from jax.sharding import Mesh

    if isinstance(local, PipelineMesh):
        m = copy.copy(local)
        m.__dict__.pop("_replicated", None)  # (a per-rank cache)
        procs = {d.process_index for g in m.rank_devices for d in g}
        if len(procs) > 1 or procs != {jax.process_index()}:
            m.rank_procs = spanning_layout(m, jax.process_index())
            missing = sorted(set(range(world_size)) - procs)
            if missing:
                raise ConfigError(
                    f"baton.jit: the mesh's ranks span processes but hold no device of "
                    f"processes {missing} (of {world_size}): every process must hold a slot "
                    f"of one rank")
            m.ranks_per_process = 1
            _check_cache_for_spanning(m)
            return m
    else:
        m = PipelineMesh.__new__(PipelineMesh)
        mesh = local if isinstance(local, Mesh) else Mesh(np.array(list(local)), (DATA_AXIS,))
        m.rank_devices, m.meshes, m.axis = [list(mesh.devices.flat)], [mesh], "pipe"
        m.batch_axes = tuple(n for n in mesh.axis_names if n in BATCH_AXES)
    k = m.ranks_per_process = len(m.rank_devices)
    m.rank_devices = list(m.rank_devices) * world_size
    m.meshes = list(m.meshes) * world_size
    m.rank_procs = [[r // k] for r in range(len(m.rank_devices))]
    return m


def _check_cache_for_spanning(mesh: PipelineMesh) -> None:
    """Refuses, before anything is compiled, a mesh whose ranks span processes on a JAX that
    hangs running cross-process collectives loaded from its persistent compilation cache
    (:func:`baton._jax_compat.cached_cross_process_collectives_hang`): every process takes
    the same decision from the same mesh and configuration, so all of them raise."""
    platform = mesh.rank_devices[0][0].platform
    if not cached_cross_process_collectives_hang(platform):
        return
    r, procs = next((r, ps) for r, ps in enumerate(mesh.rank_procs) if len(ps) > 1)
    raise ConfigError(
        f"baton.jit: rank {r} spans processes {procs}, so its programs run collectives across "
        f"processes, and JAX {jax.__version__} on {platform} hangs running such a collective "
        f"from an executable it loaded from the persistent compilation cache "
        f"({jax.config.jax_compilation_cache_dir}): turn the cache off for this run "
        f"(JAX_ENABLE_COMPILATION_CACHE=false, or jax.config.update("
        f"'jax_enable_compilation_cache', False) before the first compile), or use another "
        f"JAX release")


def _host(x) -> np.ndarray:
    return np.asarray(x, order="C")  # (ascontiguousarray would make a 0-d array 1-d)


def spread(x) -> bool:
    """``x`` is a ``jax.Array`` over several processes' devices (a rank spanning processes)
    of which this process holds only some shards."""
    return (isinstance(x, jax.Array) and not x.is_fully_addressable
            and not x.is_fully_replicated)


def host_value(x) -> np.ndarray:
    """``x`` in host memory. An array over several processes' devices: its local copy when
    replicated; else, when :func:`spread`, gathered with a replicating jit over its devices,
    which every process holding it must call (collective)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not x.is_fully_replicated:
            from jax.sharding import Mesh, NamedSharding, PartitionSpec

            devs = sorted(x.sharding.device_set, key=lambda d: d.id)
            rep = NamedSharding(Mesh(np.array(devs), ("all",)), PartitionSpec())
            x = jax.jit(lambda a: a, out_shardings=rep)(x)
        x = x.addressable_data(0)
    return _host(x)


class Router:
    """Point-to-point transfers of step values outside the instruction streams."""

    def __init__(self, group: ProcessGroup, timeout: float):
        self.g = group
        self.timeout = timeout
        self.sends: list = []
        self.counter = 0

    def _tag(self) -> int:
        t = _TAG_BASE + self.counter % _TAG_SPAN
        self.counter += 1
        return t

    def allgather(self, blob: str) -> list[str]:
        """Every process's ``blob``, over the transport (point to point, 2 (R - 1) messages
        per process): the rendezvous store's exchange polls files, a cost every step
        (bench/results/code_notes.md)."""
        me, R, t = self.g.rank, self.g.world_size, self.g.transport
        mine = np.frombuffer(blob.encode(), np.uint8).copy()
        recvs = {}
        for src in range(R):
            for dst in range(R):
                if src == dst:
                    continue
                tag = self._tag()
                if me == src:
                    self.sends.append(t.isend(dst, tag, [mine]))
                elif me == dst:
                    recvs[src] = t.irecv(src, tag)
        t.flush()
        return [blob if q == me else np.asarray(recvs[q].wait(self.timeout)[0]).tobytes().decode()
                for q in range(R)]

    def holders(self, keys: Sequence[Any], values: Sequence[Any], vals: dict) -> dict:
        """Which process holds each of ``keys`` (one all-gather of a bit string); fills
        ``vals`` with this process's values."""
        have = "".join("0" if isinstance(x, Remote) else "1" for x in values)
        blobs = self.allgather(have)
        if len({len(b) for b in blobs}) != 1:
            raise ConfigError(
                f"rank {self.g.rank}: the processes called the step with different numbers of "
                f"leaves ({[len(b) for b in blobs]}); every process must make the same calls")
        where = {}
        for j, (k, x) in enumerate(zip(keys, values)):
            where[k] = {q for q in range(len(blobs)) if blobs[q][j] == "1"}
            if have[j] == "1":
                vals[k] = x
        return where

    def need(self, keys: Sequence[Any], process: int | Sequence[int], vals: dict,
             where: dict) -> None:
        """Makes every value of ``keys`` present on ``process`` (one process, or every
        process of a list: a rank spanning processes), sent by its lowest holder (``where``:
        key -> the processes that hold it). A value spread over the processes of a rank
        (:func:`spread`) is gathered to host by all of them first."""
        me = self.g.rank
        t = self.g.transport
        procs = [process] if isinstance(process, (int, np.integer)) else list(process)
        recvs = []
        for k in keys:
            hold = where.get(k)
            if not hold:
                raise ConfigError(
                    f"processes {procs} need a value (id {k}) that no process holds: pass the "
                    f"full value (or the Remote placeholder its owner returned) in every process")
            missing = [q for q in procs if q not in hold]
            if not missing:
                continue
            src = min(hold)
            if me in hold and spread(vals[k]):
                vals[k] = host_value(vals[k])  # (every holder: the gather is collective)
            for q in missing:
                tag = self._tag()
                if me == src:
                    self.sends.append(t.isend(q, tag, [_host(vals[k])]))
                elif me == q:
                    recvs.append((k, t.irecv(src, tag)))
                hold.add(q)
        t.flush()
        for k, req in recvs:
            vals[k] = req.wait(self.timeout)[0]

    def finish(self) -> None:
        for r in self.sends:
            r.wait(self.timeout)
        self.sends.clear()


def gather(group: ProcessGroup, tree: Any, timeout: float = 120.0) -> Any:
    """Every leaf of ``tree`` as a numpy array on every process (``Remote`` leaves are
    fetched from the process that holds them). Collective: call it in every process."""
    leaves, treedef = jax.tree.flatten(tree)
    router = Router(group, timeout)
    vals: dict = {}
    keys = list(range(len(leaves)))
    where = router.holders(keys, leaves, vals)
    for q in range(group.world_size):
        router.need(keys, q, vals, where)
    router.finish()
    return jax.tree.unflatten(treedef, [host_value(vals[k]) for k in keys])
