"""The worker processes of bench/chaos.py: start them (one per rank, ``BATON_*`` variables, a
fresh file store), read their ``CHAOS`` markers with arrival times, run a clean job."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "chaos_worker.py"
STEPS, EVERY = 12, 3


class Proc:
    """One worker process and the (time, line) pairs of its output, read on a thread."""

    def __init__(self, rank, world, store, args, env_extra):
        env = dict(os.environ, BATON_RANK=str(rank), BATON_WORLD_SIZE=str(world),
                   BATON_LOCAL_RANK=str(rank), BATON_STORE=f"file://{store}",
                   JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", **env_extra.get(rank, {}))
        self.rank = rank
        self.lines: list[tuple[float, str]] = []
        self.cv = threading.Condition()
        self.p = subprocess.Popen([sys.executable, str(WORKER), *args], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.exit_time = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            with self.cv:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self.cv.notify_all()
        self.p.wait()
        with self.cv:
            self.exit_time = time.monotonic()
            self.cv.notify_all()

    def wait_marker(self, pattern: str, timeout: float):
        """Time of the first ``CHAOS`` line matching ``pattern`` (None: not within timeout or
        the process ended)."""
        rx = re.compile(r"CHAOS " + pattern)
        end = time.monotonic() + timeout
        with self.cv:
            while True:
                for t, ln in self.lines:
                    if rx.match(ln):
                        return t
                left = end - time.monotonic()
                if left <= 0 or self.exit_time is not None:
                    return None
                self.cv.wait(left)

    def markers(self):
        with self.cv:
            return [(t, ln[6:]) for t, ln in self.lines if ln.startswith("CHAOS ")]

    def text(self):
        with self.cv:
            return "\n".join(ln for _, ln in self.lines)

    def wait_exit(self, deadline: float) -> bool:
        with self.cv:
            while self.exit_time is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cv.wait(left)
        return True

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


def start(world, args, env_extra=None):
    """``world`` workers on a fresh file store; ``env_extra``: rank -> more variables."""
    store = tempfile.mkdtemp(prefix="chaos-store-")
    return [Proc(r, world, store, args, env_extra or {}) for r in range(world)], store


def worker_args(ckpt, timeout, resume):
    a = ["--steps", str(STEPS), "--ckpt", str(ckpt), "--ckpt-every", str(EVERY),
         "--timeout", str(timeout)]
    return a + (["--resume"] if resume else [])


def losses_of(proc):
    out = {}
    for _, m in proc.markers():
        if m.startswith("step "):
            _, i, v = m.split()
            out[int(i)] = v
    return out


def done_digest(proc):
    for _, m in proc.markers():
        if m.startswith("done "):
            return m.split()[1]
    return None


def phase_times(proc):
    """{phase: duration} from a clean run's markers (the first of each phase)."""
    ms = proc.markers()
    begin, out = {}, {}
    for t, m in ms:
        kind = m.split()[0]
        if kind.endswith("-begin"):
            begin.setdefault(kind[:-6], t)
        elif kind.endswith("-end") and kind[:-4] in begin:
            out.setdefault(kind[:-4], t - begin[kind[:-4]])
    steps = [t for t, m in ms if m.startswith("step ")]
    if len(steps) > 2:
        out["step"] = (steps[-1] - steps[0]) / (len(steps) - 1)
    return out


def clean_run(world, ckpt, timeout, resume=False, limit=600):
    procs, store = start(world, worker_args(ckpt, timeout, resume))
    deadline = time.monotonic() + limit
    try:
        for p in procs:
            if not p.wait_exit(deadline):
                raise RuntimeError(f"clean run of {world} processes did not finish in {limit} s")
        bad = [p for p in procs if p.p.returncode != 0]
        if bad:
            raise RuntimeError(f"clean run failed (rank {bad[0].rank}, code "
                               f"{bad[0].p.returncode}):\n{bad[0].text()[-4000:]}")
        return procs
    finally:
        for p in procs:
            p.kill()
        shutil.rmtree(store, ignore_errors=True)


def committed_steps(ckpt) -> list[int]:
    if not os.path.isdir(ckpt):
        return []
    return sorted(int(d) for d in os.listdir(ckpt)
                  if d.isdigit() and os.path.exists(os.path.join(ckpt, d, "COMMITTED")))
