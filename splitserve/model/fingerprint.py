"""Model fingerprint (DESIGN.md 4.2): KV from an engine with another fingerprint is never used."""
from __future__ import annotations

import hashlib
import json

from splitserve.model.spec import ModelSpec

# Bump when the KV cache layout or the block-hash contract changes.
KV_FORMAT_VERSION = 1


def model_fingerprint(spec: ModelSpec, kv_dtype: str, block_size: int,
                      weights_digest: str, kernels: str = "default") -> str:
    """Hex digest over everything that decides whether two engines' KV blocks are
    interchangeable."""
    fields = {
        "kv_format_version": KV_FORMAT_VERSION,
        "architecture": spec.architecture,
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "kv_dtype": kv_dtype,
        "block_size": block_size,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,
        "weights_digest": weights_digest,
        # "default" or the exact kernels' version: they compute other bits.
        "kernels": kernels,
    }
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canonical, digest_size=16).hexdigest()
