"""One rank of a multi-rank step as one XLA program (``RankProgram``; one process per rank,
or several ranks in one process, each program on its rank's device).

The rank's instruction stream becomes one jitted program of its microbatch loop: its tasks in
the stream's order, and each stretch of transfers between two tasks one XLA FFI custom call
(``baton_comm``, ``ffi.py``, built by ``rank_transfers.py``) that posts sends and receives on
the transport and waits for receives where the next task needs them, from XLA's thread with
no Python. A scalar token threads every FFI call in stream order (each reads and writes it);
sends read the arrays they send, waits produce the arrays tasks read, and each task's end
marker (``baton_mark``) reads its outputs, so the transfers happen in the stream's order and
no earlier than their data (the argument is in ``docs/ARCHITECTURE.md``). Transfers match by
order per (peer, channel), the verifier's FIFO model; the tags need no buffer id.

The loop is lowered as a table (``rank_table.py``: every task compiled once per rank) or
rolled (the items rolled into scans, ``_core.roll_rank`` and ``loop_program.py``);
``loop_form`` chooses.

Traced rank programs record their markers and transfers (a runtime switch of the same
executable; ``RankProgram.events``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .. import _core
from ..errors import ConfigError, ExecutionError
from . import ffi
from .loop_program import _LoopProgram
from .rank_table import build_table, describe_table, lower_table, unit_sequence
from .rank_transfers import RankTransfers, recorded_events
from .rings import ring_layout
from .rolling import ItemOp, rank_items
from .task_env import _Env, _Token

_MAX_ITEMS_PER_STAGE = 16  # a rank's pattern (rolled lowering): its tasks and transfers


# how a rank's loop may be lowered: chosen per platform, or forced
LOOP_FORMS = ("auto", "table", "rolled")


def check_loop_form(form: Any) -> str:
    """``form`` if it names a loop form (``LOOP_FORMS``), else ``ConfigError`` naming it."""
    if not isinstance(form, str) or form not in LOOP_FORMS:
        raise ConfigError(f"baton.jit: loop_form must be one of "
                          f"{', '.join(map(repr, LOOP_FORMS))} (got {form!r})")
    return form


def loop_form(cs, rank: int) -> str:
    """How a rank's loop is lowered: ``"table"`` (one ``fori_loop`` over the rank's table,
    each unit a two-branch ``lax.switch``: every task compiled once) or ``"rolled"`` (the
    items in stream order, repeating runs rolled into ``lax.scan``, no conditionals).
    ``cs.loop_form`` (``baton.jit(loop_form=...)``) forces one; ``"auto"`` chooses per
    platform: GPU ranks are rolled, since XLA's GPU conditional thunk copies the branch
    index to the host and waits for it before every branch, so a table would run host and
    GPU in lockstep, one unit at a time, and receives could not be posted ahead of the
    compute they overlap; other ranks get the table. An offloading step is rolled."""
    forced = check_loop_form(cs.loop_form)
    if cs.offload and any(o == _core.Offload.STASH for o in cs.offload):
        # the table's rings hold device buffers only: an offloading rank is rolled
        if forced == "table":
            raise ConfigError(f"rank {rank}: the table loop form does not offload; offload "
                              f"lowers the loop rolled (loop_form='rolled' or 'auto')")
        return "rolled"
    if forced != "auto":
        return forced
    platforms = {d.platform for d in cs.mesh.rank_devices[rank]}
    return "rolled" if platforms & {"gpu", "cuda"} else "table"


class RankProgram(_LoopProgram):
    """One rank of a multi-rank ``CompiledStep``: its microbatch loop as one jitted program
    whose transfers are XLA FFI custom calls into the C++ transports (``baton_comm``, see
    ``cpp/python/ffi_handlers.cc``; the module docstring says how they are ordered). Called
    with the loop's outer values (``CompiledStep._loop_needs``), it returns this rank's loop
    outputs (part index -> value) once every transfer is done. ``comm`` is the rank's
    ``baton._core.runtime.RankComm``, attached to its transport by the caller."""

    marks = True
    share = None  # the SharedProgram that runs this rank's table with others' (shared.py)
    shared_in = None  # while it traces: this device's (rows, slots) inputs

    def __init__(self, cs, rank, comm, timeout):
        ffi.register()
        self.comm = comm
        self.timeout = float(timeout)
        comm.set_timeout(self.timeout)
        # A rank of several devices runs SPMD: each transfer is called per device (shard_map
        # over the rank's sub-mesh) on its local shard, and device i of one rank exchanges
        # with device i of the other (the same block of the same spec: shard to shard).
        self.sub = cs.mesh.meshes[rank]
        self.D = int(self.sub.devices.size)
        self.transfers = RankTransfers(cs, comm, self.sub, rank)
        # One device: the table (each task compiled once), but on GPUs (loop_form). Several:
        # the items rolled into scans, since JAX's Shardy partitioner does not apply the
        # model's sharding constraints inside a conditional's branches as it does in
        # straight-line code (the MoE GPT's dispatch became all-gathers instead of
        # all-to-alls; docs/ARCHITECTURE.md)
        self.form = loop_form(cs, rank)
        self.table = self.D == 1 and self.form == "table"
        if self.table:
            self.cs, self.rank, self.items = cs, rank, rank_items(cs, rank)
            self._table_init()
        else:  # no stacked buffers between loops: runs that would need them stay unrolled
            super().__init__(cs, rank, _MAX_ITEMS_PER_STAGE * max(1, cs.num_stages),
                             stacked=False)
        self.needs = [o for o in cs.loop_needs[rank] if o not in cs.traced.literals]
        self.mine = [i for i, p in enumerate(cs.parts) if cs.stage_rank[p.stage] == rank]
        # (peer, channel, send) -> buffer ids of one step, in order (events)
        self._order = self.transfers.configure(self.items)
        self.fn = jax.jit(self._program)
        self.compiled = None  # the executable (compile)

    # -- the table (rank_table.py) ---------------------------------------------------------
    def _table_init(self):
        """The rank's loop as a table (``build_table``, lowered by ``_loop``): its steps,
        units and rows; a ring per ringed kind until the lowering knows the avals and pools
        the kinds of equal shape (``_pool``)."""
        t = build_table(self.items)
        self.steps, self.stretches, self.units, self.rows = t.steps, t.stretches, t.units, t.rows
        self._pool(None)

    def _pool(self, pool_of):
        """The rank program's rings with ``pool_of`` (``(kind, stage)`` -> pool; kinds of one
        pool share a ring; None: a ring per kind): ``self.lives`` (the ringed kinds),
        ``self.pool_of``, ``self.pools`` (pool -> its kinds), ``self.slots`` (``(kind,
        stage)`` -> the slot of each microbatch's buffer), ``self.rings`` (pool -> slots)."""
        lay = self.layout = ring_layout(self.cs, self.rank, pool_of)
        self.lives, self.pool_of = lay.kinds, lay.pool_of
        self.slots, self.rings = lay.slots, lay.sizes
        self.pools: dict = {}
        for ks in lay.kinds:
            self.pools.setdefault(lay.pool_of[ks], []).append(ks)

    def ring_bytes(self, pooled: bool = True) -> int:
        """Bytes the rank's rings hold (after lowering): with the rings the program uses
        (``pooled``: kinds of equal avals share one), or with one ring per kind."""
        if pooled:
            return sum(R * self.buffer_bytes[kinds[0]] for pool, kinds in self.pools.items()
                       for R in [self.rings[pool]])
        sizes = ring_layout(self.cs, self.rank).sizes
        return sum(R * self.buffer_bytes[ks] for ks, R in sizes.items())

    def live_buffer_peak(self) -> int:
        """The most bytes of ringed buffers ever held at once (a lower bound for any rings)."""
        held = self.layout.held
        return max((sum(self.buffer_bytes[ks] for ks, w, last in held if w <= p <= last)
                    for p in {w for _, w, _ in held}), default=0)

    def describe(self) -> str:
        """The table: its steps, its units (tasks, and transfer stretches with symbolic
        microbatches: ``>Act0`` send, ``+Grad1`` receive posted, ``<Grad1`` received) and
        the slots of each ring, e.g. ``table 16 steps; tasks F0 B0; transfers [>Act0.a]
        [+Grad1.a]; rings Stash0:2``. A rank of several devices: its rolled runs
        (``_LoopProgram.describe``)."""
        if not self.table:
            return super().describe()
        return describe_table(self.units, self.stretches, len(self.rows), self.pools,
                              self.rings)

    def unit_sequence(self) -> list[str]:
        """The units the steps run, in order: ``F0``, or a stretch as ``>Act0 +Grad1``."""
        return unit_sequence(self.steps)

    def _loop(self, env, outer, whole_mb, token):
        """The rank's loop: as a table (``rank_table.lower_table``: one ``fori_loop`` over
        the rank's table, each unit once) or, rolled, its items rolled into scans
        (``_LoopProgram._loop``)."""
        if not self.table:
            return super()._loop(env, outer, whole_mb, token)
        lower_table(self, env, outer, whole_mb, token)

    # -- transfers (rank_transfers.py) -------------------------------------------------------
    def _mark(self, phase, dep, after):
        return self.transfers.mark(phase, dep, after)

    def _comm(self, group, base, get, put, token):
        self.transfers.call(group, get, put, token)

    def _move(self, it, base, get, put, token):
        key = (it.kind, it.stage, it.mb)
        if it.op == ItemOp.OFFLOAD:
            self.transfers.offload(key, base, get(key), token)
        else:
            put(key, self.transfers.fetch(key, base, token))

    def events(self) -> list[tuple]:
        """The last step's recorded events in the interpreter's format (``Executor.events``,
        ``rank_transfers.recorded_events``). Empty unless the comm recorded."""
        return recorded_events(self.cs, self.rank, self.comm, self._order)

    # -- running -----------------------------------------------------------------------------

    @property
    def comms(self) -> list:
        """The transfer contexts this program's calls use (a ``SharedProgram``: its ranks')."""
        return [self.comm]

    def set_timeout(self, timeout) -> None:
        """Bounds every wait of the next steps (seconds)."""
        if self.timeout != float(timeout):
            self.timeout = float(timeout)
            self.comm.set_timeout(self.timeout)

    def compile(self, vals):
        """Traces and compiles the program for these inputs."""
        self.compiled = self.lower(vals).compile()

    def lower(self, vals):
        """Traces the program for these inputs (``jax.stages.Lowered``; its ``compile()``
        runs in XLA without the GIL, so several ranks' programs compile in parallel)."""
        return self.fn.lower(self._args(vals))

    def lowered_text(self) -> str:
        """The program's StableHLO, lowered from the loop inputs' avals (tests inspect its
        custom calls)."""
        cs = self.cs
        return self.fn.lower([jax.ShapeDtypeStruct(cs.traced.avals[o].shape,
                                                   cs.traced.avals[o].dtype,
                                                   sharding=cs.sharding(o, self.rank))
                              for o in self.needs]).as_text()

    def _args(self, vals):
        return self.cs.place(self.needs, [vals[o] for o in self.needs], self.rank)

    def __call__(self, vals) -> dict[int, Any]:
        """Runs one step; a failure (here or on another rank) raises ``ExecutionError``
        naming the rank where it started."""
        try:
            outs = (self.compiled or self.fn)(self._args(vals))
            jax.block_until_ready(outs)
        except BaseException as e:
            raise self.error(e) from e
        return dict(zip(self.mine, outs[1:]))

    def error(self, e: BaseException) -> ExecutionError:
        """``e`` (raised while running the program) as the step's ``ExecutionError``: the
        transfer context's failure when it has one (the rank it started on named), else
        ``e`` (a task error), after telling the other ranks."""
        if isinstance(e, ExecutionError):
            return e
        got = self.comm.failure()
        if got is not None:
            origin, msg = got
        else:
            origin, msg = self.rank, f"rank {self.rank}: {type(e).__name__}: {e}"
            if self.comm.attached:
                self.comm.abort(msg)
        err = ExecutionError(msg)
        err.failed_rank = origin
        return err

    def _program(self, args):
        cs = self.cs
        lits = cs.traced.literals
        vals = dict(zip(self.needs, args))

        def outer(v):
            o, _ = cs.loop_src[v]
            return vals[o] if o in vals else lits[o]

        env = _Env()
        token = _Token(jnp.zeros((), jnp.int32))
        self._loop(env, outer, self._whole_mb(outer, {}), token)
        final = self._final_parts(env, self.mine)
        done = self.transfers.drain(token.dep)  # every send delivered before the program ends
        return [done] + [final[i] for i in self.mine]

