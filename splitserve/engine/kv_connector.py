"""The engine's KV connector: everything a KV transfer may ask of an engine, and nothing
more. `LLMEngine` implements it; `splitserve.transfer` (sender, receiver, packing) holds
an engine only as a `KVConnector`, so no transfer reaches into the scheduler, the block
pool or the KV tensor, and a test can stand a fake in for the engine.

As in vLLM v1, the connector has two roles, here seen from the engine's side:

    scheduler side: requests and blocks (engine thread, between steps)
      request_state(id)           a live request: status, prompt range, block hashes
      kv_import_target(id)        reserve blocks for a WAITING_FOR_KV prompt -> KVRange
      commit_kv(id, first_token)  the imported KV is complete: decode from the next token
                                  (a prefix import: prefill the rest here)
      fail_kv(id, recompute)      the import failed: free the blocks; prefill here or drop
      export_kv(id)               the prompt blocks of a finished hold_kv request -> KVRange
      release_kv(id)              free them (idempotent)
      abort(id)                   end a live request (a transfer was cancelled under it)
    worker side: KV tensors (engine thread, also inside the forward pass)
      kv_layout                   what a layer of blocks looks like, and whose KV it is
      read_kv_layer(layer, ids)   a private copy of one layer of some blocks
      write_kv_layer(layer, ids, kv)
      layer_listener(batch)       asked before each step; what it returns is called
                                  after each layer of that step wrote its KV (a sender
                                  streams layer i while layer i+1 computes), None: the
                                  step runs its layers in one call

Import (decode side):  add_request(await_kv) -> kv_import_target -> write_kv_layer per
layer -> commit_kv, or fail_kv. Export (prefill side): add_request(hold_kv) -> the
prefill step (layer_listener + read_kv_layer), or export_kv + read_kv_layer once it
finished -> release_kv.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from splitserve.engine.batch import ScheduledBatch
from splitserve.engine.output import RequestOutput
from splitserve.engine.request import RequestStatus
from splitserve.kv_cache import BlockHash

# Asked before each step with its batch (the block tables say where each sequence's KV
# is): returns what to call with each layer's index once that layer wrote its KV, or None
# when nothing in this step needs its KV between layers. A step with a callback runs its
# layers one call each (the exact path's C++ stack otherwise runs them in one), so a
# listener returns None whenever it can.
LayerListener = Callable[[ScheduledBatch], Callable[[int], None] | None]


class KVRange(NamedTuple):
    """A request's KV blocks covering tokens [start_token, end_token)."""
    block_ids: list[int]
    block_hashes: list[BlockHash]  # hashes of the full blocks in block_ids
    start_token: int
    end_token: int


class KVRequestState(NamedTuple):
    """A live request as a connector sees it (a copy: the engine owns the request)."""
    status: RequestStatus
    hold_kv: bool  # its blocks outlive it, for export_kv
    cache_root: BlockHash  # root of its block hashes: model fingerprint + namespace
    num_prefill_tokens: int  # prompt + resumed tokens: the range a transfer carries
    num_computed_tokens: int
    block_hashes: tuple[BlockHash, ...]  # of the full blocks of the prefill range


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape and identity of an engine's KV: two engines can exchange KV only when
    their fingerprints (model, weights, kernels, dtype, block size) are equal."""
    fingerprint: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def layer_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """[2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]: one layer's blocks."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


class KVConnectorScheduler(Protocol):
    """Requests and their blocks. Engine thread, between steps."""

    @property
    def num_computing_requests(self) -> int:
        """Requests that will compute here (waiting or running): neither those awaiting KV
        (they compute nothing until it lands) nor finished ones whose KV is held."""

    def request_state(self, request_id: str) -> KVRequestState | None:
        """The request while it is live (waiting, importing, running); None once it
        finished (held or not) or if unknown."""

    def kv_import_target(self, request_id: str) -> KVRange | None:
        """Blocks reserved for a WAITING_FOR_KV request's prompt and the token range to
        fill (a local prefix hit is not transferred again); None while the pool has no
        room. KVImportError if the request is not waiting for KV."""

    def commit_kv(self, request_id: str, first_token_id: int) -> RequestOutput | None:
        """The imported prompt KV is complete and verified: the request runs from its
        first output token on (its output). After a prefix import (`kv_prefix_end`) it
        prefills the rest of its prompt here instead: None. KVImportError if it has no
        reserved blocks."""

    def fail_kv(self, request_id: str, recompute: bool) -> None:
        """The import failed: its reserved blocks are freed, then the request is
        prefilled locally (`recompute`) or dropped. A no-op unless it waits for KV."""

    def export_kv(self, request_id: str) -> KVRange:
        """The prefill KV (prompt + resumed tokens) of a finished request added with
        hold_kv=True and not yet released. KVImportError otherwise."""

    def release_kv(self, request_id: str) -> None:
        """Frees a finished request's held blocks; idempotent."""

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a live request, freeing its blocks; None for unknown or finished ids."""


class KVConnectorWorker(Protocol):
    """The KV tensor. Engine thread; `layer_listener` runs inside the forward pass."""
    kv_layout: KVLayout
    layer_listener: LayerListener | None

    def read_kv_layer(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        """A copy of one layer's blocks in host memory (whatever the engine's device),
        `kv_layout.layer_shape(len(block_ids))`."""

    def write_kv_layer(self, layer: int, block_ids: list[int], kv: torch.Tensor) -> None:
        """Overwrites one layer of blocks reserved by `kv_import_target` (cast to the
        cache's dtype)."""


class KVConnector(KVConnectorScheduler, KVConnectorWorker, Protocol):
    """Both roles: what a KV sender or receiver holds an engine as."""
