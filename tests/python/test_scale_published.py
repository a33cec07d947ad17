"""The cluster cost model against published runs (bench/results/scale.md), its series
checks, the remat policies' memory against the residuals JAX keeps, and the shipped
hardware files' constants against their cited ranges."""

import math

import jax
import jax.numpy as jnp
import pytest

from baton import scale
from baton._jax_compat import saved_residuals
from baton.scale import abstract as A
from baton.scale import published as P
from baton.scale.profile import profile_segment


@pytest.fixture(scope="module")
def comparisons():
    profiles = {}
    return P.compare_all(profiles), profiles


def test_every_published_row_is_predicted_and_recorded(comparisons):
    cs, _ = comparisons
    assert len(cs) == len(P.RUNS) >= 15
    assert len({r.source.split(",")[0].split(" (")[0] for r in P.RUNS}) >= 5
    assert sum(r.fp8 for r in P.RUNS) >= 3
    assert sum(r.gpus > 4000 for r in P.RUNS) >= 3
    for c in cs:
        assert c.predicted > 0 and math.isfinite(c.ratio), c.run.name
        t = c.plan.time
        parts = sum(getattr(t, f) for f in vars(t))
        # The parts add up to the step; where hidden work leaves no bubble (DualPipeV's
        # fused pairs outside its steady state) they may exceed it.
        assert parts >= c.plan.step_time * (1 - 1e-9), c.run.name
        if t.bubble > 0:
            assert parts == pytest.approx(c.plan.step_time, rel=1e-9), c.run.name
    # The state recorded in bench/results/scale.md: a regression guard, not the target.
    s = P.summary(cs)
    assert s["median_abs_error"] <= 0.35, s
    assert all(0.4 < c.ratio < 2.5 for c in cs), [(c.run.name, c.ratio) for c in cs]


@pytest.mark.xfail(strict=True, reason="the target (median error <= 10%, every run within "
                   "20%) is not met yet: bench/results/scale.md lists each missed row with "
                   "its breakdown")
def test_published_rows_meet_the_target(comparisons):
    cs, _ = comparisons
    s = P.summary(cs)
    assert s["median_abs_error"] <= 0.10 and s["max_abs_error"] <= 0.20, s


# Series whose predicted change misses the published one by more than 5 points
# (bench/results/scale.md, "Against the target").
SERIES_MISSED = {"Narayanan weak scaling 1.7B -> 1T", "Megatron-LM strong scaling 96 -> 4608 H100"}


@pytest.mark.xfail(strict=True, reason="Narayanan et al.'s weak-scaling series and the "
                   "Megatron-LM strong-scaling series miss by more than 5 points "
                   "(bench/results/scale.md, 'Against the target')")
def test_series_follow_the_published_trends(comparisons):
    cs, profiles = comparisons
    for s in P.series(cs, profiles):
        assert abs(s["predicted_change"] - s["published_change"]) <= 5, s


def test_series_other_than_the_recorded_misses_follow_the_published_trends(comparisons):
    cs, profiles = comparisons
    for s in P.series(cs, profiles):
        within = abs(s["predicted_change"] - s["published_change"]) <= 5
        # the recorded misses still miss: a fix updates SERIES_MISSED and scale.md
        assert within != (s["series"] in SERIES_MISSED), s


# Rows whose source reports a memory figure the prediction misses by more than 15%
# (bench/results/scale.md, "Memory").
MEMORY_MISSED = {"torchtitan 70B FSDP 32 TP 8, fp8", "torchtitan 70B FSDP 32 TP 8, fp8, async TP"}
# Rows that ran but that the memory model puts over the GPU (bench/results/scale.md).
FIT_MISSED = {"DeepSeek-V2 236B, 1024 H800"}


@pytest.mark.xfail(strict=True, reason="the torchtitan 70B rows' memory is under-predicted by "
                   "half and the DeepSeek-V2 row does not fit (bench/results/scale.md, 'Memory')")
