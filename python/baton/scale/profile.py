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


def profile_segment(name: str, f, params, x, *, repeat: int = 1, tp_collectives: int = 0,
                    tp_bytes: int = 0, a2a_collectives: int = 0, a2a_bytes: int = 0) -> dict:
    """One segment kind's entry of the profile (see :mod:`baton.scale.abstract`):
    ``f(params, x)`` at one sample, ``params``/``x`` abstract (``ShapeDtypeStruct``)."""
    n_params = len(jax.tree.leaves(params))
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
            jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable), params, x, n_params)
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
        "stash_full": A._nbytes(x), "temp_bytes": fc.largest,
        "tp_collectives": tp_collectives, "tp_bytes": tp_bytes,
        "a2a_collectives": a2a_collectives, "a2a_bytes": a2a_bytes,
    }


def _embed(p, tokens):
    return p["emb"][tokens]


def _head(p, x):
    logits = (A._rms(x) @ p["out"]).astype(jnp.float32)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])


def profile_model(model: TransformerConfig | str, seq: int | None = None) -> dict:
    """The profile dict of ``model`` (a :class:`TransformerConfig` or a name for
    :func:`~baton.scale.models.get_model`) at ``seq`` tokens per sample."""
    cfg = get_model(model, seq) if isinstance(model, str) else model.with_seq(seq)
    s, h = cfg.seq, cfg.hidden
    act = jax.ShapeDtypeStruct((1, s, h), A.BF16)
    act_bytes = 2 * s * h
    segs = [profile_segment(
        "embed", _embed, A._abstract({"emb": (cfg.vocab, h)}),
        jax.ShapeDtypeStruct((1, s), jnp.int32), tp_collectives=1, tp_bytes=act_bytes)]
    n_moe = cfg.layers - cfg.dense_layers if cfg.experts else 0
    n_dense = cfg.layers - n_moe
    if n_dense:
        segs.append(profile_segment(
            "layer", A._layer(cfg, False), A._abstract(A._layer_params(cfg, False)), act,
            repeat=n_dense, tp_collectives=2, tp_bytes=act_bytes))
    if n_moe:
        seg = profile_segment(
            "moe_layer", A._layer(cfg, True), A._abstract(A._layer_params(cfg, True)), act,
            repeat=n_moe, tp_collectives=2, tp_bytes=act_bytes, a2a_collectives=2,
            a2a_bytes=cfg.top_k * act_bytes)
        seg["expert_params"] = len([k for k in ("e1", "e2", "e3")
                                    if cfg.mlp != "gelu" or k != "e3"]) * cfg.experts * h * cfg.moe_ffn
        segs.append(seg)
    segs.append(profile_segment(
        "head", _head, A._abstract({"out": (h, cfg.vocab), "norm": (h,)}), act,
        tp_collectives=1, tp_bytes=act_bytes))
    fwd = sum(x["fwd_flops"] * x["repeat"] for x in segs)
    return {"name": cfg.name, "seq": s, "model_flops_per_sample": 3.0 * fwd,
            "max_tp": math.gcd(cfg.heads, 64), "num_experts": cfg.experts, "segments": segs}


def profile_json(model, seq: int | None = None) -> str:
    return json.dumps(profile_model(model, seq))
