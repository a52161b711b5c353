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

T = TypeVar("T")


class TokenizerService:
    def __init__(self, tokenizer: Any, max_workers: int = 2) -> None:
        self.tokenizer = tokenizer
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
        extra = {"tools": tools} if tools else {}  # templates without tool support ignore it
        text = await self._run(
            self.tokenizer.apply_chat_template,
            messages,
            tokenize=False,
            add_generation_prompt=True,
            what="apply the chat template",
            **extra,
        )
        if not isinstance(text, str):
            raise APIError(400, "The chat template did not produce text.")
        return text

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
