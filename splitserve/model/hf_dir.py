"""A Hugging Face checkpoint directory: config.json + *.safetensors (+ tokenizer files)."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from splitserve.errors import ModelLoadError
from splitserve.model.spec import ModelSpec

if TYPE_CHECKING:
    import torch

# HF `architectures` entry (or `model_type`) -> ModelSpec.architecture
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_INDEX_FILE = "model.safetensors.index.json"


def hf_weight_names(spec: ModelSpec) -> list[str]:
    """The HF parameter names a checkpoint of `spec` must hold, in model order."""
    names = ["model.embed_tokens.weight"]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj"):
            names.append(f"{p}self_attn.{proj}.weight")
            if spec.attention_bias:
                names.append(f"{p}self_attn.{proj}.bias")
        names.append(f"{p}self_attn.o_proj.weight")
        names += [f"{p}mlp.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")]
        names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def read_json(path: str, required: bool = True) -> dict[str, Any]:
    """The JSON object in `path` ({} when absent and not required); ModelLoadError otherwise."""
    if not os.path.isfile(path):
        if required:
            raise ModelLoadError(f"{path} is missing; a Hugging Face checkpoint directory needs it")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot parse {path}: {e}; fix or re-download it") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object; fix or re-download it")
    return data


def read_hf_spec(path: str) -> ModelSpec:
    """ModelSpec from `path`/config.json (+ generation_config.json for EOS ids)."""
    cfg_file = os.path.join(path, "config.json")
    cfg = read_json(cfg_file)
    gen = read_json(os.path.join(path, "generation_config.json"), required=False)
    archs = cfg.get("architectures") or []
    arch = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if arch is None and not archs:
        arch = _MODEL_TYPES.get(str(cfg.get("model_type")))
    if arch is None:
        raise ModelLoadError(
            f"{cfg_file}: unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {', '.join(_ARCHITECTURES)}"
        )
    if cfg.get("mlp_bias") or (arch == "llama" and cfg.get("attention_bias")):
        raise ModelLoadError(f"{cfg_file}: Llama with attention_bias/mlp_bias is not supported")

    def need(key: str) -> int:
        value = cfg.get(key)
        if not isinstance(value, int):
            raise ModelLoadError(f"{cfg_file} lacks integer {key!r}; "
                                 "fix or re-download the checkpoint")
        return value

    hidden, num_heads = need("hidden_size"), need("num_attention_heads")
    rope_params: dict[str, Any] = cfg.get("rope_parameters") or {}
    if not isinstance(rope_params, dict):
        raise ModelLoadError(f"{cfg_file}: 'rope_parameters' must be an object; fix the config")
    rope_theta = cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    # NOTE: a sliding window narrower than the context is not implemented; serving only up to
    # the window keeps results exact.
    window = cfg.get("sliding_window")
    if isinstance(window, int) and (arch == "llama" or cfg.get("use_sliding_window")):
        max_pos = min(max_pos, window)
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
    return ModelSpec(
        architecture=arch,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2",
        rope_scaling=_rope_scaling(cfg, rope_params),
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=_int_tuple(eos),
    )


def _rope_scaling(cfg: dict[str, Any], rope_params: dict[str, Any]) -> dict[str, Any] | None:
    """HF rope_scaling (transformers 4) or rope_parameters (5) without the theta; None if plain."""
    scaling = cfg.get("rope_scaling")
    if not isinstance(scaling, dict):
        scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    scaling = dict(scaling)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return None
    return scaling


def _int_tuple(value: Any) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return ()


class SafetensorsWeights:
    """The tensors of a (possibly sharded) safetensors checkpoint, keyed by HF name."""

    def __init__(self, path: str) -> None:
        index_file = os.path.join(path, _INDEX_FILE)
        self.name_to_file: dict[str, str] = {}
        if os.path.isfile(index_file):
            weight_map = read_json(index_file).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index_file} has no 'weight_map'; "
                                     "re-download the checkpoint")
            for name, shard in weight_map.items():
                self.name_to_file[name] = os.path.join(path, str(shard))
        else:
            for entry in sorted(os.listdir(path)):
                if entry.endswith(".safetensors"):
                    for name in _header_names(os.path.join(path, entry)):
                        self.name_to_file[name] = os.path.join(path, entry)
        self.files = sorted(set(self.name_to_file.values()))
        if not self.files:
            raise ModelLoadError(f"{path} has config.json but no *.safetensors weights; "
                                 "download them")
        for file in self.files:
            if not os.path.isfile(file):
                raise ModelLoadError(f"shard {file} named in {index_file} is missing; download it")
            _header_names(file)  # validates every shard up front

    @property
    def names(self) -> set[str]:
        """HF names of every stored tensor."""
        return set(self.name_to_file)

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) for `names`, in that order, as stored (dtype unchanged)."""
        with ExitStack() as stack:
            handles: dict[str, Any] = {}
            for name in names:
                file = self.name_to_file[name]
                try:
                    if file not in handles:
                        handles[file] = stack.enter_context(safe_open(file, framework="pt"))
                    tensor = handles[file].get_tensor(name)
                except Exception as e:  # SafetensorError derives from Exception only
                    raise ModelLoadError(f"cannot read tensor {name!r} from {file}: {e}; "
                                         "re-download it") from e
                yield name, tensor


def _header_names(file: str) -> list[str]:
    """Tensor names in a safetensors file; ModelLoadError when its header or size is wrong."""
    try:
        with safe_open(file, framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # SafetensorError, OSError
        raise ModelLoadError(
            f"{file} is not a valid safetensors file ({e}); it is truncated or corrupt, "
            "re-download it"
        ) from e
