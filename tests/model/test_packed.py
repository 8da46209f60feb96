"""oneDNN-packed linear weights: the same numbers as nn.Linear, used by bf16 CPU engines."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from splitserve import LLM, SamplingParams
from splitserve.model.packed import PackedLinear, can_pack

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16),
                                reason="this PyTorch build has no oneDNN weight packing")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical_to_linear(bias: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(576, 960, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(lin)
    for rows in (1, 5, 32, 300):
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        assert torch.equal(packed(x), lin(x)), rows
    x3 = torch.randn(2, 3, 576, dtype=torch.bfloat16)
    assert torch.equal(packed(x3), lin(x3))


def test_bf16_engine_packs_and_generates_what_plain_weights_do(
        tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(tiny_llama_dir, dtype="bfloat16", num_blocks=64, debug_invariants=True)
    model = llm.engine.model
    assert isinstance(model.lm_head, PackedLinear)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, PackedLinear)
    # fp32 engines keep plain nn.Linear (the HF parity tests run those)
    fp32 = LLM(tiny_llama_dir, dtype="float32", num_blocks=64)
    assert isinstance(fp32.engine.model.lm_head, nn.Linear)
    # The same engine with plain weights: same tokens, same logprobs, same fingerprint.
    import splitserve.engine.engine as engine_mod
    monkeypatch.setattr(engine_mod, "can_pack", lambda device, dtype: False)
    plain = LLM(tiny_llama_dir, dtype="bfloat16", num_blocks=64, debug_invariants=True)
    assert isinstance(plain.engine.model.lm_head, nn.Linear)
    assert plain.engine.fingerprint == llm.engine.fingerprint
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [list(range(300, 340)), list(range(1000, 1007)), list(range(50, 250))]
    got, want = llm.generate(prompts, params), plain.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.logprobs == w.logprobs
