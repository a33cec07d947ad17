"""The compiled engine (one XLA program per rank, transfers as XLA FFI calls): what its
programs contain, and that steady calls compile nothing. Numerical equality with plain JAX
for every schedule is in test_e2e.py (one process) and test_mp_e2e.py (one process per
rank)."""

from __future__ import annotations

import os
import re
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import gpt  # noqa: E402

_TARGET = re.compile(r'custom_call @(\w+)|call_target_name = "(\w+)"')


def targets(text: str) -> set[str]:
    return {a or b for a, b in _TARGET.findall(text)}


@pytest.mark.parametrize("schedule", [baton.OneFOneB(), baton.Interleaved1F1B(2), baton.ZBV()],
                         ids=["1f1b", "interleaved", "zbv"])
def test_rank_programs_transfer_through_ffi_not_python(schedule):
    """Every rank's program moves its buffers with baton_comm custom calls and ends with
    baton_drain; it holds no Python callback of any kind."""
    from mlp_step import make

    ps, params, batch = make(schedule, 2, 4)
    ps(params, batch)
    step = ps.last
    assert len(step.engine.local_progs) == 2
    for rp in step.engine.local_progs:
        found = targets(rp.lowered_text())
        assert {"baton_comm", "baton_drain"} <= found, found
        assert not any("callback" in t for t in found), found
        # one custom call per stretch of transfers: as many as the items' stretches
        assert rp.lowered_text().count("baton_comm") >= 1


def test_one_rank_program_has_no_callbacks():
    from mlp_step import make

    ps, params, batch = make(baton.OneFOneB(), 1, 4)
    ps(params, batch)
    sp = ps.last.engine.single
    found = targets(sp.lowered_text(jax.tree.leaves((params, batch))))
    assert not any("callback" in t for t in found), found


def test_steady_calls_compile_nothing():
    """Calls 2-5 of a 4-rank GPT step compile nothing, although the first call's
    parameters are uncommitted (jnp.asarray) and later calls get the committed outputs."""
    compiles = []

    def listen(name, secs, **kw):
        # a compilation, or a program fetched from JAX's persistent compilation cache (on in
        # scripts/test.sh): a steady call must do neither
        if "backend_compile" in name or "cache_retrieval" in name:
            compiles.append(secs)

    jax.monitoring.register_event_duration_secs_listener(listen)
    cfg = gpt.GPTConfig(stages=4, layers=4)
    model, params, opt, st, step, ref = gpt.make(cfg, eps=1e-6)
    batch = gpt.synthetic_batch(cfg, 8)
    ps = baton.jit(step, mesh=baton.PipelineMesh(jax.devices()[:4], ranks=4),
                   schedule=baton.OneFOneB(), microbatches=4)
    params, st, loss = ps(params, st, batch)
    assert compiles, "the listener saw no compilation at all"
    counts = []
    for _ in range(4):
        compiles.clear()
        params, st, loss = ps(params, st, batch)
        jax.block_until_ready(loss)
        counts.append(len(compiles))
    assert counts == [0, 0, 0, 0], counts


def test_traced_and_untraced_steps_run_the_same_executable():
    """Tracing is a runtime switch of the programs' task markers and transfer records: a
    traced call runs the executables the untraced calls run (nothing is compiled for it),
    and its trace has every rank's tasks in the plan's order. (Also: the programs' rings are
    shared by buffer kinds of equal avals.)"""
    from mlp_step import make

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name)
        if "backend_compile" in name or "cache_retrieval" in name else None)
    ps, params, batch = make(baton.ZBV(), 2, 4)
    ps(params, batch)
    step = ps.last
    progs = list(step.engine.local_progs)
    exes = [p.compiled for p in progs]
    # the lowering shares a ring among buffer kinds of equal avals: ZB-V's rings hold less
    # than one ring per kind would, and never less than the buffers live at once
    held = [(p.live_buffer_peak(), p.ring_bytes(), p.ring_bytes(pooled=False)) for p in progs]
    assert all(live <= shared <= per_kind for live, shared, per_kind in held), held
    assert any(shared < per_kind for _, shared, per_kind in held), held
    assert any("+" in p.describe().split("; rings ")[1] for p in progs)
    compiles.clear()
    tr = baton.trace(ps, params, batch)
    ps(params, batch)
    assert compiles == []
    assert step.engine.local_progs == progs and [p.compiled for p in progs] == exes
    assert "rank_program" in ps.last_run.stats
    for r in range(2):
        want = [str(a) for a in step.rank_actions[r]]
        assert tr.rank_order(r) == want
    assert len(tr.transfers) > 0 and all(t["end"] >= t["start"] for t in tr.transfers)


