"""Network faults between two "hosts": a link that slows down or drops in the middle of
training.

Two Linux network namespaces joined by a veth pair (as in test_twohost.py, on their own
addresses 10.231.8.1/30 <-> 10.231.8.2/30), one rank of a 2-stage 1F1B ``baton.jit`` MLP in
each, talking Gloo over the veth. While the ranks train step after step, the test changes the
link on both ends of the veth (this machine's kernel has no ``netem`` queueing discipline
and no tc classifiers or iptables, so the faults are made with what it has):

* **slow**: a token bucket (``tc qdisc replace dev <veth> root tbf rate 16kbit ...``) from
  step 2 to step 5, then removed: training goes on (every step waits longer, none times
  out) and every loss is bit-identical to single-process mode;
* **drop**: from step 2 on nothing crosses the link while both processes stay alive: a
  blackhole route to the peer's address on each end (what a firewall DROP rule does), or
  the link taken down (``ip link set <veth> down``, a pulled cable). Both processes end,
  each with a ``baton.ExecutionError`` saying it timed out waiting for the rank across the
  link, within the transfer timeout (5 s here) plus a margin; nobody hangs, and interpreter
  exit (which closes the transport) does not wait on the dead link.

Needs root, iproute2 and tc (``scripts/setup.sh``). Without them the tests FAIL with a
message; they are skipped only when ``BATON_NO_NETNS=1`` is set explicitly (as the two-host
tests). Every subprocess has a timeout; the namespaces are deleted in a ``finally`` block.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ADDRS = ("10.231.8.1", "10.231.8.2")  # a private /30 that exists only inside the namespaces
TIMEOUT = 5.0  # the step's transfer timeout (baton.jit(timeout=...)) in the workers

WORKER = textwrap.dedent(f'''
    import os, sys, time
    sys.path.insert(0, {str(HERE)!r})
    import baton
    import test_mp_e2e as T
    from baton.running.distributed import process_group

    timeout, steps = float(sys.argv[1]), int(sys.argv[2])
    rank = process_group(connect_timeout=30).rank
    sched, stages, m, params, st, batch = T.config("1f1b", 2)
    ps = baton.jit(T.train_step, schedule=sched, microbatches=m, timeout=timeout)
    try:
        for i in range(1, steps + 1):
            t0 = time.monotonic()
            params, st, loss, _ = ps(params, st, batch)
            print(f"rank {{rank}} step {{i}} {{float(loss).hex()}} {{time.monotonic() - t0:.3f}}",
                  flush=True)
    except baton.BatonError as e:
        msg = " ".join(str(e).split())
        print(f"rank {{rank}} ERROR {{type(e).__name__}}: {{msg}}", flush=True)
        sys.exit(3)  # a normal exit: closing the transport must not wait on the dead link
    print(f"rank {{rank}} OK", flush=True)
''')


def _require_netns():
    """Fails (never silently skips) when the machine cannot make namespaces or shape links."""
    if os.environ.get("BATON_NO_NETNS") == "1":
        pytest.skip("BATON_NO_NETNS=1: network-namespace tests disabled")
    problems = []
    if os.geteuid() != 0:
        problems.append("not running as root (network namespaces need CAP_NET_ADMIN)")
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            problems.append(f"`{tool}` ({pkg}) not found; run scripts/setup.sh")
    if problems:
        pytest.fail("network-fault test cannot run: " + "; ".join(problems) +
                    ". Set BATON_NO_NETNS=1 to skip it explicitly.", pytrace=False)


def _run(*args):
    subprocess.run(list(args), check=True, capture_output=True, text=True, timeout=20)


@pytest.fixture
def link():
    """Two namespaces joined by a veth pair; yields [(namespace, veth, address)] per rank."""
    _require_netns()
    tag = f"{os.getpid() % 100000}"
    names = [f"btnf{tag}r0", f"btnf{tag}r1"]
    veths = [f"bf{tag}v0", f"bf{tag}v1"]  # interface names: at most 15 characters
    try:
        for n in names:
            _run("ip", "netns", "add", n)
        _run("ip", "link", "add", veths[0], "netns", names[0], "type", "veth", "peer", "name",
             veths[1], "netns", names[1])
        for n, v, a in zip(names, veths, ADDRS):
            _run("ip", "-n", n, "addr", "add", f"{a}/30", "dev", v)
            _run("ip", "-n", n, "link", "set", "lo", "up")
            _run("ip", "-n", n, "link", "set", v, "up")
        yield list(zip(names, veths, ADDRS))
    except subprocess.CalledProcessError as e:
        pytest.fail(f"cannot set up network namespaces: {e.cmd}: {e.stderr}", pytrace=False)
    finally:
        for n in names:  # deleting a namespace deletes its end of the veth pair (and the peer)
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=20)


SLOW = ("tbf", "rate", "16kbit", "burst", "1600", "latency", "5s")


def shape(link, *qdisc):
    """``tc qdisc replace dev <veth> root <qdisc>`` on both ends (``del`` with none)."""
    for ns, veth, _ in link:
        if qdisc:
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", veth, "root",
                 *qdisc)
        else:
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", veth, "root")


def drop(link, how):
    """Nothing crosses the link any more: ``blackhole`` routes to the peer on both ends, or
    the link ``down``."""
    for r, (ns, veth, _) in enumerate(link):
        if how == "blackhole":
            _run("ip", "-n", ns, "route", "add", "blackhole", f"{link[1 - r][2]}/32")
        else:
            _run("ip", "-n", ns, "link", "set", veth, "down")


class Ranks:
    """The two worker processes, their output lines read on threads (with arrival times)."""

    def __init__(self, link, tmp_path, steps):
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        store = tmp_path / "store"
        store.mkdir()
        self.lines: list[tuple[float, str]] = []
        self.cv = threading.Condition()
        self.procs = []
        for r, (ns, _, addr) in enumerate(link):
            env = dict(os.environ, BATON_RANK=str(r), BATON_WORLD_SIZE="2", BATON_LOCAL_RANK="0",
                       BATON_STORE=f"file://{store}", BATON_HOSTNAME=addr, JAX_PLATFORMS="cpu",
                       JAX_NUM_CPU_DEVICES="1")
            p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(script),
                                  str(TIMEOUT), str(steps)], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
            self.procs.append(p)
            threading.Thread(target=self._read, args=(p,), daemon=True).start()

    def _read(self, p):
        for ln in p.stdout:
            with self.cv:
                self.lines.append((time.monotonic(), ln.rstrip("\n")))
                self.cv.notify_all()

    def wait_line(self, prefix, timeout):
        end = time.monotonic() + timeout
        with self.cv:
            while not any(ln.startswith(prefix) for _, ln in self.lines):
                left = end - time.monotonic()
                if left <= 0 or all(p.poll() is not None for p in self.procs):
                    break
                self.cv.wait(min(left, 1.0))
            return next((t for t, ln in self.lines if ln.startswith(prefix)), None)

    def wait_exit(self, timeout):
        """Exit times (monotonic), None for a process still running at the deadline."""
        end = time.monotonic() + timeout
        out = []
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
                out.append(time.monotonic())
            except subprocess.TimeoutExpired:
                out.append(None)
        return out

    def text(self):
        with self.cv:
            return "\n".join(ln for _, ln in self.lines)

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def steps_of(text, rank):
    """{step: (loss hex, seconds)} of ``rank``."""
    rx = re.compile(rf"^rank {rank} step (\d+) (\S+) (\S+)$")
    return {int(m[1]): (m[2], float(m[3])) for m in map(rx.match, text.splitlines()) if m}


def single_process_losses(steps):
    """The same steps in single-process mode (2 ranks on 2 CPU devices of this process):
    multi-process mode with one device per process is bit-identical to it
    (test_mp_e2e.py)."""
    import jax

    import baton
    import test_mp_e2e as T

    sched, stages, m, params, st, batch = T.config("1f1b", 2)
    fn = baton.jit(T.train_step, mesh=baton.PipelineMesh(jax.devices()[:2], ranks=2),
                   schedule=sched, microbatches=m, transport="local")
    out = []
    for _ in range(steps):
        params, st, loss, _ = fn(params, st, batch)
        out.append(float(loss).hex())
    return out


def test_slow_link_mid_training_finishes_bit_identical(link, tmp_path):
    """The link limited to 16 kbit/s from step 2 to step 5: the steps slow down (1F1B's 4
    microbatches cross it 16 times a step), none times out, and the losses are
    single-process mode's, bit for bit."""
    steps = 8
    ranks = Ranks(link, tmp_path, steps)
    try:
        assert ranks.wait_line("rank 0 step 2 ", 240) is not None, ranks.text()[-4000:]
        shape(link, *SLOW)
        assert ranks.wait_line("rank 0 step 5 ", 120) is not None, ranks.text()[-4000:]
        shape(link)
        ends = ranks.wait_exit(120)
    finally:
        ranks.kill()
    out = ranks.text()
    assert None not in ends and [p.returncode for p in ranks.procs] == [0, 0], out[-4000:]
    want = single_process_losses(steps)
    for r in (0, 1):
        got = steps_of(out, r)
        assert [got[i][0] for i in range(1, steps + 1)] == want, (r, got, want)
    s0 = steps_of(out, 0)
    print("rank 0 step seconds:", {i: t for i, (_, t) in s0.items()})
    # steps 4 and 5 ran entirely on the slowed link, steps 7 and 8 entirely after it
    assert min(s0[4][1], s0[5][1]) > 2 * max(s0[7][1], s0[8][1]), s0


