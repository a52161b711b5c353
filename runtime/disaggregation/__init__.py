"""Prefill/decode disaggregation (`--disaggregation-mode prefill|decode`), as SGLang does it.

A router (sglang-router `--pd-disaggregation`) sends each request to a prefill
server and a decode server at once, with the same `bootstrap_host/port/room`.

Prefill server (prefill.py): the request waits in the PrefillBootstrapQueue until
its decode peer has reserved room for its KV (a `prealloc` on the bootstrap
connection), then runs as usual (chunked prefill, radix cache) with
max_new_tokens = 1. When its last chunk is computed, a KV sender ships every
layer's K and V and the first token; its row and KV stay held until the decode
side acknowledges (or the transfer fails): only then does it finish.

Decode server (decode.py): the request waits in the DecodePreallocQueue until a
row and slots for its prompt can be reserved (leaving the running requests their
decode headroom), then in the DecodeTransferQueue until its KV has arrived; it
then joins the running batch already prefilled (`Scheduler.admit_prebuilt`).
A retracted request re-enters the waiting queue and this server recomputes its
prefix itself.

Either side ends a request with a 503 error when its peer aborts it, dies, refuses
the KV layout (model, page size, KV dtype, tp_size) or lets `--disaggregation-timeout`
pass; every slot and row is released on both sides.

Tensor parallelism (ranks.py, rank_agent.py): both sides run the same tp_size, and
TP rank r of the prefill server sends its own KV heads to TP rank r of the decode
server, driven by rank 0's decisions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from config.settings import EngineSettings
from runtime.disaggregation.common import DisaggStats, transfer_backend
from runtime.disaggregation.wire import KVLayout

if TYPE_CHECKING:
    from runtime.disaggregation.decode import DecodeDisaggregation
    from runtime.disaggregation.prefill import PrefillDisaggregation
    from runtime.managers.scheduler import Scheduler
    from runtime.model_config import ModelConfig
    from runtime.model_executor.worker import Worker

__all__ = ["DisaggStats", "KVLayout", "create", "needs_bootstrap", "transfer_backend"]


def needs_bootstrap(settings: EngineSettings) -> bool:
    """Whether requests to this server must carry bootstrap_host/port/room."""
    return settings.disaggregation_mode != "null" and transfer_backend(settings) != "fake"


def create(scheduler: Scheduler, worker: Worker, config: ModelConfig, settings: EngineSettings) -> PrefillDisaggregation | DecodeDisaggregation:
    """This server's side, over the worker's KV buffers (call `start()` on the scheduler's loop)."""
    from runtime.disaggregation.decode import DecodeDisaggregation
    from runtime.disaggregation.prefill import PrefillDisaggregation

    from runtime.disaggregation.ranks import RankHub

    buffers = worker.kv_buffers()
    model = f"{config.architecture} layers={config.num_layers} hidden={config.hidden_size} vocab={config.vocab_size}"
    layout = KVLayout.of(model, settings.page_size, buffers, settings.tp_size)
    side = PrefillDisaggregation if settings.disaggregation_mode == "prefill" else DecodeDisaggregation
    ranks = None
    channel = getattr(worker, "tp_channel", None)  # rank 0 of a tensor-parallel group (ModelRunner)
    if channel is not None and transfer_backend(settings) != "fake":
        ranks = RankHub(channel, getattr(worker, "on_tp_failure", None), settings, model)
    return side(scheduler, buffers, layout, settings, ranks)
