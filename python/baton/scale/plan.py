"""Planning a training run at cluster scale (docs/SCALE.md): the Python API over the C++
search (``baton._core.plan_cluster``), records, and the ``baton.jit`` arguments of a plan."""

from __future__ import annotations

import dataclasses
import json
import os

from .. import _core
from .models import TransformerConfig
from .profile import profile_model

CLUSTERS = os.path.join(os.path.dirname(__file__), "clusters")


def cluster_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(CLUSTERS) if f.endswith(".json"))


def load_cluster(cluster: str | dict, efficiency: float | None = None) -> dict:
    """A hardware description: a preset name (``cluster_names()``), a JSON file path or a
    dict; validated by the core. ``efficiency`` overrides the file's fitted constant."""
    if isinstance(cluster, dict):
        text = json.dumps(cluster)
    elif os.path.exists(cluster):
        with open(cluster) as f:
            text = f.read()
    elif cluster.lower() in cluster_names():
        with open(os.path.join(CLUSTERS, cluster.lower() + ".json")) as f:
            text = f.read()
    else:
        raise ValueError(f"unknown cluster {cluster!r}: a JSON file or one of {cluster_names()}")
    hw = json.loads(_core.hardware_normalize(text))
    if efficiency is not None:
        hw["efficiency"] = float(efficiency)
        hw = json.loads(_core.hardware_normalize(json.dumps(hw)))
    return hw


@dataclasses.dataclass
class MemoryPerGPU:
    """Bytes on the GPU with the largest peak, by component."""
    params: int
    grads: int
    optimizer: int
    activations: int
    total: int
    host: int = 0  # bytes that GPU's rank holds in host memory at once (offloaded stashes)


@dataclasses.dataclass
class TimeBreakdown:
    """Seconds per step on the average pipeline rank, by kind (cluster.h TimeBreakdown):
    compute (GEMMs, fused attention, memory-bound work, kernel launches), the remat's extra
    work, exposed communication (TP, expert all-to-all, FSDP, data-parallel reduction), the
    optimizer update, and the bubble (the rest of the step)."""
    gemm: float
    attention: float
    memory: float
    launch: float
    recompute: float
    tp_comm: float
    ep_comm: float
    fsdp_comm: float
    dp_comm: float
    optimizer: float
    bubble: float


@dataclasses.dataclass
class ClusterPlan:
    """One ranked plan: degrees, the pipeline plan over its segments, predictions."""
    pp: int
    tp: int
    dp: int
    ep: int
    fsdp: bool
    tp_overlap: bool
    dp_overlap: bool
    schedule: str
    virtual_stages: int
    microbatches: int
    cuts: list
    remat: list
    offload: list  # per stage "none" or "stash" (empty: nothing offloaded)
    peak_host: list  # per pipeline rank, bytes in host memory (empty: nothing offloaded)
    segment_names: list
    segment_layers: list
    step_time: float
    tokens_per_second: float
    mfu: float
    tflops_per_gpu: float
    bubble: float
    fits: bool
    memory: MemoryPerGPU
    time: "TimeBreakdown"

    @classmethod
    def from_dict(cls, d: dict) -> "ClusterPlan":
        d = dict(d)
        d["memory"] = MemoryPerGPU(**d["memory"])
        d["time"] = TimeBreakdown(**d["time"])
        return cls(**d)

    @property
    def stage_layers(self) -> list[int]:
        """Layer instances (embedding, each layer, head) in each pipeline stage."""
        bounds = list(self.cuts) + [len(self.segment_layers)]
        return [sum(self.segment_layers[a:b]) for a, b in zip(bounds, bounds[1:])]

    def jit_kwargs(self) -> dict:
        """Arguments of ``baton.jit`` that run this plan, for a step whose model calls
        ``baton.stage_boundary()`` after the embedding and after every layer (instance k
        ends at boundary index k): schedule, microbatches, remat, the boundaries that end
        stages, and the mesh: ``mesh_axes`` sizes (pipeline x data x expert x tensor) for
        the ``PipelineMesh`` each pipeline rank's devices form (tensor innermost). Only
        ``schedule``, ``microbatches``, ``remat``, ``offload`` and ``boundaries`` are
        ``baton.jit`` keywords; ``mesh_axes``, ``fsdp`` and ``checkpoint_stages`` say how to build the
        mesh, shard the parameters and which stages' layers to wrap in ``jax.checkpoint``."""
        from ..schedules import schedule_from_name

        v = self.virtual_stages if self.schedule == "interleaved" else None
        starts, acc = [], 0
        for n in self.stage_layers:
            starts.append(acc)
            acc += n
        return {"schedule": schedule_from_name(self.schedule, v),
                "microbatches": self.microbatches,
                "remat": all(r != "keep" for r in self.remat),
                "offload": ({k: "stash" for k, o in enumerate(self.offload) if o == "stash"}
                            or None),
                "boundaries": [s - 1 for s in starts[1:]],
                "mesh_axes": {"pipeline": self.pp, "data": self.dp // self.ep,
                              "expert": self.ep, "tensor": self.tp},
                "fsdp": self.fsdp,
                # stages planned with full recomputation: wrap their layers in
                # jax.checkpoint (baton.jit's remat is the minimum-bytes cut, "min")
                "checkpoint_stages": [k for k, r in enumerate(self.remat) if r == "full"]}


