"""The same small payments API on each supported framework, wrapped the way its users add middleware.

Endpoints (all POST): /payments (protected, required key), /stream (protected, streamed body),
/boom (protected, raises), /slow (protected, 0.3 s), /bg (protected, background task),
/free (not protected). Each handler counts its executions in `counts` and reads the key with
the framework's documented one-liner.
"""
# No `from __future__ import annotations` here: FastAPI and Litestar read handler annotations at run time.

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

from idem_asgi import IdempotencyMiddleware, RoutePolicy, current_idempotency
from idem_asgi.backends import MemoryBackend

ROUTES = [
    RoutePolicy("/payments", methods=["POST"], required=True, single_tenant=True),
    RoutePolicy("/stream", methods=["POST"], single_tenant=True),
    RoutePolicy("/boom", methods=["POST"], single_tenant=True),
    RoutePolicy("/slow", methods=["POST"], single_tenant=True),
    RoutePolicy("/bg", methods=["POST"], single_tenant=True),
]


def _payment(counts: Counter[str], name: str, key: str | None, body: bytes) -> dict[str, Any]:
    counts[name] += 1
    return {"id": uuid.uuid4().hex, "key": key, "size": len(body), "amount": 12.30}


async def _chunks() -> AsyncIterator[bytes]:
    for i in range(3):
        await asyncio.sleep(0.01)
        yield f"chunk-{i}-{uuid.uuid4().hex};".encode()


def fastapi_app(counts: Counter[str], background: list[str]) -> Any:
    from fastapi import BackgroundTasks, FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, backend=MemoryBackend(), routes=ROUTES)

    @app.post("/payments", status_code=201)
    async def payments(request: Request) -> dict[str, Any]:
        return _payment(counts, "payments", request.state.idempotency.key, await request.body())

    @app.post("/stream")
    async def stream() -> StreamingResponse:
        counts["stream"] += 1
        return StreamingResponse(_chunks(), media_type="text/plain")

    @app.post("/boom")
    async def boom() -> None:
        counts["boom"] += 1
        raise RuntimeError("card network exploded")

    @app.post("/slow")
    async def slow() -> dict[str, Any]:
        await asyncio.sleep(0.3)
        return _payment(counts, "slow", None, b"")

    @app.post("/bg")
    async def bg(tasks: BackgroundTasks) -> dict[str, Any]:
        tasks.add_task(_note, background)
        return _payment(counts, "bg", None, b"")

    @app.post("/free")
    async def free() -> dict[str, Any]:
        return _payment(counts, "free", None, b"")

    return app


def starlette_app(counts: Counter[str], background: list[str]) -> Any:
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def payments(request: Request) -> JSONResponse:
        return JSONResponse(_payment(counts, "payments", request.state.idempotency.key, await request.body()), 201)

    async def stream(request: Request) -> StreamingResponse:
        counts["stream"] += 1
        return StreamingResponse(_chunks(), media_type="text/plain")

    async def boom(request: Request) -> JSONResponse:
        counts["boom"] += 1
        raise RuntimeError("card network exploded")

    async def slow(request: Request) -> JSONResponse:
        await asyncio.sleep(0.3)
        return JSONResponse(_payment(counts, "slow", None, b""))

    async def bg(request: Request) -> JSONResponse:
        return JSONResponse(_payment(counts, "bg", None, b""), background=BackgroundTask(_note, background))

    async def free(request: Request) -> JSONResponse:
        return JSONResponse(_payment(counts, "free", None, b""))

    routes = [Route(f"/{f.__name__}", f, methods=["POST"]) for f in (payments, stream, boom, slow, bg, free)]
    return Starlette(
        routes=routes, middleware=[Middleware(IdempotencyMiddleware, backend=MemoryBackend(), routes=ROUTES)]
    )


def litestar_app(counts: Counter[str], background: list[str]) -> Any:
    from litestar import Litestar, Request, Response, post
    from litestar.background_tasks import BackgroundTask
    from litestar.middleware import DefineMiddleware
    from litestar.response import Stream

    @post("/payments", status_code=201)
    async def payments(request: Request[Any, Any, Any]) -> dict[str, Any]:
        return _payment(counts, "payments", request.state.idempotency.key, await request.body())

    @post("/stream", status_code=200)
    async def stream() -> Stream:
        counts["stream"] += 1
        return Stream(_chunks(), media_type="text/plain")

    @post("/boom")
    async def boom() -> None:
        counts["boom"] += 1
        raise RuntimeError("card network exploded")

    @post("/slow", status_code=200)
    async def slow() -> dict[str, Any]:
        await asyncio.sleep(0.3)
        return _payment(counts, "slow", None, b"")

    @post("/bg", status_code=200)
    async def bg() -> Response[dict[str, Any]]:
        return Response(_payment(counts, "bg", None, b""), background=BackgroundTask(_note, background))

    @post("/free", status_code=200)
    async def free() -> dict[str, Any]:
        return _payment(counts, "free", None, b"")

    return Litestar(
        route_handlers=[payments, stream, boom, slow, bg, free],
        middleware=[DefineMiddleware(IdempotencyMiddleware, backend=MemoryBackend(), routes=ROUTES)],  # type: ignore[arg-type]  # Litestar types ASGI with its own TypedDicts
    )


