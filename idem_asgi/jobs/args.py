"""A job's arguments as its fingerprint and as its `args=` key: deterministic, unambiguous, typed.

A retry must give the same bytes whatever order its mappings were built in (a dict filled in
another order, `**kwargs` passed in another order), and two different calls must never give one
key. So:

- **Fingerprint**: msgpack of the arguments by parameter, in the signature's order, leaving out
  every argument equal to its parameter's default (of the same type); every mapping inside
  (`**kwargs` too) with its entries sorted by their encoded key, every set sorted. So a deploy that
  adds a parameter with a default, a caller that passes keywords in another order, or one that
  passes a default explicitly, makes the same call. Types count as msgpack keeps them: `1`, `1.0` and `True` are
  three different arguments (a retry that passes `1.0` for `1` gets `KeyReused`, never a second
  run); a tuple and a list of the same items are the same.
- **Key** (`args=["order_id", ...]`): `name=value` joined by `,`, each value its JSON text, and a
  string bare only when it cannot be read as anything else (no `,`, `"` or `\\`, and not itself a
  JSON number, `true`, `null`...): `order_id=o1`, `order_id=1` for the int and `order_id="1"` for
  the string. Read left to right, a bare value ends at the next `,` and a JSON one where its
  text ends, so no two argument tuples give one key (`("x,b=y", "z")` and `("x", "y,b=z")` do
  not). Values JSON writes as strings (UUID, datetime, Decimal, str enums) key as that string.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from ..errors import ConfigurationError

_plain = msgspec.msgpack.Encoder().encode
_ordered = msgspec.msgpack.Encoder(order="deterministic").encode  # also sorts the dicts inside Structs
_json = msgspec.json.Encoder(order="deterministic").encode


def fingerprint(arguments: Mapping[str, Any], signature: inspect.Signature | None = None) -> bytes:
    """SHA-256 of the arguments' canonical msgpack (see the module docstring); with the function's
    `signature`, arguments equal to their parameter's default are left out."""
    params = {} if signature is None else signature.parameters
    try:
        significant = {
            name: _canonical(value)
            for name, value in arguments.items()
            if not (name in params and _is_default(params[name], value))
        }
        return hashlib.sha256(_plain(significant)).digest()
    except (TypeError, OverflowError, msgspec.EncodeError) as exc:
        raise ConfigurationError(
            f"idempotent: the arguments cannot be fingerprinted ({exc}); pass fingerprint=[names of encodable ones]"
        ) from None


def _is_default(param: inspect.Parameter, value: Any) -> bool:
    """Whether `value` is what the call would have had without it: the parameter's default (the same
    type and equal), or nothing for `*args` / `**kwargs`."""
    if param.kind is inspect.Parameter.VAR_POSITIONAL:
        return value == ()  # type: ignore[no-any-return]
    if param.kind is inspect.Parameter.VAR_KEYWORD:
        return value == {}  # type: ignore[no-any-return]
    default = param.default
    if default is inspect.Parameter.empty:
        return False
    if value is default:
        return True
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # an __eq__ that refuses (arrays): count it as given
        return False


def _canonical(value: Any) -> Any:
    """`value` with its mappings and sets in a fixed order (pre-encoded as `msgspec.Raw`)."""
    if isinstance(value, dict):
        pairs = sorted((_encoded(k), _encoded(v)) for k, v in value.items())
        return msgspec.Raw(_header(len(pairs), 0x80, 0xDE) + b"".join(k + v for k, v in pairs))
    if isinstance(value, (set, frozenset)):
        items = sorted(_encoded(v) for v in value)
        return msgspec.Raw(_header(len(items), 0x90, 0xDC) + b"".join(items))
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def _encoded(value: Any) -> bytes:
    canonical = _canonical(value)
    try:
        return _ordered(canonical)
    except TypeError:  # a Struct or dataclass holding a dict with non-str keys: its own order
        return _plain(canonical)


def _header(n: int, fix: int, wide: int) -> bytes:
    """msgpack's map (0x80, 0xDE) or array (0x90, 0xDC) header for `n` entries."""
    if n < 16:
        return bytes([fix | n])
    if n < 1 << 16:
        return bytes([wide]) + n.to_bytes(2, "big")
    return bytes([wide + 1]) + n.to_bytes(4, "big")


def args_key(arguments: Mapping[str, Any], names: Iterable[str]) -> str:
    """The key of an `args=` job: `name=value` joined by `,` (see the module docstring)."""
    return ",".join(f"{name}={_text(name, arguments[name])}" for name in names)


def _text(name: str, value: Any) -> str:
    try:
        text = _json(value).decode()
    except (TypeError, msgspec.EncodeError) as exc:
        raise ConfigurationError(
            f"idempotent: argument {name!r} cannot make a key ({exc}); pass key=callable"
        ) from None
    if text.startswith('"'):
        bare: str = msgspec.json.decode(text)
        if _reads_as_itself(bare):
            return bare
    return text


def _reads_as_itself(s: str) -> bool:
    """True when `s` written bare cannot be mistaken for a separator, a JSON value or a quoted string."""
    if "," in s or '"' in s or "\\" in s:
        return False
    try:
        json.loads(s)
    except ValueError:
        return True
    return False  # "1", "true", "null", " 2", "[]": bare, it would read as that value
