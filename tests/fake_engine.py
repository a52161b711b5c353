"""The app in-process over a scripted fake engine: `FakeEngine` and the `engine`, `state` and
`client` fixtures the in-process suites import (no model, no server process)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from app.factory import create_app
from app.state import AppState, Phase
from app.tokens import TokenizerService
from config import EngineSettings, ServerSettings
from runtime.errors import InvalidRequest
from runtime.managers.io_struct import BootstrapInfo, GenerateOutput, MetaInfo
from runtime.managers.trace import TraceOptions
from runtime.sampling_params import SamplingParams
from runtime.token_roles import TokenPrompt

class ByteTokenizer:
    """One token per UTF-8 byte; enough of the HF tokenizer API for the app."""

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], **_: Any) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool, **_: Any) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


class FakeModelConfig:
    context_len = 64


def fake_logprob(token_id: int) -> float:
    return -token_id / 256


class FakeOutputStream:
    """runtime.engine_requests.OutputStream's contract over FakeEngine's chunks."""

    def __init__(self, rid: str, chunks: AsyncGenerator[GenerateOutput, None]) -> None:
        self.rid, self.finished, self._chunks = rid, False, chunks

    async def next(self) -> GenerateOutput | None:
        if self.finished:
            return None
        item = await anext(self._chunks)
        self.finished = item["meta_info"]["finish_reason"] is not None
        return item


class FakeEngine:
    """Streams the prompt back one byte per delta chunk, as the engine's contract says
    (logprobs included when asked); `fail` scripts what goes wrong, `calls` records the
    params of every request."""

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer()
        self.model_config = FakeModelConfig()
        self.settings = EngineSettings()
        self.num_waiting_reqs = 0
        self.num_running_reqs = 0
        self.fail: str | None = None  # "invalid" | "mid_stream" | "crash"
        self.aborted: list[str] = []
        self.bootstraps: list[BootstrapInfo | None] = []  # what each engine request was given
        self.rids: list[str] = []
        self.priorities: list[int | None] = []
        self.calls: list[SamplingParams] = []
        self.answer_spans: list[tuple[tuple[int, int], ...]] = []  # each request's TokenPrompt.answer_spans
        self.logprob_starts: list[int] = []  # each request's logprob_start_len

    def get_server_info(self) -> dict[str, Any]:
        return {"max_total_num_tokens": 4096, "num_running_reqs": 0, "num_waiting_reqs": self.num_waiting_reqs}

    def abort(self, rid: str, why: str = "abort_request") -> None:
        self.aborted.append(rid)

    def self_check_bootstrap(self) -> BootstrapInfo | None:
        return None

    def async_generate_stream(self, prompt: TokenPrompt, params: SamplingParams, rid: str = "",
                              return_logprob: bool = False, top_logprobs_num: int = 0,
                              bootstrap: BootstrapInfo | None = None,
                              trace: TraceOptions | None = None, logprob_start_len: int = -1,
                              priority: int | None = None) -> AsyncGenerator[GenerateOutput, None]:
        self.bootstraps.append(bootstrap)
        self.rids.append(rid)
        self.logprob_starts.append(logprob_start_len)
        self.priorities.append(priority)
        self.answer_spans.append(prompt.answer_spans)
        return self._stream(prompt.input_ids, params, rid, return_logprob, top_logprobs_num, logprob_start_len)

    async def open_stream(self, prompt: TokenPrompt, params: SamplingParams, rid: str = "", return_logprob: bool = False,
                          top_logprobs_num: int = 0, bootstrap: BootstrapInfo | None = None,
                          trace: TraceOptions | None = None, logprob_start_len: int = -1,
                          priority: int | None = None) -> FakeOutputStream:
        """The engine's OutputStream over the same scripted chunks (a lone choice's way)."""
        return FakeOutputStream(rid, self.async_generate_stream(prompt, params, rid, return_logprob, top_logprobs_num,
                                                                bootstrap, trace, logprob_start_len, priority))

    async def _stream(self, prompt: list[int], params: SamplingParams, rid: str, return_logprob: bool,
                      top_logprobs_num: int, logprob_start_len: int = -1) -> AsyncGenerator[GenerateOutput, None]:
        if self.fail == "invalid":
            raise InvalidRequest("top_k is out of range", param="top_k")
        params.validate()  # the engine's check, as the real one runs it
        self.calls.append(params)
        out = prompt[: params.max_new_tokens]
        if logprob_start_len >= len(prompt):
            raise InvalidRequest("logprob_start_len is past the prompt", param="logprob_start_len")
        # max_new_tokens=0: one chunk, with no token (prefill only).
        for i, token in enumerate(out or [None], start=1):
            if self.fail == "crash" or (self.fail == "mid_stream" and i == 2):
                raise RuntimeError("worker died")
            done = i >= len(out)
            meta: MetaInfo = {
                "id": rid, "prompt_tokens": len(prompt), "completion_tokens": len(out[:i]), "cached_tokens": 0,
                "finish_reason": {"type": "length", "matched": len(out[:i])} if done else None, "queue_time": 0.0,
                "first_token_time": None, "e2e_latency": None,
            }
            if logprob_start_len >= 0:  # prompt token j scores fake_logprob(j), in the first chunk
                scored = prompt[logprob_start_len:] if i == 1 else []
                meta["input_token_logprobs"] = [(None if j == 0 else fake_logprob(t), t) for j, t in enumerate(scored)]
                if top_logprobs_num:
                    meta["input_top_logprobs"] = [None if j == 0 else [(fake_logprob(t), t)] for j, t in enumerate(scored)]
            tokens = [] if token is None else [token]
            if return_logprob:
                meta["output_token_logprobs"] = [(fake_logprob(t), t) for t in tokens]
            if top_logprobs_num:
                meta["output_top_logprobs"] = [[(fake_logprob(t), t), (fake_logprob(t) - 1.0, (t + 1) % 256)][:top_logprobs_num]
                                               for t in tokens]
            yield {"text": "".join(map(chr, tokens)), "output_ids": tokens, "meta_info": meta}


# Fixtures of the in-process suites, which import them: `engine`, `state` (READY, at most two
# queued requests) and `client` (the ASGI app over them, no lifespan).


@pytest.fixture()
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture()
def state(engine: FakeEngine) -> Iterator[AppState]:
    state = AppState(ServerSettings(max_queued_requests=2), EngineSettings())
    state.attach(engine, TokenizerService(engine.tokenizer))  # type: ignore[arg-type]
    state.phase = Phase.READY
    yield state
    assert state.tokens is not None
    state.tokens.shutdown()


@pytest.fixture()
async def client(state: AppState) -> AsyncIterator[httpx.AsyncClient]:
    # App exceptions become 500s, as on a server.
    transport = httpx.ASGITransport(app=create_app(state), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        yield client
