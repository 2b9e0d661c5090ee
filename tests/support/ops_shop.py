"""The reader's own objects for docs/operations.md's worked example, shared between processes.

The app (under uvicorn, killed mid-payment), the `idem-asgi reconcile` hook (imported by the CLI in
a process of its own) and the test all see one payment provider and one ledger, kept in Redis
under `ops:<run>:` (`IDEM_OPS_RUN`), as a real provider is one service all of them ask.
`page_blocks()` reads the page's own code: the worked example and the reconcile hook.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import redis.asyncio as aioredis

from tests.support.servers import REDIS_URL, ROOT
from tests.support.snippets import python_blocks

PAGE: Path = ROOT / "docs" / "operations.md"


class ProviderUnavailable(Exception):
    """The reader's provider client raises it when the provider cannot be asked."""


class SharedProvider:
    """A payment provider that dedupes by idempotency key (as real ones do), kept in Redis."""

    def __init__(self, run: str) -> None:
        self.client = aioredis.Redis.from_url(REDIS_URL)
        self.charges = f"ops:{run}:charges"
        self.order = f"ops:{run}:order"

    async def charge(self, *, idempotency_key: str) -> SimpleNamespace:
        n = await self.client.hlen(self.charges)
        made = json.dumps({"id": f"ch_{n + 1}_{idempotency_key[-6:]}", "status": "succeeded"})
        if await self.client.hsetnx(self.charges, idempotency_key, made):
            await self.client.rpush(self.order, idempotency_key)
        found = await self.find_charge(idempotency_key=idempotency_key)
        assert found is not None
        return found

    async def find_charge(self, *, idempotency_key: str) -> SimpleNamespace | None:
        raw = await self.client.hget(self.charges, idempotency_key)
        return None if raw is None else SimpleNamespace(**json.loads(raw))

    async def recent_idempotency_keys(self) -> list[str]:
        return [k.decode() if isinstance(k, bytes) else k for k in await self.client.lrange(self.order, 0, -1)]


class SharedLedger:
    """The reader's ledger: one Redis list entry per `record(...)` call."""

    def __init__(self, run: str) -> None:
        self.client = aioredis.Redis.from_url(REDIS_URL)
        self.name = f"ops:{run}:ledger"

    async def record(self, *fields: Any) -> None:
        await self.client.rpush(self.name, json.dumps([str(f) for f in fields]))

    async def entries(self) -> list[list[str]]:
        return [json.loads(e) for e in await self.client.lrange(self.name, 0, -1)]


def page_blocks() -> tuple[str, str]:
    """docs/operations.md's worked example (`provider_key`, `find_payment`, `recover`, the
    middleware) and its reconcile hook (`resolve`), exactly as printed."""
    blocks = [code for _, code in python_blocks(PAGE)]
    example = [c for c in blocks if re.search(r"^def provider_key\(", c, re.M)]
    hook = [c for c in blocks if re.search(r"^async def resolve\(stale", c, re.M)]
    assert len(example) == 1 and len(hook) == 1, "the page's worked example or its hook moved"
    return example[0], hook[0]


def yours(run: str | None = None) -> dict[str, Any]:
    """The stand-ins for the reader's objects the page's code names (not the app nor the backend)."""
    run = run or os.environ["IDEM_OPS_RUN"]
    return {
        "provider": SharedProvider(run),
        "ledger": SharedLedger(run),
        "ProviderUnavailable": ProviderUnavailable,
    }


def hook_module() -> str:
    """The source of the module `idem-asgi reconcile --hook` imports: the page's example and hook
    after the stand-ins (its `app.add_middleware(...)` goes to an app that is not served here)."""
    example, hook = page_blocks()
    head = (
        "from types import SimpleNamespace\n"
        "from tests.support.ops_shop import yours\n"
        "globals().update(yours())\n"
        "app = SimpleNamespace(add_middleware=lambda *args, **kwargs: None)\n"
        "backend = None\n"
    )
    return f"{head}\n{example}\n{hook}"
