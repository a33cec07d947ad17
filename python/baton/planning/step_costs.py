"""A step's costs for the planner and simulator: each stage's traced task costs and buffer
bytes (``stage_costs``), its skip edges' bytes (``skip_costs``), and the ``CostModel`` the
step's ``simulate()`` and ``summary()`` use (``cost_model_of``: profiled seconds after
``baton.profile``, else normalized flops)."""

from __future__ import annotations

from .. import _core

G = _core.graph


def skip_costs(step) -> list:
    """Bytes per microbatch of each skip edge's transfers (``_core.SkipCost``)."""
    p = step.traced.program
    out = {}
    for t in step.partition.tasks:
        for e, vs in t.skip_out:
            out.setdefault(e, [0, 0])[0] = sum(p.value_bytes(v) for v in vs)
        for e, vs in t.skip_grad_out:
            out.setdefault(e, [0, 0])[1] = sum(p.value_bytes(v) for v in vs)
    edges = list(step.partition.skips)
    return [_core.SkipCost(edges[e].src, edges[e].dst, a, g)
            for e, (a, g) in sorted(out.items())]


def stage_costs(step) -> list[dict]:
    """Each stage's traced task costs (flops) and buffer bytes per microbatch."""
    p = step.traced.program
    out = []
    for s in range(step.num_stages):
        ts = {t.kind: t for t in step.partition.tasks if t.stage == s}
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
            # summed weight gradients go straight into the running sums (interpreter:
            # tasks._with_acc): a WGrad buffer holds only stacked parts
            wgrad_bytes=sum(p.value_bytes(step.parts[j].body) for j in wg.wgrad_out
                            if step.parts[j].reduce == G.Reduce.Stack),
        ))
    return out


def cost_model_of(step):
    """Simulator costs: the profiled ones after ``baton.profile`` (seconds), else the traced
    task costs (flops, normalized) with real byte sizes."""
    prof = step.profiled
    if prof is not None:
        return prof.cost_model
    costs = step.stage_costs()
    scale = max(max(c["f"] for c in costs), 1.0)
    cm = _core.CostModel()
    stages = []
    # A task with no ops (stage 0's I) still allocates its outputs before its
    # inputs are freed: give every task a small positive duration so that the
    # simulator's memory timeline sees that moment too.
    tiny = 1e-3
    for c in costs:
        sc = _core.StageCost()
        sc.f = max(c["f"] / scale, tiny)
        sc.b = max(c["b"] / scale, tiny)
        sc.i = max(c["i"] / scale, tiny)
        sc.w = max(c["w"] / scale, tiny)
        sc.act_bytes = int(c["act_bytes"])
        sc.stash_bytes = int(c["stash_bytes"])
        sc.grad_bytes = int(c["grad_bytes"])
        sc.wstash_bytes = int(c["wstash_bytes"])
        sc.wgrad_bytes = int(c["wgrad_bytes"])
        stages.append(sc)
    cm.stages = stages
    cm.skips = step.skip_costs()
    return cm
