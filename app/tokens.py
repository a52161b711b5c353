"""Tokenizer work for the HTTP layer, kept off the event loop.

Encoding, chat templating and bulk decoding run on a small thread pool (HF fast
tokenizers release the GIL), so a long prompt never stalls the scheduler, which
shares the loop. Single-token texts for logprobs are memoised and cheap.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from app.errors import APIError
from runtime.token_roles import Span, TokenPrompt

T = TypeVar("T")


class TokenizerService:
    def __init__(self, tokenizer: Any, max_workers: int = 2, *, mark_answers: bool = False) -> None:
        """`mark_answers`: chat prompts say where their assistant messages are (the engine
        runs deterministic inference, which keys their KV by role: runtime/token_roles.py)."""
        self.tokenizer = tokenizer
        self.mark_answers = mark_answers
        self.vocab_size = len(tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sluice-tokenizer")
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)

    async def _run(self, fn: Callable[..., T], *args: Any, what: str, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template/tokenizer failure is the input's fault
            raise APIError(400, f"Could not {what}: {type(exc).__name__}: {exc}") from exc

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = await self._run(self.tokenizer.encode, text, add_special_tokens=add_special_tokens, what="tokenize the prompt")
        return list(ids)

    async def apply_chat_template(self, messages: list[dict[str, object]], tools: list[dict[str, object]] | None = None) -> str:
        return await self._run(self._render, messages, tools, what="apply the chat template")

    async def chat_prompt(self, messages: list[dict[str, object]], tools: list[dict[str, object]] | None = None) -> TokenPrompt:
        """The templated conversation's token ids (the template holds the special tokens),
        with `mark_answers` the spans of the assistant messages' text."""
        return await self._run(self._chat_prompt, messages, tools, self.mark_answers, what="apply the chat template")

    def _render(self, messages: list[dict[str, object]], tools: list[dict[str, object]] | None) -> str:
        extra = {"tools": tools} if tools else {}  # templates without tool support ignore it
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        if not isinstance(text, str):
            raise APIError(400, "The chat template did not produce text.")
        return text

    def _chat_prompt(self, messages: list[dict[str, object]], tools: list[dict[str, object]] | None, mark_answers: bool) -> TokenPrompt:
        text = self._render(messages, tools)
        if not (mark_answers and getattr(self.tokenizer, "is_fast", False)):  # offsets need a fast tokenizer
            return TokenPrompt(list(self.tokenizer.encode(text, add_special_tokens=False)))
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        answers = self._answer_chars(messages, tools, text)
        return TokenPrompt(list(encoded["input_ids"]), _token_spans(encoded["offset_mapping"], answers))

    def _answer_chars(self, messages: list[dict[str, object]], tools: list[dict[str, object]] | None, text: str) -> list[Span]:
        """Where each assistant message's text lies in `text`: right after the template's
        rendering of the messages before it with a generation prompt (where the model
        began writing it). A template that renders it elsewhere or changed gets no span."""
        spans: list[Span] = []
        for i, message in enumerate(messages):
            content = message.get("content")
            if message.get("role") != "assistant" or not isinstance(content, str) or not content or i == 0:
                continue
            try:
                head = self._render(messages[:i], tools)
            except Exception:  # noqa: BLE001 - a template that cannot end there: no span
                continue
            if text.startswith(content, len(head)) and text.startswith(head):
                spans.append((len(head), len(head) + len(content)))
        return spans

    async def decode(self, ids: list[int]) -> str:
        self.check_ids(ids, "tokens")
        return await self._run(self.tokenizer.decode, ids, what="detokenize")

    def check_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"Token id {bad} is outside the vocabulary (size {self.vocab_size}).", param=param)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if 0 <= token_id < self.vocab_size else ""

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _token_spans(offsets: list[tuple[int, int]], chars: list[Span]) -> tuple[Span, ...]:
    """The runs of tokens with characters inside one of `chars` (sorted spans). A token
    across a span's edge counts: some tokenizers (SentencePiece's) fold the space a
    template puts before an answer into the answer's first token."""
    spans: list[Span] = []
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(chars) and chars[k][1] <= start:
            k += 1
        if k == len(chars):
            break
        if start < end and end > chars[k][0]:
            if spans and spans[-1][1] == i:
                spans[-1] = (spans[-1][0], i + 1)
            else:
                spans.append((i, i + 1))
    return tuple(spans)
