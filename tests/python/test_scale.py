"""Planning at cluster scale: abstract traces of real-size models against closed forms,
predicted memory and collective bytes against hand formulas, the search, the CLI."""

import dataclasses
import json
import math
import os
import resource
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from baton import scale
from baton.scale import abstract as A
from baton.scale.profile import profile_segment


def _llama_closed_form(cfg):
    """Parameters and training FLOPs per token of a Llama-style model, by hand:
    per layer q, k, v, o projections h(Hd + 2Kd) + Hd h, SwiGLU 3 h f, two norms 2h; the
    embedding V h, the final norm h and the untied head h V. FLOPs per token = 6 x (every
    matmul parameter: all but the embedding table and the norms) + the attention term
    12 L s H d (QK^T and PV, 2 s H d each forward, x3 for training, non-causal)."""
    h, f, L, V, s = cfg.hidden, cfg.ffn, cfg.layers, cfg.vocab, cfg.seq
    q, kv = cfg.heads * cfg.hd, cfg.kv_heads * cfg.hd
    layer_matmul = h * (q + 2 * kv) + q * h + 3 * h * f
    params = V * h + L * (layer_matmul + 2 * h) + h + h * V
    flops_per_token = 6 * (L * layer_matmul + h * V) + 12 * L * s * q
    return params, flops_per_token


def test_llama3_405b_traces_abstractly_and_matches_the_closed_form():
    cfg = scale.get_model("llama3-405b")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    prof = scale.profile_model(cfg)
    seconds = time.perf_counter() - t0
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert seconds < 60, seconds
    # Nothing of the 405B parameters (810 GB in bf16) is allocated.
    assert grown_mib < 2048, grown_mib
    params, fpt = _llama_closed_form(cfg)
    got = sum(s["params"] * s["repeat"] for s in prof["segments"])
    assert got == params
    assert 405e9 < params < 406e9
    assert prof["model_flops_per_sample"] / cfg.seq == pytest.approx(fpt, rel=1e-12)
    # The familiar approximation: 6N + attention, within the embedding's share.
    n = params
    assert fpt == pytest.approx(6 * n + 12 * cfg.layers * cfg.seq * cfg.hidden, rel=0.01)
    layer = next(s for s in prof["segments"] if s["name"] == "layer")
    assert layer["repeat"] == 126
    # Backward: twice the forward's matmuls plus the attention scores recomputed.
    attn_qk = 2 * cfg.seq * cfg.seq * cfg.heads * cfg.hd
    assert layer["bwd_flops"] == pytest.approx(2 * layer["fwd_flops"] + attn_qk, rel=1e-12)


def _mlp_layer(p, x):
    return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]


def _mlp_profile(h=256, f=1024, s=128, layers=8):
    seg = profile_segment("mlp", _mlp_layer,
                          A._abstract({"w1": (h, f), "w2": (f, h)}),
                          jax.ShapeDtypeStruct((1, s, h), jnp.bfloat16), repeat=layers,
                          tp_collectives=1, tp_bytes=2 * s * h)
    return {"name": "mlp", "seq": s, "model_flops_per_sample": 3 * layers * seg["fwd_flops"],
            "max_tp": 8, "num_experts": 0, "segments": [seg]}


HW = {"name": "test", "gpus_per_node": 4, "peak_bf16": 1e14, "hbm_bandwidth": 1e12,
      "hbm_bytes": 80 * 2**30, "intra": {"bandwidth": 1e11, "latency": 0.0},
      "inter": {"bandwidth": 1e10, "latency": 0.0}, "efficiency": 0.5}


@pytest.mark.parametrize("pp,tp,dp,fsdp", [(1, 1, 8, False), (2, 2, 2, False), (4, 2, 1, False),
                                           (2, 1, 4, True), (1, 4, 2, True), (8, 1, 1, False)])
def test_mlp_stack_memory_and_collectives_match_hand_formulas(pp, tp, dp, fsdp):
    h, f, s, L = 256, 1024, 128, 8
    prof = _mlp_profile(h, f, s, L)
    seg = prof["segments"][0]
    P = 2 * h * f
    assert seg["params"] == P
    assert seg["fwd_flops"] == 2 * s * P          # two matmuls, 2 FLOPs per multiply-add
    assert seg["bwd_flops"] == 2 * seg["fwd_flops"]
    batch, M = 16 * dp, 8
    mb = batch // dp // M
    plan = scale.evaluate_cluster(prof, HW, pp=pp, tp=tp, dp=dp, fsdp=fsdp, global_batch=batch,
                                  schedule="1f1b", microbatches=M)
    per_gpu = P / tp / (dp if fsdp else 1)        # parameters held by one GPU per layer
    layers_rank = L // pp
    assert plan.memory.params == pytest.approx(layers_rank * 2 * per_gpu, abs=2 * L)
    assert plan.memory.grads == plan.memory.params
    opt = 14 * P / tp / dp if fsdp else 12 * P / tp / dp + 2 * P / tp
    assert plan.memory.optimizer == pytest.approx(layers_rank * opt, abs=2 * L)
    assert plan.memory.total == (plan.memory.params + plan.memory.grads + plan.memory.optimizer
                                 + plan.memory.activations)
    # Collective bytes: the TP all-reduce of each microbatch's s x h output, ring 2(t-1)/t
    # of the buffer, plus FSDP's all-gather (t-1)/t of a layer's parameters (overlapped).
    link_tp = HW["intra"] if tp <= 4 else HW["inter"]
    tp_wire = 2 * (tp - 1) / tp * (mb * 2 * s * h)
    tp_seconds = _core_time("ring_all_reduce", mb * 2 * s * h, tp, link_tp)
    assert tp_seconds == pytest.approx(tp_wire / link_tp["bandwidth"], rel=1e-12)


