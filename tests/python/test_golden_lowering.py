"""Golden text of the lowerings the C++ rank-IR golden files (cpp/tests/golden, checked by
test_rank_ir.py) do not cover: the partition of a small traced model, and what the emitter
makes of a rank program, for two schedules. A change to either lowering shows up as a text
diff against tests/python/golden/; ``BATON_UPDATE_GOLDEN=1`` rewrites the files (review the
diff before committing it).

Both texts are normalized so that what JAX and XLA decide (value numbering, the user code's
op count and cost estimates, function names, locations, metadata) does not make them differ
between the JAX versions Baton supports; what Baton decides stays:

* the partition: each task's kind and stage and its value groups, values renumbered in order
  of first appearance, with their bytes;
* the emitter: the skeleton of each rank program's StableHLO, i.e. its loops (with their
  carries' types: the table and the rings), the branches of each ``case``, and every Baton
  custom call (``baton_comm``, ``baton_mark``, ``baton_drain``) with its operation kinds,
  peers, channels and stages and its operand and result types, private functions inlined
  where they are called.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import baton  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("BATON_UPDATE_GOLDEN") == "1"


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing: run with BATON_UPDATE_GOLDEN=1 to write it"
    assert text == path.read_text(), (
        f"{name} differs from its golden file; if the lowering changed on purpose, rerun with "
        "BATON_UPDATE_GOLDEN=1 and review the diff")


# -- the partition -----------------------------------------------------------------------------

_HEADER = re.compile(r"^(\S+): \d+ ops, cost [0-9.e+]+$")


def normalize_partition(text: str) -> str:
    """Values renumbered by first appearance; op counts and costs (JAX's lowering of the
    user code) dropped."""
    names: dict[str, str] = {}

    def value(m):
        return names.setdefault(m.group(0), f"%v{len(names)}")

    out = []
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head:
            out.append(f"{head.group(1)}:")
            continue
        out.append(re.sub(r"%\d+", value, line.rstrip()))
    return "\n".join(out) + "\n"


# -- the emitter -------------------------------------------------------------------------------

_FUNC = re.compile(r"^(\s*)func\.func (?:public |private )?@([\w.$-]+)\(")
_CALL = re.compile(r"(?:func\.)?call @([\w.$-]+)\(")
_CUSTOM = re.compile(r"stablehlo\.custom_call @(\w+)\(")
_DENSE = re.compile(r"^dense<(.*)> : tensor<(?:(\d+)x)?\w+>$")


def _attrs(line: str) -> dict[str, str]:
    """The FFI attributes of a custom call (``mhlo.backend_config = {...}``), values as
    lists or scalars."""
    start = line.find("mhlo.backend_config = {")
    if start < 0:
        return {}
    i = start + len("mhlo.backend_config = {")
    depth, j = 1, i
    while depth:
        depth += {"{": 1, "}": -1}.get(line[j], 0)
        j += 1
    body = line[i:j - 1]
    parts, depth, cur = [], 0, ""
    for ch in body:
        depth += {"<": 1, "[": 1, ">": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    out = {}
    for p in parts:
        key, _, val = (s.strip() for s in p.partition("="))
        m = _DENSE.match(val)
        if m:
            vals, n = m.group(1), m.group(2)
            if vals.startswith("["):
                val = vals
            else:  # a splat: every element the same
                val = "[" + ", ".join([vals] * int(n or 1)) + "]"
        else:
            val = val.split(" : ")[0]
        out[key] = val
    return out


def _signature(line: str) -> str:
    """The operand and result types at the end of an op's line."""
    return line.rsplit(" : ", 1)[1].strip() if " : " in line else ""


def _functions(text: str) -> dict[str, list[str]]:
    funcs, cur, base = {}, None, 0
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            cur, base = m.group(2), len(m.group(1))
            funcs[cur] = []
            continue
        if cur is not None:
            if line.strip() == "}" and len(line) - len(line.lstrip()) == base:
                cur = None
                continue
            funcs[cur].append(line)
    return funcs


