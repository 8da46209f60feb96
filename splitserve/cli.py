"""`splitserve serve | chat`: command-line entry points."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, TypeVar

import yaml

from splitserve.bench.command import add_bench_args, bench_command
from splitserve.config import (CacheConfig, DeadlineConfig, EngineConfig, HttpConfig,
                               KVStoreConfig, RayConfig, SchedulerConfig, ServeConfig)
from splitserve.engine.sampling_params import SamplingParams
from splitserve.errors import SplitserveError

# Keys from the environment (as vLLM's VLLM_API_KEY): a flag would show in `ps`.
API_KEY_ENV = "SPLITSERVE_API_KEY"
ADMIN_KEY_ENV = "SPLITSERVE_ADMIN_KEY"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16) | float32")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="exact kernels (default: on for bf16 on CPU)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                        num_threads=args.threads, batch_invariant=args.batch_invariant,
                        cache=CacheConfig(block_size=args.block_size),
                        scheduler=SchedulerConfig(max_model_len=args.max_model_len))


def chat(args: argparse.Namespace) -> int:
    from splitserve.engine.engine import LLMEngine  # torch: only the commands that run it

    engine = LLMEngine(engine_config(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    messages: list[dict[str, Any]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    turns = [args.prompt] if args.prompt is not None else None
    interactive = turns is None
    if interactive:
        print("splitserve chat: type a message, empty line or Ctrl-D to quit.", file=sys.stderr)
    for turn in range(1 << 30):
        if interactive:
            try:
                user = input("you> ").strip()
            except EOFError:
                break
            if not user:
                break
        elif turn >= len(turns):  # type: ignore[arg-type]
            break
        else:
            user = turns[turn]  # type: ignore[index]
        messages.append({"role": "user", "content": user})
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
        engine.add_request(f"chat-{turn}", prompt, params)
        if interactive:
            print("assistant> ", end="", flush=True)
        reply = ""
        while engine.has_unfinished:
            for out in engine.step():
                print(out.delta_text, end="", flush=True)
                reply = out.text
        print()
        messages.append({"role": "assistant", "content": reply})
    return 0


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every ServeConfig key as a flag (default None: the YAML file's value, else the
    dataclass default)."""
    p.add_argument("--config", default=None, help="YAML file with the same keys as the flags")
    p.add_argument("--model", help="HF checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", help="the model name clients send")
    p.add_argument("--mode", choices=["auto", "disagg", "agg"],
                   help="auto (default): the layout predicted to serve the most on this "
                   "machine's cores, from engine costs measured once and cached; disagg: "
                   "prefill and decode pools; agg: colocated workers")
    p.add_argument("--prefill", type=int, help="prefill workers (disagg; default 1; with "
                   "auto, giving a count means disagg)")
    p.add_argument("--decode", type=int, help="decode workers (agg: workers; default 1)")
    p.add_argument("--workload-hint", help="PROMPT:OUTPUT mean tokens --mode auto lays the "
                   "machine out for (default 512:128); PROMPT:OUTPUT:CV adds the prompt "
                   "length's spread (std / mean), e.g. 839:24:0.9")
    p.add_argument("--profile-cache", help="JSON file of --mode auto's measured cost curves "
                   "(default $SPLITSERVE_PROFILE_CACHE, else "
                   "~/.cache/splitserve/layout_profiles.json)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--worker-cores", help="cores per worker, prefill workers first: '0;1' or "
                   "'0,1;2,3' (default: split this machine's cores between the pools)")
    p.add_argument("--threads-per-worker", type=int, help="torch threads per worker")
    p.add_argument("--worker-nice", type=int, help="local workers' niceness above the "
                   "frontend's, 0-19 (default 5: the frontend preempts their compute threads)")
    p.add_argument("--prefill-borrows-cores", action=argparse.BooleanOptionalAction,
                   default=None, help="disagg: each prefill worker also computes, at the lowest "
                   "priority, on its share of the decode workers' cores while they are idle "
                   "(a helper thread each; the decode worker takes its core back through a "
                   "lease when it has work). Default: on")
    p.add_argument("--pace-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="with --slo-tpot-ms and a borrowing prefill worker: the decode worker "
                   "steps at most every 0.8 x the TPOT target while the prefill has prompts, "
                   "lending it its core in between. Default: on")
    p.add_argument("--kv-transport", choices=["tcp", "shm"],
                   help="how KV moves between workers: TCP (default) or shared memory (shm; "
                   "one host, not with --runtime ray)")
    p.add_argument("--kv-stream-layers", choices=["auto", "on", "off"],
                   help="disagg: a prefill's KV leaves layer by layer during its step (on) "
                   "or every layer right after it, once its first token is sent (off); "
                   "auto (default): layer by layer when more prompts are queued or the "
                   "compute leaves cores free, else after the step")
    p.add_argument("--disagg-policy", choices=["auto", "always", "never"],
                   help="auto: the router decides per request (conditional disaggregation)")
    p.add_argument("--max-queue-len", type=int, help="admission queue bound (then 429)")
    p.add_argument("--planner", choices=["off", "advisory", "on"],
                   help="size the pools from the SLOs every interval: advisory reports, on "
                   "also adds, drains and switches workers (default off)")
    p.add_argument("--planner-interval-s", type=float, help="planner interval (10)")
    p.add_argument("--planner-max-workers", type=int,
                   help="the planner's budget of workers (default: one per core)")
    p.add_argument("--planner-model-load-s", type=float,
                   help="seconds from starting a worker to it serving (default: measured "
                   "on this cluster's starts, 30 before the first)")
    p.add_argument("--admission", choices=["queue", "reject"],
                   help="queue: a request without room waits (default); reject: one whose "
                   "predicted TTFT passes --slo-ttft-ms gets 429 at once (early rejection)")
    p.add_argument("--tenant-max-cached-blocks", type=int, help="per-tenant cache cap")
    p.add_argument("--slo-ttft-ms", type=float, help="TTFT target (SLO attainment metric)")
    p.add_argument("--slo-tpot-ms", type=float,
                   help="TPOT target (local prefills must respect it; SLO metric)")
    p.add_argument("--dtype", help="auto (bfloat16) | float32")
    p.add_argument("--quantization", help="none | int8 (weight-only, exact kernels: CPU bf16)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="exact kernels: outputs independent of batching (default: on for "
                   "bf16 on CPU); --no-batch-invariant runs oneDNN's faster, batch-dependent "
                   "kernels (AMX machines: faster prefill)")
    p.add_argument("--block-size", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-num-partial-prefills", type=int,
                   help="prompts a step may leave unfinished (2): short prompts share the "
                   "step with a long one instead of waiting for it; 1 = first come first served")
    p.add_argument("--max-step-ms", type=float,
                   help="a step's wall time at most (1000): each worker fits its token budget "
                   "to this at its measured speed, so decodes beside a prompt chunk and prompts "
                   "behind it never wait longer on a slow CPU; 0 = the token budget alone")
    p.add_argument("--kv-cache-memory-bytes", type=int)
    p.add_argument("--kv-failure-policy", choices=["recompute", "retry", "fail"],
                   help="a failed KV transfer: the decode worker recomputes (default), the "
                   "frontend retries with a new transfer, or the request fails")
    p.add_argument("--max-retries", type=int,
                   help="retries in a row, before the request decodes again, when a worker or "
                        "transfer fails (2)")
    p.add_argument("--restart-workers", action=argparse.BooleanOptionalAction, default=None,
                   help="start a worker process again when it exits (default: yes)")
    p.add_argument("--enable-fault-injection", action="store_const", const=True,
                   help="accept POST /admin/faults (tests, chaos, soak); off by default")
    p.add_argument("--request-timeout-s", type=float, help="per-request deadline")
    p.add_argument("--queue-timeout-s", type=float, help="longest wait for admission (30)")
    p.add_argument("--prefill-timeout-s", type=float,
                   help="dispatch -> first token, else the attempt is retried (120)")
    p.add_argument("--kv-timeout-s", type=float, help="decode worker's wait for KV (60)")
    p.add_argument("--decode-step-timeout-s", type=float,
                   help="longest gap between two tokens, else the attempt is retried (60)")
    p.add_argument("--heartbeat-timeout-s", type=float,
                   help="a worker silent this long is removed, its requests resumed (30)")
    p.add_argument("--drain-timeout-s", type=float,
                   help="on SIGTERM/Ctrl-C, how long in-flight requests may finish (30)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    add_http_args(p)
    add_ray_args(p)
    add_store_args(p)


def add_ray_args(p: argparse.ArgumentParser) -> None:
    """Where workers run: child processes (default) or Ray actors (RayConfig)."""
    g = p.add_argument_group("runtime: where workers run (docs/operations.md)")
    g.add_argument("--runtime", choices=["local", "ray"],
                   help="local: child processes of this one (default); ray: Ray actors")
    g.add_argument("--ray-address", help="Ray cluster to join: 'auto' or HOST:PORT (default: "
                   "$RAY_ADDRESS, else start a local Ray)")
    g.add_argument("--cluster-name", help="Ray namespace of this cluster's workers; a frontend "
                   "started with the name of one that died re-adopts its workers (default)")
    g.add_argument("--ray-cpus-per-worker", type=float, help="Ray CPUs per worker (1)")
    g.add_argument("--ray-gpus-per-worker", type=float, help="Ray GPUs per worker (0)")
    g.add_argument("--ray-role-resources", action="store_const", const=True,
                   help="each worker also needs 1 of the custom resource named by its role "
                   "(prefill|decode|both): nodes started with it host that pool")
    g.add_argument("--ray-placement", choices=["none", "pack", "spread"],
                   help="none: by resources (default); pack: one placement group on as few "
                   "nodes as possible; spread: one per pool, across nodes")
    g.add_argument("--restart-backoff-s", type=float,
                   help="first wait before a dead worker is restarted; doubles up to 30 s (1)")


def add_store_args(p: argparse.ArgumentParser) -> None:
    """The KV store's tiers below each worker's pool (KVStoreConfig; README "KV store")."""
    g = p.add_argument_group("KV store: tiers below each worker's pool (all off by default)")
    g.add_argument("--kv-host-bytes", type=parse_bytes, help="host memory tier per worker, "
                   "e.g. 2GiB (0: off)")
    g.add_argument("--kv-disk-dir", help="disk tier: worker files under <dir>/<role>-<index>")
    g.add_argument("--kv-disk-bytes", type=parse_bytes, help="disk tier per worker (8GiB)")
    g.add_argument("--kv-disk-admission", choices=["reused", "all"],
                   help="reused: only blocks hit at least once go to disk (default)")
    g.add_argument("--kv-tenant-quota-bytes", type=parse_bytes,
                   help="each tenant's bytes in each tier of each worker (no quota)")
    g.add_argument("--kv-disk-key-file", help="32-byte key (raw or hex) for the disk tier's "
                   "encryption; default: a fresh key per start (disk blocks of an earlier "
                   "frontend are unreadable)")
    g.add_argument("--kv-peer-fetch", action=argparse.BooleanOptionalAction,
                   help="a worker may import a prompt prefix another worker holds (pool, "
                   "host or disk tier) over the KV transfer layer when the router predicts "
                   "it faster than recomputing (default on)")


def parse_bytes(text: str) -> int:
    """'4096', '512MiB', '2GiB', '1.5GB' -> bytes."""
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10**6, "mb": 10**6,
             "mib": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12,
             "tb": 10**12, "tib": 1 << 40}
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number):].lower()
    try:
        if unit not in units:
            raise ValueError(unit)
        return int(float(number) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4096, 512MiB, 2GiB)")


