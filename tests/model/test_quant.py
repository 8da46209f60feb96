"""Weight-only int8: close to the unquantized model, never mistaken for it, and only where
the exact kernels run it (the kernel itself: tests/model/test_exact_int8.py)."""
from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.model import kernels


def test_int8_engine_stays_close_and_has_its_own_fingerprint(tiny_llama_dir: str) -> None:
    bf16 = LLM(tiny_llama_dir, device="cpu", dtype="bfloat16", num_blocks=64, debug_invariants=True)
    int8 = LLM(tiny_llama_dir, device="cpu", dtype="bfloat16", quantization="int8", num_blocks=64,
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
        LLM(tiny_llama_dir, device="cpu", quantization="int3")


@pytest.mark.skipif(not kernels.is_supported(torch.device("cpu"), torch.bfloat16),
                    reason="exact kernels need an x86 CPU with AVX2")
def test_int8_runs_only_on_the_exact_kernels(tiny_llama_dir: str) -> None:
    int8 = LLM(tiny_llama_dir, device="cpu", dtype="bfloat16", quantization="int8", num_blocks=64)
    assert int8.engine.batch_invariant
    head = int8.engine.model.lm_head
    assert isinstance(head, kernels.ExactLinear) and head.packed.dtype == torch.int8
    with pytest.raises(ValueError, match="batch_invariant=False"):
        LLM(tiny_llama_dir, device="cpu", quantization="int8", batch_invariant=False)
