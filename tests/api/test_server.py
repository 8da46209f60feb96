"""The happy paths of every route, through the official openai client over real HTTP."""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import httpx2
import openai
from openai.types.chat import ChatCompletionContentPartTextParam, ChatCompletionMessageParam

from fake_backend import CREATED, MAX_MODEL_LEN, MODEL_NAMES, SCRIPT, FakeBackend, logprob_of
from splitserve.cluster.router.config import DisaggPolicy

CHAT: list[ChatCompletionMessageParam] = [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi!"}]


def _template_ids(fake: FakeBackend, messages: Sequence[Mapping[str, object]]) -> list[int]:
    tok = fake.model_info.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),
                      add_special_tokens=False)


# ---- models, health, readiness, metrics ---------------------------------------------------

def test_models_lists_every_served_name(client: openai.OpenAI, http: httpx2.Client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == MODEL_NAMES
    assert all(m.owned_by == "splitserve" and m.created == CREATED for m in models.data)
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list"
    assert [m["max_model_len"] for m in raw["data"]] == [MAX_MODEL_LEN] * len(MODEL_NAMES)


def test_health_ready_and_metrics(http: httpx2.Client, fake: FakeBackend) -> None:
    health = http.get("/health")
    assert health.status_code == 200
    assert health.json() == {"workers": {"total": 2, "healthy": 1, "by_role": {
        "decode": {"total": 1, "healthy": 0}, "prefill": {"total": 1, "healthy": 1}}},
        "in_flight": 1, "queued": 0}
    assert http.get("/ready").status_code == 200
    fake.ready = False
    assert http.get("/ready").status_code == 503
    metrics = http.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert metrics.content == fake.metrics_text()


# ---- completions --------------------------------------------------------------------------

def test_completion(client: openai.OpenAI, fake: FakeBackend) -> None:
    fake.num_cached_tokens = 1
    raw = client.completions.with_raw_response.create(model="smollm2-alias", prompt="Hello",
                                                      max_tokens=50)
    out = raw.parse()
    assert out.object == "text_completion" and out.model == "smollm2-alias"
    assert out.id == raw.headers["x-request-id"] == fake.last.request_id
    assert out.id.startswith("cmpl-")
    choice = out.choices[0]
    assert (choice.index, choice.text, choice.finish_reason) == (0, SCRIPT, "stop")
    assert choice.logprobs is None and choice.model_extra is not None
    assert choice.model_extra["stop_reason"] is None
    n_prompt, n_out = len(fake.last.prompt_token_ids), len(fake.script_ids)
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        n_prompt, n_out, n_prompt + n_out)
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 1
    assert fake.outcomes[out.id] == "finished"


def test_completion_cut_at_max_tokens_finishes_with_length(client: openai.OpenAI) -> None:
    out = client.completions.create(model="smollm2", prompt="Hello", max_tokens=3)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (" The quick brown", "length")


def test_completion_max_tokens_defaults_to_16_and_null_means_no_limit(
        client: openai.OpenAI, http: httpx2.Client, fake: FakeBackend) -> None:
    client.completions.create(model="smollm2", prompt="Hello")
    assert fake.last.params.max_tokens == 16
    response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": None})
    assert response.status_code == 200
    assert fake.last.params.max_tokens is None
    client.chat.completions.create(model="smollm2", messages=CHAT)
    assert fake.last.params.max_tokens is None


def test_completion_prompt_shapes(client: openai.OpenAI, fake: FakeBackend) -> None:
    tok = fake.model_info.tokenizer
    shapes: list[tuple[str | list[str] | list[int] | list[list[int]], list[int]]] = [
        ("Hello there", tok.encode("Hello there")), ([5, 6, 7], [5, 6, 7]),
        (["Hello there"], tok.encode("Hello there")), ([[8, 9]], [8, 9])]
    for prompt, ids in shapes:
        client.completions.create(model="smollm2", prompt=prompt, max_tokens=2)
        assert fake.last.prompt_token_ids == ids


def test_completion_without_model_uses_the_first_name(http: httpx2.Client) -> None:
    out = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).json()
    assert out["model"] == MODEL_NAMES[0]


