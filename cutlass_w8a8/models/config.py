"""Architectures of the reference Llama decoder: `LlamaConfig` and the named configs `SMALL`, `LLAMA3_8B`,
`QWEN3_30B_A3B` (a Qwen3-MoE decoder: q/k head norms and a mixture-of-experts MLP)."""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["CONFIGS", "LLAMA3_8B", "QWEN3_30B_A3B", "SMALL", "LlamaConfig"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture of a Llama-style decoder.

    Attributes
    ----------
    vocab_size : int
        Number of token ids; the embedding and ``lm_head`` have this many rows.
    hidden_size : int
        Width of the residual stream.
    intermediate_size : int
        Width of the SwiGLU MLP (``gate_up_proj`` has ``2 * intermediate_size`` outputs).
    num_layers : int
        Number of decoder layers.
    num_heads : int
        Query heads.
    num_kv_heads : int
        Key/value heads (grouped-query attention); divides ``num_heads``.
    head_dim : int, optional
        Width of one head; default ``hidden_size // num_heads``. Must be even (rotary pairs).
    rms_norm_eps : float
        Epsilon of every RMSNorm.
    rope_theta : float
        Base of the rotary frequencies, ``inv_freq[i] = rope_theta ** (-2 i / head_dim)``.
    max_position : int
        Length of the rotary table: positions must be below it (and below the cache length).
    init_std : float
        Standard deviation of the random normal weights (Hugging Face's ``initializer_range``).
    qk_norm : bool
        Qwen3's head norms: an RMSNorm over ``head_dim`` (weights ``q_norm``, ``k_norm``) on every query and key
        head after ``qkv_proj``, before the rotary embedding. Default False (Llama).
    num_experts : int
        0 (default): every layer has the dense SwiGLU MLP of ``intermediate_size``. > 0: every layer's MLP is a
        mixture of experts (Qwen3-MoE's sparse block): a bf16 router ``gate`` (hidden -> ``num_experts``), softmax
        in float32, the ``num_experts_per_tok`` largest, and that many SwiGLU experts of
        ``moe_intermediate_size`` per token, their outputs summed with the routing weights.
    num_experts_per_tok : int
        Experts per token (top-k); required (``1 <= k <= num_experts``) when ``num_experts > 0``.
    moe_intermediate_size : int, optional
        Width ``I`` of one expert's SwiGLU (its ``gate_up_proj`` has ``2 I`` outputs); required with experts.
    norm_topk_prob : bool
        Renormalize the top-k routing weights to sum to 1 (Qwen3-MoE's ``norm_topk_prob``; default True).

    Notes
    -----
    Llama 3.1's long-context rope scaling is not modelled: the rotary frequencies are the plain ones.
    """

    vocab_size: int = 8192
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_layers: int = 4
    num_heads: int = 16
    num_kv_heads: int = 4
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_position: int = 4096
    init_std: float = 0.02
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: Optional[int] = None
    norm_topk_prob: bool = True

    def __post_init__(self):
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"LlamaConfig: `hidden_size` ({self.hidden_size}) must be divisible by "
                                 f"`num_heads` ({self.num_heads}) when `head_dim` is not given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LlamaConfig: `{name}` must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig: `num_kv_heads` ({self.num_kv_heads}) must divide "
                             f"`num_heads` ({self.num_heads})")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: `head_dim` must be even (rotary pairs), got {self.head_dim}")
        if self.num_experts < 0:
            raise ValueError(f"LlamaConfig: `num_experts` must be >= 0, got {self.num_experts}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"LlamaConfig: `num_experts_per_tok` must be in [1, num_experts = "
                                 f"{self.num_experts}], got {self.num_experts_per_tok}")
            if self.moe_intermediate_size is None or self.moe_intermediate_size <= 0:
                raise ValueError(f"LlamaConfig: `moe_intermediate_size` must be positive with experts, got "
                                 f"{self.moe_intermediate_size}")

    @property
    def is_moe(self) -> bool:
        """True when every layer's MLP is a mixture of experts (``num_experts > 0``)."""
        return self.num_experts > 0

    @property
    def mlp_intermediate_size(self) -> int:
        """The K of the MLP's down projection: ``moe_intermediate_size`` with experts, else ``intermediate_size``."""
        return self.moe_intermediate_size if self.is_moe else self.intermediate_size

    @property
    def qkv_size(self) -> int:
        """Outputs of the fused ``qkv_proj``: ``(num_heads + 2 * num_kv_heads) * head_dim``."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def replace(self, **changes) -> "LlamaConfig":
        """A copy with some fields changed, e.g. ``LLAMA3_8B.replace(num_layers=4)``."""
        return dataclasses.replace(self, **changes)


#: A small default: 4 layers of width 1024, 16 query and 4 key/value heads of 64, vocabulary 8192.
SMALL = LlamaConfig()

#: Llama-3-8B's dimensions (meta-llama/Meta-Llama-3-8B config.json): 32 layers, hidden 4096, MLP 14336,
#: 32 query and 8 key/value heads of 128, vocabulary 128256, rope_theta 500000.
LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                        max_position=8192)

#: Qwen3-30B-A3B's dimensions (Qwen/Qwen3-30B-A3B config.json): 48 layers, hidden 2048, 32 query and 4 key/value
#: heads of 128 with q/k head norms, 128 experts of width 768 with 8 per token (renormalized), vocabulary 151936,
#: rope_theta 1e6, rms_norm_eps 1e-6. ``intermediate_size`` (6144) is the checkpoint's dense width, unused here.
QWEN3_30B_A3B = LlamaConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
                            num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                            max_position=40960, qk_norm=True, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=768, norm_topk_prob=True)

CONFIGS = {"small": SMALL, "llama3-8b": LLAMA3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}
