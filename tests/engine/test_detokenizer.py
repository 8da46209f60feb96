"""The incremental detokenizer: at every step its text is the decode of the whole output,
whatever the tokenizer does at the start of a text or inside a UTF-8 character, and each
step decodes a window that does not grow with the output."""
from __future__ import annotations

from typing import Any

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, normalizers

from splitserve.engine.output import Detokenizer
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.model.tokenizer import Tokenizer


_SETTINGS = settings(max_examples=150, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


def _request(params: SamplingParams) -> Request:
    return Request("r", [1, 2, 3], params, seed=0, cache_root=b"", max_tokens=1 << 20,
                   eos_token_ids=frozenset(), arrival_time=0.0)


def _run(tok: Tokenizer, ids: list[int], params: SamplingParams) -> list[Any]:
    """Feeds `ids` one token a step; the outputs of every step."""
    detok, req = Detokenizer(tok), _request(params)
    detok.add(req.request_id, want_logprobs=False)
    outs = []
    for token in ids:
        req.output_token_ids.append(token)
        outs.append(detok.update(req, None))
        if outs[-1].finished:
            break
    return outs


def _llama2_style_tokenizer() -> Tokenizer:
    """A SentencePiece-like tokenizer (Metaspace spaces, byte fallback, the first leading
    space stripped on decode): its text depends on where decoding starts."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["\u2581", "a", "b", "\u2581a", "\u2581b", "ab", "\u2581ab", "ba"]:
        vocab[piece] = len(vocab)
    merges = [("\u2581", "a"), ("\u2581", "b"), ("a", "b"), ("\u2581a", "b"), ("b", "a")]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True,
                                              unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([tokenizers.AddedToken("</s>", special=True),
                                tokenizers.AddedToken("<s>", special=True)])
    return Tokenizer(backend, "<s>", "</s>", None)


@pytest.fixture(scope="module")
def llama2_tokenizer() -> Tokenizer:
    return _llama2_style_tokenizer()


def _texts() -> st.SearchStrategy[str]:
    # ASCII, accents, CJK, emoji (4-byte UTF-8): tokens that end inside a character.
    return st.text(st.sampled_from("ab c\u00e9\u4e2d\u6587\U0001F600\n"), max_size=40)


def _check_every_step(tok: Tokenizer, ids: list[int], skip_special: bool,
                      valid_only: bool = False) -> None:
    """The text equals the whole decode at every step (`valid_only`: at every step whose
    decode is valid UTF-8; a byte-fallback decoder re-spells a whole byte run as U+FFFD
    while it is invalid, earlier bytes included, so no streamed text can follow it there)."""
    outs = _run(tok, ids, SamplingParams(skip_special_tokens=skip_special))
    for n, out in enumerate(outs, 1):
        whole = tok.decode(ids[:n], skip_special_tokens=skip_special)
        if not (valid_only and "\ufffd" in whole):
            assert out.text == whole, ids[:n]
    if outs:  # what was streamed, then only the held-back end of a split character
        sent = "".join(o.delta_text for o in outs)
        assert outs[-1].text.startswith(sent) and set(outs[-1].text[len(sent):]) <= {"\ufffd"}


@_SETTINGS
@given(ids=st.lists(st.integers(0, 49151), max_size=30), skip_special=st.booleans())
def test_random_ids_default_tokenizer(default_tokenizer: Tokenizer, ids: list[int],
                                      skip_special: bool) -> None:
    _check_every_step(default_tokenizer, ids, skip_special)


@_SETTINGS
@given(text=_texts(), skip_special=st.booleans())
def test_encoded_text_default_tokenizer(default_tokenizer: Tokenizer, text: str,
                                        skip_special: bool) -> None:
    ids = default_tokenizer.encode(text)
    _check_every_step(default_tokenizer, ids, skip_special)
    outs = _run(default_tokenizer, ids, SamplingParams(skip_special_tokens=skip_special))
    assert not ids or outs[-1].text == text


@_SETTINGS
@given(text=_texts(), specials=st.lists(st.integers(0, 2), max_size=3),
       skip_special=st.booleans())
def test_start_sensitive_tokenizer(llama2_tokenizer: Tokenizer, text: str,
                                   specials: list[int], skip_special: bool) -> None:
    ids = llama2_tokenizer.encode(text, add_special_tokens=False)
    for i, special in enumerate(specials):  # <unk>, <s>, </s> anywhere in the output
        ids.insert((i * 7) % (len(ids) + 1), special)
    _check_every_step(llama2_tokenizer, ids, skip_special, valid_only=True)


def test_window_does_not_grow_with_the_output(default_tokenizer: Tokenizer,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step decodes the new token and the one before it, not the whole output."""
    ids = default_tokenizer.encode(" the quick brown fox" * 50)
    windows: list[int] = []
    decode = default_tokenizer.decode

    def counting(token_ids: list[int], skip_special_tokens: bool = True) -> str:
        windows.append(len(token_ids))
        return decode(token_ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(default_tokenizer, "decode", counting)
    outs = _run(default_tokenizer, ids, SamplingParams())
    assert outs[-1].text == decode(ids)
    assert len(ids) == 200 and max(windows) <= 2


def test_stop_string_across_a_split_character(default_tokenizer: Tokenizer) -> None:
    """A stop string completed by a token that also starts a multi-byte character is found
    in the same step, as when every step decoded the whole output."""
    text = "ok STOP\U0001F600 more"
    ids = default_tokenizer.encode(text)
    outs = _run(default_tokenizer, ids, SamplingParams(stop=["STOP"]))
    final = outs[-1]
    assert final.finished and final.text == "ok " and final.stop_reason == "STOP"
    full = [default_tokenizer.decode(ids[:n]) for n in range(1, len(ids) + 1)]
    assert len(outs) == next(n for n, t in enumerate(full, 1) if "STOP" in t)
    assert "".join(o.delta_text for o in outs) == "ok "