def add_http_args(p: argparse.ArgumentParser) -> None:
    """The HTTP edge's flags (HttpConfig): keys, what responses tell, client deadlines."""
    g = p.add_argument_group("HTTP edge: keys, limits, deadlines")
    g.add_argument("--api-key", help=f"/v1/* needs 'Authorization: Bearer <key>' (as vLLM); "
                   f"its tenant is 'default'. Prefer ${API_KEY_ENV} or --api-key-file: a "
                   "command line is visible to every local user")
    g.add_argument("--api-key-file", help='JSON file {"<key>": "<tenant>", ...}: each '
                   "client's tenant and cache namespace come from its key")
    g.add_argument("--admin-key", help=f"/admin/* needs 'Authorization: Bearer <key>' "
                   f"(or set ${ADMIN_KEY_ENV}); without one /admin/* is off (403)")
    g.add_argument("--enable-prompt-tokens-details", action="store_const", const=True,
                   help="report usage.prompt_tokens_details.cached_tokens (vLLM's flag)")
    g.add_argument("--limit-concurrency", type=int,
                   help="open connections or requests in progress beyond which a request "
                   "gets 503 (uvicorn's; default 1024; 0: no limit)")
    g.add_argument("--timeout-keep-alive", type=int,
                   help="seconds an idle keep-alive connection stays open (30)")
    g.add_argument("--header-timeout-s", type=float,
                   help="a request's head must arrive within this, else 408 and close (20)")
    g.add_argument("--body-timeout-s", type=float,
                   help="a request's body must arrive within this, else 408 and close (60)")
    g.add_argument("--h11-max-incomplete-event-size", type=int,
                   help="largest request head in bytes (16384; vLLM's flag), else 400")


