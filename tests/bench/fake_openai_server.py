"""A scripted OpenAI-compatible server for the bench's client tests: streams `max_tokens`
one-character chunks `chunk_delay_s` apart, and fails, breaks or hangs on demand. It
records when each request arrived and finished, and the peak number in flight."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

MODEL = "fake-model"


@dataclass
class Received:
    body: dict[str, Any]
    arrived: float  # time.monotonic()
    finished: float | None = None


@dataclass
class FakeOpenAI:
    chunk_delay_s: float = 0.0
    send_usage: bool = True
    fail_status: int | None = None  # every request (or every `fail_every`-th) gets this status
    fail_every: int = 1
    error_after_chunks: int | None = None  # an error event after this many chunks
    hang: bool = False
    metrics_text: str | None = None
    max_model_len: int = 4096
    received: list[Received] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            factory = f.default_factory  # MISSING (not callable) where a plain default is
            setattr(self, f.name, factory() if callable(factory) else f.default)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [
                {"id": MODEL, "object": "model", "max_model_len": self.max_model_len},
                {"id": "other-model", "object": "model"}]}

        @app.get("/metrics")
        async def metrics() -> Response:
            if self.metrics_text is None:
                return PlainTextResponse("not found", status_code=404)
            return PlainTextResponse(self.metrics_text)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._answer(await request.json(), chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._answer(await request.json(), chat=True)

        return app

    async def _answer(self, body: dict[str, Any], chat: bool) -> Response:
        rec = Received(body, time.monotonic())
        self.received.append(rec)
        if self.fail_status is not None and len(self.received) % self.fail_every == 0:
            rec.finished = time.monotonic()
            return JSONResponse({"error": {"message": "scripted failure", "type": "x",
                                           "param": None, "code": None}},
                                status_code=self.fail_status)
        return StreamingResponse(self._events(body, chat, rec), media_type="text/event-stream")

    async def _events(self, body: dict[str, Any], chat: bool,
                      rec: Received) -> AsyncIterator[str]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            n = int(body["max_tokens"])
            if chat:
                yield _sse({"object": "chat.completion.chunk", "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i in range(n):
                if self.hang:
                    await asyncio.Event().wait()
                if self.error_after_chunks is not None and i == self.error_after_chunks:
                    yield _sse({"error": {"message": "boom mid-stream", "type": "x"}})
                    break
                await asyncio.sleep(self.chunk_delay_s)
                finish = "length" if i == n - 1 else None
                choice: dict[str, Any] = (
                    {"index": 0, "delta": {"content": "a"}, "finish_reason": finish} if chat
                    else {"index": 0, "text": "a", "finish_reason": finish})
                yield _sse({"id": "x", "object": "chunk", "created": 0, "model": MODEL,
                            "choices": [choice]})
            else:
                if self.send_usage:
                    prompt = body.get("prompt") or []
                    yield _sse({"id": "x", "object": "chunk", "created": 0, "model": MODEL,
                                "choices": [], "usage": {
                                    "prompt_tokens": len(prompt), "completion_tokens": n,
                                    "total_tokens": len(prompt) + n,
                                    "prompt_tokens_details": {"cached_tokens": 3}}})
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1
            rec.finished = time.monotonic()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
