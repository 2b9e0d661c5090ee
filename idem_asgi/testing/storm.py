"""`storm()`: fire retry storms and faults at an app in-process and report what each key saw."""

from __future__ import annotations

import json as _json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .._types import ASGIApp
from ..backends import Backend
from ..http.middleware import IdempotencyMiddleware
from .driver import Probe, Storm, StormRequest
from .report import StormReport
from .scenarios import FAULTS, SCENARIOS, configure, per_process, storm_key
from .walk import find_middleware


async def storm(
    app: ASGIApp,
    method: str = "POST",
    path: str = "/payments",
    *,
    probe: Probe,
    body: bytes | str = b"",
    json: Any = None,
    headers: Mapping[str, str] | Sequence[tuple[str, str]] = (),
    key: str | None = None,
    concurrency: int = 50,
    repeats: int = 5,
    faults: Iterable[str] = FAULTS,
    mismatch: bool = True,
    middleware: IdempotencyMiddleware | Sequence[IdempotencyMiddleware] | None = None,
    backend: Backend | None = None,
    key_header: str = "Idempotency-Key",
    replay_header: str = "Idempotent-Replayed",
    request_timeout: float = 10.0,
    workers: int = 1,
) -> StormReport:
    """Fire retry storms and faults at `app` in-process; return what each key saw.

    Args:
        app: Your ASGI app, with `IdempotencyMiddleware` installed the way you install it.
        method: The endpoint's method.
        path: The endpoint's path (it may carry a `?query`).
        probe: Counts your handler's executions: a zero-argument callable (sync or async)
            returning the total so far (`lambda: len(charges)`), or a mapping key -> count (or a
            callable returning one). Read before and after each scenario, which run one at a time.
        body: The request body (bytes/str).
        json: Or an object sent as JSON (`content-type: application/json` is added unless
            `headers` sets one).
        headers: Extra request headers (tenant, auth). Host, content-length and the key are set here.
        key: The storm's key; each fault uses `<key>-<fault>`. Default: `storm-<random>`.
        concurrency: Identical requests fired at once.
        repeats: Sequential repeats after the storm, and retries after each fault.
        faults: Which of `FAULTS` to inject.
        mismatch: Also send the storm's key with a changed body (expects `fingerprint-mismatch`, 422
            or the route's `mismatch_status`). Turn off for routes whose fingerprint ignores the
            body (`event_id` webhooks).
        middleware: The `IdempotencyMiddleware` instance(s) serving `path`. Default: found in `app`.
        backend: The store to fail for `store_fails_after_claim`, when the middleware cannot be
            found (it is then patched on the instance for the duration of the storm).
        key_header: The key header, as configured on the middleware.
        replay_header: The replay header, as configured on the middleware.
        request_timeout: Seconds before one request counts as hung.
        workers: How many processes serve the app in production. With more than one, a per-process
            store (`MemoryBackend`) fails the report: each worker would run the retry again.

    The app runs without its lifespan: start it yourself if your handlers need it. While the storm
    runs, the middleware's store and inner app are wrapped (restored afterwards).
    """
    bad_faults = [f for f in faults if f not in FAULTS]
    if bad_faults:
        raise ValueError(f"unknown fault(s) {bad_faults}; choose from {list(FAULTS)}")
    if concurrency < 1 or repeats < 0 or workers < 1:
        raise ValueError("concurrency and workers must be at least 1, and repeats at least 0")
    request = _request_of(method, path, body, json, headers)
    prefix = key or f"storm-{uuid.uuid4().hex[:8]}"
    report = StormReport(request.method, path)
    run = Storm(
        app, request, probe, key_header=key_header, replay_header=replay_header, request_timeout=request_timeout
    )
    targets = _targets(app, middleware, backend)
    configure(run, report, targets)
    per_process(report, targets, workers)
    with run.instrumented(targets, backend):
        report.keys.append(await storm_key(run, prefix, concurrency, repeats, mismatch))
        for fault in FAULTS:
            if fault in faults:
                report.keys.append(await SCENARIOS[fault](run, f"{prefix}-{fault}", max(repeats, 1)))
    return report


def _request_of(
    method: str, path: str, body: bytes | str, json: Any, headers: Mapping[str, str] | Sequence[tuple[str, str]]
) -> StormRequest:
    """The storm's request: headers encoded, the body (JSON gets its content-type), the query split off."""
    raw_headers = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    encoded = tuple((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in raw_headers)
    if json is not None:
        payload = _json.dumps(json).encode()
        if all(k != b"content-type" for k, _ in encoded):
            encoded += ((b"content-type", b"application/json"),)
    else:
        payload = body.encode() if isinstance(body, str) else bytes(body)
    route, _, query = path.partition("?")
    return StormRequest(method.upper(), route, query.encode("latin-1"), encoded, payload)


def _targets(
    app: ASGIApp, middleware: IdempotencyMiddleware | Sequence[IdempotencyMiddleware] | None, backend: Backend | None
) -> list[IdempotencyMiddleware]:
    """The middleware instances the storm instruments: given, or found in `app`; those of `backend` only."""
    if middleware is None:
        targets = find_middleware(app)
    elif isinstance(middleware, IdempotencyMiddleware):
        targets = [middleware]
    else:
        targets = list(middleware)
    return targets if backend is None else [m for m in targets if m.backend is backend]
