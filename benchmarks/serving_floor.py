"""The serving tax's floor: the thinnest server of the same shape beside `splitserve serve`.

    python benchmarks/serving_floor.py            # ~1 min on 2 cores; writes docs/benchmarks.md
    python benchmarks/serving_floor.py --quick    # 1 start, 5 rounds, no doc
    python benchmarks/serving_floor.py --prompt-tokens 160   # another step length

"The same shape" is what any split of an HTTP edge from an engine process pays: uvicorn
(h11) in one process, the engine in another pinned to the same cores, one ZeroMQ message
each way over CURVE, SSE to the openai client. The floor server (`--serve`, below) has
nothing else: a raw ASGI function, `json.loads`, one msgpack frame to a worker that runs
`LLMEngine` in a loop. Its TTFT tax over the engine alone is the part of ours that no
cut inside the frontend or the worker can remove on this machine; ours minus it is what
our layers (FastAPI and the middlewares, the request's checks, the dispatcher and the
router, the worker's loop and protocol, the response builder) cost.

Timed like benchmarks/serving.py (the same client, the same engine-alone baseline, setups
interleaved round by round, the idle ones paused), but with a short prompt and 2 output
tokens, so that the step (and its scatter) is small beside the tax: a 16-token prompt's
step still reads every weight, so each request meets caches the step has just emptied,
as a long one does.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
from benchmarks import serving  # noqa: E402
from splitserve.api.serve import UvicornServer  # noqa: E402
from benchmarks.common import (DEFAULT_OUTPUT, CpuMonitor, machine_description,  # noqa: E402
                               markdown_table, median, write_section)

ENGINE, FLOOR, AGG = "engine alone, 2 cores", "floor server", "splitserve serve --mode agg"


# -- the floor server ---------------------------------------------------------------------------
def _worker(address: str, server_public: bytes, public: bytes, secret: bytes) -> None:
    """The engine in a loop: one request at a time, each output's tokens sent at once."""
    import msgpack
    import zmq

    from splitserve.config import EngineConfig, ServeConfig
    from splitserve.engine.engine import LLMEngine
    from splitserve.engine.sampling_params import SamplingParams
    os.sched_setaffinity(0, [0, 1])
    engine = LLMEngine(EngineConfig.from_kwargs(num_threads=2, max_model_len=2048,
                                                max_step_ms=ServeConfig().max_step_ms))
    sock = zmq.Context().socket(zmq.DEALER)
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
        server_public, public, secret)
    sock.connect(address)
    sock.send(b"ready")
    while True:
        rid, ids, max_tokens = msgpack.unpackb(sock.recv())
        engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    ignore_eos=True))
        sent = 0
        while engine.has_unfinished:
            for out in engine.step():
                sock.send(msgpack.packb([rid, out.token_ids[sent:], out.finished]))
                sent = len(out.token_ids)


async def _frontend(port: int) -> None:
    import msgpack
    import uvicorn
    import zmq
    import zmq.asyncio
    server_public, server_secret = zmq.curve_keypair()
    public, secret = zmq.curve_keypair()
    router = zmq.asyncio.Context().socket(zmq.ROUTER)
    router.curve_server, router.curve_publickey, router.curve_secretkey = (
        True, server_public, server_secret)
    router.bind("tcp://127.0.0.1:*")
    worker = multiprocessing.get_context("spawn").Process(
        target=_worker, daemon=True,
        args=(router.getsockopt_string(zmq.LAST_ENDPOINT), server_public, public, secret))
    worker.start()
    identity, _ = await router.recv_multipart()
    streams: dict[str, asyncio.Queue[tuple[list[int], bool]]] = {}

    async def read() -> None:
        while True:
            _, frame = await router.recv_multipart()
            rid, tokens, finished = msgpack.unpackb(frame)
            streams[rid].put_nowait((tokens, finished))

    reader = asyncio.create_task(read())
    num = 0

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal num
        if scope["method"] == "GET":  # /v1/models, for the client's model name
            body = json.dumps({"object": "list", "data": [
                {"id": "floor", "object": "model", "created": 0, "owned_by": "floor"}]})
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body.encode()})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        req = json.loads(b"".join(chunks))
        num += 1
        rid = f"cmpl-{num}"
        queue = streams[rid] = asyncio.Queue()
        await router.send_multipart([identity, msgpack.packb(
            [rid, req["prompt"], req["max_tokens"]])])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        finished = False
        while not finished:
            tokens, finished = await queue.get()
            chunk = {"id": rid, "object": "text_completion", "created": 0, "model": "floor",
                     "choices": [{"index": 0, "text": "x" * len(tokens), "logprobs": None,
                                  "finish_reason": "length" if finished else None}]}
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + json.dumps(chunk).encode() + b"\n\n"})
        del streams[rid]
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    config = uvicorn.Config(app, host="127.0.0.1", port=port, http="h11", loop="asyncio",
                            lifespan="off", log_level="warning")
    server = UvicornServer(config)  # uvicorn's would re-raise SIGTERM before the reaping
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGTERM, lambda: setattr(server, "should_exit", True))
    try:
        await server.serve()
    finally:
        reader.cancel()
        worker.kill()
        worker.join()


