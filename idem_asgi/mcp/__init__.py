"""Idempotent `tools/call` for an MCP server over streamable HTTP: `IdempotentTools`.

An MCP client that lost a tool call's answer sends the call again, with a NEW JSON-RPC `id`. The
HTTP middleware's byte-for-byte replay would answer the wrong id, and its refusals (409, 422, 503
problems) are not what an MCP client reads. So this wrapper speaks JSON-RPC: it claims the call's
idempotency key through the claim core (`jobs.decorator.claimed`, as the job and consumer surfaces
do), lets the first call through to the app unchanged while it reads the app's answer (JSON or an
SSE stream), stores that answer's `result` object, and answers every repeat with the stored
`result` under the repeat's own `id`. A repeat that cannot be answered that way gets a JSON-RPC
error whose `error.data` is the HTTP middleware's problem (`type`, `title`, `status`, `detail`).

Only POSTs whose body is one JSON-RPC `tools/call` request carrying a key are touched; everything
else (GET and DELETE, `initialize`, `tools/list`, notifications, batches, bad JSON) reaches the app
exactly as it came. How a first call ends, as on the job surface:

- a `result` with `isError` false: stored, replayed from now on;
- a JSON-RPC `error`, a `result` with `isError: true` (a tool that raised) or one asking for input
  (`resultType: input_required`): released, so a retry runs again, unless the tool called
  `current_job().mark_effect()`: then kept, outcome unknown;
- no answer (the stream was cut, the server stopped it, the client cancelled it): like a crash, the
  claim is kept to its lease and never released.
"""

from .tools import IdempotentTools
from .wire import CODES

__all__ = ["CODES", "IdempotentTools"]
