"""Two real Engines as a prefill/decode pair around StubWorkers, for
tests/test_pd_stub.py and tests/test_pd_stub_tp.py (and any suite that needs a pair).

A test module's `make_pd` fixture is `yield from pd_pairs()` (as conftest's
make_engine is `yield from _engine_factory()`). A pair has the prefill server's
bootstrap port free and both loops started; with `ranks` > 1 each server's ranks 1..
are in-process agents (LoopbackSide) over the same stub KV.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from conftest import assert_all_memory_free
from stub_engine import stub_engine

from runtime.disaggregation.rank_agent import RankAgent
from runtime.engine import Engine
from runtime.managers.io_struct import BootstrapInfo, GenerateOutput
from runtime.model_executor.tp_channel import SideMessage, decode_side, encode_side

_rooms = itertools.count(1 << 40)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PD:
    prefill: Engine
    decode: Engine
    port: int

    def info(self, room: int | None = None) -> BootstrapInfo:
        return BootstrapInfo("127.0.0.1", self.port, next(_rooms) if room is None else room)

    async def pair(self, prompt: list[int], params: dict[str, Any], *, decode_first: bool = False, **kw: Any) -> tuple[GenerateOutput, GenerateOutput]:
        """One request sent to both servers at once, as the router does."""
        info = self.info()
        p = self.prefill.async_generate(prompt, params, bootstrap=info, **kw)
        d = self.decode.async_generate(prompt, params, bootstrap=info, **kw)
        if decode_first:
            d_task = asyncio.ensure_future(d)
            await asyncio.sleep(0.05)
            return await asyncio.gather(p, d_task)
        return await asyncio.gather(p, d)


class LoopbackSide:
    """A TP group's side channel in one process (for `ranks` > 1): each side message
    goes through the wire encoding to the in-process transfer agents of ranks 1.. .
    They share rank 0's stub KV buffer (a replicated head): a rank that wrote the
    wrong slots would change the outputs."""

    def __init__(self, engine: Engine, ranks: int) -> None:
        self.agents = [RankAgent(r, engine.settings, engine.worker.kv_buffers()) for r in range(1, ranks)]

    def start_side(self, on_failure: Any) -> None:
        pass

    def post(self, message: SideMessage) -> None:
        wired = decode_side(*encode_side(message))
        for agent in self.agents:
            agent.post(wired)


def pd_pairs() -> Iterator[Callable[..., PD]]:
    """The body of a `make_pd` fixture: yields a maker of pairs; after the test, every
    slot and row of each server must be free, then both are shut down."""
    made: list[PD] = []

    def make(backend: str = "tcp", prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None, ranks: int = 1, **both: Any) -> PD:
        port = free_port()
        common = {"disaggregation_transfer_backend": backend, "disaggregation_timeout": 5.0, "tp_size": ranks, **both}
        p = stub_engine(disaggregation_mode="prefill", disaggregation_bootstrap_port=port, **{**common, **(prefill or {})})
        d = stub_engine(disaggregation_mode="decode", **{**common, **(decode or {})})
        for engine in (p, d) if ranks > 1 else ():
            engine.worker.tp_channel = LoopbackSide(engine, ranks)  # type: ignore[attr-defined]
        p._ensure_started()
        d._ensure_started()
        made.append(PD(p, d, port))
        return made[-1]

    yield make
    for pd in made:
        for engine in (pd.prefill, pd.decode):
            assert_all_memory_free(engine)
            engine.shutdown()
            for agent in getattr(engine.worker, "tp_channel", LoopbackSide(engine, 1)).agents:
                agent.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def reason(out: GenerateOutput) -> dict[str, Any]:
    r = out["meta_info"]["finish_reason"]
    assert r is not None
    return dict(r)
