"""What the model names of the device mesh, moved onto one rank's sub-mesh.

A model traced for the whole mesh names devices in three places: the shardings of
``with_sharding_constraint`` (and of the other primitives that carry an output sharding),
the mesh and specs of ``shard_map``, and each equation's context mesh (the mesh of
``jax.set_mesh`` / ``jax.sharding.use_mesh`` around the step, or the manual mesh inside a
``shard_map`` body, which a primitive checks against its operands' types). A rank runs its
tasks on its own sub-mesh (``PipelineMesh.meshes[rank]``), so each of these is rewritten
onto it (``OnRank``):

* a mesh with the pipe axis (the user's full mesh), or without it (a mesh shaped like a
  rank's sub-mesh: any rank's devices, or abstract), becomes the rank's sub-mesh with the
  same axis types per axis (``Manual`` inside a ``shard_map`` body stays ``Manual``), in the
  mesh's own axis order, abstract or concrete as it was; the mesh of a sharding constraint
  and of a ``shard_map`` is made concrete (the rank's programs run outside the caller's
  mesh context, which names the devices of an abstract one);
* the types of the variables of nested jaxprs (a ``shard_map`` body, a jit callee, a scan
  body) and the host constants among their operands carry a sharding whose mesh is moved
  the same way (a jit callee's output types are its call's);
* a ``PartitionSpec`` drops the pipe axis (``PipelineMesh.spec_on_ranks``);
* ``shard_map``'s manual-axes sets drop the pipe axis.

On a rank of one device a sharding constraint in the device's own memory, without a layout,
is the identity: it is removed (``OnRank.drop``), so the rank's tasks name no device there
and equal ranks' tasks are equal jaxprs (``share_match``), which one program over their
devices can run (``shared.py``: a constraint on one rank's device could not be traced there).

A mesh whose other axes differ from the sub-mesh's in names or sizes raises ``ConfigError``
naming the primitive and both meshes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from .. import _jax_compat as jc
from ..errors import ConfigError

# shard_map's parameters that name its manual axes (by JAX version)
_MANUAL_SETS = ("newly_manual_axes", "manual_axes", "auto", "axis_names")


class OnRank:
    """The rewrite of equations onto rank ``rank``'s sub-mesh of ``mesh`` (a
    ``PipelineMesh``), as the fixes ``_jax_compat.map_eqn_params`` takes: ``params(name,
    params)``, ``ctx(ctx)`` (an equation's context), ``value(x)`` (a literal's value) and
    ``aval(aval)`` (a variable's type)."""

    def __init__(self, mesh, rank: int):
        self.pm = mesh
        self.rank = rank
        self.sub = mesh.meshes[rank]
        self.axis = mesh.axis
        self._meshes: dict[Any, Any] = {}
        # the memory a one-device rank's constraint may name and stay an identity: the
        # device's default (as JAX names it for a sharding that names none)
        self._own_memory = ((None, NamedSharding(self.sub, PartitionSpec()).memory_kind)
                            if self.sub.devices.size == 1 else None)

    # -- meshes ---------------------------------------------------------------------------
    def mesh(self, m: Any, where: str) -> Any:
        """``m`` (a ``Mesh`` or ``AbstractMesh``) on this rank's sub-mesh (see the module)."""
        if not m.axis_names:
            return m  # the empty mesh: no mesh context
        got = self._meshes.get(m)
        if got is None:
            got = self._meshes[m] = self._map_mesh(m, where)
        return got

    def _map_mesh(self, m: Any, where: str) -> Any:
        sub = self.sub
        names = tuple(n for n in m.axis_names if n != self.axis)
        sizes = dict(zip(m.axis_names, m.axis_sizes))
        if set(names) != set(sub.axis_names) or any(sizes[n] != sub.shape[n] for n in names):
            shape = ", ".join(f"{n}={sizes[n]}" for n in m.axis_names)
            own = ", ".join(f"{n}={sub.shape[n]}" for n in sub.axis_names)
            raise ConfigError(
                f"{where}: mesh ({shape}) is neither the pipeline's mesh nor one shaped like a "
                f"rank's sub-mesh: rank {self.rank}'s sub-mesh is ({own}) (the {self.axis!r} "
                f"axis dropped); build the model's meshes from the mesh given to PipelineMesh")
        types = dict(zip(m.axis_names, m.axis_types))
        order = [sub.axis_names.index(n) for n in names]
        conc = Mesh(np.transpose(sub.devices, order), names,
                    axis_types=tuple(types[n] for n in names))
        return conc.abstract_mesh if isinstance(m, AbstractMesh) else conc

    def concrete(self, m: Any, where: str) -> Any:
        """``m`` on this rank's sub-mesh with its devices (an abstract mesh made concrete:
        the rank's program is compiled without the user's mesh context)."""
        out = self.mesh(m, where)
        if isinstance(out, AbstractMesh) and out.axis_names:
            names = out.axis_names
            order = [self.sub.axis_names.index(n) for n in names]
            out = Mesh(np.transpose(self.sub.devices, order), names, axis_types=out.axis_types)
        return out

    def sharding(self, sh: NamedSharding, where: str, concrete: bool = False) -> NamedSharding:
        """``sh`` on this rank's sub-mesh, its mesh abstract or concrete as it was
        (``concrete``: made concrete)."""
        mesh = self.concrete(sh.mesh, where) if concrete else self.mesh(sh.mesh, where)
        spec = self.pm.spec_on_ranks(sh.spec, where)
        if mesh is sh.mesh and spec == sh.spec:
            return sh
        return NamedSharding(mesh, spec, memory_kind=sh.memory_kind)

    def _type_sharding(self, sh: NamedSharding) -> NamedSharding:
        """The sharding a type (abstract value) carries, on this rank's sub-mesh."""
        return self.sharding(sh, "a value's type")

    def value(self, x: Any) -> Any:
        """A literal's value whose type names a mesh (``_jax_compat.value_with_sharding``) on
        this rank's sub-mesh."""
        return jc.value_with_sharding(x, self._type_sharding)

    def aval(self, aval: Any) -> Any:
        """A variable's type whose sharding names a mesh, on this rank's sub-mesh."""
        sh = getattr(aval, "sharding", None)
        if not isinstance(sh, NamedSharding) or not sh.mesh.axis_names:
            return aval
        new = self._type_sharding(sh)
        return aval if new is sh else aval.update(sharding=new)

    # -- equations ------------------------------------------------------------------------
    def _value(self, v: Any, where: str) -> Any:
        if isinstance(v, NamedSharding):
            return self.sharding(v, where)
        if isinstance(v, (Mesh, AbstractMesh)):
            return self.mesh(v, where)
        if isinstance(v, tuple) and not isinstance(v, PartitionSpec) and v and any(
                isinstance(x, (NamedSharding, Mesh, AbstractMesh)) for x in v):
            return tuple(self._value(x, where) for x in v)
        return v

    def params(self, name: str, params: dict) -> dict:
        """``params`` of a ``name`` equation on this rank's sub-mesh."""
        where = "with_sharding_constraint" if name == "sharding_constraint" else name
        new = {}
        for k, v in params.items():
            nv = self._value(v, where)
            if nv is not v:
                new[k] = nv
        # the mesh of a constraint and of a shard_map made concrete: the rank's programs are
        # compiled outside the caller's mesh context (jax.set_mesh), whose devices these
        # name when abstract
        if name == "sharding_constraint" and isinstance(params.get("sharding"), NamedSharding):
            new["sharding"] = self.sharding(params["sharding"], where, concrete=True)
        if name == "shard_map":
            m = params.get("mesh")
            if isinstance(m, (Mesh, AbstractMesh)) and m.axis_names:
                new["mesh"] = self.concrete(m, where)
            for k in ("in_specs", "out_specs"):
                if k in params:
                    new[k] = tuple(self.pm.spec_on_ranks(sp, where) for sp in params[k])
            for k in _MANUAL_SETS:
                if isinstance(params.get(k), frozenset):
                    new[k] = frozenset(a for a in params[k] if a != self.axis)
        return dict(params, **new) if new else params

    def drop(self, name: str, params: dict) -> bool:
        """Whether an equation (its parameters already on this rank) is removed as the
        identity: a sharding constraint on a rank of one device, onto a ``NamedSharding`` in
        the device's default memory, without a layout. (A constraint into another memory,
        or with a layout, moves or lays out its value: kept.)"""
        if name != "sharding_constraint" or self._own_memory is None:
            return False
        sh = params.get("sharding")
        return (isinstance(sh, NamedSharding) and sh.memory_kind in self._own_memory
                and params.get("layout") is None)

    def ctx(self, ctx: Any) -> Any:
        """An equation's context with its mesh on this rank's sub-mesh (abstract)."""
        m = jc.eqn_ctx_mesh(ctx)
        if m is None or not m.axis_names:
            return ctx
        return jc.eqn_ctx_with_mesh(ctx, self.mesh(m, "the mesh context (jax.set_mesh)"))


def check_axis_types(mesh) -> None:
    """Raises ``ConfigError`` when the pipeline's mesh or the caller's mesh context
    (``jax.set_mesh``) has ``Explicit`` axes: their shardings are part of every value's type
    (explicit sharding mode), which the microbatch split and the stage boundaries do not carry
    yet. ``Auto`` axes (the default), sharding constraints and ``shard_map`` work."""
    explicit = jc.explicit_axis_type()
    if explicit is None:
        return
    for what, m in (("the mesh given to PipelineMesh", mesh.meshes[0]),
                     ("the mesh context (jax.set_mesh)", jc.context_mesh())):
        axes = [n for n, t in zip(getattr(m, "axis_names", ()), getattr(m, "axis_types", ()))
                if t == explicit]
        if axes:
            raise ConfigError(
                f"baton.jit: {what} has Explicit axes {axes}: a pipelined step supports Auto "
                f"axes (jax.sharding.AxisType.Auto, the default), with with_sharding_constraint "
                f"and shard_map inside the stages, not explicit sharding mode")


def on_rank(mesh, rank: int) -> OnRank:
    """The rewrite of the model's equations onto ``rank``'s sub-mesh of ``mesh``."""
    return OnRank(mesh, rank)
