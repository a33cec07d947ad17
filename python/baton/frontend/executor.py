"""Per-task executables and the in-process executor of a Plan.

``CompiledStep`` holds, for one traced step (one set of shapes): the C++
partition, the plan, one jitted callable per task (task kind x stage; reused for
every microbatch), jitted segments for the code before and after the loop, and
the cost model the simulator uses. ``CompiledStep.run`` executes the plan's
per-rank instruction streams on the C++ executor (``baton._core.runtime``),
with the task jits as its ``Tasks`` callbacks:

* run          calls the action's jitted task(s) on the rank's devices;
* received     ``jax.device_put``s a received value to the consuming rank's sharding;
* accumulate   adds a WGrad into the stage's accumulator.

Single process (``group`` None): one executor per rank over an in-process
transport, each in its own thread; a task that raises stops every rank and the
call raises the failing rank's ``ExecutionError`` (never hangs: every wait is
bounded). One process per rank (``group``: a ``distributed.ProcessGroup``): this
process's executor over Gloo, plus point-to-point transfers of the values that
cross ranks outside the loop (see ``_run_group``). The executors' measured peak
live bytes per rank are kept in ``last_stats``.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _core
from .. import _jax_compat as jc
from ..errors import ConfigError, ExecutionError, TraceError
from .mesh import PipelineMesh
from .trace import Traced

G = _core.graph
REGION_PRE, REGION_POST = "pre", "post"
_OUT_GROUPS = ("act", "grad", "stash", "wstash", "wgrad", "mb")
_SMALL_COPY = 4096  # elements: post-loop values small enough to compute on every stage


def _placed(x, sh) -> bool:
    """``x`` is a jax.Array committed to ``sh`` already (device_put would be a no-op). An
    uncommitted array (``jnp.asarray`` of the first call's parameters) is moved, i.e.
    committed, even on the right device: jit caches key on committedness, so passing it
    as is would compile every program again on the second call, whose inputs (the first
    call's outputs) are committed."""
    return isinstance(x, jax.Array) and getattr(x, "committed", True) and (
        x.sharding is sh or x.sharding.is_equivalent_to(sh, x.ndim))


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


def _with_acc(fn, pos: list[int]):
    """``fn`` with the running sums fused in: ``g(acc, *args)`` returns ``fn(*args)`` with
    output ``pos[k]`` replaced by ``acc[k] + output``: XLA adds inside the task's program
    instead of a separate pass over parameter-sized buffers per microbatch. (Donating ``acc``
    was measured no faster here, and slower in some steps: see docs/ARCHITECTURE.md.)"""

    def g(acc, *args):
        outs = list(fn(*args))
        for k, j in enumerate(pos):
            outs[j] = acc[k] + outs[j]
        return outs

    return g


def _with_acc_mean(g, pos: list[int], mean: list[bool]):
    """``g`` (see _with_acc) for the last microbatch: the sums of mean-reduced parts also
    divided by ``count`` (a traced scalar, as _scale_list divides), so no separate pass over
    the gradients follows the loop."""

    def h(count, acc, *args):
        outs = g(acc, *args)
        for k, j in enumerate(pos):
            if mean[k]:
                outs[j] = outs[j] / jnp.asarray(count, outs[j].dtype)
        return outs

    return h


class _Sized(list):
    """A buffer's value (list of arrays) with its byte size, which the runtime reads for its
    live-bytes accounting instead of asking every array (jax's ``nbytes`` is a Python
    property: ~900 reads per GPT step). A pytree like a list (so ``jax.block_until_ready``
    and tree functions see its arrays, not one opaque leaf)."""

    __slots__ = ("nbytes",)


def _sized_unflatten(nbytes, xs):
    out = _Sized(xs)
    out.nbytes = nbytes
    return out


jax.tree_util.register_pytree_node(_Sized, lambda v: (list(v), v.nbytes), _sized_unflatten)


class _StepState:
    """What the task callbacks of one step share: step values, placed loop inputs,
    accumulators (part index -> running sum), stacks, and the first Python exception
    raised per rank (the cause of the ExecutionError)."""

    def __init__(self, vals):
        self.vals = vals
        self.inv_cache: dict = {}
        self.split_cache: dict = {}
        self.acc: dict = {}
        self.adds: dict = {}  # first summed part of a task -> microbatches summed so far
        self.scaled: set = set()  # mean parts already divided by the microbatch count
        self.stack: dict = {}
        self.errors: dict = {}


def _to_host(value):
    """A value (list of jax.Arrays) as host-transferable arrays: one-device arrays cross as
    DLPack views, arrays sharded over several devices are gathered with numpy."""
    from ..runtime import to_host

    out = []
    for x in value:
        sh = getattr(x, "sharding", None)
        if sh is not None and len(sh.device_set) > 1:
            x = np.asarray(x)
        out.append(x)
    return to_host(out)


def _on_rank_threads(num_ranks: int, fn) -> list[BaseException | None]:
    """Runs ``fn(r)`` for every rank on its own thread ("baton-rank-r") and returns each
    rank's exception (None where it returned)."""
    errors: list[BaseException | None] = [None] * num_ranks

    def go(r):
        try:
            fn(r)
        except BaseException as e:  # noqa: BLE001  (the caller re-raises)
            errors[r] = e

    threads = [threading.Thread(target=go, args=(r,), name=f"baton-rank-{r}", daemon=True)
               for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def _raise_first(errors, st):
    """Raises the error of the rank where the failure started (its Python exception as the
    cause); the other ranks' errors only say that rank failed."""
    errs = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not errs:
        return
    origin = None
    for _, e in errs:
        fr = getattr(e, "failed_rank", -1)
        if isinstance(fr, int) and fr >= 0:
            origin = fr
            break
    chosen = next((e for r, e in errs if r == origin), errs[0][1])
    cause = st.errors.get(origin if origin is not None else errs[0][0]) if st else None
    if cause is not None and cause is not chosen:
        raise chosen from cause
    raise chosen


@dataclasses.dataclass
class TaskExe:
    kind: str
    stage: int
    fn: Any
    in_groups: tuple  # (invariant, microbatch, act, grad, stash, wstash) value ids
    n_out: dict  # group name -> count
    body: Any
    # Tasks that output weight gradients: the positions (in the outputs) of the summed ones,
    # their part indices, and the task with the running sums fused in (see _with_acc):
    # ``fn_acc`` is its jit, ``acc_body`` the plain function.
    acc_pos: list = dataclasses.field(default_factory=list)
    acc_parts: list = dataclasses.field(default_factory=list)
    fn_acc: Any = None
    acc_body: Any = None
    # The last microbatch's variant (see _with_acc_mean); None when no summed part is a mean.
    fn_acc_mean: Any = None
    acc_mean: list = dataclasses.field(default_factory=list)
    plain: Any = None  # the task as a plain function (traced into programs, program.py)

    def split(self, outs) -> dict[str, list]:
        """One call's outputs by group (``_OUT_GROUPS``: act, grad, stash, wstash, wgrad, mb)."""
        got, pos = {}, 0
        for k in _OUT_GROUPS:
            got[k] = list(outs[pos:pos + self.n_out[k]])
            pos += self.n_out[k]
        return got


def buffer_reads(exe: TaskExe, s: int, m: int) -> list[tuple[str, int, int]]:
    """The buffers (kind, stage, microbatch) task ``exe`` of stage ``s`` reads for microbatch
    ``m``, in argument order after its invariant and microbatch inputs."""
    _, _, act, grad, stash, wstash = exe.in_groups
    return [(k, bs, m) for present, k, bs in ((act, "Act", s - 1), (grad, "Grad", s + 1),
                                              (stash, "Stash", s), (wstash, "WStash", s))
            if present]


@dataclasses.dataclass
class Segment:
    stage: int
    fn: Any
    inputs: list[int]
    outputs: list[int]


class CompiledStep:
    def __init__(self, traced: Traced, plan: Any, mesh: PipelineMesh, split_backward: bool,
                 remat: bool = True, single_program: bool = True):
        self.traced = traced
        self.mesh = mesh
        self.plan = plan  # baton.Plan (python wrapper)
        core = plan.core if hasattr(plan, "core") else plan
        self.core_plan = core
        self.partition = G.partition(traced.program, split_backward, remat)
        sched = core.schedule
        self.num_stages = sched.num_stages
        self.num_ranks = sched.num_ranks
        self.M = sched.num_microbatches
        self.stage_rank = list(sched.stage_rank)
        self.rank_actions = [list(a) for a in sched.rank_actions]
        # A readable, immutable copy of the per-rank programs the executor runs.
        self.programs = tuple(tuple((str(i.opcode), i.action, i.buffer, i.peer) for i in prog)
                              for prog in core.programs)
        self.parts = list(self.partition.parts)
        self.tasks: dict[tuple[str, int], TaskExe] = {}
        by_kind = {(t.kind, t.stage): t for t in self.partition.tasks}
        for t in self.partition.tasks:
            groups = (list(t.invariant_in), list(t.microbatch_in), list(t.act_in),
                      list(t.grad_in), list(t.stash_in), list(t.wstash_in))
            outs = {"act": list(t.act_out), "grad": list(t.grad_out),
                    "stash": list(t.stash_out), "wstash": list(t.wstash_out)}
            self.tasks[(t.kind, t.stage)] = self._task_exe(
                t.kind, t.stage, list(t.ops), groups, outs, list(t.wgrad_out), list(t.mb_out))
        # F and B of one microbatch as one program (the fused actions F(s,m)+B(s,m) of
        # fuse_forward_backward): no stash leaves it.
        for s in range(self.num_stages):
            f, b = by_kind.get(("F", s)), by_kind.get(("B", s))
            if f is None or b is None:
                continue
            groups = (sorted(set(f.invariant_in) | set(b.invariant_in)),
                      sorted(set(f.microbatch_in) | set(b.microbatch_in)),
                      list(f.act_in), list(b.grad_in), [], [])
            outs = {"act": list(f.act_out), "grad": list(b.grad_out), "stash": [],
                    "wstash": []}
            self.tasks[("FB", s)] = self._task_exe(
                "FB", s, sorted(set(f.ops) | set(b.ops)), groups, outs, list(b.wgrad_out),
                list(f.mb_out))
        # What crosses ranks: Act(s, m) holds F(s)'s act outputs, Grad(s, m) B(s)'s (or I(s)'s)
        # input gradients; their avals are the layouts receivers expect (_recv_layout).
        self._buf_vals: dict[tuple[str, int], list[int]] = {}
        for t in self.partition.tasks:
            if t.kind == "F":
                self._buf_vals[("Act", t.stage)] = list(t.act_out)
            elif t.kind in ("B", "I"):
                self._buf_vals[("Grad", t.stage)] = list(t.grad_out)
        self.op_stage = list(self.partition.op_stage)
        self._build_segments()
        self.last_stats: dict[str, Any] = {}
        self._key_cache: dict[int, tuple] = {}
        self._bytes_cache: dict[tuple, int] = {}
        self._bid_cache: dict[tuple, int] = {}
        self._action_cache: dict[tuple, list] = {}
        self._loop_src = {b: (o, mb) for b, o, mb in traced.loop_inputs}
        self._by_outer: dict[int, list[int]] = {}
        for i, part in enumerate(self.parts):
            self._by_outer.setdefault(part.outer, []).append(i)
        # Loop inputs (outer values) each rank's tasks read; outputs every process receives
        # in multi-process mode (per-microbatch outputs: the loss, aux values).
        self._loop_needs: list[list[int]] = []
        for r in range(self.num_ranks):
            need = set()
            for (kind, s), exe in self.tasks.items():
                if self.stage_rank[s] == r:
                    need.update(self._loop_src[v][0] for v in exe.in_groups[0] + exe.in_groups[1])
            self._loop_needs.append(sorted(need))
        self._broadcast = {self.parts[i].outer for t in self.partition.tasks for i in t.mb_out}
        self._state: _StepState | None = None
        self._group_exec = None  # (ProcessGroup, Executor, record) in multi-process mode
        # Measurement (tracing.py, profile.py): ``record`` makes the executors record
        # per-instruction events (``last_events``: per rank, ``last_offsets``: clock offsets
        # to rank 0 in ns); ``block`` makes every task wait for its outputs, so a RUN spans
        # its compute; ``capture`` (a dict) keeps each task's first arguments.
        self.record = False
        self.block = False
        self.capture: dict | None = None
        self.last_events: list | None = None
        self.last_offsets: list | None = None
        # The compiled engine (program.py): one rank, the whole step as one XLA program; a
        # rank of several (in this process or one process per rank), its loop as one
        # program with FFI transfers (traced too: markers and transfer records switched on).
        # The interpreter (the C++ Executor) runs profiled steps, traced one-rank steps and
        # every step with single_program=False.
        self.single_program = bool(single_program)
        self._single = None
        self._rank_prog = None
        self._local_progs = None  # single process, several ranks: RankProgram per rank
        self._local_hub = None  # their in-process transports

    def _task_exe(self, kind, stage, ops, groups, outs, wgrad_parts, mb_parts) -> TaskExe:
        """One task's jit: ``ops`` (program order) from the value ids in ``groups`` to the
        outputs in ``_OUT_GROUPS`` order, with the running-sum variant when it has summed
        weight gradients (see _with_acc)."""
        outs = dict(outs, wgrad=[self.parts[i].body for i in wgrad_parts],
                    mb=[self.parts[i].body for i in mb_parts])
        in_ids = [v for g in groups for v in g]
        out_ids = [v for k in _OUT_GROUPS for v in outs[k]]
        body = _make_fn(self.traced, ops, in_ids, out_ids)
        exe = TaskExe(kind, stage, jax.jit(body), groups, {k: len(v) for k, v in outs.items()},
                      (wgrad_parts, mb_parts), plain=body)
        off = sum(len(outs[k]) for k in _OUT_GROUPS[:_OUT_GROUPS.index("wgrad")])
        summed = [(off + j, i) for j, i in enumerate(wgrad_parts)
                  if self.parts[i].reduce != G.Reduce.Stack]
        if summed:
            exe.acc_pos = [j for j, _ in summed]
            exe.acc_parts = [i for _, i in summed]
            exe.acc_body = _with_acc(body, exe.acc_pos)
            exe.fn_acc = jax.jit(exe.acc_body)
            exe.acc_mean = [self.parts[i].reduce == G.Reduce.Mean for i in exe.acc_parts]
            if any(exe.acc_mean):
                exe.fn_acc_mean = jax.jit(_with_acc_mean(exe.acc_body, exe.acc_pos,
                                                         exe.acc_mean))
        return exe

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
        self.post_segments = self._segments(post, avail, self._small_free_copies(post))

    def _small_free_copies(self, post: list[int]) -> dict[int, set[int]]:
        """Post-loop ops that read only step inputs, literals and each other and make small
        values (the optimizer's step count and bias corrections): op -> the other stages whose
        post-loop ops read them. Each of those stages computes its own copy, so its optimizer
        update does not wait for the stage the op was placed on (which finishes its loop last)."""
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
                  copies: dict[int, set[int]] | None = None) -> list[Segment]:
        """Per-stage jitted segments in dependency waves. ``copies``: op -> extra stages that
        compute their own copy of it (see _small_free_copies); a value such an op makes is
        read on a stage only from that stage's own copy."""
        tr = self.traced
        ops = tr.ops
        lits = tr.literals
        copies = copies or {}
        copied_vals = {v for i in copies for v in ops[i].outputs}
        local: dict[int, set[int]] = {s: set() for s in range(self.num_stages)}
        # Values read after each op: by later ops, the loop, the step outputs.
        uses: dict[int, set] = {}
        for i, op in enumerate(ops):
            for v in op.inputs:
                uses.setdefault(v, set()).add(i)
        external = set(tr.step_outputs) | {o for _, o, _ in tr.loop_inputs}
        # (op, stage) items: every op on its own stage, plus the copies
        remaining = sorted([(i, self.op_stage[i]) for i in op_ids]
                           + [(i, st) for i in op_ids for st in sorted(copies.get(i, ()))])
        avail = set(avail)
        segs = []

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
                    if st != stage:
                        continue
                    if all(ready(v, stage, produced) for v in ops[i].inputs):
                        seg.append(i)
                        produced.update(ops[i].outputs)
                if not seg:
                    continue
                progress = True
                seg_set = set(seg)
                remaining = [(i, st) for i, st in remaining if not (st == stage and i in seg_set)]
                ins = sorted({v for i in seg for v in ops[i].inputs
                              if v not in produced and v not in lits})
                outs = sorted(v for v in produced
                              if v in external or any(u not in seg_set for u in uses.get(v, ())))
                fn = jax.jit(_make_fn(tr, seg, ins, outs))
                segs.append(Segment(stage, fn, ins, outs))
                avail.update(produced)
                local[stage].update(produced)
            if not progress:
                raise TraceError("internal: code outside the loop could not be ordered by stage")
        return segs

    # -- helpers ---------------------------------------------------------------
    def _put(self, x, rank, batch=False):
        if batch:
            sh = self.mesh.batch_sharded(rank, np.shape(x))
        else:
            sh = self.mesh.replicated(rank)
        return x if _placed(x, sh) else jax.device_put(x, sh)

    def _put_all(self, xs, rank):
        """``_put`` of many values (replicated on ``rank``): arrays already there are kept
        (``device_put`` costs ~20 us per array even then: ~10 ms per step for the optimizer's
        inputs and the parameters), the rest moved in one batched ``device_put``."""
        sh = self.mesh.replicated(rank)
        out = list(xs)
        move = [i for i, x in enumerate(out) if not _placed(x, sh)]
        if move:
            for i, y in zip(move, jax.device_put([out[i] for i in move], [sh] * len(move))):
                out[i] = y
        return out

    def _run_segments(self, segs, vals):
        for seg in segs:
            rank = self.stage_rank[seg.stage]
            args = self._put_all([vals[v] for v in seg.inputs], rank)
            for v, x in zip(seg.outputs, seg.fn(*args)):
                vals[v] = x

    # -- one step --------------------------------------------------------------
    def run(self, flat_args: list[Any], group: Any = None, timeout: float = 120.0) -> list[Any]:
        """One step. ``group`` None: every rank in this process; a
        :class:`~baton.frontend.distributed.ProcessGroup`: this process's rank only, over its
        transport (see ``_run_group``). The compiled engine (program.py: one XLA program per
        rank, transfers as FFI calls) runs it unless the interpreter was chosen
        (``single_program=False``), the step is profiled (the capture of each task's
        arguments), or it is a traced one-rank step. A traced multi-rank step runs the same
        compiled programs with their markers and transfer records switched on."""
        interp = (not self.single_program or self.capture is not None
                  or (self.record and self.num_ranks == 1))
        if not interp:
            self.last_events = None
        if group is None:
            if interp:
                return self._run_local(flat_args, timeout)
            if self.num_ranks == 1:
                return self._run_single(flat_args, timeout)
            return self._run_programs(flat_args, timeout)
        return self._run_group(flat_args, group, timeout)

    def engine_refusal(self, rank: int, transport_kind: str = "local") -> str | None:
        """Why the compiled engine cannot run ``rank`` of this step, or None."""
        if len(self.mesh.rank_devices[rank]) > 1 and self.num_ranks > 1:
            return (f"rank {rank} has {len(self.mesh.rank_devices[rank])} devices: the "
                    f"compiled engine moves a rank's values whole, and a value sharded over "
                    f"several devices would cross through one of them; use one device per "
                    f"rank, or the interpreter (baton.jit(..., single_program=False))")
        platforms = {d.platform for d in self.mesh.rank_devices[rank]}
        if self.num_ranks > 1 and platforms != {"cpu"}:
            return (f"rank {rank} runs on {', '.join(sorted(platforms))}: the compiled "
                    f"engine's transfer handlers are CPU-only so far (the NCCL handlers are "
                    f"not written); use the interpreter (baton.jit(..., single_program=False))")
        if transport_kind not in ("local", "gloo"):
            return (f"the compiled engine's transfers run on CPU transports (local, gloo), "
                    f"not {transport_kind!r}; use the interpreter "
                    f"(baton.jit(..., single_program=False))")
        return None

    def _check_engine(self, rank, transport_kind="local"):
        why = self.engine_refusal(rank, transport_kind)
        if why is not None:
            raise ConfigError(f"baton.jit: {why}")

    # per-buffer helpers (cached: called for every task)
    def _bkey(self, b):
        k = self._key_cache.get(b)
        if k is None:
            bk = self.core_plan.buffer_key(b)
            k = self._key_cache[b] = (str(bk.kind).split(".")[-1], bk.stage, bk.microbatch)
        return k

    def _buf_id(self, kind, stage, m):
        key = (kind, stage, m)
        b = self._bid_cache.get(key)
        if b is None:
            b = self._bid_cache[key] = self.core_plan.buffer_id(
                _core.BufferKey(getattr(_core.BufKind, kind), stage, m))
        return b

    def _tasks_of(self, rank, a):
        key = (rank, a)
        ts = self._action_cache.get(key)
        if ts is None:
            act = self.rank_actions[rank][a]
            raw = [act.first] + ([act.second] if act.is_fused else [])
            ts = [(str(t.kind).split(".")[-1], t.stage, t.microbatch) for t in raw]
            if (len(ts) == 2 and (ts[0][0], ts[1][0]) == ("F", "B") and ts[0][1:] == ts[1][1:]
                    and ("FB", ts[0][1]) in self.tasks):
                ts = [("FB", ts[0][1], ts[0][2])]
            self._action_cache[key] = ts
        return ts

    # -- the Tasks callbacks (called by the C++ executor, one thread per rank) --
    def _invariant(self, v, rank):
        st = self._state
        key = (v, rank)
        if key not in st.inv_cache:
            o, _ = self._loop_src[v]
            x = st.vals[o] if o in st.vals else self.traced.literals[o]
            st.inv_cache[key] = self._put(x, rank)
        return st.inv_cache[key]

    def _microbatch(self, v, m, rank):
        st = self._state
        if v not in st.split_cache:
            o, _ = self._loop_src[v]
            x = st.vals[o] if o in st.vals else self.traced.literals[o]
            st.split_cache[v] = _split(x, self.M)
        return self._put(st.split_cache[v][m], rank, batch=True)

    def _add_parts(self, idx, xs, m):
        st = self._state
        summed = [(i, x) for i, x in zip(idx, xs)
                  if self.parts[i].reduce != G.Reduce.Stack and x is not None]
        for i, x in zip(idx, xs):
            if self.parts[i].reduce == G.Reduce.Stack:
                st.stack.setdefault(i, [None] * self.M)[m] = x
        if not summed:
            return
        if summed[0][0] not in st.acc:
            for i, x in summed:
                st.acc[i] = x
        else:
            new = _add_lists([st.acc[i] for i, _ in summed], [x for _, x in summed])
            for (i, _), x in zip(summed, new):
                st.acc[i] = x

    def _task_args(self, exe, s, m, rank, env):
        args = [self._invariant(v, rank) for v in exe.in_groups[0]]
        args += [self._microbatch(v, m, rank) for v in exe.in_groups[1]]
        for kind, bs, bm in buffer_reads(exe, s, m):
            args += env[self._buf_id(kind, bs, bm)]
        return args

    def _run_task(self, kind, s, m, rank, env):
        S = self.num_stages
        if kind == "FB":  # F(s,m)+B(s,m) fused: one program, the stash stays inside
            exe = self.tasks[("FB", s)]
            got = exe.split(self._call(exe, self._task_args(exe, s, m, rank, env)))
            if s < S - 1:
                env[self._buf_id("Act", s, m)] = got["act"]
            env[self._buf_id("Stash", s, m)] = []
            if s > 0:
                env[self._buf_id("Grad", s, m)] = got["grad"]
            env[self._buf_id("WGrad", s, m)] = got["wgrad"]
            self._add_parts(exe.body[1], got["mb"], m)
            return
        if kind == "B" and ("B", s) not in self.tasks:
            # The schedule mixes B with I/W: run I, feed its WStash straight to W.
            ie, we = self.tasks[("I", s)], self.tasks[("W", s)]
            got = ie.split(self._call(ie, self._task_args(ie, s, m, rank, env)))
            wargs = [self._invariant(v, rank) for v in we.in_groups[0]]
            wargs += [self._microbatch(v, m, rank) for v in we.in_groups[1]]
            wgrad = we.split(self._call(we, wargs + got["wstash"]))["wgrad"]
            if s > 0:
                env[self._buf_id("Grad", s, m)] = got["grad"]
            env[self._buf_id("WGrad", s, m)] = wgrad
            return
        exe = self.tasks[(kind, s)]
        got = exe.split(self._call(exe, self._task_args(exe, s, m, rank, env)))
        act, grad, stash, wstash, wgrad, mbo = (got[k] for k in _OUT_GROUPS)
        if kind == "F":
            if s < S - 1:
                env[self._buf_id("Act", s, m)] = act
            env[self._buf_id("Stash", s, m)] = stash
        elif kind in ("B", "I"):
            if s > 0:
                env[self._buf_id("Grad", s, m)] = grad
            if kind == "B":
                env[self._buf_id("WGrad", s, m)] = wgrad
            else:
                env[self._buf_id("WStash", s, m)] = wstash
        else:  # W
            env[self._buf_id("WGrad", s, m)] = wgrad
        self._add_parts(exe.body[1], mbo, m)

    def _call(self, exe, args):
        """Runs a task. A task with weight gradients adds them to the running sums itself
        (inside its program, see _with_acc) and returns None in their places; the ACCUMULATE of its
        WGrad buffer then has nothing left to add."""
        st = self._state
        key = (exe.kind, exe.stage)
        acc = None
        if exe.acc_parts and exe.acc_parts[0] in st.acc:
            acc = [st.acc.pop(i) for i in exe.acc_parts]
        if self.capture is not None:
            had = self.capture.get(key)
            if had is None or (had[0] is None and acc is not None):
                self.capture[key] = (acc, args)
        if not exe.acc_parts:
            return exe.fn(*args)
        first = exe.acc_parts[0]
        added = st.adds.get(first, 0)
        st.adds[first] = added + 1
        if acc is None:
            outs = exe.fn(*args)
        elif added + 1 == self.M and exe.fn_acc_mean is not None:  # the last microbatch
            outs = exe.fn_acc_mean(float(self.M), acc, *args)
            st.scaled.update(i for i, m in zip(exe.acc_parts, exe.acc_mean) if m)
        else:
            outs = exe.fn_acc(acc, *args)
        outs = list(outs)
        if self.block:  # the RUN spans the task's compute, sums included
            jax.block_until_ready(outs)
        for j, i in zip(exe.acc_pos, exe.acc_parts):
            st.acc[i] = outs[j]
            outs[j] = None
        return outs

    def _sized(self, b, value):
        """``value`` (buffer ``b``'s arrays) as a _Sized list. The size is measured on the first
        value of each buffer kind and stage and reused: a compiled step has one set of shapes,
        so every microbatch's Act(s, .) (Grad, Stash, ...) has the same bytes."""
        kind, s, _ = self._bkey(b)
        n = self._bytes_cache.get((kind, s))
        if n is None:
            n = self._bytes_cache[(kind, s)] = sum(int(x.nbytes) for x in value
                                                   if x is not None)
        out = _Sized(value)
        out.nbytes = n
        return out

    def _cb_run(self, rank, action, in_ids, ins, out_ids):
        try:
            env = dict(zip(in_ids, ins))
            for kind, s, m in self._tasks_of(rank, action):
                self._run_task(kind, s, m, rank, env)
            outs = [env[b] for b in out_ids]
            if self.block:
                jax.block_until_ready(outs)
            return [self._sized(b, v) for b, v in zip(out_ids, outs)]
        except BaseException as e:
            self._state.errors.setdefault(rank, e)
            raise

    def _cb_accumulate(self, rank, b, value):
        try:
            _, s, m = self._bkey(b)
            exe = self.tasks[("W" if self.partition.split_backward else "B", s)]
            self._add_parts(exe.body[0], value, m)
        except BaseException as e:
            self._state.errors.setdefault(rank, e)
            raise

    def _cb_received(self, rank, b, value):
        return self._sized(b, [jax.device_put(x, self.mesh.like(rank, x)) for x in value])

    def _recv_layout(self, rank, b):
        """The avals of buffer ``b`` as its receiver gets them (the runtime asks once per
        buffer): with them the byte transports send no header (NCCL needs them)."""
        kind, s, _ = self._bkey(b)
        return [self.traced.avals[v] for v in self._buf_vals.get((kind, s), [])]

    def _make_tasks(self):
        from .. import runtime as rt

        return rt.Tasks(run=self._cb_run, accumulate=self._cb_accumulate,
                        received=self._cb_received, to_host=_to_host,
                        from_host=rt.from_host, recv_layout=self._recv_layout)

    def _run_single(self, flat_args, timeout):
        if self._single is None:
            from .program import SingleProgram

            self._single = SingleProgram(self)
        outs = self._single(flat_args)
        # no interpreter ran: no measured live-buffer peaks (traced steps have them)
        self.last_stats = {"single_program": self._single.describe()}
        return outs

    # -- single process, several ranks: one compiled program per rank -------------
    def _local_programs(self, vals, timeout):
        """This step's rank programs over an in-process hub (built on the first call, and
        again after a failed step: a failed hub stays failed)."""
        from .. import _core
        from .program import RankProgram

        R = self.num_ranks
        if self._local_progs is None:
            for r in range(R):
                self._check_engine(r)
            comms = [_core.runtime.RankComm(r, float(timeout)) for r in range(R)]
            progs = [RankProgram(self, r, comms[r], timeout) for r in range(R)]
            for p in progs:  # all compiled before any runs (a rank never waits on a compile)
                p.compile(vals)
            self._local_progs = progs
            self._local_hub = None
        progs = self._local_progs
        if self._local_hub is None:
            hub = _core.runtime.LocalHub(R)
            self._local_hub = [hub.transport(r) for r in range(R)]
            for p, t in zip(progs, self._local_hub):
                p.comm.attach(t)
        for p in progs:
            if p.timeout != float(timeout):
                p.timeout = float(timeout)
                p.comm.set_timeout(p.timeout)
        return progs

    def _run_programs(self, flat_args, timeout):
        """Every rank's loop as its own XLA program on its devices, launched from one thread
        per rank so the ranks overlap; transfers go through the in-process transport from
        inside the programs (FFI calls), with no Python between tasks."""
        tr = self.traced
        vals: dict[Any, Any] = dict(zip(tr.step_inputs, flat_args))
        self._run_segments(self.pre_segments, vals)
        progs = self._local_programs(vals, timeout)
        R = self.num_ranks
        finals: list[dict | None] = [None] * R
        for p in progs:
            p.comm.record(self.record)

        def go(r):
            finals[r] = progs[r](vals)

        errors = _on_rank_threads(R, go)
        if any(e is not None for e in errors):
            for p in progs:
                p.comm.detach()
            for t in self._local_hub or ():
                t.close()
            self._local_hub = None
            origins = [getattr(e, "failed_rank", r) for r, e in enumerate(errors) if e]
            first = next((e for r, e in enumerate(errors) if e is not None and r in origins),
                         next(e for e in errors if e is not None))
            raise first
        if self.record:
            self.last_events = [p.events() for p in progs]
            self.last_offsets = [0] * R
        final: dict[int, Any] = {}
        for f in finals:
            final.update(f)
        for outer, idx in self._by_outer.items():
            vals[outer] = self._combine(idx, {i: final[i] for i in idx})
        self._run_segments(self.post_segments, vals)
        self.last_stats = {"rank_program": [p.describe() for p in progs]}
        return [vals[v] if v in vals else tr.literals[v] for v in tr.step_outputs]

    # -- single process: one executor thread per rank over the in-process hub ---
    def _run_local(self, flat_args, timeout):
        from .. import runtime as rt

        tr = self.traced
        vals: dict[Any, Any] = dict(zip(tr.step_inputs, flat_args))
        self._run_segments(self.pre_segments, vals)
        st = self._state = _StepState(vals)
        R = self.num_ranks
        hub = rt.LocalHub(R)
        transports = [hub.transport(r) for r in range(R)]
        tasks = self._make_tasks()
        exes = [rt.Executor(self.core_plan, r, transports[r], tasks, timeout=timeout,
                            record_events=self.record)
                for r in range(R)]
        errors = _on_rank_threads(R, lambda r: exes[r].run())
        stats = [e.stats() for e in exes]
        self.last_events = [e.events() for e in exes] if self.record else None
        self.last_offsets = [0] * R
        del exes
        for t in transports:
            t.close()
        self._state = None  # (its exceptions would tie this step to their tracebacks)
        _raise_first(errors, st)
        self.last_stats = {"peak_bytes": [s["peak_live_bytes"] for s in stats],
                           "peak_buffers": [s["peak_live_buffers"] for s in stats]}
        final = self._reduce_parts(st, range(len(self.parts)))
        for outer, idx in self._by_outer.items():
            vals[outer] = self._combine(idx, final)
        self._run_segments(self.post_segments, vals)
        return [vals[v] if v in vals else tr.literals[v] for v in tr.step_outputs]

    # -- after the loop ------------------------------------------------------------
    def _reduce_parts(self, st, idx):
        """Final value of each loop-output part in ``idx``: mean, sum or stack."""
        per_stage: dict[int, list[int]] = {}
        final: dict[int, Any] = {}
        for i in idx:
            part = self.parts[i]
            if part.reduce == G.Reduce.Mean and i in st.scaled:  # by its last task
                final[i] = st.acc[i]
            elif part.reduce == G.Reduce.Mean:
                per_stage.setdefault(part.stage, []).append(i)
            elif part.reduce == G.Reduce.Stack:
                final[i] = _stack(st.stack[i])
            else:
                final[i] = st.acc[i]
        for ids in per_stage.values():  # one jitted call per stage
            for i, x in zip(ids, _scale_list([st.acc[i] for i in ids], float(self.M))):
                final[i] = x
        return final

    def _home(self, idx):
        """The rank that holds a loop output made of parts ``idx`` (its smallest stage)."""
        return self.stage_rank[self.parts[min(idx, key=lambda i: self.parts[i].stage)].stage]

    def _combine(self, idx, final):
        rank = self._home(idx)
        total = None
        for i in idx:
            x = final[i]
            if len(idx) > 1:
                x = jax.device_put(x, self.mesh.replicated(rank))
            total = x if total is None else total + x
        return total

    # -- one process per rank -------------------------------------------------------
    def _run_group(self, flat_args, group, timeout):
        try:
            return self._run_group_body(flat_args, group, timeout)
        except ExecutionError:
            raise
        except BaseException as e:
            # e.g. code outside the loop raised: tell the other ranks instead of letting them
            # wait out the timeout.
            if not group.transport.closed:
                group.transport.abort(f"rank {group.rank}: {type(e).__name__}: {e}")
            raise

    def _run_group_body(self, flat_args, group, timeout):
        """This process runs rank ``group.rank``: the code outside the loop of its stages,
        its instruction stream over ``group.transport``, and the transfers of values that
        cross ranks outside the loop (inputs another rank holds, partial sums of a value
        shared by stages on several ranks, per-microbatch outputs sent to every process).
        Every process walks the same sequence of transfers, so they pair up."""
        from .. import runtime as rt
        from .distributed import Remote, Router

        tr = self.traced
        lits = tr.literals
        me, R = group.rank, self.num_ranks
        router = Router(group, timeout)
        vals: dict[Any, Any] = {}
        where = router.holders(tr.step_inputs, flat_args, vals)
        self._group_segments(self.pre_segments, vals, where, router, me)
        for r in range(R):
            router.need([o for o in self._loop_needs[r] if o not in lits], r, vals, where)
        st = self._state = _StepState(vals)
        if (self._group_exec is None or self._group_exec[0] is not group
                or self._group_exec[2] != self.record):
            self._group_exec = None
            ex = rt.Executor(self.core_plan, me, group.transport, self._make_tasks(),
                             timeout=timeout, record_events=self.record)
            try:
                ex.handshake(timeout)
            except BaseException:
                del ex
                raise
            self._group_exec = (group, ex, self.record)
            if self not in group.steps:
                group.steps.append(self)
        ex = self._group_exec[1]
        prog = self._rank_program(group, router, vals, timeout)
        if prog is not None:  # the loop as one XLA program (program.py)
            self._state = None
            prog.comm.record(self.record)
            final = prog(vals)
            self.last_stats = {"rank_program": prog.describe()}
            if self.record:
                from .tracing import gather_events

                self.last_events, self.last_offsets = gather_events(group, prog.events(),
                                                                    timeout)
        else:
            errors: list[BaseException | None] = [None] * R
            try:
                ex.run()
            except BaseException as e:  # noqa: BLE001
                errors[me] = e
            self._state = None
            _raise_first(errors, st)
            s = ex.stats()
            peaks = router.allgather(f"{s['peak_live_bytes']} {s['peak_live_buffers']}")
            self.last_stats = {"peak_bytes": [int(p.split()[0]) for p in peaks],
                               "peak_buffers": [int(p.split()[1]) for p in peaks]}
            if self.record:
                from .tracing import gather_events

                self.last_events, self.last_offsets = gather_events(group, ex.events(), timeout)
            mine = [i for i, p in enumerate(self.parts) if self.stage_rank[p.stage] == me]
            final = self._reduce_parts(st, mine)
        for i, p in enumerate(self.parts):
            where[("part", i)] = {self.stage_rank[p.stage]}
            if i in final:
                vals[("part", i)] = final[i]
        for outer, idx in self._by_outer.items():
            home = self._home(idx)
            if len(idx) > 1:
                router.need([("part", i) for i in idx], home, vals, where)
            if me == home:
                vals[outer] = self._combine(idx, {i: vals[("part", i)] for i in idx})
            where[outer] = {home}
        self._group_segments(self.post_segments, vals, where, router, me)
        seen = set()
        for v in tr.step_outputs:
            if v in self._broadcast and v not in seen:
                seen.add(v)
                for q in range(R):
                    router.need([v], q, vals, where)
        outs = []
        for v in tr.step_outputs:
            if v in lits:
                outs.append(lits[v])
            elif me in where[v]:
                outs.append(vals[v])
            else:
                aval = tr.avals[v]
                outs.append(Remote(tuple(aval.shape), np.dtype(aval.dtype), min(where[v])))
        router.finish()
        return outs

    def _rank_program(self, group, router, vals, timeout):
        """This rank's loop as one program (program.RankProgram) over the process's
        transport, or None when the interpreter runs it (chosen, or a traced or profiled
        step). A program that cannot be built or compiled raises; the ranks first exchange
        whether they could, so every rank raises instead of waiting on the others."""
        if not self.single_program or self.capture is not None:
            return None
        rp = self._rank_prog
        if rp is not None and rp.transport is group.transport:
            if rp.timeout != float(timeout):
                rp.timeout = float(timeout)
                rp.comm.set_timeout(rp.timeout)
            return rp
        from .. import _core
        from .program import RankProgram

        me = group.rank
        why = self.engine_refusal(me, group.transport.kind) or ""
        if not why:
            try:
                comm = _core.runtime.RankComm(me, float(timeout))
                comm.attach(group.transport)
                rp = RankProgram(self, me, comm, timeout)
                rp.transport = group.transport
                rp.compile(vals)
            except Exception as e:  # noqa: BLE001  (raised below, on every rank)
                why = f"building its program failed: {type(e).__name__}: {e}"
        whys = router.allgather(why.replace("\n", " "))
        bad = [(q, w) for q, w in enumerate(whys) if w]
        if bad:
            self._rank_prog = None
            raise ConfigError("baton.jit: the compiled engine cannot run this step: "
                              + "; ".join(f"rank {q}: {w}" for q, w in bad))
        self._rank_prog = rp
        return rp

    def _group_segments(self, segs, vals, where, router, me):
        lits = self.traced.literals
        for seg in segs:
            r = self.stage_rank[seg.stage]
            router.need([v for v in seg.inputs if v not in lits], r, vals, where)
            if r == me:
                self._run_segments([seg], vals)
            for v in seg.outputs:  # a value copied on several stages is held by each
                where.setdefault(v, set()).add(r)


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
                # summed weight gradients go straight into the running sums (see _call):
                # a WGrad buffer holds only stacked parts
                wgrad_bytes=sum(p.value_bytes(self.parts[j].body) for j in wg.wgrad_out
                                if self.parts[j].reduce == G.Reduce.Stack),
            ))
        return out
