"""KV handoff between two engines, for benchmarks/transfer.py: what layer-wise streaming adds
before the decode worker's first step (2K-token prompt, prefill on A, decode on B in
another process), and whether int8 KV on the wire changes greedy output.

Streaming (default model, bf16): engine A (this process, 2 threads,
max_num_batched_tokens 2048: one prefill step) streams over TCP to engine B (another
process, 1 thread, `benchmarks/transfer.py --serve decode`). "ready" = B committed the KV and
can run its first decode step; compared with A's prefill alone (no transfer, separate
repetitions), and with sending the held KV after the prefill instead of streaming it. The
plan round trip (B reserving blocks) happens before the prompt "arrives": in the system it
precedes the prefill.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from collections.abc import Sequence

from benchmarks.common import ServeChild, median
from splitserve.transfer.layer_codec import Compression
from splitserve.transfer.transport import get_transport

TRANSFER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transfer.py")
TTFT_PROMPT = 2048
KV_POOL_BYTES = 256 << 20  # per engine: ~11K tokens of the default model in bf16
DEADLINE_S = 120.0


# -- layer-wise streaming: a 2K-token prompt, prefill on A, decode on B ---------------------
def serve_decode(address_out: list[str]) -> None:
    """Engine B: for each stdin line {"rid", "prompt"}, await the KV, print the plan, then
    print when the KV was committed and the first decode step ran."""
    from splitserve.config import EngineConfig
    from splitserve.engine.engine import LLMEngine
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.transfer.receiver import KVReceiver
    engine = LLMEngine(EngineConfig.from_kwargs(None, dtype="bfloat16", num_threads=1,
                                                kv_cache_memory_bytes=KV_POOL_BYTES))
    receiver = KVReceiver(engine, get_transport("tcp").listen())
    address_out.append(receiver.address)
    for line in sys.stdin:
        cmd = json.loads(line)
        engine.add_request(cmd["rid"], cmd["prompt"], SamplingParams(
            temperature=0, max_tokens=2, ignore_eos=True), await_kv=True)
        plan = receiver.expect(cmd["rid"], timeout_s=DEADLINE_S)
        assert plan is not None
        print(json.dumps({**dataclasses.asdict(plan), "key": plan.key.hex()}), flush=True)
        handle = None
        while handle is None:
            receiver.wait(0.05)  # sleeps while A computes: B must not steal A's cores
            done = receiver.poll()
            handle = done[0] if done else None
        t_commit = time.monotonic()
        result = {"state": handle.poll().state.name, "t_commit": t_commit,
                  "telemetry": handle.telemetry.as_record()}
        if engine.has_unfinished:
            engine.step()  # the first decode step
        result["t_first_step_end"] = time.monotonic()
        while engine.has_unfinished:
            engine.step()
        print(json.dumps(result), flush=True)
    os._exit(0)


def run_ttft(reps: int) -> tuple[list[list[object]], dict[str, float]]:
    from splitserve.config import EngineConfig
    from splitserve.engine.engine import LLMEngine
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.transfer.handle import TransferPlan
    from splitserve.transfer.sender import KVSender, LayerStreaming
    engine = LLMEngine(EngineConfig.from_kwargs(None, dtype="bfloat16", num_threads=2,
                                                max_num_batched_tokens=TTFT_PROMPT,
                                                kv_cache_memory_bytes=KV_POOL_BYTES))
    sender = KVSender(engine, stream_layers=LayerStreaming.ON)  # A computes nothing else
    child = ServeChild(TRANSFER_SCRIPT, "decode")
    rng = random.Random(7)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    results: dict[str, list[float]] = {
        k: [] for k in ("alone", "streamed", "held", "streamed_prefill", "held_prefill",
                        "streamed_exposed", "held_exposed")}
    try:
        for rep in range(reps + 1):  # the first round warms up
            prompt = [rng.randrange(100, engine.spec.vocab_size) for _ in range(TTFT_PROMPT)]
            t0 = time.monotonic()
            engine.add_request(f"alone-{rep}", prompt, first)
            while engine.has_unfinished:
                engine.step()
            results["alone"].append(time.monotonic() - t0)
            for mode in ("streamed", "held"):
                rid = f"{mode}-{rep}"
                prompt = [rng.randrange(100, engine.spec.vocab_size) for _ in range(TTFT_PROMPT)]
                child.send(json.dumps({"rid": rid, "prompt": prompt}))
                fields = json.loads(child.readline(DEADLINE_S))
                plan = TransferPlan(**{**fields, "key": bytes.fromhex(fields["key"])})
                t_arrival = time.monotonic()
                engine.add_request(rid, prompt, first, hold_kv=True)
                handle = sender.start(rid, plan) if mode == "streamed" else None
                t_prefill = None
                while t_prefill is None:
                    outs = engine.step()
                    for out in outs:
                        if out.request_id == rid and out.token_ids:
                            t_prefill = time.monotonic()
                            if handle is None:
                                handle = sender.send_held(rid, plan, out.token_ids[0])
                    sender.poll(outs)
                assert handle is not None
                while not handle.poll().is_terminal:
                    sender.poll()
                    time.sleep(0.0005)
                sender.poll()  # releases A's held blocks
                result = json.loads(child.readline(DEADLINE_S))
                assert result["state"] == "DONE", result
                results[mode].append(result["t_commit"] - t_arrival)
                results[f"{mode}_prefill"].append(t_prefill - t_arrival)
                results[f"{mode}_exposed"].append(result["t_commit"] - t_prefill)
    finally:
        child.close()
        sender.close()
    results = {k: v[1:] for k, v in results.items()}
    alone = median(results["alone"])
    rows: list[list[object]] = []
    for mode, label in (("streamed", "layer-wise streaming"),
                        ("held", "send held KV after the prefill")):
        ready, exposed = median(results[mode]), median(results[f"{mode}_exposed"])
        rows.append([label, f"{alone * 1e3:.0f}", f"{median(results[f'{mode}_prefill']) * 1e3:.0f}",
                     f"{exposed * 1e3:.1f} (**{exposed / alone:+.1%}**)",
                     f"{ready * 1e3:.0f} ({(ready - alone) / alone:+.1%})",
                     spread(results["alone"]) + " / " + spread(results[mode])])
    summary = {"alone_s": alone, "streamed_s": median(results["streamed"]),
               "held_s": median(results["held"])}
    return rows, summary


def spread(values: Sequence[float]) -> str:
    return f"{min(values) * 1e3:.0f}-{max(values) * 1e3:.0f}"


# -- int8 on the wire: does decoding still agree? --------------------------------------------
AGREEMENT_PROMPTS = [
    "Explain why the sky is blue in three sentences.",
    "Write a short poem about a lighthouse keeper.",
    "List five uses of a paperclip and explain each briefly.",
    "What is the difference between a list and a tuple in Python?",
]


def run_agreement(new_tokens: int) -> list[list[object]]:
    """Greedy continuation on B after a handoff with exact and int8 KV, vs A alone."""
    from splitserve import LLM, SamplingParams
    from splitserve.transfer.receiver import KVReceiver
    from splitserve.transfer.sender import KVSender
    a = LLM(dtype="bfloat16", kv_cache_memory_bytes=KV_POOL_BYTES)
    b = LLM(dtype="bfloat16", kv_cache_memory_bytes=KV_POOL_BYTES)
    sender = KVSender(a.engine)
    receiver = KVReceiver(b.engine, get_transport("inproc").listen())
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    rows = []
    try:
        for compression in (Compression.NONE, Compression.INT8):
            same_prefix, same_tokens, total = [], 0, 0
            for i, text in enumerate(AGREEMENT_PROMPTS):
                prompt = a.tokenizer.encode(a.tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True),
                    add_special_tokens=False)
                expected = a.generate(prompt, params)[0].token_ids
                rid = f"{compression.value}-{i}"
                b.engine.add_request(rid, prompt, params, await_kv=True)
                plan = receiver.expect(rid)
                assert plan is not None
                a.engine.add_request(rid, prompt, dataclasses.replace(params, max_tokens=1),
                                     hold_kv=True)
                send = sender.start(rid, plan, compression=compression)
                handles: list = []
                while not handles:
                    sender.poll(a.engine.step() if a.engine.has_unfinished else [])
                    handles = receiver.poll()
                    time.sleep(0.0005)
                while not send.poll().is_terminal:
                    sender.poll()
                    time.sleep(0.0005)
                sender.poll()
                got = list(handles[0].output.token_ids) if handles[0].output else []
                while b.engine.has_unfinished:
                    for out in b.engine.step():
                        got = list(out.token_ids)
                prefix = next((k for k, (x, y) in enumerate(zip(got, expected)) if x != y),
                              len(expected))
                same_prefix.append(prefix)
                same_tokens += sum(x == y for x, y in zip(got, expected))
                total += len(expected)
            rows.append([compression.value, len(AGREEMENT_PROMPTS), new_tokens,
                         f"{same_tokens / total:.0%}",
                         " / ".join(str(p) for p in same_prefix)])
    finally:
        sender.close()
        receiver.close()
    return rows


HANDOFF_NOTES = """\
- **int8 on the wire** halves the bytes (plus 0.4% of scales) but is slower on loopback:
  quantizing and dequantizing on 2 cores (~1-2 GB/s) costs more than the bytes it saves at
  ~3 GB/s. It pays on links slower than ~1 GB/s (1-10 GbE between hosts), not on one host.
  Greedy continuations mostly agree (table above); it stays off by default.
