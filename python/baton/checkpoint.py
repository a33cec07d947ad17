"""Checkpoints of pipelined training state on Orbax.

``save(path, step, state, fn)`` writes the training state (the step's leading arguments, e.g.
``(params, opt_state)``) of a ``baton.jit`` step; ``restore(path, step, fn=...)`` reads it back
placed for a pipelined step of any layout (other ranks, another schedule: every array is found
by its path), or, without ``fn``, as a plain JAX pytree.

On disk, under ``path``::

    <step>/                      one directory per checkpointed step (the integer)
        baton.json               Baton's metadata (process 0): plan, stage map, tree, leaves
        process-<p>/             an Orbax PyTree item: the arrays process p wrote,
                                 {"rank<r>": {"a<i>": leaf i}} for each rank r it runs
        COMMITTED                written last, by process 0, once every item is finalized

Each process writes only the leaves its own ranks hold (no gather), asynchronously (Orbax's
``AsyncCheckpointer``). The commit is collective: ``SaveHandle.wait()`` (or the next
``save``, ``wait_until_finished()`` or ``restore``; not interpreter exit, so call one before
the program ends) waits for this process's write, exchanges every process's status over
Baton's process group, and then process 0 writes ``COMMITTED``. A step directory without it
is not a checkpoint: ``latest_step`` and ``restore`` skip it, and the next ``save`` of that
step replaces it. Killing a run at any point of a save leaves the previous checkpoint as it
was.

In multi-process mode every process is its own JAX world (``jax.process_count() == 1``), so
Orbax's own multi-host coordination has nothing to do: each process's item is a complete
one-process Orbax checkpoint (written to a temporary directory and renamed by Orbax), and
Baton's commit marker makes the set of items one checkpoint.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import time
from typing import Any

import jax
import numpy as np

from .errors import ConfigError, ExecutionError

FORMAT = "baton-checkpoint/1"
METADATA = "baton.json"
COMMIT = "COMMITTED"

_log = logging.getLogger("baton")


def _test_hook(event: str, **info) -> None:
    """Called at points of a save (tests replace it to kill a process there): ``"writing"``
    (this process's Orbax write has started), ``"written"`` (it finished, before the commit
    exchange), ``"commit"`` (process 0, every item written, before ``COMMITTED``)."""


# -- paths -------------------------------------------------------------------------------------
def _step_dir(path, step: int) -> str:
    return os.path.join(os.fspath(path), str(int(step)))


def _item_name(process: int) -> str:
    return f"process-{process}"


def committed(path, step: int) -> bool:
    """``path/<step>`` is a committed checkpoint."""
    return os.path.isfile(os.path.join(_step_dir(path, step), COMMIT))


def all_steps(path) -> list[int]:
    """The committed steps under ``path``, ascending (uncommitted step directories skipped)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return []
    return sorted(int(n) for n in os.listdir(path)
                  if n.isdigit() and committed(path, int(n)))


def latest_step(path) -> int | None:
    """The newest committed step under ``path`` (None when there is none); a step whose save
    did not finish (no ``COMMITTED`` marker) is skipped."""
    steps = all_steps(path)
    return steps[-1] if steps else None


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


# -- the state's leaves ------------------------------------------------------------------------
def _key_entry(k) -> list:
    tu = jax.tree_util
    if isinstance(k, tu.DictKey):
        return ["dict", k.key if isinstance(k.key, (str, int)) else str(k.key)]
    if isinstance(k, tu.SequenceKey):
        return ["seq", k.idx]
    if isinstance(k, tu.GetAttrKey):
        return ["attr", k.name]
    if isinstance(k, tu.FlattenedIndexKey):
        return ["index", k.key]
    return ["key", str(k)]


def _name(entries) -> str:
    out = []
    for kind, k in entries:
        out.append(f".{k}" if kind == "attr" else f"[{k!r}]" if kind == "dict" else f"[{k}]")
    return "".join(out) or "<root>"


