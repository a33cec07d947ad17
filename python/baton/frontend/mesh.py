"""``PipelineMesh``: pipeline ranks, each a group of devices running its tasks SPMD."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..errors import ConfigError

DATA_AXIS = "data"


class PipelineMesh:
    """Devices split into ``ranks`` pipeline ranks of equal size.

    ``PipelineMesh(jax.devices()[:8], ranks=4)``: rank r owns devices
    ``[2r, 2r+1]`` and runs its stages' tasks data-parallel over them (the
    microbatch is sharded along its leading axis, parameters are replicated).
    ``PipelineMesh(mesh)`` with a ``jax.sharding.Mesh`` that has a ``'pipe'``
    axis: rank r is the sub-mesh at index r of that axis (its other axes are
    flattened into one data axis).
    """

    def __init__(self, devices: Any = None, ranks: int | None = None, axis: str = "pipe"):
        if isinstance(devices, Mesh):
            mesh = devices
            if axis not in mesh.axis_names:
                raise ConfigError(f"PipelineMesh: the mesh has no {axis!r} axis {mesh.axis_names}")
            arr = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), 0)
            groups = [list(arr[r].reshape(-1)) for r in range(arr.shape[0])]
            if ranks is not None and ranks != len(groups):
                raise ConfigError(
                    f"PipelineMesh: ranks={ranks} but the {axis!r} axis has {len(groups)}"
                )
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
        if len({d for g in groups for d in g}) != sum(len(g) for g in groups):
            raise ConfigError("PipelineMesh: a device appears in two ranks")
        self.rank_devices: list[list[Any]] = groups
        self.meshes = [Mesh(np.array(g), (DATA_AXIS,)) for g in groups]

    @property
    def num_ranks(self) -> int:
        return len(self.rank_devices)

    def devices_per_rank(self) -> int:
        return len(self.rank_devices[0])

    def replicated(self, rank: int) -> NamedSharding:
        cache = self.__dict__.setdefault("_replicated", {})  # one object per rank: cheap checks
        mesh = self.meshes[rank]
        got = cache.get(rank)
        if got is None or got[0] is not mesh:
            got = cache[rank] = (mesh, NamedSharding(mesh, PartitionSpec()))
        return got[1]

    def batch_sharded(self, rank: int, shape: Sequence[int]) -> NamedSharding:
        n = len(self.rank_devices[rank])
        if n > 1 and len(shape) >= 1 and shape[0] % n == 0:
            return NamedSharding(self.meshes[rank], PartitionSpec(DATA_AXIS))
        return self.replicated(rank)

    def like(self, rank: int, x: Any) -> NamedSharding:
        """The sharding on ``rank`` that mirrors ``x``'s layout (batch-split or replicated)."""
        sh = getattr(x, "sharding", None)
        spec = getattr(sh, "spec", None)
        if spec is not None and len(spec) >= 1 and spec[0] == DATA_AXIS:
            return self.batch_sharded(rank, x.shape)
        return self.replicated(rank)

    def key(self) -> tuple:
        return tuple(tuple(d.id for d in g) for g in self.rank_devices)

    def __repr__(self) -> str:
        return f"PipelineMesh(ranks={self.num_ranks}, devices_per_rank={self.devices_per_rank()})"
