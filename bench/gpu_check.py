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


def _scan_step(ranks: int):
    """The small pipelined step of the scan-loop rows (1F1B, 4 microbatches, rolled loop
    form), run once: (the step, its results as a list of arrays)."""
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    import jax
    import baton
    from mlp_step import make

    ps, params, batch = make(baton.OneFOneB(), ranks, 4, loop_form="rolled")
    out = jax.block_until_ready(ps(params, batch))
    return ps, jax.tree.leaves(out)


def rank_program_hlo(ranks: int, ps=None) -> list[str]:
    """The optimized HLO of each rank program of a small pipelined step, rolled loop
    form (the GPU form), on this machine's backend (of ``ps``, the step ``_scan_step``
    ran, when given)."""
    if ps is None:
        ps, _ = _scan_step(ranks)
    eng = ps.last.engine
    progs = eng.local_progs if ranks > 1 else []
    if not progs:
        return [eng.single.compiled.as_text()] if getattr(eng.single, "compiled", None) else []
    return [p.compiled.as_text() for p in progs if p.compiled is not None]


# XLA's command buffers (CUDA graphs) forced on for the kinds that cover the rank loop:
# fusions, cuBLAS(Lt) GEMMs, custom calls (Baton's FFI handlers among them), conditionals and
# while loops, with no minimum graph size. The baseline turns every kind off (an empty list;
# XLA's default list already records some).
COMMAND_BUFFERS_ON = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,"
                      "CONDITIONAL,WHILE --xla_gpu_graph_min_graph_size=1")
COMMAND_BUFFERS_OFF = "--xla_gpu_enable_command_buffer="


def scan_results(path: str, ranks: int) -> None:
    """The scan-loop step's results into ``path`` (.npz, arrays in order) and, as its last
    line, how many times the optimized HLO names a command buffer (run in a process of its
    own, under the XLA_FLAGS it was given)."""
    import numpy as np

    ps, leaves = _scan_step(ranks)
    np.savez(path, *[np.asarray(x) for x in leaves])
    texts = rank_program_hlo(ranks, ps)
    print(f"command_buffer mentions: {sum(t.count('command_buffer') for t in texts)}", flush=True)


