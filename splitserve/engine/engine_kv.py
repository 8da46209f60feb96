"""LLMEngine's side of the KV connector (kv_connector.py): what a KV transfer may ask of
the engine. Exports hold a finished request's blocks (`_held`) until `release_kv`; imports
fill the blocks a WAITING_FOR_KV request reserved, then commit or fail it; live migration
(`detach`) and peer fetch (`hold_prefix`) hold KV the same way an export does."""
from __future__ import annotations

import time

import torch

from splitserve.engine.batch import SampledToken
from splitserve.engine.kv_connector import KVConnector, KVRange, KVRequestState
from splitserve.engine.output import Detokenizer, RequestOutput
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import Scheduler
from splitserve.errors import InvalidRequestError, KVImportError
from splitserve.kv_cache import KVCacheManager, root_hash


class EngineKV(KVConnector):
    """Mixed into LLMEngine, whose constructor sets what is declared here."""
    scheduler: Scheduler
    kv: KVCacheManager
    kv_cache: torch.Tensor  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    device: torch.device
    block_size: int
    fingerprint: str
    eos_token_ids: frozenset[int]
    detokenizer: Detokenizer
    _held: dict[str, Request]  # finished requests whose KV is kept for export

    def _check_prompt(self, token_ids: list[int]) -> None:
        raise NotImplementedError  # LLMEngine's: length and token ids against the model

    def _outputs(self, updated: list[Request], sampled: dict[str, SampledToken],
                 num_computed: int) -> list[RequestOutput]:
        raise NotImplementedError  # LLMEngine's: detokenized outputs of a step

    @property
    def num_computing_requests(self) -> int:
        return len(self.scheduler.requests) - len(self.scheduler.awaiting_kv)

    def request_state(self, request_id: str) -> KVRequestState | None:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        n = req.num_prefill_tokens
        return KVRequestState(req.status, req.hold_kv, req.cache_root, n,
                              req.num_computed_tokens,
                              tuple(req.block_hashes[:n // self.block_size]))

    def detach(self, request_id: str) -> int:
        """Ends a decoding request here and holds its KV for export (live migration): the
        KV of every token it computed, exactly what a prefill of its prompt and output so
        far would hold. Returns its last sampled token, whose KV is not computed yet: the
        receiver's first token, as after a prefill. KVImportError when the request is not
        decoding (waiting, mid-prefill, awaiting KV, or unknown)."""
        req = self.scheduler.requests.get(request_id)
        if (req is None or req.status is not RequestStatus.RUNNING or not req.output_token_ids
                or req.num_computed_tokens != req.num_tokens - 1):
            raise KVImportError(f"request {request_id!r} is not decoding here; only a "
                                "decoding request can move with its KV")
        req.hold_kv = True
        self.scheduler.finish(request_id, RequestStatus.FINISHED_STOPPED)  # keeps its KV
        self.detokenizer.remove(request_id)
        self._held[request_id] = req
        return req.all_token_ids[-1]

    def hold_prefix(self, request_id: str, token_ids: list[int], *,
                    namespace: str | None = None, tenant: str | None = None) -> int:
        """Peer fetch, the holder's side: holds the longest prefix of `token_ids` that this
        engine has cached (in the pool, or brought up from its tiers), in whole blocks,
        for `export_kv` and `release_kv`, as a finished hold_kv request would. Nothing is
        computed and nothing waits for a step or a free sequence slot. Returns how many
        tokens it holds (0: none, and nothing is held)."""
        if request_id in self.scheduler.requests or request_id in self._held:
            raise InvalidRequestError(f"request id {request_id!r} is already in use",
                                      field="request_id")
        self._check_prompt(token_ids)
        req = Request(
            request_id=request_id, prompt_token_ids=list(token_ids),
            params=SamplingParams(max_tokens=1), seed=0,
            cache_root=root_hash(self.fingerprint, namespace), max_tokens=1,
            eos_token_ids=self.eos_token_ids, arrival_time=time.monotonic(),
            status=RequestStatus.FINISHED_STOPPED, hold_kv=True,
            tenant=tenant if tenant is not None else namespace)
        req.update_block_hashes(self.block_size)
        every_block = len(token_ids) + 1  # nothing is computed: the last block may hit too
        if self.scheduler.promote is not None:
            self.scheduler.promote(req.block_hashes, every_block, req.tenant)
        hit = self.kv.computed_prefix(req.block_hashes, every_block)
        if not hit or self.kv.allocate(request_id, len(hit) * self.block_size, hit) is None:
            return 0
        req.num_computed_tokens = len(hit) * self.block_size
        self._held[request_id] = req
        return req.num_computed_tokens

    def export_kv(self, request_id: str) -> KVRange:
        req = self._held.get(request_id)
        if req is None:
            raise KVImportError(f"request {request_id!r} holds no exportable KV")
        n = req.num_computed_tokens  # the prefill, and for a detached request its output
        return KVRange(self.kv.block_table(request_id)[:_blocks(n, self.block_size)],
                       req.block_hashes[:n // self.block_size], 0, n)

    def release_kv(self, request_id: str) -> None:
        if self._held.pop(request_id, None) is not None:
            self.kv.free(request_id)

    def kv_import_target(self, request_id: str) -> KVRange | None:
        req = self.scheduler.awaiting_kv.get(request_id)
        if req is None:
            raise KVImportError(f"request {request_id!r} is not waiting for KV")
        table = self.kv.block_table(request_id)
        if not table:
            self.scheduler.reserve_import_blocks()
            table = self.kv.block_table(request_id)
            if not table:
                return None
        first, end = req.num_computed_tokens // self.block_size, req.kv_import_end
        return KVRange(table[first:], req.block_hashes[first:end // self.block_size],
                       req.num_computed_tokens, end)

    def read_kv_layer(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        # [2, len(block_ids), block_size, num_kv_heads, head_dim], in host memory.
        # index_select copies whole blocks: ~3x faster than advanced indexing on one CPU
        # thread (which copies the cache's last dimension, 128 bytes, at a time).
        ids = torch.tensor(block_ids, device=self.device)
        return self.kv_cache[layer].index_select(1, ids).cpu()

    def write_kv_layer(self, layer: int, block_ids: list[int], kv: torch.Tensor) -> None:
        kv = kv.to(self.kv_cache.device, self.kv_cache.dtype)
        if self.device.type != "cpu":
            self.kv_cache[layer][:, torch.tensor(block_ids, device=self.device)] = kv
            return
        # On CPU, numpy's fancy assignment copies a whole block (6 KiB for the default
        # model) per index, on this thread: ~3x faster than torch's index_put/index_copy_,
        # whose CPU kernels copy the last dimension at a time (docs/transfer.md).
        rows = (2, len(block_ids), -1)
        cache = self.kv_cache[layer].view(torch.uint8).reshape(
            2, self.kv_cache.shape[2], -1).numpy()
        cache[:, block_ids] = kv.contiguous().view(torch.uint8).reshape(rows).numpy()

    def commit_kv(self, request_id: str, first_token_id: int) -> RequestOutput | None:
        req = self.scheduler.awaiting_kv.get(request_id)
        if req is None or not self.kv.block_table(request_id):
            raise KVImportError(f"request {request_id!r} has no reserved KV blocks to commit")
        if req.kv_prefix_end is not None:  # the sender's token follows the prefix: unused
            self.scheduler.commit_imported(req, None)
            return None
        self.scheduler.commit_imported(req, first_token_id)
        return self._outputs([req], {}, 0)[0]

    def fail_kv(self, request_id: str, recompute: bool) -> None:
        req = self.scheduler.fail_import(request_id, recompute)
        if req is not None and req.is_finished:
            self.detokenizer.remove(request_id)


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
