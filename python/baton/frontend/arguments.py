"""A step's arguments as Baton reads them: which step inputs are donated
(``donated_inputs``), each flat argument's ``PartitionSpec`` on the ranks' sub-meshes
(``input_specs``), and the compile cache's key per leaf (``leaf_key``)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ..errors import ConfigError


def donated_inputs(args, traced, donate_argnums) -> frozenset:
    """The step input values of the arguments ``donate_argnums`` names."""
    if not donate_argnums:
        return frozenset()
    bad = [i for i in donate_argnums if i >= len(args)]
    if bad:
        raise ConfigError(f"baton.jit: donate_argnums names argument {bad[0]} but the step "
                          f"was called with {len(args)} arguments")
    out, pos = set(), 0
    for i, a in enumerate(args):
        n = len(jax.tree.leaves(a))
        if i in donate_argnums:
            out.update(traced.step_inputs[pos:pos + n])
        pos += n
    return frozenset(out)

def input_specs(mesh, param_shardings, args) -> list:
    """Per flat argument, its ``PartitionSpec`` on the ranks' sub-meshes, or None
    (replicated): from ``param_shardings`` (for the first argument, and for every
    sub-tree of the other arguments with the first argument's structure: optax's ``mu``,
    ``nu``, ...), else from the argument's own ``NamedSharding``. Raises ``ConfigError``
    naming the argument path for a spec that names an axis the mesh lacks or does not
    divide the value's shape."""
    leaves = jax.tree_util.tree_flatten_with_path(args)[0]
    specs: dict[int, Any] = {}
    if param_shardings is not None:
        ptree = jax.tree.structure(args[0])
        try:
            pspecs = ptree.flatten_up_to(param_shardings)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"baton.jit: param_shardings does not match the structure of "
                              f"the first argument (the parameters): {e}") from None
        # every sub-tree (of any argument) with the parameters' structure takes their specs

        def is_params(y):
            return ptree.num_leaves > 1 and jax.tree.structure(y) == ptree

        pos = 0
        for part in jax.tree.leaves(args, is_leaf=is_params):
            n = len(jax.tree.leaves(part))
            if is_params(part) or (pos == 0 and n == ptree.num_leaves):
                for j, sp in enumerate(pspecs):
                    specs[pos + j] = sp
            pos += n
    out = []
    for i, (path, x) in enumerate(leaves):
        where = f"baton.jit: argument {jax.tree_util.keystr(path)}"
        sp = specs.get(i)
        if sp is None:
            sh = getattr(x, "sharding", None)
            if isinstance(sh, NamedSharding) and sh.spec:
                sp = sh
        if sp is None:
            out.append(None)
            continue
        spec = mesh.spec_on_ranks(sp, where)
        mesh.check_spec(spec, np.shape(x), where)
        out.append(spec if spec else None)
    return out


def leaf_key(x) -> tuple:
    """(shape, dtype) of an argument leaf for the compile cache; cheap for arrays (a step has
    hundreds of leaves, and np.shape and str(dtype) are slow per leaf)."""
    dt = getattr(x, "dtype", None)
    shape = getattr(x, "shape", None)
    if isinstance(dt, np.dtype) and shape is not None:
        return (tuple(shape), dt)
    return (np.shape(x), _dtype_name(x))


def _dtype_name(x) -> str:
    dt = getattr(x, "dtype", None)  # arrays, Remote, ShapeDtypeStruct: no dispatch
    if dt is not None and not isinstance(x, (int, float, complex, bool)):
        return str(dt)  # also extended dtypes (typed PRNG keys: key<fry>), which numpy lacks
    return str(jax.numpy.result_type(x))  # Python scalars: JAX's weak type rules