@pytest.mark.parametrize("warm", ["threads", "here", None],
                         ids=["warmed", "warmed_in_this_thread", "not_warmed"])
def test_code_after_the_loop_compiled_ahead_is_not_compiled_again(monkeypatch, warm):
    """A ``Warmup`` (warm.py: with several processes, on threads started while the rank
    programs compile, or on one core in the building thread after them) compiles the
    segments after the loop from avals and placements ahead of their first call, so running
    them compiles nothing; without it each compiles at its call (the check can fail)."""
    import optax
    from baton import _jax_compat as jc
    from baton.running import step as step_mod
    from baton.emit.warm import Warmup
    from mlp_step import make_train

    in_post, compiles = [False], []

    def listen(name, secs, **kw):
        if in_post[0] and ("backend_compile" in name or "cache_retrieval" in name):
            compiles.append(name)

    run = step_mod.CompiledStep._run_segments

    def timed(self, segs, vals, free=False, **kw):
        in_post[0] = free
        try:
            return run(self, segs, vals, free=free, **kw)
        finally:
            in_post[0] = False

    monkeypatch.setattr(step_mod.CompiledStep, "_run_segments", timed)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        ps, params, st, batch = make_train(baton.OneFOneB(), 2, optax.adam(1e-2))
        step = ps.compile(params, st, batch)
        assert len(step.post_segments) >= 2
        want = len(step.post_segments) if jc.jax_version >= (0, 12) else 0
        if warm == "threads":
            w = Warmup(step, step.post_segments, [0, 1])
            # JAX 0.11's AOT compile does not fill the cache jit calls use: no warm-up there
            assert len(w.threads) == want and w.jobs == []
            w.join()
        elif warm == "here":
            w = Warmup(step, step.post_segments, [0, 1], background=False)
            assert w.threads == [] and len(w.jobs) == want
            w.run()
            assert w.jobs == []
        jax.block_until_ready(ps(params, st, batch))
    finally:
        in_post[0] = False
    assert (compiles == []) == (warm is not None and jc.jax_version >= (0, 12)), compiles


EXIT_WHILE_WARMING = """
import os, sys
sys.path.insert(0, {here!r})
import optax, baton
from baton.emit.warm import Warmup
from mlp_step import make_train
ps, params, st, batch = make_train(baton.OneFOneB(), 2, optax.adam(1e-2))
step = ps.compile(params, st, batch)
print(len(Warmup(step, step.post_segments, [0, 1]).threads), flush=True)
"""


def test_a_process_that_exits_while_warming_up_exits_cleanly(tmp_path):
    """A process that stops while the warm-up compiles (``compile`` without a call, or an
    error) waits for those compiles: as daemon threads inside XLA while the interpreter
    finalizes, they crashed it (SIGSEGV here, std::terminate under load)."""
    import subprocess

    script = tmp_path / "exit_warm.py"
    script.write_text(EXIT_WHILE_WARMING.format(here=os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=180, env=env)
    assert p.returncode == 0, (p.returncode, p.stdout[-2000:], p.stderr[-4000:])
    from baton import _jax_compat as jc

    assert int(p.stdout.split()[-1]) >= (2 if jc.jax_version >= (0, 12) else 0), p.stdout
