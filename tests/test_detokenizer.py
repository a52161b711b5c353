"""Incremental detokenization: never broken UTF-8, never leaked stop text."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.managers.detokenizer import IncrementalDetokenizer


def _stream(tokenizer: Any, text: str, stop: list[str], prompt: str = "Say:") -> tuple[str, IncrementalDetokenizer]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt, add_special_tokens=False), stop)
    out = []
    for i in range(1, len(ids) + 1):
        detok.feed(ids[:i])
        delta = detok.release(finished=False)
        assert "\ufffd" not in delta
        out.append(delta)
        if detok.matched_stop:
            break
    out.append(detok.release(finished=True))
    return "".join(out), detok


def test_multibyte_characters_split_across_tokens_are_never_broken(tokenizer: Any) -> None:
    text = "你好，世界 🌍🚀 naïve café — ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # the emoji and CJK really are split into byte tokens
    streamed, _ = _stream(tokenizer, text, [])
    assert streamed == tokenizer.decode(ids)


def test_stop_string_spanning_tokens_is_cut_and_never_leaked(tokenizer: Any) -> None:
    streamed, detok = _stream(tokenizer, "Hello world, stop here please and more", [" here please"])
    assert streamed == "Hello world, stop"
    assert detok.matched_stop == " here please"


def test_a_possible_stop_prefix_is_held_back_until_it_resolves(tokenizer: Any) -> None:
    ids = tokenizer.encode("The end is near, the end", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], ["the end."])
    detok.feed(ids)
    shown = detok.release(finished=False)
    assert shown == "The end is near, "  # "the end" could still become "the end."
    assert detok.release(finished=True) == "the end"


def test_stop_strings_before_min_new_tokens_do_not_count(tokenizer: Any) -> None:
    ids = tokenizer.encode("stop here, then stop again", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], ["stop"])
    detok.feed(ids[:2], check_stop=False)  # "stop here" arrives before min_new_tokens
    assert detok.matched_stop is None
    detok.feed(ids, check_stop=True)
    assert detok.matched_stop == "stop"
    assert detok.release(finished=True) == "stop here, then "


class _WrapperOnly:
    """The tokenizer seen only through transformers' `decode` (the slow path)."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = tokenizer.decode


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=12), skip=st.booleans(), stop=st.sampled_from([[], ["e"], ["\n\n"]]))
def test_the_rust_fast_path_streams_the_same_text_as_transformers_decode(tokenizer: Any, ids: list[int], skip: bool, stop: list[str]) -> None:
    streams = []
    for tok in (tokenizer, _WrapperOnly(tokenizer)):
        detok = IncrementalDetokenizer(tok, [1, 2, 3], stop, skip_special_tokens=skip)
        out = []
        for i in range(1, len(ids) + 1):
            detok.feed(ids[:i])
            out.append(detok.release(finished=i == len(ids) or detok.matched_stop is not None))
            if detok.matched_stop:
                break
        streams.append(("".join(out), detok.matched_stop))
    assert streams[0] == streams[1]
