"""The fault matrix: what every surface does at every point of a claim under every kind of fault.

One table, read by the tests that run its cells (tests/faults/) and rendered into
docs/reliability.md (`python -m tests.support.fault_matrix --write`; tests/faults/test_matrix_doc.py
fails when the page drifts from it). A cell is (surface, point, kind, store); its expected outcome:

- `once`: the effect happened exactly once, and every later retry or redelivery is answered from
  the stored outcome (a replay, an ack) without running the handler;
- `blocked`: the outcome is unknown (the holder is gone after its claim, its effect may have
  happened): retries get `outcome-unknown` (HTTP 409, a job's `OutcomeUnknown`, a dead-lettered
  message) until recovery resolves it, and the handler never runs again; the effect count says
  whether it did run (0 after the claim, 1 mid-effect or before the store write);
- `later`: nothing was claimed, nothing happened; the retry or redelivery runs it, once.

Where each point is (the same on every surface):

| point | where the work stands |
|---|---|
| `before_claim` | the request or message is in, its claim not made yet |
| `after_claim` | the claim is made, the handler has not started its effect |
| `mid_effect` | the handler's effect happened, the handler has not returned |
| `in_transaction` | inside the handler's Postgres `transaction()`, its writes made, before COMMIT (Postgres only) |
| `before_store` | the handler returned, its answer or result not stored yet |
| `after_store` | the answer or result is stored; not sent, not acked yet |
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Final, Literal

Surface = Literal["http", "job", "rabbitmq", "nats_pull", "nats_push"]
Point = Literal["before_claim", "after_claim", "mid_effect", "in_transaction", "before_store", "after_store"]
Kind = Literal["sigkill", "graceful_stop", "channel_lost", "cancelled", "store_outage", "store_stall", "broker_restart"]
Store = Literal["redis", "postgres"]
Outcome = Literal["once", "blocked", "later"]

SURFACES: Final[tuple[Surface, ...]] = ("http", "job", "rabbitmq", "nats_pull", "nats_push")
POINTS: Final[tuple[Point, ...]] = (
    "before_claim",
    "after_claim",
    "mid_effect",
    "in_transaction",
    "before_store",
    "after_store",
)
KINDS: Final[tuple[Kind, ...]] = (
    "sigkill",
    "graceful_stop",
    "channel_lost",
    "cancelled",
    "store_outage",
    "store_stall",
    "broker_restart",
)
STORES: Final[tuple[Store, ...]] = ("redis", "postgres")
BROKERS: Final[frozenset[Surface]] = frozenset({"rabbitmq", "nats_pull", "nats_push"})

SURFACE_NAMES: Final[dict[Surface, str]] = {
    "http": "HTTP under uvicorn",
    "job": "a job (`@idempotent`) in a process of its own",
    "rabbitmq": "RabbitMQ consumer",
    "nats_pull": "NATS pull consumer",
    "nats_push": "NATS push consumer",
}
KIND_NAMES: Final[dict[Kind, str]] = {
    "sigkill": "SIGKILL",
    "graceful_stop": "graceful stop",
    "channel_lost": "channel or subscription lost",
    "cancelled": "task cancelled",
    "store_outage": "store killed, started again",
    "store_stall": "store stalled two leases",
    "broker_restart": "broker killed, started again",
}
KIND_DETAILS: Final[dict[Kind, str]] = {
    "sigkill": "the process is killed (`SIGKILL`) while its keys sit at their points",
    "graceful_stop": (
        "`SIGTERM`: uvicorn's graceful shutdown; a consumer process whose main task is cancelled and whose "
        "`async with` block drains; a job process whose main task (the job call) is cancelled"
    ),
    "channel_lost": "RabbitMQ closes the consumer's channel; NATS ends the subscription (`unsubscribe()`)",
    "cancelled": (
        "the work's task is cancelled: uvicorn's shutdown timeout cancels the request; a timeout around the "
        "job call; the broker client cancels the consumer callback's task"
    ),
    "store_outage": "the store (a throwaway server) is killed, then started again on the same port and data",
    "store_stall": "the store is stopped (`SIGSTOP`) for two leases, then resumed (`SIGCONT`)",
    "broker_restart": "the broker (a throwaway node) is killed, then started again",
}

# The cells whose outcome is not `once`, and why (the rest of the table follows from these rules).
#
# - A fault that leaves the work running (a broker's cancellation, a channel lost, a broker or
#   store that comes back, a store stall, a consumer's or uvicorn's graceful stop) ends `once`:
#   the work finishes, its outcome is stored, and what the client or broker missed is answered
#   from the store.
# - A fault that ends the work after its claim (SIGKILL; a cancellation of the work's own task:
#   uvicorn's shutdown timeout, a timeout around a job, a job process's graceful stop) ends
#   `blocked`, unless the claim proves nothing happened (still inside an uncommitted
#   `transaction()`: rolled back, run again once) or the outcome was stored already.
# - The same fault before the claim ends `later`: nothing was claimed, the retry runs it. So does
#   a store fault before the claim of a request or a job: the claim fails (503, `BackendUnavailable`),
#   while a consumer holds the delivery and claims it once the store is back (`once`).


def expected(surface: Surface, point: Point, kind: Kind, store: Store) -> Outcome | None:
    """The expected outcome of a cell, or None when the cell does not exist."""
    if point == "in_transaction" and store != "postgres":
        return None  # only Postgres has `transaction()`
    if kind in ("channel_lost", "broker_restart") and surface not in BROKERS:
        return None
    if kind in ("store_outage", "store_stall") and point == "before_claim" and surface not in BROKERS:
        return "later"  # the claim fails (503, `BackendUnavailable`): nothing ran, the client's retry runs it
    if not _ends_the_work(surface, kind):
        return "once"
    if point == "before_claim":
        return "later"
    if point in ("in_transaction", "after_store"):
        return "once"
    return "blocked"


def _ends_the_work(surface: Surface, kind: Kind) -> bool:
    """Whether the fault ends the work itself (it may have had its effect), not only what is around it."""
    if kind == "sigkill":
        return True
    if kind == "cancelled":
        return surface not in BROKERS  # a broker's cancellation of the callback never reaches the work
    if kind == "graceful_stop":
        return surface == "job"  # uvicorn and the consumers drain first; a job's own task is cancelled
    return False


Cell = tuple[Surface, Point, Kind, Store, Outcome]


def cells(surface: Surface | None = None, kind: Kind | None = None, store: Store | None = None) -> list[Cell]:
    """Every existing cell (optionally of one surface, kind or store), with its expected outcome."""
    found = []
    for s in SURFACES if surface is None else (surface,):
        for k in KINDS if kind is None else (kind,):
            for st in STORES if store is None else (store,):
                for p in POINTS:
                    outcome = expected(s, p, k, st)
                    if outcome is not None:
                        found.append((s, p, k, st, outcome))
    return found


_MARK: Final = {"once": "once", "blocked": "**blocked**", "later": "later"}


def render() -> str:
    """The table as docs/reliability.md shows it: a row per (surface, kind), a column per point."""
    head = "| surface | fault | " + " | ".join(f"`{p}`" for p in POINTS) + " |"
    lines = [head, "|" + "---|" * (len(POINTS) + 2)]
    for surface in SURFACES:
        for kind in KINDS:
            row = []
            for point in POINTS:
                outcomes = {expected(surface, point, kind, st) for st in STORES} - {None}
                if not outcomes:
                    row.append("—")
                    continue
                (outcome,) = outcomes  # the same on both stores wherever the cell exists
                assert outcome is not None
                row.append(_MARK[outcome] + ("" if point != "in_transaction" else " (Postgres)"))
            if all(cell == "—" for cell in row):
                continue
            lines.append(f"| {SURFACE_NAMES[surface]} | {KIND_NAMES[kind]} | " + " | ".join(row) + " |")
    count = len(cells())
    legend = (
        f"{count} cells (Redis and Postgres each; `in_transaction` is Postgres only). once: the effect "
        "happened exactly once and every retry or redelivery is answered from the stored outcome. "
        "**blocked**: the holder is gone after its claim and the outcome is unknown: retries get "
        "`outcome-unknown` (or the message is dead-lettered) until recovery resolves it; never run twice. "
        "later: nothing was claimed; the retry or redelivery runs it, once."
    )
    kinds = [f"- {KIND_NAMES[k]}: {KIND_DETAILS[k]}." for k in KINDS]
    return "\n".join([*lines, "", legend, "", *kinds])


START: Final = "<!-- fault-matrix:start -->"
END: Final = "<!-- fault-matrix:end -->"
PAGE: Final = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"


def on_page(text: str) -> str | None:
    """The generated part of the page, between the markers (None when they are missing)."""
    found = re.search(re.escape(START) + r"(.*?)" + re.escape(END), text, re.S)
    return None if found is None else found.group(1).strip("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print the fault matrix, or write it into docs/reliability.md.")
    parser.add_argument("--write", action="store_true", help="replace the table between the markers of the page")
    args = parser.parse_args(argv)
    table = render()
    if not args.write:
        print(table)
        return 0
    text = PAGE.read_text()
    if on_page(text) is None:
        print(f"{PAGE}: no {START} ... {END} markers", file=sys.stderr)
        return 1
    block = f"{START}\n{table}\n{END}"
    PAGE.write_text(re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
