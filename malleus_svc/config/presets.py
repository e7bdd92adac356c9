"""Model shapes, shared by the cost model (FLOPs, bytes) and the runtime (the torch model).

A LLaMA-style decoder: token embedding, `layers` blocks of (RMSNorm, causal attention with
rotary positions, RMSNorm, SwiGLU MLP), a final RMSNorm and an LM head, tied to the embedding or
not. Beside the sizes, a shape carries the numbers that make it one LLaMA generation or another:
the RMSNorm epsilon, the rotary base, Llama 3's rotary scaling and the tie.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

# The defaults (LLaMA 1 and 2): the RMSNorm epsilon and the rotary base.
NORM_EPS = 1e-5
ROPE_BASE = 10000.0


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rotary scaling (`rope_type: llama3`): wavelengths longer than the original context
    over `low_freq_factor` are stretched `factor`-fold, those shorter than it over
    `high_freq_factor` kept, and the band between interpolated smoothly."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


# A shape's sizes: integers (kv_heads may be None); its other fields are its LLaMA generation's numbers.
SIZE_FIELDS = ("layers", "hidden", "heads", "ffn", "vocab", "seq_len", "kv_heads")


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq_len: int
    kv_heads: int | None = None  # grouped-query attention; None means kv_heads == heads
    norm_eps: float = NORM_EPS
    rope_theta: float = ROPE_BASE
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False   # the LM head is the embedding's matrix (one weight, trained as one)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelShape":
        """The inverse of `to_dict` (a manifest's or a file's shape)."""
        scaling = d.get("rope_scaling")
        return cls(**{**d, "rope_scaling": RopeScaling(**scaling) if scaling else None})

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def block_params(self) -> int:
        """Parameters of one transformer block (attention + SwiGLU MLP + two RMSNorm weights)."""
        h, kv = self.hidden, self.n_kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h          # q, k, v, out projections
        mlp = 3 * h * self.ffn                      # gate, up, down
        return attn + mlp + 2 * h

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def head_params(self) -> int:
        return self.vocab * self.hidden + self.hidden  # LM head + final norm

    def block_flops(self, tokens: int, seq_len: int | None = None) -> float:
        """Forward + backward FLOPs of one block over `tokens` tokens in sequences of `seq_len`.

        6 FLOPs per parameter per token (2 forward, 4 backward) for the matrix multiplies, plus
        attention scores and values: 4 * seq * hidden per token forward (causal halves it), x3 for
        forward + backward.
        """
        s = seq_len or self.seq_len
        dense = 6.0 * (self.block_params() - 2 * self.hidden) * tokens
        attn = 3.0 * 4.0 * s * self.hidden * tokens / 2.0
        return dense + attn

    def to_dict(self) -> dict:
        return asdict(self)


# Llama 3.x (Meta's configs; trained here at the original 8,192-token context); the 3.2 models tie
# their head to the embedding.
LLAMA3_SHAPES = (("llama3.2-1b", 16, 2048, 32, 8192, 32.0, True), ("llama3.2-3b", 28, 3072, 24, 8192, 32.0, True),
                 ("llama3.1-8b", 32, 4096, 32, 14336, 8.0, False), ("llama3.1-70b", 80, 8192, 64, 28672, 8.0, False))

# The Malleus paper's evaluation shapes, a few small GPT shapes that run on a CPU, and Llama 3.
PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(layers=4, hidden=64, heads=4, ffn=128, vocab=256, seq_len=64),
    "small": ModelShape(layers=8, hidden=256, heads=8, ffn=704, vocab=256, seq_len=128),
    "gpt-125m": ModelShape(layers=12, hidden=768, heads=12, ffn=3072, vocab=50304, seq_len=2048),
    "gpt-1.3b": ModelShape(layers=24, hidden=2048, heads=16, ffn=8192, vocab=50304, seq_len=2048),
    "gpt-32l": ModelShape(layers=32, hidden=4096, heads=32, ffn=11008, vocab=50304, seq_len=4096),
    "llama-32b": ModelShape(layers=60, hidden=6656, heads=64, ffn=17920, vocab=32000, seq_len=4096),
    "llama-70b": ModelShape(layers=80, hidden=8192, heads=64, ffn=28672, vocab=32000, seq_len=4096, kv_heads=8),
    "llama-110b": ModelShape(layers=80, hidden=8192, heads=64, ffn=49152, vocab=32000, seq_len=4096, kv_heads=8),
    **{name: ModelShape(layers=layers, hidden=hidden, heads=heads, ffn=ffn, vocab=128256, seq_len=8192, kv_heads=8,
                        rope_theta=500000.0, rope_scaling=RopeScaling(factor, 1.0, 4.0, 8192), tie_embeddings=tied)
       for name, layers, hidden, heads, ffn, factor, tied in LLAMA3_SHAPES},
}


def preset(name: str) -> ModelShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None
