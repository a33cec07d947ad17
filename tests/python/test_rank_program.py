"""The structure of a rank's one-program loop (program.RankProgram) for multi-process steps:
the items a rank's instruction stream becomes, how they roll into scans, and the invariants
every schedule's items keep. Running the programs across processes (against plain JAX) is in
test_mp_e2e.py; these checks need no second process."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import pytest  # noqa: E402

import baton  # noqa: E402
from baton import _core  # noqa: E402
from baton.frontend.program import RankProgram, _analyze, item_reads, item_writes, rank_items  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "eager1f1b", "interleaved", "zbh1", "zbh2", "zbv", "dualpipev"]


def _step(name, ranks, microbatches):
    from mlp_step import make

    ps, params, batch = make(baton.schedule_from_name(name), ranks, microbatches)
    return ps.compile(params, batch)


def test_one_f_one_b_rank_programs():
    """2 ranks, 1F1B, 8 microbatches: rank 0's steady state is one scan advancing two
    microbatches per repetition, so each stash is read (B0) before the next repetition's F0
    overwrites its carry slot; rank 1's pattern is rotated so each period's transfers are one
    call. Receives are posted where the interpreter posts them (Executor::post_ahead: before
    the task preceding the RECV), so the simulator's memory model holds for the program."""
    cs = _step("1f1b", 2, 8)
    r0 = RankProgram(cs, 0, _core.runtime.RankComm(0), 10.0)
    r1 = RankProgram(cs, 1, _core.runtime.RankComm(1), 10.0)
    assert r0.describe() == (
        "[F0]; [>Act0]; scan 3 x [+Grad1 F0 >Act0 <Grad1 B0 +Grad1 F0 >Act0 <Grad1 B0]/2; "
        "[+Grad1]; [F0]; [>Act0]; [+Grad1]; [<Grad1]; [B0]; [<Grad1]; [B0]")
    assert r1.describe() == (
        "scan 2 x [+Act0]; [<Act0]; scan 5 x [FB1 >Grad1 +Act0 <Act0]; [FB1]; [>Grad1]; "
        "[+Act0]; scan 2 x [<Act0 FB1 >Grad1]")
    assert r0.stacked_buffers() == r1.stacked_buffers() == []
    for rp in (r0, r1):
        for (pat, r, d), slots in zip(rp.runs, rp._slots):
            if r > 1:
                assert _analyze(cs, pat, d).copies == 0, pat  # every carry slot in place
    # rank 0: Grad1(m) is posted right after Act0(m) is sent, before F0(m+1), and waited on
    # before B0(m)
    items = rank_items(cs, 0)
    assert items[:7] == [("run", "F", 0, 0, -1), ("send", "Act", 0, 0, 1),
                         ("post", "Grad", 1, 0, 1), ("run", "F", 0, 1, -1),
                         ("send", "Act", 0, 1, 1), ("wait", "Grad", 1, 0, 1),
                         ("run", "B", 0, 0, -1)]


# the V schedules at 2 ranks only: 4 ranks would need 8 stages of the test MLP
@pytest.mark.parametrize("name,ranks", [(n, 2) for n in SCHEDULES]
                         + [(n, 4) for n in SCHEDULES if n not in ("zbv", "dualpipev")])
def test_rank_items_keep_the_stream(name, ranks):
    """For every schedule: a rank's items run its tasks in the stream's order; every buffer
    is posted, then waited on, before the first task that reads it, and sent after the task
    that makes it; what a rank sends to a peer is what that peer waits on from it; no run
    hands stacked buffers on."""
    from baton.frontend.program import task_list

    cs = _step(name, ranks, 2 * ranks)
    sent, waited = set(), set()
    for r in range(ranks):
        items = rank_items(cs, r)
        assert [it[1:4] for it in items if it[0] == "run"] == task_list(cs, r)
        have, posted = set(), set()
        for it in items:
            op, k, s, m, peer = it
            if op == "post":
                posted.add((k, s, m))
            elif op == "wait":
                assert (k, s, m) in posted, (r, it)
                waited.add((peer, r, k, s, m))
            elif op == "send":
                assert (k, s, m) in have, (r, it)
                sent.add((r, peer, k, s, m))
            for key in item_reads(cs, it):
                assert key in have, (r, it, key)
            have.update(item_writes(cs, it))
        rp = RankProgram(cs, r, _core.runtime.RankComm(r), 10.0)
        assert rp.stacked_buffers() == [], (r, rp.describe())
    assert sent == waited


@pytest.mark.parametrize("name,ranks", [(n, 2) for n in SCHEDULES]
                         + [(n, 4) for n in ("1f1b", "interleaved", "zbh2")])
def test_transfers_pair_in_fifo_order(name, ranks):
    """The FFI transfers carry no buffer ids: the k-th send a->b of a buffer kind pairs with
    the k-th receive b posts from a of that kind (the verifier's FIFO model), and b waits on
    its receives in the order it posted them. Both hold for the items of every schedule."""
    cs = _step(name, ranks, 2 * ranks)
    sends: dict[tuple, list] = {}
    posts: dict[tuple, list] = {}
    for r in range(ranks):
        waits: dict[tuple, list] = {}
        for op, k, s, m, peer in rank_items(cs, r):
            if op == "send":
                sends.setdefault((r, peer, k), []).append((s, m))
            elif op == "post":
                posts.setdefault((peer, r, k), []).append((s, m))
            elif op == "wait":
                waits.setdefault((peer, r, k), []).append((s, m))
        for key, got in waits.items():
            assert got == posts[key], (r, key)
    assert sends == posts
