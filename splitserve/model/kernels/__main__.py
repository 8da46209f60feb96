"""`python -m splitserve.model.kernels`: build the exact CPU kernels now, not on first use."""
import torch

from splitserve.model.kernels import is_supported, isa_name

if is_supported(torch.device("cpu"), torch.bfloat16):
    print(f"exact CPU kernels ready ({isa_name()})")
else:
    print("exact CPU kernels: not available here (engines run the fast path)")
