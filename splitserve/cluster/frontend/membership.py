"""What the router learns from workers' messages: who joined (WorkerReady) and how
loaded each one is (LoadReport, with the step timings its cost models fit)."""
from __future__ import annotations

from splitserve.cluster.protocol import LoadReport, WorkerReady
from splitserve.cluster.router.router import KVLayout, Role, Router, WorkerLoad

_ROLES = {"prefill": Role.PREFILL, "decode": Role.DECODE, "both": Role.BOTH}


def router_add_worker(router: Router, msg: WorkerReady) -> None:
    """Registers (or re-registers) a worker with the router, idle. The workers know the
    model's KV layout (block size; bytes per token from layers, heads, dtype): the router's
    block counts and transfer-time estimate use it."""
    router.set_kv_layout(KVLayout(msg.block_size, msg.kv_bytes_per_token))
    router.add_worker(msg.worker_id, _ROLES[msg.role],
                      WorkerLoad(0, 0, 0, 0, msg.num_blocks, msg.max_num_seqs))


def router_observe_load(router: Router, worker_id: str, max_num_seqs: int,
                        msg: LoadReport) -> None:
    """A load report: the worker's queue and memory, and its pure prefill or pure decode
    steps as samples for the cost models (mixed steps fit neither)."""
    router.update_load(worker_id, WorkerLoad(
        msg.num_running, msg.num_waiting + msg.num_awaiting_kv, msg.num_waiting_tokens,
        msg.kv_blocks_used, msg.kv_blocks_total, max_num_seqs))
    for step in msg.steps:
        if step.num_prefill_tokens and not step.num_decode_seqs:
            router.observe_prefill(worker_id, step.num_prefill_tokens, step.seconds)
        elif step.num_decode_seqs and not step.num_prefill_tokens:
            router.observe_decode_step(worker_id, step.num_decode_seqs, step.seconds)
