"""A token's role: text given to the model, or an answer the model wrote.

Under --enable-deterministic-inference a token's linear kernel follows its role, not the
batch it runs in (runtime/layers/batch_invariant.py PromptRows): given tokens take a GGUF
layer's bfloat16 tiles, answers its exact Q4 blocks. So a token's KV is a function of the
tokens before it and their roles, and the radix cache may share KV only between equal
(token, role) sequences (`role_keyed`).

Generated tokens are answers. So are the tokens of an earlier answer that a chat sends
back in its next turn, when the request says where they are (`TokenPrompt.answer_spans`;
the chat route finds the assistant messages in the template's text): they then take the
kernel they were decoded on, and the cache can serve them from the turn that wrote them.

A request's roles are `role_switches`: the sorted positions where the role flips, starting
as given text; the last is the prompt's length (every generated token is an answer).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

Span = tuple[int, int]  # [start, end) positions


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    """Prompt token ids with the spans that are earlier answers of the model (a chat's
    assistant turns), sorted and disjoint."""

    input_ids: list[int]
    answer_spans: tuple[Span, ...] = ()

    def check(self) -> str | None:
        """What is wrong with the spans, or None."""
        end = 0
        for span in self.answer_spans:
            if len(span) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in span):
                return "answer_spans must be [start, end) pairs of integers"
            if not end <= span[0] < span[1] <= len(self.input_ids):
                return f"answer_spans must be sorted, disjoint, non-empty and within the prompt's {len(self.input_ids)} tokens"
            end = span[1]
        return None


def role_switches(prompt_len: int, answer_spans: Sequence[Span] = ()) -> tuple[int, ...]:
    return (*(x for span in answer_spans for x in span), prompt_len)


def segments(switches: Sequence[int], lo: int, hi: int) -> Iterator[tuple[int, int, bool]]:
    """[lo, hi) cut where the role flips: (start, end, is_answer) pieces, in order."""
    k = bisect.bisect_right(switches, lo)  # switches at or before lo: odd = an answer
    start = lo
    while start < hi:
        end = min(switches[k], hi) if k < len(switches) else hi
        if end > start:
            yield start, end, k % 2 == 1
            start = end
        k += 1


def role_keyed(tokens: list[int], switches: Sequence[int]) -> list[int]:
    """`tokens` (a request's first len(tokens)) with each answer token as `~token`, a
    negative id: the radix cache's key when a token's KV depends on its role."""
    out = list(tokens)
    for start, end, answer in segments(switches, 0, len(out)):
        if answer:
            out[start:end] = [~t for t in out[start:end]]
    return out