def serve_config(args: argparse.Namespace) -> ServeConfig:
    values: dict[str, Any] = {}
    if args.config:
        with open(args.config, encoding="utf-8") as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{args.config} must hold a mapping of serve options")
        values = {str(k).replace("-", "_"): v for k, v in loaded.items()}
    for key, env in (("api_key", API_KEY_ENV), ("admin_key", ADMIN_KEY_ENV)):
        if os.environ.get(env):
            values[key] = os.environ[env]
    for key, value in vars(args).items():
        if key not in ("config", "command") and value is not None:
            values[key] = value
    if isinstance(values.get("worker_cores"), str):
        values["worker_cores"] = [[int(c) for c in part.split(",")]
                                  for part in values["worker_cores"].split(";")]
    if values.get("quantization") == "none":
        values["quantization"] = None
    if values.get("limit_concurrency") == 0:
        values["limit_concurrency"] = None
    deadlines = _group(values, "deadlines", DeadlineConfig)
    http = _group(values, "http", HttpConfig)
    ray = _group(values, "ray", RayConfig)
    store = _group(values, "store", KVStoreConfig)
    known = ServeConfig.__dataclass_fields__.keys() - {"deadlines", "http", "ray", "store"}
    unknown = values.keys() - known
    if unknown:
        raise ValueError(f"unknown serve options {sorted(unknown)}; known: {sorted(known)}")
    return ServeConfig(**values, deadlines=deadlines, http=http, ray=ray, store=store)


