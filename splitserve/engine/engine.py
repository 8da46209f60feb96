"""One inference engine: model + paged KV cache + scheduler, driven one step at a time."""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from splitserve.config import EngineConfig
from splitserve.engine.batch import SampledToken, ScheduledBatch
from splitserve.engine.device import resolve_batch_invariant, resolve_device, resolve_dtype
from splitserve.engine.engine_kv import EngineKV
from splitserve.engine.kv_connector import KVLayout, LayerListener
from splitserve.engine.kv_tiers import KVTiers, TierBridge
from splitserve.engine.output import Detokenizer, RequestOutput
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.runner import ModelRunner
from splitserve.engine.sampling_params import SamplingParams, check_length, check_token_ids
from splitserve.engine.scheduler import Scheduler
from splitserve.errors import InvalidRequestError, StepFailed
from splitserve.kv_cache import BlockHash, KVCacheManager, KVEvent, root_hash
from splitserve.model.fingerprint import model_fingerprint
from splitserve.model import weight_cache
from splitserve.model.kernels import (exact_state, isa_name, kernels_version,
                                       use_exact_kernels_)
from splitserve.model.llama import LlamaForCausalLM
from splitserve.model.loader import open_checkpoint
from splitserve.model.memory import huge_page_zeros
from splitserve.model.packed import can_pack, pack_linears_
from splitserve.model.quant import QUANTIZATIONS
from splitserve.model.registry import build_model

logger = logging.getLogger(__name__)


class StepStats(NamedTuple):
    """What one engine step computed and how long it took (feeds the router's cost model)."""
    num_prefill_tokens: int  # prompt tokens computed (prefill chunks)
    num_decode_seqs: int  # sequences that decoded one token
    seconds: float


class EngineLoad(NamedTuple):
    """A snapshot of the engine's queue and memory, for load reports."""
    num_running: int
    num_waiting: int  # waiting or preempted, to be prefilled here
    num_prefilling: int  # running, their prompt not all computed yet (chunked prefill)
    num_waiting_tokens: int  # prompt tokens of both not yet computed
    num_awaiting_kv: int  # WAITING_FOR_KV
    kv_blocks_used: int
    kv_blocks_total: int
    max_num_seqs: int


