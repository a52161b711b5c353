"""Traces and the dashboard through the ASGI app, in-process, over a real scheduler on the
stub worker started on the test's own loop: GET /v1/requests/{rid}/trace (behind the
API key, 404 for an unknown id), `"return_trace": true` on every generation route, the
caller's `traceparent`, a client that disconnects, and the dashboard's files and snapshot."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.types import ASGIApp, Message

from app.factory import create_app
from app.routes_dashboard import STATIC, Rates, snapshot
from app.state import AppState, Phase
from app.tokens import TokenizerService
from config import ServerSettings
from runtime.engine import Engine
from tests.stub_engine import make_prompts, stub_engine

KEY = "sk-trace"
AUTH = {"Authorization": f"Bearer {KEY}"}
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
APPS: dict[int, ASGIApp] = {}  # engine -> the app serving it, for the tests that drive ASGI by hand


@contextlib.asynccontextmanager
async def serving(**settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Engine, AppState]]:
    """The app over a stub engine (with these engine `settings`) whose scheduler runs on
    this loop (as `sluice serve` runs it)."""
    engine = stub_engine(**settings)
    await engine.start()
    state = AppState(ServerSettings(api_key=KEY), engine.settings)
    state.attach(engine, TokenizerService(engine.tokenizer))
    state.phase = Phase.READY
    app = create_app(state)
    APPS[id(engine)] = app
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://app", headers=AUTH) as client:
            yield client, engine, state
    finally:
        task = engine._task
        engine.shutdown()
        if task is not None:
            await asyncio.wait_for(task, 30)
        assert state.tokens is not None
        state.tokens.shutdown()


def native(rid: str, max_new: int = 4, **extra: Any) -> dict[str, Any]:
    prompt = make_prompts([12], seed=len(rid))[0]
    return {"input_ids": prompt, "rid": rid, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}, **extra}


async def test_the_trace_route_answers_known_ids_behind_the_key_and_404_otherwise() -> None:
    async with serving() as (client, engine, _):
        r = await client.post("/generate", json=native("t1"))
        assert r.status_code == 200 and "trace" not in r.json()["meta_info"]
        trace = (await client.get("/v1/requests/t1/trace")).json()
        assert trace["rid"] == "t1" and trace["state"] == "finished" and trace["output_tokens"] == 4
        assert trace == engine.get_trace("t1")
        unknown = await client.get("/v1/requests/no-such-id/trace")
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "trace_not_found"
        no_key = await client.get("/v1/requests/t1/trace", headers={"Authorization": ""})
        assert no_key.status_code == 401


async def test_return_trace_puts_the_timeline_in_the_final_meta_info_of_every_route() -> None:
    async with serving() as (client, _, _):
        body = (await client.post("/generate", json=native("n1", return_trace=True))).json()
        assert body["meta_info"]["trace"]["rid"] == "n1" and body["meta_info"]["trace"]["state"] == "finished"

        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "return_trace": True, "n": 2}
        body = (await client.post("/v1/chat/completions", json=chat)).json()
        traces = [c["meta_info"]["trace"] for c in body["choices"]]
        assert [t["rid"] for t in traces] == [f"{body['id']}-0", f"{body['id']}-1"]
        assert all(t["output_tokens"] == 3 for t in traces)

        r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "return_trace": True, "stream": True})
        events = [json.loads(e.removeprefix("data: ")) for e in r.text.strip().split("\n\n")[:-1]]
        with_trace = [e for e in events if e["choices"] and "meta_info" in e["choices"][0]]
        assert len(with_trace) == 1 and with_trace[0]["choices"][0]["finish_reason"] == "length"
        assert with_trace[0]["choices"][0]["meta_info"]["trace"]["rid"] == events[0]["id"]

        plain = (await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})).json()
        assert "meta_info" not in plain["choices"][0]


async def test_the_callers_traceparent_and_arrival_are_on_the_trace() -> None:
    async with serving() as (client, engine, _):
        r = await client.post("/generate", json=native("tp", return_trace=True), headers={"traceparent": TRACEPARENT})
        trace = r.json()["meta_info"]["trace"]
        assert trace["traceparent"] == TRACEPARENT
        assert [e["event"] for e in trace["events"]][:3] == ["arrival", "tokenized", "queued"]
        assert engine.scheduler.traces.get("tp") is not None


async def _call_then_disconnect(client_app: ASGIApp, path: str, body: dict[str, Any], engine: Engine, rid: str) -> list[Message]:
    """Drive the ASGI app by hand: send `body`, then report the client gone as soon as
    `rid` has its first token. Returns what the app sent."""
    sent: list[Message] = []
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        while True:
            trace = engine.get_trace(rid)
            if trace is not None and any(e["event"] == "first_token" for e in trace["events"]):
                return {"type": "http.disconnect"}
            await asyncio.sleep(0.001)

    async def send(message: Message) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"authorization", AUTH["Authorization"].encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("app", 80)}
    await client_app(scope, receive, send)
    return sent


async def test_a_client_that_disconnects_is_on_the_trace() -> None:
    async with serving() as (client, engine, _):
        app = APPS[id(engine)]
        for rid, stream in (("gone-json", False), ("gone-sse", True)):
            await _call_then_disconnect(app, "/generate", native(rid, max_new=3000, stream=stream), engine, rid)
            assert await asyncio.to_thread(engine.wait_idle, 30)
            trace = engine.get_trace(rid)
            assert trace is not None and trace["finish_reason"] == "abort", trace
            whys = [e["why"] for e in trace["events"] if e["event"] == "abort_requested"]
            assert whys[0] == "client_disconnected", whys
            assert 0 < trace["output_tokens"] < 3000


async def test_the_dashboard_page_is_open_and_its_data_is_not() -> None:
    async with serving() as (client, _, _):
        for path, kind in (("/dashboard", "text/html"), ("/dashboard/dashboard.js", "text/javascript"),
                           ("/dashboard/dashboard.css", "text/css")):
            r = await client.get(path, headers={"Authorization": ""})
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind), path
        for path in STATIC:  # nothing from a CDN: the only URL is SVG's namespace
            text = (await client.get(path)).text
            assert set(re.findall(r"https?://[^\"' )]+", text)) <= {"http://www.w3.org/2000/svg"}, path
        assert (await client.get("/dashboard/events", headers={"Authorization": ""})).status_code == 401


async def test_the_dashboard_snapshot_is_the_engines_state() -> None:
    async with serving() as (client, engine, state):
        for i in range(3):
            assert (await client.post("/generate", json=native(f"d{i}", stream=True))).status_code == 200
        assert await asyncio.to_thread(engine.wait_idle, 30)
        snap = snapshot(state, Rates())
        assert snap["server"] == engine.get_server_info()
        latency = snap["latency"]
        assert isinstance(latency, dict) and latency["ttft"]["count"] == 3 and latency["itl"]["count"] > 0
        requests = snap["requests"]
        assert isinstance(requests, list) and [r["rid"] for r in requests[:3]] == ["d2", "d1", "d0"]
