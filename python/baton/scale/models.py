"""Model definitions by name for planning at scale (docs/SCALE.md).

Each entry is a decoder-only transformer described by its hyperparameters; the abstract
tracer (:mod:`baton.scale.abstract`) builds the layer functions from them. Sources:
Llama 2/3 values from the models' published configs as MaxText ships them
(MaxText/configs/models/llama2-7b.yml ... llama3.1-405b.yml, mixtral-8x7b.yml,
deepseek2-16b.yml); GPT-3 175B from Brown et al. 2020 (table 2.1, with Megatron's
vocabulary 51,200); the GPT models of Narayanan et al. 2021 (table 1: heads, hidden size,
layers; vocabulary 51,200, sequence 2,048, feed-forward 4h).
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer. ``mlp``: ``"swiglu"`` (3 matrices) or ``"gelu"`` (2).
    MoE: ``experts`` routed experts of width ``moe_ffn``, ``top_k`` per token, plus
    ``shared_experts`` always-on ones; the first ``dense_layers`` layers keep a dense MLP of
    width ``ffn``. ``head_dim`` defaults to hidden // heads."""

    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    mlp: str = "swiglu"
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    head_dim: int = 0
    source: str = ""

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def with_seq(self, seq: int | None) -> "TransformerConfig":
        return self if seq is None else dataclasses.replace(self, seq=int(seq))


_MAXTEXT = "MaxText src/MaxText/configs/models/{}.yml (github.com/AI-Hypercomputer/maxtext)"
_MEGATRON = "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters, table 1"


def _llama(name, layers, hidden, ffn, heads, kv, vocab, seq, yml):
    return TransformerConfig(name, layers, hidden, ffn, heads, kv, vocab, seq,
                             source=_MAXTEXT.format(yml))


def _gpt(name, heads, hidden, layers, seq=2048, vocab=51200, source=_MEGATRON):
    return TransformerConfig(name, layers, hidden, 4 * hidden, heads, heads, vocab, seq,
                             mlp="gelu", source=source)


MODELS: dict[str, TransformerConfig] = {m.name: m for m in [
    _llama("llama2-7b", 32, 4096, 11008, 32, 32, 32000, 4096, "llama2-7b"),
    _llama("llama2-13b", 40, 5120, 13824, 40, 40, 32000, 4096, "llama2-13b"),
    _llama("llama2-70b", 80, 8192, 28672, 64, 8, 32000, 4096, "llama2-70b"),
    _llama("llama3-8b", 32, 4096, 14336, 32, 8, 128256, 8192, "llama3-8b"),
    _llama("llama3-70b", 80, 8192, 28672, 64, 8, 128256, 8192, "llama3-70b"),
    _llama("llama3-405b", 126, 16384, 53248, 128, 8, 128256, 8192, "llama3.1-405b"),
    TransformerConfig("mixtral-8x7b", 32, 4096, 14336, 32, 8, 32000, 4096, experts=8,
                      top_k=2, moe_ffn=14336, source=_MAXTEXT.format("mixtral-8x7b")),
    # DeepSeek-V2-Lite-like MoE (MaxText deepseek2-16b): 64 routed experts of width 1408,
    # 6 per token, 2 shared, the first layer dense. Its multi-head latent attention is
    # modelled as plain multi-head attention of the same width (stated in docs/SCALE.md).
    TransformerConfig("deepseek2-16b", 27, 2048, 10944, 16, 16, 102400, 4096, experts=64,
                      top_k=6, moe_ffn=1408, shared_experts=2, dense_layers=1, head_dim=128,
                      source=_MAXTEXT.format("deepseek2-16b")),
    # DeepSeek-V3 (arXiv:2412.19437, sec. 4.2): 61 layers, width 7168, 128 heads of 128, the
    # first 3 layers dense (width 18432), then 256 routed experts of width 2048, 8 per
    # token, 1 shared; vocabulary 129,280; MLA modelled as plain attention (docs/SCALE.md).
    TransformerConfig("deepseek-v3", 61, 7168, 18432, 128, 128, 129280, 4096, experts=256,
                      top_k=8, moe_ffn=2048, shared_experts=1, dense_layers=3, head_dim=128,
                      source="DeepSeek-V3 technical report (arXiv:2412.19437), sec. 4.2"),
    # DeepSeek-V2 (arXiv:2405.04434, sec. 3.1.2): 60 layers, width 5120, 128 heads of 128, the
    # first layer dense (width 12288), then 160 routed experts of width 1536, 6 per token, 2
    # shared; vocabulary 102,400, sequence 4,096; MLA modelled as plain attention (docs/SCALE.md).
    TransformerConfig("deepseek-v2", 60, 5120, 12288, 128, 128, 102400, 4096, experts=160,
                      top_k=6, moe_ffn=1536, shared_experts=2, dense_layers=1, head_dim=128,
                      source="DeepSeek-V2 technical report (arXiv:2405.04434), sec. 3.1.2"),
    # BLOOM-176B (arXiv:2211.05100, table 1): 70 layers, width 14336, 112 heads, GELU MLP of
    # 4h, vocabulary 250,880, sequence 2,048 (ALiBi: no rotary, same FLOPs).
    _gpt("bloom-176b", 112, 14336, 70, vocab=250880,
         source="BLOOM (arXiv:2211.05100), table 1"),
    _gpt("gpt3-175b", 96, 12288, 96, source="Brown et al. 2020, table 2.1 (vocab 51,200 as Megatron)"),
    _gpt("gpt-1.7b", 24, 2304, 24),
    _gpt("gpt-3.6b", 32, 3072, 30),
    _gpt("gpt-7.5b", 32, 4096, 36),
    _gpt("gpt-18b", 48, 6144, 40),
    _gpt("gpt-39b", 64, 8192, 48),
    _gpt("gpt-76b", 80, 10240, 60),
    _gpt("gpt-145b", 96, 12288, 80),
    _gpt("gpt-310b", 128, 16384, 96),
    _gpt("gpt-530b", 128, 20480, 105),
    _gpt("gpt-1t", 160, 25600, 128),
]}

