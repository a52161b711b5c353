"""GrammarBackend (compile + cache) and Grammar (one request's matcher)."""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

GrammarKey = tuple[str, str]  # (kind, text): kind is json_schema | regex | ebnf


class InvalidGrammar(ValueError):
    """A constraint that does not compile; the request gets a 400."""


class GrammarBackend:
    """Compiles constraints on a small thread pool, one compilation per distinct key
    (the cache keeps the future, so concurrent requests with one schema share it)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_threads: int = 2) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._max_threads = max_threads
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="sluice-grammar")
        self._cache: dict[GrammarKey, Future[xgrammar.CompiledGrammar]] = {}
        self._lock = threading.Lock()
        # Built by the first compilation, on the pool (importing xgrammar and reading the
        # vocabulary take a few hundred ms that neither start-up nor the loop should pay).
        self._compiler: xgrammar.GrammarCompiler | None = None
        self.stop_token_ids: tuple[int, ...] = ()

    def _ensure_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size)
                self.stop_token_ids = tuple(info.stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=self._max_threads)
            return self._compiler

    def compile(self, key: GrammarKey) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar of `key` (done at once on a cache hit). A failure is an
        InvalidGrammar in the future; failures are not cached."""
        with self._lock:
            fut = self._cache.get(key)
            if fut is None or (fut.done() and fut.exception() is not None):
                fut = self._cache[key] = self._pool.submit(self._compile, key)
            return fut

    def _compile(self, key: GrammarKey) -> xgrammar.CompiledGrammar:
        kind, text = key
        compiler = self._ensure_compiler()
        try:
            if kind == "json_schema":
                # Compact JSON: no free whitespace between tokens, so a small model cannot
                # wander off into endless blanks.
                return compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "ebnf":
                return compiler.compile_grammar(text)
        except Exception as exc:  # noqa: BLE001 - whatever xgrammar refuses is the input's fault
            raise InvalidGrammar(f"invalid {kind}: {_first_line(exc)}") from exc
        raise InvalidGrammar(f"unknown constraint kind {kind!r}")

    def matcher(self, compiled: xgrammar.CompiledGrammar) -> Grammar:
        import xgrammar

        return Grammar(xgrammar.GrammarMatcher(compiled))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Grammar:
    """One request's matcher. Used by the worker thread only, in forward order; other
    threads queue changes with `accept_later` / `rollback_later` (deque: thread-safe)."""

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self.matcher = matcher
        self._pending: collections.deque[tuple[str, int]] = collections.deque()

    def accept_later(self, token: int) -> None:
        self._pending.append(("accept", token))

    def rollback_later(self, n: int = 1) -> None:
        self._pending.append(("rollback", n))

    def _catch_up(self) -> None:
        while self._pending:
            op, n = self._pending.popleft()
            if op == "accept":
                self.matcher.accept_token(n)
            else:
                self.matcher.rollback(n)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Worker thread: write the allowed next tokens into `bitmask[row]`. A terminated
        grammar (its request ended; overlap runs it one step past) allows anything:
        that step's token is dropped."""
        self._catch_up()
        if self.matcher.is_terminated():
            bitmask[row].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        """Worker thread: advance past the token just sampled under this mask."""
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token)


def _first_line(exc: BaseException) -> str:
    # xgrammar's messages start with a "[time] file.cc:line: " prefix; keep what follows.
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    head, sep, tail = text.partition(": ")
    return tail if sep and ".cc:" in head else text
