"""TokenToKVPoolAllocator: the free list of KV slots, handed out in pages."""

from __future__ import annotations

import torch


class TokenToKVPoolAllocator:
    """Slots are `page * page_size + offset` for pages 1..num_pages (page 0 is the
    dummy page that padding writes to). A page is owned by one holder at a time: a
    request's tail, or one radix-tree node, so `free` returns whole pages.
    """

    def __init__(self, size: int, page_size: int) -> None:
        assert size % page_size == 0, "KV pool size must be a multiple of page_size"
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self._released: list[torch.Tensor] = []

    def available_size(self) -> int:
        self._merge()
        assert self.free_pages.numel() <= self.num_pages, "KV slot freed twice"
        return int(self.free_pages.numel()) * self.page_size

    def _merge(self) -> None:
        # Released pages go to the front: they held KV, so their memory is mapped and
        # warm, while the never-used tail of the pool faults on first touch (a huge
        # page of fresh guest memory cost 3-6 ms to map on a KVM guest, bench/RESULTS.md item 41).
        # Invariant: pages never handed out stay an ascending run at the back.
        if self._released:
            self.free_pages = torch.cat([*reversed(self._released), self.free_pages])
            self._released = []

    def _take_pages(self, n: int) -> torch.Tensor | None:
        self._merge()
        if n > self.free_pages.numel():
            return None
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return pages

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Fresh slots starting on a page boundary (whole pages are taken)."""
        p = self.page_size
        pages = self._take_pages(-(-num_tokens // p))
        if pages is None or p == 1:  # page_size 1: a page is a slot
            return pages
        slots = (pages[:, None] * p + torch.arange(p)).flatten()
        return slots[:num_tokens]

    def alloc_extend(self, prefix_lens: list[int], extend_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """Slots for each request's new tokens, continuing its partly filled last page.

        `last_locs[i]` is the slot of the request's token at position prefix_lens[i]-1
        (ignored when that position is page-aligned).
        """
        p = self.page_size
        if p == 1:
            return self.alloc(sum(extend_lens))
        need_pages = 0
        for prefix, n in zip(prefix_lens, extend_lens):
            in_tail = min(n, (-prefix) % p)
            need_pages += -(-(n - in_tail) // p)
        pages = self._take_pages(need_pages)
        if pages is None:
            return None
        out, used = [], 0
        for prefix, n, last in zip(prefix_lens, extend_lens, last_locs):
            in_tail = min(n, (-prefix) % p)
            if in_tail:
                out.append(torch.arange(last + 1, last + 1 + in_tail))
            k = -(-(n - in_tail) // p)
            if k:
                fresh = (pages[used : used + k, None] * p + torch.arange(p)).flatten()[: n - in_tail]
                out.append(fresh)
                used += k
        return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """One slot per request for the token at position seq_lens[i]-1."""
        p = self.page_size
        if p == 1:
            return self.alloc(len(seq_lens))
        return self.alloc_extend([s - 1 for s in seq_lens], [1] * len(seq_lens), last_locs)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        pages = slots // self.page_size if self.page_size > 1 else slots
        if self.page_size > 1:
            pages = torch.unique(pages)
        self._released.append(pages.to(torch.int64))
