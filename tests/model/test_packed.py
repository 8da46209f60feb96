"""oneDNN-packed linear weights: the fast path (`batch_invariant=False`) of bf16 CPU engines.

oneDNN chooses its kernel by row count and ISA (AMX tiles on Intel from some row count on, a
GEMV path for one row), so packed and plain weights are only guaranteed to agree to bf16
rounding, not bit for bit; exact bits are the exact kernels' job (test_exact_kernels.py).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from splitserve import LLM, SamplingParams
from splitserve.model.kernels import ExactLinear, is_supported
from splitserve.model.packed import PackedLinear, can_pack

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16),
                                reason="oneDNN cannot pack bf16 weights here (build or CPU ISA)")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_the_linear_to_bf16_rounding(bias: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(576, 960, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(lin)
    for rows in (1, 5, 32, 300):
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        torch.testing.assert_close(packed(x), lin(x), rtol=2e-2, atol=2e-2)
    x3 = torch.randn(2, 3, 576, dtype=torch.bfloat16)
    torch.testing.assert_close(packed(x3), lin(x3), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not is_supported(torch.device("cpu"), torch.bfloat16),
                    reason="exact kernels need an x86 CPU with AVX2")
def test_fast_path_packs_and_has_its_own_fingerprint(tiny_llama_dir: str) -> None:
    exact = LLM(tiny_llama_dir, device="cpu", dtype="bfloat16", num_blocks=64,
                debug_invariants=True)
    assert exact.engine.batch_invariant
    assert isinstance(exact.engine.model.lm_head, ExactLinear)
    fast = LLM(tiny_llama_dir, device="cpu", dtype="bfloat16", num_blocks=64, debug_invariants=True,
               batch_invariant=False)
    assert isinstance(fast.engine.model.lm_head, PackedLinear)
    assert isinstance(fast.engine.model.model.layers[0].self_attn.qkv_proj, PackedLinear)
    # fp32 engines keep plain nn.Linear (the HF parity tests run those)
    fp32 = LLM(tiny_llama_dir, device="cpu", dtype="float32", num_blocks=64)
    assert isinstance(fp32.engine.model.lm_head, nn.Linear) and not fp32.engine.batch_invariant
    # Their bits differ, so their KV must never mix.
    assert len({exact.engine.fingerprint, fast.engine.fingerprint,
                fp32.engine.fingerprint}) == 3
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [list(range(300, 340)), list(range(1000, 1007))]
    for got, want in zip(fast.generate(prompts, params), exact.generate(prompts, params)):
        assert len(got.token_ids) == len(want.token_ids) == 12
        # the first token's log-probabilities agree to bf16 rounding
        assert got.logprobs is not None and want.logprobs is not None
        assert abs((got.logprobs[0].logprob or 0) - (want.logprobs[0].logprob or 0)) < 0.1


def test_batch_invariant_where_it_cannot_run_is_refused(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="batch_invariant=True needs bfloat16"):
        LLM(tiny_llama_dir, device="cpu", dtype="float32", num_blocks=64, batch_invariant=True)
    with pytest.raises(ValueError, match="quantization=int8 needs bfloat16"):
        LLM(tiny_llama_dir, device="cpu", dtype="float32", num_blocks=64, quantization="int8")
    # int8 weights run on the exact kernels: asking for invariance with them is fine
    assert LLM(tiny_llama_dir, device="cpu", dtype="bfloat16", num_blocks=64, quantization="int8",
               batch_invariant=True).engine.batch_invariant