def test_completion_stream(client: openai.OpenAI, fake: FakeBackend) -> None:
    chunks = list(client.completions.create(model="smollm2", prompt="Hello", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == SCRIPT
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert {c.id for c in chunks} == {fake.last.request_id}
    assert all(c.usage is None for c in chunks)


def test_completion_stream_include_usage(client: openai.OpenAI, fake: FakeBackend) -> None:
    chunks = list(client.completions.create(model="smollm2", prompt="Hello", stream=True,
                                            max_tokens=4, stream_options={"include_usage": True}))
    *text_chunks, last = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == " The quick brown fox"
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 4
    assert last.usage.prompt_tokens == len(fake.last.prompt_token_ids)


def test_stream_is_server_sent_events_ending_with_done(http: httpx2.Client) -> None:
    with http.stream("POST", "/v1/completions",
                     json={"prompt": "Hi", "max_tokens": 2, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    events = body.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert [p["choices"][0]["text"] for p in payloads] == [" The", " quick"]


def test_completion_logprobs(client: openai.OpenAI, fake: FakeBackend) -> None:
    out = client.completions.create(model="smollm2", prompt="Hello", max_tokens=3, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp is not None
    assert lp.tokens == [" The", " quick", " brown"]
    assert lp.token_logprobs == [logprob_of(0), logprob_of(1), logprob_of(2)]
    assert lp.text_offset == [0, 4, 10]
    tok = fake.model_info.tokenizer
    first = fake.script_ids[0]
    assert lp.top_logprobs is not None
    alternative = tok.decode([first + 1], skip_special_tokens=False)
    assert lp.top_logprobs[0] == {" The": logprob_of(0), alternative: logprob_of(0) - 1}
    assert fake.last.params.logprobs == 2


def test_completion_logprobs_stream_offsets_continue(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="smollm2", prompt="Hello", max_tokens=3,
                                            logprobs=0, stream=True))
    offsets: list[int] = []
    tops = []
    for chunk in chunks:
        lp = chunk.choices[0].logprobs
        assert lp is not None and lp.text_offset is not None and lp.top_logprobs is not None
        offsets += lp.text_offset
        tops.append(len(lp.top_logprobs[0]))
    assert offsets == [0, 4, 10] and tops == [1, 1, 1]


# ---- chat ---------------------------------------------------------------------------------

def test_chat(client: openai.OpenAI, fake: FakeBackend) -> None:
    out = client.chat.completions.create(model="smollm2", messages=CHAT)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == SCRIPT
    assert out.choices[0].finish_reason == "stop"
    assert fake.last.prompt_token_ids == _template_ids(fake, CHAT)
    assert out.usage is not None and out.usage.completion_tokens == len(fake.script_ids)


def test_chat_content_parts_are_joined_text(client: openai.OpenAI, fake: FakeBackend) -> None:
    parts: list[ChatCompletionContentPartTextParam] = [{"type": "text", "text": "Hi"},
                                                       {"type": "text", "text": "there"}]
    client.chat.completions.create(model="smollm2",
                                   messages=[{"role": "user", "content": parts}])
    assert fake.last.prompt_token_ids == _template_ids(
        fake, [{"role": "user", "content": "Hi\nthere"}])


def test_chat_tool_and_assistant_roles(client: openai.OpenAI, fake: FakeBackend) -> None:
    messages: list[ChatCompletionMessageParam] = CHAT + [
                       {"role": "assistant", "content": "Hello."},
                       {"role": "tool", "content": "42", "tool_call_id": "c1"},
                       {"role": "user", "content": "And?"}]
    client.chat.completions.create(model="smollm2", messages=messages)
    assert len(fake.last.prompt_token_ids) > len(_template_ids(fake, CHAT))


def test_chat_stream(client: openai.OpenAI, fake: FakeBackend) -> None:
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=CHAT, stream=True, max_completion_tokens=3,
        stream_options={"include_usage": True}))
    first, *middle, usage = chunks
    assert first.object == "chat.completion.chunk"
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "")
    assert "".join(c.choices[0].delta.content or "" for c in middle) == " The quick brown"
    assert middle[-1].choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens == 3
    assert {c.id for c in chunks} == {fake.last.request_id}


def test_chat_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI,
                                                         fake: FakeBackend) -> None:
    client.chat.completions.create(model="smollm2", messages=CHAT,
                                   max_tokens=7, max_completion_tokens=2)
    assert fake.last.params.max_tokens == 2
    client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=7)
    assert fake.last.params.max_tokens == 7


