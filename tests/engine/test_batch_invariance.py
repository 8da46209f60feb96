"""Batch invariance in the default dtype (bf16, exact kernels): a request's tokens, logits
(every row any engine samples from, and the log-probabilities, bit for bit) and KV are
those of the request run alone, whatever shares its steps: other requests, prompt chunks
of any size, prefix hits, decodes next to prefills. And a sequence prefilled from its
prompt plus k generated tokens (what a migration or a retry does) continues exactly as the
uninterrupted one.

These rest on the exact kernels' contract (tests/model/test_exact_kernels.py), not on any
particular oneDNN kernel, so they must hold on every x86 CPU and ISA level.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve import LLM, SamplingParams
import splitserve.engine.runner as runner_module
from splitserve.engine.batch import SampleSpec
from splitserve.engine.engine import LLMEngine
from splitserve.engine.output import RequestOutput
from splitserve.model import kernels

pytestmark = pytest.mark.skipif(not kernels.is_supported(torch.device("cpu"), torch.bfloat16),
                                reason="exact kernels need an x86 CPU with AVX2")

CHUNKS = (5, 16, 64, 512)  # max_num_batched_tokens: prompt chunks of any size
# (thread counts and ISA levels: tests/model/test_exact_kernels.py; CI reruns this file
# with SPLITSERVE_CPU_ISA=avx2)


def _signature(out: RequestOutput) -> tuple[Any, ...]:
    assert out.logprobs is not None
    return (out.token_ids, [(s.token_id, s.logprob, s.top_logprobs) for s in out.logprobs])


def _params(seed: int | None, max_tokens: int) -> SamplingParams:
    if seed is None:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True, logprobs=3)


class LogitsLedger:
    """Every logits row any engine samples from, by (model, prompt + output so far): the
    same tokens must always give the same full row of logits, bit for bit, in whatever
    batch, chunk or engine it was computed. (Rows are kept as digests.)"""

    def __init__(self) -> None:
        self.rows: dict[tuple[Any, ...], bytes] = {}
        self.num_checked = 0
        self._model: str | None = None

    def watch(self, llm: LLM, model: str) -> None:
        sampled_logits = llm.engine.model.sampled_logits

        def tagged(*args: Any) -> Any:
            self._model = model
            return sampled_logits(*args)
        llm.engine.model.sampled_logits = tagged  # type: ignore[method-assign,assignment]

    def wrap(self, sample: Callable[..., Any]) -> Callable[..., Any]:
        def checked(logits: torch.Tensor, specs: list[SampleSpec],
                    first_max: list[int] | None = None) -> Any:
            for row, spec in zip(logits, specs):
                key = (self._model, tuple(spec.prompt_token_ids), tuple(spec.output_token_ids))
                digest = hashlib.blake2b(row.contiguous().numpy().tobytes()).digest()
                assert self.rows.setdefault(key, digest) == digest, f"logits differ: {key}"
                self.num_checked += 1
            if first_max is not None:  # the step's own argmax: numpy's
                assert first_max == logits.numpy().argmax(axis=-1).tolist()
            return sample(logits, specs, first_max)
        return checked


LEDGER = LogitsLedger()


@pytest.fixture(scope="module", autouse=True)
def _check_every_logits_row() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner_module, "sample", LEDGER.wrap(runner_module.sample))
        yield
    assert LEDGER.num_checked > len(LEDGER.rows)  # rows were computed more than once


class Engines:
    """Engines over one model on the CPU (where the exact kernels run, also on a machine
    with a GPU): one per chunk size (prefix cache on) and the reference that runs each
    request alone, in one chunk, without prefix caching."""

    def __init__(self, model: str | None, **kwargs: Any) -> None:
        kwargs["device"] = "cpu"
        self.batched = {c: LLM(model, max_num_batched_tokens=c, debug_invariants=True, **kwargs)
                        for c in CHUNKS}
        self.alone = LLM(model, max_num_batched_tokens=512, enable_prefix_caching=False,
                         **kwargs)
        assert all(llm.engine.batch_invariant for llm in [self.alone, *self.batched.values()])
        tag = f"{model}+{kwargs.get('quantization')}"  # int8 logits are their own
        for llm in [self.alone, *self.batched.values()]:
            LEDGER.watch(llm, tag)
        self._memo: dict[Any, tuple[Any, ...]] = {}

    def alone_signature(self, prompt: list[int], params: SamplingParams) -> tuple[Any, ...]:
        key = (tuple(prompt), params.seed, params.max_tokens)
        if key not in self._memo:
            self._memo[key] = _signature(self.alone.generate([prompt], params)[0])
        return self._memo[key]


@pytest.fixture(scope="module")
def tiny_engines(tiny_llama_dir: str) -> Engines:
    # head_dim 16: the kernels' tail paths; random weights: nearly flat logits, so any
    # difference in bits shows in the tokens quickly
    return Engines(tiny_llama_dir, num_blocks=512, max_model_len=512)


@pytest.fixture(scope="module")
def tiny_int8_engines(tiny_llama_dir: str) -> Engines:
    """Weight-only int8 runs on the same exact kernels: invariant the same way."""
    return Engines(tiny_llama_dir, num_blocks=512, max_model_len=512, quantization="int8")


@pytest.fixture(scope="module")
def smol_engines() -> Engines:
    return Engines(None, num_blocks=256, max_model_len=2048)


requests = st.lists(
    st.tuples(st.lists(st.integers(100, 40000), min_size=1, max_size=60),  # prompt tail
              st.booleans(),  # starts with the shared prefix (a prefix-cache hit)
              st.one_of(st.none(), st.integers(0, 2**31)),  # None: greedy; else the seed
              st.integers(1, 6)),  # max_tokens
    min_size=1, max_size=10)


def _check_batch(engines: Engines, batch: list[Any], prefix: list[int], chunk: int) -> None:
    prompts = [(prefix if shared else []) + tail for tail, shared, _, _ in batch]
    params = [_params(seed, n) for _, _, seed, n in batch]
    llm = engines.batched[chunk]
    for attempt in range(2):  # the second time, every shared prefix is a cache hit
        outs = llm.generate(prompts, params)
        for i, (prompt, p, out) in enumerate(zip(prompts, params, outs)):
            assert _signature(out) == engines.alone_signature(prompt, p), (attempt, i)
    llm.engine.check_invariants()


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=requests, prefix=st.lists(st.integers(100, 40000), min_size=16, max_size=40),
       chunk=st.sampled_from(CHUNKS))
def test_any_batch_gives_each_request_its_bits_alone_tiny(tiny_engines: Engines, batch: Any,
                                                         prefix: list[int], chunk: int) -> None:
    _check_batch(tiny_engines, batch, prefix, chunk)


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=requests, prefix=st.lists(st.integers(100, 40000), min_size=16, max_size=40),
       chunk=st.sampled_from(CHUNKS))
def test_any_batch_gives_each_request_its_bits_alone_int8(tiny_int8_engines: Engines,
                                                         batch: Any, prefix: list[int],
                                                         chunk: int) -> None:
    _check_batch(tiny_int8_engines, batch, prefix, chunk)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=requests, prefix=st.lists(st.integers(100, 40000), min_size=16, max_size=40),
       chunk=st.sampled_from(CHUNKS))
def test_any_batch_gives_each_request_its_bits_alone_default_model(
        smol_engines: Engines, batch: Any, prefix: list[int], chunk: int) -> None:
    _check_batch(smol_engines, batch, prefix, chunk)


def _prompt_kv(engine: LLMEngine, request_id: str) -> list[torch.Tensor]:
    kv = engine.export_kv(request_id)
    layers = [engine.read_kv_layer(i, kv.block_ids) for i in range(engine.spec.num_layers)]
    # [2, blocks, block_size, heads, dim] -> the prompt's tokens only
    return [x.flatten(1, 2)[:, :kv.end_token] for x in layers]


def test_prompt_kv_is_the_same_bits_in_any_batch(smol_engines: Engines) -> None:
    """The KV a prefill worker exports is what any other engine would compute."""
    prompt = list(range(3000, 3045))
    others = [list(range(500, 530)), list(range(9000, 9100))]
    one = SamplingParams(temperature=0, max_tokens=1)
    alone = smol_engines.alone.engine
    alone.add_request("p", prompt, one, hold_kv=True)
    while alone.has_unfinished:
        alone.step()
    want = _prompt_kv(alone, "p")
    alone.release_kv("p")
    batched = smol_engines.batched[16].engine  # 16-token chunks, two other prompts beside it
    for i, other in enumerate(others):
        batched.add_request(f"o{i}", other, SamplingParams(temperature=0, max_tokens=5))
    batched.add_request("p", prompt, one, hold_kv=True)
    while batched.has_unfinished:
        batched.step()
    got = _prompt_kv(batched, "p")
    batched.release_kv("p")
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def _finish(engine: LLMEngine, request_id: str) -> RequestOutput:
    last = None
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == request_id:
                last = out
    assert last is not None and last.finished
    return last


@pytest.mark.parametrize("seed", [None, 1234], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 18, 19, 20, 30])
def test_replay_from_prompt_plus_k_tokens_continues_exactly(smol_engines: Engines, k: int,
                                                            seed: int | None) -> None:
    # 29 prompt tokens: k = 3 ends the replayed prefix on a block boundary (32), k = 2 and
    # 4 around it, 19 on the next (48), 18 and 20 around it.
    prompt = list(range(7000, 7029))
    params = _params(seed, 36)
    engine = smol_engines.batched[64].engine
    engine.add_request("full", prompt, params)
    engine.add_request("beside", list(range(100, 160)), _params(None, 20))
    full = _finish(engine, "full")
    other = smol_engines.batched[5].engine  # another engine, other chunking, no shared cache
    other.add_request("replay", prompt, params, resume_token_ids=full.token_ids[:k])
    replay = _finish(other, "replay")
    assert replay.token_ids == full.token_ids
    assert replay.text == full.text