def emitter_skeleton(text: str) -> str:
    """The loops, branches and Baton custom calls of a program's StableHLO (see the module
    docstring), indented by nesting."""
    funcs = _functions(text)

    def walk(name: str, depth: int, out: list[str], seen: tuple) -> None:
        lines = funcs[name]
        base = min((len(ln) - len(ln.lstrip()) for ln in lines if ln.strip()), default=0)
        for line in lines:
            s = line.strip()
            ind = "  " * (depth + (len(line) - len(line.lstrip()) - base) // 2)
            if "stablehlo.while" in s:
                out.append(f"{ind}while carries {_signature(s)}")
            elif s.startswith("} do {"):
                out.append(f"{ind}do")
            elif "stablehlo.case" in s:
                out.append(f"{ind}case")
            elif s == "}, {":
                out.append(f"{ind}branch")
            elif _CUSTOM.search(s):
                target = _CUSTOM.search(s).group(1)
                if target.startswith("baton_"):
                    attrs = {k: v for k, v in sorted(_attrs(s).items()) if k != "comm"}
                    args = " ".join(f"{k}={v}" for k, v in attrs.items())
                    out.append(f"{ind}{target}{' ' + args if args else ''} : {_signature(s)}")
            else:
                m = _CALL.search(s)
                if m and m.group(1) in funcs and m.group(1) not in seen:
                    walk(m.group(1), len(ind) // 2, out, seen + (m.group(1),))

    out: list[str] = []
    walk("main", 0, out, ("main",))
    return "\n".join(out) + "\n"


# -- the cases ---------------------------------------------------------------------------------

SCHEDULES = {"1f1b": baton.OneFOneB, "interleaved": lambda: baton.Interleaved1F1B(2),
             "zbh1": baton.ZBH1}


@pytest.mark.parametrize("name", ["1f1b", "zbh1"])
def test_partition_text(name):
    """The partition of the test MLP for 2 ranks: a full backward (1F1B) and a split one
    (ZB-H1: I and W)."""
    from mlp_step import make

    ps, params, batch = make(SCHEDULES[name](), 2, 4)
    cs = ps.compile(params, batch)
    check_golden(f"partition_mlp_{name}.txt",
                 normalize_partition(cs.partition.to_text(cs.traced.program)))


@pytest.mark.parametrize("name", ["1f1b", "interleaved"])
def test_emitted_rank_programs(name):
    """Every rank's compiled program for the test MLP on 2 ranks, 4 microbatches."""
    from mlp_step import make

    ps, params, batch = make(SCHEDULES[name](), 2, 4)
    ps(params, batch)
    progs = ps.last.engine.local_progs
    assert len(progs) == 2
    text = "".join(f"# rank {p.rank}\n" + emitter_skeleton(p.lowered_text()) for p in progs)
    check_golden(f"emit_mlp_{name}.txt", text)


def test_skeleton_keeps_what_baton_decides():
    """The normalization drops names, numbering and metadata, but not a custom call's
    attributes, its types, or a loop's carries."""
    text = """module @jit_f attributes {mhlo.num_partitions = 1 : i32} {
  func.func public @main(%arg0: tensor<4xf32>) -> (tensor<i32>) {
    %0:2 = stablehlo.while(%iterArg = %c, %iterArg_1 = %arg0) : tensor<i32>, tensor<4xf32>
    cond {
      stablehlo.return %1 : tensor<i1>
    } do {
      %2 = func.call @helper_7(%iterArg) : (tensor<i32>) -> tensor<i32>
      stablehlo.return %2, %iterArg_1 : tensor<i32>, tensor<4xf32>
    } loc(#loc3)
    %9 = stablehlo.custom_call @baton_drain(%0#0) {backend_config = "", has_side_effect = true, mhlo.backend_config = {comm = 3 : i64}} : (tensor<i32>) -> tensor<i32>
    return %9 : tensor<i32>
  }
  func.func private @helper_7(%arg0: tensor<i32>) -> tensor<i32> {
    %0 = stablehlo.custom_call @baton_comm(%arg0) {mhlo.backend_config = {channels = dense<[0, 1]> : tensor<2xi32>, comm = 3 : i64, kinds = dense<1> : tensor<2xi32>, peers = dense<1> : tensor<2xi32>, stages = dense<[0, 1]> : tensor<2xi32>}} : (tensor<i32>) -> tensor<i32>
    return %0 : tensor<i32>
  }
}
"""
    assert emitter_skeleton(text) == (
        "while carries tensor<i32>, tensor<4xf32>\n"
        "do\n"
        "  baton_comm channels=[0, 1] kinds=[1, 1] peers=[1, 1] stages=[0, 1] : "
        "(tensor<i32>) -> tensor<i32>\n"
        "baton_drain : (tensor<i32>) -> tensor<i32>\n")
    part = "partition: 2 stages\nF0: 4 ops, cost 2192\n  act_out: %15 %3 (256 bytes)\n" \
           "B0: 7 ops, cost 2.5e+03\n  stash_in: %15 (256 bytes)\n"
    assert normalize_partition(part) == (
        "partition: 2 stages\nF0:\n  act_out: %v0 %v1 (256 bytes)\nB0:\n"
        "  stash_in: %v0 (256 bytes)\n")
