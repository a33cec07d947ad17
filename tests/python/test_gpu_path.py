"""What the GPU path decides on the host, tested on CPU: the loop form per platform (GPU ranks
lowered straight, without a ``lax.switch`` per unit; forced on CPU it gives the table's
results), the transfer counts a CUDA context reserves staging for, the engine no longer
refusing GPU ranks of several devices, and the NCCL library rules as bound."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

from types import SimpleNamespace  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402
from baton import _core  # noqa: E402
from baton.frontend import engine, ffi  # noqa: E402
from baton.frontend.rank_program import RankProgram, loop_form  # noqa: E402
from baton.frontend.rolling import rank_items  # noqa: E402


def _fake_step(platform, ranks=2, per_rank=2, transport="nccl"):
    devs = [[SimpleNamespace(platform=platform, id=r * per_rank + j, process_index=0)
             for j in range(per_rank)] for r in range(ranks)]
    meshes = [SimpleNamespace(shape={"tensor": per_rank}) for _ in range(ranks)]
    mesh = SimpleNamespace(rank_devices=devs, meshes=meshes, ranks_per_process=None)
    return SimpleNamespace(mesh=mesh, num_ranks=ranks, transport=transport, loop_form=None,
                           offload=[])


def test_loop_form_is_chosen_per_platform_and_can_be_forced(monkeypatch):
    monkeypatch.delenv("BATON_LOOP_FORM", raising=False)
    assert loop_form(_fake_step("cpu"), 0) == "table"
    assert loop_form(_fake_step("gpu"), 1) == "straight"
    assert loop_form(_fake_step("cuda"), 0) == "straight"
    cs = _fake_step("gpu")
    cs.loop_form = "table"
    assert loop_form(cs, 0) == "table"
    monkeypatch.setenv("BATON_LOOP_FORM", "straight")
    assert loop_form(_fake_step("cpu"), 0) == "straight"
    monkeypatch.setenv("BATON_LOOP_FORM", "rolled")
    with pytest.raises(ValueError, match="rank 0: loop form 'rolled'"):
        loop_form(_fake_step("cpu"), 0)


@pytest.mark.parametrize("name", ["1f1b", "zbh1"])
def test_straight_form_equals_the_table(monkeypatch, name):
    """Two ranks in one process on the compiled engine: the straight form (what GPU ranks
    get: no conditional per unit) gives the table's results exactly, and both equal plain
    JAX."""
    from mlp_step import make

    sched = baton.schedule_from_name(name)
    outs = {}
    for form in ("table", "straight"):
        monkeypatch.setenv("BATON_LOOP_FORM", form)
        ps, params, batch = make(sched, 2, 4)
        outs[form] = jax.block_until_ready(ps(params, batch))
        cs = ps.compile(params, batch)
        # what ran: each rank's program as described by the engine (a table, or the rolled
        # straight-line runs: scans and single items, no table)
        ran = cs.last_stats["rank_program"]
        assert len(ran) == 2 and all(d.startswith("table") == (form == "table") for d in ran)
        prog = RankProgram(cs, 0, _core.runtime.RankComm(0), 10.0)
        assert prog.form == form and prog.table == (form == "table")
    for a, b in zip(jax.tree.leaves(outs["table"]), jax.tree.leaves(outs["straight"]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    import mlp

    loss, grads = jax.value_and_grad(mlp.make_loss())(params, batch)
    want = jax.tree.leaves((loss, grads))
    for a, b in zip(jax.tree.leaves(outs["straight"]), want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_transfer_counts_of_a_rank():
    from mlp_step import make

    ps, params, batch = make(baton.OneFOneB(), 2, 4)
    cs = ps.compile(params, batch)
    chan = cs.buffers.channel
    for r in range(2):
        items = rank_items(cs, r)
        counts = ffi.transfer_counts(items, chan)
        assert sum(n for *_, n in counts) == sum(
            op in (_core.ItemOp.SEND, _core.ItemOp.POST) for op, *_ in items)
        sends = sum(n for _, _, send, n in counts if send)
        assert sends == 4  # one activation (rank 0) or gradient (rank 1) per microbatch
        assert all(n > 0 for *_, n in counts) and counts == sorted(counts)


def test_gpu_ranks_of_several_devices_are_not_refused(monkeypatch):
    """The refusal "the NCCL context is one device per rank" is gone: a GPU rank of two
    devices over NCCL is accepted (when the CUDA handlers are built); ranks that share a GPU
    are still refused by name."""
    monkeypatch.setattr(ffi, "has_cuda", lambda: True)
    step = _fake_step("gpu")
    assert engine.refusal(step, 0) is None and engine.refusal(step, 1) is None
    shared = _fake_step("gpu")
    shared.mesh.rank_devices[1][1] = shared.mesh.rank_devices[0][1]
    why = engine.refusal(shared, 0)
    assert why is not None and "share GPU" in why
    monkeypatch.setattr(ffi, "has_cuda", lambda: False)
    assert "no CUDA transfer handlers" in engine.refusal(step, 0)


def test_nccl_library_rules_as_bound():
    rt = _core.runtime
    libs = rt.mapped_libraries("libstdc++")
    assert len(libs) == 1 and "libstdc++" in libs[0]
    assert rt.mapped_libraries("libbaton-no-such-library") == []
    assert rt.nccl_version_mismatch(22809, 22809) == ""
    assert "major" in rt.nccl_version_mismatch(30000, 22809)
    path, version, was_mapped, err = rt.nccl_library()
    assert isinstance(path, str) and isinstance(version, int) and isinstance(err, str)
    assert (err == "") == bool(path)  # loaded (with a path), or the reason it was not


def test_an_already_mapped_nccl_is_the_one_used(tmp_path):
    """When the process already maps a libnccl (as JAX's CUDA plugin does), Baton opens that
    copy (RTLD_NOLOAD) even when $BATON_NCCL_LIBRARY names another file, so one copy is
    mapped. In a fresh process: the library is loaded once per process."""
    import ctypes.util
    import subprocess
    import sys

    if not _core.ffi.has_cuda():
        pytest.skip("built without CUDA/nccl.h: Baton loads no NCCL")
    try:
        ctypes.CDLL("libnccl.so.2")
    except OSError:
        pytest.skip("no libnccl.so.2 on the loader path of this machine")
    code = (
        "import ctypes, os\n"
        "ctypes.CDLL('libnccl.so.2')  # mapped first, as JAX's plugin would\n"
        "from baton import _core\n"
        "rt = _core.runtime\n"
        "before = rt.mapped_libraries('libnccl')\n"
        "path, version, was_mapped, err = rt.nccl_library()\n"
        "after = rt.mapped_libraries('libnccl')\n"
        "assert err == '', err\n"
        "assert was_mapped, (path, before)\n"
        "assert len(before) == 1 and after == before, (before, after)\n"
        "assert os.path.realpath(path) == os.path.realpath(before[0]), (path, before)\n"
        "print('ok', path, version)\n")
    env = dict(os.environ, BATON_NCCL_LIBRARY=str(tmp_path / "libnccl-other.so"))
    env.pop("BATON_QUIET", None)  # (the log line is checked)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok ")
    assert "already mapped" in r.stderr  # the one log line names where NCCL came from


class _FakeNccl:
    """Stands in for ``NcclRankComm`` (no GPU here): records what ``nccl_comms`` builds."""

    made: list = []
    fail_on: tuple | None = None

    def __init__(self, rank, world, device, store, links, timeout, prefix):
        if _FakeNccl.fail_on == (rank, prefix.rsplit("/", 1)[1]):
            raise RuntimeError(f"rank {rank}: NCCL setup: the peer never arrived")
        self.rank, self.world, self.device, self.prefix = rank, world, device, prefix
        self.routes: dict = {}
        self.closed = False
        _FakeNccl.made.append(self)

    def set_route(self, ordinal, member):
        self.routes[ordinal] = member

    def close(self):
        self.closed = True


def _gpu_step(ranks=2, per_rank=2, procs=None):
    """A step whose ranks have ``per_rank`` GPUs (CUDA ordinals counting from 0 in each
    process); ``procs[r][j]``: the process of rank r's slot j (default: all in this one)."""
    devs = []
    for r in range(ranks):
        row = []
        for j in range(per_rank):
            p = procs[r][j] if procs else 0
            row.append(SimpleNamespace(platform="gpu", id=r * per_rank + j, process_index=p,
                                       local_hardware_id=(r * per_rank + j) if not procs
                                       else j))
        devs.append(row)
    meshes = [SimpleNamespace(devices=np.array(row, dtype=object), shape={"tensor": per_rank})
              for row in devs]
    mesh = SimpleNamespace(rank_devices=devs, meshes=meshes, ranks_per_process=None)
    return SimpleNamespace(mesh=mesh, num_ranks=ranks, transport="nccl")


def test_nccl_comms_one_context_per_device_slot(monkeypatch):
    """Ranks of two GPUs in one process: four contexts (rank x slot), each on its own CUDA
    device with store keys under ``/slot<j>``; each rank's lead (slot 0) routes slot 1's
    ordinal to slot 1's context. A slot whose setup fails names the rank and the slot, and
    the contexts already made are closed."""
    monkeypatch.setattr(_core.runtime, "NcclRankComm", _FakeNccl)
    monkeypatch.setattr(engine, "links", lambda step, r: [(1 - r, 0, r == 0)])
    _FakeNccl.made, _FakeNccl.fail_on = [], None
    leads = engine.nccl_comms(_gpu_step(), [0, 1], store=None, timeout=5.0, prefix="p")
    assert [(c.rank, c.device, c.prefix) for c in sorted(_FakeNccl.made, key=lambda c: c.device)] \
        == [(0, 0, "p/slot0"), (0, 1, "p/slot1"), (1, 2, "p/slot0"), (1, 3, "p/slot1")]
    assert [c.device for c in leads] == [0, 2]
    assert {o: m.device for o, m in leads[0].routes.items()} == {1: 1}
    assert {o: m.device for o, m in leads[1].routes.items()} == {3: 3}
    _FakeNccl.made, _FakeNccl.fail_on = [], (1, "slot1")
    with pytest.raises(baton.ConfigError, match=r"rank 1 \(device slot 1\).*never arrived"):
        engine.nccl_comms(_gpu_step(), [0, 1], store=None, timeout=5.0, prefix="p")
    assert len(_FakeNccl.made) == 3 and all(c.closed for c in _FakeNccl.made)


def test_nccl_comms_one_process_per_gpu(monkeypatch):
    """Ranks spanning processes (one process per GPU): this process (0) holds slot 0 of rank
    0 only; its one context is that slot's, with no routes (as a Gloo slot context)."""
    monkeypatch.setattr(_core.runtime, "NcclRankComm", _FakeNccl)
    monkeypatch.setattr(engine, "links", lambda step, r: [(1 - r, 0, r == 0)])
    _FakeNccl.made, _FakeNccl.fail_on = [], None
    step = _gpu_step(procs=[[0, 1], [2, 3]])
    (lead,) = engine.nccl_comms(step, [0], store=None, timeout=5.0, prefix="p")
    assert (lead.rank, lead.device, lead.prefix, lead.routes) == (0, 0, "p/slot0", {})
    assert len(_FakeNccl.made) == 1
