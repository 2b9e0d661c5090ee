"""The one route table: which (method, path) a policy covers, for the middleware, `add_openapi` and webhooks.

Paths are matched relative to `scope["root_path"]`, as Starlette's router does: an app mounted at
`/v1` (or served with `uvicorn --root-path /api`) sees `scope["path"] == "/v1/payments"` with
`root_path == "/v1"`, and its policy says `/payments`. Exact paths are tried before patterns, and
the first matching entry wins.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterable, Sequence
from typing import Generic, TypeVar

from .._types import Scope
from ..errors import ConfigurationError
from . import problems
from .current import location
from .fingerprint import FingerprintRule, RawBody
from .keys import ScopeFunc
from .policy import RecoverHook, RoutePolicy, seconds

T = TypeVar("T")
_PARAM = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")


def route_path(scope: Scope) -> str:
    """`scope["path"]` relative to `scope["root_path"]` (the path a mounted app routes by)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    rest = path[len(root) :]
    if not rest:
        return "/"
    return rest if rest[0] == "/" else path


def compile_path(pattern: str) -> tuple[str | None, re.Pattern[str] | None]:
    """Return (exact path, None) for a literal pattern, else (None, compiled regex).

    `/payments` is literal, `{name}` matches one path segment, and a trailing `/*` matches the
    prefix itself and everything below it.
    """
    if not pattern.startswith("/"):
        raise ConfigurationError(f"route paths start with '/': {pattern!r}")
    prefix = pattern.endswith("/*")
    body = pattern[:-2] if prefix else pattern
    if not prefix and _PARAM.search(body) is None and "*" not in body:
        return body, None
    if "*" in body:
        raise ConfigurationError(f"'*' is only allowed as a trailing '/*': {pattern!r}")
    regex = ""
    pos = 0
    for m in _PARAM.finditer(body):
        regex += re.escape(body[pos : m.start()]) + "[^/]+"
        pos = m.end()
    regex += re.escape(body[pos:])
    regex += "(?:/.*)?" if prefix else ""
    # DOTALL: a percent-encoded newline (`/api/a%0Ab`) reaches `scope["path"]` decoded; without it
    # `.*` stops at the newline, the path matches no policy, and the request runs unprotected.
    return None, re.compile(regex, re.DOTALL)


def method_set(methods: Iterable[str] | str, where: str) -> frozenset[str]:
    """Upper-cased methods; a bare string is one method (iterating "POST" would give P, O, S, T)."""
    found = frozenset(m.upper() for m in ((methods,) if isinstance(methods, str) else methods))
    if not found:
        raise ConfigurationError(f"{where} protects no method")
    return found


class PathTable(Generic[T]):
    """(path pattern, methods) -> value; exact paths before patterns, first match wins."""

    __slots__ = ("_exact", "_patterns", "methods")

    def __init__(self, entries: Iterable[tuple[str, frozenset[str], T]]) -> None:
        self._exact: dict[str, list[tuple[frozenset[str], T]]] = {}
        self._patterns: list[tuple[re.Pattern[str], frozenset[str], T]] = []
        methods: set[str] = set()
        for pattern, verbs, value in entries:
            exact, regex = compile_path(pattern)
            methods |= verbs
            if exact is not None:
                self._exact.setdefault(exact, []).append((verbs, value))
            else:
                assert regex is not None
                self._patterns.append((regex, verbs, value))
        self.methods = frozenset(methods)

    def match(self, path: str, method: str) -> T | None:
        """The first entry covering (`path`, `method`), exact paths first."""
        for verbs, value in self._exact.get(path, ()):
            if method in verbs:
                return value
        for regex, verbs, value in self._patterns:
            if method in verbs and regex.fullmatch(path):
                return value
        return None

    def lookup(self, scope: Scope) -> T | None:
        """The entry covering this HTTP request, by method and path relative to the mount."""
        method = scope["method"]
        if method not in self.methods:
            return None
        path: str = scope["path"]
        if scope.get("root_path"):  # mounted: the path relative to the mount (no call when not)
            path = route_path(scope)
        for verbs, value in self._exact.get(path, ()):  # (`match`, inline: the usual exact path)
            if method in verbs:
                return value
        return self.match(path, method) if self._patterns else None


