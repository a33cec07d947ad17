"""First contact with a GPU: what Baton's CUDA path does on one lent GPU, told truthfully.

    python bench/gpu_check.py              # on the GPU machine (bench/gpu_check.sh runs it)
    python bench/gpu_check.py --dry-run    # anywhere: every row's plumbing, no GPU needed

Each row prints one line ``ROW name|PASS|FAIL|INFO|detail``. Rows that need more than the
machine has (two GPUs and more, several nodes) are not rows: the last line,
``UNTESTED: ...``, lists them. The exit status is 1 when any row that this hardware can run
did not run or failed (a row that is not written yet is a FAIL saying so; a missing GPU
fails every GPU row), else 0.

The dry run reaches every row in the same order with the same names, runs each row's
host-side part (the environment, the HLO host-sync check on a CPU rank program, the
reservation arithmetic) and reports the GPU part as INFO "dry run"; its exit status is 0 when
every row was reached and printed in the ROW format. tests/python/test_gpu_check_dry.py runs
both modes on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
STATUSES = ("PASS", "FAIL", "INFO")
UNTESTED = ("two GPUs and more (NCCL between ranks on different GPUs, pipe x tensor)",
            "several nodes (NCCL over the network)")


@dataclasses.dataclass(frozen=True)
class Result:
    status: str  # PASS, FAIL or INFO
    detail: str


@dataclasses.dataclass(frozen=True)
class Context:
    dry: bool  # the dry run: no GPU work
    gpu: bool  # a CUDA device is visible to JAX


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    gpu: bool  # needs a GPU (else it runs anywhere)
    run: Callable[[Context], Result]


def emit(name: str, result: Result) -> None:
    detail = " ".join(result.detail.split()).replace("|", "/")
    print(f"ROW {name}|{result.status}|{detail}", flush=True)


# ------------------------------------------------------------------ host-side parts

def environment_facts() -> dict[str, str]:
    """Versions, the variables that change the CUDA path, and the libnccl copies mapped
    before and after Baton loads NCCL."""
    import jax
    import jaxlib

    facts = {"python": sys.version.split()[0], "jax": jax.__version__,
             "jaxlib": jaxlib.__version__}
    try:
        from importlib.metadata import version
        facts["cuda plugin"] = version("jax-cuda13-plugin")
    except Exception:  # noqa: BLE001
        facts["cuda plugin"] = "none"
    for k in sorted(os.environ):
        if (k in ("XLA_FLAGS", "CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS",
                  "CUDA_VISIBLE_DEVICES") or k.startswith("XLA_PYTHON_CLIENT_")
                or k.startswith("NCCL_")):
            facts[k] = os.environ[k]
    from baton import _core
    rt = _core.runtime
    facts["libnccl before baton"] = ",".join(rt.mapped_libraries("libnccl")) or "none"
    try:
        facts["backend"] = jax.default_backend()
        devs = jax.devices()
        facts["devices"] = f"{len(devs)} x {devs[0].device_kind}"
        stats = devs[0].memory_stats() or {}
        if "bytes_limit" in stats:
            facts["xla memory limit"] = f"{stats['bytes_limit'] / 2**30:.1f} GiB"
    except RuntimeError as e:
        facts["backend"] = f"error: {e}"
    path, code, was_mapped, err = rt.nccl_library()
    facts["libnccl baton uses"] = (f"{path} ({code}, {'JAX' if was_mapped else 'Baton'} loaded "
                                   f"it)" if path else f"none: {err}")
    facts["libnccl after baton"] = ",".join(rt.mapped_libraries("libnccl")) or "none"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30).stdout.strip()
        facts["nvidia-smi"] = out.splitlines()[0] if out else "no GPU"
    except (OSError, subprocess.SubprocessError):
        facts["nvidia-smi"] = "not installed"
    return facts


# An HLO instruction line: "%name = <shape> <opcode>(operands), attributes"; the shape ends
# in "]", "}" or ")" (a tuple).
_SHAPE = r"%\S+\s*=\s*[^=]*?[\]\}\)]\s+"
_CONDITIONAL = re.compile(_SHAPE + r"conditional\(")
_WHILE = re.compile(_SHAPE + r"while\(")


@dataclasses.dataclass(frozen=True)
class HostSyncs:
    loops: int  # while loops in the module
    syncs: list  # the operations that wait for the host, described


def host_syncs(hlo_text: str) -> HostSyncs:
    """The operations of an optimized HLO module that make XLA's GPU runtime wait for the
    host each time they run: conditionals (the branch index is copied to the host) and
    while loops without a known trip count (the condition is), and how many while loops
    there are."""
    syncs, loops = [], 0
    for line in hlo_text.splitlines():
        if _CONDITIONAL.search(line):
            syncs.append("conditional " + line.split("=")[0].strip())
        elif _WHILE.search(line):
            loops += 1
            if "known_trip_count" not in line:
                syncs.append("while without a known trip count " + line.split("=")[0].strip())
    return HostSyncs(loops, syncs)


def rank_program_hlo(ranks: int) -> list[str]:
    """The optimized HLO of each rank program of a small pipelined step, straight loop
    form (the GPU form), on this machine's backend."""
    os.environ.setdefault("BATON_LOOP_FORM", "straight")
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    import baton
    from mlp_step import make

    ps, params, batch = make(baton.OneFOneB(), ranks, 4)
    ps(params, batch)
    eng = ps.last.engine
    progs = eng.local_progs if ranks > 1 else []
    if not progs:
        return [eng.single.compiled.as_text()] if getattr(eng.single, "compiled", None) else []
    return [p.compiled.as_text() for p in progs if p.compiled is not None]


