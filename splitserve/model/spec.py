"""Architecture hyperparameters read from a checkpoint (config.json or GGUF metadata)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # registry key: "llama" (also Mistral, SmolLM) or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    # HF-style rope_scaling dict ({"rope_type": "llama3", "factor": 8.0, ...}) or None.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
