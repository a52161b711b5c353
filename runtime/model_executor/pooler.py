"""Pooler: on an --is-embedding server a forward returns pooled hidden states, not tokens.

Every batch of an embedding server is an EXTEND of prompt chunks; no request ever
decodes. The forward runs the model to its final norm and reduces each request's
chunk of hidden states to one float32 vector on the host, its *partial*:
- last: the hidden state of the chunk's last token;
- cls:  the hidden state of the chunk's first token;
- mean: the sum of the chunk's hidden states.
The scheduler combines a request's partials over its chunks, in launch order
(runtime/managers/embedding_manager.py): last keeps the final chunk's, cls the first
chunk's, mean sums them and divides by the prompt length; then it L2-normalizes.

Invariant: with mean or cls pooling the first chunk of every request starts at
position 0, because `resolve_pooling` turns the radix cache off (a cached prefix
would skip hidden states those two need). Last pooling keeps the radix cache: the
last token's hidden state is the same whether its prefix was computed now or earlier.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, cast

import structlog
import torch

from config.settings import EngineSettings, SettingsError
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.worker import BatchResult, ModelWorkerBatch

log = structlog.get_logger("sluice.engine")

PoolingMethod = Literal["last", "mean", "cls"]

# sentence-transformers' 1_Pooling/config.json switches -> our method (the others are refused).
_ST_MODES: dict[str, PoolingMethod] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
# Modules of a sentence-transformers pipeline sluice reproduces (Normalize: always on).
_ST_KNOWN = ("Transformer", "Pooling", "Normalize")


def _no_partials() -> torch.Tensor:
    return torch.empty(0, 0)


class Runner(Protocol):
    """What of the ModelRunner an embedding forward uses (model_runner.py holds a Pooler)."""

    model: torch.nn.Module
    stream: torch.cuda.Stream | None

    def build_forward_batch(self, mwb: ModelWorkerBatch) -> ForwardBatch: ...


@dataclass(slots=True)
class EmbeddingResult(BatchResult):
    """An embedding forward's result: no token is sampled (`next_token_ids` is empty)."""

    partials: torch.Tensor = field(default_factory=_no_partials)  # [bs, hidden] float32 on the host


def sentence_transformers_pooling(model_dir: Path) -> PoolingMethod | None:
    """The pooling a sentence-transformers model dir declares (modules.json ->
    <pooling module>/config.json), or None when the dir has no modules.json."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    unknown = [m["type"] for m in modules if m.get("type", "").rsplit(".", 1)[-1] not in _ST_KNOWN]
    if unknown:
        raise SettingsError(f"{modules_file} has modules sluice does not run: {unknown} (pass --pooling to serve "
                            "the transformer's pooled output anyway)")
    pooling = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
    if pooling is None:
        return None
    config = json.loads((model_dir / pooling.get("path", "") / "config.json").read_text())
    on = [key for key, value in config.items() if key.startswith("pooling_mode_") and value is True]
    methods = [_ST_MODES[key] for key in on if key in _ST_MODES]
    if len(methods) != 1 or any(key in _ST_UNSUPPORTED for key in on):
        raise SettingsError(f"{pooling.get('path')}/config.json asks for pooling {on}: sluice pools with exactly one "
                            "of last, mean or cls (pass --pooling to choose)")
    return methods[0]


def resolve_pooling(settings: EngineSettings, model_dir: Path) -> EngineSettings:
    """An embedding server's pooling (auto: the model dir's sentence-transformers config,
    else last); mean and cls also turn the radix cache off (the invariant above)."""
    if not settings.is_embedding:
        return settings
    pooling: PoolingMethod
    if settings.pooling == "auto":
        pooling = sentence_transformers_pooling(model_dir) or "last"
    else:
        pooling = cast(PoolingMethod, settings.pooling)
        try:  # the user chose: only say where the model dir disagrees
            declared = sentence_transformers_pooling(model_dir)
        except SettingsError as exc:
            log.warning("--pooling overrides the model's sentence-transformers config", pooling=pooling, config=str(exc))
        else:
            if declared is not None and declared != pooling:
                log.warning("--pooling differs from the model's sentence-transformers config", pooling=pooling, model=declared)
    no_radix = settings.disable_radix_cache or pooling != "last"
    if no_radix and not settings.disable_radix_cache:
        log.info("radix cache off: mean/cls pooling needs every token's hidden state", pooling=pooling)
    return dataclasses.replace(settings, pooling=pooling, disable_radix_cache=no_radix)


class Pooler:
    def __init__(self, method: PoolingMethod) -> None:
        self.method = method

    def partials(self, hidden: torch.Tensor, extend_seq_lens: torch.Tensor) -> torch.Tensor:
        """`hidden` [T, H] packed request by request, `extend_seq_lens[i]` rows each -> [bs, H] float32."""
        ends = torch.cumsum(extend_seq_lens, 0)
        if self.method == "last":
            return hidden[ends - 1].float()
        if self.method == "cls":
            return hidden[ends - extend_seq_lens].float()
        bs = extend_seq_lens.numel()
        owner = torch.repeat_interleave(torch.arange(bs, device=hidden.device), extend_seq_lens, output_size=hidden.shape[0])
        return torch.zeros(bs, hidden.shape[1], dtype=torch.float32, device=hidden.device).index_add_(0, owner, hidden.float())

    @torch.inference_mode()
    def forward(self, runner: Runner, mwb: ModelWorkerBatch) -> EmbeddingResult:
        """One embedding batch on the runner's worker thread; waits for the device (no
        decode runs beside it to overlap with)."""
        assert not mwb.forward_mode.is_decode(), "an embedding server never decodes"
        on_stream = torch.cuda.stream(runner.stream) if runner.stream is not None else contextlib.nullcontext()
        with on_stream:
            fb = runner.build_forward_batch(mwb)
            hidden = runner.model(fb.input_ids, fb.positions, fb)
            partials = self.partials(hidden, fb.extend_seq_lens).cpu()
        return EmbeddingResult(next_token_ids=[], partials=partials)


def pooler_for(settings: EngineSettings) -> Pooler | None:
    """The worker's pooler on an embedding server (pooling resolved), else None."""
    if not settings.is_embedding:
        return None
    assert settings.pooling != "auto", "resolve_pooling first"
    return Pooler(cast(PoolingMethod, settings.pooling))
