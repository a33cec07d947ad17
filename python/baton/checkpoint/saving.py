"""``baton.checkpoint.save``: the state's leaves, who writes each (the process of the rank
that holds it), ``baton.json``, and this process's asynchronous Orbax write."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..errors import ConfigError
from ..running.distributed import Remote, host_value
from . import commit
from .commit import _PENDING, SaveHandle, _exchange, _write_atomic, wait_until_finished
from .layout import FORMAT, METADATA, _data_name, _item_name, _step_dir, committed
from .leaves import (FlatState, _as_args, _check_state_tree, _compiled, _dtype_str, _flatten,
                     _input_stages, _leaf_rank_of_devices)
from .store import _ocp, _saver


@dataclass
class _Processes:
    """The processes that take part in a save: Baton's process group (None: this process
    alone), its exchange timeout, this process, their number and the ranks each runs."""

    group: Any = None
    timeout: float = 120.0
    me: int = 0
    world: int = 1
    ranks_per_process: int = 1


@dataclass
class _StepLeaves:
    """What the step tells about each leaf: the stages that read it, the rank of the first of
    them (its owner; None when no stage reads it), and the step's plan for the metadata."""

    stages: list[list[int]]
    owners: list[int | None]
    plan: dict | None = None

    @classmethod
    def none(cls, n: int) -> "_StepLeaves":
        return cls([[] for _ in range(n)], [None] * n)


@dataclass(frozen=True)
class _Writer:
    """The process that writes a leaf, and the rank under which its item holds it."""

    process: int
    rank: int


def _step_number(step) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ConfigError(f"baton.checkpoint.save: step must be a non-negative integer "
                          f"(got {step!r})")
    return int(step)


def _from_step(fn, args, procs: _Processes, n: int) -> _StepLeaves:
    """The leaves' stages and owners from the compiled step; joins the step's process group
    (``procs``) in multi-process mode."""
    cs = _compiled(fn, "save")
    _check_state_tree(fn, args, "save")
    if fn.multi:
        procs.group = fn._connect()
        procs.me, procs.world = procs.group.rank, procs.group.world_size
        procs.timeout = fn.timeout
        procs.ranks_per_process = fn.mesh.ranks_per_process
    found = _StepLeaves.none(n)
    in_stages = _input_stages(cs)
    for i in range(n):
        found.stages[i] = in_stages[cs.traced.step_inputs[i]]
        if found.stages[i]:
            found.owners[i] = cs.stage_rank[found.stages[i][0]]
    plan = cs.plan
    found.plan = dict(
        fingerprint=str(plan.fingerprint), schedule=str(plan.schedule.name),
        ranks=cs.num_ranks, stages=cs.num_stages, microbatches=cs.M,
        stage_rank=list(map(int, cs.stage_rank)),
        multi_process=bool(fn.multi))
    return found


def _held(flat: FlatState, procs: _Processes) -> str:
    """One character per leaf: ``1`` when this process holds it, ``0`` for a ``baton.Remote``
    placeholder (only in multi-process mode)."""
    have = "".join("0" if isinstance(x, Remote) else "1" for x in flat.leaves)
    if procs.group is None and "0" in have:
        j = have.index("0")
        raise ConfigError(f"baton.checkpoint.save: leaf {flat.names[j]} is a baton.Remote "
                          f"placeholder, but this is not a multi-process step")
    return have


def _clear_step_dir(path, step: int, procs: _Processes, overwrite: bool) -> None:
    """Process 0 removes an uncommitted (killed) save of ``step``, or a committed one when
    ``overwrite``."""
    d = _step_dir(path, step)
    if procs.me == 0 and os.path.exists(d):
        if committed(path, step) and not overwrite:
            raise ConfigError(f"baton.checkpoint.save: step {step} under {path} exists "
                              f"(pass overwrite=True to replace it)")
        shutil.rmtree(d)


def _agree(procs: _Processes, have: str, error: str,
           has_data: bool = False) -> tuple[list[str], list[int]]:
    """Every process's ``have`` string and the processes that passed a data state; raises the
    first process's error, if any."""
    blobs = _exchange(procs.group, json.dumps({"have": "" if error else have, "error": error,
                                               "data": has_data}), procs.timeout)
    errors = [(p, json.loads(b)["error"]) for p, b in enumerate(blobs) if json.loads(b)["error"]]
    if errors:
        p, msg = errors[0]
        raise ConfigError(msg if p == procs.me else f"process {p}: {msg}")
    haves = [json.loads(b)["have"] for b in blobs]
    if len({len(h) for h in haves}) != 1:
        raise ConfigError(f"baton.checkpoint.save: the processes passed states of different "
                          f"sizes ({[len(h) for h in haves]} leaves)")
    return haves, [p for p, b in enumerate(blobs) if json.loads(b)["data"]]