def _flatten(state, wrapped: bool):
    """(leaves, [key entries], treedef) of the state; the leading tuple index is dropped when
    the state is one argument (``wrapped``)."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(state)
    keys = []
    for path, _ in pairs:
        e = [_key_entry(k) for k in path]
        keys.append(e[1:] if wrapped else e)
    return [x for _, x in pairs], keys, treedef


def _as_args(state):
    """State -> (the step's leading arguments as a tuple, wrapped?). A plain tuple is the
    leading arguments (``(params, opt_state)``); anything else is the first argument."""
    if type(state) is tuple:
        return state, False
    return (state,), True


def _input_stages(step) -> dict[int, list[int]]:
    """Step input value -> the stages that read it: the stages of the code before and after the
    loop whose segments take it (a small value such as the optimizer's step count is copied
    into every stage that uses it), and the stages whose loop tasks read it (as an invariant or
    per microbatch). These are the values the step moves to a stage's rank."""
    tr = step.traced
    stages: dict[int, set[int]] = {v: set() for v in tr.step_inputs}
    for seg in list(step.pre_segments) + list(step.post_segments):
        for v in seg.inputs:
            if v in stages:
                stages[v].add(int(seg.stage))
    for (_, s), exe in step.tasks.items():
        for b in list(exe.in_groups[0]) + list(exe.in_groups[1]):
            o = step.loop_src[b][0]
            if o in stages:
                stages[o].add(int(s))
    return {v: sorted(x) for v, x in stages.items()}


def _compiled(fn, what: str):
    from .frontend.api import PipelinedFunction

    if not isinstance(fn, PipelinedFunction):
        raise ConfigError(f"baton.checkpoint.{what}: fn must be a baton.jit step "
                          f"(got {type(fn).__name__})")
    if fn.last is None or fn._tree is None:
        raise ConfigError(f"baton.checkpoint.{what}: the step has not been compiled yet: call it "
                          f"once, or fn.compile(*example_args), first")
    if fn.multi and getattr(fn.mesh, "spans", False):
        raise ConfigError(f"baton.checkpoint.{what}: the step's ranks span processes; "
                          f"checkpoints are written by one process per rank so far (gather "
                          f"the state with fn.gather and save it from one process)")
    return fn.last


def _check_state_tree(fn, args, what: str) -> None:
    """``args`` (the state as leading arguments) has the structure of the step's first
    ``len(args)`` arguments; raises ConfigError naming the first path that differs."""
    want = fn._tree.children()
    if len(args) > len(want):
        raise ConfigError(f"baton.checkpoint.{what}: the state has {len(args)} parts but the step "
                          f"takes {len(want)} arguments")
    for k, (part, t) in enumerate(zip(args, want)):
        got = jax.tree.structure(part)
        if got == t:
            continue
        have = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(part)[0]}
        dummy = jax.tree.unflatten(t, [0] * t.num_leaves)
        need = {jax.tree_util.keystr(p) for p, _ in
                jax.tree_util.tree_flatten_with_path(dummy)[0]}
        diff = sorted(need - have) or sorted(have - need)
        where = f"[{k}]{diff[0]}" if diff else f"[{k}]"
        raise ConfigError(f"baton.checkpoint.{what}: the state's argument {k} does not have the "
                          f"structure of the step's argument {k} (first difference at {where}: "
                          f"state {got}, step {t})")


def _leaf_rank_of_devices(x, mesh) -> int | None:
    sh = getattr(x, "sharding", None)
    if sh is None or not hasattr(mesh, "rank_devices"):
        return None
    ds = sh.device_set
    for r, devs in enumerate(mesh.rank_devices):
        if ds <= set(devs):
            return r
    return None


def _dtype_str(x) -> str:
    return np.dtype(getattr(x, "dtype", None) or np.result_type(x)).name


# -- Orbax ---------------------------------------------------------------------------------
def _ocp():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover
        raise ConfigError("baton.checkpoint needs orbax-checkpoint "
                          "(pip install orbax-checkpoint)") from e
    return ocp


def _mp_options(ocp) -> dict:
    """Each process writes and reads its own items: under ``jax.distributed`` (several JAX
    processes) Orbax must not coordinate with the others (every process its own primary host,
    barriers among itself only). Empty in Baton's own multi-process mode, where each process
    is a one-process JAX world."""
    if jax.process_count() <= 1:
        return {}
    me = jax.process_index()
    return dict(multiprocessing_options=ocp.options.MultiprocessingOptions(
        primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"baton{me}"))


_SAVER = None


