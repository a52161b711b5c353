"""AppState: what every route shares (engine, tokenizer, metrics, lifecycle, admission).

Lifecycle: STARTING (engine loading; generation routes and /health answer 503) ->
READY -> DRAINING (SIGTERM: /health and new generation requests answer 503 while
in-flight ones finish). Only the event loop touches this object.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from app.errors import APIError
from app.metrics import Metrics
from config import EngineSettings, ServerSettings

if TYPE_CHECKING:
    from app.tokens import TokenizerService
    from runtime import Engine

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class RunningGroup(Protocol):
    """What the state needs of a launched GenerationGroup (app.generation imports this
    module, so the state names the group by what it does)."""

    def abort(self) -> None: ...


class Phase(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"  # the engine can no longer serve (a tensor-parallel rank died); exiting


class Ticket:
    """One admitted generation request; `release` is idempotent."""

    __slots__ = ("_state", "_held")

    def __init__(self, state: AppState) -> None:
        self._state = state
        self._held = True
        state.inflight += 1
        state.idle.clear()

    def release(self) -> None:
        if self._held:
            self._held = False
            self._state.inflight -= 1
            if self._state.inflight == 0:
                self._state.idle.set()


@dataclass(eq=False)
class AppState:
    server: ServerSettings
    engine_settings: EngineSettings
    engine: Engine | None = None
    tokens: TokenizerService | None = None
    phase: Phase = Phase.STARTING
    # Admitted generation requests whose response has not ended; `idle` is set iff 0.
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    # Engine requests launched by the app that have produced no output yet: a request
    # counts as queued from admission to its first chunk (the engine's own waiting
    # count lags behind requests it has not yet picked up).
    not_started: int = 0
    groups: dict[str, RunningGroup] = field(default_factory=dict)
    rids: set[str] = field(default_factory=set)
    context_limit: int = 0  # set by attach()
    bound: tuple[str, int] | None = None  # listening address, when served over a socket
    on_fatal: Callable[[BaseException], None] | None = None  # the engine failed (to start, or later)
    failure: str | None = None  # why, once phase is FAILED
    metrics: Metrics = field(init=False)

    def __post_init__(self) -> None:
        self.idle.set()
        self.metrics = Metrics(self.server_info_or_none, lambda: self.model_name)

    @property
    def model_name(self) -> str:
        return self.server.served_model_name or self.engine_settings.model_path or DEFAULT_MODEL_NAME

    @property
    def architecture(self) -> str:
        """The model's architecture (picks the tool-call parser of its chat format)."""
        return str(getattr(self.ready_engine().model_config, "architecture", ""))

    @property
    def context_len(self) -> int:
        """The most tokens (prompt + completion) one request can use: the model's context,
        or less when the KV pool is smaller (the engine rejects anything larger)."""
        self.ready_engine()
        return self.context_limit

    def attach(self, engine: Engine, tokens: TokenizerService) -> None:
        """Make a started engine serve requests (still STARTING until warmed up)."""
        limit = int(engine.model_config.context_len)
        kv_tokens = engine.get_server_info().get("max_total_num_tokens")
        if isinstance(kv_tokens, int):
            limit = min(limit, kv_tokens - int(engine.settings.page_size))
        self.context_limit = limit
        self.tokens = tokens
        self.engine = engine

    def server_info_or_none(self) -> dict[str, Any] | None:
        return self.engine.get_server_info() if self.engine is not None else None

    def ready_engine(self) -> Engine:
        """The engine, or 503 while it loads."""
        if self.engine is None or self.tokens is None:
            raise APIError(503, "The server is starting; the model is not loaded yet.", code="server_starting")
        return self.engine

    def tokenizer(self) -> TokenizerService:
        self.ready_engine()
        assert self.tokens is not None
        return self.tokens

    def admit(self) -> Ticket:
        """Admit a generation request, or 503 if draining or the queue is full."""
        engine = self.ready_engine()
        if self.phase is Phase.STARTING:
            raise APIError(503, "The server is starting; the model is warming up.", code="server_starting")
        if self.phase is Phase.DRAINING:
            raise APIError(503, "The server is shutting down.", code="server_shutting_down")
        if self.phase is Phase.FAILED:
            raise APIError(503, f"The engine failed: {self.failure}", code="engine_failed")
        limit = self.server.max_queued_requests
        if limit is not None and max(engine.num_waiting_reqs, self.not_started) >= limit:
            raise APIError(
                503, f"Too many queued requests (limit {limit}); retry later.", code="queue_full",
                headers={"Retry-After": "1"},
            )
        return Ticket(self)

    async def wait_idle(self, timeout: float) -> bool:
        """True if every admitted request ended within `timeout` seconds."""
        try:
            await asyncio.wait_for(self.idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