def test_update_in_place_is_the_default_and_can_be_declined():
    """A run's optimizer writes its new state over the old (PyTorch, Megatron, a Baton step
    with donated arguments): the peak is the static bytes plus the loop's. Declined, the new
    parameters and optimizer state sit beside the old after the loop."""
    prof = _mlp_profile()
    kw = dict(pp=2, tp=1, dp=4, global_batch=64, schedule="1f1b", microbatches=8, remat="full")
    own = scale.evaluate_cluster(prof, HW, **kw).memory
    copies = scale.evaluate_cluster(prof, HW, update_in_place=False, **kw).memory
    P, O = own.params, own.optimizer
    assert copies.total == max(own.total, 3 * P + 2 * O) > own.total
    plans = scale.plan_cluster(prof, HW, 8, 64, top=1, update_in_place=False, pp=[2], tp=[1],
                               fsdp=False)
    assert plans.plans[0].memory.total >= 3 * plans.plans[0].memory.params


def _core_time(kind, nbytes, n, link):
    from baton import _core
    return _core.collective_time(kind, nbytes, n, link["bandwidth"], link["latency"])


def test_search_ranks_plans_and_beats_a_given_configuration():
    prof = _mlp_profile()
    r = scale.plan_cluster(prof, HW, gpus=16, global_batch=64)
    times = [p.step_time for p in r.plans]
    assert times == sorted(times) and times
    given = scale.evaluate_cluster(prof, HW, pp=2, tp=2, dp=4, global_batch=64,
                                   schedule="1f1b", microbatches=8)
    assert r.plans[0].step_time <= given.step_time * 1.02
    best = r.plans[0]
    assert best.tokens_per_second == pytest.approx(64 * 128 / best.step_time)
    kw = best.jit_kwargs()
    assert kw["microbatches"] == best.microbatches
    assert len(kw["boundaries"]) == len(best.cuts) - 1
    assert sum(best.stage_layers) == 8
    assert kw["mesh_axes"]["pipeline"] * kw["mesh_axes"]["tensor"] * best.dp == 16


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="unknown model"):
        scale.get_model("llama9-1t")
    with pytest.raises(ValueError, match="unknown cluster"):
        scale.load_cluster("tpu-v9")
    with pytest.raises(ValueError, match="efficiency"):
        scale.load_cluster("h100", efficiency=2.0)
    with pytest.raises(ValueError, match="no plan fits"):
        tiny = dict(HW, hbm_bytes=2**20)
        scale.plan_cluster(_mlp_profile(), tiny, gpus=4, global_batch=8)


def test_presets_cite_sources():
    for name in scale.cluster_names():
        hw = scale.load_cluster(name)
        for key in ("peak_bf16", "hbm_bandwidth", "hbm_bytes", "intra.bandwidth",
                    "inter.bandwidth"):
            assert hw["sources"].get(key), (name, key)


