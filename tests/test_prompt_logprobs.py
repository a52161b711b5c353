"""Prompt logprobs (#14) on the real model equal HF transformers' on the same weights
(float32, CPU), in the scheduler settings that cut, share and mix prefills; through a
real server, OpenAI's echo + logprobs and SGLang's logprob_start_len report them.

Tolerance: PROMPT_LOGPROB_TOL absolute per logprob. Measured on the embedded SmolLM2-135M
(prompts of 1 to 177 tokens, chunks of 16, mixed batches): at most 2e-5 from HF.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import torch
from server_helpers import ServerProcess, assert_error_envelope, shared_server

from tests.conftest import LONG_TEXT, HFOracle, assert_all_memory_free, assert_greedy_equal
from tests.tiny_checkpoints import make_llama_checkpoint

PROMPT_LOGPROB_TOL = 1e-4
MAX_NEW = 8

SETTINGS: dict[str, dict[str, Any]] = {
    "chunk16-mixed": {"chunked_prefill_size": 16, "enable_mixed_chunk": True},  # radix on, overlap on
    "radix-no-overlap": {"disable_overlap_schedule": True},
    "page4-chunk10-no-radix": {"page_size": 4, "chunked_prefill_size": 10, "disable_radix_cache": True},
}


@torch.inference_mode()
def hf_logprobs(oracle: HFOracle, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row i is log p(. | ids[: i + 1]), which scores ids[i + 1]."""
    return torch.log_softmax(oracle.model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def assert_prompt_logprobs_equal_hf(oracle: HFOracle, prompt: list[int], start: int, meta: dict[str, Any], top_k: int = 0) -> None:
    ref = hf_logprobs(oracle, prompt)
    entries = meta["input_token_logprobs"]
    assert [t for _, t in entries] == prompt[start:]
    assert entries[0][0] is None
    for i, (lp, token) in enumerate(entries[1:], start=start + 1):
        assert abs(lp - float(ref[i - 1, token])) < PROMPT_LOGPROB_TOL, (i, lp, float(ref[i - 1, token]))
    if top_k:
        tops = meta["input_top_logprobs"]
        assert len(tops) == len(entries) and tops[0] is None
        for i, top in enumerate(tops[1:], start=start + 1):
            want = ref[i - 1].topk(top_k).values.tolist()  # compared by value: near-ties may swap ids
            assert max(abs(v - w) for (v, _), w in zip(top, want)) < PROMPT_LOGPROB_TOL
            assert all(abs(v - float(ref[i - 1, t])) < PROMPT_LOGPROB_TOL for v, t in top)


@pytest.fixture(scope="module", params=SETTINGS)
def plp_engine(request: pytest.FixtureRequest, make_module_engine: Any) -> Any:
    return make_module_engine(**SETTINGS[request.param])


def test_prompt_logprobs_equal_hf_in_one_batch(plp_engine: Any, hf_oracle: HFOracle, prompts: list[list[int]]) -> None:
    """Every prompt (1 to ~180 tokens) from several starts, in one batch: with chunks of 16
    the long prompt's chunks ride with the others' decodes (mixed batches)."""
    starts = [min(s, len(p) - 1) for s, p in zip([0, 2, 0, 5, 0, 10], prompts)]
    mixed_before = plp_engine.scheduler.stats.counters.get("num_mixed_batches", 0)
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    outs = plp_engine.generate(prompts, params, return_logprob=True, top_logprobs_num=3, logprob_start_len=starts)
    for prompt, start, out in zip(prompts, starts, outs):
        assert_prompt_logprobs_equal_hf(hf_oracle, prompt, start, out["meta_info"], top_k=3)
        assert_greedy_equal(hf_oracle, prompt, out["output_ids"], MAX_NEW)
    if plp_engine.settings.enable_mixed_chunk:
        assert plp_engine.scheduler.stats.counters["num_mixed_batches"] > mixed_before
    assert_all_memory_free(plp_engine)


def test_a_cached_shared_prefix_is_recomputed_from_logprob_start_len(plp_engine: Any, hf_oracle: HFOracle, tokenizer: Any) -> None:
    head = tokenizer.encode(LONG_TEXT, add_special_tokens=False)
    plp_engine.generate(head, {"max_new_tokens": 2, "temperature": 0})  # the prefix is cached (radix on)
    prompt = head + tokenizer.encode(" What held back the flood?", add_special_tokens=False)
    start = 40
    out = plp_engine.generate(prompt, {"max_new_tokens": 2, "temperature": 0}, return_logprob=True, logprob_start_len=start)
    assert_prompt_logprobs_equal_hf(hf_oracle, prompt, start, out["meta_info"])
    page = plp_engine.settings.page_size
    assert out["meta_info"]["cached_tokens"] == (0 if plp_engine.settings.disable_radix_cache else start - start % page)
    again = plp_engine.generate(prompt, {"max_new_tokens": 2, "temperature": 0}, return_logprob=True, logprob_start_len=start)
    assert again["meta_info"]["input_token_logprobs"] == out["meta_info"]["input_token_logprobs"]
    assert_all_memory_free(plp_engine)


def test_a_prefill_only_request_scores_the_prompt_and_frees_everything(plp_engine: Any, hf_oracle: HFOracle, prompts: list[list[int]]) -> None:
    prompt = prompts[4]
    out = plp_engine.generate(prompt, {"max_new_tokens": 0}, return_logprob=True, top_logprobs_num=1, logprob_start_len=0)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "matched": 0}
    assert out["meta_info"]["output_token_logprobs"] == []
    assert_prompt_logprobs_equal_hf(hf_oracle, prompt, 0, out["meta_info"], top_k=1)
    assert_all_memory_free(plp_engine)