# ------------------------------------------------------------------------------- rows

def not_written(what: str) -> Callable[[Context], Result]:
    def run(ctx: Context) -> Result:
        if ctx.dry:
            return Result("INFO", f"dry run: reached; on a GPU this row FAILs: {what}")
        return Result("FAIL", f"did not run: {what}")
    return run


def row_environment(ctx: Context) -> Result:
    facts = environment_facts()
    detail = "; ".join(f"{k} {v}" for k, v in facts.items())
    if not ctx.dry and not ctx.gpu:
        return Result("FAIL", "no CUDA device visible to JAX; " + detail)
    return Result("INFO", detail)


def row_build(ctx: Context) -> Result:
    from baton import _core
    built = _core.ffi.has_cuda() and _core.runtime.NcclRankComm.built()
    detail = (f"CUDA handlers {'built' if _core.ffi.has_cuda() else 'NOT built'}; "
              f"NcclRankComm {'built' if _core.runtime.NcclRankComm.built() else 'NOT built'}")
    if ctx.dry:
        return Result("INFO", "dry run: " + detail)
    return Result("PASS" if built else "FAIL", detail)


def row_scan_hlo(ctx: Context) -> Result:
    texts = rank_program_hlo(1 if ctx.gpu else 2)
    if not texts:
        return Result("FAIL", "no compiled rank program to inspect")
    found = [host_syncs(t) for t in texts]
    syncs = [s for f in found for s in f.syncs]
    loops = sum(f.loops for f in found)
    detail = (f"{len(texts)} rank program(s) on {'GPU' if ctx.gpu else 'CPU'}, straight form, "
              f"{loops} while loop(s): "
              + ("no conditional, every while loop with a known trip count" if not syncs
                 else "; ".join(syncs[:3])))
    bad = bool(syncs) or loops == 0  # no loop at all: the rank loop was not found
    if ctx.dry:
        return Result("FAIL" if bad else "INFO", "dry run (CPU HLO): " + detail)
    return Result("FAIL" if bad else "PASS", detail)


def row_command_buffers(ctx: Context) -> Result:
    if ctx.dry:
        return Result("INFO", "dry run: reached; on a GPU reruns the rank loop with "
                      "XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL... "
                      "(not written yet: FAILs there)")
    return Result("FAIL", "did not run: the command-buffer rerun is not written yet")


def row_single(name: str) -> Callable[[Context], Result]:
    """A row of bench/gpu_check_single.py (run in a process of its own once)."""
    def run(ctx: Context) -> Result:
        if ctx.dry:
            return Result("INFO", f"dry run: reached; on a GPU: gpu_check_single.py's "
                          f"'{name}'")
        out = _single_output()
        for line in out.splitlines():
            if line.startswith(f"ROW {name}|"):
                _, status, detail = line.split("|", 2)
                return Result(status, detail)
        return Result("FAIL", f"did not run: {' '.join(out.splitlines()[-3:])}")
    return run


