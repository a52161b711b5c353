"""Errors the engine raises for bad input (the HTTP layer maps them to 400)."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """The request cannot be served as given; nothing was queued."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