def test_every_published_run_fits_and_its_memory_is_within_15_percent(comparisons):
    cs, _ = comparisons
    for c in cs:
        assert c.plan.fits, c.run.name
        if c.run.published_mem_gib:
            assert c.plan.memory.total / 2**30 == pytest.approx(c.run.published_mem_gib,
                                                                rel=0.15), c.run.name


def test_memory_other_than_the_recorded_misses(comparisons):
    cs, _ = comparisons
    assert sum(c.run.published_mem_gib is not None for c in cs) >= 6
    for c in cs:
        assert c.plan.fits != (c.run.name in FIT_MISSED), c.run.name
        if c.run.published_mem_gib:
            err = abs(c.plan.memory.total / 2**30 / c.run.published_mem_gib - 1)
            assert (err <= 0.15) != (c.run.name in MEMORY_MISSED), (c.run.name, err)


def test_series_direction_of_the_schedule_comparison(comparisons):
    # Interleaving beats 1F1B on torchtitan's 405B run, as published.
    cs, profiles = comparisons
    s = next(x for x in P.series(cs, profiles) if "interleaved" in x["series"])
    assert s["published_change"] > 0 and s["predicted_change"] > 0


def _small_layer():
    cfg = scale.get_model("llama:layers=1,hidden=64,ffn=128,heads=4,kv_heads=2,vocab=100,seq=32")
    params = A._abstract(A._layer_params(cfg, False))
    x = jax.ShapeDtypeStruct((1, cfg.seq, cfg.hidden), jnp.bfloat16)
    return cfg, A._layer(cfg, False), params, x


def _kept_bytes(f, params, x):
    concrete = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), (params, x))
    total = 0
    for aval, what in saved_residuals(f, *concrete):
        if "from the argument" in what and "argument x" not in what and "argument 1" not in what:
            continue  # parameters stay in place; they are not stash
        total += math.prod(aval.shape) * jnp.dtype(aval.dtype).itemsize
    return total


def test_remat_policies_keep_what_jax_keeps():
    _, f, params, x = _small_layer()
    seg = profile_segment("layer", f, params, x)
    # keep: every residual jax.vjp keeps; min: those of jax.checkpoint under
    # dots_with_no_batch_dims_saveable (the linear layers' outputs, not the attention
    # scores); full: the layer's input alone (a checkpointed layer keeps only its argument).
    assert seg["stash_keep"] == _kept_bytes(f, params, x)
    dots = jax.checkpoint(f, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    assert seg["stash_min"] == _kept_bytes(dots, params, x)
    # the scores' policy keeps more: the s x s matrices the selective policy recomputes
    scores = jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable)
    assert _kept_bytes(scores, params, x) > seg["stash_min"]
    assert seg["stash_full"] == _kept_bytes(jax.checkpoint(f), params, x)
    assert seg["stash_full"] < seg["stash_min"] < seg["stash_keep"]


def test_full_recomputation_checkpoints_the_layers_not_the_head():
    # Megatron-LM's and torchtitan's full recomputation (and the plan's checkpoint_stages)
    # wrap the transformer layers only: the head keeps its fp32 logits for the loss's
    # backward, the embedding its token ids.
    prof = scale.profile_model("llama3-8b")
    seg = {s["name"]: s for s in prof["segments"]}
    assert seg["layer"]["stash_full"] == 2 * 8192 * 4096  # the layer's bf16 input
    assert seg["head"]["stash_full"] == seg["head"]["stash_keep"]
    assert seg["head"]["stash_keep"] > 4 * 8192 * 128256  # the fp32 logits at least
    assert seg["embed"]["stash_full"] == seg["embed"]["stash_keep"]
    hw = scale.load_cluster("h100")
    kw = dict(pp=1, tp=1, dp=8, fsdp=True, global_batch=16, schedule="1f1b", microbatches=1)
    full = scale.evaluate_cluster(prof, hw, remat="full", **kw).memory
    # per GPU: 2 samples, 32 layer inputs each, and the head's own residuals
    stash = 2 * (32 * seg["layer"]["stash_full"] + seg["head"]["stash_keep"])
    assert full.activations >= stash
    # q, k and v read one normalized activation, gate and up another: the weight-gradient
    # stash keeps each once (the matmuls' "input" names the first reader).
    shared = [(mm["n"], mm["input"]) for mm in seg["layer"]["matmuls"]]
    assert shared == [(4096, -1), (1024, 0), (1024, 0), (4096, -1), (14336, -1), (14336, 4),
                      (4096, -1)]


