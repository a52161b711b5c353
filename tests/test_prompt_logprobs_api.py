"""Prompt logprobs (#14) on the HTTP routes, in-process over the fake engine: OpenAI
`echo` + `logprobs` and native `logprob_start_len` render what the engine reports, in
OpenAI's and SGLang's shapes, and bad input is a 400 before anything runs. (The fake
engine scores prompt token t as fake_logprob(t); tests/test_prompt_logprobs.py checks
the real model against HF.)"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
from fake_engine import FakeEngine, client, engine, fake_logprob, state  # noqa: F401 - the fixtures



def _events(body: bytes) -> list[dict[str, Any]]:
    events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


def _error(r: httpx.Response, param: str) -> None:
    """An OpenAI-style 400 naming `param` (a rule across fields names it in its message)."""
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param or (error["param"] is None and param in error["message"]), error


async def test_echo_with_logprobs_reports_the_prompts_logprobs_then_the_completions(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    body = {"prompt": "abcd", "max_tokens": 2, "echo": True, "logprobs": 1}
    choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "abcdab"
    assert lp["tokens"] == list("abcdab")
    assert lp["token_logprobs"] == [None] + [fake_logprob(t) for t in b"bcdab"]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"b": fake_logprob(ord("b"))}
    assert lp["text_offset"] == [0, 1, 2, 3, 4, 5]
    assert engine.logprob_starts == [0]
    events = _events((await client.post("/v1/completions", json={**body, "stream": True})).content)
    streamed = [x for e in events if (c := e["choices"][0])["logprobs"] for x in zip(*c["logprobs"].values(), strict=True)]
    assert streamed == list(zip(*lp.values(), strict=True))


async def test_echo_with_max_tokens_0_scores_the_prompt_alone(client: httpx.AsyncClient) -> None:
    for stream in (False, True):
        r = await client.post("/v1/completions", json={"prompt": "xyz", "max_tokens": 0, "echo": True, "logprobs": 0,
                                                       "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            choices = [e["choices"][0] for e in _events(r.content)]
            assert "".join(c["text"] for c in choices) == "xyz" and choices[-1]["finish_reason"] == "length"
            lp = next(c["logprobs"] for c in choices if c["logprobs"])
        else:
            body = r.json()
            (choice,) = body["choices"]
            assert choice["text"] == "xyz" and choice["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == 0
            lp = choice["logprobs"]
        assert lp["token_logprobs"] == [None, fake_logprob(ord("y")), fake_logprob(ord("z"))]


async def test_n_choices_share_the_prompt_logprobs_their_first_choice_computed(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    r = await client.post("/v1/completions", json={"prompt": ["ab", "cd"], "n": 2, "max_tokens": 1, "echo": True, "logprobs": 0})
    assert engine.logprob_starts == [0, -1, 0, -1]  # one prompt scoring per prompt
    lps = [c["logprobs"]["token_logprobs"][:2] for c in r.json()["choices"]]
    assert lps == [[None, fake_logprob(ord("b"))]] * 2 + [[None, fake_logprob(ord("d"))]] * 2


async def test_without_echo_or_logprobs_the_prompt_is_not_scored(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1, "echo": True})
    await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1, "logprobs": 2})
    r = await client.post("/generate", json={"text": "ab", "return_logprob": True})
    assert engine.logprob_starts == [-1, -1, -1]
    assert "input_token_logprobs" not in r.json()["meta_info"]


async def test_native_input_logprobs_take_sglangs_shape(client: httpx.AsyncClient) -> None:
    body = {"text": "abcd", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True, "logprob_start_len": 1,
            "top_logprobs_num": 1}
    meta = (await client.post("/generate", json=body)).json()["meta_info"]
    assert meta["input_token_logprobs"] == [[None, 98, None], [fake_logprob(99), 99, None], [fake_logprob(100), 100, None]]
    assert meta["input_top_logprobs"] == [None, [[fake_logprob(99), 99, None]], [[fake_logprob(100), 100, None]]]
    assert meta["output_token_logprobs"] == [[fake_logprob(97), 97], [fake_logprob(98), 98]]  # unchanged
    meta = (await client.post("/generate", json={**body, "return_text_in_logprobs": True})).json()["meta_info"]
    assert meta["input_token_logprobs"][0] == [None, 98, "b"]
    assert meta["output_token_logprobs"][0] == [fake_logprob(97), 97, "a"]
    assert meta["output_top_logprobs"][0][0] == [fake_logprob(97), 97, "a"]
    events = _events((await client.post("/generate", json={**body, "stream": True})).content)
    assert all(len(e["meta_info"]["input_token_logprobs"]) == 3 for e in events)  # cumulative, as SGLang's


async def test_a_batched_generate_takes_one_logprob_start_len_per_prompt(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    body = {"text": ["abc", "wxyz"], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True, "logprob_start_len": [0, 2]}
    outs = (await client.post("/generate", json=body)).json()
    assert [len(o["meta_info"]["input_token_logprobs"]) for o in outs] == [3, 2]
    assert engine.logprob_starts == [0, 2]
    _error(await client.post("/generate", json={**body, "logprob_start_len": [0]}), "logprob_start_len")
    _error(await client.post("/generate", json={**body, "text": "abc"}), "logprob_start_len")  # a list needs a batch


async def test_bad_prompt_logprob_requests_are_400s(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    base = {"text": "abcd", "return_logprob": True}
    _error(await client.post("/generate", json={**base, "logprob_start_len": -2}), "logprob_start_len")
    _error(await client.post("/generate", json={**base, "logprob_start_len": 4}), "logprob_start_len")  # the engine's check
    _error(await client.post("/generate", json={**base, "logprob_start_len": "0"}), "logprob_start_len")
    _error(await client.post("/generate", json={**base, "top_logprobs_num": 21}), "top_logprobs_num")
    _error(await client.post("/v1/completions", json={"prompt": "ab", "echo": True, "logprobs": 21}), "logprobs")
    _error(await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": -1}), "max_tokens")
