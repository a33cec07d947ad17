"""Admission at rendezvous: only this job's processes join.

A *job token* (a secret shared by the job's processes) comes from the environment:
``BATON_JOB_TOKEN`` (``python -m baton.launch`` makes a fresh one per launch), else one
derived from SLURM's job id, step id and restart count (a requeued job gets another),
else none (admission off; the store's own isolation is all there is). It is used twice:

* every rendezvous store key lives under the job's *namespace*, a hash of the token
  (:func:`job_namespace`; a file store: a sub-directory), so processes with another token
  never read or write this job's keys;
* once a transport's connections are up, and before any data moves, every pair of ranks
  runs a challenge-response *hello* over its own connection (:func:`admit`): each sends a
  fresh random nonce, then proves knowledge of the token with an HMAC-SHA256 over both
  nonces, both ranks and the namespace. The token never leaves the process in clear. A
  peer whose proof is wrong (another job's or a stale run's process, or a stray
  connection Gloo took for a peer) is refused: logged with the address it reports, and
  every rank raises ``ConfigError`` naming it; a peer that sends nothing is named when
  the hello times out. Nothing waits unbounded.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket

import numpy as np

from ..errors import ConfigError

_TAG = 1 << 43  # below the router's tags (1 << 44), far above the executor's
_NONCE = 32
_log = logging.getLogger("baton")


def new_token() -> str:
    """A fresh random job token (what the launcher puts in ``BATON_JOB_TOKEN``)."""
    return secrets.token_hex(32)


def job_token(env=None) -> str | None:
    """This job's token: ``BATON_JOB_TOKEN``, else derived from ``SLURM_JOB_ID`` (with
    ``SLURM_STEP_ID`` and ``SLURM_RESTART_COUNT``), else None."""
    env = os.environ if env is None else env
    tok = env.get("BATON_JOB_TOKEN")
    if tok:
        return tok
    if env.get("SLURM_JOB_ID"):
        return "slurm:" + ":".join(env.get(k, "") for k in
                                   ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"))
    return None


def job_namespace(token: str | None) -> str:
    """The store namespace of ``token`` ("" without one): not the token, a hash of it."""
    if not token:
        return ""
    return "job-" + hashlib.sha256(b"baton-namespace\0" + token.encode()).hexdigest()[:16]


def _proof(token: str, ns: str, src: int, dst: int, nonce_dst: bytes, nonce_src: bytes) -> bytes:
    msg = b"baton-hello\0%s\0%d\0%d\0" % (ns.encode(), src, dst) + nonce_dst + nonce_src
    return hmac.new(token.encode(), msg, hashlib.sha256).digest()


def _blob(b: bytes) -> np.ndarray:
    return np.frombuffer(b, np.uint8).copy()


def _exchange(t, rank: int, world: int, tag: int, mine: dict[int, bytes], timeout: float,
              what: str) -> dict[int, bytes]:
    """Sends ``mine[p]`` to every peer p and returns what each sent (bounded waits)."""
    peers = [p for p in range(world) if p != rank]
    sends = [t.isend(p, tag, [_blob(mine[p])]) for p in peers]
    recvs = {p: t.irecv(p, tag) for p in peers}
    t.flush()
    got = {}
    for p, r in recvs.items():
        try:
            got[p] = np.asarray(r.wait(timeout)[0]).tobytes()
        except Exception as e:
            raise ConfigError(f"rank {rank}: admission: rank {p} sent no {what} within "
                              f"{timeout:g} s ({type(e).__name__}: {e}); refused") from None
    for s in sends:
        s.wait(timeout)
    return got


def admit(t, rank: int, world: int, token: str, ns: str, timeout: float) -> None:
    """The hello over transport ``t`` (connected, nothing sent yet). Raises ``ConfigError``
    naming every peer that failed it."""
    if world == 1:
        return
    me = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
    nonce = secrets.token_bytes(_NONCE)
    hello = _exchange(t, rank, world, _TAG, {p: nonce + me for p in range(world)}, timeout,
                      "hello")
    proofs = {p: _proof(token, ns, rank, p, h[:_NONCE], nonce) for p, h in hello.items()}
    got = _exchange(t, rank, world, _TAG + 1, proofs, timeout, "proof of the job token")
    bad = []
    for p, h in hello.items():
        want = _proof(token, ns, p, rank, nonce, h[:_NONCE])
        if len(h) < _NONCE or not hmac.compare_digest(got[p], want):
            who = _reported(h[_NONCE:])
            _log.warning("baton admission: rank %d refused the connection of rank %d (%s): "
                         "wrong proof of the job token", rank, p, who)
            bad.append(f"rank {p} ({who})")
    if bad:
        raise ConfigError(
            f"rank {rank}: admission refused {', '.join(bad)}: its proof of the job token is "
            f"wrong (a process of another job or of a stale run of this one, or a stray "
            f"connection); check that every process got this launch's BATON_JOB_TOKEN")


def _reported(b: bytes) -> str:
    try:
        d = json.loads(b.decode())
        return f"reports host {str(d['host'])[:64]}, pid {int(d['pid'])}"
    except Exception:
        return f"sent {len(b)} unreadable bytes"


__all__ = ["admit", "job_namespace", "job_token", "new_token"]
