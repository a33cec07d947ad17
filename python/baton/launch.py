"""Start one process per pipeline rank on this host.

    python -m baton.launch --nprocs N [--timeout S] [--grace S] script.py [args ...]

Each process gets ``BATON_RANK``, ``BATON_WORLD_SIZE``, ``BATON_LOCAL_RANK`` and
``BATON_STORE=file:///<fresh temporary directory>`` (see :mod:`baton.runtime.rendezvous`)
and ``BATON_JOB_TOKEN``, a fresh random job token (see :mod:`baton.runtime.admission`).
On a host with GPUs each process sees one: ``CUDA_VISIBLE_DEVICES`` is set to the r-th GPU of
the launcher's visible list (``CUDA_VISIBLE_DEVICES`` if set, else ``nvidia-smi -L``); with
more processes than GPUs, process r gets GPU r mod n (ranks sharing a GPU). ``--no-pin``
leaves every process every GPU.
When a process exits with an error, the others are given ``--grace`` seconds to stop on
their own (they learn of the failure through the transport), then are terminated. The
launcher exits with the first failing process's code (0 when all succeed) and names it.

Processes that share a GPU each get their share of its memory
(``XLA_PYTHON_CLIENT_MEM_FRACTION``: the fraction the user set, else XLA's default 0.75,
divided by the sharers). Every process starts with ``CUDA_MODULE_LOADING=EAGER`` unless the
user chose a mode: with lazy loading, the first step's NCCL calls on several threads can race
CUDA's loading of modules inside the driver and deadlock (docs/GPU.md). See
:func:`gpu_share_env`.
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
from .runtime.gpu_share import gpu_share_env


def _parser():
    p = argparse.ArgumentParser(prog="python -m baton.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", type=int, required=True, help="number of processes (ranks)")
    p.add_argument("--timeout", type=float, default=0.0,
                   help="stop everything after this many seconds (0: no limit)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds the other ranks get to stop after one fails")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not give each process one GPU (CUDA_VISIBLE_DEVICES)")
    p.add_argument("-m", dest="module", action="store_true", help="run script as a module")
    p.add_argument("script", help="script (or module with -m) to run")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p


def visible_gpus(env=None) -> list[str]:
    """The GPUs this launcher may hand out: ``CUDA_VISIBLE_DEVICES``'s entries when it is
    set, else the indices ``nvidia-smi -L`` lists (none without a driver)."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def pinned_gpu(rank: int, gpus: list[str]) -> str | None:
    """The GPU process ``rank`` sees (``CUDA_VISIBLE_DEVICES``), or None without GPUs."""
    return gpus[rank % len(gpus)] if gpus else None


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
    gpus = visible_gpus() if a.pin else []
    try:
        for r in range(a.nprocs):
            env = dict(os.environ)
            env.update(BATON_RANK=str(r), BATON_WORLD_SIZE=str(a.nprocs), BATON_LOCAL_RANK=str(r),
                       BATON_STORE="file://" + store, BATON_JOB_TOKEN=token)
            gpu = pinned_gpu(r, gpus)
            if gpu is not None:  # one GPU per process
                env["CUDA_VISIBLE_DEVICES"] = gpu
            env.update(gpu_share_env(r, a.nprocs, gpus, os.environ))
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
