"""A retry storm against a tiny FastAPI payments app: one charge per key, every repeat a replay or 409.

Run with `python3 dev.py demo` (in-memory store) or `python3 dev.py demo --backend redis://127.0.0.1:6379/0`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import uuid
from collections import Counter

import httpx
from fastapi import FastAPI, Request

from idem_asgi import IdempotencyMiddleware, RoutePolicy, backend_from_url, scope_from_header


def build_app(backend_url: str) -> tuple[FastAPI, Counter[str]]:
    """The payments app, and the ledger of real charges per key (the ground truth)."""
    charges: Counter[str] = Counter()
    app = FastAPI()
    app.add_middleware(
        IdempotencyMiddleware,
        backend=backend_from_url(backend_url),
        routes=[RoutePolicy("/payments", methods=["POST"], required=True)],
        scope=scope_from_header("x-merchant-id"),
    )

    @app.post("/payments", status_code=201)
    async def charge(request: Request) -> dict[str, object]:
        key = request.state.idempotency.key
        order = await request.json()
        await asyncio.sleep(0.02)  # the card network takes a moment
        charges[key] += 1
        return {"charge_id": uuid.uuid4().hex, "amount": order["amount"], "currency": "EUR"}

    return app, charges


async def storm(backend_url: str, keys: int, duplicates: int, seed: int) -> int:
    app, charges = build_app(backend_url)
    rng = random.Random(seed)
    run = uuid.uuid4().hex[:8]  # durable stores keep earlier runs: fresh keys each time
    jobs = [(f"order-{run}-{i}", i) for i in range(keys) for _ in range(duplicates)]
    rng.shuffle(jobs)
    first: dict[str, bytes] = {}
    outcome: Counter[str] = Counter()
    mismatched = 0
    started = time.perf_counter()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://demo") as client:

        async def one(key: str, amount: int) -> None:
            nonlocal mismatched
            r = await client.post(
                "/payments",
                json={"amount": amount},
                headers={"Idempotency-Key": key, "X-Merchant-Id": "m-1"},
            )
            if r.status_code == 201:
                kind = "replayed" if r.headers.get("idempotent-replayed") == "true" else "executed"
                outcome[kind] += 1
                if first.setdefault(key, r.content) != r.content:
                    mismatched += 1
            else:
                outcome[str(r.status_code)] += 1

        await asyncio.gather(*(one(key, amount) for key, amount in jobs))
        # Every client now retries once more after its answer: all must be byte-identical replays.
        late = await asyncio.gather(
            *(
                client.post("/payments", json={"amount": i}, headers={"Idempotency-Key": key, "X-Merchant-Id": "m-1"})
                for key, i in {k: a for k, a in jobs}.items()
            )
        )
    wall = time.perf_counter() - started
    late_ok = sum(
        r.headers.get("idempotent-replayed") == "true" and r.content == first[k]
        for r, k in zip(late, {k: a for k, a in jobs}, strict=True)
    )
    double = sum(n - 1 for n in charges.values() if n > 1)
    print(f"backend             {backend_url}")
    print(f"requests            {len(jobs)} ({keys} keys x {duplicates} concurrent duplicates), seed {seed}")
    print(f"charges executed    {sum(charges.values())}  (keys charged: {len(charges)} of {keys})")
    print(f"double charges      {double}")
    print(f"first answers       {outcome['executed']}")
    print(f"replays (201)       {outcome['replayed']}")
    print(f"409 in progress     {outcome['409']}")
    print(f"other statuses      {sum(v for s, v in outcome.items() if s not in ('executed', 'replayed', '409'))}")
    print(f"replays differing   {mismatched}")
    print(f"late retries        {late_ok}/{len(late)} byte-identical replays")
    print(f"wall time           {wall:.2f} s")
    ok = double == 0 and mismatched == 0 and late_ok == len(late) and len(charges) == keys
    print("RESULT              " + ("OK: every payment charged exactly once" if ok else "FAILED"))
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="memory://", help="memory://, redis://... or postgresql://...")
    parser.add_argument("--keys", type=int, default=50)
    parser.add_argument("--duplicates", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print("One payment, 200 concurrent retries:")
    code = asyncio.run(storm(args.backend, 1, 200, args.seed))
    print(f"\n{args.keys} payments, {args.duplicates} concurrent retries each:")
    return code | asyncio.run(storm(args.backend, args.keys, args.duplicates, args.seed + 1))


if __name__ == "__main__":
    raise SystemExit(main())
