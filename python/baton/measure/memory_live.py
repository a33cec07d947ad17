"""What a pipelined step holds per device, measured (``step.memory(measure=True)``; the model
is ``memory.py``): bytes of arrays per device, and the peak over samples of the live arrays
taken while the step runs (``LivePeak``; how each engine samples: ``memory.py``'s module
docstring)."""

from __future__ import annotations

import functools
import threading

import jax
import numpy as np

from ..errors import ConfigError
from ..running.run_options import PostSegment
from .profile import xla_memory


@functools.lru_cache(maxsize=4096)
def _shard_bytes(sharding, shape: tuple, itemsize: int) -> tuple:
    """((device id, bytes), ...): each device's shard of an array of ``shape``."""
    out = []
    for d, idx in sharding.devices_indices_map(shape).items():
        n = 1
        for sl, dim in zip(idx, shape):
            n *= len(range(*sl.indices(dim)))
        out.append((d.id, n * itemsize))
    return tuple(out)


def _itemsize(dtype) -> int:
    """Bytes per element (also of extended dtypes such as PRNG keys: their storage)."""
    return int(getattr(dtype, "itemsize", None) or np.dtype(dtype).itemsize)


def per_device(items, out: dict | None = None, times: int = 1) -> dict:
    """Adds the per-device shard bytes of ``items`` ((sharding, shape, dtype) triples or
    jax.Arrays) into ``out`` (device id -> bytes), ``times`` each."""
    out = {} if out is None else out
    for it in items:
        sh, shape, dt = ((it.sharding, it.shape, it.dtype) if isinstance(it, jax.Array)
                         else it)
        for d, n in _shard_bytes(sh, tuple(shape), _itemsize(dt)):
            out[d] = out.get(d, 0) + n * times
    return out


class LivePeak:
    """The peak over samples of live jax array bytes per device (see the module
    docstring); ``temps[(kind, stage)]``: a task's XLA temporaries, added on its rank's
    devices at a sample taken inside it."""

    def __init__(self, rank_devices, temps: dict):
        self.devs = [{d.id for d in g} for g in rank_devices]
        self.temps = temps
        self.peak: dict[int, int] = {}
        self.update_peak: dict[int, int] = {}  # over the samples after the loop
        self.offset: dict[int, int] = {}  # added to every sample (measure_live)
        self.samples = 0
        self._lock = threading.Lock()

    def sample(self, rank: int | None = None, task: tuple | None = None) -> None:
        live = per_device(jax.live_arrays())
        extra = self.temps.get(task, 0) if task is not None else 0
        with self._lock:
            self.samples += 1
            for d, n in live.items():
                n += self.offset.get(d, 0)
                if extra and d in self.devs[rank]:
                    n += extra
                if n > self.peak.get(d, 0):
                    self.peak[d] = n
                if isinstance(task, PostSegment) and n > self.update_peak.get(d, 0):
                    self.update_peak[d] = n

    def sample_programs(self, progs) -> None:
        """One sample as compiled programs start: ``progs`` ((ranks, compiled) pairs), each
        program's allocation (``program_bytes``) added on its ranks' devices."""
        extra: dict[int, int] = {}
        for ranks, compiled in progs:
            n = program_bytes(compiled)
            for r in ranks:
                for d in self.devs[r]:
                    extra[d] = extra.get(d, 0) + n
        live = per_device(jax.live_arrays())
        with self._lock:
            self.samples += 1
            for d in set(live) | set(extra):
                n = live.get(d, 0) + self.offset.get(d, 0) + extra.get(d, 0)
                if n > self.peak.get(d, 0):
                    self.peak[d] = n


def program_bytes(compiled) -> int:
    """Bytes per device XLA allocates while ``compiled`` runs beyond its arguments: its
    temporaries and the outputs not written into donated arguments."""
    mem = xla_memory(compiled) if compiled is not None else None
    if mem is None:
        raise ConfigError("step.memory(measure=True): the backend gives no memory analysis "
                          "of the compiled program (its allocation is unknown)")
    return (mem["temp_size_in_bytes"] + mem["output_size_in_bytes"]
            - mem.get("alias_size_in_bytes", 0))


def measure_live(fn, args, temps: dict) -> tuple[dict, dict]:
    """One call of ``fn`` on its own engine with live-array sampling on; device id -> peak
    over the step, and over the segments after the loop. The interpreter samples after every
    task and transfer; the compiled engine as each program starts (its arguments placed),
    adding the program's own allocation as XLA assigned it (``LivePeak.sample_programs``)."""
    step = fn.compile(*args)
    live = LivePeak(step.mesh.rank_devices, temps)
    # a donating step consumes copies of the caller's donated arrays (``_call(keep_args)``):
    # the caller's originals stay live beside them, and are not the step's to count
    for i in fn.donate_argnums:
        for d, n in per_device([x for x in jax.tree.leaves(args[i])
                                if isinstance(x, jax.Array)]).items():
            live.offset[d] = live.offset.get(d, 0) - n
    fn._call(args, keep_args=True, live=live)
    return dict(live.peak), dict(live.update_peak)
