"""A model's abstract profile (the JSON ``baton-plan --profile`` and ``plan_cluster`` take):
each distinct layer kind traced once at one sample with ``jax.make_jaxpr`` on
``jax.ShapeDtypeStruct`` arguments and counted by :mod:`baton.scale.abstract`."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp

from . import abstract as A
from .models import TransformerConfig, get_model


def _residual_bytes(f, params, x, param_count: int) -> int:
    closed = jax.make_jaxpr(lambda p, a: jax.vjp(f, p, a)[1])(params, x)
    _, _, invars, outvars, _ = A.jaxpr_parts(closed)
    skip = {id(v) for v in invars[:param_count]}
    seen, total = set(), 0
    for v in outvars:
        if A.is_literal(v) or id(v) in skip or id(v) in seen:
            continue
        seen.add(id(v))
        total += A._nbytes(v.aval)
    return total


# Megatron's tensor-parallel split of each weight: row-parallel (the contracted dimension
# sharded) for the attention output and the MLP's / experts' down projections, replicated
# for the MoE router, column-parallel (the output sharded) for every other weight.
ROW_PARALLEL = {"wo", "w2", "e2"}
REPLICATED = {"router"}


def _leaf_names(params) -> list[str]:
    paths, _ = jax.tree_util.tree_flatten_with_path(params)
    return [str(getattr(path[-1], "key", path[-1])) for path, _ in paths]


def _tp_dim(mm: dict, names: list[str]) -> int:
    if mm["param"] is None:
        return 0
    name = names[mm["param"]]
    return 0 if name in REPLICATED else 2 if name in ROW_PARALLEL else 1


def profile_segment(name: str, f, params, x, *, repeat: int = 1, tp_collectives: int = 0,
                    tp_bytes: int = 0, a2a_collectives: int = 0, a2a_bytes: int = 0,
                    hidden: int | None = None, mem_bytes: float = 0.0, kernels: int = 0,
                    causal: bool = True, attn_scores: float = 0.0,
                    mem_bytes_replicated: float = 0.0, a2a_top_k: int = 0,
                    checkpointed: bool = True) -> dict:
    """One segment kind's entry of the profile (see :mod:`baton.scale.abstract`):
    ``f(params, x)`` at one sample, ``params``/``x`` abstract (``ShapeDtypeStruct``).
    Each linear layer's tensor-parallel split follows its weight's name (ROW_PARALLEL,
    REPLICATED); ``mem_bytes`` and ``kernels`` are the forward's memory-bound bytes and non-matmul
    kernels (docs/SCALE.md, "Time from physical parts"); ``mem_bytes_replicated`` the part
    of ``mem_bytes`` outside the TP regions (split over TP ranks only with sequence
    parallelism); ``a2a_top_k`` the experts each token's all-to-all copies go to.
    ``checkpointed``: whether full recomputation checkpoints this segment (the transformer
    layers); the embedding and the head are not (Megatron-LM's and torchtitan's full
    recomputation wrap the layers only, as the plan's ``checkpoint_stages`` do), so their
    ``stash_full`` is what they keep without recomputation."""
    n_params = len(jax.tree.leaves(params))
    names = _leaf_names(params)
    fwd = jax.make_jaxpr(f)(params, x)
    fc = A.count(fwd, range(n_params))
    out_avals = jax.eval_shape(f, params, x)
    if jnp.issubdtype(jnp.result_type(x), jnp.integer):
        g = lambda p, a: jax.vjp(lambda q: f(q, a), p)[1](out_avals)  # noqa: E731
        keep_f = lambda p, a: f(p, a)  # noqa: E731
        bwd_closed = jax.make_jaxpr(lambda p, a: g(p, a))(params, x)
    else:
        ct = jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype), out_avals)
        bwd_closed = jax.make_jaxpr(lambda p, a, c: jax.vjp(f, p, a)[1](c))(params, x, ct)
        keep_f = f
    total = A.count(bwd_closed, range(n_params))
    if jnp.issubdtype(jnp.result_type(x), jnp.integer):
        keep = _residual_bytes(lambda p, a: keep_f(p, a), params, x, n_params)
        stash_min = keep
    else:
        keep = _residual_bytes(f, params, x, n_params)
        stash_min = _residual_bytes(
            jax.checkpoint(f, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable), params, x, n_params)
    out_bytes = sum(A._nbytes(o) for o in jax.tree.leaves(out_avals))
    return {
        "name": name, "repeat": repeat,
        "fwd_flops": fc.flops, "bwd_flops": max(0.0, total.flops - fc.flops),
        "wgrad_flops": min(fc.param_flops, max(0.0, total.flops - fc.flops)),
        "hbm_bytes": fc.dot_bytes,
        "params": sum(math.prod(p.shape) for p in jax.tree.leaves(params)),
        "expert_params": 0,
        "act_bytes": out_bytes if out_bytes > 64 else 0,
        "stash_keep": keep, "stash_min": min(stash_min, keep), "min_recompute_flops": 0.0,
        "stash_full": A._nbytes(x) if checkpointed else keep, "temp_bytes": fc.largest,
        "tp_collectives": tp_collectives, "tp_bytes": tp_bytes,
        "a2a_collectives": a2a_collectives, "a2a_bytes": a2a_bytes, "a2a_top_k": a2a_top_k,
        "matmuls": [{"m": mm["m"], "n": mm["n"], "k": mm["k"], "count": mm["count"],
                     "linear": mm["linear"], "tp_dim": _tp_dim(mm, names),
                     "expert": mm["count"] > 1, "input": mm["input"]} for mm in fc.matmuls],
        "attn_flops": fc.attn_flops, "attn_scores": float(attn_scores), "attn_causal": causal,
        "mem_bytes": float(mem_bytes), "kernels": int(kernels),
        "mem_bytes_replicated": float(mem_bytes_replicated),
    }


def _embed(p, tokens):
    return p["emb"][tokens]


def _head(p, x):
    logits = (A._rms(x) @ p["out"]).astype(jnp.float32)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])


# Non-matmul kernels per forward (an assumption, docs/SCALE.md): a transformer layer's
# two norms, two residual adds, rotary embedding, the MLP activation, fused attention and
# its layout copy; an MoE layer adds the router's softmax / top-k, the permutation and its
# inverse, and the experts' activation; the embedding is one gather; the head its norm,
# the loss's softmax and reduction.
KERNELS = {"embed": 1, "layer": 8, "moe_layer": 14, "head": 3}


def layer_mem_bytes(cfg: TransformerConfig, moe: bool) -> float:
    """Forward HBM bytes of one layer's memory-bound work per sample, each fused op reading
    its inputs and writing its output once (bf16): two RMSNorms (read + write s x h: 8sh),
    two residual adds (read 2, write 1: 12sh), rotary embedding on q and k
    (4 s (q + kv)), and the MLP activation (SwiGLU reads two s x f and writes one: 6sf;
    GELU 4sf). An MoE layer's dispatch and combine copy top_k x s x h each way
    (8 top_k s h) and its activation runs on top_k x s x moe_ffn (+ the shared experts)."""
    s, h = cfg.seq, cfg.hidden
    q, kv = cfg.heads * cfg.hd, cfg.kv_heads * cfg.hd
    act = 6 if cfg.mlp != "gelu" else 4
    base = 20 * s * h + 4 * s * (q + kv)
    if not moe:
        return float(base + act * s * cfg.ffn)
    return float(base + 8 * cfg.top_k * s * h + act * s * cfg.moe_ffn *
                 (cfg.top_k + cfg.shared_experts))


def profile_model(model: TransformerConfig | str, seq: int | None = None) -> dict:
    """The profile dict of ``model`` (a :class:`TransformerConfig` or a name for
    :func:`~baton.scale.models.get_model`) at ``seq`` tokens per sample."""
    cfg = get_model(model, seq) if isinstance(model, str) else model.with_seq(seq)
    s, h = cfg.seq, cfg.hidden
    act = jax.ShapeDtypeStruct((1, s, h), A.BF16)
    act_bytes = 2 * s * h
    segs = [profile_segment(
        "embed", _embed, A._abstract({"emb": (cfg.vocab, h)}),
        jax.ShapeDtypeStruct((1, s), jnp.int32), tp_collectives=1, tp_bytes=act_bytes,
        hidden=h, mem_bytes=4.0 * s * h, kernels=KERNELS["embed"], checkpointed=False)]
    n_moe = cfg.layers - cfg.dense_layers if cfg.experts else 0
    n_dense = cfg.layers - n_moe
    if n_dense:
        segs.append(profile_segment(
            "layer", A._layer(cfg, False), A._abstract(A._layer_params(cfg, False)), act,
            repeat=n_dense, tp_collectives=2, tp_bytes=act_bytes, hidden=h,
            attn_scores=float(cfg.heads * s * s),
            mem_bytes=layer_mem_bytes(cfg, False), mem_bytes_replicated=20.0 * s * h,
            kernels=KERNELS["layer"]))
    if n_moe:
        seg = profile_segment(
            "moe_layer", A._layer(cfg, True), A._abstract(A._layer_params(cfg, True)), act,
            repeat=n_moe, tp_collectives=2, tp_bytes=act_bytes, a2a_collectives=2,
            a2a_bytes=cfg.top_k * act_bytes, a2a_top_k=cfg.top_k, hidden=h, mem_bytes=layer_mem_bytes(cfg, True),
            mem_bytes_replicated=20.0 * s * h,
            attn_scores=float(cfg.heads * s * s),
            kernels=KERNELS["moe_layer"])
        seg["expert_params"] = len([k for k in ("e1", "e2", "e3")
                                    if cfg.mlp != "gelu" or k != "e3"]) * cfg.experts * h * cfg.moe_ffn
        segs.append(seg)
    segs.append(profile_segment(
        "head", _head, A._abstract({"out": (h, cfg.vocab), "norm": (h,)}), act,
        tp_collectives=1, tp_bytes=act_bytes, hidden=h,
        # the norm (4sh) and the loss: the logits written, read by the softmax (4 s V)
        mem_bytes=4.0 * s * h + 4.0 * s * cfg.vocab, kernels=KERNELS["head"],
        checkpointed=False))
    fwd = sum(x["fwd_flops"] * x["repeat"] for x in segs)
    return {"name": cfg.name, "seq": s, "model_flops_per_sample": 3.0 * fwd,
            "max_tp": math.gcd(cfg.heads, 64), "num_experts": cfg.experts, "segments": segs}


def profile_json(model, seq: int | None = None) -> str:
    return json.dumps(profile_model(model, seq))
