"""An outbox committed with the claim: messages that announce an effect commit in its transaction,
and a relay publishes them to RabbitMQ or NATS with a stable message id (at least once; consumers
keyed by that id apply each once). PostgreSQL only: see docs/outbox.md for what Redis can promise.

    outbox = Outbox(backend)
    async with backend.transaction() as conn:
        await conn.execute("INSERT INTO charges ...")
        await outbox.add(conn, "payments.charged", body)
"""

from ._table import Backlog, Outbox, OutboxMessage
from .publishers import NatsPublisher, Publisher, RabbitPublisher, publisher_for
from .relay import Relay, RelayStats

__all__ = [
    "Backlog",
    "NatsPublisher",
    "Outbox",
    "OutboxMessage",
    "Publisher",
    "RabbitPublisher",
    "Relay",
    "RelayStats",
    "publisher_for",
]
