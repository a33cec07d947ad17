"""What the GPU path decides on the host, tested on CPU: the loop form per platform (GPU ranks
lowered rolled, without a ``lax.switch`` per unit; forced on CPU it gives the table's
results), the transfer counts a CUDA context reserves staging for, the engine no longer
refusing GPU ranks of several devices, the NCCL library rules as bound, and the choice between
NCCL and host staging with the transfer contexts each builds."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

from types import SimpleNamespace  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import baton  # noqa: E402
from baton import _core  # noqa: E402
from baton.emit import ffi  # noqa: E402
from baton.running import engine  # noqa: E402
from baton.emit.rank_program import RankProgram, loop_form  # noqa: E402
from baton.emit.rolling import rank_items  # noqa: E402


def _fake_step(platform, ranks=2, per_rank=2, transport="nccl"):
    devs = [[SimpleNamespace(platform=platform, id=r * per_rank + j, process_index=0)
             for j in range(per_rank)] for r in range(ranks)]
    meshes = [SimpleNamespace(shape={"tensor": per_rank}) for _ in range(ranks)]
    mesh = SimpleNamespace(rank_devices=devs, meshes=meshes, ranks_per_process=None)
    return SimpleNamespace(mesh=mesh, num_ranks=ranks, transport=transport, loop_form="auto",
                           offload=[])


def test_loop_form_is_chosen_per_platform_and_can_be_forced():
    assert loop_form(_fake_step("cpu"), 0) == "table"
    assert loop_form(_fake_step("gpu"), 1) == "rolled"
    assert loop_form(_fake_step("cuda"), 0) == "rolled"
    cs = _fake_step("gpu")
    cs.loop_form = "table"
    assert loop_form(cs, 0) == "table"
    cs = _fake_step("cpu")
    cs.loop_form = "rolled"
    assert loop_form(cs, 0) == "rolled"
    cs.loop_form = "straight"
    with pytest.raises(baton.ConfigError, match="loop_form must be one of .*'straight'"):
        loop_form(cs, 0)


@pytest.mark.parametrize("name", ["1f1b", "zbh1"])
def test_rolled_form_equals_the_table(name):
    """Two ranks in one process on the compiled engine: the rolled form (what GPU ranks
    get: no conditional per unit) gives the table's results exactly, and both equal plain
    JAX."""
    from mlp_step import make

    sched = baton.schedule_from_name(name)
    outs = {}
    for form in ("table", "rolled"):
        ps, params, batch = make(sched, 2, 4, loop_form=form)
        outs[form] = jax.block_until_ready(ps(params, batch))
        cs = ps.compile(params, batch)
        assert cs.loop_form == form
        # what ran: each rank's program as described by the engine (a table, or the rolled
        # straight-line runs: scans and single items, no table)
        ran = ps.last_run.stats["rank_program"]
        assert len(ran) == 2 and all(d.startswith("table") == (form == "table") for d in ran)
        prog = RankProgram(cs, 0, _core.runtime.RankComm(0), 10.0)
        assert prog.form == form and prog.table == (form == "table")
    for a, b in zip(jax.tree.leaves(outs["table"]), jax.tree.leaves(outs["rolled"]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    import mlp

    loss, grads = jax.value_and_grad(mlp.make_loss())(params, batch)
    want = jax.tree.leaves((loss, grads))
    for a, b in zip(jax.tree.leaves(outs["rolled"]), want, strict=True):
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


def test_in_flight_of_a_rank_is_what_the_rank_ir_says():
    """NcclRankComm.reserve's intervals: one per send and posted receive of the step, from
    its POST to its WAIT / FREE; at most what is in flight at once is reserved, not the
    step's transfers (1F1B, 2 stages, 4 microbatches: a send and two receives at once)."""
    from mlp_step import make

    ps, params, batch = make(baton.OneFOneB(), 2, 4)
    cs = ps.compile(params, batch)
    for r in range(2):
        prog = cs.rank_ir().programs[r]
        fl = ffi.in_flight(prog)
        items = rank_items(cs, r)
        assert len(fl) == sum(op in (_core.ItemOp.SEND, _core.ItemOp.POST) for op, *_ in items)
        for _, _, send, f, t in fl:
            assert 0 <= f <= t < len(prog.instrs)
            assert prog.instrs[f].op == _core.RankOp.POST
            assert prog.instrs[t].op == (_core.RankOp.FREE if send else _core.RankOp.WAIT)
        assert sum(send for _, _, send, _, _ in fl) == 4
        assert ffi.most_in_flight(fl, lambda c, s: 1000) == (1000, 2000)
    # intervals that touch overlap, -1 runs to the end; sizes are pooled apart
    one = lambda c, s: 10 if c == 0 else 7  # noqa: E731
    assert ffi.most_in_flight([(0, 0, False, 0, 4), (0, 0, False, 4, 6)], one) == (0, 20)
    assert ffi.most_in_flight([(0, 0, False, 0, 4), (0, 0, False, 5, 6)], one) == (0, 10)
    assert ffi.most_in_flight([(0, 0, True, 0, -1), (0, 0, True, 5, 6),
                               (1, 0, True, 0, 1)], one) == (27, 0)


