"""Message consumers that apply each message once: RabbitMQ (aio-pika) and NATS JetStream (nats-py).

A broker delivers at least once: a consumer that dies after the effect and before its ack gets the
message redelivered, to itself or to another consumer. Both adapters run your handler under a claim
of the message's key (a message id, a header, a JSON body field or a callable), in the key space
the consumer names (`namespace`: never derived from a queue, stream or durable name, so renaming a
durable or moving it from push to pull keeps every record), and settle each delivery the same way:

- first delivery: run the handler, store that it ran (and what it returned), then ack;
- a duplicate of a message already applied: ack without running the handler;
- a duplicate while another consumer still runs it: wait up to `wait` seconds for that outcome
  (then ack), else hand it back to the broker after a short hold (a redelivery counts toward the
  broker's bound, so an immediate hand-back would dead-letter the duplicates of a slow message); a
  duplicate of a delivery still running *in this process* (its channel closed under it) is held
  until that one ends, never handed back;
- the handler raised: the claim is released and the message handed back after a backoff (0.5 s
  doubling per delivery, up to 30 s), so the broker counts the attempt and its bound (RabbitMQ
  quorum queue `x-delivery-limit`, JetStream consumer `max_deliver`) ends a poison message's
  retries, and without a bound it is retried a few times a minute, never in a hot loop;
- the store could not make the claim (down, a failover, durable replicas not confirming it):
  nothing ran, so the delivery is held and its claim retried in this process with growing backoff
  (up to 2 s apart) until the store answers; no redelivery counts toward the bound, and a held
  delivery keeps its prefetch / `max_ack_pending` slot, so the consumer takes no new messages
  meanwhile. Never a dead letter (RabbitMQ: after `store_hold` seconds it is requeued);
- a message that can never be applied: no key, a key or fingerprint reader that raises, a body the
  fingerprint cannot read, another message under a used key, or an outcome unknown (the handler
  called `current_job().mark_effect()`, then failed; or a consumer died mid-handler and its lease ran
  out): dead-lettered at once with the reason (logged; on NATS copied with the message to
  `dead_letter=` before `term()`), for a person.

**Interruptions.** Both brokers' clients cancel the callback's task when its channel or subscription
ends (a channel error, `consumer_timeout`, a lost connection, `nc.close()`, `unsubscribe()`, a
`drain()` past its timeout). The adapters run each delivery's work (claim, handler, store write,
ack) in a task of their own that such a cancellation does not reach: the handler finishes and its
result is stored, and the redelivery finds it and is acked without running. Each adapter is an
`async with` block (`async with rabbitmq_handler(...) as on_message:`): leaving it (a graceful stop
cancelling the main task, SIGINT under `asyncio.run`) takes no new delivery and waits for the
running ones to finish (`drain()`, up to `stop_timeout`), before the connection is closed. Work
still cancelled after that (the process exits) counts as a crash: the claim is kept to its lease,
never released, and recovery resolves it on the redelivery (`recover=`; a Postgres `transaction()`
that never committed runs again once; one that committed is acked as applied).
"""

from ._core import STOP_TIMEOUT, Consumer, KeyOf, PrintOf, Settle, apply_once, body_digest
from .nats import nats_handler
from .rabbitmq import rabbitmq_handler

__all__ = [
    "STOP_TIMEOUT",
    "Consumer",
    "KeyOf",
    "PrintOf",
    "Settle",
    "apply_once",
    "body_digest",
    "nats_handler",
    "rabbitmq_handler",
]
