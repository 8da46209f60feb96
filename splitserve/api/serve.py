"""`splitserve serve`: the frontend process. Starts the cluster (workers as processes),
then serves the OpenAI-compatible API until Ctrl-C / SIGTERM, then stops every worker."""
from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import logging
import logging.config
import os
import time
from collections.abc import AsyncIterator, Iterator

import uvicorn

from splitserve.api.auth import Access
from splitserve.api.backend import ModelInfo
from splitserve.api.http_protocol import uvicorn_config
from splitserve.api.request_id import log_config
from splitserve.api.server import build_app
from splitserve.cluster.frontend.dispatcher import Dispatcher
from splitserve.cluster.heap import freeze_startup_heap, pause_collector
from splitserve.cluster.launcher import Cluster
from splitserve.cluster.protocol import Role
from splitserve.cluster.frontend.stream import GenerateRequest, StreamDelta
from splitserve.config import ServeConfig
from splitserve.model.loader import open_checkpoint

logger = logging.getLogger("splitserve.serve")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ClusterBackend:
    """The HTTP layer's Backend, served by the dispatcher."""

    def __init__(self, cluster: Cluster, model_info: ModelInfo) -> None:
        assert cluster.dispatcher is not None, "a started cluster"
        self.cluster, self.dispatcher = cluster, cluster.dispatcher
        self.model_info = model_info

    def generate(self, request: GenerateRequest) -> AsyncIterator[StreamDelta]:
        return self.dispatcher.generate(request)

    def is_ready(self) -> bool:
        return self.dispatcher.is_ready()

    def health(self) -> dict[str, object]:
        index = self.dispatcher.router.index
        return {**self.dispatcher.health(),
                "index": {"blocks": index.num_blocks, "tenants": index.num_tenants,
                          "pending_claims": index.num_pending_claims,
                          "by_worker": {w: index.num_worker_blocks(w)
                                        for w in index.worker_ids()},
                          "tiers": self.dispatcher.router.tier_blocks(),
                          "routed_tier_blocks": self.dispatcher.router.stats().num_tier_blocks,
                          "routed_peer_fetches":
                              self.dispatcher.router.stats().num_peer_fetches},
                "planner": self.cluster.last_decision,
                "layout": self.cluster.layout.to_dict() if self.cluster.layout else None}

    def metrics_text(self) -> bytes:
        return self.dispatcher.metrics_text()

    async def add_worker(self, role: str) -> str:
        return self.cluster.add_worker(Role(role))

    async def drain_worker(self, worker_id: str, timeout_s: float) -> dict[str, object]:
        return await self.cluster.drain_worker(worker_id, timeout_s)

    async def switch_role(self, worker_id: str, role: str, timeout_s: float) -> dict[str, object]:
        return await self.cluster.switch_role(worker_id, Role(role), timeout_s)

    def inject_fault(self, worker_id: str, spec: dict[str, object]) -> dict[str, object]:
        return self.dispatcher.admin.inject_fault(worker_id, spec).to_dict()

    async def check_pools(self) -> dict[str, dict[str, object]]:
        return await self.dispatcher.admin.check_pools()

    async def purge_tenant(self, tenant: str) -> dict[str, object]:
        return await self.dispatcher.admin.purge_tenant(tenant)

    def tenant_cache(self, tenant: str) -> dict[str, object]:
        return self.dispatcher.metrics.tiers.tenant_usage(tenant)


class UvicornServer(uvicorn.Server):
    """uvicorn, minus its signal handling: uvicorn re-raises SIGTERM/SIGINT after its own
    shutdown, which would kill this process before it stops the workers. `serve` installs
    handlers that ask the server to exit and then stops the cluster itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def model_info(config: ServeConfig, max_model_len: int) -> ModelInfo:
    """Served names as vLLM has them: `--served-model-name`, else the `--model` argument as
    given; the checkpoint's base name (without .gguf) is accepted too."""
    ckpt = open_checkpoint(config.model)
    base = os.path.basename(ckpt.path.rstrip("/")).removesuffix(".gguf")
    if config.model is None:
        base = DEFAULT_MODEL_NAME
    names = [n for n in (config.served_model_name, config.model, base) if n]
    names = list(dict.fromkeys(names))
    return ModelInfo(served_model_names=names, tokenizer=ckpt.tokenizer,
                     max_model_len=max_model_len, vocab_size=ckpt.spec.vocab_size,
                     created=int(time.time()))


async def serve(config: ServeConfig) -> None:
    import setproctitle
    setproctitle.setproctitle("splitserve-frontend")
    pause_collector()  # until the startup heap is frozen, below
    Access.from_config(config.http)  # a bad key file fails before any worker starts
    cluster = Cluster(config)
    dispatcher = await cluster.start()
    try:
        info = model_info(config, dispatcher.max_model_len)
        app = build_app(ClusterBackend(cluster, info), config.http)
        server = UvicornServer(uvicorn_config(
            app, config.http, host=config.host, port=config.port,
            log_config=log_config(config.log_level.upper()),
            timeout_graceful_shutdown=math.ceil(config.drain_timeout_s)))
        freeze_startup_heap("frontend")
        logger.info("serving %s on http://%s:%d (%s, %d workers on the %s runtime%s)",
                    info.served_model_names[0], config.host, config.port, cluster.config.mode,
                    len(cluster.handles), config.runtime,
                    f", adopted {cluster.adopted}" if cluster.adopted else "")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
        await server.serve()
    finally:
        await cluster.stop()
        logger.info("stopped")


def run(config: ServeConfig) -> int:
    logging.config.dictConfig(log_config(config.log_level.upper()))
    asyncio.run(serve(config))
    return 0
