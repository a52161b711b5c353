"""Run the app on hypercorn + uvloop with SGLang-style graceful shutdown.

SIGTERM/SIGINT: the state turns DRAINING (/health and new generation requests get
503), in-flight requests finish for up to `graceful_shutdown_timeout` seconds (then
the rest are aborted), hypercorn stops, the lifespan shuts the engine down, and the
process exits 0. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import structlog
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config

from app.factory import create_app
from app.lifecycle import EngineFactory, bind_socket, default_engine_factory
from app.state import AppState, Phase
from config import EngineSettings, ServerSettings

log = structlog.get_logger("sluice.app")

# After the drain, connections still open are idle keep-alives; close them quickly.
CONNECTION_CLOSE_TIMEOUT = 3.0


async def serve(
    engine_settings: EngineSettings,
    server_settings: ServerSettings,
    engine_factory: EngineFactory = default_engine_factory,
) -> int:
    """Serve until a signal (exit code 0) or until the engine fails to start (1)."""
    sock = bind_socket(server_settings.host, server_settings.port)
    state = AppState(server_settings, engine_settings)
    host, port = sock.getsockname()[:2]
    state.bound = (host, port)
    app = create_app(state, engine_factory)

    config = Config()
    config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns the bound socket from here
    config.graceful_timeout = CONNECTION_CLOSE_TIMEOUT
    # Hypercorn logs through stdlib loggers that propagate to the one configured handler.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.accesslog = logging.getLogger("hypercorn.access") if server_settings.log_level == "debug" else None
    config.keep_alive_timeout = 75.0

    stop = asyncio.Event()
    exit_code = 0
    drain_task: asyncio.Task[None] | None = None

    async def drain() -> None:
        timeout = server_settings.graceful_shutdown_timeout
        log.info("draining in-flight requests", inflight=state.inflight, timeout=timeout)
        if not await state.wait_idle(timeout):
            log.warning("graceful shutdown timed out; aborting the rest", inflight=state.inflight)
            if state.engine is not None:
                state.engine.abort_all()
            await state.wait_idle(CONNECTION_CLOSE_TIMEOUT)
        stop.set()

    def on_signal(signum: int) -> None:
        nonlocal drain_task
        if drain_task is not None:
            log.warning("second signal: stopping now", signal=signal.Signals(signum).name)
            stop.set()
            return
        log.info("shutdown requested", signal=signal.Signals(signum).name)
        state.phase = Phase.DRAINING
        drain_task = asyncio.create_task(drain(), name="sluice-drain")

    def on_fatal(exc: BaseException) -> None:
        nonlocal exit_code
        exit_code = 1
        stop.set()

    state.on_fatal = on_fatal
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await hypercorn_serve(app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        if drain_task is not None and not drain_task.done():
            drain_task.cancel()
    log.info("server stopped", exit_code=exit_code)
    return exit_code


def run(engine_settings: EngineSettings, server_settings: ServerSettings) -> int:
    """Blocking entry point: one uvloop event loop for HTTP, scheduler and worker."""
    if sys.platform != "win32":
        import uvloop

        return uvloop.run(serve(engine_settings, server_settings))
    return asyncio.run(serve(engine_settings, server_settings))
