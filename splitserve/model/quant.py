"""Weight-only int8 quantization (opt-in `quantization="int8"`).

Batch-1 decode streams every weight once per token, so its speed is bytes over DRAM
bandwidth: int8 weights halve the bytes. Each output row gets one symmetric scale
(amax / 127); activations stay bf16. The exact kernels run it (csrc/exact.cpp: the same
fold over k as for bf16 weights, each int8 being a bf16 value, then one multiply by the
row's scale), so an int8 engine is batch-invariant and the same on AVX2 and AVX-512 BF16
machines, against its own reference: the numbers differ from bf16, so the quantization is
part of the model fingerprint and KV from an int8 engine is never mixed with a bf16 one's.
"""
from __future__ import annotations

import torch

QUANTIZATIONS = ("int8",)


def int8_weights(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (q int8 [N, K] in [-127, 127], scale fp32 [N]) with weight ~= q * scale."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()