def scan_command(path: str, ranks: int, flags: str) -> tuple[list[str], dict]:
    """The command line and environment that run ``scan_results`` under XLA_FLAGS ``flags``
    (added to the caller's)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(x for x in (env.get("XLA_FLAGS", ""), flags) if x)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--scan-results", path,
           "--ranks", str(ranks)]
    return cmd, env


# ------------------------------------------------------------------------------- rows

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
    detail = (f"{len(texts)} rank program(s) on {'GPU' if ctx.gpu else 'CPU'}, rolled form, "
              f"{loops} while loop(s): "
              + ("no conditional, every while loop with a known trip count" if not syncs
                 else "; ".join(syncs[:3])))
    bad = bool(syncs) or loops == 0  # no loop at all: the rank loop was not found
    if ctx.dry:
        return Result("FAIL" if bad else "INFO", "dry run (CPU HLO): " + detail)
    return Result("FAIL" if bad else "PASS", detail)


def row_command_buffers(ctx: Context) -> Result:
    import tempfile

    import numpy as np

    ranks = 1  # the scan-loop row's program on one GPU
    runs = {"off": COMMAND_BUFFERS_OFF, "on": COMMAND_BUFFERS_ON}
    if ctx.dry:
        cmd, env = scan_command("<tmp>/on.npz", ranks, COMMAND_BUFFERS_ON)
        return Result("INFO", f"dry run: reached; on a GPU runs the scan-loop row's program "
                      f"twice, each in a process of its own: XLA_FLAGS={env['XLA_FLAGS']!r} "
                      f"{' '.join(cmd[1:])}, and with {COMMAND_BUFFERS_OFF!r} (every kind off), "
                      "and compares the results exactly")
    tmp = tempfile.mkdtemp(prefix="baton-gpu-check-cmdbuf-")
    said, arrays = {}, {}
    for name, flags in runs.items():
        cmd, env = scan_command(f"{tmp}/{name}.npz", ranks, flags)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env,
                               cwd=ROOT)
        except subprocess.TimeoutExpired:
            return Result("FAIL", f"hung: the run with command buffers {name} gave no answer "
                          "within 180 s")
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("command_buffer mentions")]
        if p.returncode != 0 or not lines:
            return Result("FAIL", f"the run with command buffers {name} failed (rc="
                          f"{p.returncode}): {' '.join((p.stdout + p.stderr).splitlines()[-3:])}")
        said[name] = lines[-1].split(":")[1].strip()
        with np.load(f"{tmp}/{name}.npz") as z:
            arrays[name] = [z[f"arr_{i}"] for i in range(len(z.files))]
    a, b = arrays["off"], arrays["on"]
    same = len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape
                                    and np.array_equal(x, y) for x, y in zip(a, b))
    worst = max((float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
                 for x, y in zip(a, b) if x.shape == y.shape and x.size), default=0.0)
    detail = (f"{len(a)} arrays, results with {COMMAND_BUFFERS_ON!r} bit-equal to the run "
              f"with every kind off: {same} (largest difference {worst:.1e}); the optimized "
              f"HLO names a command buffer {said['on']} time(s) with them on, {said['off']} "
              "off")
    return Result("PASS" if same else "FAIL", detail)


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


def _packed(sizes: list[int], align: int = 256) -> int:
    """The bytes of one staging slot holding tensors of ``sizes`` (nccl_comm.h: each offset
    aligned to 256 bytes)."""
    at = 0
    for n in sizes:
        at = -(-at // align) * align + n
    return at


# (channel, stage) -> tensor bytes of the staging row's program: act of stage 0 (two tensors),
# grad of stage 1
STAGING_LAYOUTS = {(0, 0): [32 << 20, 1000], (1, 1): [16 << 20]}


def staging_program(microbatches: int = 8) -> list:
    """Rank 0's transfers of a two-rank 1F1B step (``_core.build_rank_ir``, no devices
    needed): ``ffi.in_flight``'s (channel, stage, send, from, to), sends of activations and
    receives of gradients, one each per microbatch."""
    from baton import _core
    from baton.emit import ffi

    ir = _core.build_rank_ir(_core.lower(_core.one_f_one_b(2, microbatches)))
    return ffi.in_flight(ir.programs[0])


def staging_arithmetic(fl: list) -> tuple[tuple[int, int], tuple[int, int]]:
    """(sends, receives) bytes in flight at once by the rank IR, and the step's."""
    from baton.emit import ffi

    def nbytes(c, s):
        return _packed(STAGING_LAYOUTS[c, s])
    step = tuple(sum(nbytes(c, s) for c, s, d, _, _ in fl if d == send) for send in (True, False))
    return ffi.most_in_flight(fl, nbytes), step


def _mib(pair) -> str:
    return f"{pair[0] / 2**20:.2f}/{pair[1] / 2**20:.2f} MiB"


