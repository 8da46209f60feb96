"""What benchmarks/engine.py measures: the workloads (prefill, batch-1 and batch-32 decode) on
our engine and on HF transformers, and the roofline bound of each figure."""
from __future__ import annotations

import functools
import itertools
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
try:
    from benchmarks.common import median
except ImportError:  # run as a plain script from benchmarks/
    from common import median  # type: ignore[no-redef]

from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams

PREFILL_LEN = 512
DECODE_PROMPT_LEN = 128
BATCH = 32
_ids = itertools.count()
_seeds = itertools.count(1)


# -- workloads --------------------------------------------------------------------------------
def random_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    """Fresh random token ids (no special tokens) on every call: no prefix can be reused."""
    rng = random.Random(next(_seeds) * 7919)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


@dataclass
class Figure:
    """Throughput samples (tokens/s) of one measurement."""
    samples: list[float] = field(default_factory=list)

    @property
    def value(self) -> float:
        return median(self.samples) if self.samples else float("nan")

    def cell(self) -> str:
        if not self.samples:
            return "-"
        if len(self.samples) == 1:
            return f"{self.value:,.0f}"
        return f"{self.value:,.0f} ({min(self.samples):,.0f}-{max(self.samples):,.0f})"


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def engine_prefill(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from add_request to the first token of a max_tokens=1 request."""
    rid = f"prefill-{next(_ids)}"
    steps = 0
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, greedy(1))
    done = False
    while not done:
        outs = engine.step()
        steps += 1
        done = any(o.request_id == rid and o.token_ids for o in outs)
    elapsed = time.perf_counter() - t0
    assert steps == 1, f"prefill took {steps} steps; raise max_num_batched_tokens"
    while engine.has_unfinished:
        engine.step()
    return elapsed


def engine_decode(engine: LLMEngine, prompts: Sequence[list[int]], new_tokens: int
                  ) -> tuple[float, int]:
    """(seconds, tokens) of the decode steps only: all prompts are prefilled together in one
    step (untimed), then every later step decodes one token for each request."""
    params = greedy(new_tokens)
    ids = [f"decode-{next(_ids)}" for _ in prompts]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    counts: dict[str, int] = {}
    prefill_steps = 0
    while len(counts) < len(ids):
        for o in engine.step():
            if o.token_ids:
                counts[o.request_id] = len(o.token_ids)
        prefill_steps += 1
    assert prefill_steps == 1 and all(c == 1 for c in counts.values()), (
        "the prompts did not prefill in one step; raise max_num_batched_tokens/max_num_seqs")
    t0 = time.perf_counter()
    while engine.has_unfinished:
        for o in engine.step():
            counts[o.request_id] = len(o.token_ids)
    elapsed = time.perf_counter() - t0
    tokens = sum(counts.values()) - len(ids)
    assert tokens == len(ids) * (new_tokens - 1), (tokens, len(ids), new_tokens)
    return elapsed, tokens


# -- HF transformers reference -------------------------------------------------------------------
def load_hf_reference(gguf_path: str) -> nn.Module:
    """Dense fp32 HF LlamaForCausalLM with exactly the GGUF's dequantized weights
    (shared/FACTS.md: config from the GGUF, tensors from load_gguf_checkpoint, tied lm_head)."""
    import gguf
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    directory, name = os.path.split(gguf_path)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    with no_init_weights():
        model = LlamaForCausalLM(config)
    original, original_tqdm = gguf.get_tensor_name_map, gguf_utils.tqdm
    # transformers rebuilds this pure name map ~400 times; memoizing it only saves time.
    gguf.get_tensor_name_map = functools.cache(original)
    gguf_utils.tqdm = lambda iterable, **_: iterable  # no progress bar in the output
    try:
        tensors = load_gguf_checkpoint(gguf_path, return_tensors=True,
                                       model_to_load=model)["tensors"]
    finally:
        gguf.get_tensor_name_map, gguf_utils.tqdm = original, original_tqdm
    result = model.load_state_dict(tensors, strict=False, assign=True)
    assert not result.unexpected_keys and result.missing_keys == ["lm_head.weight"], result
    model.tie_weights()
    return model.float().eval()


@torch.inference_mode()
def hf_prefill(model: nn.Module, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0


@torch.inference_mode()
def hf_decode(model: nn.Module, prompts: Sequence[list[int]], new_tokens: int
              ) -> tuple[float, int]:
    """Greedy decode with the KV cache (equal-length prompts: no padding, no mask); times
    the new_tokens - 1 steps after the prefill forward."""
    ids = torch.tensor(list(prompts))
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        out = model(input_ids=tok, past_key_values=past, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - t0, len(prompts) * (new_tokens - 1)


# -- the machine's bound for each figure -----------------------------------------------------------
@dataclass
class Bound:
    tok_s: float
    limited_by: str
    flop_per_token: float
    bytes_per_step: float
    tokens_per_step: int


def model_counts(engine: LLMEngine) -> dict[str, float]:
    """Weights from the spec (the engine's linears may be packed, int8 or plain)."""
    s = engine.spec
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    linear = s.num_layers * (s.hidden_size * (q + 2 * kv) + q * s.hidden_size
                             + 3 * s.hidden_size * s.intermediate_size)
    head = s.vocab_size * s.hidden_size
    norms = (2 * s.num_layers + 1) * s.hidden_size
    # The LM head is read once per step; an untied embedding only one row per token.
    weight_bytes = (linear + head + norms) * engine.dtype.itemsize
    if engine.config.quantization == "int8":  # one byte a weight, an fp32 scale a row
        rows = s.num_layers * (q + 2 * kv + s.hidden_size + 2 * s.intermediate_size
                               + s.hidden_size) + s.vocab_size
        weight_bytes = linear + head + 4 * rows + norms * engine.dtype.itemsize
    return {"linear": float(linear), "head": float(head), "weight_bytes": float(weight_bytes),
            "kv_bytes_per_token": float(2 * s.num_layers * s.num_kv_heads * s.head_dim
                                        * engine.dtype.itemsize),
            "attn_flop_per_key": float(4 * s.num_layers * s.num_heads * s.head_dim)}


def model_shapes(engine: LLMEngine) -> list[tuple[int, int]]:
    """(out, in) of one layer's projections as the engine runs them: QKV and gate/up fused."""
    s = engine.spec
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return [(q + 2 * kv, s.hidden_size), (s.hidden_size, q),
            (2 * s.intermediate_size, s.hidden_size), (s.hidden_size, s.intermediate_size)]


def roofline(flop_per_token: float, tokens_per_step: int, bytes_per_step: float,
             flops: float, bandwidth: float) -> Bound:
    t_flop = flop_per_token * tokens_per_step / flops
    t_mem = bytes_per_step / bandwidth
    t = max(t_flop, t_mem)
    return Bound(tokens_per_step / t, "FLOP/s" if t_flop >= t_mem else "DRAM bandwidth",
                 flop_per_token, bytes_per_step, tokens_per_step)


def bounds(engine: LLMEngine, flops: float, bandwidth: float, new_tokens: int
           ) -> dict[str, Bound]:
    """Roofline of each figure: max(FLOP / GEMM FLOP/s, bytes / DRAM read bandwidth)."""
    c = model_counts(engine)
    # Prefill: projections for every token, causal attention (token t sees t+1 keys, so
    # ~L/2 keys on average), the LM head only for the last position.
    prefill_flop = (2 * c["linear"] + c["attn_flop_per_key"] * (PREFILL_LEN + 1) / 2
                    + 2 * c["head"] / PREFILL_LEN)
    # Decode: every token runs all projections and the LM head; its attention reads the
    # context (average over the decode: prompt + half the new tokens).
    ctx = DECODE_PROMPT_LEN + new_tokens / 2
    decode_flop = 2 * c["linear"] + 2 * c["head"] + c["attn_flop_per_key"] * ctx
    return {
        "prefill": roofline(prefill_flop, PREFILL_LEN, c["weight_bytes"] + PREFILL_LEN
                            * c["kv_bytes_per_token"], flops, bandwidth),
        "decode_b1": roofline(decode_flop, 1, c["weight_bytes"] + ctx * c["kv_bytes_per_token"],
                              flops, bandwidth),
        "decode_b32": roofline(decode_flop, BATCH, c["weight_bytes"] + BATCH * ctx
                               * c["kv_bytes_per_token"], flops, bandwidth),
    }