def test_baton_plan_model_cli():
    exe = os.path.join(os.path.dirname(sys.executable), "baton-plan")
    out = subprocess.run(
        [exe, "--model", "gpt:layers=4,hidden=256,heads=4,vocab=1000,seq=128", "--cluster",
         "h100", "--gpus", "16", "--global-batch", "32", "--top", "3"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tokens/s" in out.stdout and "MFU" in out.stdout
    bad = subprocess.run([exe, "--model", "nope", "--cluster", "h100", "--gpus", "8",
                          "--global-batch", "8"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "unknown model" in bad.stderr


def test_calibrate_recovers_the_efficiency_of_synthetic_measurements():
    prof = _mlp_profile()
    truth = dict(HW, efficiency=0.37)
    ms = []
    for pp, tp, dp in [(2, 2, 2), (1, 4, 2)]:
        p = scale.evaluate_cluster(prof, truth, pp=pp, tp=tp, dp=dp, global_batch=32,
                                   schedule="1f1b", microbatches=4)
        ms.append(scale.Measurement(prof, pp, tp, dp, 32, "1f1b", 4, p.step_time))
    hw = scale.calibrate(HW, ms)
    assert hw["efficiency"] == pytest.approx(0.37, rel=1e-3)
    with pytest.raises(ValueError, match="step_time"):
        scale.calibrate(HW, [dataclasses.replace(ms[0], step_time=0.0)])


def test_moe_profile_and_expert_parallel_memory():
    cfg = scale.get_model("llama:layers=2,hidden=128,ffn=256,heads=4,experts=4,top_k=2,"
                          "moe_ffn=256,vocab=1000,seq=64")
    prof = scale.profile_model(cfg)
    moe = next(s for s in prof["segments"] if s["name"] == "moe_layer")
    assert moe["repeat"] == 2 and prof["num_experts"] == 4
    assert moe["expert_params"] == 4 * 3 * 128 * 256
    # Balanced routing: the experts' matmuls count top_k x tokens x one expert's FLOPs.
    dense_part = 2 * 64 * (4 * 128 * 128 + 128 * 4)  # q, k, v, o projections and the router
    attn = 4 * 64 * 64 * 128
    assert moe["fwd_flops"] == 2 * 64 * 2 * 3 * 128 * 256 + dense_part + attn
    assert moe["a2a_collectives"] == 2 and moe["a2a_bytes"] == 2 * (2 * 64 * 128)
    one = scale.evaluate_cluster(prof, HW, pp=1, tp=1, dp=4, ep=1, global_batch=8,
                                 schedule="1f1b", microbatches=2)
    two = scale.evaluate_cluster(prof, HW, pp=1, tp=1, dp=4, ep=2, global_batch=8,
                                 schedule="1f1b", microbatches=2)
    # Expert weights are split over the expert axis: half of them leave each GPU.
    assert one.memory.params - two.memory.params == pytest.approx(
        2 * moe["repeat"] * moe["expert_params"] / 2, abs=8)
    assert two.step_time > 0
    r = scale.plan_cluster(prof, HW, gpus=8, global_batch=16, ep=[2], top=3)
    assert r.plans and all(p.ep == 2 for p in r.plans)


def test_16384_gpu_search_takes_seconds():
    prof = scale.profile_model("llama3-405b")
    t0 = time.perf_counter()
    r = scale.plan_cluster(prof, "h100", 16384, 2048, top=3, offload=False)
    assert time.perf_counter() - t0 < 60
    best = r.plans[0]
    assert best.pp * best.tp * best.dp == 16384
    assert best.memory.total <= 76 * 2**30 and best.fits
    assert 0.2 < best.mfu < 0.7


def test_offload_keeps_the_stashes_recompute_would_drop():
    """Llama 3 405B on 16,384 H100 (pp 32 x tp 8): without offload the best plan recomputes
    part of most stages to fit in 76 GiB. Over PCIe (63 GB/s a direction) moving a layer's
    stash costs more than recomputing it, so the search keeps recomputing; over a Grace
    Hopper-class host link (NVLink-C2C, 450 GB/s a direction) every stage keeps its
    residuals and offloads them, the step is faster, and host memory holds what the device
    no longer does, within the preset's host bytes per GPU."""
    from baton.errors import ConfigError
    prof = scale.profile_model("llama3-405b")
    kw = dict(top=1, pp=[32], tp=[8], fsdp=False, tp_overlap=True, dp_overlap=True, gap=0.0)
    hw = scale.load_cluster("h100")
    c2c = dict(hw, host_link=dict(hw["host_link"], bandwidth=450e9))
    plain = scale.plan_cluster(prof, c2c, 16384, 2048, offload=False, **kw).plans[0]
    pcie = scale.plan_cluster(prof, hw, 16384, 2048, **kw).plans[0]
    off = scale.plan_cluster(prof, c2c, 16384, 2048, **kw).plans[0]
    assert sum(m != "keep" for m in plain.remat) > len(plain.remat) // 2
    assert not plain.offload and plain.memory.host == 0
    assert not pcie.offload and pcie.step_time == pytest.approx(plain.step_time)
    assert "stash" in off.offload and set(off.remat) == {"keep"}
    assert off.step_time < plain.step_time and off.mfu > plain.mfu
    assert off.memory.total <= 76 * 2**30 and 0 < max(off.peak_host) <= hw["host_bytes"]
    # each offloading stage's rank holds host bytes; the others none
    on_host = {k % 32 for k, o in enumerate(off.offload) if o == "stash"}
    assert {r for r, h in enumerate(off.peak_host) if h > 0} == on_host
    assert off.jit_kwargs()["offload"] == {k: "stash" for k, o in enumerate(off.offload)
                                           if o == "stash"}
    assert plain.jit_kwargs()["offload"] is None
    assert "host" in scale.plan_cluster(prof, c2c, 16384, 2048, **kw).table()
    # host memory bounds it: a quarter of what that plan holds forbids it
    cap = max(off.peak_host) // 4
    capped = scale.plan_cluster(prof, dict(c2c, host_bytes=cap), 16384, 2048, **kw).plans[0]
    assert max(capped.peak_host, default=0) <= cap
    # a cluster file without a host link: not searched, and refused by name when asked for
    bare = {k: v for k, v in hw.items() if k != "host_link"}
    assert not scale.plan_cluster(prof, bare, 16384, 2048, **kw).plans[0].offload
    with pytest.raises(ConfigError, match="host_link"):
        scale.plan_cluster(prof, bare, 16384, 2048, offload=True, **kw)