def test_gpu_ranks_of_several_devices_are_not_refused(monkeypatch):
    """The refusal "the NCCL context is one device per rank" is gone: a GPU rank of two
    devices over NCCL is accepted (when the CUDA handlers are built); two ranks of one process
    that share a GPU are still refused by name (processes that share one are staged)."""
    monkeypatch.setattr(ffi, "has_cuda", lambda: True)
    step = _fake_step("gpu")
    assert engine.refusal(step, 0) is None and engine.refusal(step, 1) is None
    shared = _fake_step("gpu")
    shared.mesh.rank_devices[1][1] = shared.mesh.rank_devices[0][1]
    why = engine.refusal(shared, 0)
    assert why is not None and "of this process share GPU" in why and "baton.launch" in why
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


# ---- NCCL or host staging: the choice per step and the comms it builds -----------------

def test_choose_transport_over_the_ranks_hosts_and_gpus():
    """The decision is C++'s ``choose_cuda_transport`` per device slot over the ranks: NCCL
    unless two ranks share a GPU of one host or NCCL is unavailable; host staging then, with
    the line saying why; ranks of several GPUs that would need staging are refused."""
    pick = engine.choose_transport
    assert pick({(0, 0): ("h", 0), (1, 0): ("h", 1)}) == ("nccl", "")
    assert pick({(0, 0): ("a", 0), (1, 0): ("b", 0)}) == ("nccl", "")  # same id, two hosts
    how, why = pick({(0, 0): ("h", 0), (1, 0): ("h", 1), (2, 0): ("h", 0)})
    assert how == "staged" and "ranks 0 and 2 share GPU 0 on h" in why
    how, why = pick({(0, 0): ("h", 0), (1, 0): ("h", 1)}, "process 1: libnccl.so.2 not found")
    assert how == "staged" and "NCCL unavailable (process 1: libnccl.so.2 not found)" in why
    two = {(0, 0): ("h", 0), (0, 1): ("h", 1), (1, 0): ("h", 2), (1, 1): ("h", 3)}
    assert pick(two) == ("nccl", "")
    two[(1, 1)] = ("h", 1)  # slot 1 of both ranks on GPU 1
    with pytest.raises(baton.ConfigError, match=r"device slot 1: ranks 0 and 1 share GPU 1"):
        pick(two)
    with pytest.raises(baton.ConfigError, match=r"no process reported device slot 1 of ranks"):
        pick({(0, 0): ("h", 0), (0, 1): ("h", 1), (1, 0): ("h", 2)})
    with pytest.raises(baton.ConfigError, match=r"ranks \[0, 2\] were gathered"):
        pick({(0, 0): ("h", 0), (2, 0): ("h", 1)})
    with pytest.raises(ValueError, match="1 hosts for 2 ranks"):
        _core.runtime.choose_cuda_transport(["h"], [0, 1], True)


