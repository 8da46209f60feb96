"""The HTTP side of the bench: server discovery (`/v1/models`, `/metrics`) and one
streaming request per BenchRequest through the official `openai` client, timed chunk by
chunk into a RequestRecord."""
from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from splitserve.bench.errors import BenchSetupError
from splitserve.bench.record import RequestRecord
from splitserve.bench.request import BenchRequest
from splitserve.bench.tokens import token_text


@dataclass(frozen=True)
class ServerInfo:
    """What `/v1/models` says: the model to use and its context (None when not listed)."""
    base_url: str
    model: str
    served_models: list[str]
    max_model_len: int | None


@dataclass(frozen=True)
class RequestOptions:
    """Per-request settings shared by every request of a run."""
    model: str
    endpoint: str  # "completions" | "chat"
    temperature: float
    timeout_s: float


def normalize_base_url(url: str) -> str:
    """`http://host:port` without a trailing `/` or `/v1`."""
    url = url.rstrip("/")
    return url.removesuffix("/v1") if url.endswith("/v1") else url


def _get(url: str, timeout_s: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return bytes(response.read())


def fetch_server_info(base_url: str, model: str | None, timeout_s: float = 10.0) -> ServerInfo:
    """Reads `/v1/models`; the model is `model` (which must be served) or the first listed."""
    base = normalize_base_url(base_url)
    try:
        body = json.loads(_get(base + "/v1/models", timeout_s))
        entries = [m for m in body["data"] if isinstance(m, dict) and "id" in m]
    except (urllib.error.URLError, OSError) as exc:
        raise BenchSetupError(f"cannot reach {base}/v1/models ({exc}); is the server running "
                              "and is --base-url right?") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise BenchSetupError(f"{base}/v1/models did not answer an OpenAI model list "
                              f"({exc!r}); is --base-url an OpenAI-compatible server?") from exc
    names = [str(m["id"]) for m in entries]
    if not names:
        raise BenchSetupError(f"{base}/v1/models lists no model")
    chosen = model if model is not None else names[0]
    if chosen not in names:
        raise BenchSetupError(f"model {chosen!r} is not served by {base}; it serves "
                              f"{', '.join(names)} (pass one with --model)")
    limit = next((m.get("max_model_len") for m in entries if m["id"] == chosen), None)
    return ServerInfo(base, chosen, names, int(limit) if isinstance(limit, int) else None)


def fetch_metrics_text(base_url: str, timeout_s: float = 10.0) -> str | None:
    """The server's Prometheus text, or None when it has no `/metrics`."""
    try:
        return _get(normalize_base_url(base_url) + "/metrics", timeout_s).decode(
            "utf-8", errors="replace")
    except (urllib.error.URLError, OSError):
        return None


# Idle pooled connections are dropped after this long, before any common server's idle
# timeout (uvicorn and so vLLM: 5 s): reusing a connection the server is closing at that
# moment fails the request, and without retries that would count as a server failure.
CLIENT_KEEPALIVE_S = 2.0


def make_client(base_url: str, timeout_s: float) -> Any:
    """An AsyncOpenAI client without retries (a retried request would hide a failure)."""
    import httpx2
    import openai

    limits = httpx2.Limits(max_connections=1000, max_keepalive_connections=100,
                           keepalive_expiry=CLIENT_KEEPALIVE_S)
    return openai.AsyncOpenAI(base_url=normalize_base_url(base_url) + "/v1",
                              api_key=os.environ.get("OPENAI_API_KEY", "none"),
                              max_retries=0, timeout=timeout_s,
                              http_client=openai.DefaultAsyncHttpxClient(limits=limits))


async def send_request(client: Any, options: RequestOptions, request: BenchRequest,
                       record: RequestRecord, clock: Callable[[], float]) -> None:
    """Streams one request (`ignore_eos`, `max_tokens` = the intended output length, usage
    asked for) and fills `record`: send time, each output chunk's arrival, end, usage,
    status and error. Never raises for a failed request; the failure is in the record."""
    import openai

    common: dict[str, Any] = dict(
        model=options.model, max_tokens=request.output_len, temperature=options.temperature,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    record.send_s = clock()
    try:
        async with asyncio.timeout(options.timeout_s):
            if options.endpoint == "chat":
                content = token_text(request.prompt_token_ids)
                stream = await client.chat.completions.create(
                    messages=[{"role": "user", "content": content}], **common)
            else:
                stream = await client.completions.create(prompt=request.prompt_token_ids,
                                                         **common)
            record.status = 200
            async with stream:  # closes the response however the loop ends
                async for chunk in stream:
                    now = clock()
                    if chunk.choices and _chunk_text(chunk.choices[0], options.endpoint):
                        record.chunk_s.append(now)
                    if chunk.usage is not None:
                        _take_usage(record, chunk.usage)
    except TimeoutError:
        record.error = f"no complete answer within {options.timeout_s:g} s"
    except openai.APIStatusError as exc:
        record.status, record.error = exc.status_code, exc.message
    except Exception as exc:  # connection loss, error event mid-stream: the request failed
        record.error = f"{type(exc).__name__}: {exc}"
    record.end_s = clock()
    if record.error is None and not record.chunk_s:
        record.error = "the stream ended without output"
    if record.output_tokens is None:
        record.output_tokens = len(record.chunk_s)


def _chunk_text(choice: Any, endpoint: str) -> str:
    """The output text a chunk carries (chat's role-only head chunk carries none)."""
    if endpoint == "chat":
        return str(getattr(choice.delta, "content", None) or "")
    return str(getattr(choice, "text", None) or "")


def _take_usage(record: RequestRecord, usage: Any) -> None:
    record.output_tokens = int(usage.completion_tokens)
    record.usage_reported = True
    record.prompt_tokens = int(usage.prompt_tokens)
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None)
    record.cached_tokens = int(cached) if cached is not None else None
