"""The training state's leaves: their key paths and names, the step's leading arguments they
stand for, the stages of a compiled step that read them, and the checks that a state fits a
step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..errors import ConfigError
from ..frontend.api import PipelinedFunction


@dataclass
class FlatState:
    """A state flattened: its leaves, each leaf's key entries (``[kind, key]`` pairs) and the
    treedef of the leading arguments."""

    leaves: list
    keys: list[list]
    treedef: Any

    @property
    def names(self) -> list[str]:
        return [_name(k) for k in self.keys]


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


def _flatten(state, wrapped: bool) -> FlatState:
    """The state's leaves and key entries; the leading tuple index is dropped when the state is
    one argument (``wrapped``)."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(state)
    keys = []
    for path, _ in pairs:
        e = [_key_entry(k) for k in path]
        keys.append(e[1:] if wrapped else e)
    return FlatState([x for _, x in pairs], keys, treedef)


def _as_args(state):
    """State -> (the step's leading arguments as a tuple, wrapped?). A plain tuple is the
    leading arguments (``(params, opt_state)``); anything else is the first argument."""
    if type(state) is tuple:
        return state, False
    return (state,), True


def _wrap(args, wrapped):
    return args[0] if wrapped else args


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
    if not isinstance(fn, PipelinedFunction):
        raise ConfigError(f"baton.checkpoint.{what}: fn must be a baton.jit step "
                          f"(got {type(fn).__name__})")
    if fn.last is None or fn._tree is None:
        raise ConfigError(f"baton.checkpoint.{what}: the step has not been compiled yet: call it "
                          f"once, or fn.compile(*example_args), first")
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
