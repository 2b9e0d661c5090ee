"""What `@idempotent` refuses at decoration time, because no retry could make it safe later.

- Not an `async def` function: a sync function's body would run, then fail on `await` (the claim
  released, so every retry runs it again); a generator has no single result to store.
- A default namespace that is not the same in every process: `__main__` (the module is
  `__main__` when run as a script and `job` when imported: one key, two runs), a function defined
  inside another (`<locals>`: every function a wrapper without `functools.wraps` returns shares its
  qualified name), a name that is not its code's, or one another function already uses.
- A return annotation msgspec cannot encode and decode: every repeat would fail to decode it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any, get_type_hints

import msgspec
import msgspec.inspect as mi

from .errors import ConfigurationError

_spaces: dict[str, tuple[str, int]] = {}  # default namespace -> where its function is defined


def checked_function(func: Callable[..., Any], names: tuple[str, ...]) -> inspect.Signature:
    """`func`'s signature, once it is known to be an `async def` function with the `args=` names."""
    what = getattr(func, "__qualname__", repr(func))
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
    try:
        returns = get_type_hints(func).get("return", Any)
        msgspec.msgpack.Decoder(returns)
        custom = next(_custom_types(mi.type_info(returns), set()), None)
    except (NameError, TypeError) as exc:
        raise ConfigurationError(
            f"idempotent: the return annotation of {func.__qualname__} is not usable: {exc}"
        ) from None
    if custom is not None:
        raise ConfigurationError(
            f"idempotent: {func.__qualname__} returns {custom.__qualname__}, which msgspec cannot store; "
            "return a msgspec.Struct, a dataclass or builtin types"
        )
    return returns


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
    module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
    code = getattr(inspect.unwrap(func), "__code__", None)
    fix = 'pass namespace="..." (a name that stays the same: "jobs:charge")'
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
    where = (code.co_filename, code.co_firstlineno)
    if _spaces.setdefault(space, where) != where:
        raise ConfigurationError(
            f"idempotent: the default namespace {space!r} is already used by another function "
            f"({_spaces[space][0]}:{_spaces[space][1]}); {fix}"
        )
    return space