class LLMEngine(EngineKV):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype)
        ckpt = open_checkpoint(config.model)
        self.spec, self.tokenizer = ckpt.spec, ckpt.tokenizer
        weights_digest = ckpt.weights_digest
        if config.quantization is not None:
            if config.quantization not in QUANTIZATIONS:
                raise ValueError(f"quantization {config.quantization!r} is not supported; "
                                 f"use one of {QUANTIZATIONS} or none")
            weights_digest += f"+{config.quantization}"
        self.batch_invariant = resolve_batch_invariant(config, self.device, self.dtype,
                                                        self.spec)
        model = build_model(self.spec)
        assert isinstance(model, LlamaForCausalLM)
        # The exact kernels' packed weights from an earlier start, when one kept them
        # (quantized weights run on those kernels only: resolve_... says so).
        kept = weight_cache.cache_file(ckpt.weights_digest, self.spec, config.quantization,
                                       self.dtype) \
            if self.batch_invariant and self.device.type == "cpu" else None
        packed = weight_cache.read(kept)
        if packed is None:
            model.load_weights(ckpt.iter_weights())
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        if self.batch_invariant:
            use_exact_kernels_(self.model, config.quantization, packed)
            if packed is None:
                weight_cache.write(kept, exact_state(self.model))
        elif can_pack(self.device, self.dtype):
            pack_linears_(self.model)  # same numbers, faster GEMV: no fingerprint change

        self.max_model_len = config.scheduler.max_model_len or self.spec.max_position_embeddings
        if self.max_model_len > self.spec.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"{self.spec.max_position_embeddings} positions; lower it")
        cache = config.cache
        self.block_size = cache.block_size
        bytes_per_block = (2 * self.spec.num_layers * cache.block_size * self.spec.num_kv_heads
                           * self.spec.head_dim * self.dtype.itemsize)
        num_blocks = cache.num_blocks or max(2, cache.kv_cache_memory_bytes // bytes_per_block)
        # Zeroed so padded reads in attention never meet NaN garbage; on CPU on 2 MB pages
        # (a decode step reads it from DRAM, gathered by block: model/memory.py).
        shape = (self.spec.num_layers, 2, num_blocks, cache.block_size,
                 self.spec.num_kv_heads, self.spec.head_dim)
        self.kv_cache = (huge_page_zeros(shape, self.dtype) if self.device.type == "cpu"
                         else torch.zeros(shape, dtype=self.dtype, device=self.device))
        # Exact and fast kernels give other bits: their KV never mixes.
        self.fingerprint = model_fingerprint(
            self.spec, str(self.dtype).removeprefix("torch."), cache.block_size,
            weights_digest, kernels=kernels_version() if self.batch_invariant else "default")
        self.kv_layout = KVLayout(self.fingerprint, cache.block_size, self.spec.num_layers,
                                  self.spec.num_kv_heads, self.spec.head_dim, self.dtype)
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(self.model, self.kv_cache, cache.block_size, self.device,
                                  exact=self.batch_invariant)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_token_ids = frozenset(self.spec.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        # KV senders use it to stream layer i while layer i+1 computes (kv_connector.py).
        self.layer_listener: LayerListener | None = None
        self._held: dict[str, Request] = {}  # finished requests whose KV is kept for export
        self.num_computed_tokens_total = 0  # tokens run through the model (for tests/metrics)
        self.last_step: StepStats | None = None
        logger.info("engine ready: %s, %d KV blocks of %d tokens, %s on %s, %s kernels",
                    ckpt.path, num_blocks, cache.block_size, self.dtype, self.device,
                    f"batch-invariant ({isa_name()})" if self.batch_invariant else "fast")

    @property
    def num_blocks(self) -> int:
        return self.kv.pool.num_blocks

    @property
    def tier_block_bytes(self) -> int:
        """One block's KV in every layer: what a tier below the pool keeps per block."""
        return self.kv_cache[:, :, 0].numel() * self.kv_cache.element_size()

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    *, namespace: str | None = None, hold_kv: bool = False,
                    await_kv: bool = False, resume_token_ids: list[int] | None = None,
                    tenant: str | None = None, kv_prefix_end: int | None = None) -> Request:
        """Queues a request. `namespace`: which cached prefixes it may hit; `tenant`: whose
        cache its blocks count against below the pool (defaults to the namespace).
        `await_kv`: its prompt KV will be imported (WAITING_FOR_KV); with `kv_prefix_end`
        only the prefix [0, kv_prefix_end) (whole blocks, short of the prompt's end), and
        the request computes the rest here once it is committed (peer fetch);
        `hold_kv`: keep its blocks after it finishes until `release_kv` (for export).
        `resume_token_ids`: output an earlier attempt already produced; the request goes
        on from there exactly as the uninterrupted one would (sampling is a function of
        the seed and the output position, DESIGN 3), and its outputs include them."""
        if request_id in self.scheduler.requests or request_id in self._held:
            raise InvalidRequestError(f"request id {request_id!r} is already in use",
                                      field="request_id")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        resumed = list(resume_token_ids or [])
        self._check_prompt(token_ids + resumed)
        check_token_ids(params.stop_token_ids, self.spec.vocab_size, "stop_token_ids")
        if kv_prefix_end is not None:
            self._check_prefix_end(kv_prefix_end, len(token_ids), await_kv)
        room = self.context_limit - len(token_ids)
        max_tokens = min(params.max_tokens or room, room)
        if len(resumed) >= max_tokens:
            raise InvalidRequestError(f"{len(resumed)} resumed tokens leave nothing to "
                                      f"generate within max_tokens={max_tokens}",
                                      field="resume_token_ids")
        req = Request(
            request_id=request_id, prompt_token_ids=token_ids, params=params,
            seed=params.seed if params.seed is not None else random.getrandbits(63),
            cache_root=root_hash(self.fingerprint, namespace), max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids, arrival_time=time.monotonic(),
            status=RequestStatus.WAITING_FOR_KV if await_kv else RequestStatus.WAITING,
            hold_kv=hold_kv, resumed_token_ids=resumed,
            tenant=tenant if tenant is not None else namespace, kv_prefix_end=kv_prefix_end)
        req.update_block_hashes(self.block_size)
        self.scheduler.add(req)
        self.detokenizer.add(request_id, params.logprobs is not None)
        return req

    @property
    def context_limit(self) -> int:
        """Prompt + output tokens one request can reach: max_model_len, or less when the
        KV pool is smaller. Workers advertise it as their max_model_len."""
        return min(self.max_model_len, self.num_blocks * self.block_size)

    def _check_prefix_end(self, end: int, num_prompt_tokens: int, await_kv: bool) -> None:
        if not await_kv:
            raise InvalidRequestError("kv_prefix_end is for a request that awaits KV",
                                      field="kv_prefix_end")
        if end <= 0 or end % self.block_size or end > num_prompt_tokens - 1:
            raise InvalidRequestError(
                f"kv_prefix_end={end} must be a positive multiple of the block size "
                f"({self.block_size}) below the prompt's last token ({num_prompt_tokens})",
                field="kv_prefix_end")

    def _check_prompt(self, token_ids: list[int]) -> None:
        check_length(len(token_ids), None, self.context_limit)
        check_token_ids(token_ids, self.spec.vocab_size, "prompt")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Aborts a live request (frees its blocks); a no-op for unknown or finished ids."""
        req = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        if req is None:
            return None
        return self.detokenizer.update(req, None)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    @property
    def decode_only(self) -> bool:
        """The next step would only decode: no prompt token left to compute."""
        return self.scheduler.decode_only

    def request_ids(self) -> list[str]:
        """Every request that holds this engine's resources: live ones, then finished ones
        whose KV is held for export (until `release_kv`)."""
        return [*self.scheduler.requests, *self._held]

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step. If computing it raises, the step's requests end in error (StepFailed
        names them) and the engine stays usable: blocks are cached only after a step
        completes, so nothing the failed step wrote can ever be a prefix hit."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        try:
            result = self.runner.execute(batch, self._layer_hook(batch))
            updated = self.scheduler.update(batch, result)
            outputs = self._outputs(updated, result.sampled, result.num_computed_tokens)
        except Exception as exc:
            raise self._fail_step(batch, exc) from exc
        self.last_step = _step_stats(batch, time.perf_counter() - start)
        self.scheduler.observe_step(batch.num_tokens, self.last_step.seconds)
        return outputs

    def _fail_step(self, batch: ScheduledBatch, exc: Exception) -> StepFailed:
        ids = [seq.request_id for seq in batch.seqs]
        logger.exception("engine step failed; ending its %d requests", len(ids))
        for rid in ids:
            self.scheduler.finish(rid, RequestStatus.FINISHED_ERROR)  # frees its blocks
            self.detokenizer.remove(rid)
            self.release_kv(rid)  # held by an output that finished before the failure
        self.check_invariants()  # AssertionError: the engine is broken, not one request
        return StepFailed(f"{type(exc).__name__}: {exc}", ids)

    def _layer_hook(self, batch: ScheduledBatch) -> Callable[[int], None] | None:
        listener = self.layer_listener
        return None if listener is None else listener(batch)

    def _outputs(self, updated: list[Request], sampled: dict[str, SampledToken], num_computed: int
                 ) -> list[RequestOutput]:
        self.num_computed_tokens_total += num_computed
        outputs = []
        for req in updated:
            out = self.detokenizer.update(req, sampled.get(req.request_id))
            if out.finished and not req.is_finished:  # a stop string matched
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            if req.hold_kv and out.finished:
                self._held[req.request_id] = req
            outputs.append(out)
        if self.config.debug_invariants:
            self.check_invariants()
        return outputs

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def load(self) -> EngineLoad:
        sched, pool = self.scheduler, self.kv.pool
        prefilling = [r for r in sched.running if r.num_computed_tokens < r.num_prefill_tokens]
        return EngineLoad(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_prefilling=len(prefilling),
            num_waiting_tokens=sum(r.num_prefill_tokens - r.num_computed_tokens
                                   for r in (*sched.waiting, *prefilling)),
            num_awaiting_kv=len(sched.awaiting_kv), kv_blocks_used=pool.num_used_blocks,
            kv_blocks_total=pool.num_blocks, max_num_seqs=self.config.scheduler.max_num_seqs)

    # -- KV events: what the router's prefix index is built from --------------------------------
    def enable_kv_events(self) -> None:
        """Records prefix-cache events from now on for one consumer (a worker publishing
        them), which must drain them with `take_kv_events`. Off by default: nobody drains
        an offline engine's events, and they would pile up for as long as it runs."""
        self.kv.pool.enable_events()

    def take_kv_events(self) -> list[KVEvent]:
        """Prefix-cache events (stored / removed blocks) since the last call, oldest first
        (after a backlog overflow: AllBlocksCleared, then every cached block)."""
        return self.kv.pool.take_events()

    def evict_cached_blocks(self, block_hashes: list[BlockHash]) -> int:
        """Drops these blocks from the prefix cache unless a request is using them."""
        return self.kv.pool.evict_cached(block_hashes)

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every block hash in the prefix cache now (a snapshot for an index resync)."""
        return self.kv.pool.cached_hashes()

    # -- tiers below the pool (kv_tiers.py; implemented by splitserve.store) ----------------------
    def attach_tiers(self, tiers: KVTiers) -> TierBridge:
        """From now on evicted cached blocks go down to `tiers` and waiting requests'
        prefixes come up from them."""
        bridge = TierBridge(self.kv, self.kv_cache, self.kv_layout, tiers)
        self.scheduler.promote = bridge.promote
        return bridge

    def purge_tenant(self, tenant: str | None) -> int:
        """Drops the tenant's cached blocks that no request uses and overwrites their KV
        with zeros (blocks in use keep theirs until freed). Returns how many."""
        pool = self.kv.pool
        ids = [b for b in pool.cached_block_ids() if pool.block(b).owner == tenant]
        pool.evict_cached([pool.block(b).block_hash or b"" for b in ids])
        freed = [b for b in ids if pool.block(b).block_hash is None]
        if freed:
            self.kv_cache[:, :, torch.tensor(freed, device=self.device)] = 0
        return len(freed)


def _step_stats(batch: ScheduledBatch, seconds: float) -> StepStats:
    # NOTE: a one-token sequence that samples is a decode; a one-token last prefill chunk
    # counts as a decode too, which is what it costs.
    num_decodes = sum(1 for s in batch.seqs if len(s.token_ids) == 1 and s.sample is not None)
    return StepStats(batch.num_tokens - num_decodes, num_decodes, seconds)