def _saver():
    """This process's Orbax ``AsyncCheckpointer`` (one save in flight at a time)."""
    global _SAVER
    if _SAVER is None:
        ocp = _ocp()
        mp = _mp_options(ocp)
        _SAVER = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(**mp), **mp)
    return _SAVER


def _reader():
    ocp = _ocp()
    mp = _mp_options(ocp)
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**mp), **mp)


# -- save --------------------------------------------------------------------------------
class SaveHandle:
    """A save in flight. ``wait()`` (collective in multi-process mode: call it in every
    process) finishes this process's write and commits the checkpoint; returns the step
    directory. ``done`` tells whether it was committed."""

    def __init__(self, path, step, group, timeout, process, expected_items, writing,
                 failed=""):
        self.path = os.fspath(path)
        self.step = int(step)
        self.dir = _step_dir(path, step)
        self.group = group
        self.timeout = timeout
        self.process = process
        self.expected_items = expected_items
        self.writing = writing
        self.failed = failed  # this process's Orbax save did not start: why
        self.done = False
        self.error: BaseException | None = None

    def wait(self) -> str:
        if self.done:
            return self.dir
        if self.error is not None:
            raise self.error
        try:
            return self._finish()
        except BaseException as e:
            self.error = e
            raise
        finally:
            if self in _PENDING:
                _PENDING.remove(self)

    wait_until_finished = wait

    def _finish(self) -> str:
        status = self.failed or "ok"
        if self.writing:
            try:
                _saver().wait_until_finished()
            except Exception as e:  # noqa: BLE001  (reported to every process)
                status = f"{type(e).__name__}: {e}"
        _test_hook("written", step=self.step, process=self.process)
        statuses = _exchange(self.group, status, self.timeout)
        bad = [(p, s) for p, s in enumerate(statuses) if s != "ok"]
        if bad:
            raise ExecutionError(
                f"baton.checkpoint.save: step {self.step} under {self.path} was not committed: "
                + "; ".join(f"process {p}: {s}" for p, s in bad))
        if self.process == 0:
            missing = [n for n in self.expected_items
                       if not os.path.isdir(os.path.join(self.dir, n))]
            if missing:
                raise ExecutionError(f"baton.checkpoint.save: step {self.step}: items {missing} "
                                     f"are missing under {self.dir}; not committed")
            _test_hook("commit", step=self.step, process=self.process)
            _write_atomic(os.path.join(self.dir, COMMIT),
                          json.dumps({"step": self.step, "time": time.time()}) + "\n")
        _exchange(self.group, "committed", self.timeout)  # every process sees the marker
        self.done = True
        return self.dir


_PENDING: list[SaveHandle] = []


def wait_until_finished() -> None:
    """Finishes and commits every save in flight in this process (collective in
    multi-process mode)."""
    while _PENDING:
        _PENDING[0].wait()


def _at_exit():
    """A save still in flight at exit cannot be committed any more (Orbax finishes its writes
    on threads, and Python starts no thread once it is shutting down): says so."""
    for h in _PENDING:
        _log.warning("baton.checkpoint: step %d under %s was not committed (the program ended "
                     "before handle.wait() or baton.checkpoint.wait_until_finished()); "
                     "latest_step and restore ignore it", h.step, h.path)


atexit.register(_at_exit)


