"""The compiled engine: runs a ``CompiledStep``'s loop as XLA programs.

* one rank: the whole step as one program (``SingleProgram``, ``single_program.py``);
* several ranks in one process: one ``RankProgram`` per rank on its devices, each launched
  from its own thread so the ranks overlap, transfers through an in-process ``LocalHub``
  from inside the programs (FFI calls);
* several processes: the ``RankProgram`` of each of this process's k ranks, one thread per
  rank, over the process group's transport (k = 1) or the rank's own Gloo context (k > 1);
  when ranks span processes, every process of a rank runs its program (one multi-controller
  SPMD program; XLA calls the transfer handlers for the process's own devices) over its
  slot's Gloo context (``ProcessGroup.loop_transports``).
* on GPUs the same programs run over NCCL (``NcclRankComm``): one context per device slot of
  a rank (slot j of every rank shares communicators with slot j of the others, as the Gloo
  slot contexts do), in one process per host or one process per GPU (``nccl_comms``); or,
  when two ranks (processes) share one GPU of a host or NCCL is unavailable, staged through
  pinned host memory over the ranks' CPU transports (a ``RankComm`` per rank with
  ``stage_on_cuda``, ``staged_comms``). The choice is C++'s ``choose_cuda_transport`` over
  every rank's host and GPU (``gpu_place``), taken once per step (``choose_transport``).

Programs are compiled before their first run (a rank never waits on another's compile).
A step the engine cannot run raises ``ConfigError`` saying why (``refusal``); there is no
fallback to the interpreter.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any, Mapping

import jax

from .. import _core
from .. import runtime as rt
from ..errors import ConfigError
from ..runtime import rendezvous
from ..emit import ffi
from ..emit.rank_program import RankProgram
from ..emit.rolling import ItemOp, rank_items
from ..emit.share_match import share_groups
from ..emit.shared import SharedProgram, SharedSegments
from ..emit.single_program import SingleProgram
from .step_run import LoopRecord
from .threads import on_rank_threads, raise_first
from .events import gather_events
from ..emit.warm import Warmup


_GPU = ("gpu", "cuda")


def refusal(step, rank: int, transport_kind: str | None = None) -> str | None:
    """Why the compiled engine cannot run ``rank`` of ``step`` over ``transport_kind``
    (default: the step's, ``step.transport``), or None."""
    kind = transport_kind or step.transport
    devs = step.mesh.rank_devices[rank]
    if step.num_ranks == 1:
        return None  # one program, no transfers
    platforms = {d.platform for d in devs}
    if len(devs) > 1 and kind == "local":
        return (f"rank {rank} has {len(devs)} devices: in one process XLA:CPU runs one "
                f"multi-device program at a time (its client serializes them), so ranks of "
                f"several devices cannot overlap their programs here; run one process per "
                f"rank (python -m baton.launch; each rank's program then runs SPMD on its "
                f"devices, transfers shard to shard), or the interpreter "
                f"(baton.jit(..., engine='interpreter')), which moves shards device to device")
    k = step.mesh.ranks_per_process or 1
    if len(devs) > 1 and k > 1 and platforms == {"cpu"}:
        return (f"rank {rank} has {len(devs)} devices and this process runs {k} ranks: "
                f"XLA:CPU runs one multi-device program at a time per process (its client "
                f"serializes them), so this process's ranks could not overlap and their "
                f"transfers would wait on each other; give each rank one device, or run one "
                f"rank per process (PipelineMesh(..., ranks=1), or mesh=None)")
    shapes = {tuple(m.shape.items()) for m in step.mesh.meshes}
    if len(shapes) > 1:
        return (f"the ranks' sub-meshes differ ({', '.join(map(str, sorted(shapes)))}): "
                f"shard-to-shard transfers need the same axes and sizes on every rank")
    if platforms == {"cpu"}:
        if kind not in ("local", "gloo"):
            return (f"rank {rank} runs on CPU, whose transfers go over the 'local' (one "
                    f"process) or 'gloo' (several) transports, not {kind!r}")
        return None
    if platforms <= set(_GPU):
        if kind != "nccl":
            return (f"rank {rank} runs on a GPU: its transfers go over NCCL "
                    f"(transport='nccl', the default on GPUs), not {kind!r}")
        if not ffi.has_cuda():
            return ("this build of baton has no CUDA transfer handlers (it was built "
                    "without the CUDA toolkit and nccl.h); rebuild on a machine that has them")
        # (several processes: only this process's ranks are its devices, k = ranks_per_process)
        local = range(rank - rank % k, rank - rank % k + k) if step.mesh.ranks_per_process \
            else range(step.num_ranks)
        for q in local:
            both = [d for d in devs if q != rank and d in step.mesh.rank_devices[q]]
            if both:
                mine = both[0]
                return (f"ranks {min(q, rank)} and {max(q, rank)} of this process share GPU "
                        f"{mine}: one process drives one program at a time on a device, so "
                        f"the ranks could not overlap and one would wait forever on the "
                        f"other's transfers; give each rank its own GPU, run the ranks as "
                        f"processes of their own (python -m baton.launch: processes that "
                        f"share a GPU have their transfers staged through host memory), or "
                        f"use one rank (a one-rank step is one program)")
        return None
    return (f"rank {rank} runs on {', '.join(sorted(platforms))}: the compiled engine's "
            f"transfers run on CPUs (local, gloo) and NVIDIA GPUs (nccl)")


def check(step, rank: int, transport_kind: str | None = None) -> None:
    why = refusal(step, rank, transport_kind)
    if why is not None:
        raise ConfigError(f"baton.jit: {why}")


def links(step, rank: int) -> list[tuple[int, int, bool]]:
    """(peer, channel, send) of every direction of a link ``rank``'s loop uses."""
    return sorted({(peer, step.buffers.channel(k, s), op == ItemOp.SEND) for op, k, s, _, peer
                   in rank_items(step, rank) if op in (ItemOp.SEND, ItemOp.POST)})


def local_slots(step, rank: int) -> list[tuple[int, Any]]:
    """(slot, device) of each of ``rank``'s devices this process holds: slot j is the rank's
    j-th device in its sub-mesh's order (device j of one rank exchanges with device j of
    another, shard to shard)."""
    me = jax.process_index()
    flat = list(step.mesh.meshes[rank].devices.flat)
    return [(j, d) for j, d in enumerate(flat) if d.process_index == me]


def nccl_comms(step, ranks, store, timeout, prefix) -> list:
    """An ``NcclRankComm`` for each rank in ``ranks`` (of this process), constructed at once
    (NCCL's setup is collective: each waits for its peers). A rank of several GPUs gets one
    context per device slot this process holds (slot j's communicators join slot j of every
    rank, store keys under ``<prefix>/slot<j>``, as the Gloo slot contexts do); the first is
    the rank's (its id is the one the program carries) and routes each other device's calls
    to its slot's context (``set_route``, by CUDA ordinal)."""
    R = step.num_ranks
    jobs = [(i, j, d) for i, r in enumerate(ranks) for j, d in local_slots(step, r)]
    made: dict[tuple[int, int], Any] = {}

    def make(n):
        i, j, dev = jobs[n]
        r = ranks[i]
        made[(i, j)] = _core.runtime.NcclRankComm(
            r, R, int(dev.local_hardware_id), store, links(step, r), float(timeout),
            f"{prefix}/slot{j}")

    errors = on_rank_threads(len(jobs), make)
    bad = [(ranks[jobs[n][0]], jobs[n][1], e) for n, e in enumerate(errors) if e is not None]
    if bad:
        for c in made.values():
            c.close()
        raise ConfigError("baton.jit: NCCL setup failed: " + "; ".join(
            f"rank {r} (device slot {j}): {type(e).__name__}: {e}" for r, j, e in bad)) \
            from bad[0][2]
    out = []
    for i, r in enumerate(ranks):
        mine = [(j, d) for n, j, d in jobs if n == i]
        lead = made[(i, mine[0][0])]
        for j, d in mine[1:]:
            lead.set_route(int(d.local_hardware_id), made[(i, j)])
        out.append(lead)
    return out


def gpu_place(dev, environ: Mapping[str, str] | None = None,
              host: str | None = None) -> tuple[str, int]:
    """(host, GPU) of a CUDA device of this process, comparable across processes: the host
    name and the GPU's index on the host. XLA's ordinal (``local_hardware_id``) counts the
    GPUs this process sees, so it is mapped through ``CUDA_VISIBLE_DEVICES`` (a process of
    ``baton.launch`` sees its one GPU as ordinal 0). A GPU named by UUID or MIG id there is
    told apart by that name, appended to the host (its index is then 0)."""
    environ = os.environ if environ is None else environ
    host = socket.gethostname() if host is None else host
    ordinal = int(dev.local_hardware_id)
    if ordinal < 0:
        raise ConfigError(f"baton.jit: device {dev} has no local hardware id ({ordinal}): "
                          f"its GPU cannot be told")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return host, ordinal
    names = [g.strip() for g in visible.split(",") if g.strip()]
    if ordinal >= len(names):
        raise ConfigError(f"baton.jit: device {dev} has CUDA ordinal {ordinal}, but "
                          f"CUDA_VISIBLE_DEVICES={visible!r} names {len(names)} GPU(s)")
    name = names[ordinal]
    return (host, int(name)) if name.isdigit() else (f"{host}/{name}", 0)


def gpu_places(step, ranks) -> dict[tuple[int, int], tuple[str, int]]:
    """(rank, slot) -> ``gpu_place`` of each GPU slot this process holds of ``ranks``."""
    return {(r, j): gpu_place(d) for r in ranks for j, d in local_slots(step, r)
            if d.platform in _GPU}


def nccl_error() -> str:
    """Why NCCL cannot be used in this process ('' when it can): loading it failed."""
    return _core.runtime.nccl_library()[3]


def choose_transport(places: Mapping[tuple[int, int], tuple[str, int]],
                     nccl_err: str = "") -> tuple[str, str]:
    """``("nccl", "")`` or ``("staged", the log line saying why)`` for a step whose ranks
    0..R-1 have their device slots on ``places[(rank, slot)]`` = (host, GPU), decided by
    ``_core.runtime.choose_cuda_transport`` for each slot j over the ranks (slot j's NCCL
    communicators join slot j of every rank); ``nccl_err``: why NCCL is unavailable ('' when
    it is available). Host staging runs ranks of one GPU: ranks of several that need it are
    refused (``ConfigError``)."""
    ranks = sorted({r for r, _ in places})
    slots = sorted({j for _, j in places})
    if not places or ranks != list(range(len(ranks))):
        raise ConfigError(f"baton.jit: the GPUs of ranks {ranks} were gathered: expected "
                          f"every rank from 0")
    rt = _core.runtime
    for j in slots:
        missing = [r for r in ranks if (r, j) not in places]
        if missing:
            raise ConfigError(f"baton.jit: no process reported device slot {j} of ranks "
                              f"{missing}")
        kind, why = rt.choose_cuda_transport([places[(r, j)][0] for r in ranks],
                                             [places[(r, j)][1] for r in ranks],
                                             not nccl_err, nccl_err)
        if kind == rt.CudaTransport.HOST_STAGED:
            if len(slots) > 1:
                raise ConfigError(
                    f"baton.jit: the ranks have {len(slots)} GPUs each and cannot use NCCL "
                    f"(device slot {j}: {why.removeprefix('baton: ')}); host staging runs "
                    f"ranks of one GPU: give each rank GPUs of its own with NCCL, or one GPU "
                    f"per rank")
            return "staged", why
    return "nccl", ""


def log_choice(why: str) -> None:
    """The one line saying why a step's transfers are staged (``$BATON_QUIET`` silences)."""
    if why and not os.environ.get("BATON_QUIET"):
        print(why, file=sys.stderr, flush=True)


def staged_comms(step, ranks, timeout) -> list:
    """A CPU ``RankComm`` per rank in ``ranks`` (of this process; the caller attaches its
    transport), staging its transfers through pinned host memory on the rank's one GPU
    (``stage_on_cuda``, by its CUDA ordinal)."""
    out = []
    for r in ranks:
        slots = local_slots(step, r)
        if len(slots) != 1:
            raise ConfigError(f"baton.jit: rank {r} holds {len(slots)} GPUs in this process: "
                              f"host staging runs ranks of one GPU")
        c = _core.runtime.RankComm(r, float(timeout))
        c.stage_on_cuda(int(slots[0][1].local_hardware_id))
        out.append(c)
    return out


def agree_places(router, step, ranks) -> tuple[dict[tuple[int, int], tuple[str, int]], str]:
    """Every process's ``gpu_places`` of its ``ranks`` and why NCCL is unavailable there,
    exchanged (``router.allgather``: every process calls it): the places of every rank's
    slots and the processes' NCCL errors ('' when every process has NCCL), the same in every
    process. A process that could not tell its GPUs makes every process raise."""
    try:
        mine = {"places": [[r, j, h, g] for (r, j), (h, g) in gpu_places(step, ranks).items()],
                "nccl": nccl_error()}
    except Exception as e:  # noqa: BLE001  (every process raises, below)
        mine = {"error": f"{type(e).__name__}: {e}"}
    blobs = [json.loads(b) for b in router.allgather(json.dumps(mine))]
    bad = [f"process {p}: {b['error']}" for p, b in enumerate(blobs) if "error" in b]
    if bad:
        raise ConfigError("baton.jit: telling the ranks' GPUs apart failed: " + "; ".join(bad))
    places = {(r, j): (h, g) for b in blobs for r, j, h, g in b["places"]}
    errs = [f"process {p}: {b['nccl']}" for p, b in enumerate(blobs) if b["nccl"]]
    return places, "; ".join(errs)


class ProgramEngine:
    """The compiled programs of one ``CompiledStep`` (built on first use, kept)."""

    def __init__(self, step, share: bool = True):
        """``share``: ranks of this process doing the same work run one shared program
        (``baton.jit(share_programs=...)``)."""
        self.step = step
        self.single = None  # SingleProgram (one rank)
        self.single_traced = None  # ... with task markers (traced one-rank steps)
        self.local_progs = None  # one process, several ranks: RankProgram per rank
        # ... and the programs that run them: a SharedProgram for the largest group of
        # ranks that can share one (shared.py; ``share``), the others' own
        self.local_units = None
        self.share = bool(share)
        self._local_hub = None  # their in-process transports
        self.rank_progs = None  # several processes: this process's ranks' RankPrograms
        self.warmup = None  # several processes: the code after the loop, compiling (warm.py)
        self._nccl_builds = 0
        self.transfers = None  # on GPUs: "nccl" or "staged" (choose_transport), once chosen

    # -- one rank -----------------------------------------------------------------------
    def run_single(self, flat_args, opts) -> tuple[list[Any], LoopRecord]:
        """The one-rank step as one program: its flat outputs and ``LoopRecord``; traced
        (``opts.record``): the same program with its task markers (``SingleProgram``'s
        docstring), built once and kept."""
        step = self.step
        if not opts.record:
            if self.single is None:
                self.single = SingleProgram(step)
            prog = self.single
        else:
            if self.single_traced is None:
                self.single_traced = SingleProgram(step, _core.runtime.RankComm(0, 120.0))
            prog = self.single_traced
            prog.comm.record(True)
        outs = prog(flat_args, opts.live)
        events = offsets = None
        if opts.record:  # (its markers have all run once its outputs exist)
            jax.block_until_ready(outs)
            prog.comm.record(False)
            events, offsets = [prog.events()], [0]
        # no interpreter ran: no measured live-buffer peaks
        return outs, LoopRecord(events, offsets, {"single_program": prog.describe()})

    # -- one process, several ranks -------------------------------------------------------
    def _local_programs(self, vals, timeout):
        """This step's rank programs over an in-process hub (built on the first call, and
        again after a failed step: a failed hub stays failed)."""
        step = self.step
        R = step.num_ranks
        if self.local_progs is None:
            for r in range(R):
                check(step, r)
            if step.transport == "nccl":
                if self.transfers is None:
                    self.transfers, why = choose_transport(gpu_places(step, range(R)),
                                                           nccl_error())
                    log_choice(why)
            if self.transfers == "staged":
                comms = staged_comms(step, list(range(R)), timeout)
            elif step.transport == "nccl":
                import tempfile

                self._nccl_builds += 1
                comms = nccl_comms(step, list(range(R)), rt.file_store(tempfile.mkdtemp(
                    prefix="baton-nccl-")), timeout, f"baton/local{self._nccl_builds}")
            else:
                comms = [_core.runtime.RankComm(r, float(timeout)) for r in range(R)]
            progs = [RankProgram(step, r, comms[r], timeout) for r in range(R)]
            units = progs
            if self.share and step.transport != "nccl":
                units = [g[0].prog if len(g) == 1 else SharedProgram(g)
                         for g in share_groups(progs)]
            raise_first(compile_all(units, vals))
            self.local_progs = progs
            self.local_units = units
            self._local_hub = None
        progs = self.local_progs
        if self._local_hub is None and not self._nccl():
            hub = _core.runtime.LocalHub(R)
            self._local_hub = [hub.transport(r) for r in range(R)]
            for p, t in zip(progs, self._local_hub):
                p.comm.attach(t)
        for p in progs:
            p.set_timeout(timeout)
        return progs

    def _nccl(self) -> bool:
        """The step's transfers run over NCCL contexts (not over CPU transports, staged or
        not)."""
        return self.step.transport == "nccl" and self.transfers != "staged"

    def join_warmup(self) -> None:
        """Waits for the code after the loop to finish compiling (the first call only)."""
        if self.warmup is not None:
            self.warmup.join()
            self.warmup = None

    def post_groups(self):
        """The code after the loop of this process's shared ranks (``shared.SharedSegments``;
        built once), or None when no ranks share a program."""
        sp = next((u for u in self.local_units or () if isinstance(u, SharedProgram)), None)
        if sp is None:
            return None
        if sp.post is None:
            sp.post = SharedSegments(sp, self.step.post_segments)
        return sp.post

    def _launch(self, progs, vals, opts) -> tuple[dict[int, Any], list]:
        """Runs ``progs`` (one thread per program; inline for one), recording when ``opts``
        asks; returns their loop output parts and each one's exception (or None). With
        ``opts.live``, the live arrays are sampled as the programs start, their arguments
        placed, each device's program's own allocation added (``LivePeak.sample_programs``)."""
        for p in progs:
            for c in p.comms:
                c.record(opts.record)
        if opts.live is not None:
            held = [p._args(vals) for p in progs]
            opts.live.sample_programs([([q.rank for q in getattr(p, "progs", [p])], p.compiled)
                                       for p in progs])
            del held
        finals: list[dict] = [{} for _ in progs]

        def go(j):
            finals[j] = progs[j](vals)

        errors = on_rank_threads(len(progs), go, inline=True)
        final: dict[int, Any] = {}
        for f in finals:
            final.update(f)
        return final, errors

    def run_local(self, vals, timeout, opts) -> tuple[dict[int, Any], LoopRecord]:
        """Every rank's loop as its own program, launched from one thread per rank; returns
        every loop output part and the ``LoopRecord``."""
        step = self.step
        progs = self._local_programs(vals, timeout)
        R = step.num_ranks
        units = self.local_units
        final, errors = self._launch(units, vals, opts)
        if any(e is not None for e in errors):
            if self._nccl():  # a failed NCCL context stays failed: built anew
                for p in progs:
                    p.comm.close()
                self.local_progs = None
            else:
                for p in progs:
                    p.comm.detach()
                for t in self._local_hub or ():
                    t.close()
                self._local_hub = None
            raise_origin(units, errors)
        events = [p.events() for p in progs] if opts.record else None
        return final, LoopRecord(events, [0] * R if opts.record else None,
                                 {"rank_program": [p.describe() for p in progs]})

    # -- several processes ---------------------------------------------------------------
    def run_rank(self, group, router, vals, timeout, opts) -> tuple[dict[int, Any], LoopRecord]:
        """The loops of this process's ranks, each its program over its transport, one
        thread per rank; returns their loop output parts and the ``LoopRecord`` (events
        gathered from every process when recording). A program that cannot be built or
        compiled raises ``ConfigError``; the processes first exchange whether they could, so
        every process raises instead of waiting on the others."""
        step = self.step
        k = len(step.mesh.ranks_of(group.rank))
        ts = group.loop_transports(step.mesh, timeout)
        progs = self.rank_progs
        if (progs is None or progs[0].transport is not ts[0]
                or not all(p.comm.attached for p in progs)):  # (a failed NCCL context stays failed)
            progs = self._build_rank(group, router, vals, timeout, ts)
        for p in progs:
            p.set_timeout(timeout)
        final, errors = self._launch(progs, vals, opts)
        raise_origin(progs, errors)
        one = k == 1  # (one rank per process: its describe() alone, as before)
        stats = {"rank_program": progs[0].describe() if one
                 else [p.describe() for p in progs]}
        events = offsets = None
        if opts.record:
            events, offsets = gather_events(group, [p.events() for p in progs], timeout,
                                            step.mesh)
        return final, LoopRecord(events, offsets, stats)

    def _build_rank(self, group, router, vals, timeout, ts):
        step = self.step
        ranks = step.mesh.ranks_of(group.rank)
        whys = {r: refusal(step, r) for r in ranks}
        if step.transport == "nccl" and self.transfers is None:
            # every process calls both and gets the same answer (the same places), so every
            # process holds the same choice, or the same error
            places, err = agree_places(router, step, ranks)
            if places:  # (none: no GPU; refused by name above)
                try:
                    self.transfers, why = choose_transport(places, err)
                    if group.rank == 0:
                        log_choice(why)
                except ConfigError as e:  # (raised below, in every process)
                    whys[ranks[0]] = str(e).removeprefix("baton.jit: ")
        progs = []
        if not any(whys.values()):
            r = ranks[0]
            try:
                if self.transfers == "staged":  # a CPU transport per rank, staged on its GPU
                    comms = staged_comms(step, ranks, timeout)
                    for c, t in zip(comms, ts):
                        c.attach(t)
                elif step.transport == "nccl":  # the loop over NCCL, the rest over the group
                    self._nccl_builds += 1
                    comms = nccl_comms(step, ranks, rendezvous.make_store(
                        rendezvous.rank_info().store), timeout,
                        f"baton/{step.core_plan.fingerprint()}/{self._nccl_builds}")
                else:
                    comms = [_core.runtime.RankComm(r, float(timeout)) for r in ranks]
                    for c, t in zip(comms, ts):
                        c.attach(t)
                for r, c, t in zip(ranks, comms, ts):
                    progs.append(RankProgram(step, r, c, timeout))
                    progs[-1].transport = t
                serial = _cores() < 2  # (one core: no overlap to gain, warm.py)
                self.warmup = Warmup(step, step.post_segments, ranks, background=not serial)
                errors = compile_all(progs, vals)
                if serial:
                    self.warmup.run()
                whys.update({r: f"{type(e).__name__}: {e}" for r, e in zip(ranks, errors) if e})
            except Exception as e:  # noqa: BLE001  (raised below, in every process)
                whys[r] = f"{type(e).__name__}: {e}"
            whys = {q: w and f"building its program failed: {w}" for q, w in whys.items()}
        mine = "; ".join(f"rank {q}: {w}" for q, w in whys.items() if w)
        bad = [b for b in router.allgather(mine.replace("\n", " ")) if b]
        if bad:
            self.rank_progs = None
            raise ConfigError("baton.jit: the compiled engine cannot run this step: "
                              + "; ".join(bad))
        self.rank_progs = progs
        return progs


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity on this platform)
        return os.cpu_count() or 1


