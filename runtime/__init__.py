"""The engine: SGLang's scheduler design in one asyncio process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.engine import Engine

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import runtime.mem...` in tools and tests stays light.
    if name == "Engine":
        from runtime.engine import Engine

        return Engine
    raise AttributeError(name)
