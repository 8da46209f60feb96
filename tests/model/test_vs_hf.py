"""Model math against HF transformers (the independent reference): fp32 token for token,
and the default bf16 engine (exact kernels) as close to the fp32 reference as HF's bf16.

Greedy decoding meets near-ties (top-2 margin < 0.01) on some prompts; two correct fp32
implementations may diverge there. Each comparison therefore runs up to and including the
reference's first near-tie position (margin 0.01 for the real model; 1e-4 for the
tiny random ones, whose logits are small and flat), and the test requires that most tokens
were compared.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.model.attention import AttentionMetadata, PrefillSlice, forward_context

NEAR_TIE = 0.01
PROMPTS = [
    "The capital of France is",
    "Write a Python function that reverses a string.",
    "Once upon a time, in a small village by the sea,",
    "List three prime numbers greater than 100:",
    "Explain why the sky is blue in one paragraph.",
    "def fibonacci(n):\n    ",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "The three laws of thermodynamics are",
]


def hf_greedy(hf, prompt_ids: list[int], max_new: int, near_tie: float
              ) -> tuple[list[int], int]:
    """Reference tokens and the number of leading positions that are safe to compare."""
    out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False,
                      output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    safe = len(tokens)
    for i, scores in enumerate(out.scores):
        top2 = scores[0].float().topk(2).values
        if float(top2[0] - top2[1]) < near_tie:
            safe = i + 1  # the tie position itself may still agree; nothing after it counts
            break
    return tokens, safe


def last_logits(llm: LLM, prompt_ids: list[int]) -> torch.Tensor:
    """Our model's last-position logits for one prompt, through paged attention."""
    engine = llm.engine
    n, device = len(prompt_ids), engine.device
    num_blocks = -(-n // engine.block_size)
    meta = AttentionMetadata(
        kv_cache=engine.kv_cache, slot_mapping=torch.arange(n, device=device), num_decodes=0,
        decode_block_tables=None, decode_padding=None, decode_context_lens=[],
        prefills=[PrefillSlice(0, n, 0, torch.arange(num_blocks, device=device), None)])
    with torch.inference_mode(), forward_context(meta):
        hidden = engine.model(torch.tensor(prompt_ids, device=device),
                              torch.arange(n, device=device))
        return engine.model.compute_logits(hidden[-1:])[0].cpu()


def compare(llm: LLM, hf, prompts: list[list[int]], max_new: int,
            near_tie: float = NEAR_TIE) -> None:
    # Both stop at EOS (HF's generate does), so the reference may be shorter than max_new.
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new))
    compared = total = 0
    for p, out in zip(prompts, ours):
        ref, safe = hf_greedy(hf, p, max_new, near_tie)
        assert out.token_ids[:safe] == ref[:safe], f"prompt {p[:8]}... diverged before a near-tie"
        if safe == len(ref):
            assert out.token_ids == ref
        compared += safe
        total += len(ref)
        with torch.inference_mode():
            ref_logits = hf(torch.tensor([p])).logits[0, -1].float()
        rel = (last_logits(llm, p) - ref_logits).norm() / ref_logits.norm()
        assert rel < 1e-3, f"last-position logits relative error {rel:.2e}"
    assert compared >= 0.75 * total, f"only {compared}/{total} tokens were comparable"


def test_default_model_matches_hf(hf_reference_smollm2) -> None:
    llm = LLM(dtype="float32", num_blocks=512, debug_invariants=True)
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                          add_special_tokens=False) for p in PROMPTS[:4]]
    prompts += [tok.encode(p) for p in PROMPTS[4:]]
    compare(llm, hf_reference_smollm2, prompts, max_new=64)
    llm.engine.check_invariants()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_random_models_match_hf(arch: str, tiny_llama_dir: str, tiny_qwen2_dir: str) -> None:
    from transformers import AutoModelForCausalLM
    path = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", num_blocks=128, debug_invariants=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (5, 17, 33, 64)]
    # Random weights give small, flat logits (|logit| < 1): near-ties are far more common,
    # and fp32 implementations agree to ~1e-6, so a tighter tie margin is the fair cut.
    compare(llm, hf, prompts, max_new=32, near_tie=1e-4)


def test_exact_bf16_engine_is_as_close_to_hf_fp32_as_hf_bf16(hf_reference_smollm2) -> None:
    """The default engine (bf16, exact kernels: their own summation orders) against the fp32
    reference: last-position logits on average no further off than HF's own bf16 model
    (per prompt both scatter between ~1% and ~7%: bf16 rounding, not a bias), and the same
    greedy token wherever the reference has no near-tie."""
    import copy
    llm = LLM(device="cpu", num_blocks=512, debug_invariants=True)  # the exact kernels' device
    assert llm.engine.batch_invariant
    rows: list[torch.Tensor] = []
    sampled_logits = llm.engine.model.sampled_logits

    def capture(*args: Any) -> tuple[torch.Tensor, list[int] | None]:
        logits, first_max = sampled_logits(*args)
        rows.append(logits)
        return logits, first_max
    llm.engine.model.sampled_logits = capture  # type: ignore[method-assign,assignment]
    hf32 = hf_reference_smollm2
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    tok = llm.tokenizer
    ours_err, hf_err = [], []
    for text in PROMPTS:
        p = tok.encode(text)
        rows.clear()
        llm.generate([p], SamplingParams(temperature=0, max_tokens=1))
        ours = rows[0][0].float()
        with torch.inference_mode():
            ref = hf32(torch.tensor([p])).logits[0, -1].float()
            theirs = hf16(torch.tensor([p])).logits[0, -1].float()
        ours_err.append(float((ours - ref).norm() / ref.norm()))
        hf_err.append(float((theirs - ref).norm() / ref.norm()))
        top2 = ref.topk(2).values
        if float(top2[0] - top2[1]) > 0.5:
            assert int(ours.argmax()) == int(ref.argmax()), text
    assert max(ours_err) < 0.1, ours_err
    assert sum(ours_err) < 1.5 * sum(hf_err), (ours_err, hf_err)
