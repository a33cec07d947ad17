"""Launching a worker script as 2 processes (``python -m baton.launch``, one CPU device each)
whose processes each write ``process<p>.json`` into a folder: ``run_workers``; the environment
of workers that start ``jax.distributed``: ``distributed_env``."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys


def run_workers(tmp: pathlib.Path, worker: str, nprocs: int = 2) -> list:
    """Writes ``worker`` to ``tmp/worker.py``, launches it with ``tmp`` as its argument (with
    faulthandler: a process that aborts prints every thread's Python stack, which the
    assertion shows) and returns each process's JSON, in process order."""
    script = tmp / "worker.py"
    script.write_text(worker)
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="1", JAX_PLATFORMS="cpu", PYTHONFAULTHANDLER="1")
    p = subprocess.run([sys.executable, "-m", "baton.launch", "--nprocs", str(nprocs),
                        "--grace", "20", "--timeout", "200", str(script), str(tmp)],
                       capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-6000:]
    return [json.loads((tmp / f"process{q}.json").read_text()) for q in range(nprocs)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distributed_env() -> dict[str, str]:
    """For workers that start ``jax.distributed`` (their ranks span processes): a free port
    for its coordinator (``BATON_TEST_COORD``), and JAX's persistent compilation cache off,
    since JAX 0.12.1 hangs running cross-process collectives loaded from it (baton.jit refuses
    such a mesh while the cache is on)."""
    return {"BATON_TEST_COORD": f"127.0.0.1:{free_port()}",
            "JAX_ENABLE_COMPILATION_CACHE": "false"}
