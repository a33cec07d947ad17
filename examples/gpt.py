"""A small GPT-style decoder (Flax Linen) cut into pipeline stages, trained with Optax AdamW.

Embedding -> N pre-norm transformer blocks -> final LayerNorm -> LM head tied to the
embedding (``Embed.attend``). ``stages`` stage boundaries are placed between blocks,
so the embedding lives on the first stage and the head on the last: the tied
embedding's gradient is summed across the first and last stage after the
microbatch loop. Data: synthetic tokens (a fixed random sequence shifted by one).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import baton


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq: int = 16
    dim: int = 32
    heads: int = 2
    layers: int = 4
    stages: int = 4  # number of pipeline stages the model is cut into
    remat: bool = False  # jax.checkpoint each block


class Block(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.MultiHeadDotProductAttention(
            num_heads=c.heads, qkv_features=c.dim, deterministic=True, use_bias=False
        )(h, mask=mask)
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * c.dim)(h)
        h = nn.gelu(h)
        h = nn.Dense(c.dim)(h)
        return x + h


class GPT(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        embed = nn.Embed(c.vocab, c.dim, name="embed")
        pos = self.param("pos", nn.initializers.normal(0.02), (c.seq, c.dim))
        x = embed(tokens) + pos[None, : tokens.shape[1]]
        per_stage = max(c.layers // c.stages, 1)
        block = nn.remat(Block) if c.remat else Block
        for i in range(c.layers):
            x = block(c, name=f"block{i}")(x)
            if (i + 1) % per_stage == 0 and (i + 1) // per_stage < c.stages:
                x = baton.stage_boundary(x)
        x = nn.LayerNorm(name="ln_f")(x)
        return embed.attend(x)  # LM head tied to the embedding


def loss_fn(model: GPT, params, batch):
    tokens, targets = batch
    logits = model.apply({"params": params}, tokens)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def synthetic_batch(cfg: GPTConfig, batch: int, seed: int = 0):
    key = jax.random.PRNGKey(seed)
    seq = jax.random.randint(key, (batch, cfg.seq + 1), 0, cfg.vocab)
    return seq[:, :-1], seq[:, 1:]


def scan_step(model: GPT, opt, microbatches: int):
    """The non-pipelined baseline the benchmarks compare against: the same training step with
    the microbatch loop as one ``lax.scan`` (``baton.accumulate`` outside ``baton.jit``) and the
    optimizer after it; wrap it in ``jax.jit``."""

    def step(params, opt_state, batch):
        loss, grads = baton.accumulate(
            jax.value_and_grad(lambda p, b: loss_fn(model, p, b)), params, batch=batch,
            microbatches=microbatches)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def param_specs(params, tensor: str | None = None, fsdp: str | None = None):
    """``PartitionSpec``s for ``params`` (pass as ``baton.jit(param_shardings=...)``).

    ``tensor``: Megatron-style tensor parallelism over that mesh axis: attention heads
    (query/key/value kernels split by head, the output projection by its head input) and the
    MLP (first kernel by its output columns, second by its input rows), the embedding by
    vocabulary; XLA inserts the all-reduces. ``fsdp``: every parameter also split over that
    axis along a dimension tensor parallelism leaves alone (ZeRO-3 / FSDP: gathered where a
    task uses it, gradients reduce-scattered). Either may be None.
    """
    from jax.sharding import PartitionSpec as P

    t, f = tensor, fsdp
    both = tuple(a for a in (t, f) if a) or None  # a dimension split over both axes

    def spec(path, x):
        name = jax.tree_util.keystr(path)
        if "Dense_0" in name:
            return P(f, t) if x.ndim == 2 else P(both)
        if "Dense_1" in name:
            return P(t, f) if x.ndim == 2 else P(f)
        if any(k in name for k in ("['query']", "['key']", "['value']")):
            return P(f, t, None)
        if "['out']" in name:
            return P(t, None, f)
        if "embedding" in name:
            return P(t, f)
        if x.ndim == 2:  # pos
            return P(None, f)
        return P(f)  # LayerNorm scales and biases

    return jax.tree_util.tree_map_with_path(spec, params)


def make(cfg: GPTConfig, lr: float = 1e-3, seed: int = 0, eps: float = 1e-8):
    """Returns (model, params, optimizer, opt_state, train_step, reference_step)."""
    model = GPT(cfg)
    tokens = jnp.zeros((1, cfg.seq), jnp.int32)
    params = model.init(jax.random.PRNGKey(seed), tokens)["params"]
    opt = optax.adamw(lr, eps=eps, weight_decay=0.01)
    opt_state = opt.init(params)

    def train_step(params, opt_state, batch):
        loss, grads = baton.accumulate(
            jax.value_and_grad(lambda p, b: loss_fn(model, p, b)), params, batch=batch
        )
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def reference_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, batch))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return model, params, opt, opt_state, train_step, reference_step
