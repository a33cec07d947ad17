"""``PipelineMesh``: pipeline ranks, each a group of devices running its tasks SPMD."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .errors import ConfigError

DATA_AXIS = "data"
# Axes that split the batch (data parallelism inside a rank) when the mesh has them; every
# other axis (e.g. "tensor") holds a replica of each microbatch.
BATCH_AXES = ("data", "fsdp", "expert")


class PipelineMesh:
    """Devices split into pipeline ranks, each a sub-mesh that runs its stages' tasks SPMD.

    ``PipelineMesh(mesh, axis="pipe")`` with a ``jax.sharding.Mesh`` that has a ``"pipe"`` axis
    and any other named axes (e.g. ``("pipe", "data", "fsdp", "tensor", "expert")``): rank r
    is the sub-mesh at index r of the pipe axis, keeping the other axes and their names, so
    ``PartitionSpec``s, ``with_sharding_constraint`` and ``shard_map`` inside the model name
    the same axes on every rank. The batch is split over ``batch_axes`` (default: those of
    ``data``, ``fsdp`` and ``expert`` the mesh has); parameters take the shardings the user
    gives (``baton.jit(param_shardings=...)`` or the arrays' own), replicated otherwise.

    ``PipelineMesh(jax.devices()[:8], ranks=4)``, the shorthand for pipe x data: rank r owns
    devices ``[2r, 2r+1]`` as a one-axis ``"data"`` sub-mesh.
    """

    # multi-process mode (distributed.process_mesh): the ranks each process runs (k), and per
    # rank the processes that hold its devices (one, process r // k; or, when ranks span
    # processes, every process of the rank's sub-mesh: distributed.spanning_layout)
    ranks_per_process: int | None = None
    rank_procs: list | None = None

    def __init__(self, devices: Any = None, ranks: int | None = None, axis: str = "pipe",
                 batch_axes: Sequence[str] | None = None):
        self.axis = axis
        if isinstance(devices, Mesh):
            mesh = devices
            if axis not in mesh.axis_names:
                raise ConfigError(f"PipelineMesh: the mesh has no {axis!r} axis {mesh.axis_names}")
            k = mesh.axis_names.index(axis)
            arr = np.moveaxis(mesh.devices, k, 0)
            names = tuple(n for n in mesh.axis_names if n != axis)
            if ranks is not None and ranks != arr.shape[0]:
                raise ConfigError(
                    f"PipelineMesh: ranks={ranks} but the {axis!r} axis has {arr.shape[0]}"
                )
            if names:
                types = tuple(t for n, t in zip(mesh.axis_names, mesh.axis_types) if n != axis)
                self.meshes = [Mesh(arr[r], names, axis_types=types)
                               for r in range(arr.shape[0])]
            else:
                # (a mesh of the pipe axis alone: arr is 1-D, each rank one device)
                self.meshes = [Mesh(arr[r:r + 1], (DATA_AXIS,)) for r in range(arr.shape[0])]
            groups = [list(np.asarray(arr[r:r + 1]).reshape(-1)) if arr.ndim == 1
                      else list(arr[r].reshape(-1)) for r in range(arr.shape[0])]
        else:
            devs = list(jax.devices() if devices is None else devices)
            if ranks is None:
                ranks = len(devs)
            if not isinstance(ranks, int) or ranks < 1:
                raise ConfigError(f"PipelineMesh: ranks must be a positive integer (got {ranks!r})")
            if len(devs) % ranks:
                raise ConfigError(
                    f"PipelineMesh: {len(devs)} devices cannot be split into {ranks} equal ranks"
                )
            k = len(devs) // ranks
            groups = [devs[r * k : (r + 1) * k] for r in range(ranks)]
            self.meshes = [Mesh(np.array(g), (DATA_AXIS,)) for g in groups]
        if len({d for g in groups for d in g}) != sum(len(g) for g in groups):
            raise ConfigError("PipelineMesh: a device appears in two ranks")
        self.rank_devices: list[list[Any]] = groups
        names = self.meshes[0].axis_names
        if batch_axes is None:
            batch_axes = tuple(n for n in names if n in BATCH_AXES)
        for n in batch_axes:
            if n not in names:
                raise ConfigError(f"PipelineMesh: batch axis {n!r} is not an axis of the ranks' "
                                  f"sub-meshes {names}")
        self.batch_axes = tuple(batch_axes)

    @property
    def num_ranks(self) -> int:
        return len(self.rank_devices)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The axes of every rank's sub-mesh (the pipe axis removed)."""
        return tuple(self.meshes[0].axis_names)

    def procs(self, rank: int) -> list[int]:
        """The processes that hold ``rank`` (multi-process mode)."""
        return self.rank_procs[rank]

    def ranks_of(self, process: int) -> list[int]:
        """The ranks process ``process`` runs (multi-process mode)."""
        return [r for r, ps in enumerate(self.rank_procs) if process in ps]

    @property
    def spans(self) -> bool:
        """Some rank's sub-mesh spans several processes (multi-process mode)."""
        return bool(self.rank_procs) and any(len(ps) > 1 for ps in self.rank_procs)

    def axis_size(self, name: str) -> int:
        return int(self.meshes[0].shape[name])

    def devices_per_rank(self) -> int:
        return len(self.rank_devices[0])

    def replicated(self, rank: int) -> NamedSharding:
        cache = self.__dict__.setdefault("_replicated", {})  # one object per rank: cheap checks
        mesh = self.meshes[rank]
        got = cache.get(rank)
        if got is None or got[0] is not mesh:
            got = cache[rank] = (mesh, NamedSharding(mesh, PartitionSpec()))
        return got[1]

    def batch_spec(self, shape: Sequence[int]) -> PartitionSpec:
        """The spec of a batch-leading array: dimension 0 over the batch axes when it
        divides, else replicated."""
        n = int(np.prod([self.axis_size(a) for a in self.batch_axes], dtype=np.int64))
        if n > 1 and len(shape) >= 1 and shape[0] % n == 0:
            axes = self.batch_axes
            return PartitionSpec(axes[0] if len(axes) == 1 else axes)
        return PartitionSpec()

    def batch_sharded(self, rank: int, shape: Sequence[int]) -> NamedSharding:
        spec = self.batch_spec(shape)
        return NamedSharding(self.meshes[rank], spec) if spec else self.replicated(rank)

    def spec_on_ranks(self, spec: Any, where: str = "") -> PartitionSpec:
        """``spec`` (a ``PartitionSpec``, or a ``NamedSharding`` over the full mesh or a
        sub-mesh) as a spec of the ranks' sub-meshes: the pipe axis dropped. An axis the
        sub-meshes do not have raises ``ConfigError`` naming ``where`` and the axis."""
        if isinstance(spec, NamedSharding):
            spec = spec.spec
        if spec is None:
            return PartitionSpec()
        if not isinstance(spec, PartitionSpec):
            raise ConfigError(f"{where}: expected a PartitionSpec or NamedSharding, got "
                              f"{type(spec).__name__}")
        out = []
        for entry in spec:
            names = entry if isinstance(entry, tuple) else (entry,)
            keep = []
            for n in names:
                if n is None or n == self.axis:
                    continue
                if n not in self.axis_names:
                    raise ConfigError(f"{where}: sharding {spec} names axis {n!r}, which the "
                                      f"ranks' sub-meshes {self.axis_names} do not have")
                keep.append(n)
            out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
        while out and out[-1] is None:
            out.pop()
        return PartitionSpec(*out)

    def check_spec(self, spec: PartitionSpec, shape: Sequence[int], where: str = "") -> None:
        """Raises ``ConfigError`` naming ``where`` when ``spec`` does not fit ``shape``."""
        if len(spec) > len(shape):
            raise ConfigError(f"{where}: sharding {spec} has {len(spec)} entries but the value "
                              f"has shape {tuple(shape)}")
        for dim, entry in enumerate(spec):
            if entry is None:
                continue
            names = entry if isinstance(entry, tuple) else (entry,)
            n = int(np.prod([self.axis_size(a) for a in names], dtype=np.int64))
            if shape[dim] % n:
                raise ConfigError(f"{where}: dimension {dim} of shape {tuple(shape)} is not "
                                  f"divisible by the size {n} of axis "
                                  f"{'x'.join(names)} (sharding {spec})")

    def sharding(self, rank: int, spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(self.meshes[rank], spec) if spec else self.replicated(rank)

    def like(self, rank: int, x: Any) -> NamedSharding:
        """The sharding on ``rank`` that mirrors ``x``'s layout (its spec on this rank's
        sub-mesh; replicated when ``x`` has none)."""
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        if not spec:
            return self.replicated(rank)
        try:
            return self.sharding(rank, self.spec_on_ranks(spec))
        except ConfigError:
            return self.replicated(rank)

    def key(self) -> tuple:
        return (tuple(tuple(d.id for d in g) for g in self.rank_devices), self.axis_names,
                self.batch_axes)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={self.axis_size(n)}" for n in self.axis_names)
        return f"PipelineMesh(ranks={self.num_ranks}, {axes})"