def falcon_app(counts: Counter[str], background: list[str]) -> Any:
    import falcon
    import falcon.asgi

    class Payments:
        async def on_post(self, req: Any, resp: Any) -> None:
            info = current_idempotency()
            resp.media = _payment(counts, "payments", info.key if info else None, await req.stream.read())
            resp.status = 201

    class Stream:
        async def on_post(self, req: Any, resp: Any) -> None:
            counts["stream"] += 1
            resp.content_type = "text/plain"
            resp.stream = _chunks()

    class Boom:
        async def on_post(self, req: Any, resp: Any) -> None:
            counts["boom"] += 1
            raise RuntimeError("card network exploded")

    class Slow:
        async def on_post(self, req: Any, resp: Any) -> None:
            await asyncio.sleep(0.3)
            resp.media = _payment(counts, "slow", None, b"")

    class Bg:
        async def on_post(self, req: Any, resp: Any) -> None:
            resp.media = _payment(counts, "bg", None, b"")

            async def note() -> None:
                background.append("ran")

            resp.schedule(note)

    class Free:
        async def on_post(self, req: Any, resp: Any) -> None:
            resp.media = _payment(counts, "free", None, b"")

    inner = falcon.asgi.App()
    for path, resource in (
        ("/payments", Payments()),
        ("/stream", Stream()),
        ("/boom", Boom()),
        ("/slow", Slow()),
        ("/bg", Bg()),
        ("/free", Free()),
    ):
        inner.add_route(path, resource)
    return IdempotencyMiddleware(inner, backend=MemoryBackend(), routes=ROUTES)  # type: ignore[arg-type]  # falcon types its ASGI app with dict scopes


def quart_app(counts: Counter[str], background: list[str]) -> Any:
    from quart import Quart, Response, jsonify, request

    app = Quart(__name__)

    @app.post("/payments")
    async def payments() -> Any:
        info = current_idempotency()  # or request.scope["state"]["idempotency"]
        return jsonify(
            _payment(counts, "payments", info.key if info else None, cast(bytes, await request.get_data()))
        ), 201

    @app.post("/stream")
    async def stream() -> Any:
        counts["stream"] += 1
        return Response(_chunks(), mimetype="text/plain")

    @app.post("/boom")
    async def boom() -> Any:
        counts["boom"] += 1
        raise RuntimeError("card network exploded")

    @app.post("/slow")
    async def slow() -> Any:
        await asyncio.sleep(0.3)
        return jsonify(_payment(counts, "slow", None, b""))

    @app.post("/bg")
    async def bg() -> Any:
        async def note() -> None:
            background.append("ran")

        app.add_background_task(note)
        return jsonify(_payment(counts, "bg", None, b""))

    @app.post("/free")
    async def free() -> Any:
        return jsonify(_payment(counts, "free", None, b""))

    # Quart's documented way to add ASGI middleware: wrap its asgi_app.
    app.asgi_app = IdempotencyMiddleware(app.asgi_app, backend=MemoryBackend(), routes=ROUTES)  # type: ignore[method-assign,assignment,arg-type]
    return app


def blacksheep_app(counts: Counter[str], background: list[str]) -> Any:
    from blacksheep import Application, Request, Response, Router, StreamedContent, json

    app = Application(router=Router())  # not the module-wide default router, which every app would share
    post = app.router.post

    @post("/payments")
    async def payments(request: Request) -> Response:
        info = current_idempotency()  # or request.scope["state"]["idempotency"]
        return json(_payment(counts, "payments", info.key if info else None, await request.read() or b""), status=201)

    @post("/stream")
    async def stream(request: Request) -> Response:
        counts["stream"] += 1
        return Response(200, content=StreamedContent(b"text/plain", _chunks))

    @post("/boom")
    async def boom(request: Request) -> Response:
        counts["boom"] += 1
        raise RuntimeError("card network exploded")

    @post("/slow")
    async def slow(request: Request) -> Response:
        await asyncio.sleep(0.3)
        return json(_payment(counts, "slow", None, b""))

    @post("/bg")
    async def bg(request: Request) -> Response:
        async def note() -> None:
            background.append("ran")

        _tasks.add(asyncio.get_running_loop().create_task(note()))
        return json(_payment(counts, "bg", None, b""))

    @post("/free")
    async def free(request: Request) -> Response:
        return json(_payment(counts, "free", None, b""))

    return _Started(app, IdempotencyMiddleware(app, backend=MemoryBackend(), routes=ROUTES))


_tasks: set[Any] = set()


class _Started:
    """Start a BlackSheep app on its first request (what uvicorn's lifespan does; httpx sends none)."""

    def __init__(self, app: Any, asgi: Any) -> None:
        self.app, self.asgi = app, asgi

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if not self.app.started:
            await self.app.start()
        await self.asgi(scope, receive, send)


def django_app(counts: Counter[str], background: list[str]) -> Any:
    from tests.django_project import build

    return build(counts, background, ROUTES, _payment, _chunks)


def _note(background: list[str]) -> None:
    background.append("ran")


FRAMEWORKS: dict[str, Callable[[Counter[str], list[str]], Any]] = {
    "fastapi": fastapi_app,
    "starlette": starlette_app,
    "litestar": litestar_app,
    "falcon": falcon_app,
    "quart": quart_app,
    "blacksheep": blacksheep_app,
    "django": django_app,
}
