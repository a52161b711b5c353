"""What offline API users rely on: stop conditions, sampling controls, logprobs,
streaming, aborts and input errors — each ending with every KV slot free."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from runtime.errors import InvalidRequest
from tests.conftest import assert_all_memory_free


@pytest.fixture(scope="module")
def engine(make_module_engine: Any) -> Any:
    return make_module_engine()


PROMPT = "The capital of France is"


def _greedy(engine: Any, prompt: Any = PROMPT, **params: Any) -> dict[str, Any]:
    return engine.generate(prompt, {"max_new_tokens": 24, "temperature": 0, **params})


def test_stop_string_ends_the_text_before_it(engine: Any) -> None:
    full = _greedy(engine, ignore_eos=True)["text"]
    words = full.split()
    stop = words[len(words) // 2]
    out = _greedy(engine, ignore_eos=True, stop=stop)
    assert out["text"] == full[: full.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = _greedy(engine, ignore_eos=True, stop=[stop], no_stop_trim=True)
    assert kept["text"] == full[: full.index(stop) + len(stop)]


def test_stop_token_id_ends_generation_on_that_token(engine: Any) -> None:
    ids = _greedy(engine, ignore_eos=True)["output_ids"]
    out = _greedy(engine, ignore_eos=True, stop_token_ids=[ids[3]])
    first = ids.index(ids[3])
    assert out["output_ids"] == ids[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[3]}


def test_eos_stops_unless_ignore_eos_and_min_new_tokens_defers_it(engine: Any, tokenizer: Any) -> None:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}], tokenize=False, add_generation_prompt=True)
    stopped = engine.generate(chat, {"max_new_tokens": 64, "temperature": 0})
    assert stopped["meta_info"]["finish_reason"]["type"] == "stop"
    n = len(stopped["output_ids"])
    assert stopped["output_ids"][-1] in engine.model_config.eos_token_ids
    assert "<|im_end|>" not in stopped["text"]
    ignored = engine.generate(chat, {"max_new_tokens": n + 5, "temperature": 0, "ignore_eos": True})
    assert len(ignored["output_ids"]) == n + 5 and ignored["meta_info"]["finish_reason"]["type"] == "length"
    deferred = engine.generate(chat, {"max_new_tokens": 64, "temperature": 0, "min_new_tokens": n + 2})
    assert len(deferred["output_ids"]) >= n + 2
    assert not set(deferred["output_ids"][: n + 1]) & set(engine.model_config.eos_token_ids)


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(engine: Any) -> None:
    params = {"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 1234, "ignore_eos": True}
    a = engine.generate(PROMPT, params)
    # The same seed in a batch with other traffic draws the same tokens.
    b = engine.generate([PROMPT, "Once upon a time"], [params, {**params, "seed": 7}])[0]
    assert a["output_ids"] == b["output_ids"]
    draws = {tuple(engine.generate(PROMPT, {**params, "seed": s})["output_ids"]) for s in range(4)}
    assert len(draws) > 1
    assert engine.generate(PROMPT, {**params, "top_k": 1})["output_ids"] == _greedy(engine, ignore_eos=True)["output_ids"][:16]


def test_each_request_keeps_its_sampling_params_as_the_batch_changes_around_it(engine: Any) -> None:
    # Requests finish at different steps, so the decode batch shrinks under the
    # survivors: each must still sample with its own parameters and seed.
    params = [
        {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 20, "temperature": 0.8, "seed": 11, "ignore_eos": True},
        {"max_new_tokens": 9, "temperature": 0, "repetition_penalty": 1.5, "ignore_eos": True},
        {"max_new_tokens": 20, "temperature": 1.2, "top_k": 5, "seed": 3, "ignore_eos": True},
    ]
    prompts = [PROMPT, "Once upon a time", "1, 2, 3, 1, 2, 3,", "def main():"]
    together = engine.generate(prompts, params)
    alone = [engine.generate(p, sp) for p, sp in zip(prompts, params)]
    assert [o["output_ids"] for o in together] == [o["output_ids"] for o in alone]
    assert [len(o["output_ids"]) for o in together] == [4, 20, 9, 20]


def test_repetition_penalty_matches_hf(engine: Any, hf_oracle: Any, tokenizer: Any) -> None:
    ids = tokenizer.encode("1, 2, 3, 1, 2, 3, 1, 2,", add_special_tokens=False)
    ours = engine.generate(ids, {"max_new_tokens": 12, "temperature": 0, "repetition_penalty": 1.3, "ignore_eos": True})
    ref = oracle_generate(hf_oracle, ids, 12, repetition_penalty=1.3)
    assert ours["output_ids"] == ref


def oracle_generate(oracle: Any, ids: list[int], n: int, **kw: Any) -> list[int]:
    with torch.inference_mode():
        out = oracle.model.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2, **kw
        )
    return out[0, len(ids) :].tolist()


def test_logprobs_are_the_models_and_top_logprobs_are_sorted(engine: Any, hf_oracle: Any, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    out = engine.generate(ids, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}, return_logprob=True, top_logprobs_num=3)
    meta = out["meta_info"]
    assert [t for _, t in meta["output_token_logprobs"]] == out["output_ids"]
    ref = hf_oracle.logprobs_after(ids)
    assert abs(meta["output_token_logprobs"][0][0] - float(ref[out["output_ids"][0]])) < 1e-3
    for top, (lp, tok) in zip(meta["output_top_logprobs"], meta["output_token_logprobs"]):
        assert len(top) == 3 and top[0][1] == tok and abs(top[0][0] - lp) < 1e-6
        assert [v for v, _ in top] == sorted((v for v, _ in top), reverse=True)


def test_stream_chunks_concatenate_to_the_final_text(engine: Any) -> None:
    prompt = "Repeat after me: 你好，世界 🌍🚀 — ok."

    async def run() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        chunks = [c async for c in engine.async_generate_stream(prompt, {"max_new_tokens": 24, "temperature": 0})]
        whole = await engine.async_generate(prompt, {"max_new_tokens": 24, "temperature": 0})
        return chunks, whole

    chunks, whole = asyncio.run(run())
    # Chunks are deltas: concatenated, they are the non-streamed output.
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert all("\ufffd" not in c["text"] for c in chunks)
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_closing_a_stream_aborts_and_frees_its_kv(engine: Any) -> None:
    async def run() -> int:
        seen = 0
        stream = engine.async_generate_stream(PROMPT, {"max_new_tokens": 500, "temperature": 0, "ignore_eos": True})
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()
        return seen

    assert asyncio.run(run()) == 3
    assert_all_memory_free(engine)
    assert engine.get_server_info()["num_aborted_requests_total"] >= 1


def test_abort_of_waiting_and_running_requests_frees_everything(make_engine: Any) -> None:
    engine = make_engine(max_running_requests=1)

    async def run() -> list[dict[str, Any]]:
        params = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
        tasks = [asyncio.ensure_future(engine.async_generate(PROMPT, params, rid=f"r{i}")) for i in range(3)]
        await asyncio.sleep(0.5)
        engine.abort("r2")  # still waiting: max_running_requests=1
        engine.abort_all()
        return list(await asyncio.gather(*tasks))

    outs = asyncio.run(run())
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    assert all(len(o["output_ids"]) < 400 for o in outs)
    assert_all_memory_free(engine)


@pytest.mark.parametrize(
    "prompt, params, param",
    [
        ("", {}, "prompt"),
        ([10**9], {}, "prompt"),
        (PROMPT, {"temperature": -1}, "temperature"),
        (PROMPT, {"top_p": 0}, "top_p"),
        (PROMPT, {"top_k": 2**63}, "top_k"),
        (PROMPT, {"seed": -1}, "seed"),
        (PROMPT, {"max_new_tokens": 10**6}, "max_tokens"),
        (PROMPT, {"stop": [""]}, "stop"),
        (PROMPT, {"bogus": 1}, "bogus"),
        (PROMPT, {"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
    ],
)
def test_bad_input_is_rejected_before_queueing(engine: Any, prompt: Any, params: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        engine.generate(prompt, params)
    assert err.value.param == param
    assert engine.num_waiting_reqs == 0


def test_bad_request_does_not_disturb_others_and_memory_is_whole_after(engine: Any) -> None:
    good = _greedy(engine, ignore_eos=True)
    with pytest.raises(InvalidRequest):
        engine.generate(PROMPT, {"top_k": 0})
    assert _greedy(engine, ignore_eos=True)["output_ids"] == good["output_ids"]
    assert_all_memory_free(engine)
