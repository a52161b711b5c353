"""The app's OpenAPI 3.1 document, generated from the pydantic request models.

Served at GET /openapi.json; the fuzz tests draw request bodies from it, so the
schema and the validation that enforces it are one and the same.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app.embedding_protocol import EmbeddingRequest, EncodeRequest
from app.native_protocol import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from app.protocol import ChatCompletionRequest, CompletionRequest

# (method, path, request model or None, summary)
ROUTES: tuple[tuple[str, str, type[BaseModel] | None, str], ...] = (
    ("post", "/v1/completions", CompletionRequest, "OpenAI completions (stream with SSE)."),
    ("post", "/v1/chat/completions", ChatCompletionRequest, "OpenAI chat completions (stream with SSE)."),
    ("post", "/v1/embeddings", EmbeddingRequest, "OpenAI embeddings (an --is-embedding server; 400 otherwise)."),
    ("get", "/v1/models", None, "The served model."),
    ("get", "/v1/models/{model_id}", None, "One model, 404 if it is not served."),
    ("post", "/v1/tokenize", TokenizeRequest, "Tokenize a prompt or chat messages."),
    ("post", "/v1/detokenize", DetokenizeRequest, "Token ids to text."),
    ("post", "/generate", GenerateRequest, "Native generation (SGLang style)."),
    ("post", "/encode", EncodeRequest, "Native embeddings, SGLang style (an --is-embedding server; 400 otherwise)."),
    ("post", "/abort_request", AbortRequest, "Abort one request or all."),
    ("post", "/flush_cache", None, "Flush the prefix cache (400 while requests run)."),
    ("get", "/health", None, "Liveness/readiness (503 while starting or draining)."),
    ("get", "/health_generate", None, "Generate one token end to end."),
    ("get", "/get_model_info", None, "Model and tokenizer paths."),
    ("get", "/get_server_info", None, "Engine and server settings (as resolved at start-up) and engine state."),
    ("get", "/model_info", None, "Alias of /get_model_info (SGLang's newer name)."),
    ("get", "/server_info", None, "Alias of /get_server_info (SGLang's newer name)."),
    ("get", "/get_load", None, "Load per data-parallel rank (one): requests, queue, KV tokens held."),
    ("get", "/metrics", None, "Prometheus metrics."),
    ("get", "/v1/requests/{rid}/trace", None, "One request's timeline (running, or among the last finished); 404 if unknown."),
    ("get", "/dashboard", None, "The live dashboard (an HTML page; its data needs the API key)."),
    ("get", "/dashboard/events", None, "The dashboard's server-sent events: one snapshot a second."),
)

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _error_responses() -> dict[str, Any]:
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    return {code: {"description": text, **ref} for code, text in (
        ("400", "Invalid request"), ("401", "Missing or wrong API key"), ("404", "Unknown model or route"),
        ("413", "Body too large"), ("415", "Body not sent as application/json"),
        ("503", "Starting, shutting down, or queue full"),
    )}


@cache
def openapi_document() -> dict[str, Any]:
    models = [m for _, _, m, _ in ROUTES if m is not None]
    _, top = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    schemas = dict(top.get("$defs", {}))
    schemas["ErrorResponse"] = ERROR_SCHEMA
    paths: dict[str, dict[str, Any]] = {}
    for method, path, model, summary in ROUTES:
        op: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "OK"}, **_error_responses()}}
        if model is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
            }
        if "{model_id}" in path:
            op["parameters"] = [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "sluice", "version": "0.1.0", "description": "OpenAI-compatible LLM inference server."},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
