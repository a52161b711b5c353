"""Startup and shutdown of the engine inside the app's lifespan.

Startup returns at once so hypercorn binds and answers /health with 503 while the
model loads in a worker thread; the scheduler is then started on the server's own
loop (`await engine.start()`), one token is generated as a warm-up, and only then
does the state turn READY and the ready line get logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import structlog
from starlette.applications import Starlette

from app.state import AppState, Phase
from app.tokens import TokenizerService
from config import EngineSettings
from runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtime import Engine

log = structlog.get_logger("sluice.app")

EngineFactory = Callable[[EngineSettings], "Engine"]
READY_MESSAGE = "The server is fired up and ready to roll!"
# After the engine fails, /health answers 503 this long before the process exits
# non-zero, so probes and waiting clients see why rather than a refused connection.
FAILED_EXIT_DELAY_S = 2.0


def default_engine_factory(settings: EngineSettings) -> Engine:
    from runtime import Engine

    return Engine(settings)


async def _warm_up(state: AppState) -> None:
    engine = state.ready_engine()
    if engine.settings.is_embedding:
        await engine.async_encode([0])
        return
    await engine.async_generate([0], SamplingParams(max_new_tokens=1, temperature=0.0), bootstrap=engine.self_check_bootstrap())


async def _wait_listening(address: tuple[str, int], timeout: float = 30.0) -> None:
    """Bounded poll until the listening socket accepts (hypercorn listens after startup)."""
    host, port = address
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return


def url_of(address: tuple[str, int]) -> str:
    host, port = address
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def start_engine(state: AppState, factory: EngineFactory) -> None:
    try:
        log.info("loading model", model_path=state.engine_settings.model_path or "<embedded default>")
        engine = await asyncio.to_thread(factory, state.engine_settings)
        await engine.start()
        loop = asyncio.get_running_loop()
        engine.add_fatal_listener(lambda reason: loop.call_soon_threadsafe(engine_failed, state, reason))
        # Deterministic inference keys an earlier answer's KV by its role: a chat's next turn
        # says where its assistant messages are, to reuse it (runtime/token_roles.py).
        state.attach(engine, TokenizerService(engine.tokenizer, mark_answers=engine.settings.enable_deterministic_inference))
        await _warm_up(state)
        if state.bound is not None:  # a serving process (not an app in a test's process): one engine for its life
            from runtime.engine_setup import freeze_startup_heap

            freeze_startup_heap("server")
            await _wait_listening(state.bound)
        if state.phase is Phase.STARTING:
            state.phase = Phase.READY
        url = url_of(state.bound) if state.bound is not None else None
        log.info(READY_MESSAGE, url=url, model=state.model_name, context_len=state.context_len)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        log.error("engine failed to start", exc_info=exc)
        if state.on_fatal is not None:
            state.on_fatal(exc)
        raise


def engine_failed(state: AppState, reason: str) -> None:
    """On the loop: the engine can no longer serve. Refuse new work, end what runs,
    then exit non-zero (state.on_fatal) after FAILED_EXIT_DELAY_S."""
    if state.phase is Phase.FAILED:
        return
    state.phase, state.failure = Phase.FAILED, reason
    log.error("engine failed; the server will exit", reason=reason)
    if state.engine is not None:
        state.engine.abort_all()

    async def exit_later() -> None:
        await asyncio.sleep(FAILED_EXIT_DELAY_S)
        if state.on_fatal is not None:
            state.on_fatal(RuntimeError(reason))

    asyncio.get_running_loop().create_task(exit_later(), name="sluice-exit-after-failure")


def make_lifespan(factory: EngineFactory) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state: AppState = app.state.sluice
        loader = asyncio.create_task(start_engine(state, factory), name="sluice-engine-start")
        try:
            yield
        finally:
            loader.cancel()
            with contextlib.suppress(BaseException):
                await loader
            if state.engine is not None:
                state.engine.shutdown()
            if state.tokens is not None:
                state.tokens.shutdown()
            log.info("engine stopped")

    return lifespan


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket before loading anything, so a busy port fails fast."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(address)
    return sock
