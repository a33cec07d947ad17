"""Several pipeline ranks per process: 2 launched processes x 2 ranks (4 ranks of one CPU
device each; each process has 2 devices), ``baton.jit(mesh=PipelineMesh(local_devices, ranks=2))``.

* The MLP of ``test_mp_e2e.py`` trained 2 AdamW steps with 1F1B (4 stages) and ZB-V (8
  stages, 2 per rank) on the compiled engine, and 1F1B on the interpreter
  (``engine="interpreter"``): losses, gradients, updated parameters and optimizer state equal
  to plain JAX (``accumulate`` as a ``lax.scan`` over the same microbatches, rtol 1e-5); each
  process holds exactly its ranks' stages (the rest are ``Remote``s naming the stage's rank);
  a traced step (either engine) has every rank's tasks.
* Processes with different numbers of ranks are refused in both, naming each process's k
  (same launch, before training: the refusal leaves the process group usable).
* One process SIGKILLed in the middle of a step: the other raises ``ExecutionError`` naming
  a rank of the dead process; a rank that raises (beside another rank of its process): both
  processes raise ``ExecutionError`` naming it; well within the timeout.

Every launch has a timeout.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402
from baton.planning.tasks import FUSED_FB  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import test_mp_e2e as T  # noqa: E402  (the MLP step, its configs and plain-JAX reference)

K = 2  # ranks per process
# case -> (schedule, compiled engine?): the interpreter (engine="interpreter") too
CASES = {"1f1b": ("1f1b", True), "zbv": ("zbv", True), "1f1b-interp": ("1f1b", False)}
NAMES = tuple(CASES)


def local_mesh():
    return baton.PipelineMesh(jax.local_devices()[:K], ranks=K)


def train_main(p, world, out):
    # every process must run the same number of ranks: refused in every process, by name
    mesh = local_mesh() if p == 0 else None
    bad = baton.jit(T.train_step, mesh=mesh, schedule=baton.OneFOneB(), microbatches=4)
    try:
        bad.compile(*T.config("1f1b", 2)[3:])
        (out / f"mismatch-process{p}.txt").write_text("accepted")
    except baton.ConfigError as e:
        (out / f"mismatch-process{p}.txt").write_text(str(e))
    R = world * K
    for name, (sname, program) in CASES.items():
        sched, stages, m, params, st, batch = T.config(sname, R)
        ps = baton.jit(T.train_step, mesh=local_mesh(), schedule=sched, microbatches=m,
                       engine="compiled" if program else "interpreter")
        assert ps.ranks == [p * K, p * K + 1], ps.ranks
        hist, params, st = T.run_steps(ps, params, st, batch)
        step = ps.last
        assert step.num_ranks == R
        held = []
        for s in range(stages):
            r = step.stage_rank[s]
            for leaf in jax.tree.leaves(params[s]):
                if isinstance(leaf, baton.Remote):
                    assert leaf.rank == r and r // K != p, (name, p, s, leaf)
                else:
                    assert r // K == p, (name, p, s)
                    assert leaf.sharding.device_set == set(step.mesh.rank_devices[r]), (s, r)
                    held.append(s)
        assert held, (name, p)
        if program:
            hows = ps.last_run.stats["rank_program"]
            assert isinstance(hows, list) and len(hows) == K, hows
        else:  # every rank's executor peaks, exchanged
            hows = [f"executor {b}" for b in ps.last_run.stats["peak_bytes"]]
            assert len(hows) == R and all(b > 0 for b in ps.last_run.stats["peak_bytes"]), hows
        (out / f"{name}-mode-process{p}.txt").write_text("\n".join(hows))
        np.save(out / f"{name}-loss-process{p}.npy", [float(x) for x, _ in hist])
        if sname == "1f1b":  # a traced step: every global rank's tasks, on one clock
            tr = baton.trace(ps, params, st, batch)
            ranks = sorted({r["rank"] for r in tr.runs})
            (out / f"{name}-trace-process{p}.txt").write_text(f"{tr.num_ranks} {ranks}")
        full = ps.gather((hist, params, st))
        if p == 0:
            np.savez(out / f"{name}.npz", **T.flat_result(*full))
        print(f"process {p} {name} ok", flush=True)
    skips_main(p, out)


def skips_main(p, out):
    """The MLP with two long skips (test_stage_graph) on the 4 ranks with 1F1B: the skip
    edges 0 -> 3 and 1 -> 3 cross from process 0 to process 1 over Gloo."""
    import test_stage_graph as G

    train_step, _ = G._steps(G.skip_loss)
    key = jax.random.PRNGKey(1)
    params, batch = G.init_skip(key), G.skip_batch(key, 16)
    ps = baton.jit(train_step, mesh=local_mesh(), schedule=baton.OneFOneB(), microbatches=4)
    st = G.OPT.init(params)
    losses = []
    for _ in range(2):
        params, st, loss, _ = ps(params, st, batch)
        losses.append(float(loss))
    edges = [(e.src, e.dst) for e in ps.last.core_plan.skips]
    full = ps.gather(params)
    if p == 0:
        np.savez(out / "skips.npz", loss=np.asarray(losses), edges=np.asarray(edges),
                 **{f"p{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(full))})


def fault_main(p, world, out, mode):
    """``kill``: process 1 SIGKILLs itself inside its last stage's task (rank 3), at the
    second microbatch. ``raise``: rank 1 (process 0's second rank) raises inside its
    forward, at the second microbatch."""
    sched, stages, m, params, st, batch = T.config("1f1b", world * K)
    ps = baton.jit(T.train_step, mesh=local_mesh(), schedule=sched, microbatches=m,
                   timeout=60)
    step = ps.compile(params, st, batch)
    task = (FUSED_FB, stages - 1) if mode == "kill" else (baton.TaskKind.F, 1)
    if step.stage_rank[task[1]] // K == p:
        calls = [0]

        def maybe_fail():
            calls[0] += 1
            if calls[0] == 2 and mode == "kill":
                os.write(1, f"process {p} killing itself\n".encode())
                os.kill(os.getpid(), 9)
            if calls[0] == 2:
                raise RuntimeError("injected failure on rank 1")

        T.call_in_task(step.tasks[task], maybe_fail)
    t0 = time.monotonic()
    try:
        ps(params, st, batch)
    finally:
        os.write(1, f"process {p} step ended after {time.monotonic() - t0:.1f} s\n".encode())


def worker_main(mode, outdir):
    from baton.running.distributed import process_group

    g = process_group()
    if mode == "train":
        train_main(g.rank, g.world_size, pathlib.Path(outdir))
    else:
        fault_main(g.rank, g.world_size, pathlib.Path(outdir), mode)


WORKER = f"""
import os, sys
sys.path.insert(0, {str(HERE)!r})
import baton
import test_multi_rank_process as T
p = os.environ["BATON_RANK"]
try:
    T.worker_main(sys.argv[1], sys.argv[2])
except baton.BatonError as e:
    os.write(1, f"process {{p}} ERROR {{type(e).__name__}}: {{e}}\\n".encode())
    os._exit(3)
print(f"process {{p}} done", flush=True)
"""


def launch(tmp_path, mode, timeout):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(K), JAX_PLATFORMS="cpu")
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "baton.launch", "--nprocs", "2", "--grace", "20",
         "--timeout", str(timeout - 15), str(script), mode, str(tmp_path)],
        capture_output=True, text=True, timeout=timeout, env=env)
    return p, time.monotonic() - t0


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mrank")
    p, elapsed = launch(tmp, "train", timeout=420)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    # the processes exit without noise (executors released before their transports close)
    assert "leaked" not in p.stderr and "reference counting" not in p.stderr, p.stderr[-3000:]
    print(f"2 processes x 2 ranks, {', '.join(NAMES)}: {elapsed:.1f} s")
    return tmp


@pytest.mark.parametrize("name", NAMES)
def test_two_processes_of_two_ranks_match_plain_jax(trained, name):
    sched, stages, m, params, st, batch = T.config(CASES[name][0], 2 * K)
    got = dict(np.load(trained / f"{name}.npz"))
    ref = T.flat_result(*T.run_steps(jax.jit(lambda p, s, b: T._scan_step(p, s, b, m)),
                                     params, st, batch))
    assert got.keys() == ref.keys() and any(k.startswith("grad") for k in got)
    for k in got:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-7, err_msg=f"{name} {k}")
    for q in range(2):  # every process has every step's loss
        np.testing.assert_array_equal(np.load(trained / f"{name}-loss-process{q}.npy"),
                                      [got[f"loss{i}"] for i in range(T.STEPS)])
        hows = (trained / f"{name}-mode-process{q}.txt").read_text().splitlines()
        if name == "1f1b":  # every rank's loop a table, each task compiled once
            assert len(hows) == K and all(h.startswith("table") for h in hows), hows
        if name == "1f1b-interp":  # the executors of all 4 ranks
            assert len(hows) == 2 * K and all(h.startswith("executor") for h in hows), hows
        if CASES[name][0] == "1f1b":
            seen = (trained / f"{name}-trace-process{q}.txt").read_text()
            assert seen == "4 [0, 1, 2, 3]", seen


def test_skip_edges_cross_processes(trained):
    """Values of stages 0 and 1 read by stage 3 go straight from process 0's ranks to
    process 1's (skip edges over Gloo) and train like plain JAX."""
    import test_stage_graph as G

    got = dict(np.load(trained / "skips.npz"))
    assert got["edges"].tolist() == [[0, 3], [1, 3]]
    _, ref = G._steps(G.skip_loss)
    key = jax.random.PRNGKey(1)
    params, batch = G.init_skip(key), G.skip_batch(key, 16)
    st = G.OPT.init(params)
    losses = []
    for _ in range(2):
        params, st, loss, _ = ref(params, st, batch)
        losses.append(float(loss))
    np.testing.assert_allclose(got["loss"], losses, rtol=1e-5)
    for i, x in enumerate(jax.tree.leaves(params)):
        np.testing.assert_allclose(got[f"p{i}"], np.asarray(x), rtol=1e-5, atol=1e-6)


def test_different_ranks_per_process_refused_by_name(trained):
    for q in range(2):
        msg = (trained / f"mismatch-process{q}.txt").read_text()
        assert "same number of pipeline ranks" in msg, msg
        assert "process 0 has 2, process 1 has 1" in msg, msg


@pytest.mark.parametrize("mode", ["kill", "raise"])
def test_failure_stops_every_process(tmp_path, mode):
    """Process 1 killed mid-step (its ranks 2 and 3 gone): process 0 raises ExecutionError
    naming one of them. Rank 1 raising (its sibling rank 0 in the same process): both processes
    raise ExecutionError naming rank 1. Both well within the 60 s timeout."""
    p, elapsed = launch(tmp_path, mode, timeout=180)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-6000:]
    errors = {q: [ln for ln in out.splitlines() if ln.startswith(f"process {q} ERROR")]
              for q in range(2)}
    if mode == "kill":
        assert "process 1 killing itself" in out, out[-6000:]
        line = errors[0]  # whichever of the dead process's ranks (2, 3) was noticed first
        assert line and re.search(r"ExecutionError: .*rank ([23]) failed: connection to rank "
                                  r"\1 was lost", line[0]), out[-6000:]
    else:
        for q in range(2):
            line = errors[q]
            assert line and "ExecutionError" in line[0], out[-6000:]
            # process 0: rank 1's own error; process 1: its ranks' waits, "rank 1 failed"
            want = "ExecutionError: rank 1: " if q == 0 else "rank 1 failed: rank 1: "
            assert want in line[0], line[0]
        assert "injected failure on rank 1" in out, out[-6000:]
    took = [float(ln.split()[-2]) for ln in out.splitlines()
            if ln.startswith("process 0 step ended after")]
    assert took and took[0] < 30, (took, out[-3000:])
    assert elapsed < 120, f"took {elapsed:.1f} s"


def test_process_mesh_layout_and_multi_device_ranks_refused():
    """(No launch.) The pipeline of P processes of k ranks: global rank p*k + j is local rank
    j. k ranks of several CPU devices in one process are refused by the compiled engine."""
    import types

    from baton.running import engine
    from baton.running.distributed import process_mesh

    one = process_mesh(baton.PipelineMesh(jax.devices()[:2], ranks=2), 3)
    assert one.num_ranks == 6 and one.ranks_per_process == 2
    assert [d[0].id for d in one.rank_devices] == [0, 1] * 3
    two = process_mesh(baton.PipelineMesh(jax.devices()[:4], ranks=2), 2)
    step = types.SimpleNamespace(transport="gloo", mesh=two, num_ranks=4)
    why = engine.refusal(step, 3)
    assert why and "rank 3 has 2 devices and this process runs 2 ranks" in why, why
    single = process_mesh(jax.devices()[:2], 2)  # one rank of 2 devices per process: runs
    assert engine.refusal(types.SimpleNamespace(transport="gloo", mesh=single, num_ranks=2),
                          1) is None
