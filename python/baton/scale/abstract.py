"""Abstract profile of a real-size model: one training step traced with
``jax.ShapeDtypeStruct`` arguments (nothing is allocated), one layer per distinct layer
kind, multiplied by its repeat count (docs/SCALE.md, "Model profile").

Counted from the traced jaxprs (one sample of ``seq`` tokens, bf16):

- FLOPs: every ``dot_general`` contributes 2 x (output elements) x (contracted size), in
  every nested jaxpr (jit calls, checkpoint regions, custom derivatives). Elementwise ops,
  reductions and softmax are not counted (they run at memory speed, fused). ``fwd_flops``
  from the forward jaxpr; ``bwd_flops`` = FLOPs of the ``jax.vjp`` jaxpr (forward +
  backward) minus the forward, so the attention core's recomputation (it is a
  ``jax.checkpoint`` region, as a fused flash-attention kernel recomputes its scores) is
  included; ``wgrad_flops`` = FLOPs of forward matmuls with a parameter operand (their
  weight gradient costs as much).
- HBM bytes: operand and result bytes of every forward ``dot_general``.
- Stash: ``keep`` = bytes of the residuals ``jax.vjp`` keeps (its outputs that are not
  parameters); ``min`` = residuals under
  ``jax.checkpoint(policy=dots_with_no_batch_dims_saveable)`` (the linear layers' outputs
  kept; the elementwise work and the attention core, whose score matmuls have batch
  dimensions, recomputed and costed by the cluster model); ``full`` = the layer's input.
- Temporaries: the largest single forward value outside checkpoint regions.
- Collectives implied by the sharding (documented formulas, not traced): Megatron TP has
  2 all-reduces of the s x h activation per transformer layer in the forward (attention
  output, MLP output) and 2 in the backward; 1 for the vocabulary-parallel embedding and
  1 for the head. An MoE layer adds 2 all-to-alls (dispatch, combine) of top_k x s x h.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from .._jax_compat import is_literal, jaxpr_parts, open_jaxpr, sub_jaxprs
from .models import TransformerConfig

BF16 = jnp.bfloat16
_SHAPE_OPS = {"convert_element_type", "reshape", "transpose", "broadcast_in_dim", "squeeze",
              "copy", "copy_p"}


def _nbytes(aval) -> int:
    return int(math.prod(aval.shape)) * jnp.dtype(aval.dtype).itemsize


def _dot_flops(eqn) -> float:
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    contracted = math.prod(lhs.shape[d] for d in lc)
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted


@dataclasses.dataclass
class JaxprCounts:
    flops: float = 0.0
    param_flops: float = 0.0  # matmuls with a parameter operand
    dot_bytes: float = 0.0
    largest: int = 0  # largest value outside checkpoint regions
    # Matmuls outside checkpoint regions, as the profile's "matmuls" entries (m, n, k,
    # count, linear); the FLOPs of those inside (attention's core) in ``attn_flops``.
    matmuls: list = dataclasses.field(default_factory=list)
    attn_flops: float = 0.0
    # The activation operand of each linear matmul -> (the variable, kept alive so that its
    # id stays unique; the index of the first matmul reading it): matmuls that read the
    # same activation (q, k and v; an MLP's gate and up) carry that index as "input".
    inputs: dict = dataclasses.field(default_factory=dict)


def _dot_shape(eqn, param_operand: int | None) -> dict:
    """(m, n, k, count) of a dot_general: m the lhs's free size (times the batch unless the
    parameter operand is batched, as an expert's weights are: then count = batch)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    batch = math.prod(lhs[d] for d in lb)
    k = math.prod(lhs[d] for d in lc)
    m = math.prod(lhs[d] for d in range(len(lhs)) if d not in lc and d not in lb)
    n = math.prod(rhs[d] for d in range(len(rhs)) if d not in rc and d not in rb)
    if param_operand == 0:  # parameter on the left: the activation's rows are n
        m, n = n, m
    if param_operand is not None and batch > 1:
        return {"m": float(m), "n": int(n), "k": int(k), "count": int(batch), "linear": True}
    return {"m": float(batch * m), "n": int(n), "k": int(k), "count": 1,
            "linear": param_operand is not None}


def count(closed, param_positions=()) -> JaxprCounts:
    """FLOPs and bytes of a (closed) jaxpr, recursing into nested jaxprs; the invars at
    ``param_positions`` are parameters (tracked through casts, reshapes and calls)."""
    out = JaxprCounts()
    _, _, invars, _, _ = jaxpr_parts(closed) if hasattr(closed, "jaxpr") else (
        None, None, closed.invars, None, None)
    _count(open_jaxpr(closed), {id(invars[k]): k for k in param_positions}, out, top=True)
    return out


