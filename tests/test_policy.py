"""Route policies: defaults, durations, path patterns, and which requests they protect."""

from __future__ import annotations

import dataclasses
import math
from datetime import timedelta
from typing import Any

import pytest

from idem_asgi import IdempotencyMiddleware, RoutePolicy, current_idempotency
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import MemoryBackend
from idem_asgi.errors import ConfigurationError
from idem_asgi.http.keys import scope_from_header
from idem_asgi.http.policy import seconds
from idem_asgi.http.routing import compile_path
from tests.support.asgi import drive, http_scope


def test_defaults_match_the_contract() -> None:
    p = RoutePolicy("/payments")
    assert tuple(p.methods) == ("POST", "PATCH")
    assert seconds(p.ttl) == 86_400
    assert p.required is False
    assert p.on_expired == "block"
    assert p.wait is None
    assert p.fingerprint is None and p.key is None  # None: RawBody() over method, path, query and body
    assert 500 in p.release_statuses and 599 in p.release_statuses and 499 not in p.release_statuses
    assert {"set-cookie", "www-authenticate", "proxy-authenticate", "authorization", "connection"} <= set(
        p.excluded_headers
    )


def test_policy_is_frozen() -> None:
    p = RoutePolicy("/payments")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.required = True  # type: ignore[misc]


@pytest.mark.parametrize(
    ("value", "expected"),
    [(30, 30.0), (0.25, 0.25), (timedelta(minutes=2), 120.0), (timedelta(days=30), 2_592_000.0)],
)
def test_durations_accept_seconds_and_timedelta(value: Any, expected: float) -> None:
    assert seconds(value) == expected


@pytest.mark.parametrize("value", [0, -1, 0.0, timedelta(0), timedelta(seconds=-5), math.nan])
def test_durations_must_be_positive(value: Any) -> None:
    with pytest.raises(ConfigurationError):
        seconds(value)


def test_thirty_day_ttl_as_timedelta_is_accepted() -> None:
    mw = IdempotencyMiddleware(
        app_recording([]),
        routes=[RoutePolicy("/p", ttl=timedelta(days=30), lease=timedelta(seconds=10), single_tenant=True)],
    )
    assert mw.policies[0].ttl == timedelta(days=30)


# --- compile_path ----------------------------------------------------------------------------


def test_literal_path_compiles_to_an_exact_match() -> None:
    assert compile_path("/payments") == ("/payments", None)
    assert compile_path("/v1.0/pay+ments") == ("/v1.0/pay+ments", None)


@pytest.mark.parametrize(
    ("pattern", "matches", "misses"),
    [
        (
            "/orders/{order_id}/refunds",
            ["/orders/42/refunds", "/orders/a-b.c/refunds"],
            ["/orders//refunds", "/orders/4/2/refunds", "/orders/42/refunds/x", "/orders/42"],
        ),
        ("/api/*", ["/api", "/api/", "/api/x", "/api/x/y"], ["/apix", "/ap", "/other/api/x"]),
        ("/v1.0/{id}", ["/v1.0/7"], ["/v1x0/7"]),
        ("/t/{a}/{b}/*", ["/t/1/2", "/t/1/2/3/4"], ["/t/1", "/t/1/", "/t//2/3"]),
    ],
)
def test_patterns_match_whole_segments(pattern: str, matches: list[str], misses: list[str]) -> None:
    exact, regex = compile_path(pattern)
    assert exact is None and regex is not None
    for path in matches:
        assert regex.fullmatch(path), path
    for path in misses:
        assert not regex.fullmatch(path), path


@pytest.mark.parametrize("pattern", ["payments", "", "/a/*/b", "/a*", "/*/x"])
def test_bad_patterns_are_refused(pattern: str) -> None:
    with pytest.raises(ConfigurationError):
        compile_path(pattern)


# --- what the middleware protects ------------------------------------------------------------


def app_recording(seen: list[Any]) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(current_idempotency())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    return app


