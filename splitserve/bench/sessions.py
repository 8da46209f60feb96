"""The sessions workload: multi-turn conversations whose prompts grow by whole turns, so
turn k+1's prompt starts with exactly turn k's prompt (what a prefix cache can reuse).

    turn 0:  [system][user 0]
    turn 1:  [system][user 0][reply 0][user 1]
    turn 2:  [system][user 0][reply 0][user 1][reply 1][user 2]

The system prompt is shared by every session. The replies are stand-in tokens of the
turn's output length (the server's real reply tokens are not known to the client).
"""
from __future__ import annotations

import math

import numpy as np

from splitserve.bench.config import BenchConfig
from splitserve.bench.lengths import sample_lengths, scale_length
from splitserve.bench.request import BenchRequest
from splitserve.bench.tokens import TokenSynth


def build_sessions(config: BenchConfig, synth: TokenSynth, rng: np.random.Generator,
                   max_model_len: int | None) -> tuple[list[BenchRequest], int, int, int]:
    """`config.num_requests` turns in ceil(num_requests / turns) sessions, ordered turn by
    turn (turn 0 of every session, then turn 1, ...), each turn `after` its predecessor.

    Returns (requests, num_sessions, num_dropped, num_clamped): a turn whose prompt plus
    output would pass `max_model_len` ends its session (its remaining turns are dropped);
    a first turn that does not fit has its prompt cut instead (clamped).
    """
    n, turns, scale = config.num_requests, config.turns, config.length_scale
    num_sessions = math.ceil(n / turns)
    user_lens = [scale_length(x, scale) for x in sample_lengths(config.input_len, n, rng)]
    out_lens = [scale_length(x, scale) for x in sample_lengths(config.output_len, n, rng)]
    system = synth.system(scale_length(config.system_len, scale)) if config.system_len else []
    limit = max_model_len
    turns_of: list[list[BenchRequest]] = []
    num_dropped = num_clamped = 0
    for session in range(num_sessions):
        history, made = list(system), []
        for turn in range(turns):
            k = session * turns + turn
            if k >= n:
                break
            prompt = history + synth.request(2 * k, user_lens[k])
            out = out_lens[k] if limit is None else min(out_lens[k], limit - 1)
            is_clamped = out != out_lens[k]
            if limit is not None and len(prompt) + out > limit:
                if turn > 0:
                    num_dropped += min(turns, n - session * turns) - turn
                    break
                prompt, is_clamped = prompt[:limit - out], True
            num_clamped += is_clamped
            made.append(BenchRequest(prompt, out, session_id=session))
            history = prompt + synth.request(2 * k + 1, out)  # the reply's stand-in
        turns_of.append(made)
    requests: list[BenchRequest] = []
    index_of: dict[tuple[int, int], int] = {}  # (session, turn) -> position in `requests`
    for turn in range(turns):
        for session, made in enumerate(turns_of):
            if turn < len(made):
                if turn > 0:
                    made[turn].after = index_of[session, turn - 1]
                index_of[session, turn] = len(requests)
                requests.append(made[turn])
    return requests, num_sessions, num_dropped, num_clamped
