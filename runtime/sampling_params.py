"""Per-request sampling parameters: SGLang's names, and the one declaration of each
param's default, bounds and meaning.

Each field's `ParamSpec` (its metadata, collected in `PARAM_SPECS`) is what
`SamplingParams.validate()` enforces and what every HTTP route's schema documents.
The routes only check JSON types and hand the values to `from_dict`, so a bound
changed here changes the engine and every route at once, and answers stay identical.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from runtime.errors import InvalidParam, InvalidRequest

CLIP_MAX_NEW_TOKENS = 4096
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's; a request without a budget gets this, cut to the context left
INT32_MAX = 2**31 - 1  # caps the decode budget one request reserves in PrefillAdder
SEED_END = 2**63  # seeds are non-negative int64s
MAX_TOP_LOGPROBS = 20  # alternatives per output token

T = TypeVar("T")


def _num(x: float) -> str:
    for k in (31, 63):
        if x == 2**k:
            return f"2**{k}"
        if x == 2**k - 1:
            return f"2**{k} - 1"
        if x == -(2**k):
            return f"-2**{k}"
    return f"{x:g}"


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """The meaning and accepted range of one param (of each item, for a list param).
    `off` is a sentinel accepted outside the range (top_k's -1)."""

    doc: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    off: float | None = None

    def admits(self, x: float) -> bool:
        if x == self.off:
            return True
        return not (
            (self.ge is not None and x < self.ge)
            or (self.gt is not None and x <= self.gt)
            or (self.le is not None and x > self.le)
            or (self.lt is not None and x >= self.lt)
        )

    def range_text(self) -> str:
        lo = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else ""
        hi = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else ""
        return f"in {lo}, {hi}" if lo and hi else f">= {lo[1:]}" if lo.startswith("[") else f"> {lo[1:]}" if lo else ""

    def rule(self, kind: str) -> str:
        """The rule in words: "must be an integer in [0, 2**63)"."""
        rule = f"{kind} {self.range_text()}".rstrip()
        return f"must be {_num(self.off)} (off) or {rule}" if self.off is not None else f"must be {rule}"

    def json_schema(self) -> dict[str, float]:
        """JSON-schema bounds; with `off`, the minimum takes it in."""
        bounds = {"minimum": self.ge, "exclusiveMinimum": self.gt, "maximum": self.le, "exclusiveMaximum": self.lt}
        if self.off is not None:
            bounds = {**bounds, "minimum": min(self.off, self.ge if self.ge is not None else self.off), "exclusiveMinimum": None}
        return {k: v for k, v in bounds.items() if v is not None}


def _param(default: T, doc: str, **bounds: float) -> T:
    return field(default=default, metadata={"spec": ParamSpec(doc, **bounds)})


def _list_param(doc: str, **bounds: float) -> Any:
    return field(default_factory=list, metadata={"spec": ParamSpec(doc, **bounds)})


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = _param(DEFAULT_MAX_NEW_TOKENS, "Most tokens to generate; 0 = prefill only (for prompt logprobs).",
                                 ge=0, le=INT32_MAX)
    min_new_tokens: int = _param(0, "Tokens generated before EOS or a stop may end the output.", ge=0, le=INT32_MAX)
    temperature: float = _param(1.0, "Sampling temperature; 0 = greedy.", ge=0.0, le=2.0)
    top_p: float = _param(1.0, "Nucleus sampling: the smallest set of tokens with this much probability.", gt=0.0, le=1.0)
    top_k: int = _param(-1, "Sample from the k most likely tokens; -1 = off (HTTP routes also take 0 = off).",
                        off=-1, ge=1, le=INT32_MAX)
    min_p: float = _param(0.0, "Drop tokens less likely than min_p times the most likely one.", ge=0.0, le=1.0)
    frequency_penalty: float = _param(0.0, "Penalise tokens by how often they occurred in the output.", ge=-2.0, le=2.0)
    presence_penalty: float = _param(0.0, "Penalise tokens that occurred in the output.", ge=-2.0, le=2.0)
    repetition_penalty: float = _param(1.0, "Divide the logits of tokens seen so far (1 = off).", gt=0.0, le=10.0)
    stop: list[str] = _list_param("Strings that end the output (removed from it unless no_stop_trim).")
    stop_token_ids: list[int] = _list_param("Token ids that end the output (kept in output_ids).", ge=0, le=INT32_MAX)
    ignore_eos: bool = _param(False, "Keep generating past the model's EOS token.")
    skip_special_tokens: bool = _param(True, "Leave special tokens out of the text.")
    spaces_between_special_tokens: bool = _param(True, "Put spaces between special tokens in the text.")
    no_stop_trim: bool = _param(False, "Keep the matched stop string at the end of the text.")
    seed: int | None = _param(None, "RNG seed: the same seed, prompt and params give the same output.",
                              ge=0, lt=SEED_END)
    logit_bias: dict[int, float] | None = _param(None, "Added to the logits of these token ids before sampling.", ge=-100.0, le=100.0)
    # Structured output (at most one; needs --grammar-backend xgrammar).
    json_schema: str | None = _param(None, "Constrain the output to this JSON schema (given as a JSON string).")
    regex: str | None = _param(None, "Constrain the output to match this regular expression.")
    ebnf: str | None = _param(None, "Constrain the output to this EBNF grammar (xgrammar/GBNF syntax, start rule `root`).")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Validated params from SGLang-style keys; a null value means "not given"."""
        d = {k: v for k, v in (d or {}).items() if v is not None}
        unknown = set(d) - set(PARAM_SPECS)
        if unknown:
            raise InvalidRequest(f"unknown sampling params: {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if isinstance(d.get("logit_bias"), dict):  # JSON keys are strings: "50256": -100
            d["logit_bias"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in d["logit_bias"].items()}
        p = cls(**d)
        p.validate()
        return p

    def validate(self) -> None:
        """Raise InvalidParam for the first param that breaks its ParamSpec or a cross-param rule."""
        for name, spec in PARAM_SPECS.items():
            value = getattr(self, name)
            reason = _violation(_HINTS[name], spec, value)
            if reason is not None:
                raise InvalidParam(name, value, reason)
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidParam("min_new_tokens", self.min_new_tokens,
                               f"must not exceed the most tokens to generate ({self.max_new_tokens})")
        given = [k for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None]
        if len(given) > 1:
            raise InvalidParam(given[1], getattr(self, given[1]), f"cannot be combined with {given[0]}: give one constraint")

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the output constraint, or None."""
        for kind in ("json_schema", "regex", "ebnf"):
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalty(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0


PARAM_SPECS: dict[str, ParamSpec] = {f.name: f.metadata["spec"] for f in fields(SamplingParams)}
_HINTS: dict[str, object] = typing.get_type_hints(SamplingParams)

# Request-level params that are not sampling params, declared the same way: the routes'
# schemas document these specs and the engine and the app both check with `check_priority`.
DEFAULT_PRIORITY = 0
REQUEST_SPECS: dict[str, ParamSpec] = {
    "priority": ParamSpec(
        "Scheduling priority under --schedule-policy priority: larger values run first (smaller ones with "
        "--schedule-low-priority-values-first), and with --enable-priority-preemption may preempt running "
        "requests of lower priority. Absent: 0. Ignored under other policies.",
        ge=-(2**31), le=INT32_MAX,
    ),
}


def check_priority(value: object) -> int:
    """`value` as a request's priority; InvalidParam if it is not an int32."""
    reason = _violation(int, REQUEST_SPECS["priority"], value)
    if reason is not None:
        raise InvalidParam("priority", value, reason)
    return typing.cast(int, value)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _violation(hint: object, spec: ParamSpec, value: object) -> str | None:
    """Why `value` is not a valid `hint` within `spec`, or None."""
    if hint is bool:
        return None if isinstance(value, bool) else "must be a boolean"
    if hint == list[str]:
        ok = isinstance(value, list) and all(isinstance(s, str) and s for s in value)
        return None if ok else "must be a non-empty string or a list of non-empty strings"
    if hint == list[int]:
        ok = isinstance(value, list) and all(_is_int(t) and spec.admits(t) for t in value)
        return None if ok else spec.rule("a list of integers")
    if hint == dict[int, float] | None:
        ok = value is None or (isinstance(value, dict) and all(
            _is_int(k) and 0 <= k <= INT32_MAX and _is_number(v) and spec.admits(v) for k, v in value.items()))
        return None if ok else "must map token ids to numbers " + spec.range_text()
    if hint == str | None:
        return None if value is None or (isinstance(value, str) and value) else "must be a non-empty string"
    if hint == int | None and value is None:
        return None
    kind, ok = ("a number", _is_number(value)) if hint is float else ("an integer", _is_int(value))
    if not ok or not spec.admits(typing.cast(float, value)):  # a number once `ok`
        return spec.rule(kind)
    return None
