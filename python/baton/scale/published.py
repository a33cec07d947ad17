"""Published training runs that the cluster cost model is checked against
(bench/results/scale.md, tests/python/test_scale_published.py).

Each :class:`PublishedRun` is one configuration as its source describes it (degrees,
batch, schedule, microbatches, precision, recomputation, overlap) with the published
throughput and, where given, the published memory per GPU. Where a source is silent the
field carries an assumption, written in ``assumptions``; the same rules apply to every
source: microbatch size 1 unless stated; ``remat="auto"`` = the least recomputation
(keep, then min, then full) that fits the GPU in Baton's memory model; overlap off for
runs before 2023 (Megatron 2021, BLOOM), as stated otherwise. Nothing here is fitted:
the hardware files' constants come from cited measurements (docs/SCALE.md).
"""

from __future__ import annotations

import dataclasses
import statistics

from .models import get_model
from .plan import evaluate_cluster, load_cluster
from .profile import profile_model

NARAYANAN = "Narayanan et al. 2021 (arXiv:2104.04473), table 1"
LLAMA3 = "Llama 3 Herd of Models (arXiv:2407.21783), table 4"
TITAN = "torchtitan docs/performance.md (commit 9dec370, Dec 2024)"
MEGATRON_README = "Megatron-LM README, strong scaling (NVIDIA/Megatron-LM)"
BLOOM = "BLOOM (arXiv:2211.05100), sec. 3.4"
DEEPSEEK = "DeepSeek-V3 technical report (arXiv:2412.19437), table 1 and sec. 3"
DEEPSEEK_V2 = "DeepSeek-V2 technical report (arXiv:2405.04434), sec. 3.1.3 and 3.2.3"
# Bytes per element of DeepSeek-V3's fp8 activations: e4m3 values with one fp32 scaling
# factor per 1x128 tile (report sec. 3.3.2, fine-grained quantization; sec. 3.3.3, the
# activations before the MoE up-projections are quantized to fp8 before the dispatch, and
# those kept for the backward are cached in fp8).
DEEPSEEK_FP8 = 1 + 4 / 128


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    model: str
    cluster: str
    pp: int
    tp: int
    dp: int
    global_batch: int
    schedule: str
    microbatches: int
    published: float
    metric: str  # megatron_tflops | model_tflops | mfu | tps (tokens/s/GPU)
    v: int = 1
    ep: int = 1
    fsdp: bool = False
    fp8: bool = False
    remat: str = "auto"
    tp_overlap: bool = False
    dp_overlap: bool = False
    grad_reduce_bytes: float = 4.0
    flash_attention: bool = True
    sequence_parallel: bool = True
    # Expert all-to-alls (ClusterOptions): bytes per element of the dispatch-way ones
    # (2: bf16) and the most nodes a token's experts lie on (0: no limit).
    dispatch_bytes: float = 2.0
    # Bytes per element of the activations kept for the backward (2: bf16; DeepSeek-V3's fp8
    # with 1x128 scales: DEEPSEEK_FP8).
    stash_bytes: float = 2.0
    ep_node_limit: int = 0
    # Fused attention kernel by name among the hardware file's attention_kernels ("fa2":
    # PyTorch SDPA's flash backend); "": the file's default (cuDNN's on Hopper).
    attention_kernel: str = ""
    published_mem_gib: float | None = None
    assumptions: str = ""

    @property
    def gpus(self) -> int:
        return self.pp * self.tp * self.dp


_N = ("microbatch size 1, full recompute (the paper's setting), 1F1B for p = 1 and "
      "interleaved v = 2 otherwise, fp16 gradients all-reduced after the backward (no overlap), "
      "unfused attention (FlashAttention came in 2022), no sequence parallelism (introduced in "
      "2022, Korthikanti et al., arXiv:2205.05198: the norms and residual adds run on the whole "
      "activation on every TP rank)")
_L3 = ("interleaved v = 4, microbatch 1 (M = the batch per DP group), remat auto, ZeRO-1 with "
       "the gradient reduce-scatter overlapped (the paper's FSDP without resharding) in fp32, "
       "TP overlap off (not described)")
