"""create_app: routes, middleware, error handlers and lifespan in one place."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app import routes_chat, routes_completions, routes_dashboard, routes_embeddings, routes_misc, routes_native, routes_trace
from app.errors import EXCEPTION_HANDLERS
from app.lifecycle import EngineFactory, default_engine_factory, make_lifespan
from app.middleware import AuthMiddleware, BodyLimitMiddleware
from app.openapi import openapi_document
from app.responses import JSONResponse
from app.state import AppState


async def openapi_json(request: Request) -> Response:
    return JSONResponse(openapi_document())


def create_app(state: AppState, engine_factory: EngineFactory = default_engine_factory) -> Starlette:
    """The ASGI app over `state`; its lifespan loads the engine with `engine_factory`."""
    routes = [
        Route("/v1/completions", routes_completions.create_completion, methods=["POST"]),
        Route("/v1/chat/completions", routes_chat.create_chat_completion, methods=["POST"]),
        Route("/v1/embeddings", routes_embeddings.create_embedding, methods=["POST"]),
        Route("/v1/models", routes_misc.list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", routes_misc.retrieve_model, methods=["GET"]),
        Route("/v1/tokenize", routes_misc.tokenize, methods=["POST"]),
        Route("/v1/detokenize", routes_misc.detokenize, methods=["POST"]),
        Route("/generate", routes_native.generate, methods=["POST"]),
        Route("/encode", routes_embeddings.encode, methods=["POST"]),
        Route("/abort_request", routes_native.abort_request, methods=["POST"]),
        Route("/flush_cache", routes_native.flush_cache, methods=["POST", "GET"]),
        Route("/get_model_info", routes_native.get_model_info, methods=["GET"]),
        Route("/get_server_info", routes_native.get_server_info, methods=["GET"]),
        # SGLang's newer names, which sglang-router asks for first (it falls back to the
        # /get_ ones with a deprecation warning), and the load report it polls.
        Route("/model_info", routes_native.get_model_info, methods=["GET"]),
        Route("/server_info", routes_native.get_server_info, methods=["GET"]),
        Route("/get_load", routes_native.get_load, methods=["GET"]),
        Route("/health", routes_misc.health, methods=["GET"]),
        Route("/health_generate", routes_misc.health_generate, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/v1/requests/{rid:path}/trace", routes_trace.request_trace, methods=["GET"]),
        Route("/dashboard/events", routes_dashboard.dashboard_events, methods=["GET"]),
        *(Route(path, routes_dashboard.dashboard_file, methods=["GET"]) for path in routes_dashboard.STATIC),
    ]
    if state.server.enable_metrics:
        routes.append(Route("/metrics", routes_misc.metrics, methods=["GET"]))
    # The body limit is outermost: it also drains the body under a 401 (see its invariant).
    middleware = [
        Middleware(BodyLimitMiddleware, limit=state.server.max_request_body_bytes),
        Middleware(AuthMiddleware, api_key=state.server.api_key),
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=make_lifespan(engine_factory),
    )
    app.state.sluice = state
    return app
