"""One subscription per `RedisBackend` to its channel, for repeats held in this process on a claim
held in another: the scripts that end a watched claim publish its key there.

Opened on the first `watch`, re-opened after a dropped connection (by redis-py itself, or here). A
notice published while it is down is never seen, so each drop tells every listener `None`
("anything may have changed"): held repeats read their records again (and poll until it is back).
A role refused the channel (ACL `NOPERM`) turns notices off for good: repeats poll, as on a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from redis import exceptions as redis_errors

from .._listeners import Listeners

logger = logging.getLogger("idem_asgi")


class Notices(Listeners):
    def __init__(self, client: Any, channel: bytes) -> None:
        super().__init__()
        self._client = client
        self._channel = channel

    async def _run(self, ready: asyncio.Event) -> None:
        delay = 0.1
        while True:
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                # redis-py reconnects a dropped subscription by itself, without a word to us.
                pubsub.connection.register_connect_callback(self._reconnected)
                ready.set()
                delay = 0.1
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self._tell(message["data"])
            except redis_errors.NoPermissionError:
                logger.warning("idem_asgi: redis refuses the channel %r; held repeats poll instead", self._channel)
                self._refused = True
                ready.set()
                return
            except (redis_errors.RedisError, OSError) as exc:
                ready.clear()
                logger.info("idem_asgi: redis notices interrupted (%r); resubscribing", exc)
                self._tell_all(None)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
            finally:
                if pubsub.connection is not None:  # it goes back to the pool: never tell from it again
                    pubsub.connection.deregister_connect_callback(self._reconnected)
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _reconnected(self, connection: Any) -> None:
        """The subscription was dropped and made again: what was published meanwhile is lost."""
        self._tell_all(None)

    def _tell(self, name: bytes) -> None:
        self._tell_all(name[-65:-1].decode("ascii", "replace"))  # the key is `{prefix}{<digest>}`
