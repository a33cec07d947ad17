"""The structure of a rank's one-program loop (program.RankProgram) for multi-process steps:
the items a rank's instruction stream becomes, the table of units they run as, its rings, and
the invariants every schedule's items keep. Running the programs across processes (against
plain JAX) is in test_mp_e2e.py; these checks need no second process."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import pytest  # noqa: E402

import baton  # noqa: E402
from baton import _core  # noqa: E402
from baton.emit.rank_program import RankProgram  # noqa: E402
from baton.emit.rolling import item_reads, item_writes, rank_items  # noqa: E402
from baton.planning.tasks import unit_order  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "eager1f1b", "interleaved", "zbh1", "zbh2", "zbv", "dualpipev"]


def _step(name, ranks, microbatches):
    from mlp_step import make

    ps, params, batch = make(baton.schedule_from_name(name), ranks, microbatches)
    return ps.compile(params, batch)


def test_one_f_one_b_rank_programs():
    """2 ranks, 1F1B, 8 microbatches: each rank's loop is a table whose units are its tasks
    (each once: F0 and B0 on rank 0, the fused FB1 on rank 1) and its distinct transfer
    stretches; rank 0 keeps two stashes in flight (a ring of 2), every other buffer is read by
    the next unit (rings of 1). Receives are posted where the rank IR posts them (the
    interpreter runs the same IR: before the task preceding the RECV), so the simulator's
    memory model holds for the program."""
    cs = _step("1f1b", 2, 8)
    r0 = RankProgram(cs, 0, _core.runtime.RankComm(0), 10.0)
    r1 = RankProgram(cs, 1, _core.runtime.RankComm(1), 10.0)
    assert r0.describe() == (
        "table 16 steps; tasks F0 B0; transfers [>Act0.a +Grad1.a] [>Act0.a <Grad1.b] "
        "[+Grad1.a] [>Act0.a +Grad1.a <Grad1.b] [<Grad1.a]; rings Act0:1 Grad1:1 Stash0:2")
    assert r1.describe() == (
        "table 9 steps; tasks FB1; transfers [+Act0.a +Act0.b <Act0.a] "
        "[>Grad1.a +Act0.b <Act0.c] [>Grad1.a <Act0.b] [>Grad1.a]; rings Act0:1 Grad1:1")
    assert r0.unit_sequence()[:5] == ["F0", ">Act0 +Grad1", "F0", ">Act0 <Grad1", "B0"]
    assert [u for u in r0.unit_sequence() if u[0] not in "<>+"] == \
        ["F0", "F0"] + ["B0", "F0"] * 6 + ["B0", "B0"]
    # rank 0: Grad1(m) is posted right after Act0(m) is sent, before F0(m+1), and waited on
    # before B0(m)
    items = rank_items(cs, 0)
    RUN, SEND, POST, WAIT = (_core.ItemOp.RUN, _core.ItemOp.SEND, _core.ItemOp.POST,
                             _core.ItemOp.WAIT)
    F, B = _core.TaskKind.F, _core.TaskKind.B
    Act, Grad = _core.BufKind.Act, _core.BufKind.Grad
    assert items[:7] == [(RUN, F, 0, 0, -1), (SEND, Act, 0, 0, 1),
                         (POST, Grad, 1, 0, 1), (RUN, F, 0, 1, -1),
                         (SEND, Act, 0, 1, 1), (WAIT, Grad, 1, 0, 1),
                         (RUN, B, 0, 0, -1)]


# the V schedules at 2 ranks only: 4 ranks would need 8 stages of the test MLP
@pytest.mark.parametrize("name,ranks", [(n, 2) for n in SCHEDULES]
                         + [(n, 4) for n in SCHEDULES if n not in ("zbv", "dualpipev")])
def test_rank_items_keep_the_stream(name, ranks):
    """For every schedule: a rank's items run its tasks in the stream's order; every buffer
    is posted, then waited on, before the first task that reads it, and sent after the task
    that makes it; what a rank sends to a peer is what that peer waits on from it; no run
    hands stacked buffers on."""
    from baton.emit.rolling import task_list

    cs = _step(name, ranks, 2 * ranks)
    sent, waited = set(), set()
    for r in range(ranks):
        items = rank_items(cs, r)
        assert [it[1:4] for it in items if it[0] == _core.ItemOp.RUN] == task_list(cs, r)
        have, posted = set(), set()
        for it in items:
            op, k, s, m, peer = it
            if op == _core.ItemOp.POST:
                posted.add((k, s, m))
            elif op == _core.ItemOp.WAIT:
                assert (k, s, m) in posted, (r, it)
                waited.add((peer, r, k, s, m))
            elif op == _core.ItemOp.SEND:
                assert (k, s, m) in have, (r, it)
                sent.add((r, peer, k, s, m))
            for key in item_reads(cs, it):
                assert key in have, (r, it, key)
            have.update(item_writes(cs, it))
        _check_rings(cs, r)
    assert sent == waited


def _check_rings(cs, r):
    """Replays rank ``r``'s items with the rings its rank program assigns, one per buffer
    kind and one shared by all kinds (the lowering shares a ring among kinds of equal avals):
    every read finds the buffer it wants in its slot (nothing overwrote it), a task never
    writes a slot it reads, and each ring has exactly as many slots as the most buffers of
    its pool held at once (from where the program puts one to its last read, both
    included)."""
    rp = RankProgram(cs, r, _core.runtime.RankComm(r), 10.0)
    for pool_of in (None, {ks: 0 for ks in rp.lives}):
        rp._pool(pool_of)
        slots: dict[tuple, tuple] = {}
        for it in rp.items:
            read = set()
            for k, s, m in item_reads(cs, it):
                key = (rp.pool_of[(k, s)], int(rp.slots[(k, s)][m]))
                assert slots.get(key) == (k, s, m), (r, it, slots.get(key))
                read.add(key)
            for k, s, m in item_writes(cs, it):
                if (k, s) in rp.pool_of:
                    key = (rp.pool_of[(k, s)], int(rp.slots[(k, s)][m]))
                    assert key not in read, (r, it)
                    slots[key] = (k, s, m)
        for pool, R in rp.rings.items():
            spans = [(w, last) for ks, w, last in rp.layout.held if rp.pool_of[ks] == pool]
            most = max(sum(w <= p <= last for w, last in spans) for p, _ in spans)
            assert R == most, (r, pool, R, most)
    # every task kind once per rank, whatever the schedule
    tasks = [it[1:3] for it in rp.items if it[0] == _core.ItemOp.RUN]
    assert sorted(rp.units, key=unit_order) == sorted(set(tasks), key=unit_order), (
        r, rp.describe())


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
            if op == _core.ItemOp.SEND:
                sends.setdefault((r, peer, k), []).append((s, m))
            elif op == _core.ItemOp.POST:
                posts.setdefault((peer, r, k), []).append((s, m))
            elif op == _core.ItemOp.WAIT:
                waits.setdefault((peer, r, k), []).append((s, m))
        for key, got in waits.items():
            assert got == posts[key], (r, key)
    assert sends == posts
