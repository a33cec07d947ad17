"""Per-task executables and the in-process executor of a Plan.

``CompiledStep`` holds, for one traced step (one set of shapes): the C++
partition, the plan, one jitted callable per task (task kind x stage; reused for
every microbatch), jitted segments for the code before and after the loop, and
the cost model the simulator uses. ``CompiledStep.run`` interprets the plan's
per-rank instruction streams in one process:

* RUN    calls the jitted task on the rank's devices;
* SEND   posts the buffer on the (src, dst) channel; RECV takes it and
         ``jax.device_put``s it to the receiving rank's sharding;
* FREE   drops the reference; ACCUMULATE adds a WGrad into the stage's
         accumulator.

Ranks advance round-robin, each until it blocks (a RUN whose inputs are absent,
a RECV whose SEND has not been posted). If no rank can advance the executor
raises ``ExecutionError`` naming every blocked rank and instruction (it never
hangs). It counts live plan buffers per rank (bytes and count) and keeps the
peaks in ``last_stats``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _core
from .. import _jax_compat as jc
from ..errors import ExecutionError, TraceError
from .mesh import PipelineMesh
from .trace import Traced

G = _core.graph
REGION_PRE, REGION_POST = "pre", "post"
_OUT_GROUPS = ("act", "grad", "stash", "wstash", "wgrad", "mb")


@jax.jit
def _add_lists(a, b):
    return [x + y for x, y in zip(a, b)]


@jax.jit
def _scale_list(a, c):
    return [x / jnp.asarray(c, x.dtype) for x in a]


@jax.jit
def _stack(xs):
    return jnp.stack(xs)


@functools.partial(jax.jit, static_argnums=1)
def _split(x, m):
    x = jnp.asarray(x)
    x = x.reshape((m, x.shape[0] // m, *x.shape[1:]))
    return [x[i] for i in range(m)]


def _make_fn(traced: Traced, op_ids: list[int], in_ids: list[int], out_ids: list[int]):
    ops = [traced.ops[i] for i in op_ids]
    lits = traced.literals

    def fn(*args):
        env = dict(zip(in_ids, args))

        def read(v):
            if v in env:
                return env[v]
            return lits[v]

        for op in ops:
            outs = jc.eval_eqn(op.prim, op.params, op.ctx, [read(v) for v in op.inputs])
            for v, x in zip(op.outputs, outs):
                env[v] = x
        return [read(v) for v in out_ids]

    return fn


@dataclasses.dataclass
class TaskExe:
    kind: str
    stage: int
    fn: Any
    in_groups: tuple  # (invariant, microbatch, act, grad, stash, wstash) value ids
    n_out: dict  # group name -> count
    body: Any


@dataclasses.dataclass
class Segment:
    stage: int
    fn: Any
    inputs: list[int]
    outputs: list[int]


class CompiledStep:
    def __init__(self, traced: Traced, plan: Any, mesh: PipelineMesh, split_backward: bool):
        self.traced = traced
        self.mesh = mesh
        self.plan = plan  # baton.Plan (python wrapper)
        core = plan.core if hasattr(plan, "core") else plan
        self.core_plan = core
        self.partition = G.partition(traced.program, split_backward)
        sched = core.schedule
        self.num_stages = sched.num_stages
        self.num_ranks = sched.num_ranks
        self.M = sched.num_microbatches
        self.stage_rank = list(sched.stage_rank)
        self.rank_actions = [list(a) for a in sched.rank_actions]
        self.programs = [[(str(i.opcode), i.action, i.buffer, i.peer) for i in prog]
                         for prog in core.programs]
        self.parts = list(self.partition.parts)
        self.tasks: dict[tuple[str, int], TaskExe] = {}
        for t in self.partition.tasks:
            groups = (list(t.invariant_in), list(t.microbatch_in), list(t.act_in),
                      list(t.grad_in), list(t.stash_in), list(t.wstash_in))
            outs = {
                "act": list(t.act_out),
                "grad": list(t.grad_out),
                "stash": list(t.stash_out),
                "wstash": list(t.wstash_out),
                "wgrad": [self.parts[i].body for i in t.wgrad_out],
                "mb": [self.parts[i].body for i in t.mb_out],
            }
            in_ids = [v for g in groups for v in g]
            out_ids = [v for k in _OUT_GROUPS for v in outs[k]]
            fn = jax.jit(_make_fn(traced, list(t.ops), in_ids, out_ids))
            self.tasks[(t.kind, t.stage)] = TaskExe(
                t.kind, t.stage, fn, groups, {k: len(v) for k, v in outs.items()},
                (list(t.wgrad_out), list(t.mb_out)))
        self.op_stage = list(self.partition.op_stage)
        self._build_segments()
        self.last_stats: dict[str, Any] = {}

    # -- code outside the loop ------------------------------------------------
    def _build_segments(self):
        tr = self.traced
        ops = tr.ops
        pre = [i for i, op in enumerate(ops) if op.region == REGION_PRE]
        post = [i for i, op in enumerate(ops) if op.region == REGION_POST]
        self.pre_segments = self._segments(pre, set(tr.step_inputs))
        avail = set(tr.step_inputs)
        for s in self.pre_segments:
            avail.update(s.outputs)
        avail.update(o for _, o, _ in tr.loop_outputs)
        self.post_segments = self._segments(post, avail)

    def _segments(self, op_ids: list[int], avail: set[int]) -> list[Segment]:
        tr = self.traced
        ops = tr.ops
        lits = tr.literals
        # Values read after each op: by later ops, the loop, the step outputs.
        uses: dict[int, set] = {}
        for i, op in enumerate(ops):
            for v in op.inputs:
                uses.setdefault(v, set()).add(i)
        external = set(tr.step_outputs) | {o for _, o, _ in tr.loop_inputs}
        remaining = list(op_ids)
        avail = set(avail)
        segs = []
        while remaining:
            progress = False
            for stage in range(self.num_stages):
                seg, produced = [], set()
                for i in remaining:
                    op = ops[i]
                    if self.op_stage[i] != stage:
                        continue
                    if all(v in avail or v in produced or v in lits for v in op.inputs):
                        seg.append(i)
                        produced.update(op.outputs)
                if not seg:
                    continue
                progress = True
                seg_set = set(seg)
                remaining = [i for i in remaining if i not in seg_set]
                ins = sorted({v for i in seg for v in ops[i].inputs
                              if v not in produced and v not in lits})
                outs = sorted(v for v in produced
                              if v in external or any(u not in seg_set for u in uses.get(v, ())))
                fn = jax.jit(_make_fn(tr, seg, ins, outs))
                segs.append(Segment(stage, fn, ins, outs))
                avail.update(produced)
            if not progress:
                raise TraceError("internal: code outside the loop could not be ordered by stage")
        return segs

    # -- helpers ---------------------------------------------------------------
    def _put(self, x, rank, batch=False):
        if batch:
            sh = self.mesh.batch_sharded(rank, np.shape(x))
        else:
            sh = self.mesh.replicated(rank)
        return jax.device_put(x, sh)

    def _run_segments(self, segs, vals):
        for seg in segs:
            rank = self.stage_rank[seg.stage]
            args = [self._put(vals[v], rank) for v in seg.inputs]
            for v, x in zip(seg.outputs, seg.fn(*args)):
                vals[v] = x

    # -- one step --------------------------------------------------------------
    def run(self, flat_args: list[Any]) -> list[Any]:
        tr = self.traced
        vals: dict[int, Any] = dict(zip(tr.step_inputs, flat_args))
        self._run_segments(self.pre_segments, vals)
        M, S = self.M, self.num_stages
        # Loop inputs: invariants placed once per rank, microbatches split.
        loop_src = {b: (o, mb) for b, o, mb in tr.loop_inputs}
        inv_cache: dict[tuple[int, int], Any] = {}
        split_cache: dict[int, Any] = {}

        def invariant(v, rank):
            key = (v, rank)
            if key not in inv_cache:
                o, _ = loop_src[v]
                x = vals[o] if o in vals else tr.literals[o]
                inv_cache[key] = self._put(x, rank)
            return inv_cache[key]

        def microbatch(v, m, rank):
            if v not in split_cache:
                o, _ = loop_src[v]
                x = vals[o] if o in vals else tr.literals[o]
                split_cache[v] = _split(x, M)
            return self._put(split_cache[v][m], rank, batch=True)

        bufs: list[dict[int, list]] = [dict() for _ in range(self.num_ranks)]
        chan: dict[tuple[int, int, int], list] = {}
        acc: dict[int, Any] = {}        # part index -> running sum on its rank
        stack: dict[int, list] = {}     # part index -> per-microbatch values
        core = self.core_plan
        key_cache: dict[int, tuple] = {}

        def bkey(b):
            if b not in key_cache:
                k = core.buffer_key(b)
                key_cache[b] = (str(k.kind).split(".")[-1], k.stage, k.microbatch)
            return key_cache[b]

        def bid(kind, stage, m):
            return core.buffer_id(_core.BufferKey(getattr(_core.BufKind, kind), stage, m))

        bid_cache: dict[tuple, int] = {}

        def buf_id(kind, stage, m):
            k = (kind, stage, m)
            if k not in bid_cache:
                bid_cache[k] = bid(kind, stage, m)
            return bid_cache[k]

        live = [0] * self.num_ranks
        live_n = [0] * self.num_ranks
        peak = [0] * self.num_ranks
        peak_n = [0] * self.num_ranks

        def nbytes(arrs):
            return sum(int(a.size) * a.dtype.itemsize for a in arrs)

        def put_buf(rank, b, arrs):
            if b in bufs[rank]:
                raise ExecutionError(f"rank {rank}: buffer {core.describe_buffer(b)} written twice")
            bufs[rank][b] = arrs
            live[rank] += nbytes(arrs)
            live_n[rank] += 1
            peak[rank] = max(peak[rank], live[rank])
            peak_n[rank] = max(peak_n[rank], live_n[rank])

        def drop_buf(rank, b):
            arrs = bufs[rank].pop(b)
            live[rank] -= nbytes(arrs)
            live_n[rank] -= 1

        def add_parts(idx, xs, m):
            summed = [(i, x) for i, x in zip(idx, xs) if self.parts[i].reduce != G.Reduce.Stack]
            for i, x in zip(idx, xs):
                if self.parts[i].reduce == G.Reduce.Stack:
                    stack.setdefault(i, [None] * M)[m] = x
            if not summed:
                return
            if summed[0][0] not in acc:
                for i, x in summed:
                    acc[i] = x
            else:
                new = _add_lists([acc[i] for i, _ in summed], [x for _, x in summed])
                for (i, _), x in zip(summed, new):
                    acc[i] = x

        def task_inputs(task, rank):
            kind, s, m = task
            if kind == "B" and ("B", s) not in self.tasks:
                kind = "I"  # split partition: B runs I then W (see run_task)
            exe = self.tasks[(kind, s)]
            inv, mbi, act, grad, stash, wstash = exe.in_groups
            need = []
            if act:
                need.append(("Act", s - 1))
            if grad:
                need.append(("Grad", s + 1))
            if stash:
                need.append(("Stash", s))
            if wstash:
                need.append(("WStash", s))
            ids = [buf_id(bk, bs, m) for bk, bs in need]
            if any(b not in bufs[rank] for b in ids):
                return None  # not ready: look again after other ranks advanced
            args = [invariant(v, rank) for v in inv]
            args += [microbatch(v, m, rank) for v in mbi]
            for b in ids:
                args += bufs[rank][b]
            return args

        def run_task(task, rank, args):
            kind, s, m = task
            if kind == "B" and ("B", s) not in self.tasks:
                # The schedule mixes B with I/W: run I, feed its WStash straight to W.
                ie, we = self.tasks[("I", s)], self.tasks[("W", s)]
                outs = ie.fn(*args)
                k = ie.n_out
                grad = outs[k["act"]:k["act"] + k["grad"]]
                off = k["act"] + k["grad"] + k["stash"]
                wst = outs[off:off + k["wstash"]]
                inv, mbi = we.in_groups[0], we.in_groups[1]
                wargs = [invariant(v, rank) for v in inv] + [microbatch(v, m, rank) for v in mbi]
                wouts = we.fn(*wargs, *wst)
                if s > 0:
                    put_buf(rank, buf_id("Grad", s, m), list(grad))
                put_buf(rank, buf_id("WGrad", s, m), list(wouts[:we.n_out["wgrad"]]))
                return
            exe = self.tasks[(kind, s)]
            outs = exe.fn(*args)
            pos = 0
            n = exe.n_out

            def take(k):
                nonlocal pos
                r = outs[pos:pos + n[k]]
                pos += n[k]
                return r

            act, grad, stash, wstash, wgrad, mbo = (take(k) for k in _OUT_GROUPS)
            if kind == "F":
                if s < S - 1:
                    put_buf(rank, buf_id("Act", s, m), act)
                put_buf(rank, buf_id("Stash", s, m), stash)
            elif kind in ("B", "I"):
                if s > 0:
                    put_buf(rank, buf_id("Grad", s, m), grad)
                if kind == "B":
                    put_buf(rank, buf_id("WGrad", s, m), wgrad)
                else:
                    put_buf(rank, buf_id("WStash", s, m), wstash)
            else:  # W
                put_buf(rank, buf_id("WGrad", s, m), wgrad)
            add_parts(exe.body[1], mbo, m)

        def tasks_of(action):
            ts = [action.first]
            if action.is_fused:
                ts.append(action.second)
            return [(str(t.kind).split(".")[-1], t.stage, t.microbatch) for t in ts]

        pc = [0] * self.num_ranks
        actions = self.rank_actions
        n_instr = sum(len(p) for p in self.programs)
        done = 0
        while done < n_instr:
            progress = False
            for r in range(self.num_ranks):
                prog = self.programs[r]
                while pc[r] < len(prog):
                    op, a, b, peer = prog[pc[r]]
                    if op == "RUN":
                        ready = []
                        for task in tasks_of(actions[r][a]):
                            args = task_inputs(task, r)
                            if args is None:
                                ready = None
                                break
                            ready.append((task, args))
                        if ready is None:
                            break
                        for task, args in ready:
                            run_task(task, r, args)
                    elif op == "SEND":
                        chan[(r, peer, b)] = bufs[r][b]
                    elif op == "RECV":
                        src = chan.pop((peer, r, b), None)
                        if src is None:
                            break
                        put_buf(r, b, [jax.device_put(x, self.mesh.like(r, x)) for x in src])
                    elif op == "FREE":
                        drop_buf(r, b)
                    elif op == "ACCUMULATE":
                        kind, s, m = bkey(b)
                        exe = self.tasks[("W" if self.partition.split_backward else "B", s)]
                        add_parts(exe.body[0], bufs[r][b], m)
                    else:
                        raise ExecutionError(f"rank {r}: unknown instruction {op}")
                    pc[r] += 1
                    done += 1
                    progress = True
            if not progress:
                blocked = [core.describe(r, pc[r]) for r in range(self.num_ranks)
                           if pc[r] < len(self.programs[r])]
                raise ExecutionError(
                    "pipeline cannot make progress; blocked: " + "; ".join(blocked)
                )
        for r in range(self.num_ranks):
            if bufs[r]:
                left = ", ".join(core.describe_buffer(b) for b in bufs[r])
                raise ExecutionError(f"rank {r}: buffers left after the step: {left}")
        self.last_stats = {"peak_bytes": peak, "peak_buffers": peak_n}

        # Loop outputs: reduce, combine partial sums on the smallest stage.
        by_outer: dict[int, list[int]] = {}
        for i, part in enumerate(self.parts):
            by_outer.setdefault(part.outer, []).append(i)
        # Scale means (one jitted call per stage), then sum partials per outer value.
        per_stage: dict[int, list[int]] = {}
        for i, part in enumerate(self.parts):
            if part.reduce == G.Reduce.Mean:
                per_stage.setdefault(part.stage, []).append(i)
        final: dict[int, Any] = {}
        for s_, idx in per_stage.items():
            for i, x in zip(idx, _scale_list([acc[i] for i in idx], float(M))):
                final[i] = x
        for i, part in enumerate(self.parts):
            if part.reduce == G.Reduce.Stack:
                final[i] = _stack(stack[i])
            elif part.reduce == G.Reduce.Sum:
                final[i] = acc[i]
        for outer, idx in by_outer.items():
            first = min(idx, key=lambda i: self.parts[i].stage)
            rank = self.stage_rank[self.parts[first].stage]
            total = None
            for i in idx:
                x = final[i]
                if len(idx) > 1:
                    x = jax.device_put(x, self.mesh.replicated(rank))
                total = x if total is None else total + x
            vals[outer] = total
        self._run_segments(self.post_segments, vals)
        return [vals[v] if v in vals else tr.literals[v] for v in tr.step_outputs]

    # -- planning data -----------------------------------------------------------
    def stage_costs(self) -> list[dict]:
        p = self.traced.program
        out = []
        for s in range(self.num_stages):
            ts = {t.kind: t for t in self.partition.tasks if t.stage == s}
            f = ts["F"]
            b = ts.get("B")
            i = ts.get("I")
            w = ts.get("W")
            bsum = (b.cost if b else i.cost + w.cost)
            wg = b if b else w
            out.append(dict(
                f=f.cost, b=bsum, i=(i.cost if i else bsum / 2), w=(w.cost if w else bsum / 2),
                act_bytes=sum(p.value_bytes(v) for v in f.act_out),
                stash_bytes=sum(p.value_bytes(v) for v in f.stash_out),
                grad_bytes=sum(p.value_bytes(v) for v in (b or i).grad_out),
                wstash_bytes=sum(p.value_bytes(v) for v in (i.wstash_out if i else [])),
                wgrad_bytes=sum(p.value_bytes(self.parts[j].body) for j in wg.wgrad_out),
            ))
        return out
