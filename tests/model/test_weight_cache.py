"""The exact kernels' packed weights kept on disk (model/weight_cache.py): what is read back
is what was packed, bit for bit (a model built from it has the packed model's every
tensor, and the real engine generates the same tokens from it); a damaged file is
ignored; a new build's file replaces the old one of the same checkpoint, quantization and
dtype only."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams
from splitserve.model import kernels, weight_cache
from splitserve.model.llama import LlamaForCausalLM
from splitserve.model.spec import ModelSpec

pytestmark = pytest.mark.skipif(not kernels.is_supported(torch.device("cpu"), torch.bfloat16),
                                reason="exact kernels need an x86 CPU with AVX2")

SPEC = ModelSpec("qwen2", vocab_size=300, hidden_size=128, intermediate_size=320,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                 rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=True,
                 attention_bias=True)


def _model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(SPEC)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.to(torch.bfloat16)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_model_built_from_kept_weights_has_the_packed_models_every_tensor(
        tmp_path: Path, quantization: str | None) -> None:
    packed = kernels.use_exact_kernels_(_model(1), quantization)
    state = kernels.exact_state(packed)
    assert any(k.endswith(".bias") for k in state)  # qkv's, in fp32
    assert any(k.endswith(".scale") for k in state) == (quantization == "int8")
    path = tmp_path / "w-1.safetensors"
    weight_cache.write(path, state)
    kept = weight_cache.read(path)
    assert kept is not None
    _assert_same(kept, state)
    # Another model of the spec (other numbers): built from them, it is the packed one.
    rebuilt = kernels.use_exact_kernels_(_model(2), quantization, kept)
    _assert_same(kernels.exact_state(rebuilt), state)
    assert getattr(rebuilt.model, "exact_decoder") is not None  # built on them


def test_a_damaged_or_missing_file_is_ignored(tmp_path: Path) -> None:
    state = kernels.exact_state(kernels.use_exact_kernels_(_model(1)))
    path = tmp_path / "w-1.safetensors"
    assert weight_cache.read(None) is None and weight_cache.read(path) is None
    weight_cache.write(path, state)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40  # a bit of the last tensor's bytes
    path.write_bytes(bytes(data))
    assert weight_cache.read(path) is None
    path.write_bytes(bytes(data[: len(data) // 2]))  # cut short
    assert weight_cache.read(path) is None
    path.write_bytes(b"not a safetensors file")
    assert weight_cache.read(path) is None
    weight_cache.write(path, state)  # rewritten, as the start that found it damaged does
    assert weight_cache.read(path) is not None


def test_a_new_build_replaces_only_the_file_of_its_checkpoint_and_kind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(weight_cache.CACHE_ENV, str(tmp_path))
    path = weight_cache.cache_file("abc", SPEC, None, torch.bfloat16)
    assert path is not None and path.parent == tmp_path and path.name.startswith("abc-")
    # Whatever decides the bytes names another file.
    untied = replace(SPEC, tie_word_embeddings=False)
    for other in (("abc", SPEC, "int8", torch.bfloat16), ("abc", SPEC, None, torch.float32),
                  ("xyz", SPEC, None, torch.bfloat16), ("abc", untied, None, torch.bfloat16)):
        assert weight_cache.cache_file(*other) != path, other
    int8 = weight_cache.cache_file("abc", SPEC, "int8", torch.bfloat16)
    assert int8 is not None
    older = [path.with_name(path.name.rsplit("-", 1)[0] + f"-{n}.safetensors")
             for n in ("0000000000000000", "1111111111111111")]
    others = [int8, path.with_name(path.name.replace("abc-", "xyz-"))]
    for old in older + others:
        old.write_bytes(b"old")
    weight_cache.write(path, {"w": torch.ones(4, dtype=torch.bfloat16)})
    assert sorted(tmp_path.iterdir()) == sorted([path, *others])
    monkeypatch.setenv(weight_cache.CACHE_ENV, "off")
    assert weight_cache.cache_file("abc", SPEC, None, torch.bfloat16) is None


def test_the_engine_from_kept_weights_generates_what_the_engine_packed_afresh_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real default model in bf16: the first engine packs and keeps its weights, the
    second reads them; every tensor and every greedy token of a batch are the same."""
    monkeypatch.setenv(weight_cache.CACHE_ENV, str(tmp_path))
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    first = LLM(num_threads=1)
    [kept] = list(tmp_path.iterdir())
    second = LLM(num_threads=1)
    assert list(tmp_path.iterdir()) == [kept]  # read, not written again
    _assert_same(kernels.exact_state(second.engine.model),
                 kernels.exact_state(first.engine.model))
    assert second.engine.fingerprint == first.engine.fingerprint
    assert ([o.token_ids for o in second.generate(prompts, params)]
            == [o.token_ids for o in first.generate(prompts, params)])
