"""Errors the engine raises for bad input (the HTTP layer maps them to 400)."""

from __future__ import annotations

_MAX_VALUE_REPR = 80


class InvalidRequest(ValueError):
    """The request cannot be served as given; nothing was queued."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidParam(InvalidRequest):
    """One sampling param breaks its rule. `describe(name)` words it under the name a
    caller used for it (the OpenAI routes call `max_new_tokens` `max_tokens`)."""

    def __init__(self, param: str, value: object, reason: str) -> None:
        self.value = value
        self.reason = reason
        super().__init__(self.describe(param), param)

    def describe(self, name: str) -> str:
        shown = repr(self.value)
        if len(shown) > _MAX_VALUE_REPR:
            shown = shown[: _MAX_VALUE_REPR - 3] + "..."
        return f"{name}={shown}: {self.reason}"
