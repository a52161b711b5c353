"""The ASGI app in-process over a scripted fake engine: the paths a real model cannot
trigger on demand (an engine failure mid-stream, an engine crash, a full queue,
startup and draining) in milliseconds, without loading a model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from app.factory import create_app
from app.state import AppState, Phase
from app.tokens import TokenizerService
from config import EngineSettings, ServerSettings
from runtime.errors import InvalidRequest


class ByteTokenizer:
    """One token per UTF-8 byte; enough of the HF tokenizer API for the app."""

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], **_: Any) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


class ModelConfig:
    context_len = 64


class FakeEngine:
    """Streams the prompt back one byte per chunk; `fail` scripts what goes wrong."""

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer()
        self.model_config = ModelConfig()
        self.settings = EngineSettings()
        self.num_waiting_reqs = 0
        self.num_running_reqs = 0
        self.fail: str | None = None  # "invalid" | "mid_stream" | "crash"
        self.aborted: list[str] = []

    def get_server_info(self) -> dict[str, Any]:
        return {"max_total_num_tokens": 4096, "num_running_reqs": 0, "num_waiting_reqs": self.num_waiting_reqs}

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    def async_generate(self, prompt: list[int], params: dict[str, Any], stream: bool = False, rid: str = "",
                       return_logprob: bool = False, top_logprobs_num: int = 0) -> AsyncIterator[dict[str, Any]]:
        assert stream, "the app always streams from the engine"
        return self._stream(prompt, params, rid)

    async def _stream(self, prompt: list[int], params: dict[str, Any], rid: str) -> AsyncIterator[dict[str, Any]]:
        if self.fail == "invalid":
            raise InvalidRequest("top_k is out of range", param="top_k")
        out = prompt[: params["max_new_tokens"]]
        for i in range(1, len(out) + 1):
            if self.fail == "crash" or (self.fail == "mid_stream" and i == 2):
                raise RuntimeError("worker died")
            done = i == len(out)
            meta = {"id": rid, "prompt_tokens": len(prompt), "completion_tokens": i, "cached_tokens": 0,
                    "finish_reason": {"type": "length", "matched": i} if done else None, "queue_time": 0.0}
            yield {"text": bytes(out[:i]).decode(errors="replace"), "delta": chr(out[i - 1]), "output_ids": out[:i],
                   "meta_info": meta}


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
    # No lifespan: the engine is attached above. App exceptions become 500s, as on a server.
    transport = httpx.ASGITransport(app=create_app(state), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        yield client


def _events(body: bytes) -> list[bytes]:
    assert body.endswith(b"\n\n")
    return [e.removeprefix(b"data: ") for e in body[:-2].split(b"\n\n")]


async def test_streamed_echo_through_the_fake_engine(client: httpx.AsyncClient, state: AppState) -> None:
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True})
    assert r.status_code == 200
    events = _events(r.content)
    assert events[-1] == b"[DONE]" and b'"text":"c"' in events[-2] and b'"finish_reason":"length"' in events[-2]
    assert state.inflight == 0 and state.not_started == 0 and not state.groups


async def test_engine_failure_after_the_stream_started_is_an_error_event_then_done(
    client: httpx.AsyncClient, engine: FakeEngine, state: AppState
) -> None:
    engine.fail = "mid_stream"
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}],
                                                        "max_tokens": 5, "stream": True})
    assert r.status_code == 200
    events = _events(r.content)
    assert events[-1] == b"[DONE]"
    assert events[-2].startswith(b'{"error":{') and b'"type":"server_error"' in events[-2]
    assert len(engine.aborted) == 1  # the failed choice is aborted, its KV freed
    assert state.inflight == 0 and not state.rids


async def test_engine_validation_error_on_first_chunk_is_a_400_before_any_byte(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.fail = "invalid"
    for stream in (True, False):
        r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "stream": stream})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "top_k"


async def test_unexpected_engine_crash_is_a_500_envelope_not_a_hang(client: httpx.AsyncClient, engine: FakeEngine,
                                                                    state: AppState) -> None:
    engine.fail = "crash"
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert state.inflight == 0


async def test_queue_at_its_limit_is_503(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.num_waiting_reqs = 2
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    engine.num_waiting_reqs = 1
    assert (await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})).status_code == 200


async def test_starting_and_draining_answer_503(client: httpx.AsyncClient, state: AppState) -> None:
    assert (await client.get("/health")).status_code == 200
    state.phase = Phase.DRAINING
    assert (await client.get("/health")).status_code == 503
    r = await client.post("/generate", json={"text": "abc"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    state.phase, state.engine = Phase.STARTING, None
    assert (await client.get("/health")).status_code == 503
    assert (await client.post("/v1/completions", json={"prompt": "abc"})).json()["error"]["code"] == "server_starting"
