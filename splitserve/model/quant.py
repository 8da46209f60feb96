"""Weight-only int8 quantization (opt-in `quantization="int8"`).

Batch-1 decode streams every weight once per token; on CPU the bf16 GEMV reaches only a
third of DRAM bandwidth while `_weight_int8pack_mm` reads half the bytes and runs ~3x
faster (measured in benchmarks/engine.py). Activations stay bf16; each output row has one
symmetric scale. The numbers differ from bf16, so the quantization is part of the model
fingerprint: KV from an int8 engine is never mixed with a bf16 engine's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = ("int8",)


class Int8Linear(nn.Module):
    """y = x @ (w_int8 * scale)^T (+ bias), per-output-channel symmetric scales."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out_features]
        self.weight_int8 = nn.Parameter(torch.round(w / scale[:, None]).to(torch.int8),
                                        requires_grad=False)
        self.scale = nn.Parameter(scale.to(linear.weight.dtype), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.device.type == "cpu" and x2.dtype == torch.bfloat16:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.scale)
        else:  # other devices/dtypes: dequantize on the fly (same math, no fast kernel)
            y = F.linear(x2, self.weight_int8.to(x2.dtype) * self.scale[:, None].to(x2.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], y.shape[-1])


def quantize_int8_(model: nn.Module) -> nn.Module:
    """Replaces every nn.Linear (projections and LM head) in place; embeddings stay as they are."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear(child))
    return model
