"""GET /v1/requests/{rid}/trace: one request's timeline (runtime/managers/trace.py), for
a running request or one of the last `--trace-buffer-size` finished; 404 otherwise."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from app.errors import APIError
from app.responses import JSONResponse
from app.serving import app_state


async def request_trace(request: Request) -> Response:
    state = app_state(request)
    rid = request.path_params["rid"]
    trace = state.ready_engine().get_trace(rid)
    if trace is None:
        kept = state.engine_settings.trace_buffer_size
        raise APIError(404, f"No trace of request {rid!r}: it is unknown, or older than the last {kept} finished.",
                       param="rid", code="trace_not_found")
    return JSONResponse(trace)
