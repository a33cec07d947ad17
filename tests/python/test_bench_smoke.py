"""bench/smoke.py, the smoke pass over every benchmark: it knows every script under bench/
(a case, or excluded with a reason), so a new benchmark cannot escape it, and its checks can
fail. The pass itself (every script at its smoke size, a few minutes) runs in CI as a step of
its own: ``.venv/bin/python bench/smoke.py``."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def _smoke():
    spec = importlib.util.spec_from_file_location("bench_smoke", BENCH / "smoke.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_smoke"] = mod
    spec.loader.exec_module(mod)
    return mod


smoke = _smoke()


def _scripts() -> set[str]:
    """The benchmark scripts of the repository: git's tracked ``bench/*.py`` (a file someone
    is still writing is not one yet), every ``bench/*.py`` outside a git work tree."""
    try:
        p = subprocess.run(["git", "ls-files", "bench/*.py"], cwd=BENCH.parent,
                           capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return {p.name for p in BENCH.glob("*.py")}
    return {pathlib.PurePath(line).name for line in p.stdout.split()}


def test_every_script_is_a_case_or_excluded_with_a_reason():
    scripts = _scripts()
    cases = [c.script for c in smoke.CASES]
    assert len(cases) == len(set(cases)), "a script with two cases"
    listed = set(cases) | set(smoke.EXCLUDED) | set(smoke.NOT_SCRIPTS)
    assert scripts - listed == set(), "benchmarks without a smoke case"
    assert listed - scripts == set(), "smoke entries for scripts that do not exist"
    assert not (set(cases) & (set(smoke.EXCLUDED) | set(smoke.NOT_SCRIPTS)))
    assert all(why.strip() for why in {**smoke.EXCLUDED, **smoke.NOT_SCRIPTS}.values())


def test_no_case_writes_into_results():
    for c in smoke.CASES:
        assert not any("results" in a for a in c.args), c.script


@pytest.mark.parametrize("stdout,ok", [
    ("| a | b |\n|---|---|\n| 1 | 2 |\n", True),
    ("| a | b |\n|---:|:---|\n", True),
    ("done in 3 s\n", False),
    ("| a | b |\n", False),
])
def test_markdown_table_check(stdout, ok):
    import re

    assert bool(re.search(smoke.MARKDOWN_TABLE, stdout)) == ok


def test_a_failing_script_fails_the_case(tmp_path, monkeypatch):
    """A script that exits non-zero, or exits 0 without its table, is a failed case."""
    (tmp_path / "bad.py").write_text("import sys\nprint('| a |\\n|---|')\nsys.exit(3)\n")
    (tmp_path / "quiet.py").write_text("print('no table')\n")
    (tmp_path / "good.py").write_text("print('| a |\\n|---|\\n| 1 |')\n")
    monkeypatch.setattr(smoke, "HERE", tmp_path)
    bad = smoke.run_case(smoke.Case("bad.py"))
    assert not bad.ok and "exit code 3" in bad.why
    quiet = smoke.run_case(smoke.Case("quiet.py"))
    assert not quiet.ok and "no table" in quiet.why
    assert smoke.run_case(smoke.Case("good.py")).ok


def test_a_verdict_exit_code_passes_only_with_its_table(tmp_path, monkeypatch):
    """A case may accept the exit code of a verdict on its numbers (bench/soak.py's 1), but
    never without the report."""
    (tmp_path / "verdict.py").write_text("import sys\nprint('| a |\\n|---|')\nsys.exit(1)\n")
    (tmp_path / "crash.py").write_text("raise SystemExit(1)\n")
    monkeypatch.setattr(smoke, "HERE", tmp_path)
    assert smoke.run_case(smoke.Case("verdict.py", exit_ok=(0, 1))).ok
    assert not smoke.run_case(smoke.Case("verdict.py")).ok
    crash = smoke.run_case(smoke.Case("crash.py", exit_ok=(0, 1)))
    assert not crash.ok and "no table" in crash.why