def _writers(flat: FlatState, haves: list[str], found: _StepLeaves, procs: _Processes,
             fn) -> list[_Writer]:
    """Who writes each leaf: the process of its owner rank (the first stage that reads it) if
    that process holds it, else the lowest process that does (under its first rank)."""
    k = procs.ranks_per_process
    out = []
    for i, n in enumerate(flat.names):
        hold = [p for p in range(procs.world) if haves[p][i] == "1"]
        if not hold:
            raise ConfigError(f"baton.checkpoint.save: no process holds {n}")
        own = found.owners[i]
        if procs.group is None:
            r = own
            if r is None and fn is not None:
                r = _leaf_rank_of_devices(flat.leaves[i], fn.mesh)
            out.append(_Writer(0, r if r is not None else 0))
        else:
            owners = [] if own is None else [q for q in fn.mesh.procs(own) if q in hold]
            p = owners[0] if owners else hold[0]
            out.append(_Writer(p, own if owners else fn.mesh.ranks_of(p)[0]))
    return out


def _metadata(step: int, procs: _Processes, args, wrapped: bool, flat: FlatState,
              found: _StepLeaves, writers: list[_Writer], data_procs: list[int]) -> dict:
    """The content of ``baton.json``."""
    names = flat.names
    leaf_meta = []
    for i, x in enumerate(flat.leaves):
        w = writers[i]
        leaf_meta.append(dict(path=names[i], keys=flat.keys[i], dtype=_dtype_str(x),
                              shape=list(np.shape(x)), stages=found.stages[i], rank=w.rank,
                              process=w.process, key=f"a{i}"))
    stage_map: dict[str, list[str]] = {}
    for m in leaf_meta:
        for s in m["stages"]:
            stage_map.setdefault(str(s), []).append(m["path"])
    items = sorted({_item_name(w.process) for w in writers}) + [_data_name(p)
                                                                 for p in data_procs]
    return dict(format=FORMAT, step=step, processes=procs.world, items=items,
                data_processes=data_procs,
                tree=dict(treedef=str(flat.treedef), parts=len(args), wrapped=wrapped),
                leaves=leaf_meta, stage_map=stage_map,
                **({} if found.plan is None else {"plan": found.plan}))


def _metadata_text(meta: dict) -> str:
    """JSON, one line per leaf."""
    head = json.dumps({k: v for k, v in meta.items() if k != "leaves"}, indent=1)
    leaves = ",\n  ".join(json.dumps(m) for m in meta["leaves"])
    return head[:-2] + ',\n "leaves": [\n  ' + leaves + "\n ]\n}\n"


def _writable(x, name: str):
    """A leaf as this process's Orbax item holds it. Under ``jax.distributed`` (ranks spanning
    processes) Orbax writes a host (numpy) leaf from JAX process 0 only and refuses an array
    on one process's devices alone; it writes the replica-0 shards of a global array from the
    process that holds them. So the value becomes a replicated global array over this
    process's first device (replica 0, the only shard built here) and one device of another
    process (a replica this process neither holds nor writes): made from the local buffer
    alone, without communication."""
    if jax.process_count() <= 1:
        return x if isinstance(x, jax.Array) else np.asarray(x)
    x = np.asarray(x)
    if np.dtype(jax.dtypes.canonicalize_dtype(x.dtype)) != x.dtype:
        raise ConfigError(f"baton.checkpoint.save: leaf {name} is a host {x.dtype} value, which "
                          f"this JAX (jax_enable_x64 off) would store as "
                          f"{jax.dtypes.canonicalize_dtype(x.dtype)} on a device; pass it as a "
                          f"jax.Array of the dtype to keep")
    mine = jax.local_devices()[0]
    other = next(d for d in jax.devices() if d.process_index != mine.process_index)
    sharding = NamedSharding(Mesh(np.array([mine, other]), ("replica",)), PartitionSpec())
    return jax.make_array_from_single_device_arrays(x.shape, sharding,
                                                    [jax.device_put(x, mine)])


