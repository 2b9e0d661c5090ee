"""One store per URL (and one default memory store per `routes` list) shared by every middleware instance.

Some frameworks build one middleware instance per route handler (Litestar's `DefineMiddleware`
built 26 for 3 handlers, its own OpenAPI routes included). Each instance building its own store
would open one connection pool each, and a header key reused on two routes would meet two stores.
So a store given as a URL is built once per process and URL, and the default memory store once per
`routes` list object (what such frameworks pass to every instance). Entries live as long as some
middleware uses them.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from .backends import Backend, backend_from_url
from .backends.memory import MemoryBackend
from .errors import ConfigurationError

_by_url: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_by_routes: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def backend_for(backend: Backend | str | None, routes: Sequence[object]) -> Backend:
    """The store a middleware uses: the one given, the shared one for a URL, or the shared default."""
    if backend is None:
        found = _by_routes.get(id(routes))
        if found is None or found._shared_routes is not routes:
            found = MemoryBackend()
            found._shared_routes = routes  # type: ignore[attr-defined]  # pins the id while shared
            _by_routes[id(routes)] = found
        backend = found
    elif isinstance(backend, str):
        found = _by_url.get(backend)
        if found is None:
            found = backend_from_url(backend)
            _by_url[backend] = found
        backend = found
    if not isinstance(backend, Backend):
        raise ConfigurationError(f"{backend!r} does not implement the idem_asgi Backend protocol")
    return backend