def test_gpu_place_maps_the_ordinal_through_cuda_visible_devices():
    """Each process of ``baton.launch`` sees its GPU as ordinal 0: the place is the host and
    the GPU the launcher pinned, so processes pinned to one GPU agree and others differ."""
    from baton import launch

    dev = SimpleNamespace(local_hardware_id=0)
    assert engine.gpu_place(dev, {}, "h") == ("h", 0)
    assert engine.gpu_place(dev, {"CUDA_VISIBLE_DEVICES": "3"}, "h") == ("h", 3)
    assert engine.gpu_place(SimpleNamespace(local_hardware_id=1),
                            {"CUDA_VISIBLE_DEVICES": "2, 5"}, "h") == ("h", 5)
    assert engine.gpu_place(dev, {"CUDA_VISIBLE_DEVICES": "GPU-9f3a"}, "h") == ("h/GPU-9f3a", 0)
    with pytest.raises(baton.ConfigError, match=r"ordinal 2, but CUDA_VISIBLE_DEVICES='0,1'"):
        engine.gpu_place(SimpleNamespace(local_hardware_id=2), {"CUDA_VISIBLE_DEVICES": "0,1"},
                         "h")
    # three processes on two GPUs: processes 0 and 2 share GPU 0
    places = {(r, 0): engine.gpu_place(dev, {"CUDA_VISIBLE_DEVICES": launch.pinned_gpu(
        r, ["0", "1"])}, "h") for r in range(3)}
    assert places == {(0, 0): ("h", 0), (1, 0): ("h", 1), (2, 0): ("h", 0)}
    how, why = engine.choose_transport(places)
    assert how == "staged" and "ranks 0 and 2 share GPU 0 on h" in why
    assert engine.choose_transport({k: places[k] for k in [(0, 0), (1, 0)]}) == ("nccl", "")


class _FakeRankComm:
    """Stands in for ``RankComm`` (no GPU here): records attach and ``stage_on_cuda``."""

    made: list = []

    def __init__(self, rank, timeout=60.0):
        self.rank, self.staged_on, self.transport = rank, None, None
        _FakeRankComm.made.append(self)

    def stage_on_cuda(self, ordinal):
        self.staged_on = ordinal

    def attach(self, t):
        self.transport = t

    @property
    def attached(self):
        return self.transport is not None

    def detach(self):
        self.transport = None


class _FakeProgram:
    def __init__(self, step, rank, comm, timeout):
        self.rank, self.comm, self.compiled = rank, comm, None

    def set_timeout(self, t):
        pass


class _Router:
    """The other process's answers to ``allgather`` (this process is 0)."""

    def __init__(self, *peer_blobs):
        self.peer = list(peer_blobs)
        self.sent: list = []

    def allgather(self, blob):
        self.sent.append(blob)
        return [blob, self.peer.pop(0)]


def _wire(monkeypatch, visible="0"):
    monkeypatch.setattr(ffi, "has_cuda", lambda: True)
    monkeypatch.setattr(engine, "nccl_error", lambda: "")
    monkeypatch.setattr(_core.runtime, "RankComm", _FakeRankComm)
    monkeypatch.setattr(engine, "RankProgram", _FakeProgram)
    monkeypatch.setattr(engine, "compile_all", lambda progs, vals: [None] * len(progs))
    monkeypatch.setattr(engine, "Warmup", lambda *a, **k: SimpleNamespace(run=lambda: None))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.delenv("BATON_QUIET", raising=False)
    _FakeRankComm.made = []


def _two_process_step():
    """Process 0's view of a two-process step of one GPU per rank (its own GPU, ordinal 0)."""
    step = _gpu_step(ranks=2, per_rank=1)
    step.mesh.ranks_per_process = 1
    step.mesh.ranks_of = lambda p: [p]
    step.post_segments = []
    step.core_plan = SimpleNamespace(fingerprint=lambda: "fp")
    return step


def _peer(rank=1, gpu=0, nccl=""):
    import json
    import socket

    return json.dumps({"places": [[rank, 0, socket.gethostname(), gpu]], "nccl": nccl})


