"""A request inside one engine: its tokens, progress and state."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from splitserve.engine.sampling_params import SamplingParams
from splitserve.kv_cache import BlockHash, hash_full_blocks


class RequestStatus(IntEnum):
    WAITING = 0
    WAITING_FOR_KV = 1  # its prompt KV will be imported, not computed
    RUNNING = 2
    PREEMPTED = 3
    # Finished states sort last.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)  # identity equality: requests are entities
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # params.seed, or one drawn at admission
    cache_root: BlockHash  # root of the chained block hashes: model fingerprint + namespace
    max_tokens: int  # params.max_tokens capped by max_model_len
    eos_token_ids: frozenset[int]
    arrival_time: float
    status: RequestStatus = RequestStatus.WAITING
    # Keep the KV blocks after finishing, for export; released by the engine's release_kv.
    hold_kv: bool = False
    # Whose cache its blocks count against in the tiers below the pool (quotas, keys).
    tenant: str | None = None
    # Output tokens an earlier attempt already produced (a retry or a migration resumes
    # the sequence): they count as output for sampling, penalties, stops and max_tokens.
    resumed_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache. Catches up with num_tokens; the last token of a
    # running request is never computed until the step that samples the next one.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (last admission)
    num_preemptions: int = 0
    # A prefix import (peer fetch): only tokens [0, kv_prefix_end) of a WAITING_FOR_KV
    # request are imported; it computes the rest itself. None: the whole prefill range.
    kv_prefix_end: int | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    stop_reason: int | str | None = None

    def __post_init__(self) -> None:
        self.output_token_ids = list(self.resumed_token_ids)
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens known at admission (prompt + resumed output): what a prefill computes
        or a KV import provides before the first new token is sampled."""
        return len(self.prompt_token_ids) + len(self.resumed_token_ids)

    @property
    def kv_import_end(self) -> int:
        """Where the KV an import provides ends: the prefix, or the whole prefill range."""
        return self.num_prefill_tokens if self.kv_prefix_end is None else self.kv_prefix_end

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int, block_size: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.update_block_hashes(block_size)

    def update_block_hashes(self, block_size: int) -> None:
        """Extends block_hashes to cover every full block of all_token_ids."""
        num_full = self.num_tokens // block_size
        done = len(self.block_hashes)
        if num_full > done:
            parent = self.block_hashes[-1] if done else self.cache_root
            tokens = self.all_token_ids[done * block_size:num_full * block_size]
            self.block_hashes.extend(hash_full_blocks(parent, tokens, block_size))
