"""Transforming answers on their way into the store and back: so that card data or personal data in
a response body never sits in Redis or Postgres in clear.

`IdempotencyMiddleware(transform=...)` takes any object with `store(response) -> StoredResponse`
(applied before every write of an answer: completion, its background retries, recovered answers)
and `load(response) -> StoredResponse` (applied to every answer read back before it is replayed).
The client that ran the request gets the app's own bytes; replays get `load(store(answer))`, so a
transform whose `load` undoes `store` keeps replays byte-identical. A `load` that fails (a key that
cannot decrypt) answers 500 `store-misconfigured` and never runs the app again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import msgspec

from .records import StoredResponse


@runtime_checkable
class AnswerTransform(Protocol):
    def store(self, response: StoredResponse, /) -> StoredResponse: ...
    def load(self, response: StoredResponse, /) -> StoredResponse: ...


class EncryptBody:
    """Encrypt the body (and, with `headers=True`, the headers) with your own cipher.

    `encrypt`/`decrypt` are bytes -> bytes, e.g. `cryptography.fernet.Fernet(key).encrypt` and
    `.decrypt` (`MultiFernet` for key rotation); the status stays in clear for the ops tools.
    """

    __slots__ = ("decrypt", "encrypt", "headers")

    def __init__(
        self, encrypt: Callable[[bytes], bytes], decrypt: Callable[[bytes], bytes], *, headers: bool = True
    ) -> None:
        self.encrypt = encrypt
        self.decrypt = decrypt
        self.headers = headers

    def store(self, response: StoredResponse, /) -> StoredResponse:
        body = response.body
        headers = response.headers
        if self.headers:  # one sealed blob: [headers, body]
            body = _pack([headers, body])
            headers = [(b"x-idem-sealed", b"1")]
        return msgspec.structs.replace(response, headers=headers, body=self.encrypt(body))

    def load(self, response: StoredResponse, /) -> StoredResponse:
        body = self.decrypt(response.body)
        if self.headers and response.headers == [(b"x-idem-sealed", b"1")]:
            headers, body = _unpack(body)
            return msgspec.structs.replace(response, headers=headers, body=body)
        return msgspec.structs.replace(response, body=body)


_pack = msgspec.msgpack.Encoder().encode
_unpack = msgspec.msgpack.Decoder(tuple[list[tuple[bytes, bytes]], bytes]).decode
