"""Building blocks shared by Llama-family decoders: RMSNorm, rotary embedding, SwiGLU."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.model import kernels


class RMSNorm(nn.Module):
    """y = RMSNorm(x + residual), returning (y, x + residual): the residual add of a
    decoder layer is fused into the norm that follows it (one kernel on the exact path)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.uses_exact_kernels = False  # kernels.use_exact_kernels_ sets it

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.uses_exact_kernels:
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        h = x if residual is None else x + residual
        return F.rms_norm(h, (h.shape[-1],), self.weight, self.eps), h


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with the checkpoint's RoPE scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq.float()
    assert scaling is not None
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return (inv_freq / factor).float()
    if rope_type == "llama3":
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low_freq_factor, old_ctx / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(medium, smoothed, out).float()
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: default, "
                     "linear, llama3")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (HF layout) from a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.cos: torch.Tensor
        self.signed_sin: torch.Tensor
        self.register_buffer("cos", emb.cos(), persistent=False)
        # rotate_half's sign folded into the table: see apply_rotary.
        half = head_dim // 2
        signed_sin = torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1)
        self.register_buffer("signed_sin", signed_sin, persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [num_tokens, head_dim] for a step; computed once, used by every
        layer."""
        return (self.cos.index_select(0, positions).to(dtype),
                self.signed_sin.index_select(0, positions).to(dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE, x * cos + cat(-x2, x1) * sin, as x * cos + cat(x2, x1) *
    cat(-sin, sin): the same products bit for bit, in 4 ops instead of 6 (the op count is
    what a decode step of one token pays for)."""
    # x: [num_tokens, heads, head_dim]; cos, signed_sin: [num_tokens, head_dim]
    cos, signed_sin = cos.unsqueeze(1), signed_sin.unsqueeze(1)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one projection."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
