"""BatchChannel: rank 0 hands each forward's inputs to the other tensor-parallel ranks.

One step costs two broadcasts over the TP group: a fixed header of HEADER_LEN int64
(the command and the lengths), then one flat int64 payload holding every list of
the ForwardInputs back to back. No pickling, no per-request objects. Rank 0 sends
from its worker thread after resolving future token ids, so the other ranks see
real ids; forwards run in the same order on every rank because each rank's
collectives pair with rank 0's.

Payload layout (bs requests, T new tokens, S row syncs):
  input_ids[T] out_cache_loc[T] req_pool_indices[bs] seq_lens[bs]
  extend_prefix_lens[bs] extend_seq_lens[bs] has_prefix_slots[bs]
  prefix_slots[sum of extend_prefix_lens over rows with has_prefix_slots]
  sync_rows[S] sync_lens[S] sync_slots[sum sync_lens]
  prompt_logprob_rows[the rest]

Side messages (Command.SIDE) carry what is not a forward: prefill/decode
disaggregation's KV transfer orders (runtime/disaggregation/ranks.py). Header
[SIDE, 0, 0, n_slots, json_len, payload length]; payload: the slots, then the
orjson header's bytes packed into int64 words. Rank 0 broadcasts them from their
own thread under `step_lock`, so they fall between two steps in the same order
on every rank; a worker rank hands them to its transfer agent and returns to its
step loop at once.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import torch

from runtime.distributed.parallel_state import broadcast_from_rank0, get_tp_device, tensor_model_parallel_all_reduce
from runtime.model_executor.forward_batch import ForwardMode
from runtime.model_executor.worker import ForwardInputs

HEADER_LEN = 6  # command, forward_mode, bs, T, S, payload length


class Command(enum.IntEnum):
    FORWARD = 1
    HEARTBEAT = 2  # no forward: a one-element all-reduce that every rank must join
    SHUTDOWN = 3
    SIDE = 4  # a side message between two steps (SideMessage)


@dataclass(frozen=True, slots=True)
class SideMessage:
    header: dict[str, Any]  # orjson-serialisable
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))  # int64, CPU


def encode_side(message: SideMessage) -> tuple[torch.Tensor, torch.Tensor]:
    raw = orjson.dumps(message.header)
    words = torch.frombuffer(bytearray(raw + bytes(-len(raw) % 8)), dtype=torch.int64)
    payload = torch.cat([message.slots.to("cpu", torch.int64).reshape(-1), words])
    return torch.tensor([Command.SIDE, 0, 0, message.slots.numel(), len(raw), payload.numel()], dtype=torch.int64), payload


def decode_side(header: torch.Tensor, payload: torch.Tensor) -> SideMessage:
    _, _, _, n, json_len, _ = header.tolist()
    raw = payload[n:].numpy().tobytes()[:json_len]
    return SideMessage(orjson.loads(raw), payload[:n].clone())


def encode(inputs: ForwardInputs, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bs, syncs = len(inputs.req_pool_indices), inputs.row_syncs
    has_prefix = [0 if s is None else 1 for s in inputs.prefix_slots]
    switches = inputs.role_switches or [()] * bs
    i64 = torch.int64
    parts = [
        input_ids.to("cpu", i64),
        inputs.out_cache_loc.to(i64),
        torch.tensor(inputs.req_pool_indices, dtype=i64),
        torch.tensor(inputs.seq_lens, dtype=i64),
        torch.tensor(inputs.extend_prefix_lens, dtype=i64),
        torch.tensor(inputs.extend_seq_lens, dtype=i64),
        torch.tensor(has_prefix, dtype=i64),
        *(s.to(i64) for s in inputs.prefix_slots if s is not None),
        torch.tensor([row for row, _ in syncs], dtype=i64),
        torch.tensor([slots.numel() for _, slots in syncs], dtype=i64),
        *(slots.to(i64) for _, slots in syncs),
        torch.tensor([len(s) for s in switches], dtype=i64),
        torch.tensor([x for s in switches for x in s], dtype=i64),
        torch.tensor(inputs.prompt_logprob_rows, dtype=i64),
    ]
    payload = torch.cat(parts)
    header = torch.tensor([Command.FORWARD, inputs.forward_mode, bs, input_ids.numel(), len(syncs), payload.numel()], dtype=i64)
    return header, payload


def decode(header: torch.Tensor, payload: torch.Tensor) -> ForwardInputs:
    _, mode, bs, t, s, _ = header.tolist()
    pos = 0

    def take(n: int) -> torch.Tensor:
        nonlocal pos
        out = payload[pos : pos + n]
        pos += n
        return out

    input_ids, out_cache_loc = take(t), take(t)
    rows, seq_lens, prefix_lens, extend_lens, has_prefix = (take(bs).tolist() for _ in range(5))
    prefix_slots = [take(p) if h else None for p, h in zip(prefix_lens, has_prefix)]
    sync_rows, sync_lens = take(s).tolist(), take(s).tolist()
    row_syncs = [(row, take(n)) for row, n in zip(sync_rows, sync_lens)]
    role_switches = [tuple(take(n).tolist()) for n in take(bs).tolist()]
    return ForwardInputs(
        forward_mode=ForwardMode(mode),
        input_ids=input_ids,
        out_cache_loc=out_cache_loc,
        req_pool_indices=rows,
        seq_lens=seq_lens,
        extend_prefix_lens=prefix_lens,
        extend_seq_lens=extend_lens,
        prefix_slots=prefix_slots,
        row_syncs=row_syncs,
        prompt_logprob_rows=payload[pos:].tolist(),
        role_switches=role_switches,
    )


class BatchChannel:
    """Rank 0's end.

    Invariant: the collectives of one step (this channel's broadcasts and the
    forward's all-reduces and all-gathers) never interleave with another step's,
    so every rank runs the same sequence of collectives. The forward thread holds
    `step_lock` for a whole forward; the heartbeat thread takes it too.
    """

    def __init__(self) -> None:
        self.step_lock = threading.Lock()
        self._last_step = time.monotonic()
        self.closed = False
        self._side: queue.SimpleQueue[SideMessage | None] = queue.SimpleQueue()
        self._side_thread: threading.Thread | None = None
        self._on_side_failure: Callable[[str], None] | None = None

    def start_side(self, on_failure: Callable[[str], None] | None) -> None:
        """Start the thread that broadcasts side messages (once; `on_failure` as a forward's)."""
        if self._side_thread is None:
            self._on_side_failure = on_failure
            self._side_thread = threading.Thread(target=self._send_side, name="sluice-tp-side", daemon=True)
            self._side_thread.start()

    def post(self, message: SideMessage) -> None:
        """Queue a side message (any thread; never blocks): broadcast between two steps."""
        assert self._side_thread is not None, "start_side first"
        self._side.put(message)

    def _send_side(self) -> None:
        while (message := self._side.get()) is not None:
            header, payload = encode_side(message)
            with self.step_lock:
                if self.closed:
                    return
                try:
                    broadcast_from_rank0(header.to(get_tp_device()))
                    broadcast_from_rank0(payload.to(get_tp_device()))
                except Exception as exc:  # noqa: BLE001 - a failed broadcast is a dead group
                    if self._on_side_failure is not None:
                        self._on_side_failure(f"tensor-parallel side message failed: {exc}")
                    return
                self._last_step = time.monotonic()

    def send(self, inputs: ForwardInputs, input_ids: torch.Tensor) -> None:
        """Under `step_lock`, before this rank's own forward of `inputs`."""
        header, payload = encode(inputs, input_ids)
        broadcast_from_rank0(header.to(get_tp_device()))
        broadcast_from_rank0(payload.to(get_tp_device()))
        self._last_step = time.monotonic()

    def _command(self, command: Command) -> None:
        broadcast_from_rank0(torch.tensor([command, 0, 0, 0, 0, 0], dtype=torch.int64, device=get_tp_device()))

    def heartbeat_if_idle(self, idle_s: float) -> None:
        """A heartbeat when no step ran for `idle_s` (raises if a rank is gone or hung)."""
        with self.step_lock:
            if self.closed or time.monotonic() - self._last_step < idle_s:
                return
            self._command(Command.HEARTBEAT)
            heartbeat_reply()
            self._last_step = time.monotonic()

    def shutdown(self) -> None:
        """Tell the other ranks to exit (once no forward is in flight)."""
        with self.step_lock:
            if not self.closed:
                self.closed = True
                self._command(Command.SHUTDOWN)
        self._side.put(None)


def heartbeat_reply() -> None:
    """Every rank's half of a heartbeat: an all-reduce that completes only if all answer."""
    tensor_model_parallel_all_reduce(torch.ones(1, device=get_tp_device()))


def receive() -> ForwardInputs | SideMessage | Command:
    """A non-zero rank's end: the next forward's inputs, a side message, or a command."""
    device = get_tp_device()
    # (between two commands rank 0 may be idle, or still starting: no bound on this wait)
    header = broadcast_from_rank0(torch.empty(HEADER_LEN, dtype=torch.int64, device=device), wait_forever=True).cpu()
    command = Command(int(header[0]))
    if command not in (Command.FORWARD, Command.SIDE):
        return command
    payload = broadcast_from_rank0(torch.empty(int(header[5]), dtype=torch.int64, device=device)).cpu()
    return decode(header, payload) if command is Command.FORWARD else decode_side(header, payload)
