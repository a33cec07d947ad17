"""Admission at rendezvous (``baton.runtime.admission``): only this job's processes join.

* The hello over connected Gloo transports: the same token is admitted and data then
  moves; another token (a foreign job or a stale run sharing the store namespace) is
  refused on both sides, naming the peer rank and the address it reports, within the
  timeout, and the refusing rank's peers learn of it.
* Processes started with the same store but different job tokens never see each other's
  keys: each fails naming the rank that never joined.
* Stray TCP connections to Gloo's ports (garbage, a fake hello, a connection made while
  the ranks are still connecting): the job either completes (data moves, clean close) or
  fails with an error naming the rank; never a hang or a crash of the test process.
* ``python -m baton.launch`` gives every process of a launch one fresh token.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import baton
from baton import runtime as rt
from baton.runtime import admission


def on_threads(fns, limit=60.0):
    """Runs each fn on its own thread; returns (result or exception) per fn."""
    out = [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 (reported to the test)
            out[i] = e

    ts = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=limit)
    assert not any(t.is_alive() for t in ts), "a rank still waits"
    return out


class SpyStore:
    """An in-process store (callback_store) that records the address blobs it serves and
    can hold back the address keys until ``release`` is set."""

    def __init__(self):
        self.keys = {}
        self.release = threading.Event()
        self.release.set()

    def set_(self, key, value):
        self.keys[key] = bytes(value)

    def get(self, key, timeout_s):
        deadline = time.monotonic() + timeout_s
        if "/addr/" in key:
            self.release.wait(timeout_s)
        while key not in self.keys:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no key {key!r} after {timeout_s} s")
            time.sleep(0.005)
        return self.keys[key]

    def store(self):
        return rt.callback_store(self.set_, self.get)

    def ports(self):
        """Every TCP port the ranks published (one listening socket per Gloo pair)."""
        out = []
        for k, blob in self.keys.items():
            if "/addr/" not in k:
                continue
            i = 0
            while i < len(blob):
                (n,) = struct.unpack_from("<I", blob, i)
                out.append(struct.unpack_from("!H", blob, i + 6)[0])
                i += 4 + n
        return out


def connect_pair(store, prefix, timeout=10.0):
    return on_threads([lambda r=r: rt.gloo_transport(r, 2, store, hostname="127.0.0.1",
                                                     connect_timeout=timeout, prefix=prefix)
                       for r in (0, 1)])


def roundtrip(ts):
    """Rank 0 sends an array to rank 1 and back; returns what came back."""
    x = np.arange(6, dtype=np.float32)

    def r0():
        ts[0].send(1, 7, [x], 20.0)
        return ts[0].recv(1, 8, 20.0)[0]

    def r1():
        y = ts[1].recv(0, 7, 20.0)[0]
        ts[1].send(0, 8, [np.asarray(y) * 2], 20.0)

    got = on_threads([r0, r1])
    for g in got:
        assert not isinstance(g, BaseException), got
    return np.asarray(got[0])


def test_same_token_is_admitted_and_data_moves():
    ts = connect_pair(rt.hash_store(), "adm-same")
    res = on_threads([lambda r=r: admission.admit(ts[r], r, 2, "tok", "ns", 10.0) for r in (0, 1)])
    assert res == [None, None], res
    np.testing.assert_array_equal(roundtrip(ts), np.arange(6, dtype=np.float32) * 2)
    for t in ts:
        t.close()


def test_another_token_is_refused_on_both_sides_naming_the_peer(caplog):
    ts = connect_pair(rt.hash_store(), "adm-other")
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="baton"):
        res = on_threads([lambda r=r: admission.admit(ts[r], r, 2, f"token-{r}", "ns", 10.0)
                          for r in (0, 1)])
    assert time.monotonic() - t0 < 10.0
    for r, e in enumerate(res):
        assert isinstance(e, baton.ConfigError), res
        msg = str(e)
        assert f"rank {r}: admission refused rank {1 - r}" in msg, msg
        assert f"reports host {socket.gethostname()}" in msg and f"pid {os.getpid()}" in msg, msg
        assert "proof of the job token is wrong" in msg, msg
    assert sum("refused the connection of rank" in m for m in caplog.messages) == 2
    for t in ts:
        t.close()


def test_a_silent_peer_is_named_when_the_hello_times_out():
    ts = connect_pair(rt.hash_store(), "adm-silent")
    t0 = time.monotonic()
    (e,) = on_threads([lambda: admission.admit(ts[0], 0, 2, "tok", "ns", 1.0)])
    assert isinstance(e, baton.ConfigError), e
    assert "rank 0: admission: rank 1 sent no hello within 1 s" in str(e), e
    assert time.monotonic() - t0 < 8.0
    for t in ts:
        t.close()


def test_token_sources_and_namespace():
    assert admission.job_token({"BATON_JOB_TOKEN": "abc", "SLURM_JOB_ID": "5"}) == "abc"
    a = admission.job_token({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"})
    b = admission.job_token({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0",
                             "SLURM_RESTART_COUNT": "1"})
    assert a and b and a != b  # a requeued job is another job
    assert admission.job_token({}) is None
    ns = admission.job_namespace("secret-token")
    assert ns.startswith("job-") and "secret" not in ns
    assert ns != admission.job_namespace("secret-token2") and admission.job_namespace(None) == ""


RANK = textwrap.dedent('''
    import sys, time
    import baton
    from baton.runtime import rendezvous
    try:
        t = rendezvous.init_transport("gloo", connect_timeout=float(sys.argv[1]))
        print("CONNECTED")
        t.close()
    except baton.BatonError as e:
        print(f"ERROR {type(e).__name__}: {e}")
''')


def test_processes_with_different_tokens_never_join(tmp_path):
    """Same store directory, same world size, another job token: the keys live in other
    namespaces, so each process waits for a peer of its own job and names it."""
    procs = []
    for r in (0, 1):
        env = dict(os.environ, BATON_RANK=str(r), BATON_WORLD_SIZE="2", BATON_LOCAL_RANK="0",
                   BATON_STORE=f"file://{tmp_path}", BATON_HOSTNAME="127.0.0.1",
                   BATON_JOB_TOKEN=f"job-{r}")
        procs.append(subprocess.Popen([sys.executable, "-c", RANK, "3"], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for r, out in enumerate(outs):
        assert "CONNECTED" not in out, out
        assert f"rank(s) {1 - r} never joined" in out, out
    assert len([d for d in os.listdir(tmp_path) if d.startswith("job-")]) == 2


def test_launch_gives_one_fresh_token_per_launch(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os; print('TOKEN', os.environ['BATON_JOB_TOKEN'])\n")
    toks = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-m", "baton.launch", "--nprocs", "2", str(script)],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        got = {ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("TOKEN")}
        assert len(got) == 1 and len(next(iter(got))) == 64, p.stdout
        toks.append(got.pop())
    assert toks[0] != toks[1]


def stray(port, payload):
    """Connects to 127.0.0.1:port and sends payload; True when the connection was taken."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=1.0)
    except OSError:
        return False
    try:
        s.sendall(payload)
    except OSError:
        pass
    return s


