"""`RoutePolicy(replay="current")`: a repeat of a completed key gets the current state of what the
first request made, not a frozen copy of its answer.

The middleware asks the app itself: a `GET` of the resource the first answer named (its `Location`,
or the route's `locate(answer)`), sent through the app below the middleware with the repeat's own
headers (its credentials, its tenant), minus its body's. Only a `GET`, never the operation: a repeat
never runs the operation a second time, whatever the fetch does. The answer keeps the first answer's
status and `Location`, carries the fetched representation with its own headers, says where it
came from (`Content-Location`, RFC 9110 8.7) and is marked a replay. When there is nothing to fetch
(no locator, a first answer that was not a 2xx, another host) or the fetch does not give a 2xx in
time (the resource is gone, the app failed or hung), the stored answer is replayed as it was; the
`Idempotent-Replay-Source` header tells the two apart (`current` or `stored`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final
from urllib.parse import unquote, urlsplit

import anyio

from .._logging import throttled
from .._types import ASGIApp, Message, Scope
from ..context import STATE_KEY
from ..records import StoredResponse
from .asgi import HIDDEN_EXTENSIONS

Locate = Callable[[StoredResponse], "str | None"]
"""Given the first answer, the path (and query) of the resource it made, or None: nothing to fetch."""

FETCH_TIMEOUT: Final = 10.0
"""Seconds the app has to answer the `GET`; after them the stored answer is replayed."""

SOURCE_HEADER: Final = b"idempotent-replay-source"
CURRENT: Final = (SOURCE_HEADER, b"current")
STORED: Final = (SOURCE_HEADER, b"stored")

# The repeat's headers that describe its own body (the GET has none) or its key (the GET claims nothing).
_BODY_HEADERS: Final = frozenset(
    (b"content-length", b"content-type", b"content-encoding", b"transfer-encoding", b"expect", b"digest")
)
# The fetched answer's headers the replay sets itself.
_OWN_HEADERS: Final = frozenset((b"content-length", b"location", b"content-location", b"transfer-encoding"))


def location(answer: StoredResponse) -> str | None:
    """The default locator: the first answer's `Location` header."""
    for name, value in answer.headers:
        if name == b"location":
            return value.decode("latin-1")
    return None


def _target(where: str, scope: Scope) -> tuple[str, bytes] | None:
    """(path, query) of `where` when it names a resource of this app: a path, or a URL on the
    request's own host; None otherwise (another host is not ours to ask)."""
    parts = urlsplit(where)
    if parts.scheme or parts.netloc:
        host = next((v for k, v in scope.get("headers", ()) if k == b"host"), b"").decode("latin-1")
        if parts.scheme not in ("http", "https") or parts.netloc.lower() != host.lower():
            return None
    if not parts.path.startswith("/"):
        return None
    return parts.path, parts.query.encode("latin-1")  # (the path as sent: percent-encoded)


async def fetch_current(
    app: ASGIApp, scope: Scope, answer: StoredResponse, locate: Locate, key_header: bytes, limit: int
) -> tuple[list[tuple[bytes, bytes]], bytes] | None:
    """The current representation (headers, body) of what `answer` made, fetched with a GET through
    `app` as the repeat's caller; None when there is nothing to fetch or no 2xx came in time."""
    if not 200 <= answer.status < 300:
        return None
    try:
        where = locate(answer)
    except Exception as exc:  # the deployer's locator: its failure costs the repeat the current state only
        throttled(logging.WARNING, f"idem_asgi: replay='current': the route's locate() raised {type(exc).__name__}")
        return None
    target = _target(where, scope) if where else None
    if target is None:
        return None
    path, query = target
    state = {k: v for k, v in (scope.get("state") or {}).items() if k != STATE_KEY}  # the GET is under no claim
    headers = [(k, v) for k, v in scope["headers"] if k not in _BODY_HEADERS and k != key_header]
    sub: dict[str, Any] = {
        **scope,
        "method": "GET",
        "path": unquote(path),  # ASGI's path is decoded; raw_path is the bytes as sent
        "raw_path": path.encode("latin-1", "replace"),
        "query_string": query,
        "headers": headers,
        "state": state,
    }
    extensions = scope.get("extensions")
    if extensions:  # as for the app's own run: every body byte through `send`, so it is seen here
        sub["extensions"] = {k: v for k, v in extensions.items() if k not in HIDDEN_EXTENSIONS}
    done = anyio.Event()
    sent = False
    status = 0
    got: list[tuple[bytes, bytes]] = []
    body: list[bytes] = []
    size = 0
    finished = too_big = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, size, finished, too_big
        kind = message["type"]
        if kind == "http.response.start":
            status = message["status"]
            got.extend((bytes(k).lower(), bytes(v)) for k, v in message.get("headers", ()))
        elif kind == "http.response.body":
            chunk = bytes(message.get("body", b""))
            size += len(chunk)
            if size > limit:
                too_big = True
                raise _TooBig
            body.append(chunk)
            if not message.get("more_body", False):
                finished = True
                done.set()

    try:
        with anyio.move_on_after(FETCH_TIMEOUT):
            await app(sub, receive, send)
    except _TooBig:
        return None
    except Exception as exc:
        throttled(
            logging.WARNING,
            f"idem_asgi: replay='current': the GET of the resource raised {type(exc).__name__}; replayed as stored",
        )
        return None
    finally:
        done.set()
    if too_big or not finished or not 200 <= status < 300:
        return None
    kept = [(k, v) for k, v in got if k not in _OWN_HEADERS]
    return [*kept, (b"content-location", (where or path).encode("latin-1"))], b"".join(body)


class _TooBig(Exception):
    """The current representation is over the route's `max_stored_body`."""