class FloorServer:
    """The floor server in a child process; one streaming request per `run`."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
        deadline = time.monotonic() + 600
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the floor server did not start") from None
                time.sleep(0.5)
        self.stream = serving.StreamClient(f"http://127.0.0.1:{port}")

    def run(self, rep: int) -> serving.Timing:
        return self.stream.run(rep)

    def pause(self, paused: bool) -> None:
        serving.pause_tree(self.proc.pid, paused)

    def stop(self) -> None:
        """Stops it through uvicorn's SIGTERM, so the worker is reaped under it and its CPU
        counts as this script's (CpuMonitor), not as another process's."""
        self.pause(False)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            for pid in serving.descendants(self.proc.pid):
                os.kill(pid, 9)
            self.proc.wait()


# -- the comparison -----------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=30, help="rounds per start (30)")
    ap.add_argument("--instances", type=int, default=2, help="fresh starts of every setup")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--output-tokens", type=int, default=2)
    ap.add_argument("--output", default=DEFAULT_OUTPUT)
    args = ap.parse_args()
    # The engine-alone child reads both from the environment, the client from the module.
    serving.PROMPT_TOKENS, serving.OUTPUT_TOKENS = args.prompt_tokens, args.output_tokens
    os.environ["SPLITSERVE_BENCH_PROMPT_TOKENS"] = str(args.prompt_tokens)
    os.environ["SPLITSERVE_BENCH_OUTPUT_TOKENS"] = str(args.output_tokens)
    if args.serve:
        asyncio.run(_frontend(args.serve))
        return 0
    rounds, instances = (5, 1) if args.quick else (args.rounds, args.instances)
    runs: dict[str, list[serving.Timing]] = {}
    monitor = CpuMonitor().start()
    for instance in range(instances):
        setups: dict[str, serving.Setup] = {
            ENGINE: serving.OfflineEngine(2, [0, 1]), FLOOR: FloorServer(),
            AGG: serving.Served(["--mode", "agg", "--max-model-len", "2048"])}
        serving.run_rounds(setups, instance, rounds, runs)
    others = monitor.stop()
    base = runs[ENGINE]
    rows = [[ENGINE, f"{median([t.ttft_s for t in base]) * 1e3:.1f}", "-", "-"]]
    for name in (FLOOR, AGG):
        pairs = list(zip(runs[name], base))
        at_event = [(a.first_event_s - b.ttft_s) * 1e3 for a, b in pairs
                    if a.first_event_s is not None]
        rows.append([name, f"{median([t.ttft_s for t in runs[name]]) * 1e3:.1f}",
                     f"{median([(a.ttft_s - b.ttft_s) * 1e3 for a, b in pairs]):+.2f}",
                     f"{median(at_event):+.2f}"])
    floor = [a.ttft_s - b.ttft_s for a, b in zip(runs[FLOOR], base)]
    ours = [a.ttft_s - b.ttft_s for a, b in zip(runs[AGG], base)]
    text = "\n".join([
        f"One streaming request at a time: {serving.PROMPT_TOKENS}-token prompt (random ids), "
        f"{serving.OUTPUT_TOKENS} output tokens, greedy, bf16; {instances} fresh start(s) of "
        f"every setup x {rounds} interleaved rounds, the idle setups paused; TTFT as in "
        "\"Serving overhead\" (from the openai client handing the request to its transport "
        "to the parsed first chunk); taxes are medians of the per-round differences from "
        "the engine alone. The floor server: uvicorn (h11) + a raw ASGI function + one "
        "ZeroMQ/CURVE message each way + the same engine in a process pinned to the same "
        "2 cores (benchmarks/serving_floor.py).", "",
        markdown_table(["setup", "TTFT ms", "TTFT tax ms", "tax at the first event ms"], rows),
        "", f"Ours above the floor: {median([a - b for a, b in zip(ours, floor)]) * 1e3:+.2f} "
        f"ms (median of the rounds' differences). Other processes used {others:.2f} cores "
        "on average during the run."])
    print(text)
    if not args.quick:
        title = "Serving tax floor" + ("" if args.prompt_tokens == 16 else
                                       f", {args.prompt_tokens}-token prompts")
        write_section(args.output, title, text, machine=machine_description())
    return 0


if __name__ == "__main__":
    sys.exit(main())