def test_prompt_logprobs_at_tp2_equal_hf(make_engine: Any, tokenizer: Any, tmp_path: Path, prompts: list[list[int]]) -> None:
    """Rank 1 joins the all-gathers of the prompt rows' logits (their rows ride the broadcast)."""
    checkpoint = make_llama_checkpoint(tmp_path, tokenizer, num_kv_heads=2)
    oracle = HFOracle(checkpoint)
    engine = make_engine(model_path=str(checkpoint), tp_size=2, chunked_prefill_size=16, max_running_requests=8)
    outs = engine.generate(prompts, {"max_new_tokens": 2, "temperature": 0}, return_logprob=True, top_logprobs_num=2,
                           logprob_start_len=0)
    for prompt, out in zip(prompts, outs):
        assert_prompt_logprobs_equal_hf(oracle, prompt, 0, out["meta_info"], top_k=2)
    assert_all_memory_free(engine)


# ---- through a real server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    server = shared_server()
    yield server
    info = server.wait_all_kv_free()
    assert info["available_kv_tokens"] == info["max_total_num_tokens"], info


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def _logprobs_close(got: list[float | None], want: list[float | None]) -> bool:
    """The same entries up to PROMPT_LOGPROB_TOL. Two requests for the same prompt are not
    bit-equal in general: this float32 server's matmuls (MKL's sgemm) may round a row
    differently with the batch's row count (on an AMD EPYC: 11 rows alone vs 22 with n = 2,
    1e-5 apart); only --enable-deterministic-inference promises equal bits."""
    return len(got) == len(want) and all(
        (g is None) == (w is None) and (g is None or w is None or abs(g - w) < PROMPT_LOGPROB_TOL) for g, w in zip(got, want)
    )


def test_openai_echo_with_logprobs_scores_the_prompt_as_hf_does(server: ServerProcess, hf_oracle: HFOracle, tokenizer: Any) -> None:
    ids = tokenizer.encode("The river rose slowly through the night, and by morning", add_special_tokens=False)
    ref = hf_logprobs(hf_oracle, ids)
    body = {"prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 0
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - float(ref[i - 1, ids[i]])) < PROMPT_LOGPROB_TOL
        assert 2 <= len(lp["top_logprobs"][i]) <= 3 and lp["tokens"][i] in lp["top_logprobs"][i]
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])

    # With a completion: the prompt's entries, then the completion's; streamed alike.
    body = {**body, "max_tokens": 4, "n": 2}
    final = _post(server, "/v1/completions", body).json()["choices"]
    assert all(_logprobs_close(c["logprobs"]["token_logprobs"][: len(ids)], lp["token_logprobs"]) for c in final)
    assert all(len(c["logprobs"]["tokens"]) == len(ids) + 4 for c in final)
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        events = [e for e in s.iter_lines() if e.startswith("data: {")]
    streamed: dict[int, list[Any]] = {0: [], 1: []}
    for e in events:
        c = orjson.loads(e.removeprefix("data: "))["choices"][0]
        if c["logprobs"]:
            streamed[c["index"]].extend(c["logprobs"]["token_logprobs"])
    assert all(_logprobs_close(streamed[i], final[i]["logprobs"]["token_logprobs"]) for i in (0, 1))


def test_native_generate_reports_input_token_logprobs_from_logprob_start_len(
    server: ServerProcess, hf_oracle: HFOracle, tokenizer: Any
) -> None:
    ids = tokenizer.encode("def fibonacci(n):\n    if n < 2:", add_special_tokens=False)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_logprob": True,
            "logprob_start_len": 3, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    meta = _post(server, "/generate", body).json()["meta_info"]
    entries = meta["input_token_logprobs"]
    assert [e[2] for e in entries] == [tokenizer.decode([t]) for t in ids[3:]]
    pairs = {"input_token_logprobs": [(lp, t) for lp, t, _ in entries],
             "input_top_logprobs": [None if top is None else [(lp, t) for lp, t, _ in top] for top in meta["input_top_logprobs"]]}
    assert_prompt_logprobs_equal_hf(hf_oracle, ids, 3, pairs, top_k=2)
    assert all(len(e) == 3 for e in meta["output_token_logprobs"])

    batch = {"input_ids": [ids, ids[:5]], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
             "logprob_start_len": [0, 4]}
    outs = _post(server, "/generate", batch).json()
    assert [len(o["meta_info"]["input_token_logprobs"]) for o in outs] == [len(ids), 1]
    assert [e[2] for e in outs[0]["meta_info"]["input_token_logprobs"]] == [None] * len(ids)  # text only when asked


def test_bad_prompt_logprob_requests_get_openai_style_400s(server: ServerProcess) -> None:
    native = {"text": "Hello there", "return_logprob": True}
    for body, param in (
        ({**native, "logprob_start_len": 100}, "logprob_start_len"),  # past the prompt
        ({**native, "logprob_start_len": -2}, "logprob_start_len"),
        ({**native, "top_logprobs_num": 21}, "top_logprobs_num"),
    ):
        assert assert_error_envelope(_post(server, "/generate", body), 400)["param"] == param
    r = _post(server, "/v1/completions", {"prompt": "Hello", "echo": True, "logprobs": 21})
    assert assert_error_envelope(r, 400)["param"] == "logprobs"
