"""POST /pay as raw ASGI, for store tests through the middleware: `Payments` counts its runs per
idempotency key and answers 201 with a fresh id; `post` sends one request and times it."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from typing import Any

from idem_asgi._types import Receive, Scope, Send
from idem_asgi.http.problems import slug_of
from tests.support.asgi import drive, http_scope


class Payments:
    """A raw ASGI app that counts executions per idempotency key and answers 201 with a fresh uuid."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.runs: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body", False):
            pass
        key = dict(scope["headers"])[b"idempotency-key"].decode()
        self.runs[key] += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        body = json.dumps({"key": key, "id": uuid.uuid4().hex}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class Answer:
    def __init__(self, status: int, headers: dict[bytes, bytes], body: bytes, elapsed: float) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.elapsed = elapsed

    @property
    def replayed(self) -> bool:
        return self.headers.get(b"idempotent-replayed") == b"true"

    @property
    def problem(self) -> str | None:
        if self.headers.get(b"content-type") != b"application/problem+json":
            return None
        return slug_of(str(json.loads(self.body)["type"])) or ""


async def post(app: Any, key: str, body: bytes = b'{"amount": 10}') -> Answer:
    """One POST /pay through the ASGI app (the client never hangs up); never hangs longer than 10 s."""
    headers = [(b"idempotency-key", key.encode()), (b"content-type", b"application/json")]
    started = time.monotonic()
    result = await asyncio.wait_for(drive(app, http_scope("POST", "/pay", raw_headers=headers), [body]), 10)
    elapsed = time.monotonic() - started
    return Answer(result.status, {bytes(k): bytes(v) for k, v in result.headers}, result.body, elapsed)
