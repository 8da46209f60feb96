"""Weight-only int8: close to the unquantized model, and never mistaken for it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from splitserve import LLM, SamplingParams
from splitserve.model.quant import Int8Linear


def test_int8_linear_matches_dequantized_math() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    q = Int8Linear(lin)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    dequant = q.weight_int8.float() * q.scale.float()[:, None]
    expected = x.float() @ dequant.T + lin.bias.float()
    assert torch.allclose(q(x).float(), expected, atol=0.05, rtol=0.02)
    # and the quantization error itself is small relative to the weights
    assert (dequant - lin.weight.float()).abs().max() <= lin.weight.float().abs().max() / 127


def test_int8_engine_stays_close_and_has_its_own_fingerprint(tiny_llama_dir: str) -> None:
    bf16 = LLM(tiny_llama_dir, dtype="bfloat16", num_blocks=64, debug_invariants=True)
    int8 = LLM(tiny_llama_dir, dtype="bfloat16", quantization="int8", num_blocks=64,
               debug_invariants=True)
    assert bf16.engine.fingerprint != int8.engine.fingerprint
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    prompt = list(range(300, 340))
    a, b = bf16.generate(prompt, params)[0], int8.generate(prompt, params)[0]
    assert len(b.token_ids) == 8
    # The first token's distribution is close: the int8 top-1 is in the bf16 top-5.
    assert b.logprobs is not None and a.logprobs is not None
    assert b.token_ids[0] in [t for t, _ in a.logprobs[0].top_logprobs or []]
    int8.engine.check_invariants()


def test_unknown_quantization_is_rejected(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="quantization"):
        LLM(tiny_llama_dir, quantization="int3")
