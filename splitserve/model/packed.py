"""Linear layers with oneDNN-packed weights (bf16 on CPU, the default there).

`F.linear` hands oneDNN a plain row-major weight and oneDNN reorders it into its blocked
layout inside every call; at batch-1 decode that streams the weight at ~15 GB/s against
~40 GB/s of DRAM bandwidth. Packing once at load time (what PyTorch's inductor does when
it freezes a CPU model) made the 120 projections of one SmolLM2 decode step 1.56x faster
and a batch of 32 1.36x faster, with bit-identical outputs: the same oneDNN kernel runs,
only the reorder is gone (benchmarks/engine.py; docs/benchmarks.md "Engine").
"""
from __future__ import annotations

import functools

import torch
from torch import nn


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this PyTorch build and CPU pack linear weights for `device` and `dtype`
    (oneDNN's bf16 path needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: not on AVX2-only CPUs,
    nor under ONEDNN_MAX_CPU_ISA=AVX2)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and _onednn_packs_bf16()


@functools.cache
def _onednn_packs_bf16() -> bool:
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    """y = x @ W^T (+ b) with W held in oneDNN's blocked layout (read-only afterwards)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Packed for small batches (decode); measured no slower than plain weights for
        # 32-512 rows too (prefill chunks).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the model's flat [num_tokens, features] batches
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed,
                                               self.bias, "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)


def pack_linears_(model: nn.Module) -> nn.Module:
    """Replaces every nn.Linear (projections and LM head) in place; a tied LM head gets
    its own packed copy and the embedding keeps the plain weight."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, PackedLinear(child))
    return model
