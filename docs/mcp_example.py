"""An MCP server whose `charge` tool runs once per idempotency key. Run: python docs/mcp_example.py"""

import asyncio
import socket

import httpx2
import uvicorn
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import MCPServer

from idem_asgi.backends import MemoryBackend
from idem_asgi.jobs import current_job
from idem_asgi.mcp import IdempotentTools

charges: list[str] = []  # our fake payment provider: one entry per charge it made
mcp = MCPServer("shop", log_level="WARNING")


@mcp.tool()
async def charge(order_id: str, amount: int) -> str:
    """Charge an order."""
    charges.append(order_id)  # the effect that must happen once
    job = current_job()  # the call's claim: job.key.key is the key, to forward to the provider
    if job is not None:
        job.mark_effect()  # from here on, a failure is never run again (outcome unknown)
    return f"charged {amount} for order {order_id}: ch_{len(charges)}"


app = IdempotentTools(
    mcp.streamable_http_app(),
    MemoryBackend(),  # one process only; RedisBackend / PostgresBackend for several workers
    tools=["charge"],  # None: every tool
)


async def main() -> None:
    sock = socket.create_server(("127.0.0.1", 0))  # listening on a free port: calls wait for the server
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        for attempt in (1, 2, 3):  # a client that lost the answer calls again, in a new session
            async with (
                httpx2.AsyncClient(headers={"Idempotency-Key": "order-1001"}) as http,
                Client(streamable_http_client(url, http_client=http)) as client,
            ):
                result = await client.call_tool("charge", {"order_id": "1001", "amount": 1230})
            print(f"attempt {attempt}: {result.content[0].text}")  # type: ignore[union-attr]
    finally:
        server.should_exit = True
        await serving
    print("charges made:", len(charges))


if __name__ == "__main__":
    asyncio.run(main())
