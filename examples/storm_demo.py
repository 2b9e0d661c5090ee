"""Retry storms against a tiny FastAPI payments app: one charge per key, every repeat either the
stored answer (byte for byte, `Idempotent-Replayed: true`) or 409 with `Retry-After`.

Run with `python3 dev.py demo` (in-memory store) or `python3 dev.py demo --backend redis://127.0.0.1:6379/0`.
First the storm without the middleware (every retry charges the card again), then three with it:
one payment retried 200 times with the default (a repeat that arrives while the charge runs gets
409 + Retry-After, one that arrives after it gets the replay), the same with `wait=2` on the route
(repeats wait for the answer: all replays), then many payments at once.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request

from idem_asgi import IdempotencyMiddleware, RoutePolicy, backend_from_url, scope_from_header

CHARGE_SECONDS = 0.05  # the card network takes a moment
SHOWN = ("idempotent-replayed", "retry-after", "content-type", "link")


def build_app(backend_url: str | None, wait: float | None) -> tuple[FastAPI, Counter[str]]:
    """The payments app (without the middleware for `backend_url=None`), and the ledger of real
    charges per key (the ground truth)."""
    charges: Counter[str] = Counter()
    app = FastAPI()
    if backend_url is not None:
        app.add_middleware(
            IdempotencyMiddleware,
            backend=backend_from_url(backend_url),
            routes=[RoutePolicy("/payments", methods=["POST"], required=True, wait=wait)],
            scope=scope_from_header("x-merchant-id"),
        )

    @app.post("/payments", status_code=201)
    async def charge(request: Request) -> dict[str, object]:
        key = request.headers["idempotency-key"]
        order = await request.json()
        await asyncio.sleep(CHARGE_SECONDS)
        charges[key] += 1
        return {"charge_id": uuid.uuid4().hex, "amount": order["amount"], "currency": "EUR"}

    return app, charges


@dataclass
class Storm:
    """What one storm saw, and a sample answer of each kind to print."""

    charges: Counter[str]
    keys: int
    requests: int
    outcome: Counter[str] = field(default_factory=Counter)
    differing: int = 0
    retry_after_missing: int = 0
    late_identical: int = 0
    late: int = 0
    samples: dict[str, httpx.Response] = field(default_factory=dict)
    wall: float = 0.0

    @property
    def double(self) -> int:
        return sum(n - 1 for n in self.charges.values() if n > 1)

    @property
    def ok(self) -> bool:
        return (
            self.double == 0
            and len(self.charges) == self.keys
            and self.differing == 0
            and self.retry_after_missing == 0
            and self.late_identical == self.late
            and set(self.outcome) <= {"first", "replayed", "409"}
        )


async def storm(backend_url: str | None, keys: int, duplicates: int, seed: int, *, wait: float | None) -> Storm:
    app, charges = build_app(backend_url, wait)
    rng = random.Random(seed)
    run = uuid.uuid4().hex[:8]  # durable stores keep earlier runs: fresh keys each time
    amounts = {f"order-{run}-{i}": 100 + i for i in range(keys)}
    # Retries arrive over twice the charge's duration: some while it runs, some after it.
    jobs = [(key, rng.uniform(0, 2 * CHARGE_SECONDS)) for key in amounts for _ in range(duplicates)]
    result = Storm(charges, keys, len(jobs))
    first: dict[str, bytes] = {}
    started = time.perf_counter()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://demo") as client:

        async def pay(key: str) -> httpx.Response:
            headers = {"Idempotency-Key": key, "X-Merchant-Id": "m-1"}
            return await client.post("/payments", json={"amount": amounts[key]}, headers=headers)

        async def one(key: str, delay: float) -> None:
            await asyncio.sleep(delay)
            r = await pay(key)
            if r.status_code == 201:
                kind = "replayed" if r.headers.get("idempotent-replayed") == "true" else "first"
                if first.setdefault(key, r.content) != r.content and kind == "replayed":
                    result.differing += 1
            else:
                kind = str(r.status_code)
                result.retry_after_missing += kind == "409" and "retry-after" not in r.headers
            result.outcome[kind] += 1
            result.samples.setdefault(kind, r)

        await asyncio.gather(*(one(key, delay) for key, delay in jobs))
        # Every client retries once more after its answer: each must be a byte-identical replay.
        late = await asyncio.gather(*(pay(key) for key in amounts))
    result.wall = time.perf_counter() - started
    result.late = len(late)
    result.late_identical = sum(
        r.headers.get("idempotent-replayed") == "true" and r.content == first.get(key)
        for r, key in zip(late, amounts, strict=True)
    )
    return result


def show(title: str, backend_url: str | None, s: Storm, *, samples: bool) -> None:
    print(f"\n== {title}")
    print(f"backend             {backend_url or '(none: no idempotency middleware)'}")
    spread = f"spread over {2 * CHARGE_SECONDS * 1000:.0f} ms"
    print(f"requests            {s.requests} ({s.keys} key(s) x {s.requests // s.keys} retries, {spread})")
    print(f"charges executed    {sum(s.charges.values())}  (double charges: {s.double})")
    print(f"first answers       {s.outcome['first']}")
    identical = s.outcome["replayed"] - s.differing
    print(f"replays (201)       {s.outcome['replayed']}  (byte-identical to the first: {identical})")
    print(f"409 in progress     {s.outcome['409']}  (with Retry-After: {s.outcome['409'] - s.retry_after_missing})")
    others = sum(v for k, v in s.outcome.items() if k not in ("first", "replayed", "409"))
    print(f"other statuses      {others}")
    print(f"late retries        {s.late_identical}/{s.late} byte-identical replays")
    print(f"wall time           {s.wall:.2f} s")
    if samples:
        for kind, label in (("replayed", "a replayed answer"), ("409", "a 409 answer")):
            if (r := s.samples.get(kind)) is not None:
                headers = "  ".join(f"{h}: {r.headers[h]}" for h in SHOWN if h in r.headers)
                print(f"{label:<20}{r.status_code}  {headers}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="memory://", help="memory://, redis://... or postgresql://...")
    parser.add_argument("--keys", type=int, default=50)
    parser.add_argument("--duplicates", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    storms = [
        ("One payment, 200 retries; default: a repeat while it runs gets 409 + Retry-After", 1, 200, None),
        ("The same with RoutePolicy(..., wait=2): repeats wait for the answer", 1, 200, 2.0),
        (f"{args.keys} payments, {args.duplicates} retries each, default", args.keys, args.duplicates, None),
    ]
    bare = asyncio.run(storm(None, 1, 200, args.seed, wait=None))
    show("Without idempotency: one payment, 200 retries (every retry charges again)", None, bare, samples=False)
    results = []
    for i, (title, keys, duplicates, wait) in enumerate(storms):
        s = asyncio.run(storm(args.backend, keys, duplicates, args.seed + i, wait=wait))
        show(title, args.backend, s, samples=i < 2)
        results.append(s)
    ok = all(s.ok for s in results)
    charged = sum(sum(s.charges.values()) for s in results)
    payments = sum(s.keys for s in results)
    repeats = sum(s.requests + s.late for s in results) - charged
    verdict = (
        f"OK: {payments} payments charged exactly once each ({charged} charges); all {repeats} repeats got "
        "the stored answer byte for byte (Idempotent-Replayed: true) or 409 with Retry-After"
        if ok
        else "FAILED: " + "; ".join(f"storm {i + 1}" for i, s in enumerate(results) if not s.ok)
    )
    print(f"\nVERDICT  {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
