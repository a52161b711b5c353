"""Tensor-parallel processes: rank 0 (the server process) and the worker ranks.

Rank 0 runs HTTP, the scheduler and its own shard; every other rank runs
`worker_main`: build its shard, then run each forward rank 0 broadcasts
(runtime/model_executor/tp_channel.py) until told to stop, and hand each side
message (a prefill/decode server's KV transfer order) to this rank's transfer agent
(runtime/disaggregation/rank_agent.py). Ranks rendezvous over torch.distributed at
`init_method` (gloo on CPU, NCCL on CUDA).

Failure: a worker that exits is seen by the watchdog within WATCHDOG_INTERVAL_S;
one that hangs makes rank 0's next collective time out after `dist_timeout`. An
idle server runs a heartbeat (a header plus a one-element all-reduce, which needs
every rank) every dist_timeout / 4, so a hang is found even with no traffic, and
the workers' wait for the next command never times out. Either way `on_failure`
fires once; the engine then turns unhealthy and the server exits non-zero.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
from collections.abc import Callable
from multiprocessing.process import BaseProcess

import structlog

from config.settings import EngineSettings

log = structlog.get_logger("sluice.tp")

WATCHDOG_INTERVAL_S = 0.2
JOIN_TIMEOUT_S = 10.0


def ranks_per_node(settings: EngineSettings) -> int:
    return settings.tp_size // settings.nnodes


def local_ranks(settings: EngineSettings) -> range:
    n = ranks_per_node(settings)
    return range(settings.node_rank * n, (settings.node_rank + 1) * n)


def init_method(settings: EngineSettings) -> str:
    """`tcp://HOST:PORT` of the rendezvous: dist_init_addr, or a free loopback port."""
    if settings.dist_init_addr:
        return f"tcp://{settings.dist_init_addr}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def worker_main(rank: int, settings: EngineSettings, method: str) -> None:
    """Entry point of a worker rank (forked or spawned, rank_context). Exits 0 on SHUTDOWN, 1 on any failure."""
    from runtime import engine_setup
    from runtime.distributed.parallel_state import destroy_tensor_parallel
    from runtime.model_executor.tp_channel import Command, SideMessage, heartbeat_reply, receive

    logging.basicConfig(level=logging.INFO, format=f"[tp{rank}] %(message)s")
    agent = None  # this rank's KV transfer agent (prefill/decode disaggregation), at its first order
    try:
        shard = engine_setup.build_shard(settings, rank, method)
        runner = shard.runner
        engine_setup.freeze_startup_heap(f"tp-rank-{rank}")
        log.info("tensor-parallel worker ready", rank=rank, pid=os.getpid())
        while True:
            item = receive()
            if item is Command.SHUTDOWN:
                break
            if item is Command.HEARTBEAT:
                heartbeat_reply()
            elif isinstance(item, SideMessage):  # handed over: this loop never waits on the network
                if agent is None:
                    from runtime.disaggregation.rank_agent import RankAgent

                    agent = RankAgent(rank, shard.settings, runner.kv_buffers())
                agent.post(item)
            elif not isinstance(item, Command):
                runner.forward_shard(item)
    except BaseException as exc:  # noqa: BLE001 - any failure ends this rank, visibly
        log.error("tensor-parallel worker failed", rank=rank, error=repr(exc))
        os._exit(1)  # skip atexit: the process group may be wedged
    if agent is not None:
        agent.close()
    destroy_tensor_parallel()
    # Nothing is left to tear down: skip the interpreter's finalization, where the C++
    # libraries' static destructors can race the threads they started (a rank of the
    # two-node test aborted there, "terminate called without an active exception", in
    # 2 of 4 CI runs, after its orderly SHUTDOWN).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# What a CPU worker rank imports before it builds its shard (torch, transformers, the model
# code): ~4 s on a 2-core Zen 1. A forkserver imports it once per process and forks each
# rank from there, so a process that builds tensor-parallel engines one after another (an
# offline Engine, the test suite) pays it once. With CUDA the ranks are spawned: nothing
# that may have touched the driver is forked.
RANK_PRELOAD = ["runtime.engine_setup", "runtime.model_executor.tp_channel", "runtime.distributed.parallel_state"]


def rank_context(settings: EngineSettings) -> mp.context.BaseContext:
    """A forkserver that has imported RANK_PRELOAD for CPU ranks on Linux; else spawn."""
    import torch

    cpu = settings.device == "cpu" or (settings.device == "auto" and not torch.cuda.is_available())
    if not cpu or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


class TPGroup:
    """The worker ranks this node runs: processes, watchdog, heartbeat."""

    def __init__(self, settings: EngineSettings, method: str, ranks: list[int]) -> None:
        self.settings = settings
        self.method = method
        self.ranks = ranks
        self.procs: dict[int, BaseProcess] = {}
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        ctx = rank_context(self.settings)
        for rank in self.ranks:
            proc = ctx.Process(target=worker_main, args=(rank, self.settings, self.method), name=f"sluice-tp{rank}", daemon=True)
            proc.start()
            self.procs[rank] = proc
        self._spawn_thread(self._watch, "sluice-tp-watchdog")

    def _spawn_thread(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def start_heartbeat(self, beat: Callable[[], None]) -> None:
        """Rank 0 only: call `beat` (which runs a heartbeat when the group is idle)
        every dist_timeout / 4 seconds."""

        def loop() -> None:
            while not self._stop.wait(self.settings.dist_timeout / 4):
                try:
                    beat()
                except Exception as exc:  # noqa: BLE001 - a failed collective is a dead group
                    self.fail(f"tensor-parallel heartbeat failed: {exc}")
                    return

        self._spawn_thread(loop, "sluice-tp-heartbeat")

    def _watch(self) -> None:
        while not self._stop.wait(WATCHDOG_INTERVAL_S):
            for rank, proc in self.procs.items():
                if not proc.is_alive() and not self._stop.is_set():
                    self.fail(f"tensor-parallel rank {rank} exited with code {proc.exitcode}")
                    return

    def fail(self, reason: str) -> None:
        """Record the group's first failure and tell the engine (from any thread)."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        log.error("tensor-parallel group failed", reason=reason)
        if self.on_failure is not None:
            self.on_failure(reason)

    def stop_watching(self) -> None:
        """Before an orderly shutdown: workers about to exit are not a failure."""
        self._stop.set()

    def wait(self) -> int:
        """Workers-only node: block until every local rank has exited; the worst exit code."""
        for proc in self.procs.values():
            proc.join()
        self._stop.set()
        return max((proc.exitcode or 0) for proc in self.procs.values()) if self.procs else 0

    def close(self) -> None:
        """Stop the threads and reap the processes. After an orderly SHUTDOWN they exit
        by themselves; after a failure they are killed (a hung rank may be stopped,
        and SIGTERM does not reach a stopped process)."""
        self._stop.set()
        for proc in self.procs.values():
            if self.failure is None:
                proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_TIMEOUT_S)


def run_worker_node(settings: EngineSettings) -> int:
    """`sluice serve --node-rank N` (N > 0): run this node's ranks, no HTTP. Returns
    when they exit (rank 0 shut the group down, or it failed): the worst exit code."""
    ranks = list(local_ranks(settings))
    log.info("tensor-parallel worker node", node_rank=settings.node_rank, ranks=ranks, init=settings.dist_init_addr)
    group = TPGroup(settings, init_method(settings), ranks)
    group.start()
    group.stop_watching()  # here the ranks' own exit codes are the outcome
    return group.wait()