- **Layer-wise streaming.** Expected what B waits for after A's prefill ends to be the last
  layer's send plus placement and commit (a few ms), against the whole payload (~47 MB,
  tens of ms) when the held KV is sent afterwards: that same-run figure is the transfer's
  exposed cost. "Arrival to B ready" compares medians of different repetitions with the
  prefill alone, so it also carries the prefill's own spread (min-max column) and the CPU
  the transfer takes from A's prefill on the shared 2 cores (copies, hashes, kernel copies:
  ~50 ms of CPU for 47 MB), which separate hosts would not pay.
  **2026-12-06 (session 54), the Zen 4 of that day, same code path** (`run_ttft` above at
  512 and 2048 tokens, 6 rounds each, not kept as a table): prefill alone 318 / 1,723 ms;
  streamed, **A's prefill 367 / 1,798 ms** and B ready 0.6 / 2.3 ms after it (368 / 1,801
  from arrival); held, A's prefill 316 / 1,725 and B ready **16.6 / 48.0 ms** after it
  (**332 / 1,773**). Sending after the step won both the first token and B's start at both
  sizes: the transfer's CPU, small by itself (the 30 layer copies 1.6 ms and their tags
  1.3 ms at 512 tokens, hot), costs the step ~3-4x as much when its threads preempt the
  step's two compute threads (whose team then waits at each barrier). A shorter switch
  interval (0.5 ms) changed little (+41 ms vs +51: not the GIL); in one process without
  a transfer, the per-layer calls cost 4.5 ms and the layer copies 6 ms of the 51.
  Hence `--kv-stream-layers auto` (the default since): layer by layer only when the
  engine has other live requests (their steps would share the cores with the transfer
  anyway) or the compute leaves cores free. The streamed row of `run_ttft` now asks for
  `LayerStreaming.ON` (A has nothing else to compute, so auto would send after the step);
  rerun with it at 512 tokens (4 rounds): streamed prefill 378 ms, B ready 383; held
  prefill 331, B ready 19.3 ms after it (350).
