"""Where and in what an engine computes: device, dtype, and whether it runs the exact
(batch-invariant) kernels."""
from __future__ import annotations

import logging

import torch

from splitserve.config import EngineConfig
from splitserve.model.kernels import is_supported
from splitserve.model.kernels import load as load_kernels
from splitserve.model.spec import ModelSpec

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    dtypes = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
              "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(dtypes)}")
    return dtypes[name]


def resolve_batch_invariant(config: EngineConfig, device: torch.device,
                             dtype: torch.dtype, spec: ModelSpec) -> bool:
    """None: exact kernels wherever they exist; True where they do not is an error.
    Quantized weights run only on the exact kernels: they need them, whatever the flag."""
    head_dim = spec.head_dim
    available = is_supported(device, dtype, head_dim, spec.hidden_size, spec.intermediate_size)
    needed = config.batch_invariant or config.quantization is not None
    if needed and not available:
        asked = (f"quantization={config.quantization}" if config.quantization is not None
                 else "batch_invariant=True")
        raise ValueError(f"{asked} needs bfloat16 on an x86 CPU with AVX2 and head_dim a "
                         f"multiple of 16 up to 128 (got {dtype}, {device}, head_dim="
                         f"{head_dim}); drop it for the fast path")
    if config.quantization is not None and config.batch_invariant is False:
        raise ValueError(f"quantization={config.quantization} runs on the exact kernels, "
                         f"which are batch-invariant: drop batch_invariant=False")
    if not available or config.batch_invariant is False:
        return False
    try:
        load_kernels()
    except Exception as exc:  # no compiler, no headers: a fresh machine without build tools
        if needed:
            raise ValueError(f"batch_invariant=True or quantization, but the exact kernels "
                             f"failed to build: {exc}; install g++ (and ninja), or drop "
                             f"the flag") from exc
        logger.warning("exact kernels failed to build (%s); running the fast path: outputs "
                       "will depend on batching", exc)
        return False
    return True