def _write_atomic(name: str, text: str) -> None:
    tmp = f"{name}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, name)
    try:
        fd = os.open(os.path.dirname(name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _metadata_text(meta: dict) -> str:
    """JSON, one line per leaf."""
    head = json.dumps({k: v for k, v in meta.items() if k != "leaves"}, indent=1)
    leaves = ",\n  ".join(json.dumps(m) for m in meta["leaves"])
    return head[:-2] + ',\n "leaves": [\n  ' + leaves + "\n ]\n}\n"


def _exchange(group, blob: str, timeout: float) -> list[str]:
    """Every process's ``blob`` (a barrier that carries a status); ``[blob]`` in one
    process."""
    if group is None:
        return [blob]
    from .frontend.distributed import Router

    router = Router(group, timeout)
    out = router.allgather(blob)
    router.finish()
    return out


def save(path, step: int, state: Any, fn: Any = None, *, overwrite: bool = False,
         wait: bool = False) -> SaveHandle:
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
    """
    wait_until_finished()
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ConfigError(f"baton.checkpoint.save: step must be a non-negative integer "
                          f"(got {step!r})")
    step = int(step)
    args, wrapped = _as_args(state)
    leaves, keys, treedef = _flatten(args, wrapped)
    names = [_name(k) for k in keys]
    group, timeout, me, world, k = None, 120.0, 0, 1, 1
    error = ""
    info: dict[str, Any] = {}
    owners: list[int | None] = [None] * len(leaves)
    stages: list[list[int]] = [[] for _ in leaves]
    try:
        if fn is not None:
            cs = _compiled(fn, "save")
            _check_state_tree(fn, args, "save")
            if fn.multi:
                group = fn._connect()
                me, world, timeout = group.rank, group.world_size, fn.timeout
                k = fn.mesh.ranks_per_process
            in_stages = _input_stages(cs)
            for i in range(len(leaves)):
                stages[i] = in_stages[cs.traced.step_inputs[i]]
                if stages[i]:
                    owners[i] = cs.stage_rank[stages[i][0]]
            plan = cs.plan
            info["plan"] = dict(
                fingerprint=str(plan.fingerprint), schedule=str(plan.schedule.name),
                ranks=cs.num_ranks, stages=cs.num_stages, microbatches=cs.M,
                stage_rank=list(map(int, cs.stage_rank)),
                multi_process=bool(fn.multi))
        from .frontend.distributed import Remote

        have = "".join("0" if isinstance(x, Remote) else "1" for x in leaves)
        if group is None and "0" in have:
            j = have.index("0")
            raise ConfigError(f"baton.checkpoint.save: leaf {names[j]} is a baton.Remote "
                              f"placeholder, but this is not a multi-process step")
        d = _step_dir(path, step)
        if me == 0 and os.path.exists(d):
            if committed(path, step) and not overwrite:
                raise ConfigError(f"baton.checkpoint.save: step {step} under {path} exists "
                                  f"(pass overwrite=True to replace it)")
            shutil.rmtree(d)  # an uncommitted (killed) save, or overwrite
    except Exception as e:  # noqa: BLE001  (told to every process, which all raise)
        if group is None:
            raise
        error = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
    blobs = _exchange(group, json.dumps({"have": "" if error else have, "error": error}),
                      timeout)
    errors = [(p, json.loads(b)["error"]) for p, b in enumerate(blobs) if json.loads(b)["error"]]
    if errors:
        p, msg = errors[0]
        raise ConfigError(msg if p == me else f"process {p}: {msg}")
    haves = [json.loads(b)["have"] for b in blobs]
    if len({len(h) for h in haves}) != 1:
        raise ConfigError(f"baton.checkpoint.save: the processes passed states of different "
                          f"sizes ({[len(h) for h in haves]} leaves)")
    # who writes each leaf: the process of its owner rank (the first stage that reads it) if
    # that process holds it, else the lowest process that does (under its first rank)
    writer = []
    for i, n in enumerate(names):
        hold = [p for p in range(world) if haves[p][i] == "1"]
        if not hold:
            raise ConfigError(f"baton.checkpoint.save: no process holds {n}")
        if group is None:
            r = owners[i]
            if r is None and fn is not None:
                r = _leaf_rank_of_devices(leaves[i], fn.mesh)
            writer.append((0, r if r is not None else 0))
        else:
            own = owners[i]
            p = own // k if own is not None and own // k in hold else hold[0]
            writer.append((p, own if own is not None and own // k == p else p * k))
    leaf_meta = []
    for i, x in enumerate(leaves):
        p, r = writer[i]
        leaf_meta.append(dict(path=names[i], keys=keys[i], dtype=_dtype_str(x),
                              shape=list(np.shape(x)), stages=stages[i], rank=r, process=p,
                              key=f"a{i}"))
    stage_map: dict[str, list[str]] = {}
    for m in leaf_meta:
        for s in m["stages"]:
            stage_map.setdefault(str(s), []).append(m["path"])
    items = sorted({_item_name(p) for p, _ in writer})
    meta = dict(format=FORMAT, step=step, processes=world, items=items,
                tree=dict(treedef=str(treedef), parts=len(args), wrapped=wrapped),
                leaves=leaf_meta, stage_map=stage_map, **info)
    d = _step_dir(path, step)
    if me == 0:
        os.makedirs(d, exist_ok=True)
        _write_atomic(os.path.join(d, METADATA), _metadata_text(meta))
    _exchange(group, "dir", timeout)  # the directory exists before anyone writes into it
    item: dict[str, dict[str, Any]] = {}
    for i, x in enumerate(leaves):
        p, r = writer[i]
        if p == me:
            if not isinstance(x, jax.Array):
                x = np.asarray(x)
            item.setdefault(f"rank{r}", {})[f"a{i}"] = x
    writing = bool(item)
    failed = ""
    if writing:
        ocp = _ocp()
        try:
            _saver().save(os.path.join(d, _item_name(me)), args=ocp.args.PyTreeSave(item))
        except Exception as e:  # noqa: BLE001  (reported to every process by wait())
            if group is None:
                raise
            failed, writing = f"{type(e).__name__}: {e}", False
    handle = SaveHandle(path, step, group, timeout, me, items, writing, failed)
    _PENDING.append(handle)
    _test_hook("writing", step=step, process=me)
    if wait:
        handle.wait()
    return handle


# -- restore -------------------------------------------------------------------------------
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
    with open(os.path.join(d, METADATA)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ConfigError(f"baton.checkpoint.restore: {d} has format {meta.get('format')!r}, "
                          f"expected {FORMAT!r}")
    saved = {m["path"]: m for m in meta["leaves"]}
    wrapped_saved = meta["tree"]["wrapped"]
    if target is None and fn is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        ms = meta["leaves"]
        vals = _read(d, ms, [dev] * len(ms))
        return _unflatten_keys([m["keys"] for m in ms], vals)
    cs = _compiled(fn, "restore") if fn is not None else None
    if target is None:  # the step's leading arguments
        parts = fn._tree.children()[: meta["tree"]["parts"]]
        args = tuple(jax.tree.unflatten(t, [0] * t.num_leaves) for t in parts)
        wrapped = wrapped_saved
        _, keys, treedef = _flatten(args, wrapped)
        tgt_leaves = [None] * treedef.num_leaves
    else:
        args, wrapped = _as_args(target)
        tgt_leaves, keys, treedef = _flatten(args, wrapped)
    names = [_name(k) for k in keys]
    if fn is not None:
        _check_state_tree(fn, args, "restore")
    # every target path in the checkpoint, with its shape and dtype; no saved path left over
    for i, n in enumerate(names):
        m = saved.get(n)
        if m is None:
            near = [p for p, x in saved.items() if x["keys"][:-1] == keys[i][:-1]][:4]
            raise ConfigError(f"baton.checkpoint.restore: {n} of the target model is not in the "
                              f"checkpoint of step {step} under {path}"
                              + (f" (it has e.g. {', '.join(near)})" if near else ""))
        t = tgt_leaves[i]
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
    ms = [saved[n] for n in names]
    if cs is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = []
        for t in tgt_leaves:
            sh = getattr(t, "sharding", None)
            shardings.append(sh if isinstance(sh, jax.sharding.Sharding) else dev)
        vals = _read(d, ms, shardings)
        return _wrap(jax.tree.unflatten(treedef, vals), wrapped)
    # placed for the step
    in_stages = _input_stages(cs)
    mine = set(fn.ranks) if fn.multi else None  # the ranks this process runs
    from .frontend.distributed import Remote

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
    return _wrap(jax.tree.unflatten(treedef, out), wrapped)


def _wrap(args, wrapped):
    return args[0] if wrapped else args


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
            item.setdefault(r, {})[m["key"]] = jax.ShapeDtypeStruct(
                tuple(m["shape"]), np.dtype(m["dtype"]), sharding=shardings[j])
            rargs.setdefault(r, {})[m["key"]] = ocp.ArrayRestoreArgs(
                sharding=shardings[j], global_shape=tuple(m["shape"]),
                dtype=np.dtype(m["dtype"]))
        where = os.path.join(d, name)
        if not os.path.isdir(where):
            raise ConfigError(f"baton.checkpoint.restore: {where} is missing (it holds "
                              f"{ms[js[0]]['path']})")
        got = ck.restore(where, args=ocp.args.PyTreeRestore(item=item, restore_args=rargs,
                                                             partial_restore=True))
        for j in js:
            m = ms[j]
            out[j] = got[f"rank{m['rank']}"][m["key"]]
    return out