def row_reservation(ctx: Context) -> Result:
    fl = staging_program()
    want, step = staging_arithmetic(fl)
    what = (f"rank 0 of a 2-rank 1F1B step of 8 microbatches ({len(fl)} transfers): in flight "
            f"at once (sends/receives) {_mib(want)}, the step's {_mib(step)}")
    if want[0] >= step[0] or want[1] >= step[1] or 0 in want:
        return Result("FAIL", f"{'dry run: ' if ctx.dry else ''}{what}: the rank IR's in-flight "
                      "maximum is not below the step's sum")
    if ctx.dry:
        return Result("INFO", f"dry run: {what}; on a GPU: NcclRankComm (self link) reserves "
                      "them (reserved_bytes compared), two sends and two receives in flight "
                      "run exactly on a pool of four slots, and with one slot reserved each way a "
                      "third at once fails naming the rank, the direction and the bytes")
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np
    from baton import _core
    from baton.emit import ffi

    rt = _core.runtime
    chans = sorted({c for c, *_ in fl})
    links = [(0, c, d) for c in chans for d in (True, False)]
    c = rt.NcclRankComm(0, 1, 0, rt.file_store(tempfile.mkdtemp()), links, 60.0,
                        "check/reserve")
    for (ch, st), sizes in STAGING_LAYOUTS.items():
        c.set_layout(ch, st, sizes)
    c.reserve(fl)
    got = tuple(c.reserved_bytes)
    slots_rank_ir = c.slots_allocated
    c.close()

    # A self-link program with two sends and two receives in flight at once (one group).
    n = 1 << 20  # 4 MiB of float32
    ops = [(0, 0, 0, 0), (0, 0, 0, 0), (1, 0, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0), (2, 0, 0, 0)]
    out = jax.ShapeDtypeStruct((n,), jnp.float32)

    def run(reserve, timeout, k):
        ctx_ = rt.NcclRankComm(0, 1, 0, rt.file_store(tempfile.mkdtemp()),
                               [(0, 0, True), (0, 0, False)], timeout, "check/reserve-run")
        ctx_.set_layout(0, 0, [n * 4])
        ctx_.reserve(reserve)

        def body(_, carry):
            x, tok = carry
            tok, (y, z) = ffi.comm(ctx_.id, ops, tok, [x, x * 2.0], [out, out])
            return y + z, tok

        @jax.jit
        def steps(x):
            tok = jnp.zeros((), jnp.int32)
            x, tok = jax.lax.fori_loop(0, k, body, (x, tok))
            return x, ffi.drain(ctx_.id, tok)

        err = ""
        y = None
        try:
            y, _ = jax.block_until_ready(steps(jnp.ones((n,), jnp.float32)))
        except Exception as e:  # noqa: BLE001  (the beyond-reservation case)
            err = str(e)
        fail = ctx_.failure()
        res = (y, tuple(ctx_.reserved_bytes), ctx_.slots_allocated, err
               + (f" / {fail}" if fail else ""))
        ctx_.close()
        return res

    two = [(0, 0, True, 0, 0)] * 2 + [(0, 0, False, 0, 0)] * 2
    y, r2, slots2, err2 = run(two, 60.0, 5)
    exact = y is not None and bool(np.array_equal(np.asarray(y), np.full((n,), 3.0**5, np.float32)))
    one = [(0, 0, True, 0, 0), (0, 0, False, 0, 0)]
    _, r1, slots1, err1 = run(one, 3.0, 1)
    named = all(x in err1 for x in ("rank 0", "receive", "4.00 MiB", "beyond the reservation"))
    ok = (got == want and exact and r2 == (2 * n * 4, 2 * n * 4) and slots2 == 4
          and r1 == (n * 4, n * 4) and slots1 == 2 and named and not err2)
    return Result("PASS" if ok else "FAIL",
                  f"{what}; reserved_bytes {_mib(got)} ({slots_rank_ir} slots); two sends and "
                  f"two receives in flight: exact {exact}, reserved {_mib(r2)}, slots {slots2} "
                  f"{err2[:120]}; one slot each way reserved, a second at once: slots {slots1}, "
                  f"the error names rank, direction, bytes {named}: {err1[:200]}")


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


def row_fault(key: str) -> Callable[[Context], Result]:
    """A check of bench/gpu_check_faults.py, in a process of its own (a check that hangs is
    reported as such); the dry run asks the script for its checks (``--list``)."""
    script = ROOT / "bench" / "gpu_check_faults.py"

    def run(ctx: Context) -> Result:
        if ctx.dry:
            p = subprocess.run([sys.executable, str(script), "--list"], capture_output=True,
                               text=True, timeout=60)
            names = dict(ln.split("|", 1) for ln in p.stdout.splitlines() if "|" in ln)
            if p.returncode != 0 or key not in names:
                return Result("FAIL", f"dry run: gpu_check_faults.py has no check {key!r} "
                              f"(rc={p.returncode}): {' '.join(p.stderr.splitlines()[-2:])}")
            return Result("INFO", f"dry run: reached; on a GPU: gpu_check_faults.py {key} "
                          f"('{names[key]}')")
        env = dict(os.environ)
        if key == "mem95":
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = ".95"
        limit = 120
        try:
            p = subprocess.run([sys.executable, str(script), key], capture_output=True,
                               text=True, timeout=limit, env=env)
        except subprocess.TimeoutExpired:
            return Result("FAIL", f"hung: gpu_check_faults.py {key} gave no answer within "
                          f"{limit} s")
        for line in p.stdout.splitlines():
            if line.startswith("ROW "):
                _, status, detail = line[4:].split("|", 2)
                return Result(status, detail)
        return Result("FAIL", f"did not run: rc={p.returncode} "
                      f"{' '.join((p.stdout + p.stderr).splitlines()[-3:])}")
    return run


SHARED = ("1f1b", "zbh1", "interleaved")  # gpu_check_shared.py's schedules, one row each
STAGED_LINE = "staged through pinned host memory"  # the engine's line when it stages
_SHARED: dict = {}


