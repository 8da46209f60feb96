"""Tokenizer and chat template against transformers' tokenizer for the same GGUF."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import pytest

from splitserve.errors import ModelLoadError
from splitserve.model.gguf_file import GGUFFile
from splitserve.model.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "12345",
    "Pi is 3.14159 and 2024-06-01 was a Saturday.",
    " leading space",
    "   three leading spaces and trailing   ",
    "line one\nline two\n\n\ttabbed",
    "def f(x):\n    return x ** 2  # square\n",
    "Ünïcödé façade, naïve café, straße",
    "日本語のテキストと中文文本",
    "emoji 😀🎉👩‍👩‍👧 and flags 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>assistant\nSure!<|im_end|>\n<|endoftext|>",
    "it's they're we'll I'd",
    "x" * 50 + " " + "ab12cd34",
    "",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, in 日本語?"},
    ],
]


@pytest.fixture(scope="module")
def ours(default_tokenizer: Tokenizer) -> Tokenizer:
    return default_tokenizer


@pytest.fixture(scope="module")
def reference(default_model_path: str) -> Any:
    from transformers import AutoTokenizer

    directory, name = os.path.split(default_model_path)
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def test_special_tokens(ours: Tokenizer) -> None:
    assert ours.vocab_size == 49152
    assert (ours.bos_token, ours.bos_token_id) == ("<|im_start|>", 1)
    assert (ours.eos_token, ours.eos_token_id) == ("<|im_end|>", 2)
    assert ours.encode("<|im_start|>") == [1]
    assert ours.encode("hi")[0] != ours.bos_token_id  # SmolLM2 adds no BOS


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: Tokenizer, reference: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    assert (ours.encode(text, add_special_tokens=False)
            == reference.encode(text, add_special_tokens=False))
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_digits_are_split(ours: Tokenizer) -> None:
    assert ours.encode("12345") == [ours.encode(d)[0] for d in "12345"]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, reference: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    expected = reference.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == expected
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_default_system_prompt(ours: Tokenizer) -> None:
    text = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def _write_toy_gguf(path: Path) -> None:
    """A small byte-level vocabulary: 256 bytes, four merges, control and user-defined tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
              + sorted(ByteLevel.alphabet()))
    tokens += ["Ġt", "he", "Ġthe", "in"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3, 4] + [1] * (len(tokens) - 4))
    writer.add_token_merges(["Ġ t", "h e", "Ġt he", "i n"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_from_gguf_reader_matches_fast_reader(tmp_path: Path) -> None:
    path = tmp_path / "toy.gguf"
    _write_toy_gguf(path)
    via_reader = Tokenizer.from_gguf(gguf.GGUFReader(str(path)))
    fast = Tokenizer.from_gguf_metadata(GGUFFile.open(str(path)).metadata)
    text = "<|im_start|>the thin <think>12 ünï 😀<|im_end|>"
    ids = via_reader.encode(text)
    assert ids == fast.encode(text)
    # BOS, then the text
    assert ids[:3] == [1, 1, via_reader.encode("the", add_special_tokens=False)[0]]
    # "Ġthe", "Ġt", "h", "in": merges applied in rank order
    assert via_reader.encode(" the thin", add_special_tokens=False) == [262, 260, 75, 263]
    assert via_reader.decode(ids) == "the thin <think>12 ünï 😀"
    assert via_reader.apply_chat_template([{"role": "user", "content": "x"}]) == "x"
    assert (via_reader.bos_token_id, via_reader.eos_token_id, via_reader.vocab_size) == (1, 2, 264)


def test_save_and_reload(ours: Tokenizer, tmp_path: Path) -> None:
    ours.save(str(tmp_path))
    reloaded = Tokenizer.from_hf_dir(str(tmp_path))
    for text in TEXTS:
        assert reloaded.encode(text) == ours.encode(text)
    assert reloaded.chat_template == ours.chat_template
    assert (reloaded.bos_token, reloaded.eos_token) == (ours.bos_token, ours.eos_token)
    assert (reloaded.bos_token_id, reloaded.eos_token_id, reloaded.vocab_size) == (1, 2, 49152)


def test_add_bos_token_from_config(ours: Tokenizer, tmp_path: Path) -> None:
    ours.save(str(tmp_path))
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["add_bos_token"] = True
    config_file.write_text(json.dumps(config))
    with_bos = Tokenizer.from_hf_dir(str(tmp_path))
    assert with_bos.encode("hi") == [1] + ours.encode("hi")
    assert with_bos.encode("hi", add_special_tokens=False) == ours.encode("hi")
    with_bos.save(str(tmp_path / "again"))
    assert Tokenizer.from_hf_dir(str(tmp_path / "again")).encode("hi") == [1] + ours.encode("hi")


def test_gguf_add_bos_token(default_model_path: str) -> None:
    metadata = dict(GGUFFile.open(default_model_path).metadata,
                    **{"tokenizer.ggml.add_bos_token": True})
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert tok.encode("hi")[0] == 1 and tok.encode("hi", add_special_tokens=False)[0] != 1


def test_no_chat_template(ours: Tokenizer, tmp_path: Path) -> None:
    ours.save(str(tmp_path))
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["chat_template"]
    config_file.write_text(json.dumps(config))
    plain = Tokenizer.from_hf_dir(str(tmp_path))
    assert plain.chat_template is None
    with pytest.raises(ValueError, match="no chat template.*plain prompt"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_errors_become_value_errors(ours: Tokenizer, tmp_path: Path) -> None:
    ours.save(str(tmp_path))
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = "{{ raise_exception('only user turns, please') }}"
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="only user turns, please"):
        Tokenizer.from_hf_dir(str(tmp_path)).apply_chat_template(
            [{"role": "user", "content": "hi"}])
    config["chat_template"] = "{% for m in messages %}{{ m.content"  # syntax error
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="chat template"):
        Tokenizer.from_hf_dir(str(tmp_path)).apply_chat_template(
            [{"role": "user", "content": "hi"}])


def test_template_features(ours: Tokenizer, tmp_path: Path) -> None:
    """tojson without HTML escaping, loop controls, extra variables and bos/eos, as in
    transformers."""
    ours.save(str(tmp_path))
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m | tojson }}{% endfor %}{{ tools | tojson }}{{ eos_token }}"
    )
    config_file.write_text(json.dumps(config))
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "<a & b>"}, {"role": "user", "content": "x"}],
        tools=[{"n": "é"}]
    )
    assert text == '<|im_start|>{"role": "user", "content": "<a & b>"}[{"n": "é"}]<|im_end|>'


def test_unsupported_gguf_tokenizers(default_model_path: str) -> None:
    metadata = GGUFFile.open(default_model_path).metadata
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_gguf_metadata(dict(metadata, **{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'mystery'"):
        Tokenizer.from_gguf_metadata(dict(metadata, **{"tokenizer.ggml.pre": "mystery"}))
