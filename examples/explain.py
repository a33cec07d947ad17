"""Show every stage of how Baton turns a training step into per-rank pipeline programs.

    JAX_NUM_CPU_DEVICES=2 python examples/explain.py              # 1F1B, then ZB-H1
    JAX_NUM_CPU_DEVICES=2 python examples/explain.py --schedule 1f1b

A two-stage MLP (one dense layer per stage, one ``stage_boundary``, an SGD
update after the microbatch loop) is pipelined with ``baton.jit`` on 2 ranks and
2 microbatches. For each schedule it prints:

1. the loop-body jaxpr that ``baton.accumulate`` traced (one microbatch; the
   same for both schedules, so printed once);
2. the ``Program`` the frontend exports to C++: one op per equation, with the
   task (kind and stage) the partition put a loop op in, or the stage that runs
   an op outside the loop;
3. each task's slice: its ops and its interface, classified as the plan's
   buffers (act, grad, stash, wstash, wgrad) plus loop-invariant inputs (param),
   per-microbatch inputs (microbatch) and per-microbatch outputs (output);
4. ``plan.to_text()``: the instruction stream of every rank.

It then runs one step and checks the loss and the updated parameters against
``jax.value_and_grad`` + SGD on the full batch. docs/WORKED_EXAMPLE.md walks
through this output.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import baton  # noqa: E402
from baton.tracing.primitives import accumulate_p, tracing_pipeline  # noqa: E402

G = baton._core.graph

DIM = 4  # features; small so the shapes in the listing stay readable
ROWS = 2  # rows per microbatch
MICROBATCHES = 2
LR = 0.1


def init_params(key):
    k0, k1 = jax.random.split(key)
    return [
        {"w": jax.random.normal(k0, (DIM, DIM)) / 2.0, "b": jnp.zeros((DIM,))},
        {"w": jax.random.normal(k1, (DIM, DIM)) / 2.0, "b": jnp.zeros((DIM,))},
    ]


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params[0]["w"] + params[0]["b"])  # stage 0
    h = baton.stage_boundary(h)
    out = h @ params[1]["w"] + params[1]["b"]  # stage 1
    return jnp.mean((out - y) ** 2)


def step(params, batch):
    loss, grads = baton.accumulate(jax.value_and_grad(loss_fn), params, batch=batch)
    # plain SGD after the loop: each stage's update runs on that stage's rank
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss


def loop_body_jaxpr(params, batch):
    """The jaxpr ``accumulate`` records inside ``baton.jit``: the body of the
    ``baton_accumulate`` equation of the step's jaxpr."""
    with tracing_pipeline(MICROBATCHES):
        step_jaxpr = jax.make_jaxpr(step)(params, batch)
    eqn = next(e for e in step_jaxpr.jaxpr.eqns if e.primitive is accumulate_p)
    return eqn.params["body"].closed


def _names(traced):
    """Names for value ids: ``in0`` (the step's first input leaf), ``p6`` (a loop-invariant
    body input: a parameter), ``x10`` (a per-microbatch body input), ``mean(v43)`` (the
    outer value of a loop output: v43 reduced over microbatches), ``v12`` (the rest)."""
    names = {v: f"in{k}" for k, v in enumerate(traced.step_inputs)}
    for b, _outer, is_mb in traced.loop_inputs:
        names[b] = f"{'x' if is_mb else 'p'}{b}"
    for b, outer, reduce in traced.loop_outputs:
        names[outer] = f"{reduce}(v{b})"
    return lambda v: names.get(v, f"v{v}")


def _shape(traced, v):
    return traced.avals[v].str_short()  # f32[2,4]


def op_line(traced, i, name):
    op = traced.ops[i]
    label = op.prim.name
    if op.kind == G.OpKind.Boundary:
        label += f"[{op.boundary}{', backward' if op.backward else ''}]"
    outs = " ".join(name(v) for v in op.outputs)
    ins = " ".join(name(v) if v not in traced.literals else "lit" for v in op.inputs)
    return f"{outs} = {label} {ins}"


