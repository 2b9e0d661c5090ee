"""What `RedisBackend.check()` warns about once the store has proved it serves: settings that
cost claims (eviction before the TTL, a failover to a replica that missed a claim)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger("idem_asgi")


async def warn_on_eviction(client: Any, cluster: bool, timeout: float) -> None:
    """Log (at start-up) that Redis may evict records before their TTL (any maxmemory-policy but noeviction)."""
    try:  # INFO, not CONFIG: managed services that refuse CONFIG still answer it
        every_shard = {"target_nodes": client.get_primaries()} if cluster else {}
        info = await asyncio.wait_for(client.info("memory", **every_shard), timeout)
    except Exception:  # not allowed or not answered: the claim above already proved the store
        return
    nodes = info.values() if cluster and isinstance(info, dict) and "maxmemory_policy" not in info else [info]
    policies = {str(node.get("maxmemory_policy", "")) for node in nodes if isinstance(node, dict)}
    evicting = sorted(p for p in policies if p and p != "noeviction")
    if evicting:
        logger.warning(
            "idem_asgi: Redis maxmemory-policy is %s: under memory pressure Redis may delete idempotency "
            "records before their TTL, and a retry of such a key runs again; set maxmemory-policy noeviction "
            "(a full Redis then refuses new claims: 503)",
            ", ".join(evicting),
        )


async def warn_on_replication(client: Any, durable_replicas: int, timeout: float) -> None:
    """Log (at start-up) that a failover can cost claims: the primary has replicas, the claims are
    not durable. (Durable claims without enough replicas need no warning: `check()`'s own claim is
    refused.)"""
    try:  # INFO, not ROLE or CONFIG: managed services that refuse those still answer it
        info = await asyncio.wait_for(client.info("replication"), timeout)
        replicas = int(info.get("connected_slaves", 0))
    except Exception:  # not allowed or not answered: the claim before this already proved the store
        return
    if replicas and not durable_replicas:
        logger.warning(
            "idem_asgi: this Redis primary has %d connected replica(s) and claims are not durable: a failover "
            "to a replica that missed a claim lets a retry run the request again (measured once: a primary paused "
            "4 s behind Sentinel under a storm, 11 duplicate executions of 800 requests); pass durable_replicas=1 "
            "so that a claim counts only once a replica has it (redis+sentinel:// URLs do by default)",
            replicas,
        )
