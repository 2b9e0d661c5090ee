"""Durable claims: a script call followed by `WAIT numreplicas timeout` on the same connection.

Redis replicates asynchronously: a primary can acknowledge a claim and die before any replica has
it, and the promoted replica then hands the key to a retry that runs the payment again. `WAIT`
returns how many replicas have every write this connection made, so sending it right behind the
script, pipelined on one connection, costs one round trip plus the replication delay, and tells
whether the claim (or the completion) would survive a failover.

The lean pool (`_resp`) and redis-py (a plain client or a Sentinel-managed one) pipeline the two
commands. On a Redis Cluster client both go on one connection of the key's primary (its shard's
replicas confirm it); a `MOVED` answer (slots moved, or a failover) refreshes the slot map and the
call is made once more on the new owner.
"""

from __future__ import annotations

import contextlib
from typing import Any

from redis import exceptions as redis_errors

from ...errors import ConfigurationError


def _source(script: Any) -> tuple[str, bytes | str]:
    """(sha, source) of a lean `_resp.Script` or a redis-py `Script`."""
    return script.sha, getattr(script, "source", None) or script.script


async def run_then_wait(
    client: Any, lean: Any, script: Any, name: str | tuple[str, ...], args: tuple[Any, ...], wait: tuple[str, int, int]
) -> tuple[Any, int]:
    """The script's reply and the number of replicas that confirmed it (and every earlier write
    on that connection): `wait` is `("WAIT", replicas, timeout_ms)`. Raises what the script raised."""
    names = (name,) if isinstance(name, str) else name
    for attempt in (1, 2):
        sha, source = _source(script)
        # The first call of a script sends its source (EVAL caches it on the server): a NOSCRIPT
        # after a WAIT would cost the replicas' timeout twice when they are down.
        if getattr(script, "idem_sent", False):
            evalsha: tuple[Any, ...] = ("EVALSHA", sha, len(names), *names, *args)
        else:
            evalsha = ("EVAL", source, len(names), *names, *args)
        if lean is not None:
            reply, acked = await lean.execute_many(evalsha, wait)
        elif hasattr(client, "nodes_manager"):
            reply, acked = await _on_shard(client, names[0], evalsha, wait)
        else:
            pipe = client.pipeline(transaction=False)
            pipe.execute_command(*evalsha)
            pipe.execute_command(*wait)
            reply, acked = await pipe.execute(raise_on_error=False)
        if isinstance(reply, redis_errors.NoScriptError) and attempt == 1:
            loaded = await (lean.execute("SCRIPT", "LOAD", source) if lean is not None else client.script_load(source))
            script.sha = loaded.decode("ascii") if isinstance(loaded, bytes) else loaded
            continue
        if not isinstance(reply, redis_errors.NoScriptError):
            script.idem_sent = True
        if isinstance(reply, BaseException):
            raise reply
        if isinstance(acked, BaseException):
            raise acked
        return reply, int(acked)
    raise AssertionError("unreachable")  # pragma: no cover


async def _on_shard(cluster: Any, name: str, *commands: tuple[Any, ...]) -> list[Any]:
    """`commands` pipelined on one connection of `name`'s primary; each reply or its error."""
    for attempt in (1, 2):
        node = cluster.get_node_from_key(name)
        connection = node.acquire_connection()
        try:
            await connection.send_packed_command(connection.pack_commands(commands))
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(await connection.read_response())
                except redis_errors.ResponseError as exc:
                    replies.append(exc)
        except BaseException as exc:
            await connection.disconnect()
            if isinstance(exc, redis_errors.ConnectionError | redis_errors.TimeoutError | OSError):
                # The primary may be gone (a failover): learn the new slot map for the next call.
                with contextlib.suppress(redis_errors.RedisError, OSError):
                    await cluster.nodes_manager.initialize()
            raise
        finally:
            node.release(connection)
        if attempt == 1 and isinstance(replies[0], redis_errors.MovedError | redis_errors.AskError):
            await cluster.nodes_manager.initialize()  # the slot moved (resharding, failover)
            continue
        return replies
    return replies


def durable_ms(replicas: int, timeout: float | None, call_timeout: float) -> int:
    """The `WAIT` timeout in ms for `durable_timeout` (default half the call's `timeout`), checked."""
    timeout = call_timeout / 2 if timeout is None else timeout
    if replicas < 0:
        raise ConfigurationError(f"durable_replicas must be 0 or more, got {replicas!r}")
    if replicas and not 0 < timeout < call_timeout:
        raise ConfigurationError(
            f"durable_timeout must be more than 0 and less than timeout ({call_timeout}s), got {timeout!r}"
        )
    return max(1, round(timeout * 1000))