GARBAGE = [b"\x00" * 64, b"GET / HTTP/1.0\r\n\r\n", os.urandom(256),
           b"baton-hello\0" + b"\x01" * 48]


def test_stray_connections_after_connect_change_nothing():
    spy = SpyStore()
    ts = connect_pair(spy.store(), "adm-stray-after")
    assert not any(isinstance(t, BaseException) for t in ts), ts
    socks = [stray(port, g) for port in spy.ports() for g in GARBAGE]
    res = on_threads([lambda r=r: admission.admit(ts[r], r, 2, "tok", "ns", 10.0) for r in (0, 1)])
    assert res == [None, None], res
    np.testing.assert_array_equal(roundtrip(ts), np.arange(6, dtype=np.float32) * 2)
    for t in ts:
        t.close()
    for s in socks:
        if s:
            s.close()


@pytest.mark.parametrize("payload", [GARBAGE[0], GARBAGE[2], b""])
def test_stray_connection_during_connect_fails_by_name_or_is_refused(payload):
    """Strays connect to every published port before the ranks read each other's
    addresses: a listening pair may take a stray for its peer. Then the job must fail
    within the timeouts, naming a rank (Gloo's connect, or the admission hello); if the
    ranks still connect to each other, the hello admits them and data moves."""
    spy = SpyStore()
    spy.release.clear()
    box = {}

    def ranks():
        box["ts"] = connect_pair(spy.store(), f"adm-stray-{len(payload)}", timeout=4.0)

    th = threading.Thread(target=ranks, daemon=True)
    th.start()
    deadline = time.monotonic() + 20
    while len([k for k in spy.keys if "/addr/" in k]) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    socks = [stray(port, payload) for port in spy.ports()]
    spy.release.set()
    th.join(timeout=60)
    assert not th.is_alive(), "the ranks still wait"
    ts = box["ts"]
    if any(isinstance(t, BaseException) for t in ts):
        # (what happens here: the listening side took a stray for its peer, so the other
        # side's connect is refused and names it; the listening side's hello then hears
        # garbage or nothing from the stray and names its peer rank)
        for r, t in enumerate(ts):
            if isinstance(t, BaseException):
                assert isinstance(t, baton.ExecutionError), ts
                assert "gloo could not connect to rank(s)" in str(t), t
                continue
            (e,) = on_threads([lambda: admission.admit(t, r, 2, "tok", "ns", 2.0)])
            assert isinstance(e, baton.ConfigError), e
            assert f"rank {r}: admission" in str(e) and f"rank {1 - r}" in str(e), e
            t.abort(str(e))
            t.close()
    else:
        res = on_threads([lambda r=r: admission.admit(ts[r], r, 2, "tok", "ns", 3.0)
                          for r in (0, 1)])
        for r, e in enumerate(res):
            assert e is None or (isinstance(e, baton.ConfigError)
                                 and f"rank {r}: admission" in str(e)), res
        if res == [None, None]:
            np.testing.assert_array_equal(roundtrip(ts), np.arange(6, dtype=np.float32) * 2)
        for t, e in zip(ts, res):
            if e is not None:
                t.abort(str(e))
            t.close()
    for s in socks:
        if s:
            s.close()