_T = ("torch.compile rows (fused elementwise work, as Baton models it); gradients reduced in "
      "fp32 (FSDP2's default); attention by PyTorch's scaled_dot_product_attention, whose "
      "flash backend is FlashAttention-2 on H100 (cuDNN's opt-in since pytorch/pytorch#138522)")
# torchtitan's table 5 states local batch 32 and no microbatch count; its pipelining code at
# the benchmarked commit takes `n_microbatches = pipeline_parallel_microbatches or
# pipeline_parallel_degree` (torchtitan/parallelisms/pipelining_utils.py; the option's help:
# "The default value will be the number of pipeline stages, if unspecified"), so the 32
# sequences per pipeline run as 8 microbatches of 4. (Fed as 32 microbatches of 1 before.)
_T405_M = ("8 microbatches of 4 sequences (torchtitan's default microbatch count = the PP "
           "degree; the table gives only the local batch of 32)")
_M = ("TP 4 / PP 8, interleaved with one layer per virtual stage (v = 12), microbatch 1 (NeMo's "
      "GPT-3 175B recipe, as recalled: the README gives no degrees), bf16, --tp-comm-overlap and "
      "--overlap-grad-reduce on, remat auto")

RUNS = [
    PublishedRun("GPT 1.7B, 32 A100", NARAYANAN, "gpt-1.7b", "a100", 1, 1, 32, 512, "1f1b", 16,
                 137, "megatron_tflops", remat="full", grad_reduce_bytes=2, flash_attention=False,
                 sequence_parallel=False, assumptions=_N),
    PublishedRun("GPT 18.4B, 256 A100", NARAYANAN, "gpt-18b", "a100", 1, 8, 32, 1024, "1f1b", 32,
                 135, "megatron_tflops", remat="full", grad_reduce_bytes=2, flash_attention=False,
                 sequence_parallel=False, assumptions=_N),
    PublishedRun("GPT 39.1B, 512 A100", NARAYANAN, "gpt-39b", "a100", 2, 8, 32, 1536,
                 "interleaved", 48, 138, "megatron_tflops", v=2, remat="full",
                 grad_reduce_bytes=2, flash_attention=False,
                 sequence_parallel=False, assumptions=_N),
    PublishedRun("GPT 145.6B, 1536 A100", NARAYANAN, "gpt-145b", "a100", 8, 8, 24, 2304,
                 "interleaved", 96, 148, "megatron_tflops", v=2, remat="full",
                 grad_reduce_bytes=2, flash_attention=False,
                 sequence_parallel=False, assumptions=_N),
    PublishedRun("GPT 310.1B, 1920 A100", NARAYANAN, "gpt-310b", "a100", 16, 8, 15, 2160,
                 "interleaved", 144, 155, "megatron_tflops", v=2, remat="full",
                 grad_reduce_bytes=2, flash_attention=False,
                 sequence_parallel=False, assumptions=_N),
    PublishedRun("GPT 1T, 3072 A100", NARAYANAN, "gpt-1t", "a100", 64, 8, 6, 3072,
                 "interleaved", 512, 163, "megatron_tflops", v=2, remat="full",
                 grad_reduce_bytes=2, flash_attention=False,
                 sequence_parallel=False, assumptions=_N),
    PublishedRun("BLOOM 176B, 384 A100", BLOOM, "bloom-176b", "a100", 12, 4, 8, 2048, "1f1b", 128,
                 156, "megatron_tflops", remat="full", flash_attention=False,
                 sequence_parallel=False,
                 assumptions="TP 4 / PP 12 / DP 8, global batch 2048, microbatch 2 (M = 128), "
                             "ZeRO-1 (the paper); 1F1B, full recompute, no overlap, fp32 "
                             "gradient reduction, no sequence parallelism (Megatron-DeepSpeed "
                             "of 2022; assumed)"),
    PublishedRun("Llama 3 405B, 8192 H100", LLAMA3, "llama3-405b", "h100", 16, 8, 64, 2048,
                 "interleaved", 32, 430, "model_tflops", v=4, dp_overlap=True, assumptions=_L3),
    PublishedRun("Llama 3 405B, 16384 H100", LLAMA3, "llama3-405b", "h100", 16, 8, 128, 2048,
                 "interleaved", 16, 400, "model_tflops", v=4, dp_overlap=True, assumptions=_L3),
    PublishedRun("GPT-3 175B, 96 H100", MEGATRON_README, "gpt3-175b", "h100", 8, 4, 3, 1152,
                 "interleaved", 384, 0.47, "mfu", v=12, tp_overlap=True, dp_overlap=True,
                 assumptions=_M),
    PublishedRun("GPT-3 175B, 4608 H100", MEGATRON_README, "gpt3-175b", "h100", 8, 4, 144, 1152,
                 "interleaved", 8, 0.42, "mfu", v=12, tp_overlap=True, dp_overlap=True,
                 assumptions=_M),
    PublishedRun("torchtitan 8B FSDP 8, bf16", TITAN + ", table 1", "llama3-8b", "h100-500w", 1, 1,
                 8, 16, "1f1b", 1, 6667, "tps", fsdp=True, remat="min", attention_kernel="fa2",
                 published_mem_gib=77.0, assumptions=_T + "; selective AC = remat min"),
    PublishedRun("torchtitan 8B FSDP 8, fp8", TITAN + ", table 1", "llama3-8b", "h100-500w", 1, 1,
                 8, 16, "1f1b", 1, 8532, "tps", fsdp=True, fp8=True, remat="min",
                 attention_kernel="fa2", published_mem_gib=76.8,
                 assumptions=_T + "; selective AC = remat min"),
    PublishedRun("torchtitan 8B FSDP 128, bf16", TITAN + ", table 3", "llama3-8b", "h100-500w", 1,
                 1, 128, 256, "1f1b", 1, 6514, "tps", fsdp=True, remat="min",
                 attention_kernel="fa2", published_mem_gib=62.0,
                 assumptions=_T + "; selective AC = remat min"),
    PublishedRun("torchtitan 8B FSDP 128, fp8", TITAN + ", table 3", "llama3-8b", "h100-500w", 1,
                 1, 128, 256, "1f1b", 1, 8380, "tps", fsdp=True, fp8=True, remat="min",
                 attention_kernel="fa2", published_mem_gib=61.8,
                 assumptions=_T + "; selective AC = remat min"),
    PublishedRun("torchtitan 70B FSDP 32 TP 8, fp8", TITAN + ", table 4", "llama3-70b",
                 "h100-500w", 1, 8, 32, 512, "1f1b", 1, 829, "tps", fsdp=True, fp8=True,
                 remat="full", attention_kernel="fa2", published_mem_gib=71.9,
                 assumptions=_T + "; full AC"),
    PublishedRun("torchtitan 70B FSDP 32 TP 8, fp8, async TP", TITAN + ", table 4", "llama3-70b",
                 "h100-500w", 1, 8, 32, 512, "1f1b", 1, 876, "tps", fsdp=True, fp8=True,
                 remat="full", tp_overlap=True, attention_kernel="fa2", published_mem_gib=67.6,
                 assumptions=_T + "; full AC"),
    PublishedRun("torchtitan 405B 1F1B, 512 H100, fp8", TITAN + ", table 5", "llama3-405b",
                 "h100-500w", 8, 8, 8, 256, "1f1b", 8, 100, "tps", fp8=True, remat="full",
                 tp_overlap=True, attention_kernel="fa2", published_mem_gib=82.5,
                 assumptions=_T + "; full AC, async TP; FSDP under PP keeps parameters "
                             "gathered through the step, evaluated as ZeRO-1 without overlap; "
                             + _T405_M),
    PublishedRun("torchtitan 405B interleaved, 512 H100, fp8", TITAN + ", table 5", "llama3-405b",
                 "h100-500w", 8, 8, 8, 256, "interleaved", 8, 128, "tps", v=2, fp8=True,
                 remat="full", tp_overlap=True, attention_kernel="fa2", published_mem_gib=72.7,
                 assumptions=_T + "; full AC, async TP, v = 2; FSDP under PP evaluated as "
                             "ZeRO-1; " + _T405_M),
    PublishedRun("DeepSeek-V3 671B, 2048 H800, fp8", DEEPSEEK, "deepseek-v3", "h800", 16, 1, 128,
                 15360, "dualpipev", 120, 14.8e12 / (2.664e6 * 3600), "tps", ep=64, fp8=True,
                 remat="min", dp_overlap=True, dispatch_bytes=DEEPSEEK_FP8,
                 stash_bytes=DEEPSEEK_FP8,
                 ep_node_limit=4,
                 assumptions="14.8T tokens in 2.664M H800 GPU hours (pre-training) = 1,543 "
                             "tokens/s/GPU; PP 16 / EP 64 / ZeRO-1 (the report), DualPipe as "
                             "DualPipeV, final batch 15,360 x 4,096, microbatch 1, RMSNorm and "
                             "up-projection recompute as remat min, MLA as plain attention; "
                             "node-limited routing, each token to at most 4 nodes over IB and "
                             "on to its 8 experts over NVLink, the two overlapped (sec. 2.1.2, "
                             "3.2.2), balanced over the nodes; dispatch in fp8 with one fp32 "
                             "scale per 1x128 tile (1.03 bytes per element), combine in bf16 "
                             "(sec. 3.3.3, 3.3.2), the backward's two all-to-alls likewise; "
                             "activations kept for the backward in fp8 with the same scales "
                             "(sec. 3.3.3, low-precision storage: the linear layers' inputs, "
                             "the MoE SwiGLU's input), all stashes at 1.03 bytes per element"),
    # 172.8K H800 GPU hours per trillion tokens (sec. 3.2.3) = 1,607.5 tokens/s/GPU; PP 16 with
    # zero-bubble pipelining, EP 8, ZeRO-1 DP, no TP, bf16 (sec. 3.1.3); batch 9,216 x 4,096
    # after the ramp (sec. 3.1.2). The GPU count is not stated: DP 64 (1,024 GPUs) assumed.
    PublishedRun("DeepSeek-V2 236B, 1024 H800", DEEPSEEK_V2, "deepseek-v2", "h800", 16, 1, 64,
                 9216, "zbh1", 144, 1e12 / (172.8e3 * 3600), "tps", ep=8, remat="min",
                 dp_overlap=True,
                 assumptions="172.8K H800 GPU hours per trillion tokens (sec. 3.2.3) = 1,607.5 "
                             "tokens/s/GPU; PP 16 (zero-bubble, as ZB-H1) / EP 8 / ZeRO-1 DP, "
                             "no TP (sec. 3.1.3); the GPU count is not stated: DP 64 assumed "
                             "(1,024 GPUs), EP 8 inside the data axis and inside one node of 8 "
                             "(NVLink), so device-limited routing (M = 3 devices per token, "
                             "sec. 2.2.2) leaves the expert all-to-alls intra-node and is not "
                             "modelled (no node limit); final batch 9,216 x 4,096 (the ramp "
                             "ignored), microbatch 1 (M = 144); the report's partial operator "
                             "recomputation as remat min; bf16 throughout, dispatch and combine "
                             "in bf16; MLA as plain attention of 128 heads of 128; gradient "
                             "reduction overlapped with the backward as in the V3 row"),
]