- **2026-12-06 10:1x (session 55), the same Zen 4 VM class, block copies.** The engine's
  `read_kv_layer` now gathers with `index_select` and `write_kv_layer` (CPU) scatters with
  numpy's fancy assignment, whole 6 KiB blocks at a time, where torch's advanced indexing
  copied 128-byte rows (one thread, the 30 layers of 1,536 tokens, 36 MB: reads 6.9 -> 2.4
  ms contiguous, 11.7 -> 5.6 scattered; writes 6.7 -> 2.1 and 9.8 -> 5.2). Expected here:
  the held row's wait after A's prefill down by ~10 ms at 2,048 tokens (A copies with two
  threads, B places with one). Measured: **43.7 and 29.3 ms** in two runs minutes apart
  (46.5 on 11-24, 48.0 in session 54's scratch run): within this table's spread, since
  here the copies overlap the wire. In
  `splitserve serve` (disagg, a core a worker), where they do not: the sender's `pack`
  25.6 -> 15.0 ms and the receiver's `place` 11.0 -> 3.9 ms a 1,536-token transfer, the
  client's token 1 -> 2 gap **51 -> 33 ms** (alternated A/B, 6 prompts each, TCP); over
  shm (`--kv-transport shm`) 31-35 ms against 40-44 over TCP in an
  alternated pair of runs. The int8 agreement table reads 73% (22 / 2 / 32 / 32): the
  same with the copies of before (rerun at e11f870's `engine_kv.py`); 11-24's 99% predates
  the kernel changes since. Greedy continuations after lossy KV diverge where two tokens
  are close; int8 on the wire stays opt-in.
"""
