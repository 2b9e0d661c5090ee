"""What a protected request must bring before anything is claimed: one well-formed key, and a scope.

Each check raises `Refused` with the problem to answer; `Protected.handle` sends it.
"""

from __future__ import annotations

import logging

from .._logging import once, redact
from .._types import Scope
from ..errors import InvalidScope, MalformedKey
from ..observe import EventName
from . import problems
from .keys import ANONYMOUS_SCOPE, parse_key, stored_scope
from .routing import Route

logger = logging.getLogger("idem_asgi")


class Refused(Exception):
    """Answer the request with this problem (raised by a step, sent by `Protected.handle`)."""

    def __init__(
        self,
        problem: problems.ProblemType,
        detail: str | None = None,
        *,
        retry_after: int | None = None,
        event: EventName | None = "rejected",
        members: dict[str, object] | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(problem.slug)
        self.problem = problem
        self.detail = detail
        self.retry_after = retry_after
        self.event = event
        self.members = members
        self.headers = headers


def sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def header_key(route: Route, scope: Scope) -> str | None:
    """The request's key header, parsed; None when absent. Raises `Refused` (400) when malformed or repeated."""
    raw: bytes | None = None
    count = 0
    for k, v in scope["headers"]:
        if k == route.header:
            raw = v
            count += 1
    return parsed_key(route, raw, count)


def parsed_key(route: Route, raw: bytes | None, count: int) -> str | None:
    """The key in the `count` header line(s) found for `route` (the last one: `raw`); `Refused` if malformed."""
    if count > 1:
        raise Refused(problems.KEY_MALFORMED, f"Send exactly one {route.header_name} header, not {count}.")
    if raw is None:
        return None
    try:
        return parse_key(raw)
    except MalformedKey as exc:
        raise Refused(problems.KEY_MALFORMED, sentence(str(exc))) from None


def request_scope(route: Route, scope: Scope) -> tuple[str | None, str | None]:
    """Whom the key belongs to: (as stored, as the handler is told).

    Raises `Refused` (400) when the scope callable names nobody on a scoped route (unless the route
    allows anonymous callers), raises, or answers something no store can keep.
    """
    if route.scope is None:
        return None, None
    try:
        raw = route.scope(scope)
    except InvalidScope as exc:
        raise Refused(problems.SCOPE_MALFORMED, sentence(str(exc))) from None
    except Exception as exc:  # its text may carry the credential it was reading
        logger.error(
            "idem_asgi: the scope callable of route %r raised %s: %s",
            route.policy.path,
            type(exc).__name__,
            redact(str(exc)),
        )
        raise Refused(problems.SCOPE_MALFORMED, "The scope of this request could not be determined.") from None
    if raw is None or raw == "":
        if route.anonymous:
            return ANONYMOUS_SCOPE, None
        raise Refused(problems.SCOPE_REQUIRED)
    try:
        stored = stored_scope(raw)
    except InvalidScope as exc:
        if not isinstance(raw, str):
            once(logging.ERROR, f"idem_asgi: route {route.policy.path!r}: {exc}")
        raise Refused(problems.SCOPE_MALFORMED, sentence(str(exc))) from None
    return stored, (raw if isinstance(raw, str) else str(raw))
