"""Multi-process mode: one process per pipeline rank, talking over Gloo.

A process started by ``python -m baton.launch`` (or under SLURM / Open MPI, or after
``jax.distributed.initialize``) is one pipeline rank; its local devices are the rank's
sub-mesh. :func:`process_group` connects the transport once per process and every
``baton.jit`` function in the process shares it.

Values that cross ranks outside the instruction streams (an input another rank holds, the
partial sums of a value shared by stages on several ranks, per-microbatch outputs sent to
every process) move with :class:`Router`: every process walks the same sequence of
``need`` calls, so sends and receives pair up (tags from one counter, above the executor's).
A leaf a process does not hold is a :class:`Remote` placeholder naming the rank that does.
"""

from __future__ import annotations

import atexit
import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from ..errors import ConfigError

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
    """This process's rank, the world size, and the transport to the other ranks."""

    rank: int
    world_size: int
    transport: Any
    source: str = ""
    # Compiled steps holding an executor on this transport: released before it closes.
    steps: list = dataclasses.field(default_factory=list)

    def release(self) -> None:
        """Drops every executor built on the transport (then closing it says goodbye to the
        peers instead of leaving executors alive at interpreter exit)."""
        for step in self.steps:
            step.interpreter.forget_group()
        self.steps.clear()


_GROUP: ProcessGroup | None = None


def launched_world_size() -> int:
    """World size from the launcher's environment (1 when there is none)."""
    from ..runtime import rendezvous

    try:
        return rendezvous.rank_info().world_size
    except ConfigError:
        return 1


def process_group(kind: str = "gloo", connect_timeout: float = 60.0) -> ProcessGroup:
    """This process's group (connected on first use, then shared)."""
    global _GROUP
    if _GROUP is None or _GROUP.transport.closed:
        from ..runtime import rendezvous

        info = rendezvous.rank_info()
        t = rendezvous.init_transport(kind, info=info, connect_timeout=connect_timeout)
        _GROUP = ProcessGroup(info.rank, info.world_size, t, info.source)
        atexit.register(_GROUP.release)  # runs before init_transport's close (LIFO)
    return _GROUP


def local_devices(mesh: Any) -> Any:
    """The devices of this process's rank: ``None`` -> ``jax.local_devices()``; a list of
    devices; a ``PipelineMesh`` with one rank; or a ``jax.sharding.Mesh`` of this process's
    devices with named axes (kept: the rank's sub-mesh)."""
    from jax.sharding import Mesh

    from .mesh import PipelineMesh

    if mesh is None:
        return list(jax.local_devices())
    if isinstance(mesh, Mesh):
        if "pipe" in mesh.axis_names:
            raise ConfigError(
                "multi-process baton.jit: each process is one rank, so its mesh is the rank's "
                f"sub-mesh, without a 'pipe' axis (got axes {mesh.axis_names})")
        return mesh
    if isinstance(mesh, PipelineMesh):
        if mesh.num_ranks != 1:
            raise ConfigError(
                f"multi-process baton.jit: each process is one rank, so mesh must be its own "
                f"devices (None, a device list, or PipelineMesh(devices, ranks=1)); got "
                f"{mesh.num_ranks} ranks")
        return list(mesh.rank_devices[0])
    return list(mesh)


def process_mesh(devices: Any, world_size: int):
    """A PipelineMesh of ``world_size`` ranks in which every rank is this process's
    devices (a process only ever places values for its own rank): ``devices`` a list (one
    ``"data"`` axis) or a ``jax.sharding.Mesh`` (its named axes)."""
    from jax.sharding import Mesh

    from .mesh import BATCH_AXES, DATA_AXIS, PipelineMesh

    m = PipelineMesh.__new__(PipelineMesh)
    mesh = devices if isinstance(devices, Mesh) else Mesh(np.array(list(devices)),
                                                          (DATA_AXIS,))
    m.rank_devices = [list(mesh.devices.flat)] * world_size
    m.meshes = [mesh] * world_size
    m.axis = "pipe"
    m.batch_axes = tuple(n for n in mesh.axis_names if n in BATCH_AXES)
    return m


def _host(x) -> np.ndarray:
    return np.asarray(x, order="C")  # (ascontiguousarray would make a 0-d array 1-d)


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
        per process): the rendezvous store's exchange polls files and took 5-15 ms per call,
        every step."""
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

    def need(self, keys: Sequence[Any], rank: int, vals: dict, where: dict) -> None:
        """Makes every value of ``keys`` present on ``rank`` (sent by its lowest holder)."""
        me = self.g.rank
        t = self.g.transport
        recvs = []
        for k in keys:
            hold = where.get(k)
            if not hold:
                raise ConfigError(
                    f"rank {rank} needs a value (id {k}) that no process holds: pass the full "
                    f"value (or the Remote placeholder its owner returned) in every process")
            if rank in hold:
                continue
            src = min(hold)
            tag = self._tag()
            if me == src:
                self.sends.append(t.isend(rank, tag, [_host(vals[k])]))
            elif me == rank:
                recvs.append((k, t.irecv(src, tag)))
            hold.add(rank)
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
    return jax.tree.unflatten(treedef, [np.asarray(vals[k]) for k in keys])
