"""Per-request sampling parameters, with SGLang's names and validation."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from runtime.errors import InvalidRequest

CLIP_MAX_NEW_TOKENS = 4096
INT32_MAX = 2**31 - 1  # caps the decode budget one request reserves in PrefillAdder


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise InvalidRequest(f"unknown sampling params: {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        for key in ("stop", "stop_token_ids"):
            if d.get(key) is None:
                d.pop(key, None)
        try:
            p = cls(**d)
        except TypeError as e:
            raise InvalidRequest(str(e)) from None
        p.validate()
        return p

    def validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"{param}={getattr(self, param)!r}: {why}", param=param)

        def is_num(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x

        for name in ("max_new_tokens", "min_new_tokens", "top_k"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise bad(name, "must be an integer")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            if not is_num(getattr(self, name)):
                raise bad(name, "must be a number")
        if self.max_new_tokens < 0:
            raise bad("max_new_tokens", "must be >= 0")
        if not 0 <= self.min_new_tokens:
            raise bad("min_new_tokens", "must be >= 0")
        if self.min_new_tokens > self.max_new_tokens:
            raise bad("min_new_tokens", "must be <= max_new_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1 or self.top_k > INT32_MAX:
            raise bad("top_k", f"must be -1 (off) or in [1, {INT32_MAX}]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "must be in (0, 10]")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63
        ):
            raise bad("seed", "must be an integer in [0, 2**63)")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a boolean")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalty(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0