def _shared_run(dry: bool) -> dict:
    """Runs bench/gpu_check_shared.py once as two processes of ``baton.launch`` sharing one
    GPU (on CPU in the dry run: one CPU device each, over Gloo); its results by schedule,
    and its output under "log"."""
    if _SHARED:
        return _SHARED
    import json
    import tempfile

    out = tempfile.mkdtemp(prefix="baton-gpu-check-shared-")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "examples")] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("BATON_QUIET", None)  # (the engine's line saying why it stages is checked)
    if dry:
        env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    else:  # both processes on the first visible GPU (the launcher pins r mod 1)
        from baton.launch import visible_gpus
        gpus = visible_gpus()
        env["CUDA_VISIBLE_DEVICES"] = gpus[0] if gpus else "0"
    cmd = [sys.executable, "-m", "baton.launch", "--nprocs", "2", "--grace", "20", "--timeout",
           "270", str(ROOT / "bench" / "gpu_check_shared.py"), out, ",".join(SHARED)]
    t = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
        log, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:  # (its output is bytes, whatever text= says)
        log = b"".join(x or b"" for x in (e.stdout, e.stderr)).decode(errors="replace")
        log, rc = log + "\nhung: no answer within 300 s", 124
    _SHARED["log"], _SHARED["rc"] = log, rc
    _SHARED["seconds"] = time.monotonic() - t
    for name in SHARED:
        path = Path(out) / f"{name}.json"
        if path.exists():
            _SHARED[name] = json.loads(path.read_text())
    return _SHARED


def row_shared(name: str) -> Callable[[Context], Result]:
    """Two processes on one GPU training a small GPT with schedule ``name`` over host
    staging, against jax.jit (bench/gpu_check_shared.py). The dry run runs the same
    processes on CPU (over Gloo, nothing staged)."""
    def run(ctx: Context) -> Result:
        got = _shared_run(ctx.dry)
        res = got.get(name)
        if res is None:
            return Result("FAIL", f"did not run: rc={got['rc']} after {got['seconds']:.0f} s: "
                          f"{' '.join(got['log'].splitlines()[-4:])}")
        detail = (f"{res['platform']}: transfers {res['transfers']}, pinned "
                  f"{res['staging_bytes'] / 2**20:.1f} MiB; equal to jax.jit (rtol 1e-5, atol "
                  f"1e-4) {res['equal']}, largest difference {res['worst_abs']:.1e} over "
                  f"{res['arrays']} arrays{''.join('; ' + m for m in res['mismatches'])}"
                  f"; {res['ms_baton']:.1f} ms/step against jax.jit's {res['ms_jit']:.1f}; GPT "
                  f"dim {res['dim']} seq {res['seq']} layers {res['layers']}, {res['stages']} "
                  f"stages, {res['microbatches']} microbatches")
        if ctx.dry:
            return Result("INFO" if res["equal"] else "FAIL", "dry run (CPU, Gloo, no GPU to "
                          "share): " + detail)
        said = STAGED_LINE in got["log"]
        ok = res["equal"] and res["transfers"] == "staged" and said
        return Result("PASS" if ok else "FAIL",
                      detail + f"; the line saying why it stages printed: {said}")
    return run


ROWS: list[Row] = [
    Row("environment", False, row_environment),
    Row("build", True, row_build),
    Row("scan loop: no host syncs in the HLO", False, row_scan_hlo),
    Row("scan loop under command buffers", True, row_command_buffers),
    Row("nccl one-rank communicator (NcclRankComm self link)", True,
        row_single("self link (FFI, fori_loop)")),
    Row("failure: peer never arrives", True, row_single("peer never arrives")),
    Row("failure: wait before its send", True, row_fault("wait")),
    Row("failure: abort from another thread mid-run", True, row_fault("abort")),
    Row("failure: close with transfers pending", True, row_fault("close")),
    Row("one libnccl mapped", True, row_single("one libnccl mapped")),
    Row("implicit sync probe", True, row_single("implicit sync probe")),
    Row("switch vs straight", True, row_single("switch vs straight")),
    Row("memory: staging reservation", True, row_reservation),
    Row("memory: XLA_PYTHON_CLIENT_MEM_FRACTION=.95", True, row_fault("mem95")),
    Row("two processes on one GPU: 1F1B", True, row_shared("1f1b")),
    Row("two processes on one GPU: ZB-H1", True, row_shared("zbh1")),
    Row("two processes on one GPU: interleaved", True, row_shared("interleaved")),
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
    p.add_argument("--scan-results", metavar="NPZ", help=argparse.SUPPRESS)  # (a row's process)
    p.add_argument("--ranks", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.scan_results:
        scan_results(a.scan_results, a.ranks)
        return 0
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
