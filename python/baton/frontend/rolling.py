"""A rank's program as items, and rolling items into runs of a repeating pattern.

An item is one thing a rank's loop does: a task it runs, or a transfer (a send, a receive
posted, a receive waited on). ``task_list`` and ``rank_items`` read a rank's items from the
plan and the C++ rank program; ``item_reads`` / ``item_writes`` say which buffers each one
reads and makes.

``roll`` splits the items into runs of a repeating pattern whose microbatches grow by
``delta`` per repetition (``[FB0]`` x 8 for fused 1F1B; ``[F0 I0 W0]`` x 8 for ZB-H1); a loop
program (``loop_program.py``) lowers each run of two or more repetitions as a ``lax.scan``:

* weight-gradient sums are its carry (zeros, ``+``, ``/ M``);
* a buffer read one repetition after the one that made it is a carry slot, written where it
  is made and read where the next repetition reads it;
* microbatch slices are its ``xs``;
* buffers read after the run and stacked per-microbatch outputs are its ``ys``.

A pattern is rolled only when every buffer a repetition reads is made earlier in the same
repetition or in the previous one (a carry slot, ``_analyze``): a buffer made before the run
would have to be read from a stack of copies. Items outside any run are called in place.
"""

from __future__ import annotations

from typing import NamedTuple

from .. import _core
from .tasks import buffer_reads, task_exes

_MAX_PERIOD_PER_STAGE = 4

class Item(NamedTuple):
    """One step of a rank's program as the emitter lowers it. ``op`` "run": ``kind`` a task
    kind (F, B, I, W, FB), ``peer`` -1; "send" / "post" (a receive posted) / "wait" (a
    receive waited on): ``kind`` a buffer kind, ``peer`` the other rank."""

    op: str
    kind: str
    stage: int
    mb: int
    peer: int


def task_list(cs, rank: int = 0) -> list[tuple[str, int, int]]:
    """A rank's tasks in program order: (kind, stage, microbatch); fused F+B as ``FB``."""
    b = cs.buffers
    return [t for a in range(len(b.rank_actions[rank])) for t in b.tasks_of(rank, a)]


def _exes(cs, kind, s):
    return task_exes(cs.tasks, kind, s)


def reads(cs, kind, s, m) -> list[tuple[str, int, int]]:
    """Buffers (kind, stage, microbatch) a task passes to its function (``buffer_reads``
    of the plan's reads)."""
    return buffer_reads(_exes(cs, kind, s)[0], cs.buffers.reads(kind, s, m))


def writes(cs, kind, s, m) -> list[tuple[str, int, int]]:
    """Buffers a task makes (the plan's, ``Buffers.writes``), but its weight gradients: a
    program adds them to its sums directly."""
    return [key for key in cs.buffers.writes(kind, s, m) if key[0] != "WGrad"]


def item_reads(cs, it: Item) -> list[tuple[str, int, int]]:
    op, k, s, m, _ = it
    if op == "run":
        return reads(cs, k, s, m)
    return [(k, s, m)] if op == "send" else []


def item_writes(cs, it: Item) -> list[tuple[str, int, int]]:
    op, k, s, m, _ = it
    if op == "run":
        return writes(cs, k, s, m)
    return [(k, s, m)] if op == "wait" else []


def _shift(it: Item, d: int) -> Item:
    return it._replace(mb=it.mb + d)


def rank_items(cs, rank: int) -> list[Item]:
    """A rank's program as items, read from the C++ rank program (``cs.rank_ir()``,
    docs/RANK_IR.md), which says where each group of transfers is posted (its receives where
    the plan posts them: before the RUN that precedes the RECV) and where each receive is
    waited on (just before the first task that reads it). The C++ verifier checks what the
    FFI transfers need: each wait follows its post, and the waits of one (peer, channel) come
    in post order."""
    prog = cs.rank_ir().programs[rank]
    bufs = cs.buffers
    items: list[Item] = []

    def key(b):
        return bufs.key(prog.buffers[b].id)

    for ins in prog.instrs:
        if ins.op == _core.RankOp.POST:
            for t in prog.groups[ins.group].transfers:
                x = prog.transfers[t]
                op = "send" if x.dir == _core.TransferDir.SEND else "post"
                items.append(Item(op, *key(x.buffer), x.peer))
        elif ins.op == _core.RankOp.WAIT:
            x = prog.transfers[ins.transfer]
            items.append(Item("wait", *key(x.buffer), x.peer))
        elif ins.op == _core.RankOp.RUN:
            for kind, s, m in bufs.tasks_of(rank, prog.units[ins.unit].action):
                items.append(Item("run", kind, s, m, -1))
    return items


