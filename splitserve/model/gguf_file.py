"""A GGUF file: its metadata, its tensor table, and float32 tensors read out of it.

`gguf.GGUFReader` builds one numpy view per metadata element, which takes seconds for a
50K-token vocabulary; this reader parses the header with `struct` and bulk numpy reads
(milliseconds), and leaves dequantization to `gguf.quants.dequantize`.

Layout (little-endian, versions 2 and 3):

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: str, value_type u32, value)
    n_tensors x (name: str, n_dims u32, dims u64 x n_dims, ggml_type u32, offset u64)
    padding to `general.alignment` | tensor data (offsets relative to here)

A string is (length u64, utf-8 bytes); an array is (item_type u32, count u64, items).
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from splitserve.errors import ModelLoadError
from splitserve.model.spec import ModelSpec

if TYPE_CHECKING:
    import torch

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
# Fixed-size scalar value types -> struct format.
_SCALAR_FORMAT: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
    6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_NUMPY_DTYPE: dict[int, str] = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4",
    6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8",
}


class GGUFTensorInfo(NamedTuple):
    """Where one tensor lives in the file and how it is stored."""

    name: str
    shape: tuple[int, ...]  # torch order: GGUF's dims reversed, e.g. [out_features, in_features]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    """Sequential little-endian reads over a buffer; raises ModelLoadError past its end."""

    def __init__(self, buf: mmap.mmap | bytes, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def _need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelLoadError(
                f"GGUF file {self.path} is truncated or corrupt (header needs byte "
                f"{self.pos + n}, file has {len(self.buf)}); re-download it"
            )

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self._need(n)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def numbers(self, value_type: int, count: int) -> list[Any]:
        dtype = np.dtype(_NUMPY_DTYPE[value_type])
        self._need(count * dtype.itemsize)
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * dtype.itemsize
        return arr.tolist()  # type: ignore[no-any-return]

    def value(self, value_type: int) -> Any:
        if value_type in _SCALAR_FORMAT:
            return self.scalar(_SCALAR_FORMAT[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type = self.scalar("<I")
            count = self.scalar("<Q")
            if item_type in _NUMPY_DTYPE:
                return self.numbers(item_type, count)
            return [self.value(item_type) for _ in range(count)]
        raise ModelLoadError(
            f"GGUF file {self.path} has unknown metadata value type {value_type} at byte "
            f"{self.pos}; the file is corrupt or from a newer GGUF version"
        )


@dataclass
class GGUFFile:
    """Parsed header of a GGUF file; tensor data is read on demand via `load_tensor`."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]

    @classmethod
    def open(cls, path: str) -> GGUFFile:
        """Parse the header of `path`; ModelLoadError if it is not a complete, readable GGUF."""
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                if size < 24 or f.read(4) != _MAGIC:
                    raise ModelLoadError(
                        f"{path} is not a GGUF file (no 'GGUF' magic); pass a .gguf file "
                        "or a Hugging Face checkpoint directory"
                    )
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                    return cls._parse(path, buf, size)
        except OSError as e:
            raise ModelLoadError(f"cannot read GGUF file {path}: {e}; "
                                 "check the path and permissions") from e

    @classmethod
    def _parse(cls, path: str, buf: mmap.mmap, size: int) -> GGUFFile:
        cur = _Cursor(buf, path)
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in _SUPPORTED_VERSIONS:
            raise ModelLoadError(
                f"GGUF file {path} has version {version}; supported: {_SUPPORTED_VERSIONS} "
                "(little-endian). Re-convert it with a recent llama.cpp"
            )
        num_tensors = cur.scalar("<Q")
        num_kv = cur.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        raw_infos = []
        for _ in range(num_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            raw_infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0:
            raise ModelLoadError(f"GGUF file {path} has invalid general.alignment "
                                 f"{alignment!r}; re-convert it")
        data_start = (cur.pos + alignment - 1) // alignment * alignment
        tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, ggml_type, rel_offset in raw_infos:
            nbytes = _tensor_nbytes(path, name, dims, ggml_type)
            info = GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type,
                                  data_start + rel_offset, nbytes)
            if info.offset + nbytes > size:
                raise ModelLoadError(
                    f"GGUF file {path} is truncated: tensor {name!r} ends at byte "
                    f"{info.offset + nbytes} but the file has {size} bytes; re-download it"
                )
            tensors[name] = info
        return cls(path=path, version=version, metadata=metadata, tensors=tensors)

    def load_tensor(self, name: str) -> torch.Tensor:
        """The tensor `name` dequantized to float32, shaped in torch order."""
        import torch  # here, not at the top: the HTTP frontend reads specs, never tensors

        info = self.tensors[name]
        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
            # [*leading dims, bytes per row]: gguf dequantizes row-wise blocks.
            row_bytes = info.shape[-1] // block_size * type_size
            raw = np.fromfile(self.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
            if raw.size != info.nbytes:
                raise ModelLoadError(f"GGUF file {self.path} is truncated at tensor "
                                     f"{name!r}; re-download it")
            blocks = raw.reshape(*info.shape[:-1], row_bytes)
            values = dequantize(blocks, GGMLQuantizationType(info.ggml_type))
        except (NotImplementedError, ValueError, OSError) as e:
            raise ModelLoadError(
                f"cannot read tensor {name!r} (ggml type {info.ggml_type}) from {self.path}: {e}"
            ) from e
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(info.shape)


def _tensor_nbytes(path: str, name: str, dims: list[int], ggml_type: int) -> int:
    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ModelLoadError(
            f"GGUF file {path}: tensor {name!r} has unknown ggml type {ggml_type}; "
            "upgrade the `gguf` package or re-quantize the model"
        ) from None
    num_elements = math.prod(dims)
    if not dims or dims[0] % block_size:
        raise ModelLoadError(
            f"GGUF file {path}: tensor {name!r} with dims {dims} does not fit ggml type "
            f"{ggml_type} blocks of {block_size}; the file is corrupt"
        )
    return num_elements // block_size * type_size


# ---- GGUF as a Llama-family checkpoint ---------------------------------------------------

_GGUF_ARCHITECTURES = ("llama", "qwen2")
# llama.cpp block tensor name -> HF name inside "model.layers.{i}."
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# `{arch}.rope.scaling.*` key -> HF rope_scaling key
_ROPE_SCALING_KEYS = {
    "type": "rope_type", "factor": "factor",
    "original_context_length": "original_max_position_embeddings",
    "attn_factor": "attention_factor", "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow",
}


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name of a llama.cpp tensor name, or None for tensors we do not use."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return None


def gguf_spec(f: GGUFFile) -> ModelSpec:
    """ModelSpec from a GGUF file's `{arch}.*` metadata and its tensor table."""
    md = f.metadata
    arch = md.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {f.path} has architecture {arch!r}; "
            f"supported: {', '.join(_GGUF_ARCHITECTURES)}"
        )
    if "rope_freqs.weight" in f.tensors:
        raise ModelLoadError(
            f"GGUF file {f.path} uses llama3-style rope scaling (rope_freqs), which is not "
            "supported from GGUF; use the model's Hugging Face safetensors directory instead"
        )

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in md:
            raise ModelLoadError(f"GGUF file {f.path} lacks metadata {arch}.{key}; re-convert it")
        return md[f"{arch}.{key}"]

    hidden, num_heads = int(need("embedding_length")), int(need("attention.head_count"))
    embd = f.tensors.get("token_embd.weight")
    vocab = md.get(f"{arch}.vocab_size") or (
        embd.shape[0] if embd else len(md.get("tokenizer.ggml.tokens", [])))
    scaling = {
        hf_key: md[f"{arch}.rope.scaling.{key}"]
        for key, hf_key in _ROPE_SCALING_KEYS.items()
        if f"{arch}.rope.scaling.{key}" in md
    }
    eos, bos = md.get("tokenizer.ggml.eos_token_id"), md.get("tokenizer.ggml.bos_token_id")
    return ModelSpec(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(md.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(md.get(f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in f.tensors,
        attention_bias=arch == "qwen2",
        rope_scaling=scaling if scaling.get("rope_type", "none") != "none" else None,
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=(eos,) if isinstance(eos, int) else (),
    )


class GGUFWeights:
    """The tensors of a GGUF file under HF names, dequantized to float32 in HF's layout."""

    def __init__(self, f: GGUFFile, spec: ModelSpec) -> None:
        self.file = f
        self.spec = spec
        self.hf_to_gguf = {hf: name for name in f.tensors if (hf := hf_name(name)) is not None}
        self.files = [f.path]

    @property
    def names(self) -> set[str]:
        """HF names of every mapped tensor."""
        return set(self.hf_to_gguf)

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, float32 tensor) for `names`, in that order."""
        for name in names:
            tensor = self.file.load_tensor(self.hf_to_gguf[name])
            if (self.spec.architecture == "llama"
                    and name.endswith(("q_proj.weight", "k_proj.weight"))):
                heads = self.spec.num_heads if "q_proj" in name else self.spec.num_kv_heads
                tensor = _unpermute_rope_rows(tensor, heads)
            yield name, tensor


def _unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation so rotary pairs are (i, i + head_dim/2) as in HF.

    llama.cpp stores each head's rows interleaved (x0, x_half, x1, x_half+1, ...):
    [heads, head_dim/2, 2, in] -> [heads, 2, head_dim/2, in].
    """
    out_features = w.shape[0]
    half = out_features // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
