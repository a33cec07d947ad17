"""Gloo start-up never waits unbounded: rendezvous + connect end within ``connect_timeout``,
with a :class:`baton.ExecutionError` naming the rank that could not be reached. After
start-up, a transfer timeout blames the peer that stopped beating (the heartbeat), not only
the peer it waited for.

Every process-starting test has a subprocess timeout."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import baton
from baton import runtime as rt

# One rank of a world of 2, started alone: its peer never comes.
LONELY = textwrap.dedent('''
    import sys, time
    import baton
    from baton.runtime import rendezvous
    t0 = time.monotonic()
    try:
        rendezvous.init_transport("gloo", connect_timeout=float(sys.argv[1]))
        print("CONNECTED")
    except baton.ExecutionError as e:
        print(f"ERROR after {time.monotonic() - t0:.2f} s: {e}")
''')


def test_rank_whose_peer_never_starts_fails_within_timeout(tmp_path):
    env = dict(os.environ, BATON_RANK="0", BATON_WORLD_SIZE="2", BATON_LOCAL_RANK="0",
               BATON_STORE=f"file://{tmp_path / 'store'}", BATON_HOSTNAME="127.0.0.1")
    p = subprocess.run([sys.executable, "-c", LONELY, "3"], env=env, capture_output=True,
                       text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "CONNECTED" not in out
    line = next((ln for ln in out.splitlines() if ln.startswith("ERROR after")), None)
    assert line is not None, out
    took = float(line.split()[2])
    # At least the timeout; at most 4x it (Gloo's own wait, which this replaced, was 5x),
    # so a loaded 2-core machine does not fail it.
    assert 2.5 <= took < 12.0, line
    assert "rank 0:" in line and "rank(s) 1 never joined" in line and "3000 ms" in line, line


def _dead_port(candidates):
    """A socket bound (not listening) to the first free 127.0.0.1 port of `candidates`."""
    for port in candidates:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", port))
            return s
        except OSError:
            s.close()
    pytest.fail("no free port among the candidates")


def _redirect(blob: bytes, port: int) -> bytes:
    """Rewrites every Gloo TCP address in an address blob (per peer: u32 length, then the
    address: a sockaddr_storage, i.e. family u16, port u16 big-endian, ...) to `port`."""
    out, i = bytearray(), 0
    while i < len(blob):
        (n,) = struct.unpack_from("<I", blob, i)
        addr = bytearray(blob[i + 4:i + 4 + n])
        assert struct.unpack_from("=H", addr, 0)[0] == socket.AF_INET
        struct.pack_into("!H", addr, 2, port)
        out += struct.pack("<I", n) + addr
        i += 4 + n
    return bytes(out)


@pytest.mark.parametrize("side", ["listen", "connect"])
def test_ranks_that_cannot_reach_each_other_both_fail_within_timeout(side):
    """Each rank reads the other's address, but nothing answers there (as with two ranks that
    both advertise 127.0.0.1 from different network namespaces). Gloo lets the side with the
    smaller byte-swapped port listen; the dead port is chosen so that both ranks listen (the
    case that used to wait 5x the timeout) or both connect (refused at once)."""
    if side == "listen":  # swapped value above every ephemeral port's
        candidates = [(hi << 8) | 0xFF for hi in range(0xEF, 0x100)]
    else:  # swapped value below every ephemeral port's
        candidates = [hi << 8 for hi in range(0x7F, 0x03, -1)]
    dead = _dead_port(candidates)
    port = dead.getsockname()[1]
    keys = {}

    # An in-process store whose readers see every published address rewritten.
    def set_(key, value):
        keys[key] = bytes(value)

    def get(key, timeout_s):
        deadline = time.monotonic() + timeout_s
        while key not in keys:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no key {key!r} after {timeout_s} s")
            time.sleep(0.005)
        v = keys[key]
        return _redirect(v, port) if "/addr/" in key else v

    store = rt.callback_store(set_, get)
    results = [None, None]

    def run(r):
        t0 = time.monotonic()
        try:
            rt.gloo_transport(r, 2, store, hostname="127.0.0.1", connect_timeout=2.0,
                              prefix=f"unreach-{side}").close()
            results[r] = ("connected", time.monotonic() - t0)
        except baton.ExecutionError as e:
            results[r] = (str(e), time.monotonic() - t0)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    dead.close()
    assert not any(t.is_alive() for t in threads), f"still waiting after {time.monotonic() - t0} s"
    for r, (msg, took) in enumerate(results):
        assert msg != "connected", f"rank {r} connected to a dead address"
        assert f"rank {r}: gloo could not connect to rank(s) {1 - r} within 2000 ms" in msg, msg
        assert f"127.0.0.1:{port}" in msg, msg
        assert took < 8.0, (took, msg)  # 4x the 2 s timeout, below Gloo's 5x listening wait
    if side == "listen":
        assert min(took for _, took in results) >= 1.5, results  # waited as listeners


# One rank of a world of 3 in a chain: rank 0 waits for rank 1, rank 1 waits for rank 2, and
# rank 2 is SIGSTOPped by the test once every rank is connected.
CHAIN = textwrap.dedent('''
    import os, sys, time
    import baton
    from baton.runtime import rendezvous
    t = rendezvous.init_transport("gloo", connect_timeout=60.0)
    rank = int(os.environ["BATON_RANK"])
    print("READY", flush=True)
    go = sys.argv[1]
    while not os.path.exists(go):
        time.sleep(0.05)
    if rank == 2:
        time.sleep(600)  # stopped by the test before it gets here
    if rank == 0:
        time.sleep(0.5)  # rank 1 waits first
    peer, limit = (1, 6.0) if rank == 0 else (2, 60.0)
    try:
        t.irecv(peer, 7).wait(limit)
        print("RECEIVED", flush=True)
    except baton.ExecutionError as e:
        print(f"ERROR {t.failure()[0]}: {e}", flush=True)
    os._exit(0)  # (a frozen peer cannot take a goodbye)
''')


def test_a_timeout_blames_the_frozen_rank_not_the_one_it_waited_for(tmp_path):
    """Rank 0 times out waiting for rank 1, which is healthy but waiting for the frozen
    rank 2: rank 2 has sent no heartbeat since it froze, so rank 0's error blames rank 2 (and
    says rank 1 may be waiting for it), and rank 1 learns that rank 2 failed."""
    go = tmp_path / "go"
    procs = []
    try:
        for r in range(3):
            env = dict(os.environ, BATON_RANK=str(r), BATON_WORLD_SIZE="3",
                       BATON_LOCAL_RANK=str(r), BATON_STORE=f"file://{tmp_path / 'store'}",
                       BATON_HOSTNAME="127.0.0.1")
            procs.append(subprocess.Popen([sys.executable, "-c", CHAIN, str(go)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        for p in procs:
            assert p.stdout.readline().strip() == "READY"
        os.kill(procs[2].pid, signal.SIGSTOP)
        go.touch()
        outs = [procs[r].communicate(timeout=120)[0] for r in (0, 1)]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert "ERROR 2: rank 0: timed out after 6 s waiting to receive" in outs[0], outs[0]
    assert "from rank 1; silent (no heartbeat): rank 2 for " in outs[0], outs[0]
    assert "that rank 1 may be waiting for" in outs[0], outs[0]
    assert "rank 1 for" not in outs[0], outs[0]  # rank 1 kept beating
    assert "ERROR 2: " in outs[1], outs[1]  # told by rank 0's abort: rank 2 failed
