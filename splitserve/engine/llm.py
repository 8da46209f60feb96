"""Offline API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages, params)`."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from splitserve.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.output import RequestOutput
from splitserve.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Runs an engine to completion over a list of prompts (batched, continuous).

    `model`: a HF checkpoint directory, a .gguf file, or None for the default model
    (SmolLM2-135M-Instruct). Keyword arguments are engine knobs (see `splitserve.config`):
    dtype, device, num_threads, block_size, num_blocks, kv_cache_memory_bytes,
    enable_prefix_caching, max_num_seqs, max_num_batched_tokens, max_num_partial_prefills,
    max_model_len.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """One output per prompt, in prompt order. A prompt is a string or a list of token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompt_list)
                  if isinstance(sampling_params, SamplingParams) else list(sampling_params))
        if len(params) != len(prompt_list):
            raise ValueError(f"{len(params)} sampling params for {len(prompt_list)} prompts")
        ids = [str(next(self._ids)) for _ in prompt_list]
        try:
            for request_id, prompt, p in zip(ids, prompt_list, params):
                self.engine.add_request(request_id, prompt, p)
        except Exception:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished:
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[i] for i in ids]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation (or a list of them)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        # The template writes special tokens (BOS included) itself: encode without adding more.
        prompts: list[Prompt] = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(
                    conv, add_generation_prompt=True),  # type: ignore[arg-type]
                add_special_tokens=False)
            for conv in conversations]
        return self.generate(prompts, sampling_params)
