"""The architecture description shared by the loaders and the model (Llama, Qwen2, Qwen3 families)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama", "qwen2" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192  # the model's context window
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    # RMSNorm over each head of q and k before RoPE (Qwen3): keeps attention logits bounded, which is
    # why Qwen3 drops the q/k/v bias and may use a head_dim other than hidden_size / num_heads.
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    @property
    def kv_bytes_per_token(self) -> int:
        """fp32 K and V over all layers: what one cached token costs in the embedded engine."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4
