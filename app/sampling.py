"""Route bodies -> `runtime.SamplingParams`, whose `validate()` is the one check of them.

Which body field is which SamplingParams field is read from the `EngineParam` marks
in the schemas, so the routes only differ in their names (`max_tokens` is
`max_new_tokens`), and a broken rule is answered under the name the body used.
"""

from __future__ import annotations

import dataclasses
from functools import cache

from pydantic import BaseModel

from app.errors import APIError
from app.protocol import EngineParam
from runtime.errors import InvalidParam
from runtime.sampling_params import SEED_END, SamplingParams, check_priority


@cache
def engine_fields(model: type[BaseModel]) -> dict[str, str]:
    """Body field -> SamplingParams field, for every field marked EngineParam."""
    return {
        name: mark.name
        for name, info in model.model_fields.items()
        for mark in info.metadata
        if isinstance(mark, EngineParam)
    }


def sampling_params(body: BaseModel, max_new_tokens: int) -> SamplingParams:
    """The params `body` sets (the rest are the engine's defaults), generating at most
    `max_new_tokens`; a value SamplingParams refuses is a 400 naming the body's field."""
    values: dict[str, object] = {}
    names: dict[str, str] = {}  # SamplingParams field -> the body field that set it
    for name, param in engine_fields(type(body)).items():
        value = getattr(body, name)
        if value is not None:
            values[param] = -1 if param == "top_k" and value == 0 else value  # 0 = off on HTTP
            names[param] = name
    values["max_new_tokens"] = max_new_tokens
    try:
        return SamplingParams.from_dict(values)
    except InvalidParam as exc:
        name = names.get(exc.param or "", exc.param or "")
        raise APIError(400, exc.describe(name), param=name) from exc


def request_priority(value: int | None) -> int | None:
    """The body's `priority` (None: not given), checked by the engine's rule: 400 if out of range."""
    if value is None:
        return None
    try:
        return check_priority(value)
    except InvalidParam as exc:
        raise APIError(400, str(exc), param="priority") from exc


def for_choice(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of a seeded request samples with `seed + index` (mod 2**63, so it stays a
    valid seed): the n choices differ from each other, yet the response is reproducible."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % SEED_END)


def with_constraint(params: SamplingParams, json_schema: str | None, source: str = "response_format") -> SamplingParams:
    """`params` constrained to `json_schema` (from response_format or a forced tool call);
    400 if the body also gave its own json_schema/regex/ebnf."""
    if json_schema is None:
        return params
    if params.grammar is not None:
        raise APIError(400, f"{source} cannot be combined with {params.grammar[0]}: give one constraint", param=source)
    return dataclasses.replace(params, json_schema=json_schema)