# Series: a source's runs in order; the change of MFU (points) across each is compared.
SERIES = [
    ("Narayanan weak scaling 1.7B -> 1T", ["GPT 1.7B, 32 A100", "GPT 1T, 3072 A100"]),
    ("Megatron-LM strong scaling 96 -> 4608 H100",
     ["GPT-3 175B, 96 H100", "GPT-3 175B, 4608 H100"]),
    ("Llama 3 8192 -> 16384 H100", ["Llama 3 405B, 8192 H100", "Llama 3 405B, 16384 H100"]),
    ("torchtitan 405B 1F1B -> interleaved",
     ["torchtitan 405B 1F1B, 512 H100, fp8", "torchtitan 405B interleaved, 512 H100, fp8"]),
    ("torchtitan 8B 8 -> 128 GPUs (bf16)",
     ["torchtitan 8B FSDP 8, bf16", "torchtitan 8B FSDP 128, bf16"]),
]


def _megatron_flops(run: PublishedRun) -> float:
    """FLOPs per iteration by Narayanan et al.'s eq. 3 (full recompute counted)."""
    cfg = get_model(run.model)
    B, s, L, h, V = run.global_batch, cfg.seq, cfg.layers, cfg.hidden, cfg.vocab
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def metric(run: PublishedRun, prof: dict, hw: dict, step: float) -> float:
    """The source's metric for a step time."""
    if run.metric == "megatron_tflops":
        return _megatron_flops(run) / step / run.gpus / 1e12
    model = prof["model_flops_per_sample"] * run.global_batch / step / run.gpus
    if run.metric == "model_tflops":
        return model / 1e12
    if run.metric == "mfu":
        return model / hw["peak_bf16"]
    return run.global_batch * prof["seq"] / step / run.gpus


