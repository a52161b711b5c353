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
"""

from __future__ import annotations

import enum
import threading
import time

import torch

from runtime.distributed.parallel_state import broadcast_from_rank0, get_tp_device, tensor_model_parallel_all_reduce
from runtime.model_executor.forward_batch import ForwardMode
from runtime.model_executor.worker import ForwardInputs

HEADER_LEN = 6  # command, forward_mode, bs, T, S, payload length


class Command(enum.IntEnum):
    FORWARD = 1
    HEARTBEAT = 2  # no forward: a one-element all-reduce that every rank must join
    SHUTDOWN = 3


def encode(inputs: ForwardInputs, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bs, syncs = len(inputs.req_pool_indices), inputs.row_syncs
    has_prefix = [0 if s is None else 1 for s in inputs.prefix_slots]
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


def heartbeat_reply() -> None:
    """Every rank's half of a heartbeat: an all-reduce that completes only if all answer."""
    tensor_model_parallel_all_reduce(torch.ones(1, device=get_tp_device()))


def receive() -> ForwardInputs | Command:
    """A non-zero rank's end: the next forward's inputs, or a command."""
    device = get_tp_device()
    header = broadcast_from_rank0(torch.empty(HEADER_LEN, dtype=torch.int64, device=device)).cpu()
    command = Command(int(header[0]))
    if command is not Command.FORWARD:
        return command
    payload = broadcast_from_rank0(torch.empty(int(header[5]), dtype=torch.int64, device=device)).cpu()
    return decode(header, payload)
