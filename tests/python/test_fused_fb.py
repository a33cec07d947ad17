"""Fused forward-backward: where a rank runs B(s,m) right after F(s,m) (the last stage of 1F1B,
every microbatch on one rank), baton.jit runs the pair as one program that keeps no stash.
Results equal the unfused run bit for bit; the plan and the executor hold no stash buffer on
that rank; turning it off restores separate F and B tasks. (On the executor: one rank would
otherwise run as one program, see test_one_rank.py.)"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402
from baton.planning.tasks import FUSED_FB  # noqa: E402

from mlp_step import make  # noqa: E402


def _run(ranks, fuse, m=4):
    ps, params, batch = make(baton.OneFOneB(), ranks, m, seed=3, layers_per_stage=2,
                             fuse_forward_backward=fuse, engine="interpreter")
    step = ps.compile(params, batch)
    calls = {}  # task -> number of calls of its jits
    for key_, exe in step.tasks.items():
        for attr in ("fn", "fn_acc", "fn_acc_mean"):
            f = getattr(exe, attr)
            if f is not None:
                def counted(*a, _f=f, _k=key_):
                    calls[_k] = calls.get(_k, 0) + 1
                    return _f(*a)
                counted.lower = f.lower  # (baton.profile compiles each task on its layouts)
                setattr(exe, attr, counted)
    out = ps(params, batch)
    ps.calls = calls
    return ps, out, (params, batch)


@pytest.mark.parametrize("ranks", [1, 2])
def test_fused_equals_unfused_and_keeps_no_stash(ranks):
    fused, got, args = _run(ranks, True)
    plain, want, _ = _run(ranks, False)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    last = ranks - 1
    acts = fused.last.rank_actions
    assert [str(a) for a in acts[last]] == [f"F{last}.{m}+B{last}.{m}" for m in range(4)]
    assert not any(a.is_fused for r in range(last) for a in acts[r])
    assert not any(a.is_fused for a in plain.last.rank_actions[last])
    # one program per pair: the stage's "FB" task ran once per microbatch, its F and B never
    F, B = baton.TaskKind.F, baton.TaskKind.B
    assert fused.calls[(FUSED_FB, last)] == 4
    assert (F, last) not in fused.calls and (B, last) not in fused.calls
    assert plain.calls[(F, last)] == plain.calls[(B, last)] == 4
    assert (FUSED_FB, last) not in plain.calls
    # the plan and the executor keep no stash on the fused rank
    assert fused.simulate().peak_activation[last] == 0
    assert plain.simulate().peak_activation[last] > 0
    assert fused.last_run.stats["peak_bytes"][last] < plain.last_run.stats["peak_bytes"][last]
    # profiling times the fused pair and the simulator uses it
    prof = baton.profile(fused, *args, runs=2)
    assert (FUSED_FB, last) in prof.task_times
    assert prof.cost_model.stages[last].fb == pytest.approx(prof.task_times[(FUSED_FB, last)])