@pytest.mark.parametrize("how", ["blackhole", pytest.param("down", marks=pytest.mark.heavy)])
def test_dropped_link_mid_training_names_the_ranks_without_hanging(link, tmp_path, how):
    """Nothing crosses the link from step 2 on (the peer stays alive): each rank's wait for
    the other times out, each process exits with an ``ExecutionError`` naming the rank
    across the link, within the timeout plus a margin."""
    ranks = Ranks(link, tmp_path, 10_000)
    try:
        assert ranks.wait_line("rank 0 step 2 ", 240) is not None, ranks.text()[-4000:]
        drop(link, how)
        t_drop = time.monotonic()
        ends = ranks.wait_exit(TIMEOUT + 60)
    finally:
        ranks.kill()
    out = ranks.text()
    assert None not in ends, f"a process hung on the dropped link:\n{out[-4000:]}"
    assert [p.returncode for p in ranks.procs] == [3, 3], out[-4000:]
    for r in (0, 1):
        err = [ln for ln in out.splitlines() if ln.startswith(f"rank {r} ERROR")]
        assert err, out[-4000:]
        e = err[0]
        print(e)
        assert e.startswith(f"rank {r} ERROR ExecutionError"), e
        # the peer across the link is named, as the rank that timed out or as the origin
        assert f"rank {1 - r}" in e and "timed out after 5 s" in e, e
    took = max(ends) - t_drop
    print(f"exits {[round(t - t_drop, 1) for t in ends]} s after the drop")
    # one timeout (5 s) for the wait; the abort message cannot cross the link either, so the
    # other rank reaches its own timeout; then interpreter exit. 2 shared cores: margin 40 s
    assert took < TIMEOUT + 40, f"{took:.1f} s from the drop to the last exit:\n{out[-3000:]}"
