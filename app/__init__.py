"""sluice's HTTP surface: OpenAI-compatible and native routes over one Engine.

`app.factory.create_app` builds the starlette application, `app.server.serve` runs it
on hypercorn + uvloop, and `app.cli.main` is the `sluice` console script.
"""

from __future__ import annotations
