"""Every benchmark under bench/ at a smoke size: each script runs as a subprocess with the
smallest arguments that still take its whole code path, and must exit 0 (or with the code of a
verdict on its numbers, which are not checked) and print its table. Prints a table of the cases with their wall times; exits
non-zero if any case fails.
    .venv/bin/python bench/smoke.py [-k NAME] [--list]
    .venv-maxtext/bin/python bench/smoke.py --maxtext      # the scripts that need MaxText
The scripts compile with XLA's optimizations off (as scripts/test.sh's default pass does) and
write any report into a temporary directory, never into bench/results/. Every ``*.py`` under
bench/ is either a case here or listed in ``NOT_SCRIPTS`` / ``EXCLUDED`` with the reason
(tests/python/test_bench_smoke.py checks that, so a new benchmark cannot be left out).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent

# A markdown table's separator row: "|---|---|" (alignment colons allowed).
MARKDOWN_TABLE = r"(?m)^\|(\s*:?-{3,}:?\s*\|)+\s*$"


@dataclasses.dataclass(frozen=True)
class Case:
    """One smoke run of a benchmark script."""
    script: str
    args: tuple[str, ...] = ()
    # what the report must contain (a regular expression), searched in stdout or, with
    # ``report``, in that file of the temporary directory
    table: str = MARKDOWN_TABLE
    report: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    maxtext: bool = False          # needs MaxText (runs in .venv-maxtext with --maxtext)
    # exit codes that pass: a script whose exit code is a verdict on its numbers (which a
    # smoke run does not judge) lists that code too; its table must still be printed
    exit_ok: tuple[int, ...] = (0,)
    timeout: float = 300.0

    @property
    def name(self) -> str:
        return self.script.removesuffix(".py")


# Files under bench/ that are not benchmarks of their own.
NOT_SCRIPTS = {
    "smoke.py": "this driver",
    "timing.py": "helpers the benchmarks import",
    "chaos_procs.py": "the worker processes of chaos.py (run by its case)",
    "chaos_report.py": "chaos.py's report (run by its case)",
    "chaos_worker.py": "one process of chaos.py and soak.py (run by their cases)",
}

# Benchmarks the smoke pass cannot run on a CPU-only machine.
EXCLUDED = {
    "gpu_check.py": "needs an NVIDIA GPU; its --dry-run (every row's plumbing, on CPU) is "
                    "tests/python/test_gpu_check_dry.py",
    "gpu_check_gpt.py": "needs an NVIDIA GPU (run by bench/gpu_check.py)",
    "gpu_check_single.py": "needs an NVIDIA GPU (run by bench/gpu_check.sh on a GPU machine)",
    "gpu_check_pipe_tensor.py": "needs 4 NVIDIA GPUs (run by bench/gpu_check.sh)",
    "gpu_check_shared.py": "rows of bench/gpu_check.py (two processes on one GPU); its dry run "
                           "runs them on CPU (tests/python/test_gpu_check_dry.py)",
    "gpu_check_faults.py": "rows of bench/gpu_check.py (failure paths on a GPU); its dry run "
                           "lists each check (tests/python/test_gpu_check_dry.py)",
}

CASES = (
    Case("autoplan.py", ("--layers", "4", "--runs", "1", "--vocab", "64", "--dim", "16",
                         "--batch", "8", "--steps", "1", "--budget", "0")),
    Case("autoplan_pinned.py", ("--layers", "4", "--runs", "1", "--vocab", "64", "--dim", "16",
                                "--steps", "1", "--budget", "0", "--top", "1",
                                "--raw", "{tmp}/raw.json")),
    # run 0 of seed 1: 2 processes, one killed while compiling
    Case("chaos.py", ("--runs", "1", "--seed", "1", "--timeout", "10", "--limit", "40",
                      "--hard", "60", "--out", "{tmp}/chaos.md"), report="chaos.md"),
    Case("compile_parts.py", ("--ranks", "2")),
    Case("compile_time.py", ("--ranks", "2", "--layers", "2", "--schedules", "1f1b")),
    Case("executor_bench.py", ("--schedules", "1f1b", "--ranks", "1,2", "--microbatches", "4",
                               "--steps", "2")),
    Case("ffi_transfer.py", ("--sizes", "4K", "--transports", "local", "--iters", "5")),
    Case("first_call_phases.py", ("--ranks", "2", "--schedules", "1f1b", "--repeat", "1")),
    Case("handshake_cost.py", (), table=r"describe [0-9.]+s"),
    Case("memory.py", ("--dim", "16", "--seq", "8", "--batch", "4", "--microbatches", "2",
                       "--schedules", "1f1b",
                       "--configs", "gpt pipe 2 x data 2 x tensor 2,gpt pipe 4 compiled")),
    Case("offload.py", ("--smoke",)),
    Case("one_rank.py", ("--schedules", "1f1b", "--dims", "32", "--rounds", "1",
                         "--microbatches", "2", "--mb-size", "1", "--seq", "8")),
    Case("pinned.py", ("--schedules", "1f1b", "--one-rank", "1f1b", "--microbatches", "2",
                       "--mb-size", "1", "--seq", "8", "--dim", "32", "--steps", "1")),
    Case("pinned_ab.py", ("--schedules", "1f1b", "--dim", "32", "--rounds", "1",
                          "--microbatches", "2", "--mb-size", "1", "--seq", "8")),
    Case("pipeline.py", ("--schedules", "1f1b", "--ranks", "2", "--microbatches", "2",
                         "--mb-size", "1", "--seq", "8", "--dim", "32", "--steps", "1")),
    Case("plan_search.py", ("--smoke", "--out", "{tmp}/plan_search.md"),
         report="plan_search.md"),
    Case("scale.py", ("--no-best",), table=r"(?m)^\|.*\|\s*$"),
    Case("schedule_choice.py", ("--ranks", "2", "--microbatches", "4")),
    # exit 1: "grows" (a handful of samples cannot show flat resources); a failed run prints
    # no report
    Case("soak.py", ("--steps", "4", "--every", "2", "--warmup", "2",
                     "--out", "{tmp}/soak.md"), table=r"Verdict: \*\*", exit_ok=(0, 1)),
    Case("spmd.py", ("--dim", "32", "--seq", "8", "--batch", "8", "--microbatches", "2",
                     "--steps", "1", "--schedules", "1f1b")),
    Case("stage_costs.py", ("--dim", "32", "--seq", "8", "--microbatches", "2",
                            "--rounds", "1")),
    Case("table_memory.py", ("--ranks", "2", "--dim", "32", "--schedules", "1f1b")),
    Case("transport_bench.py", ("--sizes", "4K", "--iters", "2",
                                "--transports", "local,gloo,gloo-2p")),
    Case("maxtext.py", ("--steps", "1", "--schedules", "1f1b"), maxtext=True, timeout=900),
    Case("maxtext_pinned.py", ("--steps", "1", "--schedules", "1f1b"), maxtext=True,
         timeout=900),
)


@dataclasses.dataclass
class Outcome:
    case: Case
    ok: bool
    seconds: float
    why: str = ""
    tail: str = ""


def environment() -> dict[str, str]:
    """The scripts' environment: XLA's optimizations off (compiling is most of a smoke run),
    no persistent compilation cache unless the caller set one."""
    env = dict(os.environ)
    env.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    env.setdefault("JAX_OPTIMIZATION_LEVEL", "O0")
    return env  # baton as installed in the interpreter's environment (scripts/setup.sh)


def run_case(case: Case) -> Outcome:
    with tempfile.TemporaryDirectory(prefix=f"smoke-{case.name}-") as tmp:
        args = [a.replace("{tmp}", tmp) for a in case.args]
        env = environment()
        env.update(case.env)
        t0 = time.monotonic()
        try:
            p = subprocess.run([sys.executable, str(HERE / case.script), *args], cwd=ROOT,
                               env=env, capture_output=True, text=True, timeout=case.timeout)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
                else (e.stdout or "")
            return Outcome(case, False, time.monotonic() - t0,
                           f"no exit within {case.timeout:g} s", out[-3000:])
        seconds = time.monotonic() - t0
        text = p.stdout
        if case.report:
            path = pathlib.Path(tmp) / case.report
            text = path.read_text() if path.exists() else ""
        tail = (p.stdout + "\n" + p.stderr)[-3000:]
        if p.returncode not in case.exit_ok:
            return Outcome(case, False, seconds, f"exit code {p.returncode}", tail)
        if not re.search(case.table, text):
            where = case.report or "stdout"
            return Outcome(case, False, seconds, f"no table in {where}", tail)
        return Outcome(case, True, seconds)


def select(maxtext: bool, names: list[str] | None) -> list[Case]:
    cases = [c for c in CASES if c.maxtext == maxtext]
    if names:
        cases = [c for c in cases if any(n in c.name for n in names)]
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--maxtext", action="store_true",
                    help="run the scripts that need MaxText (in .venv-maxtext)")
    ap.add_argument("-k", action="append", help="only the cases whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    a = ap.parse_args(argv)
    cases = select(a.maxtext, a.k)
    if a.list:
        for c in cases:
            print(c.script, " ".join(c.args))
        return 0
    if not cases:
        print("no case selected", file=sys.stderr)
        return 2
    outcomes = []
    for c in cases:
        o = run_case(c)
        outcomes.append(o)
        print(f"{c.name}: {'ok' if o.ok else 'FAILED (' + o.why + ')'} {o.seconds:.1f} s",
              file=sys.stderr, flush=True)
        if not o.ok:
            print(o.tail, file=sys.stderr, flush=True)
    print("| script | arguments | result | wall s |")
    print("|---|---|---|---|")
    for o in outcomes:
        print(f"| {o.case.script} | `{' '.join(o.case.args)}` | "
              f"{'ok' if o.ok else 'FAILED: ' + o.why} | {o.seconds:.1f} |")
    print(f"\n{sum(o.ok for o in outcomes)} of {len(outcomes)} passed, "
          f"{sum(o.seconds for o in outcomes):.0f} s")
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
