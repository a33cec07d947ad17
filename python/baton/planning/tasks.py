"""What a compiled step's loop is made of, shared by every engine: the task functions and
the plan's facts about tasks and buffers (the code outside the loop: ``segments.py``).

A *task* (``TaskExe``) is one (kind, stage) of the C++ partition as a function of its
invariant inputs, its microbatch inputs and the buffers it reads, returning its outputs
by group (``OUT_GROUPS``); the same function is jitted per task (the interpreter) or
traced into a rank's program (``loop_program.py``). Which buffers a task reads and writes
comes from the C++ plan (``Plan.action_inputs`` / ``action_outputs``, see
``buffers.Buffers``); where receives are posted and waited on comes from the C++ rank
programs (``CompiledStep.rank_ir``, docs/RANK_IR.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from .. import _core
from .. import _jax_compat as jc
from ..tracing.trace import Traced

G = _core.graph
TaskKind = _core.TaskKind
BufKind = _core.BufKind  # a plan buffer's kind; buffers are keyed (BufKind, stage, microbatch)
SKIP_KINDS = (BufKind.Skip, BufKind.SkipGrad)  # a skip edge's buffers: (kind, edge, microbatch)
MB = "mb"  # the output group of a task's per-microbatch loop outputs (no plan buffer)
# A task function's output groups in order: the buffers it writes by kind (a skip edge's
# group, ``(BufKind.Skip or SkipGrad, edge)``, goes between WStash and WGrad), then MB.
OUT_GROUPS = (BufKind.Act, BufKind.Grad, BufKind.Stash, BufKind.WStash, BufKind.WGrad, MB)
# a fused action's task kinds, as the plan's unit lists them (F then B of one microbatch):
# the kind of the fused forward+backward function (``build_tasks``)
FUSED_FB = (TaskKind.F, TaskKind.B)
# the C++ graph bindings' task kind characters (``TaskBody.kind``), read as the enum
_KIND_OF_CHAR = {_core.task_kind_char(k): k for k in TaskKind.__members__.values()}


def task_kind(char: str) -> "_core.TaskKind":
    """The ``TaskKind`` of a task of the partition (``TaskBody.kind``, a kind character)."""
    return _KIND_OF_CHAR[char]


def kind_name(kind) -> str:
    """A task kind as messages, traces and pictures name it: ``F``, ``B``, ``I``, ``W``, or
    ``FB`` for the fused kind (``FUSED_FB``)."""
    if isinstance(kind, tuple):
        return "".join(_core.task_kind_char(k) for k in kind)
    return _core.task_kind_char(kind)


def buffer_group(key: tuple):
    """The output group (``OUT_GROUPS``) that holds buffer ``key`` (kind, stage[,
    microbatch]): its kind, or ``(kind, edge)`` for a skip edge's buffer."""
    return (key[0], key[1]) if key[0] in SKIP_KINDS else key[0]


def task_name(task: tuple) -> str:
    """A task ``(kind, stage)`` as messages and tables name it: ``F0``, ``B1``, ``FB3``."""
    return f"{kind_name(task[0])}{task[1]}"


def unit_order(unit: tuple) -> tuple:
    """A sort key of ``(kind, stage, ...)`` tuples: by kind name, then the rest (the enum
    has no order)."""
    return (kind_name(unit[0]), *unit[1:])


def make_fn(traced: Traced, op_ids: list[int], in_ids: list[int], out_ids: list[int],
            fix=None):
    """The ops ``op_ids`` (program order) as a plain function from ``in_ids`` to
    ``out_ids``; ``fix`` (``retarget.OnRank``): applied to every equation's parameters and
    context first, nested ones included (the ops moved onto a rank's sub-mesh), and the
    equations it drops (``OnRank.drop``: identities) removed, their outputs read as their
    inputs."""
    ops = [traced.ops[i] for i in op_ids]
    if fix is not None:
        ops, out_ids = _on_rank(ops, out_ids, fix)
    lits = traced.literals
    if fix is not None:
        needed = {v for op in ops for v in op.inputs} | set(out_ids)
        lits = {v: fix.value(lits[v]) for v in needed if v in lits}

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
class _Op:
    prim: Any
    params: dict
    ctx: Any
    inputs: list
    outputs: list


def _on_rank(ops, out_ids, fix) -> tuple[list, list]:
    """``ops`` and ``out_ids`` (value ids) with ``fix`` applied (see ``make_fn``): a dropped
    op's outputs renamed to its inputs in the ops after it and in ``out_ids``."""
    ren: dict[int, int] = {}
    out = []
    for op in ops:
        params = jc.map_eqn_params(op.prim.name, op.params, fix.params, fix.ctx, fix.value,
                                   fix.aval, fix.drop)
        inputs = [ren.get(v, v) for v in op.inputs]
        if fix.drop(op.prim.name, params):
            if len(inputs) != len(op.outputs):
                raise ValueError(f"{op.prim.name}: not an identity of its operands, cannot drop")
            ren.update(zip(op.outputs, inputs))
            continue
        out.append(_Op(op.prim, params, fix.ctx(op.ctx), inputs, op.outputs))
    return out, [ren.get(v, v) for v in out_ids]


