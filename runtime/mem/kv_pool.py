"""The per-layer KV pool: K and V tensors indexed by KV slot."""

from __future__ import annotations

import math
import mmap

import torch

from runtime.mem.kv_prefault import KVPrefaulter


_HUGE_PAGE = 2 << 20


def _untouched_zeros(shape: tuple[int, int, int], dtype: torch.dtype, phase: int = 0) -> torch.Tensor:
    """A zero tensor whose pages the OS maps on first touch (an anonymous mapping), in 2 MB
    pages where the kernel's transparent huge pages allow it (MADV_HUGEPAGE; Linux's
    default THP mode is "madvise"). A request's KV lands on slots nobody has touched until
    the pool has been used once around (the radix cache keeps finished requests' KV), and
    each 4 KB page of them cost a fault on the worker thread: 0.8-1.4 s a GiB on a KVM
    guest, a served 16-row decode step's KV write 1.15 ms instead of ~0.4; 2 MB pages:
    0.05-0.06 s a GiB (bench/RESULTS.md item 40), but 3-6 ms a page where the host has
    not backed the guest's memory yet (item 41).

    The tensor starts `phase` bytes past a huge-page boundary: buffers of different phases
    cross into their next huge page at different slots, so a decode step that reaches
    fresh slots faults one or two pages, not one per buffer (60 at once for SmolLM2:
    a 200-420 ms step)."""
    assert 0 <= phase < _HUGE_PAGE
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, nbytes + 2 * _HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # zero-filled; the tensor keeps it alive
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled or unsupported: 4 KB pages
            pass
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE + phase  # a huge-page boundary, then the phase
    return raw[start : start + nbytes].view(dtype).view(shape)


class KVPool:
    """`k_buffer[layer][slot]` is one token's keys, `[num_kv_heads, head_dim]`.

    Slot 0 is never handed out by the allocator: padded positions (CUDA-graph
    padding, idle rows) write there harmlessly.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (size + 1, num_kv_heads, head_dim)
        # Zeros (padding reads slot 0 and a page's unwritten tail; garbage there would
        # be NaN * 0 = NaN). On CPU they come from an anonymous mapping, fresh zero pages
        # mapped without touching them: torch.zeros memsets, which took 8.5 s of a 12 s
        # start for the default 4 GiB pool.
        if torch.device(device).type == "cpu":
            # Buffer b's phase is b/(2L) of a huge page (4 KB-aligned): their fresh-page
            # faults spread evenly over the slots instead of all landing on one step.
            phases = [(b * _HUGE_PAGE // (2 * num_layers)) & ~4095 for b in range(2 * num_layers)]
            self.k_buffer = [_untouched_zeros(shape, dtype, phases[2 * i]) for i in range(num_layers)]
            self.v_buffer = [_untouched_zeros(shape, dtype, phases[2 * i + 1]) for i in range(num_layers)]
            self.prefaulter: KVPrefaulter | None = KVPrefaulter(self)
        else:
            self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.prefaulter = None

    def buffer_spans(self) -> list[tuple[int, int]]:
        """(start address, bytes per slot) of every buffer, in slot-major fault order."""
        return [(b.data_ptr(), b.stride(0) * b.element_size()) for pair in zip(self.k_buffer, self.v_buffer) for b in pair]

    def note_written(self, loc: torch.Tensor) -> None:
        """A forward is about to write KV at `loc` (host slots): map the pages past it early."""
        if self.prefaulter is not None and loc.numel():
            self.prefaulter.note_written(int(loc.max()))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]