def test_hardware_constants_inside_their_cited_ranges():
    for name in scale.cluster_names():
        hw = scale.load_cluster(name)
        assert 0 < hw["efficiency"] <= 1, name
        if hw["gemm"]["bf16"]:
            top = max(r for _, r in hw["gemm"]["bf16"])
            # H100: 0.817 measured (OpenXLA's table); A100: 0.85, inside the cited 0.80-0.90
            assert top <= 0.90 * hw["peak_bf16"], name
            assert hw["sources"]["gemm.bf16"], name
        if hw["gemm"]["fp8"]:
            assert max(r for _, r in hw["gemm"]["fp8"]) <= 0.80 * hw["peak_fp8"], name
        fwd = hw["attention"]["fwd"]
        assert all(0.3 <= f <= 0.75 for _, f in fwd), name  # FlashAttention-2/3 range
        # Named kernels: FlashAttention-2 at most the 35% of H100 that the FlashAttention-3
        # paper's abstract states, the others within FlashAttention-3's 75%.
        for kernel, a in hw.get("attention_kernels", {}).items():
            top = 0.35 if kernel == "fa2" else 0.75
            assert all(0.15 <= f <= top for _, f in a["fwd"]), (name, kernel)
            assert 0.7 <= a["bwd_ratio"] <= 0.9 and hw["sources"]["attention_kernels." + kernel]
        if fwd:
            assert 0.7 <= hw["attention"]["bwd_ratio"] <= 0.9, name
            assert 0.7 <= hw["hbm_efficiency"] <= 0.95, name
            assert 0 <= hw["overlap_contention"] <= 0.2, name
            assert 1e-6 <= hw["kernel_overhead"] <= 1e-5, name
        for link in ("intra", "inter"):
            bus = hw[link]["bus_bandwidth"]
            assert bus == 0 or 0.7 * hw[link]["bandwidth"] <= bus <= hw[link]["bandwidth"], name
        # host link per direction: between PCIe Gen4 x16 (31.5 GB/s) and NVLink-C2C (450 GB/s)
        assert 31e9 <= hw["host_link"]["bandwidth"] <= 450e9, name
        assert hw["sources"]["host_link.bandwidth"], name
        # Power cap: the clock relative to the measured card, between the DVFS cube law at
        # the lowest H100 datasheet power (NVL, 350 W: (350/700)^(1/3) = 0.79) and 1.
        ratio = hw.get("clock_ratio", 1.0)
        assert 0.79 <= ratio <= 1.0, name
        if ratio < 1:
            assert hw["sources"]["clock_ratio"], name
        # Wave quantization: SM counts of the datasheets (A100 108, H100 132, B200 148) and
        # thread-block tiles cuBLAS / CUTLASS use (64-256 per side).
        wq = hw.get("wave_quantization")
        if wq and wq.get("sms", 0) > 0:
            assert 108 <= wq["sms"] <= 148, name
            assert wq["tiles"] and all(64 <= a <= 256 and 64 <= b <= 256 for a, b in wq["tiles"])
            assert hw["sources"]["wave_quantization"], name


def test_power_capped_clock_follows_the_cited_relation():
    # h100-500w: the 700 W measurements at (500/700)^(1/3) of the clock, between the NVL
    # datasheet's 0.844 (400 W) and the SXM part, as torchtitan describes its GPUs.
    hw = scale.load_cluster("h100-500w")
    assert hw["clock_ratio"] == pytest.approx((500 / 700) ** (1 / 3), abs=1e-3)
    assert 1671 / 1979 < hw["clock_ratio"] < 1
    for name in ("h100", "a100", "h200", "h800", "b200"):
        assert scale.load_cluster(name).get("clock_ratio", 1.0) == 1.0, name
    # A100's table is the maximum-achievable (best-shape) rate: its shapes' waves apply.
    a100 = scale.load_cluster("a100")
    assert a100["wave_quantization"]["sms"] == 108


