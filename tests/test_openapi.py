"""add_openapi documents the key header and problem answers on exactly the protected operations."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI

from idem_asgi import IdempotencyMiddleware, RoutePolicy, add_openapi
from idem_asgi.backends import MemoryBackend
from idem_asgi.errors import ConfigurationError

pytestmark = pytest.mark.memory


def build() -> FastAPI:
    app = FastAPI()
    app.add_middleware(
        IdempotencyMiddleware,
        backend=MemoryBackend(),
        routes=[
            RoutePolicy("/payments", methods=["POST"], required=True, single_tenant=True),
            RoutePolicy("/orders/{order_id}/refunds", single_tenant=True),
        ],
    )

    @app.post("/payments", status_code=201)
    async def pay() -> dict[str, Any]:
        return {}

    @app.get("/payments")
    async def list_payments() -> list[Any]:
        return []

    @app.post("/orders/{order_id}/refunds")
    async def refund(order_id: str) -> dict[str, Any]:
        return {}

    @app.post("/health")
    async def health() -> dict[str, Any]:
        return {}

    add_openapi(app)
    return app


def key_param(operation: dict[str, Any]) -> dict[str, Any] | None:
    return next((p for p in operation.get("parameters", []) if p["name"] == "Idempotency-Key"), None)


def test_protected_operations_get_the_header_and_problem_answers() -> None:
    schema = build().openapi()
    pay = schema["paths"]["/payments"]["post"]
    assert key_param(pay) == {
        "name": "Idempotency-Key",
        "in": "header",
        "required": True,
        "description": "Idempotency key: every retry of one operation carries the same value; 1-255 visible ASCII.",
        "schema": {"type": "string", "minLength": 1, "maxLength": 255},
    }
    for code in ("400", "409", "413", "422", "503"):
        assert "application/problem+json" in pay["responses"][code]["content"], code
    assert "Idempotent-Replayed" in pay["responses"]["201"]["headers"]
    refund = schema["paths"]["/orders/{order_id}/refunds"]["post"]
    param = key_param(refund)
    assert param is not None and param["required"] is False
    assert "application/json" in refund["responses"]["422"]["content"]  # FastAPI's own 422 is kept
    assert "IdempotencyProblem" in schema["components"]["schemas"]


def test_unprotected_operations_are_left_alone() -> None:
    schema = build().openapi()
    assert key_param(schema["paths"]["/payments"]["get"]) is None
    assert key_param(schema["paths"]["/health"]["post"]) is None
    assert "409" not in schema["paths"]["/health"]["post"]["responses"]


def test_schema_is_patched_once() -> None:
    app = build()
    first = app.openapi()
    second = app.openapi()
    assert first is second
    assert len([p for p in second["paths"]["/payments"]["post"]["parameters"] if p["name"] == "Idempotency-Key"]) == 1


def test_app_without_the_middleware_needs_explicit_routes() -> None:
    with pytest.raises(ConfigurationError):
        add_openapi(FastAPI())


def test_ttl_expiry_header_and_problem_links_are_documented() -> None:
    app = FastAPI()
    app.add_middleware(
        IdempotencyMiddleware,
        backend=MemoryBackend(),
        routes=[
            RoutePolicy("/payments", methods=["POST"], single_tenant=True, ttl=3600, advertise_expiry=True),
            RoutePolicy("/refunds", methods=["POST"], single_tenant=True),
        ],
        problem_base="https://api.example.com/problems#",
    )

    @app.post("/payments", status_code=201)
    async def create_payment() -> dict[str, Any]:
        return {}

    @app.post("/refunds", status_code=201)
    async def refund() -> dict[str, Any]:
        return {}

    add_openapi(app)
    schema = app.openapi()
    pay = schema["paths"]["/payments"]["post"]
    assert pay["x-idempotency"] == {"ttl_seconds": 3600.0, "required": False}
    assert "within 3600 s of the first answer" in pay["description"]
    assert pay["responses"]["201"]["headers"]["Idempotency-Expires"]["schema"]["format"] == "http-date"
    assert "Idempotency-Expires" not in schema["paths"]["/refunds"]["post"]["responses"]["201"]["headers"]
    assert "Link" in pay["responses"]["409"]["headers"]
    types = schema["components"]["schemas"]["IdempotencyProblem"]["properties"]["type"]["enum"]
    assert "https://api.example.com/problems#fingerprint-mismatch" in types


@pytest.mark.parametrize(
    ("base", "link", "form", "first"),
    [
        (None, False, "uri", "urn:idem-asgi:problem:key-required"),
        ("/problems/", True, "uri-reference", "/problems/key-required"),
    ],
)
def test_problem_types_are_documented_as_what_the_base_makes_them(
    base: str | None, link: bool, form: str, first: str
) -> None:
    app = FastAPI()
    extra: dict[str, Any] = {} if base is None else {"problem_base": base}
    app.add_middleware(
        IdempotencyMiddleware,
        backend=MemoryBackend(),
        routes=[RoutePolicy("/payments", methods=["POST"], single_tenant=True)],
        **extra,
    )

    @app.post("/payments", status_code=201)
    async def create_payment() -> dict[str, Any]:
        return {}

    add_openapi(app)
    schema = app.openapi()
    responses = schema["paths"]["/payments"]["post"]["responses"]
    assert ("Link" in responses["400"].get("headers", {})) is link  # no Link documented to a page that is not there
    kind = schema["components"]["schemas"]["IdempotencyProblem"]["properties"]["type"]
    assert kind["format"] == form and kind["enum"][0] == first
    assert not any(t.startswith(("http://", "https://")) for t in kind["enum"])
