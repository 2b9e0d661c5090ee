"""The operator's console as an ASGI app: list stuck claims, inspect one with its history, resolve it.

Mount it in any ASGI app, behind an authorization callable you supply (it refuses to be built
without one, and asks it on every request):

    from idem_asgi.admin import AdminApp, token_auth

    admin = AdminApp(store, authorize=token_auth({os.environ["IDEM_ADMIN_TOKEN"]: "on-call"}))
    app = Starlette(routes=[Mount("/idem-admin", app=admin), ...])

It serves a small HTML page (`GET /`) and the JSON API the page uses:

- `GET /api/stuck?older_than=60&namespace=idem`: in-progress claims whose lease ended that long ago;
- `GET /api/key?key=K&scope=S&namespace=idem` (or `digest=` for a claim listed by its digest): one
  record, with its history;
  (tokens are strings in this API: 62 bits is more than a JavaScript number holds exactly)
- `POST /api/resolve` (JSON: key, scope, namespace, token, and `release: true`, an `answer`
  {status, headers, body} or a job's `result`; `older_than`, `dry_run`): the same fenced operation
  as `idem-asgi resolve` (`ops.resolving.resolve_key`).

Every refusal is an RFC 9457 problem (`application/problem+json`): 401 without credentials, 403
for credentials not allowed the action, 404, 409 for a claim that is live or changed since it was
read, 415 for a POST that is not JSON (so no HTML form on another site can post to it), 503 when the
store fails. Each resolution is told to the `observer` (event `resolved`), logged on
`idem_asgi.admin` with the operator's name, and written to the key's history.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import logging
import math
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, TypeAlias
from urllib.parse import parse_qs

from .._shared import backend_for
from .._types import Receive, Scope, Send
from ..backends import Backend, Histories, Maintenance
from ..claims.recovery import Outcome
from ..errors import BackendError, ConfigurationError
from ..history import with_claim
from ..observe import Event, Observer
from ..ops.cli_output import key_doc, record_doc, stale_doc, step_doc
from ..ops.resolving import OLDER_THAN, record_key, resolve_key
from ..records import RecordKey, StaleRecord, StoredResponse
from ._page import page

Action: TypeAlias = Literal["read", "resolve"]
Authorize: TypeAlias = Callable[[Scope, Action], Awaitable["str | bool | None"]]
"""Asked with the request's ASGI scope and the action (`read`: the page, lists and lookups;
`resolve`: a write) before anything is done. Its answer: the operator's name (a `str`, written to
the key's history; `True` counts as "admin"), None when the request carries no credentials it
accepts (401), False when they are not allowed this action (403)."""

logger = logging.getLogger("idem_asgi.admin")
MAX_BODY = 1 << 20
"""Largest request body the API reads (an answer to store is at most this, base64 or text)."""


def token_auth(
    operators: Mapping[str, str], *, read_only: Mapping[str, str] | None = None, header: str = "authorization"
) -> Authorize:
    """An `Authorize` for bearer tokens: `operators` maps a token to the name of someone who may
    resolve, `read_only` a token to someone who may only look (403 on a write). Tokens are compared
    in constant time; a request without `Authorization: Bearer <token>` of either gets 401."""
    if not operators and not read_only:
        raise ConfigurationError("token_auth needs at least one token")
    name = header.lower().encode("latin-1")
    writers = {t.encode(): who for t, who in operators.items()}
    readers = {t.encode(): who for t, who in (read_only or {}).items()}

    async def authorize(scope: Scope, action: Action) -> str | bool | None:
        given = next((v for n, v in scope.get("headers", ()) if n == name), b"")
        kind, _, token = given.partition(b" ")
        if kind.lower() != b"bearer" or not token:
            return None
        for known, who in writers.items():
            if hmac.compare_digest(known, token):
                return who
        for known, who in readers.items():
            if hmac.compare_digest(known, token):
                return who if action == "read" else False
        return None

    return authorize


class AdminApp:
    """The operator's console (see the module docstring). `backend` is the store the app's
    middleware uses (the object itself, or its URL: the same store a middleware built from that URL
    shares in this process)."""

    def __init__(
        self,
        backend: Backend | str,
        *,
        authorize: Authorize,
        namespace: str = "idem",
        older_than: float = OLDER_THAN,
        lease: float = 30.0,
        observer: Observer | None = None,
    ) -> None:
        if authorize is None or not callable(authorize):
            raise ConfigurationError(
                "AdminApp needs authorize=: an async callable (scope, action) -> operator name | None | False; "
                "it resolves stuck payments, so it is never served without one (see idem_asgi.admin.token_auth)"
            )
        self.backend = backend_for(backend, ())
        self.authorize = authorize
        self.namespace = namespace
        self.older_than = older_than
        self.lease = lease
        self.observer = observer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":  # mounted alone: nothing to start
                while (await receive())["type"] != "lifespan.shutdown":
                    await send({"type": "lifespan.startup.complete"})
                await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        path = path.rstrip("/") or "/"
        method = scope["method"]
        route = _ROUTES.get(path)
        if route is None:
            return await _problem(send, 404, "Not Found", f"no such page: {path}")
        allowed, action = route
        if method not in allowed:
            return await _problem(send, 405, "Method Not Allowed", f"{path} takes {', '.join(allowed)}")
        who = await self.authorize(scope, action)
        if who is None:
            return await _problem(
                send, 401, "Unauthorized", "credentials are needed", [(b"www-authenticate", b"Bearer")]
            )
        if who is False or not who:
            return await _problem(send, 403, "Forbidden", f"these credentials may not {action}")
        operator = "admin" if who is True else str(who)
        try:
            if path == "/":
                base = scope["path"].rstrip("/")  # where the API is, however the app is mounted
                await _page_response(send, page(secrets.token_urlsafe(16), base, self.namespace, self.older_than))
            elif path == "/api/stuck":
                await self._stuck(scope, send)
            elif path == "/api/key":
                await self._key(scope, send)
            else:
                await self._resolve(scope, receive, send, operator)
        except _Refused as refused:
            await _problem(send, refused.status, refused.title, refused.detail)
        except ConfigurationError as exc:
            await _problem(send, 400, "Bad Request", str(exc))
        except BackendError as exc:
            await _problem(send, 503, "Service Unavailable", f"the store failed: {exc}")

    # -- the API ---------------------------------------------------------------------------------

    async def _stuck(self, scope: Scope, send: Send) -> None:
        query = _query(scope)
        if not isinstance(self.backend, Maintenance):
            raise _Refused(501, "Not Implemented", f"{type(self.backend).__name__} cannot list claims (no stale())")
        older_than = _seconds(query.get("older_than"), self.older_than, "older_than")
        namespace = query.get("namespace") or self.namespace
        found = await self.backend.stale(older_than, 200, namespace=namespace)
        await _json(send, 200, {"older_than": older_than, "namespace": namespace, "claims": [_stale(s) for s in found]})

    async def _key(self, scope: Scope, send: Send) -> None:
        query = _query(scope)
        key = _key_of(
            query.get("namespace") or self.namespace, query.get("scope"), query.get("key"), query.get("digest")
        )
        record = await self.backend.get(key)
        steps = with_claim(await self.backend.read_history(key), record) if isinstance(self.backend, Histories) else []
        doc = record_doc(key, record) if record is not None else {**key_doc(key), "found": False}
        if record is not None:
            doc["token"] = str(record.token)  # 62 bits: more than a JavaScript number holds exactly
        doc["history"] = [step_doc(s) for s in steps]
        doc["lease_over"] = record is not None and record.lease_until <= time.time()
        await _json(send, 200, doc)

    async def _resolve(self, scope: Scope, receive: Receive, send: Send, operator: str) -> None:
        ctype = dict(scope.get("headers", ())).get(b"content-type", b"").split(b";")[0].strip().lower()
        if ctype != b"application/json":
            raise _Refused(415, "Unsupported Media Type", "send the resolution as application/json")
        ask = await _body_json(receive)
        key = _key_of(
            _text(ask.get("namespace") or self.namespace, "namespace"),
            _text(ask.get("scope"), "scope"),
            _text(ask.get("key"), "key"),
            _text(ask.get("digest"), "digest"),
        )
        token = ask.get("token")
        if isinstance(token, str) and token.isascii() and token.isdigit():
            token = int(token)
        if not isinstance(token, int) or isinstance(token, bool):
            raise ConfigurationError("token: the claim's token as the key's record shows it (a number)")
        done = await resolve_key(
            self.backend,
            key,
            token,
            _outcome(ask),
            by=f"{operator} via the admin app",
            older_than=_seconds(ask.get("older_than"), self.older_than, "older_than"),
            lease=self.lease,
            dry_run=_flag(ask.get("dry_run"), "dry_run"),
        )
        doc = {**key_doc(key), "resolved": done.done, "verdict": done.verdict, "said": done.why}
        if done.done:
            logger.warning("idem_asgi admin: %s resolved %s (%s)", operator, key.key, done.verdict)
            if self.observer is not None:
                status = None if done.verdict == "released" else getattr(_outcome(ask), "status", None)
                try:
                    self.observer(Event("resolved", "admin", key.key, key.scope or None, status))
                except Exception:
                    logger.exception("idem_asgi admin: observer failed on 'resolved'")
        status = 200 if done.done or done.dry_run else 404 if done.verdict in ("missing", "gone") else 409
        await _json(send, status, doc)


_NOSNIFF = (b"x-content-type-options", b"nosniff")
_ROUTES: dict[str, tuple[tuple[str, ...], Action]] = {
    "/": (("GET",), "read"),
    "/api/stuck": (("GET",), "read"),
    "/api/key": (("GET",), "read"),
    "/api/resolve": (("POST",), "resolve"),
}


class _Refused(Exception):
    def __init__(self, status: int, title: str, detail: str) -> None:
        self.status, self.title, self.detail = status, title, detail


_DIGEST = re.compile(r"[0-9a-f]{64}")


def _key_of(namespace: str, scope: str | None, key: str | None, digest: str | None) -> RecordKey:
    """The record asked for: by its key (and scope), or by its digest alone, as `stale` lists a claim
    whose store keeps no raw key (no `IDEM_ASGI_KEY_SECRET` to unseal it with)."""
    if key and key != "?":
        return record_key(namespace, scope or None, key)
    if digest:
        if not _DIGEST.fullmatch(digest):
            raise ConfigurationError("digest: the record's 64 hex digits, as the list of stuck claims shows it")
        return RecordKey.hashed(namespace, digest)
    raise ConfigurationError("key is required (or the record's digest)")


def _outcome(ask: dict[str, Any]) -> Outcome:
    """What the operator says happened: `release`, an `answer` {status, headers, body | body_base64}, or a `result`."""
    given = [name for name in ("release", "answer", "result") if ask.get(name) not in (None, False)]
    if len(given) != 1:
        raise ConfigurationError("give exactly one of: release (true), answer ({status, headers, body}), result")
    if given[0] == "release":
        return "release"
    if given[0] == "result":
        from ..jobs.decorator import stored_result

        return stored_result(ask["result"])
    answer = ask["answer"]
    if not isinstance(answer, dict):
        raise ConfigurationError("answer: an object {status, headers: [[name, value]], body}")
    status = answer.get("status")
    if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
        raise ConfigurationError("answer.status: an HTTP status (100-599)")
    headers: list[tuple[bytes, bytes]] = []
    given = answer.get("headers") or []
    if not isinstance(given, list):
        raise ConfigurationError("answer.headers: a list of [name, value] strings")
    for pair in given:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise ConfigurationError("answer.headers: a list of [name, value] strings")
        try:
            headers.append((pair[0].strip().lower().encode("latin-1"), pair[1].strip().encode("latin-1")))
        except UnicodeEncodeError:
            raise ConfigurationError("answer.headers: names and values must be latin-1") from None
    if "body_base64" in answer:
        try:
            body = base64.b64decode(_text(answer["body_base64"], "answer.body_base64"), validate=True)
        except binascii.Error:
            raise ConfigurationError("answer.body_base64: not base64") from None
    else:
        body = _text(answer.get("body", ""), "answer.body").encode("utf-8")
    return StoredResponse(status, headers, body)


def _text(value: object, what: str, *, required: bool = False) -> str:
    if value is None or value == "":
        if required:
            raise ConfigurationError(f"{what} is required")
        return ""
    if not isinstance(value, str):
        raise ConfigurationError(f"{what}: a string")
    try:
        value.encode("utf-8")  # JSON's \ud800 escapes make strings no store can keep
    except UnicodeEncodeError:
        raise ConfigurationError(f"{what}: not valid Unicode (a lone surrogate)") from None
    return value


def _flag(value: object, what: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigurationError(f"{what}: true or false")
    return value


def _stale(s: StaleRecord) -> dict[str, Any]:
    """A stuck claim as `stale --json` lists it, its token as a string (62 bits: more than a
    JavaScript number holds exactly)."""
    return {**stale_doc(s), "token": str(s.record.token)}


def _seconds(value: object, default: float, what: str) -> float:
    if value is None or value == "":
        return default
    try:
        if isinstance(value, bool):
            raise TypeError
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigurationError(f"{what}: a number of seconds") from None
    if not 0 <= seconds < math.inf:
        raise ConfigurationError(f"{what}: 0 or more seconds")
    return seconds


def _query(scope: Scope) -> dict[str, str]:
    try:
        parsed = parse_qs(scope.get("query_string", b"").decode("utf-8"), keep_blank_values=True, strict_parsing=False)
    except UnicodeDecodeError:
        raise ConfigurationError("the query string is not UTF-8") from None
    return {name: values[-1] for name, values in parsed.items()}


def _required(query: dict[str, str], name: str) -> str:
    value = query.get(name)
    if not value:
        raise ConfigurationError(f"{name} is required")
    return value


async def _body_json(receive: Receive) -> dict[str, Any]:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Refused(400, "Bad Request", "the client left before its request was read")
        body = message.get("body", b"")
        size += len(body)
        if size > MAX_BODY:
            raise _Refused(413, "Content Too Large", f"at most {MAX_BODY} bytes")
        chunks.append(body)
        if not message.get("more_body", False):
            break
    try:
        ask = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:
        raise ConfigurationError(f"the body is not JSON: {exc}") from None
    if not isinstance(ask, dict):
        raise ConfigurationError("the body must be a JSON object")
    return ask


async def _json(send: Send, status: int, doc: object) -> None:
    body = json.dumps(doc).encode()
    headers = [(b"content-type", b"application/json"), (b"cache-control", b"no-store"), _NOSNIFF]
    await _send(send, status, headers, body)


async def _problem(
    send: Send, status: int, title: str, detail: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps({"type": "about:blank", "title": title, "status": status, "detail": detail}).encode()
    headers = [(b"content-type", b"application/problem+json"), (b"cache-control", b"no-store"), _NOSNIFF]
    headers += extra or []
    await _send(send, status, headers, body)


async def _page_response(send: Send, made: tuple[str, str]) -> None:
    nonce, text = made
    policy = (
        f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; connect-src 'self'; "
        "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    )
    headers = [
        (b"content-type", b"text/html; charset=utf-8"),
        (b"cache-control", b"no-store"),
        (b"content-security-policy", policy.encode()),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
    ]
    await _send(send, 200, headers, text.encode())


async def _send(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


__all__ = ["AdminApp", "Authorize", "token_auth"]
