"""The official `openai` client against a real `sluice serve`: what OpenAI users rely on."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from server_helpers import MODEL, ServerProcess, shared_server


@pytest.fixture(scope="session")
def server() -> ServerProcess:
    return shared_server()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120.0)


@pytest.fixture(scope="session")
def offline_engine() -> Iterator[Any]:
    from runtime import Engine

    engine = Engine(dtype="float32", quantization="none", max_total_tokens=4096)
    yield engine
    engine.shutdown()


def _greedy(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "temperature": 0.0, **kw}


def test_completion_greedy_text_equals_offline_engine(client: openai.OpenAI, offline_engine: Any) -> None:
    prompt = "The three primary colors are"
    r = client.completions.create(**_greedy(prompt=prompt, max_tokens=12))
    expected = offline_engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0.0})
    assert r.choices[0].text == expected["text"]
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]
    assert r.usage.completion_tokens == expected["meta_info"]["completion_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # The same prompt again is served from the prefix cache (all but the token it must compute).
    again = client.completions.create(**_greedy(prompt=prompt, max_tokens=12))
    assert again.usage.prompt_tokens_details is not None
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    assert again.choices[0].text == r.choices[0].text


def test_chat_greedy_text_equals_offline_engine_on_the_chat_template(client: openai.OpenAI, offline_engine: Any) -> None:
    messages = [{"role": "user", "content": "Name one planet."}]
    r = client.chat.completions.create(**_greedy(messages=messages, max_tokens=12))
    templated = offline_engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = offline_engine.generate(templated, {"max_new_tokens": 12, "temperature": 0.0})
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected["text"]
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]


def test_completion_stream_concatenates_to_the_non_streamed_text(client: openai.OpenAI) -> None:
    kw = _greedy(prompt="Once upon a time", max_tokens=16)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_stream_starts_with_the_assistant_role_and_matches_non_stream(client: openai.OpenAI) -> None:
    kw = _greedy(messages=[{"role": "user", "content": "Say hello."}], max_tokens=16)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_include_usage_sends_a_final_usage_chunk_with_no_choices(client: openai.OpenAI, endpoint: str) -> None:
    common = dict(max_tokens=6, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    if endpoint == "chat":
        stream = client.chat.completions.create(**_greedy(messages=[{"role": "user", "content": "Hi"}], **common))
    else:
        stream = client.completions.create(**_greedy(prompt="Hi there", **common))
    chunks = list(stream)
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 6
    assert usage.total_tokens == usage.prompt_tokens + 6 and usage.prompt_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_n2_returns_two_choices_and_streams_them_interleaved_by_index(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="My favourite food is", max_tokens=8, temperature=0.8, seed=7, n=2,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    one = client.completions.create(**{**kw, "n": 1})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 2 * 8
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once, not per choice
    assert one.choices[0].text == r.choices[0].text  # choice 0 samples with the request's seed
    chunks = list(client.completions.create(**kw, stream=True))
    texts = {0: "", 1: ""}
    finished = {}
    for chunk in chunks:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert set(finished) == {0, 1}
    assert texts == {0: r.choices[0].text, 1: r.choices[1].text}  # seeded: reproducible per choice

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2, temperature=0.8
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_same_seed_gives_the_same_sampled_text(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="In the forest there lived", max_tokens=16, temperature=0.8, seed=1234)
    first = client.completions.create(**kw).choices[0].text
    second = client.completions.create(**kw).choices[0].text
    assert first == second


def test_stop_string_ends_the_text_before_the_stop(client: openai.OpenAI) -> None:
    prompt = "Count with me: one, two, three,"
    baseline = client.completions.create(**_greedy(prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True}))
    text = baseline.choices[0].text
    words = text.split()
    assert len(words) >= 4, text
    stop = words[2]
    expected = text[: text.index(stop)]
    for stops in (stop, [stop, "never-generated-xyz"]):
        r = client.completions.create(**_greedy(prompt=prompt, max_tokens=24, stop=stops, extra_body={"ignore_eos": True}))
        assert r.choices[0].text == expected
        assert r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**_greedy(prompt=prompt, max_tokens=24, stop=stop, stream=True,
                                                        extra_body={"ignore_eos": True})))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs_cover_every_token_with_top_alternatives(client: openai.OpenAI) -> None:
    r = client.completions.create(**_greedy(prompt="The sky is", max_tokens=5, logprobs=3, extra_body={"ignore_eos": True}))
    lp = r.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 4 and sampled <= 0.0
        assert sampled == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the argmax
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    chunks = list(client.completions.create(**_greedy(prompt="The sky is", max_tokens=5, logprobs=1, stream=True,
                                                       extra_body={"ignore_eos": True})))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_top_logprobs_list_alternatives_for_each_token(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        **_greedy(messages=[{"role": "user", "content": "Hi"}], max_tokens=5, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].token == token.token  # greedy
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob, abs=1e-5)
        assert token.bytes == list(token.token.encode())


def test_echo_and_token_id_prompts(client: openai.OpenAI, server: ServerProcess) -> None:
    prompt = "Water boils at"
    by_text = client.completions.create(**_greedy(prompt=prompt, max_tokens=6))
    ids = server.client().post("/v1/tokenize", json={"prompt": prompt}).json()["tokens"]
    by_ids = client.completions.create(**_greedy(prompt=ids, max_tokens=6))
    assert by_ids.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(**_greedy(prompt=prompt, max_tokens=6, echo=True))
    assert echoed.choices[0].text == prompt + by_text.choices[0].text
    batch = client.completions.create(**_greedy(prompt=[prompt, "Ice melts at"], max_tokens=4))
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text[: len(batch.choices[0].text)]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_multibyte_stream_decodes_exactly_to_the_non_streamed_text(client: openai.OpenAI, endpoint: str) -> None:
    if endpoint == "completions":
        kw = _greedy(prompt="你好，世界 🌍🚀\n你好，世界 🌍🚀\n你好，世界 🌍🚀\n", max_tokens=24)
        full = client.completions.create(**kw).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
        assert any(ord(ch) > 0x7F for ch in full), full  # the model really emitted multi-byte text
    else:
        kw = _greedy(messages=[{"role": "user", "content": "Repeat exactly: 你好，世界 🌍🚀"}], max_tokens=24)
        full = client.chat.completions.create(**kw).choices[0].message.content or ""
        chunks = client.chat.completions.create(**kw, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == full
    assert "\ufffd" not in full


def test_models_list_and_retrieve(client: openai.OpenAI, server: ServerProcess) -> None:
    (model,) = client.models.list().data
    assert model.id == MODEL and model.object == "model"
    assert model.model_extra is not None and model.model_extra["max_model_len"] <= 4096
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_unknown_model_is_404_and_context_overflow_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=100_000)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=100_000)
