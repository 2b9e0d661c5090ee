"""The README's five-line FastAPI setup works as printed: 200 concurrent retries, one charge; the
site's copy of it (docs/get-started.md) is the same code, and the site's framework snippets run."""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from idem_asgi.backends import Backend
from tests.support.servers import REDIS_URL, require

pytestmark = pytest.mark.redis
ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def first_block(page: Path, heading: str) -> str:
    """The first python block after `heading` on `page`."""
    text = page.read_text()
    match = re.search(r"```python\n(.*?)```", text[text.index(f"\n{heading}\n") :], re.S)
    assert match is not None
    return match.group(1)


def quickstart() -> str:
    return first_block(README, "## Five lines on FastAPI").replace("redis://localhost:6379/0", REDIS_URL)


def test_the_sites_five_lines_are_the_readmes() -> None:
    site = first_block(ROOT / "docs" / "get-started.md", "## Five lines on FastAPI")
    assert site == first_block(README, "## Five lines on FastAPI")


async def test_readme_quickstart_gives_one_charge_under_200_concurrent_retries() -> None:
    require("redis", REDIS_URL)
    app = FastAPI()
    charges: list[str] = []

    @app.post("/payments", status_code=201)
    async def pay(request: Request) -> dict[str, Any]:
        await asyncio.sleep(0.02)
        charges.append(request.state.idempotency.key)
        return {"charge": uuid.uuid4().hex}

    namespace: dict[str, Any] = {"app": app}
    exec(compile(quickstart(), "README.md", "exec"), namespace)  # the snippet exactly as printed
    key = f"readme-{uuid.uuid4().hex}"
    headers = {"Idempotency-Key": key, "X-Tenant-Id": "t-1"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        answers = await asyncio.gather(
            *[client.post("/payments", json={"amount": 1}, headers=headers) for _ in range(200)]
        )
        late = await client.post("/payments", json={"amount": 1}, headers=headers)
    assert charges == [key]
    first = next(a for a in answers if a.status_code == 201 and "idempotent-replayed" not in a.headers)
    assert all(a.status_code == 409 or a.content == first.content for a in answers)
    assert late.content == first.content and late.headers["idempotent-replayed"] == "true"
    backend = app.user_middleware[0].kwargs["backend"]
    assert isinstance(backend, Backend)
    await backend.aclose()


def test_the_framework_snippets_run_as_printed_with_the_compressor_outside() -> None:
    from starlette.middleware.gzip import GZipMiddleware

    from idem_asgi import IdempotencyMiddleware

    code = first_block(ROOT / "docs" / "frameworks.md", "## Adding it, framework by framework")
    namespace: dict[str, Any] = {"__name__": __name__}  # as in a module of the user's (Quart(__name__))
    exec(compile(code, "docs/frameworks.md", "exec"), namespace)  # every snippet, imports included
    assert isinstance(namespace["app"], IdempotencyMiddleware)  # the last one: Falcon wrapped
    starlette_lines = code[code.index("# Starlette") :]
    gzip_at = starlette_lines.index("Middleware(GZipMiddleware)")
    assert gzip_at < starlette_lines.index("Middleware(IdempotencyMiddleware")  # listed first = outermost
    assert GZipMiddleware.__name__ in code
