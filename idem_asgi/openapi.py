"""Document idempotency in a FastAPI app's OpenAPI schema, on exactly the protected operations."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import problems
from .errors import ConfigurationError
from .middleware import IdempotencyMiddleware
from .policy import RoutePolicy
from .routing import RouteTable

_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})
_PROBLEM_SCHEMA = {
    "type": "object",
    "description": "RFC 9457 problem details.",
    "properties": {
        "type": {"type": "string", "enum": [p.type for p in problems.ALL]},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
    },
    "required": ["type", "title", "status"],
}
_ANSWERS = {
    "400": "Idempotency key missing or malformed.",
    "409": "A request with this key is still in progress (see Retry-After), or its outcome is unknown.",
    "413": "Request body over the route's limit.",
    "422": "Idempotency key reused with a different request.",
    "503": "Idempotency store unavailable; the request was not run (see Retry-After).",
}


def _installed(app: Any) -> tuple[list[RoutePolicy], str]:
    for m in getattr(app, "user_middleware", ()):
        if getattr(m, "cls", None) is IdempotencyMiddleware:
            return list(m.kwargs.get("routes", ())), m.kwargs.get("header", "Idempotency-Key")
    raise ConfigurationError("add_openapi: no IdempotencyMiddleware on this app; pass routes=...")


def add_openapi(app: Any, routes: Sequence[RoutePolicy] | None = None, *, header: str = "Idempotency-Key") -> None:
    """Add the key header and the problem answers to each protected operation of a FastAPI app.

    Policies match path templates the way they match request paths (`{id}` matches one
    segment); `routes` defaults to those of the `IdempotencyMiddleware` added to `app`.
    """
    if routes is None:
        routes, header = _installed(app)
    table = RouteTable(routes, header=header, scope=None)
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema  # type: ignore[no-any-return]
        schema: dict[str, Any] = generate()
        for path, item in schema.get("paths", {}).items():
            for method, operation in item.items():
                if method in _METHODS and (found := table.match(path, method.upper())) is not None:
                    _document(operation, found.policy, found.header_name)
        schema.setdefault("components", {}).setdefault("schemas", {})["IdempotencyProblem"] = _PROBLEM_SCHEMA
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def _document(operation: dict[str, Any], policy: RoutePolicy, header: str) -> None:
    operation.setdefault("parameters", []).append(
        {
            "name": header,
            "in": "header",
            "required": policy.required,
            "description": "Idempotency key: every retry of one operation carries the same value; 1-255 visible ASCII.",
            "schema": {"type": "string", "minLength": 1, "maxLength": 255},
        }
    )
    responses = operation.setdefault("responses", {})
    for code, response in responses.items():
        if code.startswith("2"):
            response.setdefault("headers", {})["Idempotent-Replayed"] = {
                "description": "`true` when this is the stored answer of an earlier request with the same key.",
                "schema": {"type": "string", "enum": ["true"]},
            }
    problem = {"schema": {"$ref": "#/components/schemas/IdempotencyProblem"}}
    for code, text in _ANSWERS.items():
        entry = responses.setdefault(code, {"description": text})
        entry.setdefault("content", {})["application/problem+json"] = problem