@dataclasses.dataclass
class ClusterPlans:
    plans: list
    stats: dict
    model: dict
    hardware: dict

    def table(self) -> str:
        return format_table(self)

    def breakdown(self) -> str:
        """Where each plan's step goes (seconds on the average pipeline rank)."""
        return format_breakdown(self)


def _model_profile(model, seq) -> dict:
    if isinstance(model, dict):
        return model
    if isinstance(model, (str, TransformerConfig)):
        return profile_model(model, seq)
    raise TypeError(f"model must be a name, a TransformerConfig or a profile dict, got {type(model)}")


def plan_cluster(model, cluster, gpus: int, global_batch: int, seq: int | None = None, *,
                 fp8: bool = False, pp=(), tp=(), ep=(), fsdp: bool | None = None,
                 families=(), top: int = 10, max_segments: int = 24,
                 max_microbatch_choices: int = 1, gap: float = 0.02, node_budget: int = 500,
                 interleaved_v=(2, 4), efficiency: float | None = None,
                 tp_overlap: bool | None = None, dp_overlap: bool | None = None,
                 grad_reduce_bytes: float = 4.0, offload: bool | None = None,
                 fetch_lookahead: int = 1, dispatch_bytes: float = 2.0,
                 ep_node_limit: int = 0, update_in_place: bool = True,
                 attention_kernel: str = "", stash_bytes: float = 2.0) -> ClusterPlans:
    """Fastest predicted plans for ``model`` on ``gpus`` GPUs of ``cluster``: degrees
    (pipeline, tensor, data with ZeRO-1 or FSDP, expert), overlap settings, cuts, schedule,
    microbatches, remat and activation offload, ranked by step time. ``global_batch`` in
    sequences of ``seq`` tokens. ``tp_overlap`` / ``dp_overlap``: None searches both settings.
    ``grad_reduce_bytes``: bytes per gradient element in the data-parallel reduction.
    ``offload``: whether a plan over the memory budget may offload its ranks' stashes to host
    memory over the cluster's ``host_link`` (None: when the cluster file has one; True
    without one raises ``ConfigError``); ``fetch_lookahead``: tasks a fetch runs ahead.
    ``dispatch_bytes``: bytes per element of the dispatch-way expert all-to-alls (2: bf16;
    DeepSeek-V3's fp8 with a scale per 1x128 tile: 1 + 4/128); ``ep_node_limit``: each
    token's experts lie on at most this many nodes (DeepSeek-V3's node-limited routing: 4;
    0: no limit). ``update_in_place``: the optimizer writes the new parameters and state
    over the old ones (PyTorch, Megatron; a Baton step with ``donate_argnums`` on them), so
    no rank holds two copies after the loop; False counts the copies (a step that donates
    nothing). ``attention_kernel``: a fused-attention kernel of the cluster file's
    ``attention_kernels`` (e.g. ``"fa2"``: FlashAttention-2, PyTorch SDPA's flash backend)
    instead of its default curve. ``stash_bytes``: bytes per element of the activations kept
    for the backward (2: bf16; DeepSeek-V3 caches them in fp8 with 1x128 scales: 1 + 4/128)."""
    prof = _model_profile(model, seq)
    hw = load_cluster(cluster, efficiency)
    out = json.loads(_core.plan_cluster(
        json.dumps(prof), json.dumps(hw), int(gpus), int(global_batch), fp8=fp8,
        pp=list(pp), tp=list(tp), ep=list(ep), fsdp_mode=-1 if fsdp is None else int(fsdp),
        families=list(families), top=top, max_segments=max_segments,
        max_microbatch_choices=max_microbatch_choices, gap=gap, node_budget=node_budget,
        interleaved_v=list(interleaved_v),
        tp_overlap=-1 if tp_overlap is None else int(tp_overlap),
        dp_overlap=-1 if dp_overlap is None else int(dp_overlap),
        grad_reduce_bytes=float(grad_reduce_bytes),
        offload=-1 if offload is None else int(offload), fetch_lookahead=int(fetch_lookahead),
        dispatch_bytes=float(dispatch_bytes), ep_node_limit=int(ep_node_limit),
        update_in_place=bool(update_in_place), attention_kernel=str(attention_kernel),
        stash_bytes=float(stash_bytes)))
    return ClusterPlans([ClusterPlan.from_dict(p) for p in out["plans"]], out["stats"],
                        prof, hw)