_SPEC = re.compile(r"^(gpt|llama)\s*:\s*(.*)$")


def get_model(name: str, seq: int | None = None) -> TransformerConfig:
    """A model by name (``MODELS``), or Baton's example models at any size:
    ``"gpt:layers=12,hidden=768,heads=12,vocab=50304,seq=1024"`` (examples/gpt.py's shape:
    GELU MLP of 4 x hidden) or ``"llama:layers=..,hidden=..,ffn=..,heads=..,kv_heads=.."``."""
    key = name.strip().lower()
    if key in MODELS:
        return MODELS[key].with_seq(seq)
    m = _SPEC.match(key)
    if not m:
        raise ValueError(f"unknown model {name!r}: known {', '.join(sorted(MODELS))}, or "
                         "'gpt:layers=..,hidden=..,heads=..' / 'llama:...'")
    kind, body = m.groups()
    fields = {}
    for part in filter(None, (p.strip() for p in body.split(","))):
        k, sep, v = part.partition("=")
        if not sep or not v.strip().isdigit():
            raise ValueError(f"model {name!r}: {part!r} is not key=integer")
        fields[k.strip()] = int(v)
    known = {"layers", "hidden", "heads", "ffn", "kv_heads", "vocab", "seq", "experts", "top_k",
             "moe_ffn"}
    if unknown := set(fields) - known:
        raise ValueError(f"model {name!r}: unknown keys {sorted(unknown)} (known {sorted(known)})")
    for req in ("layers", "hidden", "heads"):
        if req not in fields:
            raise ValueError(f"model {name!r}: {req!r} is required")
    h = fields["hidden"]
    cfg = TransformerConfig(
        name=key, layers=fields["layers"], hidden=h,
        ffn=fields.get("ffn", 4 * h if kind == "gpt" else 8 * h // 3),
        heads=fields["heads"], kv_heads=fields.get("kv_heads", fields["heads"]),
        vocab=fields.get("vocab", 50304), seq=fields.get("seq", 1024),
        mlp="gelu" if kind == "gpt" else "swiglu", experts=fields.get("experts", 0),
        top_k=fields.get("top_k", 0), moe_ffn=fields.get("moe_ffn", 0),
        source="user-defined")
    return cfg.with_seq(seq)