def compile_all(progs, vals) -> list:
    """Compiles every program before any runs (a rank never waits on a compile): traced one
    by one (Python, holding the GIL), each compiled on its own thread as soon as it is
    lowered (XLA releases the GIL), so the next program's tracing overlaps the compiles
    already started; each one's exception."""
    import threading

    errors: list = [None] * len(progs)

    def comp(j, lowered):
        try:
            progs[j].compiled = lowered.compile()
        except BaseException as e:  # noqa: BLE001  (the caller raises)
            errors[j] = e

    threads = []
    try:
        for j, p in enumerate(progs):
            t = threading.Thread(target=comp, args=(j, p.lower(vals)),
                                 name=f"baton-compile-{p.rank}", daemon=True)
            t.start()
            threads.append(t)
    finally:  # (a program that fails to lower raises here, once the started ones are done)
        for t in threads:
            t.join()
    return errors


def raise_origin(progs, errors) -> None:
    """Raises the error of the program whose rank the failure started on (its
    ``failed_rank``), else the first one; nothing when every program ran."""
    errs = [(p.rank, e) for p, e in zip(progs, errors) if e is not None]
    task = [e for _, e in errs if getattr(e, "task_error", False)]
    if task:  # (a shared program's task error: the others' errors are its consequences)
        raise task[0]
    if errs:
        origins = {getattr(e, "failed_rank", r) for r, e in errs}
        raise next((e for r, e in errs if r in origins), errs[0][1])
