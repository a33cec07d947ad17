"""MaxText's configs and meshes for ``baton.integrations.maxtext``: the tiny configs
(``CONFIGS``), MaxText's config system (``load_config``), synthetic batches in MaxText's layout,
and the mesh one pipeline rank has (MaxText's ``mesh_axes`` and ``ici_*_parallelism``:
``rank_size``, ``mesh_of``)."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Sequence

import numpy as np

from ..errors import ConfigError

MAXTEXT_VERSION = "0.2.5"
INSTALL_HINT = (
    "bash scripts/setup_maxtext.sh  (or: pip install 'jax-baton[maxtext]' && "
    f"pip install --no-deps maxtext=={MAXTEXT_VERSION})"
)

# The settings every config here shares: float32 (so the
# pipelined and MaxText's own step agree to rounding), plain dot-product attention and a
# dense MoE that run on CPUs, no checkpoints, no data pipeline, no jax.distributed.
COMMON = dict(
    override_model_config=True,
    attention="dot_product",
    hardware="cpu",
    dtype="float32",
    weight_dtype="float32",
    jax_cache_dir="",
    skip_jax_distributed_system=True,
    enable_checkpointing=False,
    dataset_type="synthetic",
    enable_dropout=False,
    log_config=False,
    learning_rate=1e-3,
    warmup_steps_fraction=0.0,
    steps=100,
    max_target_length=16,
)

# A tiny Llama-2 (MaxText's llama2-7b config, shrunk).
LLAMA2_TINY = dict(
    model_name="llama2-7b",
    base_emb_dim=64,
    base_num_query_heads=4,
    base_num_kv_heads=4,
    base_mlp_dim=128,
    base_num_decoder_layers=4,
    head_dim=16,
    vocab_size=256,
)

# The MoE of the tiny configs: 4 experts, top-2, a dense ("matmul", not megablox) MoE without
# token dropping.
TINY_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    sparse_matmul=False,
    megablox=False,
    capacity_factor=-1.0,
)

# A tiny Mixtral (MaxText's mixtral-8x7b config, shrunk).
MIXTRAL_TINY = dict(
    model_name="mixtral-8x7b",
    base_emb_dim=64,
    base_num_query_heads=4,
    base_num_kv_heads=2,
    base_mlp_dim=128,
    base_moe_mlp_dim=128,
    base_num_decoder_layers=4,
    head_dim=16,
    vocab_size=256,
    **TINY_MOE,
)

# A tiny DeepSeek-V2 (MaxText's deepseek2-16b config, shrunk): one dense layer, then MoE
# layers of the routed experts (softmax router) and a shared expert; MLA attention.
DEEPSEEK2_TINY = dict(
    model_name="deepseek2-16b",
    base_emb_dim=64,
    base_num_query_heads=4,
    base_num_kv_heads=4,
    base_mlp_dim=128,
    base_moe_mlp_dim=64,
    base_num_decoder_layers=5,
    first_num_dense_layers=1,
    vocab_size=256,
    shared_experts=1,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    original_max_position_embeddings=64,
    max_position_embeddings=1024,
    **TINY_MOE,
)

CONFIGS = {"llama2": LLAMA2_TINY, "mixtral": MIXTRAL_TINY, "deepseek2": DEEPSEEK2_TINY}


def require_maxtext():
    """Imports MaxText, or raises ``ImportError`` saying how to install it."""
    try:
        import maxtext  # noqa: F401
        from maxtext.configs import pyconfig  # noqa: F401
        from maxtext.trainers.pre_train import train  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"baton.integrations.maxtext needs MaxText {MAXTEXT_VERSION} and its dependencies "
            f"({e}); install them with: {INSTALL_HINT}"
        ) from e
    from importlib.metadata import version

    got = version("maxtext")
    if got != MAXTEXT_VERSION:
        import warnings

        warnings.warn(f"baton.integrations.maxtext was written for MaxText {MAXTEXT_VERSION}; "
                      f"found {got}", stacklevel=2)


def load_config(model: str | dict = "llama2", *, batch: int = 8, **overrides) -> Any:
    """MaxText's config (``pyconfig.initialize`` on its ``base.yml``) for ``model`` (a name in
    ``CONFIGS`` or a dict of overrides with a ``model_name``) with a global batch of ``batch``
    sequences; ``overrides`` win over both."""
    require_maxtext()
    import jax
    from maxtext.configs import pyconfig

    base = dict(CONFIGS[model]) if isinstance(model, str) else dict(model)
    if isinstance(model, str) and model not in CONFIGS:
        raise ConfigError(f"unknown MaxText config {model!r}; known: {sorted(CONFIGS)}")
    kw = {**COMMON, **base, **overrides}
    # MaxText's global batch is per_device_batch_size x all devices of the process x
    # gradient_accumulation_steps.
    ga = int(kw.get("gradient_accumulation_steps", 1))
    kw.setdefault("per_device_batch_size", batch / (jax.device_count() * ga))
    kw.setdefault("run_name", "baton")
    kw.setdefault("base_output_directory", os.path.join(tempfile.gettempdir(), "baton-maxtext"))
    cfg = pyconfig.initialize([None, os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")],
                              **kw)
    if cfg.global_batch_size_to_train_on != batch:
        raise ConfigError(f"MaxText's global batch is {cfg.global_batch_size_to_train_on}, "
                          f"not {batch} (per_device_batch_size x {jax.device_count()} devices x "
                          f"{ga} accumulation steps)")
    return cfg


def synthetic_batch(config: Any, seed: int, padding: bool = True) -> dict[str, np.ndarray]:
    """A synthetic batch of ``config.global_batch_size_to_train_on`` sequences in MaxText's
    layout (``inputs``, ``targets``, their positions and segment ids; targets are the inputs
    shifted by one). With ``padding`` every row ends in 0-3 padding tokens (segment id 0), so
    microbatches hold different token counts."""
    b, t = int(config.global_batch_size_to_train_on), int(config.max_target_length)
    v = int(config.vocab_size)
    rng = np.random.default_rng(seed)
    seq = rng.integers(1, v, (b, t + 1)).astype(np.int32)
    seg = np.ones((b, t), np.int32)
    if padding:
        for r, k in enumerate(rng.integers(0, 4, b)):
            if k:
                seg[r, t - k:] = 0
    pos = np.where(seg > 0, np.arange(t, dtype=np.int32)[None, :], 0).astype(np.int32)
    inputs = np.where(seg > 0, seq[:, :-1], 0).astype(np.int32)
    targets = np.where(seg > 0, seq[:, 1:], 0).astype(np.int32)
    return dict(inputs=inputs, inputs_position=pos, inputs_segmentation=seg,
                targets=targets, targets_position=pos.copy(), targets_segmentation=seg.copy())


def rank_size(config: Any) -> int:
    """The devices of one pipeline rank: the product of MaxText's ``ici_*_parallelism`` that
    are set (a ``-1``, MaxText's axis that takes the rest, counts 1). MaxText's own pipeline
    axis (``ici_pipeline_parallelism``) is refused: Baton pipelines the model."""
    ici = dict(zip(config.mesh_axes, config.ici_parallelism))
    if ici.get("stage", 1) not in (1, -1):
        raise ConfigError(f"ici_pipeline_parallelism={ici['stage']}: Baton pipelines the model "
                          "over its ranks; leave MaxText's stage axis at 1 and pass the ranks "
                          "to pipeline_mesh")
    return int(np.prod([v for v in ici.values() if v > 0], dtype=np.int64))


def mesh_of(config: Any, devices: Sequence[Any]):
    """MaxText's mesh (``maxtext_utils.get_mesh_from_config``: its ``mesh_axes`` and
    ``ici_*_parallelism``) on ``devices``."""
    from maxtext.utils import maxtext_utils

    n = rank_size(config)
    if not devices or len(devices) % n or (len(devices) != n and -1 not in config.ici_parallelism):
        sizes = {a: v for a, v in zip(config.mesh_axes, config.ici_parallelism) if v != 1}
        raise ConfigError(f"MaxText's mesh ({sizes}) does not fit {len(devices)} devices: it needs "
                          f"{n} (or a multiple, for the axis set to -1); on CPUs set "
                          f"JAX_NUM_CPU_DEVICES")
    return maxtext_utils.get_mesh_from_config(config, list(devices))


def check_expert_axis(config: Any) -> None:
    """Raises ``ConfigError`` when MaxText's expert axis (``ici_expert_parallelism``) does not
    divide the expert count: MaxText's logical axis rules shard the experts over it."""
    ep = int(config.ici_expert_parallelism)
    if config.num_experts > 1 and ep > 1 and config.num_experts % ep:
        raise ConfigError(f"num_experts={config.num_experts} is not divisible by "
                          f"ici_expert_parallelism={ep}: MaxText shards the experts over its "
                          f"expert axis; choose an ici_expert_parallelism that divides "
                          f"num_experts")