def evaluate_cluster(model, cluster, *, pp: int, tp: int, dp: int, global_batch: int,
                     schedule: str, microbatches: int, ep: int = 1, fsdp: bool = False,
                     virtual_stages: int = 1, remat: str = "keep", seq: int | None = None,
                     fp8: bool = False, efficiency: float | None = None,
                     tp_overlap: bool = False, dp_overlap: bool = False,
                     grad_reduce_bytes: float = 4.0, flash_attention: bool = True,
                     sequence_parallel: bool = True, dispatch_bytes: float = 2.0,
                     ep_node_limit: int = 0, update_in_place: bool = True,
                     attention_kernel: str = "", stash_bytes: float = 2.0) -> ClusterPlan:
    """The prediction of one given configuration (layers spread evenly over the stages).
    ``sequence_parallel=False``: the norms and residual adds run unsplit on every TP rank
    (Megatron-LM before 2022). ``dispatch_bytes``, ``ep_node_limit``, ``update_in_place``,
    ``attention_kernel``, ``stash_bytes``: as in ``plan_cluster``."""
    prof = _model_profile(model, seq)
    hw = load_cluster(cluster, efficiency)
    out = json.loads(_core.evaluate_cluster(
        json.dumps(prof), json.dumps(hw), pp, tp, dp, ep, fsdp, int(global_batch), fp8,
        schedule, virtual_stages, microbatches, remat, tp_overlap, dp_overlap,
        float(grad_reduce_bytes), flash_attention, sequence_parallel, float(dispatch_bytes),
        int(ep_node_limit), bool(update_in_place), str(attention_kernel), float(stash_bytes)))
    return ClusterPlan.from_dict(out["plans"][0])


def format_breakdown(r: ClusterPlans) -> str:
    keys = [f.name for f in dataclasses.fields(TimeBreakdown)]
    rows = ["step time by part, % of the step (average pipeline rank): " + " ".join(
        f"{k:>9}" for k in keys)]
    for k, p in enumerate(r.plans, 1):
        rows.append(f"{k:>2} {p.step_time:>8.2f} s " + " ".join(
            f"{100 * getattr(p.time, key) / p.step_time:>8.1f}%" for key in keys))
    return "\n".join(rows)


def overlap_name(p: ClusterPlan) -> str:
    """The plan's overlap settings: "tp", "dp", "tp+dp" or "-"."""
    return "+".join(n for n, on in (("tp", p.tp_overlap), ("dp", p.dp_overlap)) if on) or "-"


def _gib(b: int) -> str:
    return f"{b / 2**30:.1f}G"


def format_table(r: ClusterPlans) -> str:
    head = (f"{'#':>2} {'pp':>3} {'tp':>2} {'dp':>5} {'ep':>2} {'fsdp':>4} {'overlap':>7} "
            f"{'schedule':>11} "
            f"{'v':>1} {'M':>4} {'step s':>7} {'tokens/s':>10} {'MFU':>6} {'bubble':>6} "
            f"{'param':>6} {'grad':>6} {'optim':>6} {'activ':>6} {'total':>6} {'host':>6}")
    rows = [head]
    for k, p in enumerate(r.plans, 1):
        m = p.memory
        rows.append(
            f"{k:>2} {p.pp:>3} {p.tp:>2} {p.dp:>5} {p.ep:>2} {'yes' if p.fsdp else 'no':>4} "
            f"{overlap_name(p):>7} "
            f"{p.schedule:>11} {p.virtual_stages:>1} {p.microbatches:>4} {p.step_time:>7.2f} "
            f"{p.tokens_per_second:>10.0f} {100 * p.mfu:>5.1f}% {100 * p.bubble:>5.1f}% "
            f"{_gib(m.params):>6} {_gib(m.grads):>6} {_gib(m.optimizer):>6} "
            f"{_gib(m.activations):>6} {_gib(m.total):>6} "
            f"{_gib(max(p.peak_host)) if any(p.peak_host) else '-':>6}")
    s = r.stats
    rows.append(f"{s['degree_tuples']} degree tuples ({s['skipped_memory']} over memory by static "
                f"bytes), {s['searched']} searches, {s['seconds']:.2f} s; MFU = model FLOPs/token "
                f"x tokens/s / (GPUs x {r.hardware['peak_bf16'] / 1e12:.0f} TFLOP/s); memory on "
                f"the fullest GPU (budget {_gib(r.hardware['hbm_bytes'] - r.hardware['reserved_bytes'])}iB; "
                f"host: the most offloaded stash bytes any rank holds in host memory)")
    return "\n".join(rows)
