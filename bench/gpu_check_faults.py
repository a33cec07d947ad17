"""Failure and memory checks of the CUDA path on one GPU (run by bench/gpu_check.py, one
process per check, so that a check that hangs is reported as such by its parent).

    python bench/gpu_check_faults.py CHECK     # prints one ``ROW <name>|<status>|<detail>``
    python bench/gpu_check_faults.py --list    # the checks' names (no GPU needed)

Each check uses ``NcclRankComm`` on a one-rank communicator (a self link, as
gpu_check_single.py's), reports the seconds the failure took to surface, and then whether
the GPU is usable: a fresh computation gives the right result and a new context moves a
tensor exactly.

* ``wait``: a group that waits for a receive whose send comes in a later group and needs the
  received tensor (a deadlock on the device); the context's timeout must end it;
* ``abort``: a long loop of self-link transfers aborted from another thread mid-run;
* ``close``: a receive posted and never waited or sent; ``close()`` must return (waiting at
  most its timeout, then aborting) instead of hanging;
* ``mem95``: with ``XLA_PYTHON_CLIENT_MEM_FRACTION=.95`` (set by the parent before JAX
  starts), a context's setup, its staging reservation (64 MiB) and one exact transfer.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
import traceback

NAMES = {
    "wait": "failure: wait before its send",
    "abort": "failure: abort from another thread mid-run",
    "close": "failure: close with transfers pending",
    "mem95": "memory: XLA_PYTHON_CLIENT_MEM_FRACTION=.95",
}
TIMEOUT = 3.0  # the contexts' transfer timeout, seconds
SEND, POST, WAIT = 0, 1, 2


def row(name: str, status: str, detail: str) -> None:
    print(f"ROW {name}|{status}|{detail}", flush=True)


def self_context(rt, n: int, prefix: str, timeout: float = TIMEOUT):
    """A one-rank context linked to itself, its staging for one send and one receive of
    ``n`` float32 reserved."""
    c = rt.NcclRankComm(0, 1, 0, rt.file_store(tempfile.mkdtemp()), [(0, 0, True), (0, 0, False)],
                        timeout, prefix)
    c.set_layout(0, 0, [n * 4])
    c.reserve([(0, 0, True, 1), (0, 0, False, 1)])
    return c


def exact_transfer(rt, ffi, n: int, prefix: str) -> bool:
    """A new context sends ``n`` float32 to itself; the tensor arrives exactly."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    c = self_context(rt, n, prefix, timeout=30.0)
    try:
        out = jax.ShapeDtypeStruct((n,), jnp.float32)

        @jax.jit
        def once(x):
            tok = jnp.zeros((), jnp.int32)
            tok, (y,) = ffi.comm(c.id, [(SEND, 0, 0, 0), (POST, 0, 0, 0), (WAIT, 0, 0, 0)], tok,
                                 [x], [out])
            return y, ffi.drain(c.id, tok)

        x = jnp.arange(n, dtype=jnp.float32)
        y, _ = jax.block_until_ready(once(x))
        return bool(np.array_equal(np.asarray(y), np.asarray(x))) and c.failure() is None
    finally:
        c.close()


def usable(rt, ffi, tag: str) -> str:
    """'' when the GPU computes right and a new context moves a tensor exactly, else what
    went wrong."""
    import jax
    import jax.numpy as jnp

    try:
        s = float(jax.block_until_ready(jnp.sum(jnp.arange(1024, dtype=jnp.float32))))
        if s != 1024 * 1023 / 2:
            return f"a fresh sum gave {s}"
        if not exact_transfer(rt, ffi, 1 << 16, f"check/{tag}/after"):
            return "a new context's transfer was not exact"
    except Exception as e:  # noqa: BLE001  (reported)
        return f"{type(e).__name__}: {e}"
    return ""


def failure_of(c) -> str:
    """The context's recorded failure ('' when none), or what asking for it raised."""
    try:
        f = c.failure()
        return "" if f is None else str(f)
    except Exception as e:  # noqa: BLE001  (reported)
        return f"(failure() raised {type(e).__name__}: {e})"


def ended(run) -> tuple[float, str]:
    """Seconds ``run`` took, and the exception it raised ('' when none)."""
    t = time.perf_counter()
    try:
        run()
        err = ""
    except Exception as e:  # noqa: BLE001  (the failure under test)
        err = f"{type(e).__name__}: {e}"
    return time.perf_counter() - t, err


def check_wait(rt, ffi) -> None:
    import jax
    import jax.numpy as jnp

    name = NAMES["wait"]
    n = 1 << 16
    c = self_context(rt, n, "check/wait")
    out = jax.ShapeDtypeStruct((n,), jnp.float32)

    @jax.jit
    def deadlock(x):
        tok = jnp.zeros((), jnp.int32)
        tok, (y,) = ffi.comm(c.id, [(POST, 0, 0, 0), (WAIT, 0, 0, 0)], tok, [], [out])
        tok, _ = ffi.comm(c.id, [(SEND, 0, 0, 0)], tok, [x + y], [])  # needs what it waits for
        return y, ffi.drain(c.id, tok)

    dt, err = ended(lambda: jax.block_until_ready(deadlock(jnp.ones((n,), jnp.float32))))
    fail = failure_of(c)
    dc, _ = ended(c.close)
    bad = usable(rt, ffi, "wait")
    ok = bool(err or fail) and dt < TIMEOUT + 20 and not bad
    row(name, "PASS" if ok else "FAIL",
        f"ended after {dt:.1f} s (timeout {TIMEOUT:g} s), close {dc:.1f} s; raised: "
        f"{err[:160] or 'nothing'}; failure: {fail[:160] or 'none'}; GPU usable after: "
        f"{bad or 'yes'}")


