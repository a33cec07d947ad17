"""``baton.checkpoint.restore`` and ``metadata``: a committed checkpoint read back, matched
path by path against a target (a step's arguments, a pytree, or the saved paths themselves)
and placed where the target wants each array."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from .. import _jax_compat as jc
from ..errors import ConfigError
from ..running.distributed import Remote
from .commit import wait_until_finished
from .layout import (FORMAT, METADATA, _data_name, _item_name, _step_dir, all_steps, committed,
                     latest_step)
from .leaves import (FlatState, _as_args, _check_state_tree, _compiled, _dtype_str, _flatten,
                     _input_stages, _wrap)
from .store import _ocp, _reader


def metadata(path, step: int | None = None) -> dict:
    """The metadata of a committed checkpoint (``baton.json``): ``plan`` (fingerprint,
    schedule, ranks, stages, ``stage_rank``), ``tree``, ``leaves`` (path, dtype, shape,
    stages, rank, process, key of every leaf) and ``stage_map`` (stage -> leaf paths)."""
    step = _committed_step(path, step, finish=False)
    with open(os.path.join(_step_dir(path, step), METADATA)) as f:
        return json.load(f)


def _committed_step(path, step, finish: bool = True):
    if finish:  # this process's saves in flight first (collective in multi-process mode)
        wait_until_finished()
    if step is None:
        step = latest_step(path)
        if step is None:
            raise ConfigError(f"baton.checkpoint: no committed checkpoint under {path}")
        return step
    d = _step_dir(path, step)
    if not os.path.isdir(d):
        raise ConfigError(f"baton.checkpoint: no checkpoint of step {step} under {path} "
                          f"(committed steps: {all_steps(path)})")
    if not committed(path, step):
        raise ConfigError(f"baton.checkpoint: step {step} under {path} was not committed (its "
                          f"save did not finish); committed steps: {all_steps(path)}")
    return int(step)


def _unflatten_keys(keys_list, values):
    """A nested structure from the saved key paths: lists for sequence keys, dicts for dict
    keys and attributes (a namedtuple comes back as a dict of its fields)."""
    def build(entries):
        if len(entries) == 1 and not entries[0][0]:
            return entries[0][1]
        kind = entries[0][0][0][0]
        groups: dict = {}
        for keys, v in entries:
            k = keys[0][1]
            groups.setdefault(tuple(k) if isinstance(k, list) else k, []).append((keys[1:], v))
        children = {k: build(g) for k, g in groups.items()}
        if kind in ("seq", "index"):
            return [children[k] for k in sorted(children)]
        return children

    return build(list(zip(keys_list, values)))


def _read_metadata(d: str) -> dict:
    with open(os.path.join(d, METADATA)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ConfigError(f"baton.checkpoint.restore: {d} has format {meta.get('format')!r}, "
                          f"expected {FORMAT!r}")
    return meta


def _target(target, fn, meta: dict):
    """(the target's leading arguments, wrapped?, flattened): ``target``, or the step's leading
    arguments as many as were saved (leaves None: the step's traced shapes are the target)."""
    if target is not None:
        args, wrapped = _as_args(target)
        return args, wrapped, _flatten(args, wrapped)
    parts = fn._tree.children()[: meta["tree"]["parts"]]
    args = tuple(jax.tree.unflatten(t, [0] * t.num_leaves) for t in parts)
    wrapped = meta["tree"]["wrapped"]
    flat = _flatten(args, wrapped)
    flat.leaves = [None] * flat.treedef.num_leaves
    return args, wrapped, flat


def _check_target(saved: dict, flat: FlatState, cs, step: int, path) -> None:
    """Every target path is in the checkpoint with its shape and dtype, and no saved path is
    left over; raises ConfigError naming the first that is not."""
    names = flat.names
    for i, n in enumerate(names):
        m = saved.get(n)
        if m is None:
            near = [p for p, x in saved.items() if x["keys"][:-1] == flat.keys[i][:-1]][:4]
            raise ConfigError(f"baton.checkpoint.restore: {n} of the target model is not in the "
                              f"checkpoint of step {step} under {path}"
                              + (f" (it has e.g. {', '.join(near)})" if near else ""))
        t = flat.leaves[i]
        if t is None and cs is not None:  # the step's own arguments: its traced shapes
            t = cs.traced.avals[cs.traced.step_inputs[i]]
        if t is not None:
            shape = tuple(t.shape) if hasattr(t, "shape") else tuple(np.shape(t))
            dtype = _dtype_str(t)
            if shape != tuple(m["shape"]) or dtype != m["dtype"]:
                raise ConfigError(f"baton.checkpoint.restore: {n} is {m['dtype']}{m['shape']} in "
                                  f"the checkpoint but {dtype}{list(shape)} in the target model")
    extra = sorted(set(saved) - set(names))
    if extra:
        raise ConfigError(f"baton.checkpoint.restore: the checkpoint of step {step} has {extra[0]}"
                          f" ({len(extra)} leaves in all) that the target model does not have")


def _restore_plain(d: str, ms: list[dict], flat: FlatState, wrapped: bool):
    """Plain JAX: each array with the sharding of its target leaf, else on the default
    device."""
    dev = jc.one_device_sharding(jax.devices()[0])
    shardings = []
    for t in flat.leaves:
        sh = getattr(t, "sharding", None)
        shardings.append(sh if isinstance(sh, jax.sharding.Sharding) else dev)
    vals = _read(d, ms, shardings)
    return _wrap(jax.tree.unflatten(flat.treedef, vals), wrapped)


def _restore_placed(d: str, ms: list[dict], cs, fn, flat: FlatState, wrapped: bool,
                    same_stages: bool):
    """Each array placed for the step (its first stage's rank, the step's sharding); in
    multi-process mode a ``baton.Remote`` for an array no rank of this process reads."""
    in_stages = _input_stages(cs)
    mine = set(fn.ranks) if fn.multi else None  # the ranks this process runs
    todo, shardings, out = [], [], [None] * len(ms)
    for i, m in enumerate(ms):
        v = cs.traced.step_inputs[i]
        st = in_stages[v]
        if same_stages and st != m["stages"]:
            raise ConfigError(f"baton.checkpoint.restore: the stage map does not match: {m['path']}"
                              f" was saved from stage(s) {m['stages']} but the target step reads"
                              f" it on stage(s) {st} (same_stages=True)")
        ranks = sorted({cs.stage_rank[s] for s in st}) or [0]
        owner = cs.stage_rank[st[0]] if st else 0
        if mine is None:
            todo.append(i)
            shardings.append(cs.sharding(v, owner))
        elif mine.intersection(ranks):
            todo.append(i)
            shardings.append(cs.sharding(v, owner if owner in mine
                                         else min(mine.intersection(ranks))))
        else:
            out[i] = Remote(tuple(m["shape"]), np.dtype(m["dtype"]), owner)
    for i, x in zip(todo, _read(d, [ms[i] for i in todo], shardings)):
        out[i] = x
    return _wrap(jax.tree.unflatten(flat.treedef, out), wrapped)


def restore(path, step: int | None = None, *, target: Any = None, fn: Any = None,
            same_stages: bool = False) -> Any:
    """Reads a committed checkpoint (``step`` None: the latest).

    With ``fn`` (a ``baton.jit`` step, called or compiled once; any number of ranks, any
    schedule): the state with the structure of ``target`` (default: the step's leading
    arguments, as many as were saved), each array found by its path and placed where the
    step wants it (its stage's rank, in the step's sharding). In multi-process mode a process
    reads only the arrays its ranks' stages use; the others come back as ``baton.Remote``
    placeholders. ``same_stages``: also require every array to be on the stage it was saved
    from. Without ``fn``: plain JAX, every array on the default device, in the structure of
    ``target`` (arrays or ``jax.ShapeDtypeStruct``s; their shardings are kept), or, with no
    ``target``, nested dicts and lists built from the saved paths. A path, shape or dtype that
    does not match raises ``ConfigError`` naming the path.
    """
    step = _committed_step(path, step)
    d = _step_dir(path, step)
    meta = _read_metadata(d)
    saved = {m["path"]: m for m in meta["leaves"]}
    if target is None and fn is None:
        dev = jc.one_device_sharding(jax.devices()[0])
        ms = meta["leaves"]
        vals = _read(d, ms, [dev] * len(ms))
        return _unflatten_keys([m["keys"] for m in ms], vals)
    cs = _compiled(fn, "restore") if fn is not None else None
    args, wrapped, flat = _target(target, fn, meta)
    if fn is not None:
        _check_state_tree(fn, args, "restore")
    _check_target(saved, flat, cs, step, path)
    ms = [saved[n] for n in flat.names]
    if cs is None:
        return _restore_plain(d, ms, flat, wrapped)
    return _restore_placed(d, ms, cs, fn, flat, wrapped, same_stages)


def _read(d: str, ms: list[dict], shardings: list) -> list:
    """The arrays of leaf metadata ``ms`` (from any process's item), each restored with its
    sharding (one partial Orbax restore per item)."""
    ocp = _ocp()
    by_item: dict[str, list[int]] = {}
    for j, m in enumerate(ms):
        by_item.setdefault(_item_name(m["process"]), []).append(j)
    out = [None] * len(ms)
    ck = _reader()
    for name, js in by_item.items():
        item: dict[str, dict] = {}
        rargs: dict[str, dict] = {}
        for j in js:
            m = ms[j]
            r = f"rank{m['rank']}"
            sh = shardings[j]
            if not sh.is_fully_addressable:  # (read here, then placed by every process)
                sh = jc.one_device_sharding(jax.local_devices()[0])
            item.setdefault(r, {})[m["key"]] = jax.ShapeDtypeStruct(
                tuple(m["shape"]), np.dtype(m["dtype"]), sharding=sh)
            rargs.setdefault(r, {})[m["key"]] = ocp.ArrayRestoreArgs(
                sharding=sh, global_shape=tuple(m["shape"]), dtype=np.dtype(m["dtype"]))
        where = os.path.join(d, name)
        if not os.path.isdir(where):
            raise ConfigError(f"baton.checkpoint.restore: {where} is missing (it holds "
                              f"{ms[js[0]]['path']})")
        got = ck.restore(where, args=ocp.args.PyTreeRestore(item=item, restore_args=rargs,
                                                             partial_restore=True))
        for j in js:
            m = ms[j]
            x = got[f"rank{m['rank']}"][m["key"]]
            if not shardings[j].is_fully_addressable:
                # a rank spanning processes: each of its processes gives the whole value and
                # places its own shards
                x = jax.device_put(np.asarray(x), shardings[j])
            out[j] = x
    return out


def _this_process(fn) -> tuple[int, int]:
    """(this process, the number of processes) of ``fn``'s step (0 of 1 without one, or in
    one process)."""
    if fn is None or not getattr(fn, "multi", False):
        return 0, 1
    g = fn._connect()
    return g.rank, g.world_size


def restore_data(path, step: int | None = None, *, fn: Any = None) -> Any:
    """This process's data-iterator state saved with ``save(..., data=...)`` at ``step``
    (None: the latest committed), to pass to the iterator's ``set_state``; None where this
    process saved none (it reads no data). ``fn``: the step, which tells this process's index
    and the number of processes. Onto another number of processes, the state is taken when
    every process that saved one saved the same (one shared pipeline); states that differ
    raise ``ConfigError`` (they cannot be mapped onto other processes), as does a checkpoint
    saved without data."""
    step = _committed_step(path, step)
    d = _step_dir(path, step)
    meta = _read_metadata(d)
    saved = meta.get("data_processes") or []
    if not saved:
        raise ConfigError(f"baton.checkpoint.restore_data: the checkpoint of step {step} under "
                          f"{path} has no data-iterator state (saved without data=...)")
    me, world = _this_process(fn)

    def load(p):
        with open(os.path.join(d, _data_name(p))) as f:
            return json.load(f)["state"]

    if world == meta["processes"]:
        return load(me) if me in saved else None
    states = {p: load(p) for p in saved}
    if len({json.dumps(s, sort_keys=True) for s in states.values()}) == 1:
        return next(iter(states.values()))
    raise ConfigError(
        f"baton.checkpoint.restore_data: the checkpoint of step {step} under {path} was saved "
        f"by {meta['processes']} processes whose data states differ (processes {saved}); this "
        f"run has {world} processes, onto which they cannot be mapped: resume on the layout it "
        f"was saved from, or save one state that every reading process shares")
