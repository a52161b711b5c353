"""Request schemas of the embedding routes: OpenAI's POST /v1/embeddings and SGLang's
native POST /encode. Shape only (strict JSON types, non-empty inputs); whether the
server embeds at all, and the context bound, are the route's checks."""

from __future__ import annotations

from typing import Annotated, Literal, cast

from pydantic import Field, model_validator

from app.native_protocol import Rid
from app.protocol import NonEmptyText, Strict, Text, TokenIds

MAX_EMBEDDING_INPUTS = 2048  # inputs per request, as OpenAI's

Texts = Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
TokenIdLists = Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if isinstance(value[0], int):
        return [list(cast(list[int], value))]
    return [v if isinstance(v, str) else list(v) for v in cast(list[str] | list[list[int]], value)]


def _batched(value: str | list[str] | list[int] | list[list[int]] | None) -> bool:
    return isinstance(value, list) and not isinstance(value[0], int)


class EmbeddingRequest(Strict):
    input: NonEmptyText | Texts | TokenIds | TokenIdLists = Field(
        description="A text, a list of texts, a list of token ids, or a list of token-id lists."
    )
    model: Text | None = Field(None, description="Must be the served model name when given.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector as the base64 of its little-endian float32 bytes."
    )
    dimensions: int | None = Field(None, description="Refused: the served model has no Matryoshka support.")
    user: Text | None = None

    def inputs(self) -> list[str | list[int]]:
        return _inputs(self.input)


class EncodeRequest(Strict):
    """SGLang's EmbeddingReqInput: one input or a batch (answered with a list)."""

    text: NonEmptyText | Texts | None = None
    input_ids: TokenIds | TokenIdLists | None = None
    rid: Rid | list[Rid] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> EncodeRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text or input_ids is required")
        if isinstance(self.rid, list) and (not self.batched or len(self.rid) != len(self.inputs())):
            raise ValueError(f"a list of rid needs a batch of as many inputs ({len(self.inputs())})")
        return self

    @property
    def batched(self) -> bool:
        return _batched(self.text if self.text is not None else self.input_ids)

    def inputs(self) -> list[str | list[int]]:
        value = self.text if self.text is not None else self.input_ids
        assert value is not None
        return _inputs(value)
