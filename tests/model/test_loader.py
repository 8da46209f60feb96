"""Checkpoint loading: GGUF and HF directories, spec mapping, exact tensors, digests, errors."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.errors import ModelLoadError
from splitserve.model.default import default_model_path as locate_default
from splitserve.model.loader import Checkpoint, open_checkpoint


@pytest.fixture(scope="module")
def smollm2(default_model_path: str) -> Checkpoint:
    return open_checkpoint(default_model_path)


def test_default_path_is_the_installed_gguf(default_model_path: str) -> None:
    assert locate_default() == default_model_path
    assert os.path.basename(default_model_path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert open_checkpoint(None).path == default_model_path


def test_gguf_spec_of_smollm2(smollm2: Checkpoint) -> None:
    spec = smollm2.spec
    assert (spec.architecture, spec.num_layers, spec.hidden_size) == ("llama", 30, 576)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (9, 3, 64)
    assert ((spec.intermediate_size, spec.vocab_size, spec.max_position_embeddings)
            == (1536, 49152, 8192))
    assert spec.rope_theta == 1e5
    assert spec.rope_scaling is None
    assert spec.tie_word_embeddings and not spec.attention_bias
    assert spec.eos_token_ids == (2,) and spec.bos_token_id == 1
    assert spec.rms_norm_eps == pytest.approx(1e-5)


def test_gguf_weights_equal_hf_reference(smollm2: Checkpoint, hf_reference_smollm2: Any) -> None:
    """Exact match with transformers' dequantization proves the names, shapes and Q/K
    un-permutation."""
    reference = hf_reference_smollm2.state_dict()
    seen = []
    for name, tensor in smollm2.iter_weights():
        assert tensor.dtype == torch.float32, name
        expected = reference[name]
        assert tensor.shape == expected.shape, name
        assert (tensor - expected).abs().max().item() < 1e-6, name
        seen.append(name)
    assert len(seen) == len(set(seen)) == len(reference) - 1  # all but the tied lm_head
    assert "lm_head.weight" not in seen


def _state_dict(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def test_tiny_llama_dir(tiny_llama_dir: str) -> None:
    ckpt = open_checkpoint(tiny_llama_dir)
    spec = ckpt.spec
    assert ((spec.architecture, spec.num_layers, spec.hidden_size, spec.intermediate_size)
            == ("llama", 2, 64, 128))
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (4, 2, 16, 49152)
    assert (spec.rope_theta, spec.max_position_embeddings) == (10000.0, 512)
    assert not spec.tie_word_embeddings and not spec.attention_bias and spec.rope_scaling is None
    stored = _state_dict(tiny_llama_dir)
    weights = dict(ckpt.iter_weights())
    assert set(weights) == set(stored)
    assert "lm_head.weight" in weights and not any(n.endswith(".bias") for n in weights)
    for name, tensor in weights.items():
        assert torch.equal(tensor, stored[name]), name
    assert ckpt.tokenizer.vocab_size == 49152


def test_tiny_qwen2_dir(tiny_qwen2_dir: str) -> None:
    ckpt = open_checkpoint(tiny_qwen2_dir)
    spec = ckpt.spec
    assert ((spec.architecture, spec.attention_bias, spec.tie_word_embeddings)
            == ("qwen2", True, True))
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rope_theta) == (4, 2, 16, 1e6)
    stored = _state_dict(tiny_qwen2_dir)
    weights = dict(ckpt.iter_weights())
    assert set(weights) == set(stored) - {"lm_head.weight"}
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.1.self_attn.{proj}.bias" in weights
    assert "model.layers.0.self_attn.o_proj.bias" not in weights
    for name, tensor in weights.items():
        assert torch.equal(tensor, stored[name]), name


def test_sharded_dir_loads_the_same(tiny_llama_dir: str, tmp_path: Path) -> None:
    stored = _state_dict(tiny_llama_dir)
    names = sorted(stored)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: stored[n] for n in shard_names}, str(tmp_path / shard))
        weight_map.update({n: shard for n in shard_names})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for extra in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_llama_dir, extra), tmp_path / extra)
    weights = dict(open_checkpoint(str(tmp_path)).iter_weights())
    assert set(weights) == set(stored)
    assert all(torch.equal(weights[n], stored[n]) for n in names)


def test_weights_digest(smollm2: Checkpoint, default_model_path: str, tiny_llama_dir: str,
                        tiny_qwen2_dir: str) -> None:
    digests = [open_checkpoint(p).weights_digest
               for p in (default_model_path, tiny_llama_dir, tiny_qwen2_dir)]
    assert digests[0] == smollm2.weights_digest
    assert len(smollm2.weights_digest) == 32 and int(smollm2.weights_digest, 16) >= 0
    assert len(set(digests)) == 3
    assert open_checkpoint(tiny_llama_dir).weights_digest == digests[1]


def test_an_unchanged_checkpoint_is_opened_once_and_a_changed_one_afresh(
        tiny_llama_dir: str, tmp_path: Path) -> None:
    ckpt_dir = _copy_dir(tiny_llama_dir, tmp_path / "ckpt")
    first = open_checkpoint(str(ckpt_dir))
    assert open_checkpoint(str(ckpt_dir)) is first
    config = json.loads((ckpt_dir / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3  # a rewritten config.json, and then a new weight file
    (ckpt_dir / "config.json").write_text(json.dumps(config))
    second = open_checkpoint(str(ckpt_dir))
    assert second.spec.rms_norm_eps == 1e-3 and second.weights_digest == first.weights_digest
    weights = _state_dict(str(ckpt_dir))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    save_file(weights, str(ckpt_dir / "model.safetensors"))
    third = open_checkpoint(str(ckpt_dir))
    assert third.weights_digest != first.weights_digest
    assert open_checkpoint(str(ckpt_dir)) is third


def test_directory_with_one_gguf(default_model_path: str) -> None:
    ckpt = open_checkpoint(os.path.dirname(default_model_path))
    assert ckpt.path == default_model_path


# ---- errors -----------------------------------------------------------------------------------


def _copy_dir(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="does not exist"):
        open_checkpoint(missing)


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        open_checkpoint(str(tmp_path))


def test_file_of_unknown_kind(tmp_path: Path) -> None:
    bogus = tmp_path / "weights.bin"
    bogus.write_bytes(b"\0" * 100)
    with pytest.raises(ModelLoadError, match="neither a .gguf file"):
        open_checkpoint(str(bogus))


@pytest.mark.parametrize("size", [0, 3, 1000, 2_000_000])
def test_truncated_gguf(default_model_path: str, tmp_path: Path, size: int) -> None:
    truncated = tmp_path / "truncated.gguf"
    with open(default_model_path, "rb") as f:
        truncated.write_bytes(f.read(size))
    with pytest.raises(ModelLoadError, match="truncated|not a GGUF") as info:
        open_checkpoint(str(truncated))
    assert str(truncated) in str(info.value)


def test_garbage_safetensors(tiny_llama_dir: str, tmp_path: Path) -> None:
    ckpt_dir = _copy_dir(tiny_llama_dir, tmp_path / "ckpt")
    (ckpt_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json" * 10)
    with pytest.raises(ModelLoadError, match="re-download"):
        open_checkpoint(str(ckpt_dir))


def test_truncated_safetensors(tiny_llama_dir: str, tmp_path: Path) -> None:
    ckpt_dir = _copy_dir(tiny_llama_dir, tmp_path / "ckpt")
    weights = ckpt_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        open_checkpoint(str(ckpt_dir))


def test_unknown_architecture(tiny_llama_dir: str, tmp_path: Path) -> None:
    ckpt_dir = _copy_dir(tiny_llama_dir, tmp_path / "ckpt")
    config = json.loads((ckpt_dir / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (ckpt_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPTNeoX.*LlamaForCausalLM"):
        open_checkpoint(str(ckpt_dir))


def test_missing_tensor(tiny_llama_dir: str, tmp_path: Path) -> None:
    ckpt_dir = _copy_dir(tiny_llama_dir, tmp_path / "ckpt")
    stored = _state_dict(tiny_llama_dir)
    del stored["model.layers.1.mlp.up_proj.weight"]
    save_file(stored, str(ckpt_dir / "model.safetensors"))
    with pytest.raises(ModelLoadError,
                       match="lacks tensors model.layers.1.mlp.up_proj.weight") as info:
        open_checkpoint(str(ckpt_dir))
    assert str(ckpt_dir) in str(info.value)


def test_missing_config_key(tiny_llama_dir: str, tmp_path: Path) -> None:
    ckpt_dir = _copy_dir(tiny_llama_dir, tmp_path / "ckpt")
    config = json.loads((ckpt_dir / "config.json").read_text())
    del config["hidden_size"]
    (ckpt_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        open_checkpoint(str(ckpt_dir))


def test_missing_tokenizer(tiny_llama_dir: str, tmp_path: Path) -> None:
    ckpt_dir = _copy_dir(tiny_llama_dir, tmp_path / "ckpt")
    (ckpt_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        open_checkpoint(str(ckpt_dir))


# ---- spec mapping variants ----------------------------------------------------------------


def _spec_of(tiny_dir: str, tmp_path: Path, config_patch: dict[str, Any],
             generation: dict[str, Any] | None = None) -> Any:
    from splitserve.model.hf_dir import read_hf_spec

    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    config = json.loads(Path(tiny_dir, "config.json").read_text())
    config.update(config_patch)
    config = {k: v for k, v in config.items() if v is not ...}
    (ckpt_dir / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (ckpt_dir / "generation_config.json").write_text(json.dumps(generation))
    return read_hf_spec(str(ckpt_dir))


def test_transformers4_style_config(tiny_llama_dir: str, tmp_path: Path) -> None:
    spec = _spec_of(tiny_llama_dir, tmp_path, {
        "rope_parameters": ..., "rope_theta": 500000.0, "head_dim": ..., "num_key_value_heads": ...,
        "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": [7, 8],
    })
    assert (spec.rope_theta == 500000.0
            and spec.rope_scaling == {"rope_type": "linear", "factor": 2.0})
    assert (spec.head_dim, spec.num_kv_heads, spec.eos_token_ids) == (16, 4, (7, 8))


def test_mistral_config_and_generation_eos(tiny_llama_dir: str, tmp_path: Path) -> None:
    spec = _spec_of(
        tiny_llama_dir, tmp_path,
        {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 256,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
        generation={"eos_token_id": [2, 5], "bos_token_id": 1},
    )
    assert (spec.architecture == "llama"
            and spec.max_position_embeddings == 256)  # clamped to the window
    assert spec.rope_theta == 1e6 and spec.rope_scaling == {"rope_type": "yarn", "factor": 4.0}
    assert (spec.eos_token_ids, spec.bos_token_id) == ((2, 5), 1)


def test_gguf_rope_scaling_and_untied(smollm2: Checkpoint, default_model_path: str) -> None:
    from splitserve.model.gguf_file import GGUFFile, gguf_spec

    gguf = GGUFFile.open(default_model_path)
    gguf.metadata.update({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    gguf.tensors["output.weight"] = gguf.tensors["token_embd.weight"]._replace(name="output.weight")
    spec = gguf_spec(gguf)
    assert spec.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert not spec.tie_word_embeddings
    gguf.metadata["general.architecture"] = "gemma"
    with pytest.raises(ModelLoadError, match="architecture 'gemma'.*supported: llama, qwen2"):
        gguf_spec(gguf)


def test_gguf_file_reads_like_gguf_reader(tmp_path: Path) -> None:
    """Our header parser and dequantization against gguf's own reader on a small file."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    from splitserve.model.gguf_file import GGUFFile

    rng = np.random.default_rng(0)
    arrays = {"a.weight": rng.standard_normal((3, 64), dtype=np.float32)}
    path = tmp_path / "toy.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("toy.count", 7)
    writer.add_float32("toy.eps", 0.5)
    writer.add_bool("toy.flag", True)
    writer.add_array("toy.ints", [1, -2, 3])
    writer.add_array("toy.strs", ["x", "ÿ"])
    writer.add_tensor("a.weight", arrays["a.weight"])
    writer.add_tensor("b.weight", arrays["a.weight"].astype(np.float16))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1):
        writer.add_tensor(f"{qtype.name}.weight", quantize(arrays["a.weight"], qtype),
                          raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = GGUFFile.open(str(path))
    assert (ours.metadata["toy.count"] == 7 and ours.metadata["toy.eps"] == 0.5
            and ours.metadata["toy.flag"])
    assert ours.metadata["toy.ints"] == [1, -2, 3] and ours.metadata["toy.strs"] == ["x", "ÿ"]
    reader = gguf.GGUFReader(str(path))
    assert len(reader.tensors) == len(ours.tensors) == 4
    for t in reader.tensors:
        expected = torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32))
        got = ours.load_tensor(t.name)
        assert got.shape == (3, 64) and got.dtype == torch.float32
        assert torch.equal(got, expected.reshape(3, 64)), t.name


@pytest.mark.parametrize("block_count", [2, "two"])
def test_gguf_without_tokenizer_or_with_bad_metadata(tmp_path: Path, block_count: Any) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "notok.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"context_length": 64, "embedding_length": 32, "feed_forward_length": 64,
                       "attention.head_count": 4}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    if isinstance(block_count, int):
        writer.add_uint32("llama.block_count", block_count)
    else:
        writer.add_string("llama.block_count", block_count)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="no tokenizer|ValueError") as info:
        open_checkpoint(str(path))
    assert str(path) in str(info.value)
