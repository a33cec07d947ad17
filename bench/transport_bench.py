"""Transport benchmark: latency and bandwidth of the runtime's transports. Prints a table.

    python bench/transport_bench.py [--sizes 4K,1M,16M] [--iters 20] [--transports local,gloo]

* local: two executors' transports in one process (value handles handed over: no copy);
* gloo: two transports over TCP loopback in one process (threads; the GIL is released while
  waiting), each transfer = header + meta + one message per array, 64-byte aligned receives.

A benchmark, not a test: it never fails on timing.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

from baton import runtime as rt


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def pair(kind: str):
    if kind == "local":
        hub = rt.LocalHub(2)
        return [hub.transport(0), hub.transport(1)]
    store = rt.hash_store()
    ts = [None, None]

    def mk(r):
        ts[r] = rt.gloo_transport(r, 2, store)

    th = [threading.Thread(target=mk, args=(r,)) for r in range(2)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    return ts


def one(ts, nbytes: int, iters: int) -> list[float]:
    x = np.ones(max(1, nbytes // 4), np.float32)
    times = []
    for i in range(iters + 2):
        t0 = time.perf_counter()
        rr = ts[1].irecv(0, i)
        rs = ts[0].isend(1, i, [x])
        ts[0].flush()
        ts[1].flush()
        rr.wait(60)
        rs.wait(60)
        if i >= 2:  # warm-up
            times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4K,64K,1M,16M")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--transports", default="local,gloo")
    a = ap.parse_args()
    print(f"{'transport':<10} {'size':>10} {'median ms':>10} {'p90 ms':>9} {'GiB/s':>8}")
    for kind in a.transports.split(","):
        ts = pair(kind)
        for s in a.sizes.split(","):
            n = parse_size(s)
            t = sorted(one(ts, n, a.iters))
            med = statistics.median(t)
            p90 = t[int(0.9 * (len(t) - 1))]
            print(f"{kind:<10} {s:>10} {med * 1e3:>10.3f} {p90 * 1e3:>9.3f} "
                  f"{n / med / (1 << 30):>8.2f}")
        for t in ts:
            t.close()


if __name__ == "__main__":
    main()
