"""Cost of one transfer inside a compiled rank program: the XLA FFI path (what the engine
runs) against the old ``io_callback`` path and the transport itself. Prints a table.

    python bench/ffi_transfer.py [--sizes 4K,16M] [--iters 200] [--md FILE]

Two ranks in one process, each a CPU device, ping-pong ``iters`` times (rank 0 sends ``size``
bytes, rank 1 sends them back); a row is half the round trip, the median over 5 runs.

* ``raw``: the transport alone, driven from two C++ threads (``isend``/``irecv`` of host
  tensors; the in-process transport hands a handle over, Gloo moves the bytes over TCP);
* ``RankComm``: the FFI handlers' C++ code without XLA (two C++ threads calling
  ``RankComm::run_group``: a copy into the transport's tensor on send, a copy out on receive);
* ``FFI``: two jitted programs (one per device, launched from two Python threads), each a
  ``lax.scan`` of ``iters`` round trips whose transfers are ``baton_comm`` custom calls;
* ``io_callback``: the same programs with each transfer group an ``io_callback`` into Python
  that posts on the transport's Python binding (copying the array, as the engine did before).

``FFI - raw`` is the cost the compiled engine adds per transfer. The process keeps freed host
memory for reuse (``retain_host_memory``, as ``baton.jit`` sets by default). A benchmark, not a
test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "2")

import jax  # noqa: E402
from timing import publish  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import io_callback  # noqa: E402

from baton import _core  # noqa: E402
from baton.emit import ffi  # noqa: E402

RT = _core.runtime


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def transports(kind):
    if kind == "local":
        hub = RT.LocalHub(2)
        return [hub.transport(0), hub.transport(1)]
    store = RT.hash_store()
    out = [None, None]
    prefix = f"ffi-bench-{time.monotonic_ns()}"

    def make(r):
        out[r] = RT.gloo_transport(r, 2, store, prefix=prefix)

    th = threading.Thread(target=make, args=(1,))
    th.start()
    make(0)
    th.join()
    return out


def run_pair(fns, args):
    outs = [None, None]

    def go(r):
        outs[r] = jax.block_until_ready(fns[r](args[r]))

    th = threading.Thread(target=go, args=(1,))
    t0 = time.perf_counter()
    th.start()
    go(0)
    th.join()
    return time.perf_counter() - t0


def ffi_programs(ts, n, iters):
    comms = [RT.RankComm(r, 60.0) for r in range(2)]
    for r in range(2):
        comms[r].attach(ts[r])
        comms[r].set_layout(0, 0, [n])
    ffi.register()
    shape = jax.ShapeDtypeStruct((n,), jnp.uint8)

    def prog(r):
        cid = comms[r].id
        peer = 1 - r

        def body(carry, _):
            x, tok = carry
            if r == 0:
                tok, _ = ffi.comm(cid, [(0, peer, 0, 0), (1, peer, 0, 0)], tok, [x], [])
                tok, (x,) = ffi.comm(cid, [(2, peer, 0, 0)], tok, [], [shape])
            else:
                tok, (x,) = ffi.comm(cid, [(2, peer, 0, 0)], tok, [], [shape])
                tok, _ = ffi.comm(cid, [(0, peer, 0, 0)], tok, [x], [])
            return (x, tok), None

        def f(x):
            (x, tok), _ = jax.lax.scan(body, (x, jnp.zeros((), jnp.int32)), None, length=iters)
            return x, ffi.drain(cid, tok)

        return jax.jit(f)

    return [prog(0), prog(1)], comms


def callback_programs(ts, n, iters):
    shape = jax.ShapeDtypeStruct((n,), jnp.uint8)
    layout = [(np.uint8, (n,))]
    state = [{"seq": 0, "posted": [], "sends": []} for _ in range(2)]

    def host(r, op, tok, *arrays):
        t, st, peer = ts[r], state[r], 1 - r
        out = []
        if op == "send-post":
            st["sends"] = [q for q in st["sends"] if not q.done()]
            st["sends"].append(t.isend(peer, (1 << 42) + 2 * st["seq"] + r,
                                       [np.array(arrays[0], copy=True)], 0, layout))
            st["posted"].append(t.irecv(peer, (1 << 42) + 2 * st["seq"] + peer, 0, layout))
            st["seq"] += 1
            t.flush()
        elif op == "wait":
            q = st["posted"].pop(0) if st["posted"] else None
            if q is None:
                q = t.irecv(peer, (1 << 42) + 2 * st["seq"] + peer, 0, layout)
                t.flush()
            out = [q.wait(60.0)[0]]
        elif op == "send":
            st["sends"].append(t.isend(peer, (1 << 42) + 2 * st["seq"] + r,
                                       [np.array(arrays[0], copy=True)], 0, layout))
            st["seq"] += 1
            t.flush()
        return (np.int32(tok), *out)

    def call(r, op, tok, xs, outs):
        res = io_callback(lambda *a: host(r, op, *a), (jax.ShapeDtypeStruct((), jnp.int32),
                                                       *outs), tok, *xs, ordered=False)
        return res[0], res[1:]

    def prog(r):
        def body(carry, _):
            x, tok = carry
            if r == 0:
                tok, _ = call(r, "send-post", tok, [x], [])
                tok, (x,) = call(r, "wait", tok, [], [shape])
            else:
                tok, (x,) = call(r, "wait", tok, [], [shape])
                tok, _ = call(r, "send", tok, [x], [])
            return (x, tok), None

        def f(x):
            (x, tok), _ = jax.lax.scan(body, (x, jnp.zeros((), jnp.int32)), None, length=iters)
            return x, tok

        return jax.jit(f)

    def reset():
        for st in state:
            st.update(seq=0, posted=[], sends=[])

    return [prog(0), prog(1)], reset


def measure(kind, n, iters, runs=5):
    devs = jax.devices()[:2]
    args = [jax.device_put(np.ones(n, np.uint8), d) for d in devs]
    row = {}
    ts = transports(kind)
    row["raw"] = statistics.median(RT._pingpong(ts[0], ts[1], n, iters, False)
                                   for _ in range(runs)) / 2
    row["RankComm"] = statistics.median(RT._pingpong(ts[0], ts[1], n, iters, True)
                                        for _ in range(runs)) / 2
    for t in ts:
        t.close()
    ts = transports(kind)
    fns, comms = ffi_programs(ts, n, iters)
    run_pair(fns, args)  # compile + warm up
    row["FFI"] = statistics.median(run_pair(fns, args) for _ in range(runs)) / iters / 2
    for c in comms:
        c.detach()
    for t in ts:
        t.close()
    ts = transports(kind)
    fns, reset = callback_programs(ts, n, iters)
    run_pair(fns, args)
    times = []
    for _ in range(runs):
        reset()
        times.append(run_pair(fns, args))
    row["io_callback"] = statistics.median(times) / iters / 2
    for t in ts:
        t.close()
    return row


def main():
    # as baton.jit does by default (retain_host_memory=True): freed host memory is reused, so
    # the transports' host tensors do not page-fault in again for every transfer
    RT.retain_host_memory()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4K,16M")
    ap.add_argument("--transports", default="local,gloo")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--md", default=None)
    a = ap.parse_args()
    lines = [
        f"# Transfers inside a compiled rank program ({datetime.date.today()}, "
        f"{platform.node()}, {os.cpu_count()} CPUs, jax {jax.__version__})",
        "",
        "`python bench/ffi_transfer.py --sizes " + a.sizes + f" --iters {a.iters}`: one-way "
        "time per transfer (half a ping-pong round trip), median of 5 runs, in microseconds.",
        "",
        "| transport | size | raw | RankComm | FFI | io_callback | FFI - raw | io_callback / FFI |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind in a.transports.split(","):
        for s in a.sizes.split(","):
            n = parse_size(s)
            iters = max(10, min(a.iters, (256 << 20) // n))
            r = {k: v * 1e6 for k, v in measure(kind, n, iters).items()}
            lines.append(f"| {kind} | {s} | {r['raw']:.1f} | {r['RankComm']:.1f} | "
                         f"{r['FFI']:.1f} | {r['io_callback']:.1f} | {r['FFI'] - r['raw']:.1f} | "
                         f"{r['io_callback'] / r['FFI']:.1f}x |")
            print(lines[-1], flush=True)
    publish("\n".join(lines) + "\n", a.md)


if __name__ == "__main__":
    main()