def _with_acc(fn, pos: list[int]):
    """``fn`` with the running sums fused in: ``g(acc, *args)`` returns ``fn(*args)`` with
    output ``pos[k]`` replaced by ``acc[k] + output``: XLA adds inside the task's program
    instead of a separate pass over parameter-sized buffers per microbatch. (Donating ``acc``
    was measured no faster here, and slower in some steps: see bench/results/pinned.md,
    "Analysis notes".)"""

    def g(acc, *args):
        outs = list(fn(*args))
        for k, j in enumerate(pos):
            outs[j] = acc[k] + outs[j]
        return outs

    return g


def _with_acc_mean(g, pos: list[int], mean: list[bool]):
    """``g`` (see _with_acc) for the last microbatch: the sums of mean-reduced parts also
    divided by ``count`` (a traced scalar), so no separate pass over the gradients follows
    the loop."""

    def h(count, acc, *args):
        outs = g(acc, *args)
        for k, j in enumerate(pos):
            if mean[k]:
                outs[j] = outs[j] / jnp.asarray(count, outs[j].dtype)
        return outs

    return h


@dataclasses.dataclass
class TaskExe:
    kind: Any  # a _core.TaskKind, or FUSED_FB
    stage: int
    fn: Any
    in_groups: tuple  # (invariant, microbatch, act, grad, stash, wstash) value ids
    n_out: dict  # output group -> count
    body: Any  # (weight-gradient parts, per-microbatch output parts)
    # skip-edge buffers it reads, after the groups: ((kind, edge), value ids) in plan order
    skip_in: list = dataclasses.field(default_factory=list)
    out_order: tuple = OUT_GROUPS  # its output groups in order (with its skip groups)
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
    plain: Any = None  # the task as a plain function (traced into programs, task_env.py)

    def split(self, outs) -> dict[str, list]:
        """One call's outputs by group (``out_order``: Act, Grad, Stash, WStash, its skip
        edges, WGrad, MB)."""
        got, pos = {}, 0
        for k in self.out_order:
            got[k] = list(outs[pos:pos + self.n_out[k]])
            pos += self.n_out[k]
        return got


def buffer_reads(exe: TaskExe, plan_reads: list[tuple]) -> list[tuple]:
    """The buffers (kind, stage, microbatch) task ``exe`` passes as arguments, in argument
    order after its invariant and microbatch inputs: of ``plan_reads`` (what the plan says
    the task reads, ``Buffers.reads``), the one of each buffer kind the function has an
    input group for (Act, Grad, Stash, WStash), then those of its skip edges."""
    _, _, act, grad, stash, wstash = exe.in_groups
    first: dict = {}
    for key in plan_reads:
        first.setdefault(buffer_group(key), key)
    want = [k for present, k in ((act, BufKind.Act), (grad, BufKind.Grad),
                                 (stash, BufKind.Stash), (wstash, BufKind.WStash)) if present]
    want += [ke for ke, _ in exe.skip_in]
    missing = [k for k in want if k not in first]
    if missing:
        raise ValueError(f"task {kind_name(exe.kind)}{exe.stage} takes buffers {missing} that "
                         f"the plan does not give it (the plan's reads: {plan_reads})")
    return [first[k] for k in want]


def _task_exe(traced, parts, kind, stage, ops, groups, outs, wgrad_parts, mb_parts,
              fix=None, skip_in=(), skip_out=()) -> TaskExe:
    """One task's jit: ``ops`` (program order) from the value ids in ``groups`` (then the
    skip edges it reads, ``skip_in``) to its outputs by group (``out_order``: the groups of
    ``OUT_GROUPS`` with the skip edges it writes, ``skip_out``, before ``WGrad``), with the
    running-sum variant when it has summed weight gradients (see _with_acc)."""
    outs = dict(outs)
    outs[BufKind.WGrad] = [parts[i].body for i in wgrad_parts]
    outs[MB] = [parts[i].body for i in mb_parts]
    outs.update(skip_out)
    order = OUT_GROUPS[:4] + tuple(k for k, _ in skip_out) + OUT_GROUPS[4:]
    in_ids = [v for g in groups for v in g] + [v for _, vs in skip_in for v in vs]
    out_ids = [v for k in order for v in outs[k]]
    body = make_fn(traced, ops, in_ids, out_ids, fix)
    exe = TaskExe(kind, stage, jax.jit(body), groups, {k: len(v) for k, v in outs.items()},
                  (wgrad_parts, mb_parts), plain=body, skip_in=list(skip_in), out_order=order)
    off = sum(len(outs[k]) for k in order[:order.index(BufKind.WGrad)])
    summed = [(off + j, i) for j, i in enumerate(wgrad_parts)
              if parts[i].reduce != G.Reduce.Stack]
    if summed:
        exe.acc_pos = [j for j, _ in summed]
        exe.acc_parts = [i for _, i in summed]
        exe.acc_body = _with_acc(body, exe.acc_pos)
        exe.fn_acc = jax.jit(exe.acc_body)
        exe.acc_mean = [parts[i].reduce == G.Reduce.Mean for i in exe.acc_parts]
        if any(exe.acc_mean):
            exe.fn_acc_mean = jax.jit(_with_acc_mean(exe.acc_body, exe.acc_pos, exe.acc_mean))
    return exe