def test_torchtitan_runs_attend_with_flashattention_2():
    """torchtitan's rows ran PyTorch's scaled_dot_product_attention, whose H100 backend in
    Dec 2024 was FlashAttention-2 (cuDNN's opt-in): the hardware file's "fa2" curve, slower
    than its default (cuDNN's) by the FlashAttention-3 paper's figure."""
    titan = [r for r in P.RUNS if r.source.startswith(P.TITAN)]
    assert titan and all(r.attention_kernel == "fa2" for r in titan)
    assert all(r.attention_kernel == "" for r in P.RUNS if r not in titan)
    r = titan[0]
    kw = dict(pp=r.pp, tp=r.tp, dp=r.dp, fsdp=r.fsdp, global_batch=r.global_batch,
              schedule=r.schedule, microbatches=r.microbatches, remat=r.remat)
    fa2 = scale.evaluate_cluster(r.model, r.cluster, attention_kernel="fa2", **kw).time
    default = scale.evaluate_cluster(r.model, r.cluster, **kw).time
    hw = scale.load_cluster(r.cluster)
    slower = hw["attention"]["fwd"][-2][1] / hw["attention_kernels"]["fa2"]["fwd"][-2][1]
    assert fa2.attention == pytest.approx(default.attention * slower, rel=1e-9)  # seq 8192
    assert fa2.gemm == default.gemm
    from baton.errors import ConfigError
    with pytest.raises(ConfigError, match="no attention kernel 'fa9'"):
        scale.evaluate_cluster(r.model, r.cluster, attention_kernel="fa9", **kw)
    with pytest.raises(ConfigError, match=r"no attention kernel 'fa9' \(attention_kernels: fa2, fa3"):
        scale.plan_cluster(r.model, r.cluster, r.gpus, r.global_batch, attention_kernel="fa9")


def test_torchtitan_pipeline_runs_use_its_default_microbatch_count():
    # torchtitan's pipelining takes n_microbatches = the PP degree when unset; table 5
    # gives only the local batch (32), so the runs are fed 8 microbatches of 4 sequences.
    for r in P.RUNS:
        if r.source.startswith(P.TITAN) and r.pp > 1:
            assert r.microbatches == r.pp, r.name
            assert r.global_batch // r.dp // r.microbatches == 4, r.name


def test_pre_2022_megatron_runs_have_no_sequence_parallelism():
    # Sequence parallelism came with Korthikanti et al. 2022 (arXiv:2205.05198): Narayanan
    # et al.'s 2021 runs and BLOOM run their norms and residual adds unsplit on every TP rank.
    for r in P.RUNS:
        old = r.source in (P.NARAYANAN, P.BLOOM)
        assert r.sequence_parallel is not old, r.name
    prof = scale.profile_model("gpt-18b")
    layer = next(s for s in prof["segments"] if s["name"] == "layer")
    s, h = prof["seq"], 6144
    assert layer["mem_bytes_replicated"] == 20 * s * h < layer["mem_bytes"]
    kw = dict(pp=1, tp=8, dp=32, global_batch=1024, schedule="1f1b", microbatches=32,
              remat="full", flash_attention=False)
    sp = scale.evaluate_cluster("gpt-18b", "a100", **kw)
    no_sp = scale.evaluate_cluster("gpt-18b", "a100", sequence_parallel=False, **kw)
    assert no_sp.time.memory > sp.time.memory and no_sp.step_time > sp.step_time


