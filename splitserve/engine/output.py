"""Request outputs and the detokenizer that turns sampled tokens into text and text stops."""
from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.engine.batch import SampledToken
from splitserve.engine.request import FINISH_REASONS, Request
from splitserve.model.tokenizer import Tokenizer


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after a step. `text`/`token_ids` are cumulative;
    `delta_text`/`delta_token_ids` are what is new since the previous output."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledToken] | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class _TextState:
    text: str = ""  # decoded output, cut at a stop string once one matched
    committed: str = ""  # the decode of output tokens [0, read_offset)
    # Tokens [prefix_offset, read_offset) are decoded again as the context of the ones after.
    prefix_offset: int = 0
    read_offset: int = 0
    num_tokens_sent: int = 0
    num_chars_sent: int = 0
    logprobs: list[SampledToken] | None = None


class Detokenizer:
    """Incremental text for each live request; finds stop strings.

    Text streamed to a client never contains an incomplete UTF-8 character (held back while
    the decode ends in U+FFFD) nor a prefix of a stop string that may still complete.

    Each step decodes only the new tokens and the few before them (their context: a
    tokenizer may spell a token differently at the start of a text), and appends what the
    new ones add; decoding the whole output every step cost O(length) per token. The
    text is the whole output's decode wherever that is valid UTF-8 (a byte-fallback
    decoder spells a whole invalid byte run as U+FFFD, bytes already streamed included;
    the text keeps what was streamed). tests/engine/test_detokenizer.py checks both.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _TextState] = {}
        # (token id, skip_special_tokens) -> its text decoded alone: the context of the
        # next step's decode when the last one committed one token, as it mostly does
        # (one tokenizer call a step fewer: ~20 us of the cold Python between decode
        # steps). At most two entries a vocabulary entry.
        self._alone: dict[tuple[int, bool], str] = {}

    def add(self, request_id: str, want_logprobs: bool) -> None:
        self._states[request_id] = _TextState(logprobs=[] if want_logprobs else None)

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def update(self, req: Request, sampled: SampledToken | None) -> RequestOutput:
        """Decodes req's output; sets req.stop_reason and returns a stop match via `stop_hit`."""
        st = self._states[req.request_id]
        if sampled is not None and st.logprobs is not None:
            st.logprobs.append(sampled)
        params = req.params
        text = self._decode(st, req.output_token_ids, params.skip_special_tokens)
        stop_hit = None
        if params.stop:
            stop_hit = _find_stop(text, params.stop, len(st.text))
            if stop_hit is not None:
                idx, stop = stop_hit
                text = text[:idx + len(stop)] if params.include_stop_str_in_output else text[:idx]
                req.stop_reason = stop
        st.text = text
        finished = req.is_finished or stop_hit is not None
        sendable = max(stable_text_len(text, params.stop, finished), st.num_chars_sent)
        out = RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), text=text, finished=finished,
            finish_reason=FINISH_REASONS.get(req.status) if req.is_finished else
            ("stop" if stop_hit else None),
            stop_reason=req.stop_reason,
            delta_text=text[st.num_chars_sent:sendable],
            delta_token_ids=req.output_token_ids[st.num_tokens_sent:],
            logprobs=st.logprobs, num_cached_tokens=req.num_cached_tokens)
        st.num_chars_sent, st.num_tokens_sent = sendable, req.num_output_tokens
        if finished:
            self.remove(req.request_id)
        return out

    def _decode(self, st: _TextState, ids: list[int], skip_special: bool) -> str:
        """The whole output's text: the committed part, then what tokens [read_offset, end)
        add to it, decoded after their context [prefix_offset, read_offset). That addition
        is committed (the offsets move past it) unless it ends inside a UTF-8 character
        (in U+FFFD) or is empty (skipped special tokens stay context)."""
        if st.read_offset == len(ids):
            return st.committed
        decode = self.tokenizer.decode
        if st.read_offset - st.prefix_offset == 1:
            key = (ids[st.prefix_offset], skip_special)
            context = self._alone.get(key)
            if context is None:
                context = self._alone[key] = decode(key[:1], skip_special_tokens=skip_special)
        else:
            context = decode(ids[st.prefix_offset:st.read_offset],
                             skip_special_tokens=skip_special)
        added = decode(ids[st.prefix_offset:], skip_special_tokens=skip_special)[len(context):]
        if not added or added.endswith("\ufffd"):
            return st.committed + added
        st.committed += added
        st.prefix_offset, st.read_offset = st.read_offset, len(ids)
        return st.committed


def stable_text_len(text: str, stops: list[str], finished: bool) -> int:
    """How much of an output's text can be streamed: all of it once finished; before that,
    not a trailing incomplete UTF-8 character nor what may still become a stop string."""
    if finished:
        return len(text)
    n = len(text.rstrip("\ufffd"))
    if stops:
        n = min(n, max(0, len(text) - max(map(len, stops)) + 1))
    return n


def _find_stop(text: str, stops: list[str], old_len: int) -> tuple[int, str] | None:
    """Earliest stop string that ends in the new part of text."""
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, old_len - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
