"""Incremental detokenization with stop strings, one instance per request.

Text is released only when it is final: never a partial UTF-8 character (the
tokenizer yields U+FFFD for an incomplete byte sequence) and never a suffix that
could still grow into a stop string.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens decoded in front of the output so tokenizers that mark word
# boundaries on the token (sentencepiece) place leading spaces right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        no_stop_trim: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.num_output = 0  # output tokens consumed so far
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.decode_kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self.no_stop_trim = no_stop_trim
        self.text = ""  # decoded so far (may hold back a partial stop string)
        self.sent = 0  # chars of `text` already released
        self.ids_sent = 0  # output tokens (and their logprobs) already handed to the caller
        self.matched_stop: str | None = None
        # Fast tokenizers without clean-up decode straight in Rust: transformers'
        # wrapper costs ~10x the decode itself, twice per token per stream.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True) else None

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.decode_kwargs["skip_special_tokens"])
        return self.tokenizer.decode(ids, **self.decode_kwargs)

    def feed(self, output_ids: list[int], check_stop: bool = True) -> None:
        """Consume output tokens not seen yet; detect stop strings in the new text
        (unless `check_stop` is False: before min_new_tokens, stops do not count)."""
        if self.matched_stop is not None:
            return
        new = output_ids[self.num_output :]
        if not new:
            return
        self.num_output = len(output_ids)
        self.ids.extend(new)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix_text) or full.endswith("\ufffd"):
            return  # an incomplete character: wait for more bytes
        old_len = len(self.text)
        self.text += full[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.stop and check_stop:
            start = max(0, old_len - self.max_stop_len + 1)
            hits = [(pos, s) for s in self.stop if (pos := self.text.find(s, start)) != -1]
            if hits:
                pos, s = min(hits)
                self.matched_stop = s
                self.text = self.text[: pos + len(s)] if self.no_stop_trim else self.text[:pos]

    def _held_back(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        for n in range(min(self.max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def release(self, finished: bool) -> str:
        """Text newly safe to show. At the finish everything left is released,
        including an incomplete character the model ended on."""
        if finished and self.matched_stop is None and self.read_offset < len(self.ids):
            self.text += self._decode(self.ids[self.prefix_offset :])[
                len(self._decode(self.ids[self.prefix_offset : self.read_offset])) :
            ]
            self.read_offset = len(self.ids)
        end = len(self.text) if finished or self.matched_stop is not None else len(self.text) - self._held_back()
        if end <= self.sent:
            return ""
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