_SINGLE: list[str] = []


def _single_output() -> str:
    if not _SINGLE:
        p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check_single.py")],
                           capture_output=True, text=True, timeout=240)
        _SINGLE.append(p.stdout + p.stderr)
    return _SINGLE[0]


def row_reservation(ctx: Context) -> Result:
    if ctx.dry:
        return Result("INFO", "dry run: reached; on a GPU this row FAILs: the staging "
                      "reservation for the transfers in flight at once, with its bytes "
                      "reported, is not written yet")
    return Result("FAIL", "did not run: the staging reservation for the transfers in flight "
                  "at once, with its bytes reported, is not written yet")


def row_gpt_one_rank(ctx: Context) -> Result:
    if ctx.dry:
        return Result("INFO", "dry run: reached; on a GPU: a one-rank GPT step (baton.jit) "
                      "against jax.jit, results to rtol 1e-5 and ms/step")
    code = (ROOT / "bench" / "gpu_check_gpt.py")
    p = subprocess.run([sys.executable, str(code)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=f"{ROOT / 'examples'}:"
                                + os.environ.get("PYTHONPATH", "")))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(("equal:", "time:"))]
    if p.returncode == 0 and len(lines) == 2:
        return Result("PASS", " ".join(lines))
    return Result("FAIL", f"rc={p.returncode} {' '.join((p.stdout + p.stderr).splitlines()[-3:])}")


HOST_STAGED = ("the host-staged transport for ranks sharing one GPU is not written yet, so two "
               "processes cannot share the GPU")

ROWS: list[Row] = [
    Row("environment", False, row_environment),
    Row("build", True, row_build),
    Row("scan loop: no host syncs in the HLO", False, row_scan_hlo),
    Row("scan loop under command buffers", True, row_command_buffers),
    Row("nccl one-rank communicator (NcclRankComm self link)", True,
        row_single("self link (FFI, fori_loop)")),
    Row("failure: peer never arrives", True, row_single("peer never arrives")),
    Row("failure: wait before its send", True, not_written("the row is not written yet")),
    Row("failure: abort from another thread mid-run", True,
        not_written("the row is not written yet")),
    Row("failure: close with transfers pending", True, not_written("the row is not written yet")),
    Row("one libnccl mapped", True, row_single("one libnccl mapped")),
    Row("implicit sync probe", True, row_single("implicit sync probe")),
    Row("switch vs straight", True, row_single("switch vs straight")),
    Row("memory: staging reservation", True, row_reservation),
    Row("memory: XLA_PYTHON_CLIENT_MEM_FRACTION=.95", True,
        not_written("the row is not written yet")),
    Row("two processes on one GPU: 1F1B", True, not_written(HOST_STAGED)),
    Row("two processes on one GPU: ZB-H1", True, not_written(HOST_STAGED)),
    Row("two processes on one GPU: interleaved", True, not_written(HOST_STAGED)),
    Row("one-rank GPT vs jax.jit", True, row_gpt_one_rank),
]


def has_gpu() -> bool:
    import jax
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="every row's plumbing, no GPU work")
    a = p.parse_args(argv)
    ctx = Context(dry=a.dry_run, gpu=False if a.dry_run else has_gpu())
    failed = []
    t0 = time.monotonic()
    for row in ROWS:
        if row.gpu and not ctx.dry and not ctx.gpu:
            result = Result("FAIL", "did not run: no CUDA device")
        else:
            try:
                result = row.run(ctx)
            except Exception as e:  # noqa: BLE001  (the row says what failed)
                traceback.print_exc()
                result = Result("FAIL", f"{type(e).__name__}: {e}")
        if result.status not in STATUSES:
            result = Result("FAIL", f"bad status {result.status!r}: {result.detail}")
        emit(row.name, result)
        if result.status == "FAIL":
            failed.append(row.name)
    print(f"# {len(ROWS)} rows in {time.monotonic() - t0:.0f} s; "
          f"{len(failed)} failed or did not run" + (f": {', '.join(failed)}" if failed else ""),
          flush=True)
    print("UNTESTED: " + "; ".join(UNTESTED), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
