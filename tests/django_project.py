"""The framework suite's payments API as a Django project: `get_asgi_application()` wrapped by the
middleware, async views, and a payment written through the ORM inside `transaction.atomic()`.

Django's settings are process-wide, so they are configured once (SQLite in a temporary file: the
ORM runs in a worker thread, which an in-memory database would not share); each `build` installs
fresh views (and clears Django's URL caches) so each test counts its own executions.
"""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from idem_asgi import IdempotencyMiddleware, RoutePolicy, current_idempotency
from idem_asgi.backends import MemoryBackend

urlpatterns: list[Any] = []
_tasks: set[asyncio.Task[None]] = set()


def _configure() -> None:
    import django
    from django.conf import settings

    if settings.configured:
        return
    database = Path(tempfile.mkdtemp(prefix="idem-django-")) / "db.sqlite3"
    settings.configure(
        DEBUG=False,
        SECRET_KEY="tests-only",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=__name__,
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(database)}},
        MIDDLEWARE=[],
        USE_TZ=True,
        LOGGING_CONFIG=None,  # leave the test run's logging alone
    )
    django.setup()
    from django.core.management import call_command

    # In a thread of its own: the suite builds apps inside a running event loop, where Django's
    # ORM refuses synchronous calls.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(call_command, "migrate", run_syncdb=True, verbosity=0).result()


def build(
    counts: Counter[str],
    background: list[str],
    routes: Sequence[RoutePolicy],
    payment: Callable[[Counter[str], str, str | None, bytes], dict[str, Any]],
    chunks: Callable[[], AsyncIterator[bytes]],
) -> Any:
    _configure()
    from asgiref.sync import sync_to_async
    from django.contrib.auth.models import User
    from django.core.asgi import get_asgi_application
    from django.db import transaction
    from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
    from django.urls import clear_url_caches, path

    def charge(key: str | None, body: bytes) -> dict[str, Any]:
        with transaction.atomic():  # the payment and its ledger row commit together
            User.objects.create(username=f"pay-{uuid.uuid4().hex}")
            return payment(counts, "payments", key, body)

    async def payments(request: HttpRequest) -> HttpResponse:
        info = current_idempotency()  # or request.scope["state"]["idempotency"] (an ASGIRequest)
        # Forward info.key to the provider as its idempotency key (see the README).
        return JsonResponse(await sync_to_async(charge)(info.key if info else None, request.body), status=201)

    async def stream(request: HttpRequest) -> HttpResponse:
        counts["stream"] += 1
        return StreamingHttpResponse(chunks(), content_type="text/plain")

    async def boom(request: HttpRequest) -> HttpResponse:
        counts["boom"] += 1
        raise RuntimeError("card network exploded")

    async def slow(request: HttpRequest) -> HttpResponse:
        await asyncio.sleep(0.3)
        return JsonResponse(payment(counts, "slow", None, b""))

    async def bg(request: HttpRequest) -> HttpResponse:
        async def note() -> None:
            background.append("ran")

        _tasks.add(asyncio.get_running_loop().create_task(note()))
        return JsonResponse(payment(counts, "bg", None, b""))

    async def free(request: HttpRequest) -> HttpResponse:
        return JsonResponse(payment(counts, "free", None, b""))

    from django.views.decorators.csrf import csrf_exempt

    views = {"payments": payments, "stream": stream, "boom": boom, "slow": slow, "bg": bg, "free": free}
    urlpatterns[:] = [path(name, csrf_exempt(view)) for name, view in views.items()]
    clear_url_caches()
    return IdempotencyMiddleware(get_asgi_application(), backend=MemoryBackend(), routes=routes)
