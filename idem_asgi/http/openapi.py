"""Document idempotency in a FastAPI app's OpenAPI schema, on exactly the protected operations."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ConfigurationError
from . import problems
from .middleware import IdempotencyMiddleware
from .policy import RoutePolicy
from .routing import Route, RouteTable

_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


def _problem_schema(base: str) -> dict[str, Any]:
    if problems.served(base):
        about, form = "a path of this API whose page (GET) says what happened and what to do", "uri-reference"
    elif base == problems.DEFAULT_PROBLEM_BASE:
        about, form = "an identifier of the case (it locates nothing); switch on it", "uri"
    else:
        about, form = "a URL whose page says what happened and what to do", "uri"
    return {
        "type": "object",
        "description": f"RFC 9457 problem details; `type` is {about}.",
        "properties": {
            "type": {"type": "string", "format": form, "enum": [p.url(base) for p in problems.ALL]},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
        },
        "required": ["type", "title", "status"],
    }


_LINK = {
    "description": 'The problem type\'s documentation: `<type>; rel="describedby"` (sent when `problem_base` '
    "names a page: a path the middleware serves, or your docs).",
    "schema": {"type": "string"},
}
_ANSWERS = {
    "400": "Idempotency key (or scope) missing or malformed.",
    "409": "A request with this key is still in progress (see Retry-After), or its outcome is unknown.",
    "413": "Request body over the route's limit.",
    "422": "Idempotency key reused with a different request.",
    "503": "Idempotency store unavailable; the request was not run (see Retry-After).",
}


class _Settings:
    """What the installed middleware says about the routes to document."""

    def __init__(
        self,
        routes: Sequence[RoutePolicy],
        header: str,
        replay_header: str,
        problem_base: str = problems.DEFAULT_PROBLEM_BASE,
    ) -> None:
        self.routes = list(routes)
        self.header = header
        self.replay_header = replay_header
        self.problem_base = problem_base


def _installed(app: Any) -> _Settings | None:
    for m in getattr(app, "user_middleware", ()):
        if getattr(m, "cls", None) is IdempotencyMiddleware:
            kwargs = m.kwargs
            return _Settings(
                kwargs.get("routes", ()),
                kwargs.get("header", "Idempotency-Key"),
                kwargs.get("replay_header", "Idempotent-Replayed"),
                kwargs.get("problem_base", problems.DEFAULT_PROBLEM_BASE),
            )
    return None


def add_openapi(
    app: Any,
    routes: Sequence[RoutePolicy] | None = None,
    *,
    header: str | None = None,
    replay_header: str | None = None,
) -> None:
    """Add the key header and the problem answers to each protected operation of a FastAPI app.

    Policies match path templates the way they match request paths (`{id}` matches one segment);
    `routes`, `header` and `replay_header` default to those of the `IdempotencyMiddleware` added to
    `app`. FastAPI apps mounted in `app` are documented too, in their own schema, with the policies
    under their mount path (relative to it) and their own middleware's.
    """
    found = _installed(app)
    if routes is None and found is None:
        raise ConfigurationError("add_openapi: no IdempotencyMiddleware on this app; pass routes=...")
    settings = _Settings(
        routes if routes is not None else found.routes if found is not None else (),
        header or (found.header if found is not None else "Idempotency-Key"),
        replay_header or (found.replay_header if found is not None else "Idempotent-Replayed"),
        found.problem_base if found is not None else problems.DEFAULT_PROBLEM_BASE,
    )
    _install(app, settings)


def _install(app: Any, settings: _Settings) -> None:
    table = RouteTable(settings.routes, header=settings.header)
    generate = app.openapi
    link = settings.problem_base != problems.DEFAULT_PROBLEM_BASE

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema  # type: ignore[no-any-return]
        schema: dict[str, Any] = generate()
        for path, item in schema.get("paths", {}).items():
            for method, operation in item.items():
                if method in _METHODS and (route := table.match(path, method.upper())) is not None:
                    _document(operation, route, settings.replay_header, link)
        schema.setdefault("components", {}).setdefault("schemas", {})["IdempotencyProblem"] = _problem_schema(
            settings.problem_base
        )
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
    for prefix, sub in _mounted(app):
        own = _installed(sub)
        inner = [_relative(p, prefix) for p in settings.routes if p.path.startswith(prefix + "/")]
        _install(
            sub,
            _Settings(
                [*inner, *(own.routes if own is not None else ())],
                own.header if own is not None else settings.header,
                own.replay_header if own is not None else settings.replay_header,
                own.problem_base if own is not None else settings.problem_base,
            ),
        )


def _mounted(app: Any) -> list[tuple[str, Any]]:
    """(mount path, app) for each FastAPI-like app mounted directly in `app`."""
    found = []
    for route in getattr(app, "routes", ()):
        sub = getattr(route, "app", None)
        path = getattr(route, "path", None)
        if isinstance(path, str) and callable(getattr(sub, "openapi", None)) and hasattr(sub, "openapi_schema"):
            found.append((path.rstrip("/"), sub))
    return found


def _relative(policy: RoutePolicy, prefix: str) -> RoutePolicy:
    from dataclasses import replace

    return replace(policy, path=policy.path[len(prefix) :] or "/")


def _document(operation: dict[str, Any], route: Route, replay_header: str, link: bool) -> None:
    parameters = operation.setdefault("parameters", [])
    declared = {(p.get("in"), str(p.get("name", "")).lower()) for p in parameters if isinstance(p, dict)}
    # A route that derives its key ignores the header: documenting it would mislead clients.
    if route.key_source is None and ("header", route.header_name.lower()) not in declared:
        parameters.append(
            {
                "name": route.header_name,
                "in": "header",
                "required": route.required,
                "description": "Idempotency key: every retry of one operation carries the same value; "
                "1-255 visible ASCII.",
                "schema": {"type": "string", "minLength": 1, "maxLength": 255},
            }
        )
    if not parameters:
        del operation["parameters"]
    # The key expiry policy the draft asks servers to publish: how long a key's answer is replayed.
    operation["x-idempotency"] = {"ttl_seconds": route.ttl, "required": route.required}
    if route.replay_ttl is not None:  # the answer is replayed for less than the key refuses a second run
        operation["x-idempotency"]["replay_ttl_seconds"] = route.replay_ttl
    ttl = f"{route.replay_ttl or route.ttl:g} s"
    note = f"Idempotent: a repeat with the same key within {ttl} of the first answer gets that answer again."
    operation["description"] = f"{operation['description']}\n\n{note}" if operation.get("description") else note
    responses = operation.setdefault("responses", {})
    for code, response in responses.items():
        if code.startswith("2"):
            headers = response.setdefault("headers", {})
            headers[replay_header] = {
                "description": "`true` when this is the stored answer of an earlier request with the same key.",
                "schema": {"type": "string", "enum": ["true"]},
            }
            if route.advertise_expiry:
                headers["Idempotency-Expires"] = {
                    "description": f"When this answer stops being replayed for its key ({ttl} after it was "
                    "first given); a request with the key after it runs again.",
                    "schema": {"type": "string", "format": "http-date"},
                }
    problem = {"schema": {"$ref": "#/components/schemas/IdempotencyProblem"}}
    answers = dict(_ANSWERS)
    if route.mismatch.status == 409:  # `mismatch_status=409`: the reused key is one more 409
        del answers["422"]
        answers["409"] = answers["409"][:-1] + ", or the key was reused with a different request."
    for code, text in answers.items():
        entry = responses.setdefault(code, {"description": text})
        entry.setdefault("content", {})["application/problem+json"] = problem
        if link:
            entry.setdefault("headers", {})["Link"] = _LINK