def _count(jaxpr, params: dict, out: JaxprCounts, top: bool, in_ckpt: bool = False) -> None:
    # params: id of a variable holding a parameter (or a cast / reshape of one) -> the
    # parameter's leaf index
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [None if is_literal(v) else id(v) for v in eqn.invars]
        if name == "dot_general":
            f = _dot_flops(eqn)
            out.flops += f
            out.dot_bytes += sum(_nbytes(v.aval) for v in eqn.invars + eqn.outvars)
            if any(i in params for i in ins):
                out.param_flops += f
            if in_ckpt:
                out.attn_flops += f
            else:
                po = next((j for j, i in enumerate(ins[:2]) if i in params), None)
                shared = -1
                if po is not None and ins[1 - po] is not None:
                    act = eqn.invars[1 - po]
                    if id(act) in out.inputs:
                        shared = out.inputs[id(act)][1]
                    else:
                        out.inputs[id(act)] = (act, len(out.matmuls))
                out.matmuls.append(dict(_dot_shape(eqn, po), input=shared,
                                        param=None if po is None else params[ins[po]]))
        elif name in _SHAPE_OPS and ins and ins[0] in params:
            params[id(eqn.outvars[0])] = params[ins[0]]
        subs = sub_jaxprs(eqn)
        for sub in subs:
            inner = open_jaxpr(sub)
            mapped = {}
            if len(inner.invars) == len(eqn.invars):
                mapped = {id(iv): params[o] for iv, o in zip(inner.invars, ins) if o in params}
            _count(inner, mapped, out, top=False,
                   in_ckpt=in_ckpt or name in ("checkpoint", "remat2"))
        if top and name not in ("checkpoint", "remat2"):
            for v in eqn.outvars:
                out.largest = max(out.largest, _nbytes(v.aval))


# --- the model's functions (shapes matter, values do not) ---------------------------------

def _rms(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)


def _attention_core(q, k, v):
    # q: [b, s, H, d], k/v: [b, s, K, d] with H = g K (grouped-query attention).
    b, s, nh, d = q.shape
    g = nh // k.shape[2]
    q = q.reshape(b, s, k.shape[2], g, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / math.sqrt(d)
    p = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    o = jnp.einsum("bkgqs,bskd->bqkgd", p, v)
    return o.reshape(b, s, nh * d)


def _attention(cfg: TransformerConfig, p, x):
    b, s, _ = x.shape
    h = _rms(x)
    q = (h @ p["wq"]).reshape(b, s, cfg.heads, cfg.hd)
    k = (h @ p["wk"]).reshape(b, s, cfg.kv_heads, cfg.hd)
    v = (h @ p["wv"]).reshape(b, s, cfg.kv_heads, cfg.hd)
    o = jax.checkpoint(_attention_core)(q, k, v)
    return x + o @ p["wo"]


def _mlp(cfg: TransformerConfig, w, x):
    if cfg.mlp == "gelu":
        return jax.nn.gelu(x @ w["w1"]) @ w["w2"]
    return (jax.nn.silu(x @ w["w1"]) * (x @ w["w3"])) @ w["w2"]


def _moe(cfg: TransformerConfig, p, x):
    # Balanced routing: each expert takes C = tokens x top_k / experts tokens, modelled as
    # a gather into [E, C, h] and a scatter-add back (no FLOPs), so the expert matmuls
    # count exactly top_k x tokens x (one expert's FLOPs per token).
    b, s, hdim = x.shape
    t = x.reshape(b * s, hdim)
    logits = t @ p["router"]
    weights, idx = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32)), cfg.top_k)
    cap = b * s * cfg.top_k // cfg.experts
    token_of = (idx.reshape(-1) % (b * s))[: cfg.experts * cap].reshape(cfg.experts, cap)
    xe = t[token_of]
    if cfg.mlp == "gelu":
        ye = jnp.einsum("ecf,efh->ech", jax.nn.gelu(jnp.einsum("ech,ehf->ecf", xe, p["e1"])),
                        p["e2"])
    else:
        a = jax.nn.silu(jnp.einsum("ech,ehf->ecf", xe, p["e1"]))
        ye = jnp.einsum("ecf,efh->ech", a * jnp.einsum("ech,ehf->ecf", xe, p["e3"]), p["e2"])
    gate = weights.reshape(-1)[: cfg.experts * cap].reshape(cfg.experts, cap, 1)
    y = jnp.zeros_like(t).at[token_of.reshape(-1)].add((ye * gate.astype(ye.dtype)).reshape(-1, hdim))
    if cfg.shared_experts:
        y = y + _mlp(cfg, p["shared"], t)
    return y.reshape(b, s, hdim)


def _layer(cfg: TransformerConfig, moe: bool):
    def f(p, x):
        x = _attention(cfg, p, x)
        h = _rms(x)
        return x + (_moe(cfg, p, h) if moe else _mlp(cfg, p["mlp"], h))
    return f


def _mlp_params(cfg: TransformerConfig, ffn: int, lead=()):
    shapes = {"w1": (*lead, cfg.hidden, ffn), "w2": (*lead, ffn, cfg.hidden)}
    if cfg.mlp != "gelu":
        shapes["w3"] = (*lead, cfg.hidden, ffn)
    return shapes


def _layer_params(cfg: TransformerConfig, moe: bool) -> dict:
    h, q, kv = cfg.hidden, cfg.heads * cfg.hd, cfg.kv_heads * cfg.hd
    p = {"wq": (h, q), "wk": (h, kv), "wv": (h, kv), "wo": (q, h), "norm1": (h,),
         "norm2": (h,)}
    if moe:
        p["router"] = (h, cfg.experts)
        p.update({"e" + k[1:]: v for k, v in _mlp_params(cfg, cfg.moe_ffn, (cfg.experts,)).items()})
        if cfg.shared_experts:
            p["shared"] = _mlp_params(cfg, cfg.moe_ffn * cfg.shared_experts)
    else:
        p["mlp"] = _mlp_params(cfg, cfg.ffn)
    return p


def _abstract(shapes):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, BF16), shapes,
                        is_leaf=lambda s: isinstance(s, tuple))