def test_chat_logprobs(client: openai.OpenAI, fake: FakeBackend) -> None:
    out = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2,
                                         logprobs=True, top_logprobs=3)
    assert out.choices[0].logprobs is not None
    content = out.choices[0].logprobs.content
    assert content is not None and [c.token for c in content] == [" The", " quick"]
    assert [c.logprob for c in content] == [logprob_of(0), logprob_of(1)]
    assert content[0].bytes == list(b" The")
    assert [len(c.top_logprobs) for c in content] == [3, 3]
    assert content[0].top_logprobs[0].token == " The"
    assert fake.last.params.logprobs == 3
    plain = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2)
    assert plain.choices[0].logprobs is None and fake.last.params.logprobs is None


# ---- what reaches the backend -------------------------------------------------------------

def test_sampling_fields_pass_through(client: openai.OpenAI, fake: FakeBackend) -> None:
    client.completions.create(
        model="smollm2", prompt="Hi", max_tokens=5, temperature=0.5, top_p=0.9, seed=1234,
        stop=["\n", "END"], presence_penalty=0.5, frequency_penalty=-0.5, user="bob",
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2,
                    "ignore_eos": True, "stop_token_ids": [7, 8],
                    "include_stop_str_in_output": True, "skip_special_tokens": False,
                    "some_unknown_field": {"is": "ignored"}})
    p = fake.last.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed) == (5, 0.5, 0.9, 1234)
    assert p.stop == ["\n", "END"]
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens) == (40, 0.05, 1.1, 2)
    assert (p.ignore_eos, p.stop_token_ids, p.include_stop_str_in_output,
            p.skip_special_tokens) == (True, [7, 8], True, False)


def test_chat_stop_string_and_seed_pass_through(client: openai.OpenAI, fake: FakeBackend) -> None:
    client.chat.completions.create(model="smollm2", messages=CHAT, stop="Bye", seed=7)
    assert (fake.last.params.stop, fake.last.params.seed) == (["Bye"], 7)


def test_defaults_are_vllms(client: openai.OpenAI, fake: FakeBackend) -> None:
    client.chat.completions.create(model="smollm2", messages=CHAT)
    p = fake.last.params
    assert (p.temperature, p.top_p, p.top_k, p.n, p.seed, p.stop, p.logprobs) == (
        1.0, 1.0, 0, 1, None, [], None)


def test_tenant_header_then_cache_salt_then_user(client: openai.OpenAI,
                                                 fake: FakeBackend) -> None:
    def tenant_for(headers: dict[str, str], body: dict[str, str]) -> str | None:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=1,
                                  extra_headers=headers, extra_body=body)
        assert fake.last.namespace == fake.last.tenant
        return fake.last.namespace

    assert tenant_for({}, {}) is None
    assert tenant_for({}, {"user": "bob"}) == "bob"
    assert tenant_for({}, {"user": "bob", "cache_salt": "salt"}) == "salt"
    assert tenant_for({"X-Tenant": "acme"}, {"user": "bob", "cache_salt": "salt"}) == "acme"


def test_disagg_override_reaches_the_request(client: openai.OpenAI, fake: FakeBackend) -> None:
    client.completions.create(model="smollm2", prompt="Hi", max_tokens=1,
                              extra_body={"disagg": "always"})
    assert fake.last.disagg is DisaggPolicy.ALWAYS
    client.chat.completions.create(model="smollm2", messages=CHAT,
                                   extra_body={"disagg": "Never"})
    assert fake.last.disagg is DisaggPolicy.NEVER
    client.chat.completions.create(model="smollm2", messages=CHAT,
                                   extra_body={"disagg": None})
    assert fake.last.disagg is None  # the server's --disagg-policy