async def protects(policy: RoutePolicy, method: str, path: str, header: str = "Idempotency-Key") -> bool:
    """True when a request with a key ran under protection (the app saw the key)."""
    seen: list[Any] = []
    mw = IdempotencyMiddleware(app_recording(seen), backend=MemoryBackend(), routes=[policy])
    await drive(mw, http_scope(method, path, headers=[(header, "k-1")]))
    return seen[0] is not None


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("POST", "/payments", True),
        ("PATCH", "/payments", True),
        ("PUT", "/payments", False),
        ("GET", "/payments", False),
        ("DELETE", "/payments", False),
        ("POST", "/payments/", False),
        ("POST", "/payments/1", False),
        ("POST", "/Payments", False),
    ],
)
async def test_default_policy_protects_post_and_patch_on_the_exact_path(method: str, path: str, expected: bool) -> None:
    assert await protects(RoutePolicy("/payments", single_tenant=True), method, path) is expected


async def test_methods_are_case_insensitive_in_the_policy() -> None:
    assert await protects(RoutePolicy("/p", methods=["put"], single_tenant=True), "PUT", "/p")


async def test_a_single_method_string_means_that_method() -> None:
    policy = RoutePolicy("/p", methods="PUT", single_tenant=True)
    assert await protects(policy, "PUT", "/p")
    assert not await protects(policy, "POST", "/p")


async def test_pattern_routes_protect_matching_paths() -> None:
    policy = RoutePolicy("/orders/{id}/refunds", single_tenant=True)
    assert await protects(policy, "POST", "/orders/9/refunds")
    assert not await protects(policy, "POST", "/orders/9/refunds/1")


async def test_per_route_header_overrides_the_middleware_header() -> None:
    policy = RoutePolicy("/p", header="X-Request-Key", single_tenant=True)
    assert await protects(policy, "POST", "/p", header="X-Request-Key")
    assert not await protects(policy, "POST", "/p", header="Idempotency-Key")


async def test_per_route_scope_overrides_the_middleware_scope() -> None:
    seen: list[Any] = []
    mw = IdempotencyMiddleware(
        app_recording(seen),
        routes=[RoutePolicy("/a"), RoutePolicy("/b", scope=scope_from_header("x-user"))],
        scope=scope_from_header("x-tenant"),
    )
    headers = [("x-tenant", "acme"), ("x-user", "u-7"), ("Idempotency-Key", "k")]
    await drive(mw, http_scope("POST", "/a", headers=headers))
    await drive(mw, http_scope("POST", "/b", headers=headers))
    assert [(i.key, i.scope) for i in seen] == [("k", "acme"), ("k", "u-7")]


async def test_first_matching_policy_wins_exact_before_pattern() -> None:
    seen: list[Any] = []
    mw = IdempotencyMiddleware(
        app_recording(seen),
        routes=[
            RoutePolicy("/api/*", header="X-Pattern-Key", single_tenant=True),
            RoutePolicy("/api/pay", single_tenant=True),
        ],
    )
    await drive(mw, http_scope("POST", "/api/pay", headers=[("Idempotency-Key", "exact")]))
    assert seen[0] is not None and seen[0].key == "exact"


@pytest.mark.parametrize(
    "policy",
    [
        RoutePolicy("/p", ttl=10, lease=20),
        RoutePolicy("/p", methods=()),
        RoutePolicy("/p", on_expired="retry"),  # type: ignore[arg-type]
        RoutePolicy("/p", wait=0),
        RoutePolicy("/p", lease=-1),
        RoutePolicy("p"),
    ],
    ids=["lease-over-ttl", "no-methods", "bad-on-expired", "zero-wait", "negative-lease", "relative-path"],
)
def test_impossible_policies_fail_at_start(policy: RoutePolicy) -> None:
    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(app_recording([]), routes=[dataclasses.replace(policy, single_tenant=True)])


def test_bad_middleware_options_fail_at_start() -> None:
    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(app_recording([]), on_store_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(app_recording([]), backend="mongodb://x")
    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(app_recording([]), backend=object())  # type: ignore[arg-type]


def test_policies_are_exposed_as_given() -> None:
    routes = [RoutePolicy("/a", single_tenant=True), RoutePolicy("/b/*", single_tenant=True)]
    assert IdempotencyMiddleware(app_recording([]), routes=routes).policies == routes
