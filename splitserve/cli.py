"""`splitserve chat | ...`: command-line entry points."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from splitserve.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.errors import SplitserveError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16) | float32")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                        num_threads=args.threads, cache=CacheConfig(block_size=args.block_size),
                        scheduler=SchedulerConfig(max_model_len=args.max_model_len))


def chat(args: argparse.Namespace) -> int:
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
    args = parser.parse_args(argv)
    try:
        return chat(args)
    except (SplitserveError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