def test_two_processes_on_one_gpu_get_host_staged_comms(monkeypatch, capfd):
    """Process 0 of two that ``baton.launch`` pinned to the same GPU: the processes exchange
    their GPUs; the engine builds a CPU RankComm staged on its GPU's ordinal, attached to the
    process's Gloo loop transport, and logs one line saying why."""
    import socket

    _wire(monkeypatch)
    nccl_made = []
    monkeypatch.setattr(engine, "nccl_comms", lambda *a, **k: nccl_made.append(a))
    eng = engine.ProgramEngine(_two_process_step())
    gloo = object()
    router = _Router(_peer(gpu=0), "")
    progs = eng._build_rank(SimpleNamespace(rank=0), router, {}, 5.0, [gloo])
    assert eng.transfers == "staged" and not nccl_made
    (c,) = _FakeRankComm.made
    assert (c.rank, c.staged_on, c.transport) == (0, 0, gloo)
    assert [p.comm for p in progs] == [c]
    err = capfd.readouterr().err
    assert f"ranks 0 and 1 share GPU 0 on {socket.gethostname()}" in err
    assert err.count("staged through pinned host memory") == 1
    assert '"places": [[0, 0, ' in router.sent[0]  # what process 0 told the other


def test_processes_on_their_own_gpus_get_nccl(monkeypatch):
    _wire(monkeypatch, visible="0")
    nccl_made = []
    monkeypatch.setattr(engine, "nccl_comms", lambda step, ranks, *a: nccl_made.append(ranks)
                        or [_FakeRankComm(r) for r in ranks])
    monkeypatch.setattr(engine.rendezvous, "rank_info", lambda: SimpleNamespace(store="x"))
    monkeypatch.setattr(engine.rendezvous, "make_store", lambda s: None)
    eng = engine.ProgramEngine(_two_process_step())
    eng._build_rank(SimpleNamespace(rank=0), _Router(_peer(gpu=1), ""), {}, 5.0, [object()])
    assert eng.transfers == "nccl" and nccl_made == [[0]]
    assert all(c.staged_on is None for c in _FakeRankComm.made)


def test_nccl_missing_in_another_process_stages_and_a_bad_peer_is_named(monkeypatch, capfd):
    _wire(monkeypatch)
    eng = engine.ProgramEngine(_two_process_step())
    eng._build_rank(SimpleNamespace(rank=0),
                    _Router(_peer(gpu=1, nccl="libnccl.so.2: cannot open"), ""), {}, 5.0,
                    [object()])
    assert eng.transfers == "staged" and _FakeRankComm.made[0].staged_on == 0
    assert "NCCL unavailable (process 1: libnccl.so.2: cannot open)" in capfd.readouterr().err
    import json

    eng = engine.ProgramEngine(_two_process_step())
    bad = json.dumps({"error": "ConfigError: no local hardware id"})
    with pytest.raises(baton.ConfigError, match=r"GPUs apart failed: process 1: ConfigError"):
        eng._build_rank(SimpleNamespace(rank=0), _Router(bad, ""), {}, 5.0, [object()])


def test_ranks_in_one_process_without_nccl_are_staged_over_the_hub(monkeypatch, capfd):
    """One process, two ranks on two GPUs, NCCL unavailable: each rank gets a staged
    RankComm on its own GPU, attached to the in-process hub."""
    _wire(monkeypatch, visible="")
    monkeypatch.setattr(engine, "nccl_error", lambda: "libnccl.so.2 not found")
    step = _gpu_step(ranks=2, per_rank=1)
    step.offload = []
    eng = engine.ProgramEngine(step)
    progs = eng._local_programs({}, 5.0)
    assert eng.transfers == "staged"
    assert [(p.comm.rank, p.comm.staged_on) for p in progs] == [(0, 0), (1, 1)]
    assert all(p.comm.attached for p in progs)  # the hub's transports
    assert "NCCL unavailable (libnccl.so.2 not found)" in capfd.readouterr().err
