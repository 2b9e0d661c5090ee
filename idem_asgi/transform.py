"""Transforming answers on their way into the store and back: so that card data or personal data in
a response body never sits in Redis or Postgres in clear.

`IdempotencyMiddleware(transform=...)` takes any object with `store(response) -> StoredResponse`
(applied before every write of an answer: completion, its background retries, recovered answers)
and `load(response) -> StoredResponse` (applied to every sealed answer read back before it is
replayed). The client that ran the request gets the app's own bytes; replays get
`load(store(answer))`, so a transform whose `load` undoes `store` keeps replays byte-identical.

Each stored answer says whether it was sealed (`StoredResponse.sealed`, set by `seal`), so turning
a transform on, rotating its key or turning it off is an ordinary deploy: an answer stored in clear
(before the transform, or by a release that stores in clear) replays as it was stored; a sealed one
goes through `load`. A sealed answer that cannot be opened (a key that cannot decrypt it, or an app
without a transform) answers 500 `store-misconfigured` and never runs the app again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final, Protocol, runtime_checkable

import msgspec

from .records import StoredResponse

Cipher = Callable[[bytes], bytes]


@runtime_checkable
class AnswerTransform(Protocol):
    def store(self, response: StoredResponse, /) -> StoredResponse: ...
    def load(self, response: StoredResponse, /) -> StoredResponse: ...


class Unsealable(Exception):
    """A sealed answer and no transform to open it (the middleware answers 500 `store-misconfigured`)."""


def seal(transform: AnswerTransform | None, response: StoredResponse) -> StoredResponse:
    """`response` as the store keeps it: through `transform.store`, and marked sealed unless the
    transform handed it back unchanged (it stores in clear, as `EncryptBody(None, ...)` does)."""
    if transform is None:
        return response
    stored = transform.store(response)
    return stored if stored is response else msgspec.structs.replace(stored, sealed=True)


def unseal(transform: AnswerTransform | None, response: StoredResponse) -> StoredResponse:
    """A stored answer as it is replayed: in clear as it is, sealed through `transform.load`.

    Raises `Unsealable` for a sealed answer without a transform, or whatever `load` raises.
    """
    if not response.sealed:
        return response
    if transform is None:
        raise Unsealable("a sealed answer, and no transform to open it")
    return msgspec.structs.replace(transform.load(response), sealed=False)


class EncryptBody:
    """Encrypt the body (and, with `headers=True`, the headers) with your own cipher.

    `encrypt`/`decrypt` are bytes -> bytes, e.g. `cryptography.fernet.Fernet(key).encrypt` and
    `.decrypt`; the status stays in clear for the ops tools. To rotate keys, encrypt with the new
    one and keep the old ones readable: `decrypt` may be a list of decrypters, newest first (each
    is tried in turn), or one `MultiFernet([new, old]).decrypt`. To turn encryption off, deploy
    `EncryptBody(None, decrypt)` for one TTL (it opens the sealed answers and stores new ones in
    clear), then drop the transform.
    """

    __slots__ = ("decrypters", "encrypt", "headers")

    def __init__(self, encrypt: Cipher | None, decrypt: Cipher | Sequence[Cipher], *, headers: bool = True) -> None:
        self.encrypt = encrypt
        self.decrypters: tuple[Cipher, ...] = (decrypt,) if callable(decrypt) else tuple(decrypt)
        if not self.decrypters or not all(callable(d) for d in self.decrypters):
            raise TypeError("EncryptBody needs a decrypt callable, or a non-empty list of them (newest first)")
        self.headers = headers

    def store(self, response: StoredResponse, /) -> StoredResponse:
        if self.encrypt is None:
            return response  # open-only: new answers are stored in clear (and not marked sealed)
        body = response.body
        headers = response.headers
        if self.headers:  # one sealed blob: [headers, body]
            body = _pack([headers, body])
            headers = _SEALED_HEADERS
        return msgspec.structs.replace(response, headers=headers, body=self.encrypt(body))

    def load(self, response: StoredResponse, /) -> StoredResponse:
        body = self.decrypt(response.body)
        if self.headers and response.headers == _SEALED_HEADERS:
            headers, body = _unpack(body)
            return msgspec.structs.replace(response, headers=headers, body=body)
        return msgspec.structs.replace(response, body=body)

    def decrypt(self, sealed: bytes) -> bytes:
        """The first decrypter that opens `sealed` (newest key first); the last one's error if none does."""
        *older, oldest = self.decrypters
        for decrypter in older:
            try:
                return decrypter(sealed)
            except Exception:
                continue
        return oldest(sealed)


_SEALED_HEADERS: Final = [(b"x-idem-sealed", b"1")]
_pack = msgspec.msgpack.Encoder().encode
_unpack = msgspec.msgpack.Decoder(tuple[list[tuple[bytes, bytes]], bytes]).decode
