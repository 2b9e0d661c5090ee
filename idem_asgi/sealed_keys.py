"""Raw keys sealed with a deployment secret, so the ops tools show a stuck claim by its key.

Stores keep a digest of each (scope, key), not the key (`store_keys=False`, the default): a dump of
Redis or of the table shows no client key, tenant or user. The price is that `idem-asgi stale`,
`reconcile` and a resolver see only that digest. With a secret (`IDEM_ASGI_KEY_SECRET`, or a
backend's `key_secret=`), Redis and Postgres also keep the scope and key sealed with it (AES-256-GCM,
bound to the record's namespace and digest): a dump still shows nothing readable, and the ops tools
given the same secret open it, so a listed claim reads `idem / tenant-42 / pay-7f3a` and a resolver
gets its `RecordKey` with scope and key (`hidden` False).

Rotation: the variable holds secrets separated by commas, newest first. Keys are sealed with the
first and opened with any, so deploy `new,old` everywhere, then drop `old` one TTL later (records
sealed under it have expired by then). A record sealed under a secret the tools do not hold, or
written without one, is listed by its digest (`hidden`), as without this feature.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from collections.abc import Sequence
from typing import Any, Final

from .errors import ConfigurationError, missing_extra
from .records import RecordKey

__all__ = ["ENV_SECRET", "KeySeal", "is_sealed"]

ENV_SECRET: Final = "IDEM_ASGI_KEY_SECRET"
"""The environment variable a backend reads its secrets from when not given `key_secret=`."""
MARK: Final = "\x1fs1"
"""How a sealed key starts: never a client key (visible ASCII) nor a derived one (a method first)."""
MIN_SECRET: Final = 16
_INFO: Final = b"idem_asgi sealed keys v1"
_NONCE: Final = bytes(12)  # each record's key is its own (see KeySeal._cipher)


def is_sealed(value: str | bytes | None) -> bool:
    """Whether a stored key field holds a sealed key (not a raw one)."""
    if isinstance(value, bytes):
        return value.startswith(MARK.encode())
    return value is not None and value.startswith(MARK)


def _aead() -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:  # pragma: no cover - cryptography is in the dev install
        raise missing_extra("sealed keys (IDEM_ASGI_KEY_SECRET) need cryptography", "keys") from None
    return AESGCM


def _pack(*parts: str) -> bytes:
    out = []
    for p in parts:
        raw = p.encode("utf-8", "surrogateescape")
        out += [len(raw).to_bytes(4, "big"), raw]
    return b"".join(out)


class KeySeal:
    """Seals (scope, key) for one record and opens it again; `secrets` newest first."""

    def __init__(self, secrets: Sequence[str]) -> None:
        if not secrets:
            raise ConfigurationError(f"{ENV_SECRET}: give at least one secret")
        self._aead = _aead()
        self._keys: dict[str, bytes] = {}
        self._first = ""
        for secret in secrets:
            if len(secret) < MIN_SECRET:
                raise ConfigurationError(
                    f"{ENV_SECRET}: each secret needs at least {MIN_SECRET} characters "
                    '(python -c "import secrets; print(secrets.token_urlsafe(32))")'
                )
            material = hmac.new(secret.encode(), _INFO, hashlib.sha256).digest()
            kid = hashlib.sha256(material).hexdigest()[:8]
            self._keys.setdefault(kid, material)
            self._first = self._first or kid

    @classmethod
    def from_setting(cls, secret: str | Sequence[str] | None) -> KeySeal | None:
        """From a backend's `key_secret=` (a str of comma-separated secrets, or a list), else from
        `IDEM_ASGI_KEY_SECRET`; None when neither is set, or `key_secret=""` (digests only)."""
        if secret is None:
            secret = os.environ.get(ENV_SECRET, "")
        parts = [s.strip() for s in secret.split(",")] if isinstance(secret, str) else list(secret)
        parts = [p for p in parts if p]
        return cls(parts) if parts else None

    def seal(self, key: RecordKey) -> str:
        """The sealed text of `key`'s scope and key, bound to its namespace and digest."""
        salt = os.urandom(16)
        box = self._cipher(self._keys[self._first], salt).encrypt(
            _NONCE, _pack(key.scope, key.key), _pack(key.namespace, key.digest)
        )
        return MARK + self._first + base64.urlsafe_b64encode(salt + box).decode("ascii")

    def _cipher(self, material: bytes, salt: bytes) -> Any:
        """AES-256-GCM under a key of this record's own (HMAC of a random salt): no nonce is ever
        reused, however many keys one secret seals (random 96-bit nonces would bound that)."""
        return self._aead(hmac.digest(material, salt, "sha256"))

    def open(self, namespace: str, digest: str, sealed: str) -> RecordKey | None:
        """The key a sealed text holds, or None: another secret's, damaged, or not this record's."""
        material = self._keys.get(sealed[len(MARK) : len(MARK) + 8]) if is_sealed(sealed) else None
        if material is None:
            return None
        try:
            raw = base64.urlsafe_b64decode(sealed[len(MARK) + 8 :])
            plain = self._cipher(material, raw[:16]).decrypt(_NONCE, raw[16:], _pack(namespace, digest))
            size = int.from_bytes(plain[:4], "big")
            scope = plain[4 : 4 + size].decode("utf-8", "surrogateescape")
            key = plain[8 + size :].decode("utf-8", "surrogateescape")
        except Exception:  # InvalidTag, bad base64: not openable with these secrets
            return None
        built = RecordKey.build(namespace, scope, key)
        return built if built.digest == digest else None


def opened(seal: KeySeal | None, namespace: str, digest: str, sealed: str | None) -> RecordKey:
    """A listed record's key: opened when it was sealed with one of `seal`'s secrets, else by digest."""
    if seal is not None and sealed:
        key = seal.open(namespace, digest, sealed)
        if key is not None:
            return key
    return RecordKey.hashed(namespace, digest)