def build_tasks(traced: Traced, partition, parts, num_stages: int,
                fix_of=lambda stage: None) -> dict[tuple[Any, int], TaskExe]:
    """Every task of the partition by ``(TaskKind, stage)``, plus ``(FUSED_FB, s)``: F and B
    of one microbatch as one function (the fused actions of fuse_forward_backward), no stash
    leaving it. ``fix_of``:
    stage -> the equation fix of its rank (``on_rank``)."""
    tasks: dict[tuple[Any, int], TaskExe] = {}
    by_kind = {(task_kind(t.kind), t.stage): t for t in partition.tasks}
    for t in partition.tasks:
        kind = task_kind(t.kind)
        groups = (list(t.invariant_in), list(t.microbatch_in), list(t.act_in),
                  list(t.grad_in), list(t.stash_in), list(t.wstash_in))
        outs = {BufKind.Act: list(t.act_out), BufKind.Grad: list(t.grad_out),
                BufKind.Stash: list(t.stash_out), BufKind.WStash: list(t.wstash_out)}
        tasks[(kind, t.stage)] = _task_exe(traced, parts, kind, t.stage, list(t.ops),
                                           groups, outs, list(t.wgrad_out), list(t.mb_out),
                                           fix_of(t.stage), *_skips(t))
    for s in range(num_stages):
        f, b = by_kind.get((TaskKind.F, s)), by_kind.get((TaskKind.B, s))
        if f is None or b is None:
            continue
        groups = (sorted(set(f.invariant_in) | set(b.invariant_in)),
                  sorted(set(f.microbatch_in) | set(b.microbatch_in)),
                  list(f.act_in), list(b.grad_in), [], [])
        outs = {BufKind.Act: list(f.act_out), BufKind.Grad: list(b.grad_out),
                BufKind.Stash: [], BufKind.WStash: []}
        fi, fo = _skips(f)
        bi, bo = _skips(b)
        tasks[(FUSED_FB, s)] = _task_exe(traced, parts, FUSED_FB, s,
                                         sorted(set(f.ops) | set(b.ops)), groups, outs,
                                         list(b.wgrad_out), list(f.mb_out), fix_of(s),
                                         fi + bi, fo + bo)
    return tasks


def _skips(t) -> tuple[list, list]:
    """The skip-edge buffers task ``t`` reads and writes: ``[((kind, edge), value ids)]``
    in the plan's order (an F's Skip edges; a B's or I's SkipGrad edges)."""
    skip, grad = BufKind.Skip, BufKind.SkipGrad
    return ([((skip, e), list(vs)) for e, vs in t.skip_in]
            + [((grad, e), list(vs)) for e, vs in t.skip_grad_in],
            [((skip, e), list(vs)) for e, vs in t.skip_out]
            + [((grad, e), list(vs)) for e, vs in t.skip_grad_out])


def task_exes(tasks, kind, s) -> list[TaskExe]:
    """The task functions a task runs: one, or I then W for a B the partition split."""
    if kind == TaskKind.B and (TaskKind.B, s) not in tasks:
        return [tasks[(TaskKind.I, s)], tasks[(TaskKind.W, s)]]
    return [tasks[(kind, s)]]


def parts_of(tasks, kind, s) -> list[int]:
    """The loop-output parts (weight gradients, per-microbatch outputs) a task adds to."""
    out = []
    for exe in task_exes(tasks, kind, s):
        out += list(exe.body[0]) + list(exe.body[1])
    return out


def combine_parts(xs: list, move=None):
    """A loop output made of several stages' parts: their sum (a value several stages make,
    e.g. a tied embedding's gradient). ``move`` (when the parts sit on different ranks) puts
    each on the rank that sums them; inside one traced program there is nothing to move. The
    one combine of every engine and path."""
    total = None
    for x in xs:
        if move is not None and len(xs) > 1:
            x = move(x)
        total = x if total is None else total + x
    return total


def final_part(part, acc, stacked, M: int):
    """A loop output part's value after the loop, from its running sum ``acc`` (Mean: /M;
    Sum: as is) or its per-microbatch values ``stacked()`` (Stack)."""
    if part.reduce == G.Reduce.Stack:
        return stacked()
    if part.reduce == G.Reduce.Mean:
        return acc / jnp.asarray(M, acc.dtype)
    return acc
