"""Start one process per pipeline rank on this host.

    python -m baton.launch --nprocs N [--timeout S] [--grace S] script.py [args ...]

Each process gets ``BATON_RANK``, ``BATON_WORLD_SIZE``, ``BATON_LOCAL_RANK`` and
``BATON_STORE=file:///<fresh temporary directory>`` (see :mod:`baton.runtime.rendezvous`)
and ``BATON_JOB_TOKEN``, a fresh random job token (see :mod:`baton.runtime.admission`).
When a process exits with an error, the others are given ``--grace`` seconds to stop on
their own (they learn of the failure through the transport), then are terminated. The
launcher exits with the first failing process's code (0 when all succeed) and names it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from .runtime.admission import new_token


def _parser():
    p = argparse.ArgumentParser(prog="python -m baton.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", type=int, required=True, help="number of processes (ranks)")
    p.add_argument("--timeout", type=float, default=0.0,
                   help="stop everything after this many seconds (0: no limit)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds the other ranks get to stop after one fails")
    p.add_argument("-m", dest="module", action="store_true", help="run script as a module")
    p.add_argument("script", help="script (or module with -m) to run")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p


def _stop(procs, sig):
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    if a.nprocs < 1:
        print("baton.launch: --nprocs must be >= 1", file=sys.stderr)
        return 2
    store = tempfile.mkdtemp(prefix="baton-store-")
    token = new_token()  # this launch's job token (admission at rendezvous)
    procs = []
    try:
        for r in range(a.nprocs):
            env = dict(os.environ)
            env.update(BATON_RANK=str(r), BATON_WORLD_SIZE=str(a.nprocs), BATON_LOCAL_RANK=str(r),
                       BATON_STORE="file://" + store, BATON_JOB_TOKEN=token)
            cmd = [sys.executable] + (["-m"] if a.module else []) + [a.script] + a.args
            procs.append(subprocess.Popen(cmd, env=env))

        def forward(signum, _frame):
            _stop(procs, signum)

        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        start = time.monotonic()
        first_fail = None  # (rank, code)
        fail_time = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            for r, p in enumerate(procs):
                code = p.poll()
                if code not in (None, 0) and first_fail is None:
                    first_fail, fail_time = (r, code), now
                    print(f"baton.launch: rank {r} exited with code {code}; "
                          f"waiting up to {a.grace:g} s for the other ranks", file=sys.stderr)
            if fail_time is not None and now - fail_time > a.grace:
                print("baton.launch: terminating the remaining ranks", file=sys.stderr)
                _stop(procs, signal.SIGTERM)
                break
            if a.timeout > 0 and now - start > a.timeout:
                print(f"baton.launch: timed out after {a.timeout:g} s; terminating", file=sys.stderr)
                _stop(procs, signal.SIGTERM)
                first_fail = first_fail or (-1, 124)
                break
            time.sleep(0.05)
        deadline = time.monotonic() + 5.0
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        _stop(procs, signal.SIGKILL)
        for p in procs:
            p.wait()
        for s, h in old.items():
            signal.signal(s, h)
        if first_fail is None:
            for r, p in enumerate(procs):
                if p.returncode != 0:
                    first_fail = (r, p.returncode)
                    break
        if first_fail is None:
            return 0
        r, code = first_fail
        if r >= 0:
            print(f"baton.launch: failed: rank {r} exited with code {code}", file=sys.stderr)
        return code if 0 < code < 256 else 1
    finally:
        _stop(procs, signal.SIGKILL)
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
