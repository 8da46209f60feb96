"""Open a checkpoint (HF directory or GGUF file): spec, tokenizer, digest and HF-named weights."""
from __future__ import annotations

import functools
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import xxhash

from splitserve.errors import ModelLoadError
from splitserve.model.default import default_model_path
from splitserve.model.gguf_file import GGUFFile, GGUFWeights, gguf_spec
from splitserve.model.hf_dir import SafetensorsWeights, hf_weight_names, read_hf_spec
from splitserve.model.spec import ModelSpec
from splitserve.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

_DIGEST_CHUNK = 8 << 20  # bytes per read while hashing weight files


class WeightSource(Protocol):
    """Where a checkpoint's tensors come from (safetensors shards or one GGUF file)."""

    files: list[str]

    @property
    def names(self) -> set[str]: ...

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class Checkpoint:
    """An opened, validated checkpoint; weights are read lazily by `iter_weights`. One
    object may serve several callers (open_checkpoint keeps the last few)."""

    path: str  # resolved file or directory
    spec: ModelSpec
    tokenizer: Tokenizer
    weights_digest: str  # hex xxh3_128 over the weight files' bytes; part of the model fingerprint
    _source: WeightSource = field(repr=False, compare=False)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, tensor) for every parameter the model needs, in model order.

        Safetensors tensors come as stored (any float dtype); GGUF tensors are dequantized to
        float32, in torch's [out_features, in_features] layout, with Q/K rows in HF order.
        """
        return self._source.read(hf_weight_names(self.spec))


def open_checkpoint(path: str | None) -> Checkpoint:
    """Open `path` (None: the default SmolLM2 GGUF) and check that it is complete.

    A directory with config.json is a Hugging Face checkpoint; a *.gguf file, or a directory
    holding exactly one .gguf and no config.json, is a GGUF checkpoint. Every problem is raised
    as ModelLoadError naming the path and what to do.
    """
    resolved = os.path.abspath(default_model_path() if path is None else os.path.expanduser(path))
    try:
        try:
            stamp = _stamp(resolved)
        except OSError:
            return _open(resolved)  # it names what is missing
        return _open_stamped(resolved, stamp)
    except ModelLoadError:
        raise
    except (OSError, KeyError, IndexError, ValueError, TypeError, struct.error) as e:
        # NOTE: a safety net; the readers raise ModelLoadError for every problem they foresee.
        raise ModelLoadError(
            f"cannot load checkpoint {resolved} ({type(e).__name__}: {e}); it is corrupt or "
            "unsupported, re-download or re-convert it"
        ) from e


def _stamp(resolved: str) -> tuple[tuple[str, int, int], ...]:
    """(path, size, mtime) of the file, or of every file in the directory."""
    paths = ([os.path.join(resolved, e) for e in sorted(os.listdir(resolved))]
             if os.path.isdir(resolved) else [resolved])
    return tuple((p, st.st_size, st.st_mtime_ns) for p in paths for st in [os.stat(p)])


@functools.lru_cache(maxsize=4)
def _open_stamped(resolved: str, stamp: tuple[tuple[str, int, int], ...]) -> Checkpoint:
    """_open, kept per file state: a server's frontend opens its checkpoint two or three
    times (the layout's profile key, the router's priors, the model list), ~0.6 s each
    for the default GGUF's 49 k-token vocabulary; a changed file is opened afresh."""
    return _open(resolved)


def _open(resolved: str) -> Checkpoint:
    source: WeightSource
    if os.path.isdir(resolved) and os.path.isfile(os.path.join(resolved, "config.json")):
        spec = read_hf_spec(resolved)
        tokenizer = Tokenizer.from_hf_dir(resolved)
        source = SafetensorsWeights(resolved)
    else:
        resolved = _gguf_file(resolved)
        gguf = GGUFFile.open(resolved)
        spec = gguf_spec(gguf)
        try:
            tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
        except ModelLoadError as e:
            raise ModelLoadError(f"{resolved}: {e}") from e
        source = GGUFWeights(gguf, spec)
    missing = [name for name in hf_weight_names(spec) if name not in source.names]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(
            f"checkpoint {resolved} lacks tensors {shown}; it is incomplete or not a "
            f"{spec.architecture} checkpoint, re-download or re-convert it"
        )
    return Checkpoint(resolved, spec, tokenizer, _digest(source.files), source)


def _gguf_file(path: str) -> str:
    """`path` itself when it is a .gguf file, or the single .gguf inside a directory."""
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(
                f"{path} is neither a .gguf file nor a directory with config.json; pass a GGUF "
                "file or a Hugging Face checkpoint directory"
            )
        return path
    if os.path.isdir(path):
        ggufs = sorted(e for e in os.listdir(path) if e.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
        raise ModelLoadError(
            f"directory {path} has no config.json and {len(ggufs)} .gguf files; expected a Hugging "
            "Face checkpoint (config.json + *.safetensors + tokenizer.json) or exactly one .gguf"
        )
    raise ModelLoadError(f"model path {path} does not exist; "
                         "pass a .gguf file or a checkpoint directory")


def _digest(files: list[str]) -> str:
    """xxh3_128 over the files' bytes, in sorted order, streamed in chunks."""
    h = xxhash.xxh3_128()
    for file in sorted(files):
        try:
            with open(file, "rb") as f:
                while chunk := f.read(_DIGEST_CHUNK):
                    h.update(chunk)
        except OSError as e:
            raise ModelLoadError(f"cannot read weight file {file}: {e}; "
                                 "check its permissions") from e
    return h.hexdigest()
