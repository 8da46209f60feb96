"""The exact kernels' packed weights kept on disk between starts.

A worker's engine dequantizes its checkpoint (the default GGUF's Q4_1 to fp32: ~1 s on one
core), fuses, casts and packs every linear for the exact kernels (~0.3 s): the same bytes
at every start of the same model and code. The first start writes them (kernels.
exact_state) to one safetensors file; later starts read it instead (a few tenths of a
second) and hand it to `use_exact_kernels_(packed=...)`. A restarted worker, one the
planner adds and every `splitserve serve` start after the first get there that much sooner.

A file is named by what decides its bytes: the checkpoint's weights digest, its model spec
(a config may tie the LM head to weights it leaves as they are), the quantization, the
dtype, the versions of torch, gguf and numpy (the dequantization's code) and a digest of
the Python that builds and packs the weights (splitserve/model/*.py and the kernels'
package). Writing one removes the
files of the same checkpoint, quantization and dtype that another version of the rest
wrote (a code change makes a new one; they are ~330 MB for the default model). Each file carries an xxh3 digest of its
tensors, checked at every read: a file that fails it, or does not parse, is ignored (and
rewritten by that start). Writes go to a temporary file renamed over the name, so a
reader sees a whole file or none.

`SPLITSERVE_WEIGHT_CACHE`: the directory (default ~/.cache/splitserve/weights, or under
$XDG_CACHE_HOME); `off` disables it.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import tempfile
from pathlib import Path

import torch
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from splitserve.model.spec import ModelSpec

logger = logging.getLogger(__name__)

CACHE_ENV = "SPLITSERVE_WEIGHT_CACHE"
_DIGEST_KEY = "xxh3_128"


def cache_file(weights_digest: str, spec: ModelSpec, quantization: str | None,
               dtype: torch.dtype) -> Path | None:
    """Where the packed weights of this checkpoint, spec, quantization and dtype live; None
    when the cache is off."""
    setting = os.environ.get(CACHE_ENV, "")
    if setting == "off":
        return None
    root = Path(setting) if setting else Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "splitserve" / "weights"
    build = hashlib.blake2b(f"{spec!r}|{_code_digest()}".encode(), digest_size=8).hexdigest()
    return root / f"{_kind(weights_digest, quantization, dtype)}-{build}.safetensors"


def read(path: Path | None) -> dict[str, torch.Tensor] | None:
    """The tensors in `path`; None when it is missing, does not parse or fails its digest."""
    if path is None or not path.exists():
        return None
    try:
        with safe_open(path, "pt") as handle:
            expected = (handle.metadata() or {}).get(_DIGEST_KEY)
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (OSError, SafetensorError, ValueError) as exc:
        logger.warning("ignoring the packed weights in %s: %s", path, exc)
        return None
    if expected != _digest(tensors):
        logger.warning("ignoring the packed weights in %s: their digest does not match", path)
        return None
    return tensors


def write(path: Path | None, tensors: dict[str, torch.Tensor]) -> None:
    """Writes `tensors` to `path` (nothing when None) and removes the files another build
    wrote for the same checkpoint, quantization and dtype; a failure is logged, never
    raised."""
    if path is None:
        return
    # NOTE: copies: the packed weights are views of one huge-page buffer, which
    # safetensors refuses to save as shared memory.
    own = {name: t.detach().contiguous().clone() for name, t in tensors.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".packed.", suffix=".tmp")
        os.close(fd)
        try:
            save_file(own, tmp, metadata={_DIGEST_KEY: _digest(own)})
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        kind = path.name.rsplit("-", 1)[0]
        for old in path.parent.glob(f"{kind}-*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)
    except (OSError, SafetensorError) as exc:  # a read-only or full disk: packed again
        logger.warning("cannot keep the packed weights in %s: %s", path, exc)


def _kind(weights_digest: str, quantization: str | None, dtype: torch.dtype) -> str:
    """The part of a file's name its replacements share."""
    return f"{weights_digest}-{quantization or 'none'}-{str(dtype).removeprefix('torch.')}"


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


@functools.cache
def _code_digest() -> str:
    """blake2b over the Python that builds and packs the weights (splitserve/model) and the
    versions of the libraries under it."""
    root = Path(__file__).resolve().parent
    h = hashlib.blake2b(digest_size=8)
    for package in ("torch", "gguf", "numpy", "safetensors"):
        h.update(f"{package}=={importlib.metadata.version(package)}\0".encode())
    for path in sorted([*root.glob("*.py"), *(root / "kernels").glob("*.py")]):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()
