"""A request's output stream as the frontend counts it: where the next Output starts
(token, character and logprob positions) and what text it may carry."""
from __future__ import annotations

from splitserve.cluster import protocol as P
from splitserve.engine.output import RequestOutput, stable_text_len


class OutputStream:
    __slots__ = ("num_chars", "num_engine_chars", "first_token_only", "stops")

    def __init__(self, first_token_only: bool = False, stops: list[str] | None = None) -> None:
        self.num_chars = 0  # text sent to the frontend
        self.num_engine_chars = 0  # text the engine released (its delta_text, summed)
        self.first_token_only = first_token_only  # a prefill for another worker
        self.stops = stops or []

    def count(self, out: RequestOutput) -> None:
        """Every engine output passes here, sent or not."""
        self.num_engine_chars += len(out.delta_text)

    def hands_off(self, out: RequestOutput) -> bool:
        """A prefill for another worker that reached its one-token limit: the request goes
        on elsewhere (a stop at token 1 ends it here)."""
        return self.first_token_only and out.finish_reason == "length"

    def next_output(self, out: RequestOutput) -> P.Output:
        """The Output message for `out`, continuing where the last one ended."""
        finished, reason = out.finished, out.finish_reason
        text = out.text[self.num_chars:self.num_engine_chars]
        if self.hands_off(out):
            # Our max_tokens ended it, not the request's: the decode worker goes on, so
            # send only the text that is stable whatever token comes next.
            finished, reason = False, None
            text = out.text[self.num_chars:stable_text_len(out.text, self.stops, False)]
        num_new = len(out.delta_token_ids)
        token_offset = len(out.token_ids) - num_new
        logprobs, lp_offset = None, token_offset
        if out.logprobs is not None:
            # The engine's logprobs cover the tokens it sampled, the last ones of its output:
            # resumed and imported tokens come before them (an import that failed and was
            # recomputed here imported none).
            base = len(out.token_ids) - len(out.logprobs)
            lp_offset = max(token_offset, base)
            logprobs = out.logprobs[lp_offset - base:]
        msg = P.Output(out.request_id, token_offset, list(out.delta_token_ids), self.num_chars,
                       text, lp_offset, logprobs, finished, reason, out.stop_reason,
                       len(out.prompt_token_ids), out.num_cached_tokens)
        self.num_chars += len(text)
        return msg
