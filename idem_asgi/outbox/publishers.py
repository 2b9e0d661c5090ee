"""Where the relay publishes: RabbitMQ (aio-pika) or NATS JetStream (nats-py), each with the outbox
row's id as the message id, and a publish that returns only once the broker has the message.

A publisher connects lazily and again after its connection broke, so a broker that was down when
the relay started, or restarted under it, costs retries, not a restart of the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

from ..errors import ConfigurationError
from ._table import OutboxMessage


class Publisher(Protocol):
    """Publishes one message; returns once the broker has it (confirmed), raises otherwise."""

    async def publish(self, message: OutboxMessage) -> None: ...

    async def aclose(self) -> None: ...


class RabbitPublisher:
    """Publishes to an exchange (default: the default exchange, routing key = the message's
    subject, so a subject names a queue) with publisher confirms, `mandatory` set (a message no
    queue takes is an error, retried, never dropped) and persistent delivery."""

    def __init__(self, url: str, *, exchange: str = "", timeout: float = 10.0) -> None:
        self.url = url
        self.exchange_name = exchange
        self.timeout = timeout
        self._connection: Any = None
        self._channel: Any = None
        self._exchange: Any = None
        self._connecting = asyncio.Lock()  # keys publish side by side: one connection for all

    async def _ready(self) -> Any:
        async with self._connecting:
            if self._exchange is None or self._channel is None or self._channel.is_closed:
                await self.aclose()  # the broker closed the channel or dropped the connection
                return await self._connect()
            return self._exchange

    async def _connect(self) -> Any:
        import aio_pika

        self._connection = await aio_pika.connect(self.url, timeout=self.timeout)
        self._channel = channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
        self._exchange = (
            channel.default_exchange
            if not self.exchange_name
            else await channel.get_exchange(self.exchange_name, ensure=True)
        )
        return self._exchange

    async def publish(self, message: OutboxMessage) -> None:
        import aio_pika

        try:
            exchange = await self._ready()
            await exchange.publish(
                aio_pika.Message(
                    message.body,
                    message_id=message.id,
                    headers=dict(message.headers),
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=message.subject,
                mandatory=True,
                timeout=self.timeout,
            )
        except (aio_pika.exceptions.DeliveryError, aio_pika.exceptions.PublishError):
            raise  # the broker refused this message (no queue took it): the connection is fine
        except Exception:
            await self.aclose()  # anything else may have broken it: connect again on the next publish
            raise

    async def aclose(self) -> None:
        connection, self._connection, self._channel, self._exchange = self._connection, None, None, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()


class NatsPublisher:
    """Publishes to JetStream with `Nats-Msg-Id` set to the message's id: the stream drops a second
    publish of it within its `duplicate_window`, and a consumer keyed by the header (the default of
    `nats_handler`) applies it once after that. A subject no stream takes is an error, retried."""

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        self.url = url
        self.timeout = timeout
        self._nc: Any = None
        self._js: Any = None
        self._connecting = asyncio.Lock()

    async def _ready(self) -> Any:
        async with self._connecting:
            if self._js is None or self._nc is None or self._nc.is_closed:
                await self._connect()
            return self._js

    async def _connect(self) -> None:
        import nats

        # No reconnect loop of nats-py's own (its first connect would retry for minutes): a closed
        # connection is opened again by the next publish, and a failed connect is that publish's error.
        self._nc = await asyncio.wait_for(
            nats.connect(self.url, connect_timeout=self.timeout, allow_reconnect=False), self.timeout
        )
        self._js = self._nc.jetstream(timeout=self.timeout)

    async def publish(self, message: OutboxMessage) -> None:
        js = await self._ready()
        headers = {**message.headers, "Nats-Msg-Id": message.id}
        await js.publish(message.subject, message.body, timeout=self.timeout, headers=headers)

    async def aclose(self) -> None:
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()


def publisher_for(url: str, *, exchange: str = "", timeout: float = 10.0) -> Publisher:
    """A publisher for `amqp://`/`amqps://` (RabbitMQ) or `nats://`/`tls://` (NATS JetStream)."""
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("amqp", "amqps"):
        return RabbitPublisher(url, exchange=exchange, timeout=timeout)
    if scheme in ("nats", "tls"):
        if exchange:
            raise ConfigurationError("--exchange is for RabbitMQ; NATS publishes to the message's subject")
        return NatsPublisher(url, timeout=timeout)
    raise ConfigurationError(f"relay: a broker URL is amqp://, amqps://, nats:// or tls://, got {url!r}")