def _start_write(path, step: int, flat: FlatState, writers: list[_Writer], procs: _Processes,
                 items: list[str], retain=None) -> SaveHandle:
    """Starts this process's Orbax write of the leaves it writes (none: nothing to write)."""
    item: dict[str, dict[str, Any]] = {}
    for i, x in enumerate(flat.leaves):
        w = writers[i]
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            # a rank spanning processes: its leaves are arrays over its processes' devices;
            # the writer writes the whole value from host memory (a leaf split over the
            # processes is gathered by all of them: collective, in the same leaf order)
            x = host_value(x)
        if w.process == procs.me:
            item.setdefault(f"rank{w.rank}", {})[f"a{i}"] = _writable(x, flat.names[i])
    writing = bool(item)
    failed = ""
    if writing:
        ocp = _ocp()
        try:
            _saver().save(os.path.join(_step_dir(path, step), _item_name(procs.me)),
                          args=ocp.args.PyTreeSave(item))
        except Exception as e:  # noqa: BLE001  (reported to every process by wait())
            if procs.group is None:
                raise
            failed, writing = f"{type(e).__name__}: {e}", False
    return SaveHandle(path, step, procs.group, procs.timeout, procs.me, items, writing, failed,
                      retain)


def _retention(max_to_keep, keep_period):
    for name, v in (("max_to_keep", max_to_keep), ("keep_period", keep_period)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"baton.checkpoint.save: {name} must be a positive integer or "
                              f"None (got {v!r})")
    return None if max_to_keep is None else (max_to_keep, keep_period)


def _data_text(data) -> str:
    try:
        return json.dumps({"state": data}) + "\n"
    except TypeError as e:
        raise ConfigError(f"baton.checkpoint.save: data must be JSON-serializable (a data "
                          f"iterator's get_state(), e.g. Grain's): {e}") from None


def save(path, step: int, state: Any, fn: Any = None, *, data: Any = None,
         max_to_keep: int | None = None, keep_period: int | None = None,
         overwrite: bool = False, wait: bool = False) -> SaveHandle:
    """Saves ``state`` as step ``step`` under ``path``; returns a :class:`SaveHandle`.

    ``state``: the training state, the step's leading arguments: a tuple ``(params,
    opt_state)`` (the first two arguments of ``fn``), or one pytree (its first argument).
    Leaves are arrays, or (multi-process mode) the ``baton.Remote`` placeholders the step
    returned. ``fn``: the ``baton.jit`` step (called or compiled once), whose plan and stage
    map go into the metadata; None saves a plain JAX state (one process, no stage map).
    Each process writes only the leaves it holds; the write is asynchronous and the
    checkpoint is committed by ``handle.wait()`` (``wait=True`` waits here), the next
    ``save`` or :func:`wait_until_finished` (not at exit: a save still in flight when the
    program ends is not committed, and a warning says so). In multi-process mode ``save`` and
    ``wait`` are collective (call them in every process, in the same order). A committed
    ``step`` that exists raises ``ConfigError`` unless ``overwrite``; an uncommitted one (a
    save that was killed) is replaced.
    ``data``: this process's data-iterator state (JSON: ``GrainFeed.get_state()``, a Grain
    iterator's ``get_state()``), or None where this process reads no data; read back with
    :func:`restore_data`. ``max_to_keep``: once this step is committed, process 0 removes the
    oldest committed steps beyond that many, except those that are a multiple of
    ``keep_period`` (Orbax ``CheckpointManager``'s retention options).
    """
    wait_until_finished()
    retain = _retention(max_to_keep, keep_period)
    data_text = None if data is None else _data_text(data)
    step = _step_number(step)
    args, wrapped = _as_args(state)
    flat = _flatten(args, wrapped)
    procs = _Processes()
    found = _StepLeaves.none(len(flat.leaves))
    have, error = "", ""
    try:
        if fn is not None:
            found = _from_step(fn, args, procs, len(flat.leaves))
        have = _held(flat, procs)
        _clear_step_dir(path, step, procs, overwrite)
    except Exception as e:  # noqa: BLE001  (told to every process, which all raise)
        if procs.group is None:
            raise
        error = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
    haves, data_procs = _agree(procs, have, error, data_text is not None)
    writers = _writers(flat, haves, found, procs, fn)
    meta = _metadata(step, procs, args, wrapped, flat, found, writers, data_procs)
    d = _step_dir(path, step)
    if procs.me == 0:
        os.makedirs(d, exist_ok=True)
        _write_atomic(os.path.join(d, METADATA), _metadata_text(meta))
    _exchange(procs.group, "dir", procs.timeout)  # the directory exists before anyone writes
    if data_text is not None:
        _write_atomic(os.path.join(d, _data_name(procs.me)), data_text)
    handle = _start_write(path, step, flat, writers, procs, meta["items"], retain)
    _PENDING.append(handle)
    commit._test_hook("writing", step=step, process=procs.me)
    if wait:
        handle.wait()
    return handle
