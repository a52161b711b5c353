"""A chat's next turn marks where its earlier answers are (app/tokens.py chat_prompt), so
that under deterministic inference their tokens keep the kernel they were decoded on and
their KV can come from the cache (runtime/token_roles.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from app.tokens import TokenizerService, _token_spans
from tests.server_helpers import ServerProcess, assert_error_envelope, shared_server

ANSWERS = ["Paris is the capital of France.", " Two spaces,\nand a line: 3 + 4 = 7 ✓"]
MESSAGES: list[dict[str, object]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Where is Paris?"},
    {"role": "assistant", "content": ANSWERS[0]},
    {"role": "user", "content": "And arithmetic?"},
    {"role": "assistant", "content": ANSWERS[1]},
    {"role": "user", "content": "Thanks."},
]


def test_the_chat_prompt_marks_each_assistant_message_as_the_model_wrote_it(tokenizer: Any) -> None:
    services = TokenizerService(tokenizer, mark_answers=True), TokenizerService(tokenizer)
    try:
        marked, plain = (asyncio.run(s.chat_prompt(MESSAGES)) for s in services)
    finally:
        for s in services:
            s.shutdown()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    # Marking changes no token: the ids are the template's text, tokenized as always.
    assert marked.input_ids == plain.input_ids == tokenizer.encode(text, add_special_tokens=False)
    assert plain.answer_spans == ()
    # One span per answer, and each is the answer's own tokenization (what a model that
    # wrote the answer decoded: its KV is what the cache holds from that turn).
    assert len(marked.answer_spans) == 2
    for (start, end), answer in zip(marked.answer_spans, ANSWERS):
        assert marked.input_ids[start:end] == tokenizer.encode(answer, add_special_tokens=False)
    assert marked.check() is None


def test_token_spans_take_the_tokens_with_characters_in_the_spans() -> None:
    offsets = [(0, 2), (2, 5), (5, 9), (9, 10), (10, 10), (10, 14), (14, 20), (20, 22)]
    # Chars 2-10 hold tokens 1-3 (token 4 is empty); 13-20 holds part of token 5 (a
    # token across the edge counts) and token 6.
    assert _token_spans(offsets, [(2, 10), (13, 20)]) == ((1, 4), (5, 7))
    assert _token_spans(offsets, [(3, 4)]) == ((1, 2),)
    assert _token_spans(offsets, []) == ()


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return shared_server("--enable-deterministic-inference")


def test_a_chats_next_turn_reuses_the_answers_kv_and_changes_no_bit(server: ServerProcess) -> None:
    """Over HTTP, under --enable-deterministic-inference: turn 2 sends turn 1's reply back as
    an assistant message; the cache serves turn 1's prompt and the reply's KV (all but its
    last token, which was never fed), and turn 2's tokens and logprobs equal the same turn
    on an empty cache."""
    messages: list[dict[str, str]] = [{"role": "user", "content": "Name three colours, then three fruits."}]
    body = {"max_tokens": 24, "temperature": 0, "logprobs": True}

    def chat(http: httpx.Client) -> dict[str, Any]:
        response = http.post("/v1/chat/completions", json={"messages": messages, **body})
        assert response.status_code == 200, response.text
        out: dict[str, Any] = response.json()
        return out

    with server.client() as http:
        assert http.post("/flush_cache").status_code == 200
        first = chat(http)
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And three animals?"}]  # fmt: skip
        second = chat(http)
        usage = first["usage"]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] - 1
        assert http.post("/flush_cache").status_code == 200
        fresh = chat(http)
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["choices"][0]["message"] == fresh["choices"][0]["message"]
    assert second["choices"][0]["logprobs"] == fresh["choices"][0]["logprobs"]
    server.wait_all_kv_free()


def test_generate_takes_answer_spans_with_input_ids(server: ServerProcess) -> None:
    """The native route's `answer_spans` (with input_ids): a next turn sent as token ids
    reuses the answer's KV when it marks it, and only its prompt's when it does not; spans
    that do not fit the prompt are a 400 naming answer_spans."""
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    prompt = [1, 9690, 198, 504, 5248, 314, 253, 4001, 30, 2, 198, 1, 520, 9531, 198]
    with server.client() as http:
        assert http.post("/flush_cache").status_code == 200
        first = http.post("/generate", json={"input_ids": prompt, "sampling_params": params}).json()
        answer = first["output_ids"]
        turn = prompt + answer + [2, 198, 1, 4093, 198]
        span = [[len(prompt), len(prompt) + len(answer)]]
        marked, plain = (http.post("/generate", json={"input_ids": turn, "sampling_params": params, **extra}).json()
                         for extra in ({"answer_spans": span}, {}))  # fmt: skip
        bad = http.post("/generate", json={"input_ids": turn, "answer_spans": [[3, len(turn) + 1]]})
    assert marked["meta_info"]["cached_tokens"] == len(prompt) + len(answer) - 1
    assert plain["meta_info"]["cached_tokens"] == len(prompt)
    assert assert_error_envelope(bad, 400)["param"] == "answer_spans"
    server.wait_all_kv_free()
