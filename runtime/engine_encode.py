"""Engine.encode / Engine.async_encode: SGLang's embedding API (an --is-embedding engine).

An embedding request travels the generation path with `EMBEDDING` as its params:
`make_req` turns it into an EmbeddingReq, the scheduler ends it after its prefill
(runtime/managers/embedding_manager.py), and its one output carries the pooled,
L2-normalized vector instead of text. On a generation engine both raise InvalidRequest.
"""

from __future__ import annotations

from typing import Protocol, cast

from runtime.managers.embedding_manager import EMBEDDING, EmbeddingOutput
from runtime.managers.io_struct import GenerateOutput
from runtime.managers.tokenizer_manager import SamplingInput

Prompt = str | list[int]  # a text or token ids (runtime/engine.py's too)


class _Generates(Protocol):
    """What of the Engine the encode calls use."""

    async def _generate_one(
        self, prompt: Prompt, params: SamplingInput, rid: str | None, return_logprob: bool, top_k: int
    ) -> GenerateOutput: ...

    def generate(
        self, prompt: Prompt | list[str] | list[list[int]], sampling_params: SamplingInput | list[SamplingInput] = None
    ) -> GenerateOutput | list[GenerateOutput]: ...


class EncodeAPI:
    """Mixed into Engine."""

    async def async_encode(self: _Generates, prompt: Prompt, rid: str | None = None) -> EmbeddingOutput:
        """The embedding of one prompt (text, tokenized with the model's special tokens,
        or token ids). Cancelling the awaiting task aborts the request."""
        return cast(EmbeddingOutput, await self._generate_one(prompt, EMBEDDING, rid, False, 0))

    def encode(self: _Generates, prompt: Prompt | list[str] | list[list[int]]) -> EmbeddingOutput | list[EmbeddingOutput]:
        """One prompt's embedding, or a list for a batch (a list of texts or token-id lists)."""
        return cast(EmbeddingOutput | list[EmbeddingOutput], self.generate(prompt, EMBEDDING))