def _analyze(cs, pat: list[Item], delta: int):
    """The carry slots of ``pat`` as a scan body advancing ``delta`` microbatches per
    repetition, or None when it cannot be one. A slot ``(k, s, m)`` is a buffer the pattern
    makes at microbatch ``m`` and the next repetition reads (there at ``m`` again, i.e.
    ``m - delta`` relative to it)."""
    makers: dict[tuple[str, int], dict[int, int]] = {}
    for j, it in enumerate(pat):
        for k, s, m in item_writes(cs, it):
            if m in makers.setdefault((k, s), {}):
                return None
            makers[(k, s)][m] = j
    slots = _Slots()
    for j, it in enumerate(pat):
        for k, s, m in item_reads(cs, it):
            mk = makers.get((k, s))
            if mk is None:
                # made before the run: the scan would read it from a stack of the buffers
                # (copies, as slow as the zero-filled stacked outputs of stacked_buffers)
                return None
            if mk.get(m, len(pat)) < j:
                continue  # made earlier in this repetition
            if m + delta in mk:
                slots.add((k, s, m + delta))
                if mk[m + delta] < j:  # overwritten before this read: both live at once
                    slots.copies += 1
                continue
            return None
    return slots


class _Slots(set):
    """Carry slots; ``copies``: reads of a slot's previous value after the repetition has
    made its new one. Both values are then live at once, so the loop's buffer cannot be updated
    in place (XLA copies the new value into it every repetition: an 11 MB stash per microbatch
    for the GPT of the benchmarks); read before it is overwritten, the slot is updated in
    place."""

    copies = 0


def _last_reads(cs, items) -> dict[tuple, int]:
    """The last position in ``items`` that reads each buffer."""
    last: dict[tuple, int] = {}
    for pos, it in enumerate(items):
        for key in item_reads(cs, it):
            last[key] = pos
    return last


def _stacked_out(cs, last_read, pat, r, d, end, slots) -> list[tuple[str, int, int]]:
    """The buffers (pattern microbatch) a run of ``pat`` (ending at position ``end``) makes
    that items after it read: they leave the scan stacked over its repetitions (its ``ys``),
    except the last repetition's value of a carry slot (the final carry)."""
    out = []
    for key in sorted({key for it in pat for key in item_writes(cs, it)}):
        k, s, m = key
        later = [t for t in range(r) if last_read.get((k, s, m + t * d), -1) >= end]
        if later and not (key in slots and later == [r - 1]):
            out.append(key)
    return out


def roll(cs, items, max_period=None, stacked=True) -> list[tuple[list[Item], int, int]]:
    """``items`` as runs ``(pattern, repetitions, delta)``: repetition t runs the pattern's
    items at microbatch ``m + t * delta``. Greedy from the front: among the (period, delta)
    with at least two repetitions, the one whose carry slots are all updated in place (see
    _Slots; else the fewest copies), then the one covering the most items, then the shortest
    period and the smallest delta; an item no period covers is a run of one. ``stacked``
    False: no run hands stacked buffers to later items (see _stacked_out)."""
    n = len(items)
    if max_period is None:
        max_period = _MAX_PERIOD_PER_STAGE * cs.num_stages
    max_p = max(1, max_period)
    last_read = _last_reads(cs, items)
    runs = []
    i = 0
    while i < n:
        best = (1, 1, 1)  # (period, repetitions, delta)
        # (-slot copies, items covered): the largest wins, then the first. A copy costs every
        # repetition; rolling only saves compile time, so no coverage pays for a copy.
        best_key = (-(1 << 30), 1)
        for p in range(1, min(max_p, (n - i) // 2) + 1):
            pat = items[i:i + p]
            for d in range(1, min(p, cs.M) + 1):
                r = 1
                while i + (r + 1) * p <= n and all(
                        items[i + r * p + j] == _shift(it, r * d) for j, it in enumerate(pat)):
                    r += 1
                if r < 2 or (0, r * p) <= best_key:
                    continue
                slots = _analyze(cs, pat, d)
                if (slots is not None and (-slots.copies, r * p) > best_key
                        and (stacked or not _stacked_out(cs, last_read, pat, r, d,
                                                         i + p * r, slots))):
                    best, best_key = (p, r, d), (-slots.copies, r * p)
        p, r, d = best
        runs.append((list(items[i:i + p]), r, d))
        i += p * r
    return runs


def _rotate(cs, runs):
    """Runs whose pattern starts and ends with transfers (rank 1 of a 1F1B: ``[<Act0 FB1
    >Grad1 +Act0]``) split a stretch of transfers at every repetition: two callbacks where one
    would do. Such a run becomes its first transfers in place, the pattern rotated (``[FB1
    >Grad1 +Act0 <Act0]``) for one repetition fewer, and the last repetition's rest in
    place."""
    out = []
    for pat, r, d in runs:
        k = 0
        while k < len(pat) and pat[k][0] != "run":
            k += 1
        if r > 2 and 0 < k < len(pat) and pat[-1][0] != "run":
            head, rest = pat[:k], pat[k:]
            rot = rest + [_shift(it, d) for it in head]
            if _analyze(cs, rot, d) is not None:
                out += [([it], 1, 1) for it in head]
                out.append((rot, r - 1, d))
                out += [([_shift(it, (r - 1) * d)], 1, 1) for it in rest]
                continue
        out.append((pat, r, d))
    return out
