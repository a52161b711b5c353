"""The engine: SGLang's scheduler design in one asyncio process.

`Engine` (runtime/engine.py) is the offline and async API; `SamplingParams`
(runtime/sampling_params.py) is the one schema of per-request sampling parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtime.engine import Engine

__all__ = ["Engine", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import runtime.mem...` in tools and tests stays light.
    if name == "Engine":
        from runtime.engine import Engine

        return Engine
    raise AttributeError(name)