def mfu_of(run: PublishedRun, prof: dict, hw: dict, value: float) -> float:
    """A metric value as MFU (model FLOPs over the bf16 peak), for the series."""
    if run.metric == "mfu":
        return value
    if run.metric == "tps":
        return value * prof["model_flops_per_sample"] / prof["seq"] / hw["peak_bf16"]
    if run.metric == "model_tflops":
        return value * 1e12 / hw["peak_bf16"]
    # Megatron's TFLOP/s count recomputation: convert through the step time.
    step = _megatron_flops(run) / (value * 1e12 * run.gpus)
    return prof["model_flops_per_sample"] * run.global_batch / step / run.gpus / hw["peak_bf16"]


@dataclasses.dataclass
class Comparison:
    run: PublishedRun
    plan: object  # ClusterPlan
    predicted: float
    remat: str

    @property
    def ratio(self) -> float:
        return self.predicted / self.run.published


def predict(run: PublishedRun, profiles: dict | None = None) -> Comparison:
    """Baton's prediction of one published configuration."""
    profiles = {} if profiles is None else profiles
    if run.model not in profiles:
        profiles[run.model] = profile_model(run.model)
    prof = profiles[run.model]
    hw = load_cluster(run.cluster)
    modes = ["keep", "min", "full"] if run.remat == "auto" else [run.remat]
    plan = None
    for mode in modes:
        plan = evaluate_cluster(prof, hw, pp=run.pp, tp=run.tp, dp=run.dp, ep=run.ep,
                                fsdp=run.fsdp, global_batch=run.global_batch,
                                schedule=run.schedule, microbatches=run.microbatches,
                                virtual_stages=run.v, remat=mode, fp8=run.fp8,
                                tp_overlap=run.tp_overlap, dp_overlap=run.dp_overlap,
                                grad_reduce_bytes=run.grad_reduce_bytes,
                                flash_attention=run.flash_attention,
                                sequence_parallel=run.sequence_parallel,
                                dispatch_bytes=run.dispatch_bytes,
                                ep_node_limit=run.ep_node_limit,
                                attention_kernel=run.attention_kernel,
                                stash_bytes=run.stash_bytes)
        if plan.fits:
            break
    return Comparison(run, plan, metric(run, prof, hw, plan.step_time), mode)


