"""Transport benchmark: latency and bandwidth of the runtime's transports. Prints a table.

    python bench/transport_bench.py [--sizes 4K,64K,1M,16M,256M] [--iters 20]
                                    [--transports local,gloo,gloo-2p,gloo-2p-nh,tcp-2p]
                                    [--md FILE]

* local:   two transports of a LocalHub in one process (value handles handed over: no copy);
* gloo:    two Gloo transports over TCP loopback in one process (threads; the GIL is released
           while waiting); each transfer = header + one message per array, 64-byte aligned receives;
* gloo-2p: Gloo between two processes (the deployment case), FileStore rendezvous, with the
           header (the receiver learns dtypes and shapes from the message);
* gloo-2p-nh: the same with the layout known on both ends (``layout=``), as the executor's
           transfers are: no header, the receiver posts the tensor receive at once;
* tcp-2p:  the baseline: plain Python sockets between two processes over loopback, ``sendall``
           of the array's buffer and ``recv_into`` a preallocated buffer (TCP_NODELAY).

Method. In-process rows time post-receive + post-send + wait for both (one-way transfer).
Two-process rows time a one-way transfer of ``size`` bytes from process 0 to process 1 followed
by a 1-byte (tcp) / 4-byte (gloo) acknowledgement back, so latency rows include one small return
trip in both baselines alike. Medians over ``--iters`` (fewer for large sizes: about 1 GiB per
size, at least 3), after 2 warm-ups. ``GiB/s`` is size / median (meaningless for ``local``, which
copies nothing).

A benchmark, not a test: it never fails on timing.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from baton import runtime as rt


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def iters_for(nbytes: int, iters: int) -> int:
    return max(3, min(iters, (1 << 30) // max(1, nbytes)))  # about 1 GiB per size at most


# ------------------------------------------------------------------ in-process pairs


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


def one_inprocess(ts, nbytes: int, iters: int) -> list[float]:
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


# ------------------------------------------------------------------ two processes


def _layout(x, known: bool):
    """What both ends pass as ``layout`` (None: Gloo sends a header first)."""
    return [(x.dtype, x.shape)] if known else None


def _gloo_peer(store_dir: str, sizes: list[int], iters: int, q, known: bool) -> None:
    t = rt.gloo_transport(1, 2, rt.file_store(store_dir))
    ack = np.zeros(1, np.float32)
    tag = 0
    for n in sizes:
        x = np.ones(max(1, n // 4), np.float32)
        for _ in range(iters_for(n, iters) + 2):
            t.recv(0, tag, timeout=120, layout=_layout(x, known))
            t.send(0, tag + 1, [ack], timeout=120, layout=_layout(ack, known))
            tag += 2
    t.close()
    q.put("done")


def run_gloo_2p(sizes: list[int], iters: int, known: bool = False) -> dict[int, list[float]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as d:
        p = ctx.Process(target=_gloo_peer, args=(d, sizes, iters, q, known))
        p.start()
        t = rt.gloo_transport(0, 2, rt.file_store(d))
        out, tag = {}, 0
        ack = np.zeros(1, np.float32)
        for n in sizes:
            x = np.ones(max(1, n // 4), np.float32)
            times = []
            for i in range(iters_for(n, iters) + 2):
                t0 = time.perf_counter()
                t.send(1, tag, [x], timeout=120, layout=_layout(x, known))
                t.recv(1, tag + 1, timeout=120, layout=_layout(ack, known))
                if i >= 2:
                    times.append(time.perf_counter() - t0)
                tag += 2
            out[n] = times
        q.get(timeout=120)
        t.close()
        p.join(60)
    return out


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


def _tcp_peer(port_q, sizes: list[int], iters: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(max(sizes))
    view = memoryview(buf)
    for n in sizes:
        for _ in range(iters_for(n, iters) + 2):
            _recv_exactly(conn, view[:n])
            conn.sendall(b"k")
    conn.close()
    srv.close()


def run_tcp_2p(sizes: list[int], iters: int) -> dict[int, list[float]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_tcp_peer, args=(q, sizes, iters))
    p.start()
    port = q.get(timeout=60)
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = bytearray(1)
    out = {}
    for n in sizes:
        x = np.ones(max(1, n // 4), np.float32)
        mv = memoryview(x).cast("B")[:n]
        times = []
        for i in range(iters_for(n, iters) + 2):
            t0 = time.perf_counter()
            s.sendall(mv)
            _recv_exactly(s, memoryview(ack))
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out[n] = times
    s.close()
    p.join(60)
    return out


# ------------------------------------------------------------------ main


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4K,64K,1M,16M,256M")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--transports", default="local,gloo,gloo-2p,gloo-2p-nh,tcp-2p")
    ap.add_argument("--md", help="also write the table, machine and command to this Markdown file")
    a = ap.parse_args()
    names = a.sizes.split(",")
    sizes = [parse_size(s) for s in names]
    rows = []
    header = (f"| {'transport':<10} | {'size':>6} | {'min ms':>8} | {'median ms':>10} "
              f"| {'p90 ms':>9} | {'GiB/s':>7} |")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")

    def emit(kind, name, n, t):
        t = sorted(t)
        med = statistics.median(t)
        p90 = t[int(0.9 * (len(t) - 1))]
        row = (f"| {kind:<10} | {name:>6} | {t[0] * 1e3:>8.3f} | {med * 1e3:>10.3f} | "
               f"{p90 * 1e3:>9.3f} | "
               f"{n / med / (1 << 30):>7.2f} |")
        rows.append(row)
        print(row, flush=True)

    for kind in a.transports.split(","):
        if kind in ("local", "gloo"):
            ts = pair(kind)
            for name, n in zip(names, sizes):
                emit(kind, name, n, one_inprocess(ts, n, iters_for(n, a.iters)))
            for t in ts:
                t.close()
        elif kind in ("gloo-2p", "gloo-2p-nh", "tcp-2p"):
            if kind == "tcp-2p":
                res = run_tcp_2p(sizes, a.iters)
            else:
                res = run_gloo_2p(sizes, a.iters, known=kind == "gloo-2p-nh")
            for name, n in zip(names, sizes):
                emit(kind, name, n, res[n])
        else:
            raise SystemExit(f"unknown transport {kind}")

    if a.md:
        with open(a.md, "w") as f:
            f.write("# Transport benchmark\n\n")
            f.write(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n")
            f.write(f"- machine: {platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, "
                    f"{platform.platform()}, Python {platform.python_version()}\n")
            f.write(f"- command: `python {' '.join(sys.argv)}`\n")
            f.write("- method: see the docstring of bench/transport_bench.py\n\n")
            f.write(header + "\n")
            f.write("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|\n")
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