def test_deepseek_all_to_alls_follow_the_report():
    # Node-limited routing (arXiv:2412.19437 sec. 2.1.2: at most 4 nodes per token) and the
    # fp8 dispatch (sec. 3.3.3: e4m3 with one fp32 scale per 1x128 tile, sec. 3.3.2); only
    # the MoE row states them, every other row keeps the defaults.
    for r in P.RUNS:
        moe = r.source == P.DEEPSEEK
        assert (r.ep_node_limit, r.dispatch_bytes) == ((4, 1 + 4 / 128) if moe else (0, 2.0))
        # its activations kept for the backward in fp8 with the same scales (sec. 3.3.3)
        assert r.stash_bytes == (1 + 4 / 128 if moe else 2.0)
    prof = scale.profile_model("deepseek-v3")
    moe = next(s for s in prof["segments"] if s["name"] == "moe_layer")
    assert moe["a2a_top_k"] == 8 and moe["a2a_collectives"] == 2
    kw = dict(pp=16, tp=1, dp=128, ep=64, global_batch=15360, schedule="1f1b",
              microbatches=120, remat="min", fp8=True)
    flat = scale.evaluate_cluster(prof, "h800", **kw)
    limited = scale.evaluate_cluster(prof, "h800", ep_node_limit=4, **kw)
    fp8 = scale.evaluate_cluster(prof, "h800", ep_node_limit=4, dispatch_bytes=1 + 4 / 128,
                                 **kw)
    # Over IB 4 of the 8 copies per token, pairwise over the group's 8 nodes (7/8 of them
    # remote) rather than 8 copies over 64 ranks (63/64 remote); the NVLink forward of all 8
    # copies (7/8 of them inside a node of 8) runs at the same time and is shorter.
    hw = scale.load_cluster("h800")
    ib, nvl = hw["inter"], hw["intra"]
    copies = 8 * 4096 * 7168 * 2  # one all-to-all of a microbatch, bf16

    def one(b):  # node-limited, b bytes per element
        return max(7 / 8 * copies * b / 2 * 4 / 8 / ib["bus_bandwidth"] + 7 * ib["latency"],
                   7 / 8 * copies * b / 2 / nvl["bus_bandwidth"] + 7 * nvl["latency"])

    flat_one = 63 / 64 * copies / ib["bus_bandwidth"] + 63 * ib["latency"]
    assert limited.time.ep_comm == pytest.approx(one(2) / flat_one * flat.time.ep_comm, rel=1e-9)
    # The dispatch-way half at 1.03 bytes per element, the combine-way half in bf16.
    assert fp8.time.ep_comm == pytest.approx(
        (one(1 + 4 / 128) + one(2)) / 2 / flat_one * flat.time.ep_comm, rel=1e-9)
    assert fp8.step_time < limited.step_time < flat.step_time


def test_deepseek_v2_row_follows_the_report():
    # arXiv:2405.04434: 172.8K H800 GPU hours per trillion tokens (sec. 3.2.3); 60 layers, the
    # first dense, then 160 routed experts of width 1536, 6 per token, 2 shared (sec. 3.1.2);
    # PP 16 zero-bubble, EP 8, ZeRO-1 DP, no TP, bf16 (sec. 3.1.3); batch 9,216 x 4,096.
    (r,) = [r for r in P.RUNS if r.source == P.DEEPSEEK_V2]
    assert r.metric == "tps"
    assert r.published == pytest.approx(1e12 / (172.8e3 * 3600), rel=1e-12)
    assert round(r.published) == 1608
    cfg = scale.get_model(r.model)
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.hd, cfg.vocab, cfg.seq) == (
        60, 5120, 128, 128, 102400, 4096)
    assert (cfg.experts, cfg.top_k, cfg.moe_ffn, cfg.shared_experts) == (160, 6, 1536, 2)
    assert (cfg.dense_layers, cfg.ffn) == (1, 12288)
    assert (r.pp, r.tp, r.ep, r.cluster, r.schedule, r.fp8) == (16, 1, 8, "h800", "zbh1", False)
    assert r.dp % r.ep == 0 and r.global_batch == 9216
    assert r.microbatches == r.global_batch // r.dp  # microbatch size 1
    # EP 8 lies inside one node of 8: device-limited routing changes no inter-node traffic.
    assert r.ep <= scale.load_cluster(r.cluster)["gpus_per_node"] and r.ep_node_limit == 0
    assert r.dispatch_bytes == 2.0
