"""The code before and after the microbatch loop as per-stage jitted segments (``Segments``).

Every op outside the loop belongs to a stage (``op_stage``: a post-loop op to the stage of its
largest staged input, a pre-loop op to its first consumer's). A region's segments run in
*slots*: slot k after every earlier slot, whatever their stages, so a value one stage makes
reaches another stage's segment only in a later slot. Ops are placed in two passes:

1. **waves** (as soon as possible): each wave gives every stage one segment of the ops whose
   inputs are ready. This fixes the slots (wave-major, then stage) and how many each stage has.
2. **latest** (as late as possible): each op moves to the latest slot of its stage that is no
   later than its own stage's readers and earlier than every other stage's. Only what another
   stage waits for stays early (a gradient norm's partial sums); the rest (Adam's moment
   decays, a weight decay's product) joins the segment that reads it, where XLA fuses it into
   the update's kernels instead of compiling a kernel of its own for it and writing its result
   out: fewer kernels to compile at the first call, less memory traffic at every call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from .. import _core
from ..errors import TraceError
from ..tracing.trace import Traced
from .tasks import make_fn

G = _core.graph

_SMALL_COPY = 4096  # elements: post-loop values small enough to compute on every stage


@dataclasses.dataclass
class Segment:
    stage: int
    fn: Any
    inputs: list[int]
    outputs: list[int]
    donate: tuple = ()  # positions of ``inputs`` the program donates


@dataclasses.dataclass
class _Placed:
    """A segment before it is jitted: its stage and its ops in program order."""
    stage: int
    ops: list[int]


class Segments:
    """The code before and after the loop as per-stage jitted segments (``pre``, ``post``),
    each list in slot order."""

    def __init__(self, traced: Traced, op_stage: list[int], num_stages: int,
                 fix_of=lambda stage: None, donated: frozenset = frozenset()):
        self.fix_of = fix_of
        self.traced = traced
        self.op_stage = op_stage
        self.num_stages = num_stages
        tr = traced
        ops = tr.ops
        pre = [i for i, op in enumerate(ops) if op.region == G.Region.Pre]
        post = [i for i, op in enumerate(ops) if op.region == G.Region.Post]
        self.pre = self._segments(pre, set(tr.step_inputs))
        avail = set(tr.step_inputs)
        for s in self.pre:
            avail.update(s.outputs)
        avail.update(o for _, o, _ in tr.loop_outputs)
        self.post = self._segments(post, avail, self._small_free_copies(post), donated)

    def _small_free_copies(self, post: list[int]) -> dict[int, set[int]]:
        """Post-loop ops that read only step inputs, literals and each other and make small
        values (the optimizer's step count and bias corrections): op -> the other stages whose
        post-loop ops read them. Each of those stages computes its own copy, so its optimizer
        update does not wait for the stage the op was placed on (which finishes its loop
        last)."""
        tr = self.traced
        ops = tr.ops
        free_vals = set(tr.step_inputs) | set(tr.literals)
        free_by_val: dict[int, int] = {}
        for i in post:
            op = ops[i]
            small = all(int(np.prod(tr.avals[v].shape)) <= _SMALL_COPY for v in op.outputs)
            if small and all(v in free_vals for v in op.inputs):
                free_vals.update(op.outputs)
                for v in op.outputs:
                    free_by_val[v] = i
        copies: dict[int, set[int]] = {}

        def need(i, stage):
            if stage == self.op_stage[i] or stage in copies.setdefault(i, set()):
                return
            copies[i].add(stage)
            for v in ops[i].inputs:
                if v in free_by_val:
                    need(free_by_val[v], stage)

        for j in post:
            if j in free_by_val.values():
                continue
            for v in ops[j].inputs:
                if v in free_by_val:
                    need(free_by_val[v], self.op_stage[j])
        return {i: st for i, st in copies.items() if st}

    def _segments(self, op_ids: list[int], avail: set[int],
                  copies: dict[int, set[int]] | None = None,
                  donated: frozenset = frozenset()) -> list[Segment]:
        """Per-stage jitted segments of ``op_ids``, placed in waves then as late as they can
        run. ``copies``: op -> extra stages that compute their own copy of it (see
        _small_free_copies); a value such an op makes is read on a stage only from that
        stage's own copy. ``donated``: step inputs the caller gave up
        (``baton.jit(donate_argnums=...)``); the last segment that reads one donates it when
        it makes an output of its shape and dtype (the new parameters or optimizer state: XLA
        writes them in place)."""
        copies = copies or {}
        waves = self._waves(op_ids, avail, copies)
        return self._jitted(self._latest(waves), donated)

    def _waves(self, op_ids, avail, copies) -> list[_Placed]:
        """The slots, as soon as possible: in each wave, every stage's segment of the (op,
        stage) items whose inputs are ready."""
        ops = self.traced.ops
        lits = self.traced.literals
        copied_vals = {v for i in copies for v in ops[i].outputs}
        local: dict[int, set[int]] = {s: set() for s in range(self.num_stages)}
        # (op, stage) items: every op on its own stage, plus the copies
        remaining = sorted([(i, self.op_stage[i]) for i in op_ids]
                           + [(i, st) for i in op_ids for st in sorted(copies.get(i, ()))])
        avail = set(avail)
        slots: list[_Placed] = []

        def ready(v, stage, produced):
            if v in lits or v in produced:
                return True
            if v in copied_vals:
                return v in local[stage]
            return v in avail

        while remaining:
            progress = False
            for stage in range(self.num_stages):
                seg, produced = [], set()
                for i, st in remaining:
                    if st == stage and all(ready(v, stage, produced) for v in ops[i].inputs):
                        seg.append(i)
                        produced.update(ops[i].outputs)
                if not seg:
                    continue
                progress = True
                seg_set = set(seg)
                remaining = [(i, st) for i, st in remaining if not (st == stage and i in seg_set)]
                slots.append(_Placed(stage, seg))
                avail.update(produced)
                local[stage].update(produced)
            if not progress:
                raise TraceError("internal: code outside the loop could not be ordered by stage")
        return slots

    def _latest(self, waves: list[_Placed]) -> list[_Placed]:
        """``waves``' items moved each to the latest slot of its stage that comes no later
        than its readers on its own stage and before its readers on other stages (its
        slot from ``waves`` is the earliest, so one always exists); empty slots dropped."""
        ops = self.traced.ops
        slot_of = {(i, w.stage): k for k, w in enumerate(waves) for i in w.ops}
        maker = {v: i for i, _ in slot_of for v in ops[i].outputs}
        readers: dict[tuple, list[tuple]] = {}
        for j, st in slot_of:
            for v in ops[j].inputs:
                if v in maker:
                    i = maker[v]  # a stage reads its own copy where it has one
                    src = (i, st) if (i, st) in slot_of else (i, self.op_stage[i])
                    readers.setdefault(src, []).append((j, st))
        stage_slots = {s: [k for k, w in enumerate(waves) if w.stage == s]
                       for s in range(self.num_stages)}
        latest: dict[tuple, int] = {}
        for item in sorted(slot_of, key=lambda it: -it[0]):  # readers before their makers
            st = item[1]
            k = stage_slots[st][-1]
            for r in readers.get(item, ()):
                if r[1] == st:
                    k = min(k, latest[r])
                else:
                    k = min(k, max((q for q in stage_slots[st] if q < latest[r]), default=-1))
            if k < slot_of[item]:
                raise TraceError(f"internal: op {item[0]} of stage {st} outside the loop has "
                                 "no slot before its readers")
            latest[item] = k
        placed = [_Placed(w.stage, []) for w in waves]
        for (i, _), k in sorted(latest.items()):
            placed[k].ops.append(i)
        return [p for p in placed if p.ops]

    def _jitted(self, placed: list[_Placed], donated: frozenset) -> list[Segment]:
        """Each placed segment as a jitted function of the values it reads (``inputs``) to
        the values read after it (``outputs``: by later ops, the loop, the step's outputs)."""
        tr = self.traced
        ops = tr.ops
        lits = tr.literals
        uses: dict[int, set] = {}
        for i, op in enumerate(ops):
            for v in op.inputs:
                uses.setdefault(v, set()).add(i)
        external = set(tr.step_outputs) | {o for _, o, _ in tr.loop_inputs}
        shapes = []
        for p in placed:
            seg_set = set(p.ops)
            produced = {v for i in p.ops for v in ops[i].outputs}
            ins = sorted({v for i in p.ops for v in ops[i].inputs
                          if v not in produced and v not in lits})
            outs = sorted(v for v in produced
                          if v in external or any(u not in seg_set for u in uses.get(v, ())))
            shapes.append((p, ins, outs))
        out = []
        for j, (p, ins, outs) in enumerate(shapes):
            later = set(tr.step_outputs).union(*[set(x[1]) for x in shapes[j + 1:]])
            give = donatable(tr.avals, ins, outs, donated, later)
            fn = make_fn(tr, p.ops, ins, outs, self.fix_of(p.stage))
            out.append(Segment(p.stage, jax.jit(fn, donate_argnums=give), ins, outs, give))
        return out


def donatable(avals, ins, outs, donated, later) -> tuple[int, ...]:
    """Positions of ``ins`` a program donates: donated step inputs nothing ``later`` reads,
    each matched to an output of ``outs`` with the same shape and dtype (XLA reuses a donated
    buffer only for such an output; an unmatched donation would only warn)."""
    free: dict[tuple, int] = {}
    for v in outs:
        k = (tuple(avals[v].shape), str(avals[v].dtype))
        free[k] = free.get(k, 0) + 1
    pos = []
    for j, v in enumerate(ins):
        k = (tuple(avals[v].shape), str(avals[v].dtype))
        if v in donated and v not in later and free.get(k, 0) > 0:
            free[k] -= 1
            pos.append(j)
    return tuple(pos)
