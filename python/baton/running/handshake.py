"""The start-up handshake over the whole traced program (multi-process mode).

Before any executor starts, every process describes the step it built as a list of
*components*: the Baton / JAX versions, the schedule, the microbatch count, the ranks, the
options that change the program, the step's inputs (path, shape, dtype, sharding), and per
stage its forward work, its backward work and its work outside the loop (each op's
primitive, parameters and operand shapes, as text), and the plan fingerprint. Each
component travels as a short hash (one all-gather of a small JSON document); only when
hashes differ do the processes exchange the text of the first differing component, and
every process raises a :class:`~baton.errors.ConfigError` naming it, the first differing
line and the processes involved, e.g. ``stage 1 forward differs: process 0 has ... tanh
..., process 1 has ... logistic ...``.

A process whose step failed to build takes part with its error, so the others stop at
once (naming it) instead of waiting for it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

from .. import _core
from ..errors import ConfigError
from ..planning.tasks import task_kind

_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")
_SET = re.compile(r"frozenset\(\{([^{}]*)\}\)")
# devices: each process holds its own (one process's rank runs on its local devices)
_DEVICE = re.compile(r"\b\w*Device\(id=\d+[^)]*\)")
_LINE_MAX = 240


def _clean(text: str) -> str:
    """Text that is the same in every process for the same program: no object addresses or
    device ids (each process runs on its own devices), set members sorted (string hashing
    is salted per process)."""
    text = _DEVICE.sub("Device", _ADDR.sub("", text))
    return _SET.sub(lambda m: "frozenset({" + ", ".join(
        sorted(x.strip() for x in m.group(1).split(","))) + "})", text)


def _aval(a) -> str:
    try:
        return a.str_short(short_dtypes=True)
    except (AttributeError, TypeError):
        return str(a)


# parameters that differ between processes tracing the same code (a per-process counter)
_VOLATILE = {"uid"}
_TK = _core.TaskKind
G = _core.graph
_KINDS = {_TK.F: "forward", _TK.B: "backward", _TK.I: "input gradient", _TK.W: "weight gradient"}


def _op_line(op, avals) -> str:
    params = ", ".join(f"{k}={_clean(str(v))}" for k, v in sorted(op.params.items())
                       if k not in _VOLATILE)
    ins = " ".join(_aval(avals[i]) for i in op.inputs)
    outs = " ".join(_aval(avals[i]) for i in op.outputs)
    return f"{op.prim.name}[{params}] {ins} -> {outs}"


def _group_lines(traced, idx: list[int]) -> list[str]:
    """The lines of a group of ops: first the values it reads from outside it."""
    ops = [traced.ops[i] for i in idx]
    made = {v for op in ops for v in op.outputs}
    reads = sorted({v for op in ops for v in op.inputs
                    if v not in made and v not in traced.literals})
    return (["reads " + " ".join(_aval(traced.avals[v]) for v in reads)]
            + [_op_line(op, traced.avals) for op in ops])


def _stage_components(step) -> list[tuple[str, list[str]]]:
    """Per stage: (name, lines) of each of its loop tasks (forward, backward, ...: the
    partition's) and of its ops outside the loop (optimizer update, ...)."""
    traced = step.traced
    groups: dict[tuple[int, int], tuple[str, list[int]]] = {}
    for t in step.partition.tasks:
        kind = task_kind(t.kind)
        groups[(int(t.stage), list(_KINDS).index(kind))] = (
            f"stage {t.stage} {_KINDS[kind]}", sorted(int(i) for i in t.ops))
    outside: dict[int, list[int]] = {}
    for i, s in enumerate(step.op_stage):
        if s >= 0 and traced.ops[i].region != G.Region.Loop:
            outside.setdefault(int(s), []).append(i)
    for s, idx in outside.items():
        groups[(s, len(_KINDS) + 1)] = (f"stage {s} outside the loop", idx)
    return [(name, _group_lines(traced, idx)) for _, (name, idx) in sorted(groups.items())]


def describe(fn, step) -> list[tuple[str, list[str]]]:
    """The components of ``step`` (a ``CompiledStep`` of ``fn``, a ``PipelinedFunction``):
    (name, lines of text)."""
    import jax
    import jaxlib

    from .. import __version__

    traced = step.traced
    inputs = []
    paths = jax.tree_util.tree_flatten_with_path(
        jax.tree.unflatten(traced.in_tree, list(traced.step_inputs)))[0]
    for path, v in paths:
        spec = step.in_specs.get(v)
        inputs.append(f"{jax.tree_util.keystr(path)}: {_aval(traced.avals[v])}"
                      + (f" sharded {spec}" if spec is not None else ""))
    comps = [
        ("versions", [f"baton {__version__}, jax {jax.__version__}, "
                      f"jaxlib {getattr(jaxlib, '__version__', '?')}"]),
        ("schedule", [repr(fn.spec)]),
        ("microbatches", [str(step.M)]),
        ("ranks", [f"{step.num_ranks} ranks"]),
        ("options", [f"remat={fn.remat} fuse_forward_backward={fn.fuse_fb} "
                     f"boundaries={fn.boundaries} donate_argnums={fn.donate_argnums}"]),
        ("stages", [f"{step.num_stages} stages"]),
        ("inputs", inputs or ["no inputs"]),
    ]
    comps += _stage_components(step)
    comps.append(("plan", [f"fingerprint {step.core_plan.fingerprint()}"]))
    return comps


@dataclasses.dataclass
class Digest:
    """What one process sends first: per component, a hash of its text; or its error."""

    hashes: dict[str, str]
    error: str = ""

    def to_json(self) -> str:
        return json.dumps({"h": self.hashes, "e": self.error})

    @staticmethod
    def from_json(text: str) -> "Digest":
        d = json.loads(text)
        return Digest(d["h"], d["e"])


def _hash(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _short(line: str) -> str:
    return line if len(line) <= _LINE_MAX else line[:_LINE_MAX] + " ..."


def _first_line_diff(mine: list[str], theirs: list[str]) -> tuple[int, str, str]:
    for i in range(max(len(mine), len(theirs))):
        a = mine[i] if i < len(mine) else "(nothing)"
        b = theirs[i] if i < len(theirs) else "(nothing)"
        if a != b:
            return i, a, b
    return -1, "", ""


def agree_program(router, comps: list[tuple[str, list[str]]] | None, error: str = "") -> None:
    """Compares this process's program (``comps``, or ``error`` when its step failed to
    build) with every other process's over ``router`` (a ``distributed.Router``; collective:
    every process calls it once per new step). Raises ``ConfigError`` in every process when
    they differ, naming the first differing component, its first differing line and the
    processes."""
    comps = comps or []
    mine = Digest({name: _hash(lines) for name, lines in comps}, error)
    digests = [Digest.from_json(b) for b in router.allgather(mine.to_json())]
    failed = [(p, d.error) for p, d in enumerate(digests) if d.error]
    if failed:
        raise ConfigError("baton.jit: the processes cannot agree on the step: " + "; ".join(
            f"process {p} could not build it ({e})" for p, e in failed))
    names = [n for n, _ in comps]
    for d in digests:
        names += [n for n in d.hashes if n not in names]
    diff = next((n for n in names if len({d.hashes.get(n) for d in digests}) > 1), None)
    if diff is None:
        return
    # Every process found the same first difference: exchange that component's text.
    text = dict(comps).get(diff, [])
    got = [json.loads(b) for b in router.allgather(json.dumps(text))]
    parts, ref = [], got[0]
    for p in range(1, len(got)):
        if _hash(got[p]) == _hash(ref):
            continue
        i, a, b = _first_line_diff(ref, got[p])
        where = "" if len(ref) <= 1 and len(got[p]) <= 1 else f" (line {i + 1})"
        parts.append(f"process 0 has {_short(a)!r}, process {p} has {_short(b)!r}{where}")
    raise ConfigError(
        f"baton.jit: the processes traced different programs: {diff} differs: "
        + "; ".join(parts) + ". Every process must run the same model code, shapes, dtypes, "
        "shardings, schedule, microbatches and Baton / JAX versions")


def error_text(e: BaseException) -> str:
    return _short(f"{type(e).__name__}: {e}")


__all__ = ["agree_program", "describe", "error_text"]
