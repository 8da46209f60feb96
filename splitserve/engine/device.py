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
    """None: exact kernels wherever they exist; True where they do not is an error."""
    head_dim = spec.head_dim
    available = config.quantization is None and is_supported(
        device, dtype, head_dim, spec.hidden_size, spec.intermediate_size)
    if config.batch_invariant and not available:
        raise ValueError(f"batch_invariant=True needs bfloat16 weights without quantization on "
                         f"an x86 CPU with AVX2 and head_dim a multiple of 16 up to 128 (got "
                         f"{dtype}, quantization={config.quantization}, {device}, head_dim="
                         f"{head_dim}); drop the flag for the fast path")
    if not available or config.batch_invariant is False:
        return False
    try:
        load_kernels()
    except Exception as exc:  # no compiler, no headers: a fresh machine without build tools
        if config.batch_invariant:
            raise ValueError(f"batch_invariant=True but the exact kernels failed to build: "
                             f"{exc}; install g++ (and ninja), or drop the flag") from exc
        logger.warning("exact kernels failed to build (%s); running the fast path: outputs "
                       "will depend on batching", exc)
        return False
    return True
