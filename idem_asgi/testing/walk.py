"""Finding every `IdempotencyMiddleware` reachable from an app, whatever the framework built."""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping
from typing import Any, Final, cast

from ..http.middleware import IdempotencyMiddleware

_WALK_LIMIT: Final = 200_000
_ATOMS: Final = (str, bytes, bytearray, int, float, complex, bool, type(None), type, types.ModuleType)


def find_middleware(app: object) -> list[IdempotencyMiddleware]:
    """Every `IdempotencyMiddleware` reachable from `app`, outermost first.

    Starlette and FastAPI build their middleware stack at the first request; this builds it now,
    exactly as that first request would (so `add_middleware` is refused afterwards, as after any
    request). Litestar builds one middleware instance per route: all of them are returned.
    """
    if getattr(app, "middleware_stack", False) is None and callable(getattr(app, "build_middleware_stack", None)):
        target = cast(Any, app)
        target.middleware_stack = target.build_middleware_stack()
    found: list[IdempotencyMiddleware] = []
    seen: set[int] = set()
    queue: list[object] = [app]
    for obj in queue:  # breadth first; the list grows while we walk it
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if len(seen) > _WALK_LIMIT:
            break
        try:
            if isinstance(obj, _ATOMS):
                continue
            if isinstance(obj, IdempotencyMiddleware):
                found.append(obj)
            queue.extend(list(_children(obj)))
        except Exception:  # a proxy that refuses to be looked at (Quart's `request` outside a request)
            continue
    return found


def _children(obj: object) -> Iterator[object]:
    if isinstance(obj, Mapping):
        yield from obj.values()
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        yield from obj
        return
    if isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            try:
                yield cell.cell_contents
            except ValueError:  # an empty cell
                continue
        return
    if isinstance(obj, types.MethodType):
        yield obj.__self__
        return
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        yield from attrs.values()
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                descriptor = klass.__dict__.get(name)
                if isinstance(descriptor, types.MemberDescriptorType):
                    try:
                        yield descriptor.__get__(obj, klass)
                    except AttributeError:  # slot not set
                        continue
