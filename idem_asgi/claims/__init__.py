"""The claim core every surface drives: HTTP requests (`_request`), jobs and consumers (`jobs`),
and the ops tools (`reconcile`). It knows nothing of HTTP or brokers.

- `session.ClaimSession`: one claim's life: claim, wait for a holder, decide, run under a renewed
  lease, settle (complete, release, or keep as outcome-unknown), with late writes and events;
- `recovery.resolve`: what an expired claim's outcome becomes in the store (one algorithm for the
  middleware's `recover` hook and for `reconcile`).
"""
