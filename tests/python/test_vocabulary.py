"""One vocabulary: python/baton reads the rank IR's instruction ops as the C++ enums
(``_core.ItemOp``, ``_core.runtime.CommOpKind``, docs/RANK_IR.md "Vocabularies"), never as
strings; it keeps no copy of a C++ enum's values and does no buffer-id arithmetic (the rows
of the dense buffer ids come from ``Plan.buffer_row`` / ``row_key`` / ``num_buffer_rows``).
Plan buffer kinds are ``_core.BufKind`` values: buffer keys ``(BufKind, stage,
microbatch)``, a task's output groups (``tasks.OUT_GROUPS``) keyed by them, never the kinds'
names or lower-case group names. Each check is a ``git grep`` over python/baton (or the
part of it that ``SCOPES`` names) whose output must be empty."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

ITEM_OPS = "run|send|post|wait|recv|free|accumulate"
# task kinds (``_core.TaskKind``, the fused ``tasks.FUSED_FB``) and plan opcodes
# (``_core.OpCode``) as their names
KIND_NAMES = "F|B|W|I|FB|RUN|SEND|RECV|FREE|POST|WAIT|ACCUMULATE"
# plan buffer kinds (``_core.BufKind``) by name, and the lower-case names task output groups
# had; "stash" on its own is also the user's ``offload="stash"`` option (see SCOPES)
BUF_NAMES = "Act|Grad|Stash|WStash|WGrad|Skip|SkipGrad|act|grad|wstash|wgrad"


def _as_string(names: str) -> str:
    """A string literal of one of ``names`` used as a value: compared, subscripted, a key
    or member of a tuple or dict, or looked up."""
    q = rf"""["']({names})["']"""
    return (rf"(==|!=|\bin)\s*\(?\s*{q}|\[\s*{q}\s*\]|\(\s*{q}\s*,|,\s*{q}\s*[,)]"
            rf"""|[{{,]\s*{q}\s*:\s*["'A-Za-z_(\[{{]|\.get\(\s*{q}""")

# (what must not be there, the extended regular expression that finds it)
PATTERNS = {
    "an item op compared as a string":
        rf'(\bop|\.op|\bit\[0\]|\bitems\[[a-z]+\]\[0\])\s*(==|!=)\s*"({ITEM_OPS})"'
        rf'|\bop\s+(not\s+)?in\s+\(\s*"({ITEM_OPS})"',
    "a copy of a C++ enum (op name -> value)":
        r'\{\s*"(send|post|wait|run|SEND|POST|WAIT|RUN)"\s*:\s*[0-9]',
    "buffer-id arithmetic (dense id = row * M + microbatch)":
        r'(num_buffer_ids\(\)|\bid\b|\.id\([^)]*\))\s*//\s*(M|cs\.M)\b|\brow\s*\*\s*(M|cs\.M)\b',
    "a task kind or event opcode compared as a string":
        rf"""\b(kind|op|opcode|k)\s*(==|!=|(not\s+)?in)\s*\(?\s*["']({KIND_NAMES})["']"""
        rf"""|\bfor\s+(kind|op|opcode|k)\s+in\s+\(\s*["']({KIND_NAMES})["']""",
    "a plan buffer kind as a string": _as_string(BUF_NAMES),
    "a task output group named stash": _as_string("stash"),
    "a buffer kind taken by its name into a key":
        r"(\(|,)\s*[A-Za-z_.]*\.(kind|buffer)\.name\s*,",
    "a traced op's region or kind as a string (_core.graph.Region, OpKind)":
        r"""\.(region|kind)\s*(==|!=)\s*["'](pre|loop|post|compute|boundary|add_any)["']"""
        r"""|\b(region|kind)\s*=\s*["'](pre|loop|post|compute|boundary|add_any)["']""",
}
# where a check looks, when not all of python/baton
SCOPES = {
    "a task output group named stash":
        ("python/baton/tracing", "python/baton/planning", "python/baton/emit",
         "python/baton/running", "python/baton/measure", "python/baton/frontend",
         ":!python/baton/planning/offload.py"),
}


def git_grep(pattern: str, *paths: str) -> str:
    p = subprocess.run(["git", "grep", "-nE", pattern, "--", *paths], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode in (0, 1), p.stderr  # 1: no match
    return p.stdout


needs_git = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(),
    reason="needs git and the repository's work tree")


@needs_git
@pytest.mark.parametrize("what", list(PATTERNS))
def test_python_baton_has_none(what):
    assert git_grep(PATTERNS[what], *SCOPES.get(what, ("python/baton",))) == "", what


@needs_git
@pytest.mark.parametrize("what,line", [
    ("an item op compared as a string", 'if op == "send":'),
    ("an item op compared as a string", 'if it.op != "run":'),
    ("an item op compared as a string", 'if op in ("send", "post"):'),
    ("a copy of a C++ enum (op name -> value)", '_K = {"send": 0, "post": 1}'),
    ("buffer-id arithmetic (dense id = row * M + microbatch)", "r = bufs.id(k, s, 0) // M"),
    ("buffer-id arithmetic (dense id = row * M + microbatch)", "b = key(row * M)"),
    ("a task kind or event opcode compared as a string", 'if t.kind == "F":'),
    ("a task kind or event opcode compared as a string", 'elif kind in ("B", "I"):'),
    ("a task kind or event opcode compared as a string", 'if kind == "FB":'),
    ("a task kind or event opcode compared as a string", 'if op == "RUN":'),
    ("a task kind or event opcode compared as a string", 'if op != "SEND":'),
    ("a task kind or event opcode compared as a string", "e.op == 'RECV'"),
    ("a task kind or event opcode compared as a string",
     'recvs = [e for e in evs if e.op == "RECV"]'),
    ("a task kind or event opcode compared as a string", 'if op in ("SEND", "RECV"):'),
    ("a task kind or event opcode compared as a string", 'for k in ("F", "B"):'),
    ("a plan buffer kind as a string", 'if key[0] != "WGrad":'),
    ("a plan buffer kind as a string", "if kind in ('Skip', 'SkipGrad'):"),
    ("a plan buffer kind as a string", 'self._avals[("Act", t.stage)] = avals'),
    ("a plan buffer kind as a string", '_CROSSING = ("Act", "Grad")'),
    ("a plan buffer kind as a string", 'bufs.get(("WStash", s), {})'),
    ("a plan buffer kind as a string", '_GROUP_OF = {"Act": "act", "Grad": "grad"}'),
    ("a plan buffer kind as a string", 'got["wgrad"] = wgot["wgrad"]'),
    ("a plan buffer kind as a string", 'OUT_GROUPS = ("act", "grad", "mb")'),
    ("a plan buffer kind as a string", 'for g, idx in (("wgrad", body[0]), ("mb", body[1])):'),
    ("a task output group named stash", 'if kind == FUSED_FB and g == "stash":'),
    ("a task output group named stash", 'outs = {"stash": [], "act": []}'),
    ("a buffer kind taken by its name into a key", "k = (bk.kind.name, bk.stage, m)"),
    ("a buffer kind taken by its name into a key", "Item(x.op, x.buffer.name, x.stage)"),
    ("a traced op's region or kind as a string (_core.graph.Region, OpKind)",
     'pre = [op for op in ops if op.region == "pre"]'),
    ("a traced op's region or kind as a string (_core.graph.Region, OpKind)",
     'if op.kind != "compute":'),
    ("a traced op's region or kind as a string (_core.graph.Region, OpKind)",
     'info.kind = "boundary"'),
])
def test_the_patterns_find_what_they_forbid(what, line):
    import re

    assert re.search(PATTERNS[what], line), (what, line)


@pytest.mark.parametrize("what,line", [
    ("a plan buffer kind as a string", 'raise ConfigError("the Act buffer of stage 1")'),
    ("a plan buffer kind as a string", "print(f\"{'grad':>6} {'param':>6}\")"),
    ("a task output group named stash", 'offload: ``"stash"`` (every stage\'s stash)'),
    ("a buffer kind taken by its name into a key", "return act.first.kind.name"),
])
def test_the_patterns_leave_messages_and_names_alone(what, line):
    import re

    assert not re.search(PATTERNS[what], line), (what, line)