def show(schedule, params, batch, show_jaxpr=True):
    print("=" * 78)
    print(f"schedule {type(schedule).__name__}: 2 ranks, {MICROBATCHES} microbatches")
    print("=" * 78)
    mesh = baton.PipelineMesh(jax.devices()[:2], ranks=2)
    # The walk-through shows F and B as separate tasks; by default baton.jit runs the last
    # stage's F(s,m)+B(s,m) of 1F1B as one fused task (docs/ARCHITECTURE.md, Execution).
    ps = baton.jit(step, mesh=mesh, schedule=schedule, microbatches=MICROBATCHES,
                   fuse_forward_backward=False)
    cs = ps.compile(params, batch)
    traced, part = cs.traced, cs.partition
    name = _names(traced)

    if show_jaxpr:
        print("\n--- 1. loop-body jaxpr (traced once, on one microbatch) ---")
        print(loop_body_jaxpr(params, batch))

    print("--- 2. exported Program: every op, its region, and where the partition put it ---")
    where = {}
    for t in part.tasks:
        for i in t.ops:
            where.setdefault(i, []).append(f"{t.kind}{t.stage}")
    for i, op in enumerate(traced.ops):
        if op.region != G.Region.Loop:
            placed = f"stage {part.op_stage[i]}"
        elif op.kind == G.OpKind.Boundary:
            placed = "cut"  # in no task: its two sides become a plan buffer
        else:
            placed = ",".join(where.get(i, [])) or "dead"
        print(f"  op {i:2d} {op.region.name.lower():<4s} {placed:<7s}  {op_line(traced, i, name)}")
    print("  loop inputs :", ", ".join(
        f"{name(b)}={name(o)}{'/mb' if mb else ''}" for b, o, mb in traced.loop_inputs))
    print("  loop outputs:", ", ".join(name(o) for _, o, _ in traced.loop_outputs))
    print("  step outputs:", ", ".join(name(v) for v in traced.step_outputs))

    print("\n--- 3. task slices (value lists line up producer-to-consumer) ---")
    for t in part.tasks:
        print(f"{t.kind}{t.stage}: ops {list(t.ops)}")
        groups = [
            ("param", t.invariant_in, "in"), ("microbatch", t.microbatch_in, "in"),
            ("act", t.act_in, "in"), ("grad", t.grad_in, "in"),
            ("stash", t.stash_in, "in"), ("wstash", t.wstash_in, "in"),
            ("act", t.act_out, "out"), ("grad", t.grad_out, "out"),
            ("stash", t.stash_out, "out"), ("wstash", t.wstash_out, "out"),
            ("wgrad", [part.parts[k].body for k in t.wgrad_out], "out"),
            ("output", [part.parts[k].body for k in t.mb_out], "out"),
        ]
        for kind, vals, way in groups:
            if len(vals):
                vs = " ".join(f"{name(v)}:{_shape(traced, v)}" for v in vals)
                print(f"    {way:>3s} {kind:<10s} {vs}")

    print("\n--- 4. per-rank instruction streams (plan.to_text()) ---")
    print(cs.plan.to_text())

    new_params, loss = ps(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, batch)
    ref_params = jax.tree.map(lambda p, g: p - LR * g, params, ref_grads)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    print(f"ran one step: loss {float(loss):.6f} and the updated parameters equal the "
          "full-batch value_and_grad + SGD reference\n")
    return traced


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", choices=["1f1b", "zbh1", "both"], default="both")
    args = ap.parse_args(argv)
    if len(jax.devices()) < 2:
        print("need 2 devices; set JAX_NUM_CPU_DEVICES=2", file=sys.stderr)
        return 2
    key = jax.random.PRNGKey(0)
    params = init_params(key)
    kx, ky = jax.random.split(jax.random.fold_in(key, 1))
    batch = (jax.random.normal(kx, (ROWS * MICROBATCHES, DIM)),
             jax.random.normal(ky, (ROWS * MICROBATCHES, DIM)))
    if args.schedule in ("1f1b", "both"):
        show(baton.OneFOneB(), params, batch)
    if args.schedule in ("zbh1", "both"):
        show(baton.ZBH1(), params, batch, show_jaxpr=args.schedule == "zbh1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
