"""The events a step's ranks recorded, gathered across processes (``gather_events``): each
rank's list to every process, with each rank's clock offset to rank 0 (``clock_offsets``).
The engines call it after a traced multi-process run; ``measure/traces.py`` reads the
result."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

_TAG_CLOCK = 1 << 45  # above the Router's tags; slots are tag << 16, below 1 << 62 (control)


def clock_offsets(transport: Any, rank: int, world: int, timeout: float,
                  rounds: int = 8) -> list[int] | None:
    """Rank 0: each rank's monotonic clock minus rank 0's, in ns (ping-pong, keeping the
    sample with the shortest round trip). Other ranks answer and get None."""
    tag = _TAG_CLOCK
    if rank == 0:
        offsets = [0] * world
        for peer in range(1, world):
            best = None
            for k in range(rounds):
                t_a = time.monotonic_ns()
                transport.isend(peer, tag + k, [np.zeros(1, np.int64)]).wait(timeout)
                t_peer = int(transport.irecv(peer, tag + k).wait(timeout)[0][0])
                t_b = time.monotonic_ns()
                if best is None or t_b - t_a < best[0]:
                    best = (t_b - t_a, t_peer - (t_a + t_b) // 2)
            offsets[peer] = best[1]
        return offsets
    for k in range(rounds):
        transport.irecv(0, tag + k).wait(timeout)
        now = time.monotonic_ns()
        transport.isend(0, tag + k, [np.array([now], np.int64)]).wait(timeout)
    return None


def gather_events(group: Any, events: list[list], timeout: float,
                  mesh: Any = None) -> tuple[list, list[int]]:
    """Every rank's events and clock offsets to process 0, in every process (collective).
    ``events``: one list per rank this process runs (``mesh.ranks_of(p)``: process p of k
    ranks runs ranks ``p*k .. p*k+k-1``, all on this process's clock). When ranks span
    processes, a rank's events are those of its slot 0 (the process holding shard 0, whose
    handlers keep the task marks)."""
    t = group.transport
    offsets = clock_offsets(t, group.rank, group.world_size, timeout)
    blobs = t.exchange(json.dumps({"events": [[list(e) for e in ev] for ev in events],
                                   "offsets": offsets}), timeout)
    parsed = [json.loads(b) for b in blobs]
    if mesh is not None and mesh.spans:
        first = [mesh.procs(r)[0] for r in range(mesh.num_ranks)]
        return ([[tuple(e) for e in parsed[p]["events"][0]] for p in first],
                [parsed[0]["offsets"][p] for p in first])
    all_events = [[tuple(e) for e in ev] for p in parsed for ev in p["events"]]
    k = len(events)
    return all_events, [o for o in parsed[0]["offsets"] for _ in range(k)]
