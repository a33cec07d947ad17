"""A GPT whose blocks have mixture-of-experts feed-forward layers (Flax Linen), cut into
pipeline stages: top-k routing with a load-balancing auxiliary loss, experts sharded over an
``expert`` mesh axis.

Each MoE layer routes every token to its ``top_k`` best experts (softmax router, capacity
``capacity_factor * tokens * top_k / experts`` per expert; tokens over capacity are dropped,
as in GShard / Switch) with one-hot dispatch and combine tensors. The experts' weights carry
``PartitionSpec("expert", ...)`` (``param_specs``) and the dispatched tokens a sharding
constraint over the ``expert`` axis, so XLA's SPMD partitioner turns the dispatch and combine
einsums into all-to-alls between the devices of a stage (the GShard formulation). Without a
mesh (plain ``jax.jit`` on one device) the same code runs unsharded. The router's
load-balancing loss (Switch Transformer: ``experts * sum_e(fraction_e * mean_prob_e)``) is
added to the training loss with weight ``aux_weight``.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import baton
from gpt import synthetic_batch  # noqa: F401  (the same synthetic tokens: cfg.seq, cfg.vocab)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    vocab: int = 64
    seq: int = 16
    dim: int = 32
    heads: int = 4
    layers: int = 2
    stages: int = 2
    experts: int = 4
    top_k: int = 2
    capacity_factor: float = 2.0
    aux_weight: float = 0.01
    expert_axis: str | None = None  # the mesh axis the experts are sharded over


def _constrain(x, spec):
    """``with_sharding_constraint`` when a mesh axis is named (inside baton.jit the constraint
    is moved onto each rank's sub-mesh); a no-op without one."""
    if spec is None:
        return x
    mesh = _MESH.get("mesh")
    if mesh is None:
        return x
    from jax.sharding import NamedSharding

    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


_MESH: dict = {}


def use_mesh(mesh) -> None:
    """The mesh whose axes the MoE layers' sharding constraints name (None: unsharded)."""
    _MESH["mesh"] = mesh


class MoE(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        b, s, d = x.shape
        tokens = x.reshape(b * s, d)
        n = tokens.shape[0]
        E, k = c.experts, c.top_k
        cap = max(1, int(c.capacity_factor * n * k / E))
        logits = nn.Dense(E, use_bias=False, name="router")(tokens)
        probs = jax.nn.softmax(logits, axis=-1)  # [n, E]
        gate, idx = jax.lax.top_k(probs, k)  # [n, k]
        gate = gate / jnp.sum(gate, axis=-1, keepdims=True)
        # position of each (token, choice) in its expert's queue, choice 0 of every token first
        onehot = jax.nn.one_hot(idx, E, dtype=jnp.int32)  # [n, k, E]
        flat = onehot.transpose(1, 0, 2).reshape(k * n, E)
        pos = (jnp.cumsum(flat, axis=0) - 1).reshape(k, n, E).transpose(1, 0, 2)
        keep = (pos < cap) & (onehot > 0)  # [n, k, E]
        slot = jax.nn.one_hot(jnp.where(keep, pos, cap), cap + 1, dtype=x.dtype)[..., :cap]
        dispatch = jnp.sum(slot * keep[..., None].astype(x.dtype), axis=1)  # [n, E, cap]
        combine = jnp.sum(slot * (keep.astype(x.dtype) * gate[..., None])[..., None], axis=1)
        spec_e = None if c.expert_axis is None else jax.sharding.PartitionSpec(c.expert_axis)
        expert_in = _constrain(jnp.einsum("nd,nec->ecd", tokens, dispatch), spec_e)
        w1 = self.param("w1", nn.initializers.lecun_normal(), (E, d, 4 * d))
        w2 = self.param("w2", nn.initializers.lecun_normal(), (E, 4 * d, d))
        h = nn.gelu(jnp.einsum("ecd,edf->ecf", expert_in, w1))
        expert_out = _constrain(jnp.einsum("ecf,efd->ecd", h, w2), spec_e)
        out = jnp.einsum("ecd,nec->nd", expert_out, combine)
        # load balancing (Switch): fraction of tokens whose first choice is e x mean router prob
        frac = jnp.mean(jax.nn.one_hot(idx[:, 0], E, dtype=x.dtype), axis=0)
        aux = E * jnp.sum(frac * jnp.mean(probs, axis=0))
        return out.reshape(b, s, d), aux


class Block(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.MultiHeadDotProductAttention(
            num_heads=c.heads, qkv_features=c.dim, deterministic=True, use_bias=False
        )(h, mask=mask)
        x = x + h
        h, aux = MoE(c)(nn.LayerNorm()(x))
        return x + h, aux


class MoEGPT(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        embed = nn.Embed(c.vocab, c.dim, name="embed")
        pos = self.param("pos", nn.initializers.normal(0.02), (c.seq, c.dim))
        x = embed(tokens) + pos[None, : tokens.shape[1]]
        aux = jnp.zeros((), x.dtype)
        per_stage = max(c.layers // c.stages, 1)
        for i in range(c.layers):
            x, a = Block(c, name=f"block{i}")(x)
            aux = aux + a
            if (i + 1) % per_stage == 0 and (i + 1) // per_stage < c.stages:
                # the auxiliary loss so far crosses the boundary with the activations
                x, aux = baton.stage_boundary((x, aux))
        x = nn.LayerNorm(name="ln_f")(x)
        return embed.attend(x), aux


def loss_fn(model: MoEGPT, params, batch):
    tokens, targets = batch
    logits, aux = model.apply({"params": params}, tokens)
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
    return nll + model.cfg.aux_weight * aux / model.cfg.layers


def param_specs(params, expert: str | None = "expert"):
    """``PartitionSpec``s: each MoE layer's expert weights split over ``expert`` (their first
    dimension), everything else replicated."""
    from jax.sharding import PartitionSpec as P

    def spec(path, x):
        name = jax.tree_util.keystr(path)
        if ("['w1']" in name or "['w2']" in name) and expert:
            return P(expert)
        return P()

    return jax.tree_util.tree_map_with_path(spec, params)


def make(cfg: MoEConfig, lr: float = 1e-3, seed: int = 0, eps: float = 1e-6):
    """Returns (model, params, optimizer, opt_state, train_step, reference_step)."""
    model = MoEGPT(cfg)
    # jitted: one compile instead of one per operation of the initializers (eager, each
    # operation of a new shape compiles; the MoE's routing makes many)
    tokens = jnp.zeros((1, cfg.seq), jnp.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(seed), tokens)["params"]
    opt = optax.adamw(lr, eps=eps, weight_decay=0.01)
    opt_state = jax.jit(opt.init)(params)

    def train_step(params, opt_state, batch):
        loss, grads = baton.accumulate(
            jax.value_and_grad(lambda p, b: loss_fn(model, p, b)), params, batch=batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def reference_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, batch))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return model, params, opt, opt_state, train_step, reference_step