def compare_all(profiles: dict | None = None) -> list[Comparison]:
    profiles = {} if profiles is None else profiles
    return [predict(r, profiles) for r in RUNS]


def series(comparisons: list[Comparison], profiles: dict) -> list[dict]:
    """Per series: published and predicted MFU at both ends and their changes (points)."""
    by = {c.run.name: c for c in comparisons}
    out = []
    for name, (a, b) in SERIES:
        ca, cb = by[a], by[b]
        hw_a, hw_b = load_cluster(ca.run.cluster), load_cluster(cb.run.cluster)
        pa = mfu_of(ca.run, profiles[ca.run.model], hw_a, ca.run.published)
        pb = mfu_of(cb.run, profiles[cb.run.model], hw_b, cb.run.published)
        qa = mfu_of(ca.run, profiles[ca.run.model], hw_a, ca.predicted)
        qb = mfu_of(cb.run, profiles[cb.run.model], hw_b, cb.predicted)
        out.append({"series": name, "published": (pa, pb), "predicted": (qa, qb),
                    "published_change": 100 * (pb - pa), "predicted_change": 100 * (qb - qa)})
    return out


def summary(comparisons: list[Comparison]) -> dict:
    errs = [abs(c.ratio - 1) for c in comparisons]
    return {"median_abs_error": statistics.median(errs), "max_abs_error": max(errs),
            "within_20": sum(e <= 0.2 for e in errs), "runs": len(errs)}