Group = TypeVar("Group", DeadlineConfig, HttpConfig, RayConfig, KVStoreConfig)


def _group(values: dict[str, Any], name: str, cls: type[Group]) -> Group:
    """ServeConfig's nested config `name`: its keys popped from `values`, given as a
    `name:` mapping (YAML) or flat (flags, YAML); flat keys win."""
    nested = values.pop(name, None) or {}
    keys = cls.__dataclass_fields__.keys()
    if not isinstance(nested, dict):
        raise ValueError(f"{name} must be a mapping of {sorted(keys)}")
    given = {str(k).replace("-", "_"): v for k, v in nested.items()}
    given.update({k: values.pop(k) for k in list(values) if k in keys})
    unknown = given.keys() - keys
    if unknown:
        raise ValueError(f"unknown {name} options {sorted(unknown)}; known: {sorted(keys)}")
    return cls(**given)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_chat = sub.add_parser("chat", help="chat with the model in the terminal (or one-shot)")
    add_engine_args(p_chat)
    p_chat.add_argument("--prompt", default=None, help="one-shot: answer this and exit")
    p_chat.add_argument("--system", default=None, help="system prompt")
    p_chat.add_argument("--max-tokens", type=int, default=256)
    p_chat.add_argument("--temperature", type=float, default=0.0)
    p_chat.add_argument("--top-p", type=float, default=1.0)
    p_chat.add_argument("--seed", type=int, default=None)
    p_serve = sub.add_parser("serve", help="serve the OpenAI API with prefill/decode pools")
    add_serve_args(p_serve)
    p_bench = sub.add_parser("bench", help="load-test an OpenAI-compatible server (SLO goodput)")
    add_bench_args(p_bench)
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            from splitserve.api.serve import run
            return run(serve_config(args))
        if args.command == "bench":
            return bench_command(args)
        return chat(args)
    except (SplitserveError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