class Route:
    """A RoutePolicy compiled once, with the middleware's defaults: everything the hot path needs."""

    __slots__ = (
        "advertise_expiry",
        "anonymous",
        "excluded",
        "fingerprint",
        "header",
        "header_name",
        "key_source",
        "label",
        "lease",
        "locate",
        "max_body",
        "max_body_digits",
        "max_stored_body",
        "methods",
        "mismatch",
        "on_expired",
        "policy",
        "recover",
        "release_statuses",
        "replay_ttl",
        "required",
        "retry_after",
        "scope",
        "ttl",
        "wait",
        "whole",
    )

    def __init__(self, policy: RoutePolicy, header: str, scope: ScopeFunc | None, recover: RecoverHook | None) -> None:
        where = f"route {policy.path!r}"
        self.label = policy.path  # what its events name as their route
        compile_path(policy.path)  # validate now, not at the first request
        self.policy = policy
        self.methods = method_set(policy.methods, where)
        self.header_name = policy.header or header
        self.header = self.header_name.lower().encode("latin-1")
        self.ttl = seconds(policy.ttl)
        self.lease = seconds(policy.lease)
        if self.lease > self.ttl:
            raise ConfigurationError(f"{where}: lease ({self.lease}s) exceeds ttl ({self.ttl}s)")
        replay_ttl = self.ttl if policy.replay_ttl is None else seconds(policy.replay_ttl)
        if not 0 < replay_ttl <= self.ttl:
            raise ConfigurationError(f"{where}: replay_ttl ({replay_ttl}s) must be at most ttl ({self.ttl}s)")
        # None: one horizon (the answer lives as long as the key), and nothing to check on a replay
        self.replay_ttl = replay_ttl if replay_ttl < self.ttl else None
        self.wait = 0.0 if policy.wait is None else seconds(policy.wait)
        self.required = policy.required
        self.max_body = policy.max_body
        self.max_body_digits = len(str(policy.max_body))  # a shorter Content-Length cannot exceed it
        self.max_stored_body = policy.max_stored_body
        # A derived key (an event id) is the operation: a 405 for a method the app does not route must
        # never be stored under it, or the genuine delivery would be answered with that 405.
        self.release_statuses: Container[int] = (
            policy.release_statuses if policy.key is None else _With(policy.release_statuses, 405)
        )
        self.key_source = policy.key
        self.fingerprint: FingerprintRule = policy.fingerprint or getattr(policy.key, "fingerprint", None) or RawBody()
        # The default rule hashes a body that came in one piece in one call (`RawBody.whole`).
        self.whole = self.fingerprint.whole if type(self.fingerprint) is RawBody else None  # (not a subclass)
        if policy.single_tenant and policy.scope is not None:
            raise ConfigurationError(f"{where}: single_tenant=True and a scope callable contradict each other")
        # A single-tenant route has one key space: the middleware's scope callable does not apply.
        self.scope = None if policy.single_tenant else (policy.scope or scope)
        self.anonymous = policy.anonymous
        self.recover = policy.recover or recover
        self.on_expired = policy.on_expired
        if self.on_expired not in ("block", "reclaim"):
            raise ConfigurationError(f"on_expired must be 'block' or 'reclaim', got {self.on_expired!r}")
        if policy.replay not in ("stored", "current"):
            raise ConfigurationError(f"{where}: replay must be 'stored' or 'current', got {policy.replay!r}")
        if policy.locate is not None and policy.replay != "current":
            raise ConfigurationError(f"{where}: locate= is for replay='current' routes")
        # replay="current": how to find what a first answer made (None: replay it as stored)
        self.locate = (policy.locate or location) if policy.replay == "current" else None
        if policy.mismatch_status not in (409, 422):
            raise ConfigurationError(f"{where}: mismatch_status must be 409 or 422, got {policy.mismatch_status!r}")
        self.mismatch = problems.mismatch(policy.mismatch_status)
        self.retry_after = policy.retry_after
        self.advertise_expiry = policy.advertise_expiry
        excluded = (policy.excluded_headers,) if isinstance(policy.excluded_headers, str) else policy.excluded_headers
        self.excluded = frozenset(h.lower().encode("latin-1") for h in excluded)

    @property
    def unscoped(self) -> bool:
        """No scope callable and not declared single-tenant: every caller would share one key space."""
        return self.scope is None and not self.policy.single_tenant


class _With:
    """A status container plus one more status."""

    __slots__ = ("_base", "_extra")

    def __init__(self, base: Container[int], extra: int) -> None:
        self._base = base
        self._extra = extra

    def __contains__(self, status: object) -> bool:
        return status == self._extra or status in self._base


class RouteTable(PathTable[Route]):
    """The compiled policies of one middleware, in the order given."""

    __slots__ = ("routes",)

    def __init__(
        self,
        policies: Sequence[RoutePolicy],
        *,
        header: str = "Idempotency-Key",
        scope: ScopeFunc | None = None,
        recover: RecoverHook | None = None,
    ) -> None:
        self.routes = tuple(Route(p, header, scope, recover) for p in policies)
        super().__init__((r.policy.path, r.methods, r) for r in self.routes)
