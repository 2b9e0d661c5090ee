"""What `@idempotent` refuses at decoration time, because no retry could make it safe later.

- Not an `async def` function: a sync function's body would run, then fail on `await` (the claim
  released, so every retry runs it again); a generator has no single result to store.
- A default namespace that is not the same in every process, or not one function's:
  `__main__` (the module is `__main__` when run as a script and `job` when imported: one key, two
  runs), a function defined inside another (`<locals>`: every function a wrapper without
  `functools.wraps` returns shares its qualified name), a name that is not its code's, a
  `functools.partial` (no name of its own: two partials of one function would share it), one
  another function already uses, and so one of several functions made by one `def` in a loop.
- A return annotation msgspec cannot encode and decode: every repeat would fail to decode it.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any, get_type_hints

import msgspec
import msgspec.inspect as mi

from ..errors import ConfigurationError

_spaces: dict[str, tuple[str, int, Any, weakref.ref[Any]]] = {}
"""Default namespace -> where its function is defined, its code, and the function."""


def _target(func: Callable[..., Any]) -> Callable[..., Any]:
    """The function a `functools.partial` calls (its annotations are that function's)."""
    while isinstance(func, functools.partial):
        func = func.func
    return func


def _name(func: Callable[..., Any]) -> str:
    return getattr(_target(func), "__qualname__", None) or repr(func)


def checked_function(func: Callable[..., Any], names: tuple[str, ...]) -> inspect.Signature:
    """`func`'s signature, once it is known to be an `async def` function with the `args=` names."""
    what = _name(func)
    if inspect.isasyncgenfunction(func) or inspect.isgeneratorfunction(func):
        raise ConfigurationError(f"idempotent: {what} is a generator; it has no single result to store")
    if not inspect.iscoroutinefunction(func):
        raise ConfigurationError(
            f"idempotent: {what} is not an `async def` function (a sync body would run before the call "
            "failed, and every retry would run it again); decorate the async function itself"
        )
    signature = inspect.signature(func)
    missing = [n for n in names if n not in signature.parameters]
    if missing:
        raise ConfigurationError(f"idempotent: args={missing!r} are not parameters of {what}")
    return signature


def checked_returns(func: Callable[..., Any]) -> Any:
    """`func`'s return annotation (Any without one), once msgspec can encode and decode it."""
    target = _target(func)
    annotation = inspect.get_annotations(target).get("return", Any)
    try:
        # Only the return annotation is resolved: a parameter's type imported under TYPE_CHECKING is
        # not needed to store the result, and must not fail the decoration.
        returns = get_type_hints(_Returns(annotation), getattr(target, "__globals__", None)).get("return", Any)
        msgspec.msgpack.Decoder(returns)
        custom = next(_custom_types(mi.type_info(returns), set()), None)
    except (NameError, TypeError) as exc:
        raise ConfigurationError(
            f"idempotent: the return annotation of {_name(func)} ({annotation!r}) is not usable: {exc}"
        ) from None
    if custom is not None:
        raise ConfigurationError(
            f"idempotent: {_name(func)} returns {custom.__qualname__}, which msgspec cannot store; "
            "return a msgspec.Struct, a dataclass or builtin types"
        )
    return returns


class _Returns:
    """An object with only a return annotation, for `get_type_hints` to resolve it alone."""

    def __init__(self, annotation: Any) -> None:
        self.__annotations__ = {"return": annotation}


def _custom_types(t: mi.Type, seen: set[int]) -> Iterator[type]:
    """The classes msgspec would only know through hooks, anywhere in the type `t`."""
    if isinstance(t, mi.CustomType):
        yield t.cls
        return
    if id(t) in seen:
        return
    seen.add(id(t))
    for name in t.__struct_fields__:
        value = getattr(t, name)
        for item in value if isinstance(value, tuple) else (value,):
            inner = item.type if isinstance(item, mi.Field) else item
            if isinstance(inner, mi.Type):
                yield from _custom_types(inner, seen)


def default_namespace(func: Callable[..., Any]) -> str:
    """`jobs:<module>.<qualified name>`, refused unless every process would compute the same."""
    fix = 'pass namespace="..." (a name that stays the same: "jobs:charge")'
    if isinstance(func, functools.partial):
        raise ConfigurationError(
            f"idempotent: a functools.partial of {_name(func)} has no name of its own (two partials of one "
            f"function would share one key space); {fix}"
        )
    module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
    code = getattr(inspect.unwrap(func), "__code__", None)
    if module is None or qualname is None or code is None:
        raise ConfigurationError(f"idempotent: {func!r} has no stable name for a default namespace; {fix}")
    space = f"jobs:{module}.{qualname}"
    if module == "__main__":
        raise ConfigurationError(
            f"idempotent: the default namespace {space!r} depends on how the module is started (run as a "
            f"script it is __main__, imported it is its name: one key, two runs); {fix}"
        )
    if "<locals>" in qualname:
        raise ConfigurationError(
            f"idempotent: {qualname} is defined inside another function (a wrapper without functools.wraps "
            f"gives every function it wraps this name, and so one key space); {fix}"
        )
    if not hasattr(func, "__wrapped__") and code.co_name != getattr(func, "__name__", None):
        raise ConfigurationError(f"idempotent: {qualname} is named apart from its code ({code.co_name}); {fix}")
    _claim_space(space, func, code, fix)
    return space


def _claim_space(space: str, func: Callable[..., Any], code: Any, fix: str) -> None:
    """Refuse `space` when another live function has it: defined elsewhere, or by the same `def`
    (a loop: one code, several functions). The same function again (another store) and a module
    reloaded (new code at the same place) keep it."""
    where = (code.co_filename, code.co_firstlineno)
    known = _spaces.get(space)
    if known is not None:
        if known[:2] != where:
            raise ConfigurationError(
                f"idempotent: the default namespace {space!r} is already used by another function "
                f"({known[0]}:{known[1]}); {fix}"
            )
        earlier = known[3]()
        if known[2] is code and earlier is not None and earlier is not func:
            raise ConfigurationError(
                f"idempotent: {space!r} is the default namespace of several functions made by one `def` "
                f"(decorated in a loop: one key space for all of them); {fix}"
            )
    _spaces[space] = (*where, code, weakref.ref(func))
