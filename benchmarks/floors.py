"""The floors the overhead benchmark measures ours against, in the same rounds.

- `Forward`: an ASGI middleware that only forwards (`await app(scope, receive, send)`): what any
  middleware layer costs, so the noise of a run shows beside the numbers.
- `Capture`: the least an idempotency middleware can do in Python: buffer the body, SHA-256 it,
  one dict lookup by key, replay a stored answer, or wrap `send`, capture the answer and store it.
  No policies, scopes, leases, fencing, problem answers or store round trips: what is left of
  ours once everything that makes it correct is taken away. A memory-store ratio close to this
  one means the rest of ours costs little.
"""

from __future__ import annotations

import hashlib
from typing import Any

from idem_asgi._types import ASGIApp, Message, Receive, Scope, Send


class Forward:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


class Capture:
    def __init__(self, app: ASGIApp, path: str = "/noop") -> None:
        self.app = app
        self.path = path
        self.stored: dict[bytes, tuple[bytes, list[Message]]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        key = next((v for k, v in scope["headers"] if k == b"idempotency-key"), None)
        if key is None:
            await self.app(scope, receive, send)
            return
        chunks = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        digest = hashlib.sha256(body).digest()
        hit = self.stored.get(key)
        if hit is not None and hit[0] == digest:
            for message in hit[1]:
                await send(message)
            return
        sent: list[Message] = []
        given = False

        async def replay_body() -> Message:
            nonlocal given
            if given:
                return await receive()
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def capture(message: Message) -> None:
            sent.append(message)
            await send(message)

        await self.app(scope, replay_body, capture)
        self.stored[key] = (digest, sent)


def floor_app(name: str, app: Any) -> Any:
    """`app` behind the floor called `name` (`capture` or `forward`)."""
    if name == "capture":
        return Capture(app)
    if name == "forward":
        return Forward(app)
    raise SystemExit(f"unknown floor {name!r}: capture or forward")