def check_abort(rt, ffi) -> None:
    import jax
    import jax.numpy as jnp

    name = NAMES["abort"]
    n = 1 << 18  # 1 MiB per transfer
    c = self_context(rt, n, "check/abort", timeout=30.0)
    out = jax.ShapeDtypeStruct((n,), jnp.float32)
    ops = [(SEND, 0, 0, 0), (POST, 0, 0, 0), (WAIT, 0, 0, 0)]

    def body(_, carry):
        x, tok = carry
        tok, (y,) = ffi.comm(c.id, ops, tok, [x], [out])
        return y + 1.0, tok

    @jax.jit
    def steps(x, k):
        x, tok = jax.lax.fori_loop(0, k, body, (x, jnp.zeros((), jnp.int32)))
        return x, ffi.drain(c.id, tok)

    x0 = jnp.zeros((n,), jnp.float32)
    jax.block_until_ready(steps(x0, 10))
    t = time.perf_counter()
    jax.block_until_ready(steps(x0, 500))
    per_unit = (time.perf_counter() - t) / 500
    k = int(min(max(6.0 / max(per_unit, 1e-7), 1000), 5e7))  # about 6 s of units
    started = time.perf_counter()
    result = steps(x0, k)  # in flight
    time.sleep(0.5)
    aborted = time.perf_counter()
    th = threading.Thread(target=lambda: c.abort("gpu_check: aborted from another thread"))
    th.start()
    dt, err = ended(lambda: jax.block_until_ready(result))
    th.join(30)
    ran = time.perf_counter() - started
    mid_run = aborted - started < 0.9 * per_unit * k  # (the loop had not finished by itself)
    fail = failure_of(c)
    dc, _ = ended(c.close)
    bad = usable(rt, ffi, "abort")
    ok = bool(err or fail) and mid_run and dt < 15 and not th.is_alive() and not bad
    row(name, "PASS" if ok else "FAIL",
        f"{k} units ({per_unit * 1e6:.1f} us each) aborted after 0.5 s; the run ended "
        f"{dt:.1f} s after the abort ({ran:.1f} s in all, mid-run {mid_run}), close "
        f"{dc:.1f} s; raised: {err[:160] or 'nothing'}; failure: {fail[:160] or 'none'}; GPU "
        f"usable after: {bad or 'yes'}")


def check_close(rt, ffi) -> None:
    import jax
    import jax.numpy as jnp

    name = NAMES["close"]
    n = 1 << 16
    c = self_context(rt, n, "check/close")

    @jax.jit
    def posted(x):
        tok = jnp.zeros((), jnp.int32)
        tok, _ = ffi.comm(c.id, [(POST, 0, 0, 0)], tok, [], [])  # never waited, never sent
        return x + 1.0, tok

    dr, err = ended(lambda: jax.block_until_ready(posted(jnp.ones((n,), jnp.float32))))
    dc, cerr = ended(c.close)
    fail = failure_of(c)
    bad = usable(rt, ffi, "close")
    ok = dc < TIMEOUT + 15 and not bad
    row(name, "PASS" if ok else "FAIL",
        f"the program returned after {dr:.1f} s ({err[:120] or 'no error'}); close returned "
        f"after {dc:.1f} s (timeout {TIMEOUT:g} s){': ' + cerr[:120] if cerr else ''}; "
        f"failure: {fail[:160] or 'none'}; GPU usable after: {bad or 'yes'}")


def check_mem95(rt, ffi) -> None:
    import os

    import jax

    name = NAMES["mem95"]
    frac = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit", 0) / 2**30
    t = time.perf_counter()
    try:
        ok = exact_transfer(rt, ffi, 16 << 20, "check/mem95")  # 64 MiB staged each way
        err = "" if ok else "the transfer was not exact"
    except Exception as e:  # noqa: BLE001  (reported)
        ok, err = False, f"{type(e).__name__}: {e}"
    dt = time.perf_counter() - t
    row(name, "PASS" if ok and frac == ".95" else "FAIL",
        f"XLA_PYTHON_CLIENT_MEM_FRACTION={frac}, XLA's limit {limit:.1f} GiB; NcclRankComm "
        f"setup, 64 MiB staging reserved and one exact transfer in {dt:.1f} s"
        + (f": {err[:200]}" if err else ""))


CHECKS = {"wait": check_wait, "abort": check_abort, "close": check_close, "mem95": check_mem95}


def main(argv: list[str]) -> int:
    if argv == ["--list"]:
        for key, name in NAMES.items():
            print(f"{key}|{name}")
        return 0
    if len(argv) != 1 or argv[0] not in CHECKS:
        print(f"usage: gpu_check_faults.py {{{','.join(CHECKS)}}} | --list", file=sys.stderr)
        return 2
    import jax
    import jax.numpy as jnp

    from baton import _core
    from baton.emit import ffi

    name = NAMES[argv[0]]
    try:
        if jax.default_backend() != "gpu":
            row(name, "FAIL", f"did not run: backend {jax.default_backend()}, not gpu")
            return 1
        if not _core.ffi.has_cuda():
            row(name, "FAIL", "did not run: baton._core was built without the CUDA handlers")
            return 1
        jax.block_until_ready(jnp.zeros(1))  # the GPU backend (and JAX's NCCL) is up first
        ffi.register()
        CHECKS[argv[0]](_core.runtime, ffi)
    except Exception as e:  # noqa: BLE001  (the row says what failed)
        traceback.print_exc()
        row(name, "FAIL", f"{type(e).__name__}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
