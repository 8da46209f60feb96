"""Text <-> token ids (HF `tokenizers`) plus the checkpoint's jinja2 chat template."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import gguf
import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from splitserve.errors import ModelLoadError
from splitserve.model.hf_dir import read_json

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# Split regexes of the byte-level BPE vocabularies we support, by `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = ("gpt2", "default")
_SMOLLM_PRE = ("smollm",)
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen")
_SUPPORTED_PRE = _GPT2_PRE + _SMOLLM_PRE + _LLAMA3_PRE + _QWEN2_PRE


class Tokenizer:
    """Text <-> token ids (HF `tokenizers`) plus the checkpoint's jinja2 chat template.

    BOS insertion lives in the backend's post-processor, so `encode` adds it exactly when the
    checkpoint asks for it (SmolLM2: never) and `save` round-trips that choice.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = (
            backend.token_to_id(bos_token) if bos_token is not None else None)
        self.eos_token_id: int | None = (
            backend.token_to_id(eos_token) if eos_token is not None else None)
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`) from `path`."""
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ModelLoadError(
                f"{path} has no tokenizer.json; only fast (tokenizers) tokenizers are supported. "
                "Save one with transformers' `tokenizer.save_pretrained(path)`"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(tok_file)
        except Exception as e:  # tokenizers raises plain Exception on bad JSON
            raise ModelLoadError(f"cannot parse {tok_file}: {e}; re-download the tokenizer") from e
        config = read_json(os.path.join(path, "tokenizer_config.json"), required=False)
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        bos, eos = _token_str(config.get("bos_token")), _token_str(config.get("eos_token"))
        add_bos = config.get("add_bos_token")
        if isinstance(add_bos, bool) and bos is not None and backend.token_to_id(bos) is not None:
            adds_now = (backend.encode("", add_special_tokens=True).ids[:1]
                        == [backend.token_to_id(bos)])
            if adds_now != add_bos:  # the config overrides tokenizer.json (as LlamaTokenizer does)
                _set_bos_processor(backend, bos if add_bos else None)
        return cls(backend, bos, eos, template if isinstance(template, str) else None)

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Build the tokenizer a GGUF file describes in its `tokenizer.*` metadata."""
        metadata = {
            key: field.contents() for key, field in reader.fields.items()
            if key.startswith("tokenizer.")
        }
        return cls.from_gguf_metadata(metadata)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Same as `from_gguf`, from already decoded metadata (`GGUFFile.metadata`)."""
        model = metadata.get("tokenizer.ggml.model")
        if "tokenizer.ggml.tokens" not in metadata:
            raise ModelLoadError(
                "GGUF file has no tokenizer (tokenizer.ggml.tokens); re-convert it with one"
            )
        if model != "gpt2":
            raise ModelLoadError(
                f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2'); "
                "use the model's Hugging Face directory with tokenizer.json instead"
            )
        pre = str(metadata.get("tokenizer.ggml.pre", "default"))
        if pre not in _SUPPORTED_PRE:
            raise ModelLoadError(
                f"GGUF pre-tokenizer {pre!r} is not supported "
                f"(supported: {', '.join(_SUPPORTED_PRE)}); "
                "use the model's Hugging Face directory with tokenizer.json instead"
            )
        tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
        token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [])
        merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
        try:
            backend = _byte_level_backend(tokens, merges, pre)
            _add_special_tokens(backend, tokens, token_types)
        except Exception as e:  # tokenizers raises plain Exception on inconsistent vocab/merges
            raise ModelLoadError(
                f"GGUF tokenizer vocabulary is unusable ({e}); re-convert the model"
            ) from e

        def token_at(key: str) -> str | None:
            idx = metadata.get(f"tokenizer.ggml.{key}")
            return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

        bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
        if metadata.get("tokenizer.ggml.add_bos_token") and bos is not None:
            _set_bos_processor(backend, bos)
        template = metadata.get("tokenizer.chat_template")
        return cls(backend, bos, eos, template if isinstance(template, str) else None)

    def save(self, path: str) -> None:
        """Write tokenizer.json and tokenizer_config.json (chat template, bos/eos) into `path`."""
        os.makedirs(path, exist_ok=True)
        self._backend.save(os.path.join(path, "tokenizer.json"))
        bos_id = self.bos_token_id
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": bos_id is not None and self.encode("")[:1] == [bos_id],
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)

    # ---- use ----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS is added only when the checkpoint asks for it."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids` (special tokens such as <|im_end|> dropped by default)."""
        return str(self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` with the checkpoint's chat template, as transformers does."""
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template; send a plain prompt (completions) "
                "instead of messages"
            )
        try:
            if self._template is None:
                self._template = _chat_environment().from_string(self.chat_template)
            context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                       **extra}
            return self._template.render(
                context, messages=messages, add_generation_prompt=add_generation_prompt
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e


# ---- helpers ------------------------------------------------------------------------------


def _byte_level_backend(tokens: list[str], merges: list[tuple[str, ...]],
                        pre: str) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer as the vocabulary's own tokenizer.json would define it."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for idx, tok in enumerate(tokens):
        # GGUF spells tokens in the byte-level alphabet except some added ones; respell those.
        spelled = (tok if set(tok) <= set(alphabet)
                   else "".join(byte_to_char[b] for b in tok.encode("utf-8")))
        vocab.setdefault(spelled, idx)
    pairs = [(m[0], m[1]) for m in merges if len(m) == 2]
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=pre in _LLAMA3_PRE)
    )
    if pre in _SMOLLM_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif pre in _GPT2_PRE:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _QWEN2_PRE:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str],
                        token_types: list[int]) -> None:
    """CONTROL tokens become special added tokens, USER_DEFINED plain added ones: both stay
    whole."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    control = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, token_types)
        # NOTE: a CONTROL token outside the byte alphabet is a llama.cpp mislabel; adding it
        # would grow the vocabulary past the embedding matrix, so skip it (as transformers does).
        if kind == _CONTROL and set(tok) <= alphabet
    ]
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind in zip(tokens, token_types)
        if kind == _USER_DEFINED and backend.token_to_id(tok) is not None
    ]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _set_bos_processor(backend: tokenizers.Tokenizer, bos: str | None) -> None:
    """Make `encode(add_special_tokens=True)` prepend `bos`, or add nothing when it is None."""
    if bos is None:
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
        return
    bos_id = backend.token_to_id(bos)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
                 + list(range(0xAE, 0xFF + 1)))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag) as a
    no-op."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON (as in transformers).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
