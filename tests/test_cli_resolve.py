"""`idem-asgi resolve`: one stuck claim ended by its key, no hook, on Redis and Postgres.

Each test leaves a claim as a SIGKILLed worker leaves it (claimed, never completed, its lease
running out), then resolves it with one command and checks what a client's retry gets.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from idem_asgi.records import IN_PROGRESS, Claimed, Existing, RecordKey
from tests.test_cli import DAY, Store, cli, cli_json, store, stuck

__all__ = ["store"]  # the fixture, shared with test_cli

BODY = b'{"charge":"ch_from_provider","amount":1230}'


def key_of(namespace: str, key: str, scope: str | None = "tenant-42") -> RecordKey:
    from idem_asgi.http.keys import stored_scope

    return RecordKey.build(namespace, None if scope is None else stored_scope(scope), key)


async def test_an_answer_is_stored_and_every_retry_replays_it(
    store: Store, namespace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = key_of(namespace, "pay-1")
    token = await stuck(store.backend, key)
    await asyncio.sleep(0.2)  # the lease is over: the holder is gone
    body = tmp_path / "charge.json"
    body.write_bytes(BODY)
    code, out, err = await cli(
        capsys,
        *store.args,
        "resolve",
        "pay-1",
        "--namespace",
        namespace,
        "--scope",
        "tenant-42",
        "--token",
        str(token),
        "--older-than",
        "0",
        "--status",
        "201",
        "--header",
        "Content-Type: application/json",
        "--body-file",
        str(body),
    )
    assert (code, err) == (0, ""), out
    assert "stored the 201 answer: retries replay it" in out
    retry = await store.backend.claim(key, b"fp", lease=30, ttl=DAY)
    assert isinstance(retry, Existing) and retry.record.response is not None
    assert retry.record.response.status == 201
    assert retry.record.response.headers == [(b"content-type", b"application/json")]
    assert retry.record.response.body == BODY


async def test_release_lets_the_next_retry_run(
    store: Store, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    key = key_of(namespace, "pay-2", scope=None)
    token = await stuck(store.backend, key)
    await asyncio.sleep(0.2)
    code, doc = await cli_json(
        capsys,
        *store.args,
        "resolve",
        "pay-2",
        "--namespace",
        namespace,
        "--token",
        str(token),
        "--release",
        "--older-than",
        "0",
    )
    assert code == 0 and doc["resolved"] is True and doc["verdict"] == "released"
    assert isinstance(await store.backend.claim(key, b"fp", lease=30, ttl=DAY), Claimed)


async def test_a_live_claim_a_changed_token_and_a_dry_run_write_nothing(
    store: Store, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    live = key_of(namespace, "pay-live")
    live_token = await stuck(store.backend, live, lease=30)
    common = [*store.args, "resolve", "--namespace", namespace, "--scope", "tenant-42", "--older-than", "0"]
    code, out, _ = await cli(capsys, *common, "pay-live", "--token", str(live_token), "--release")
    assert code == 1 and "its holder is live" in out

    over = key_of(namespace, "pay-over")
    token = await stuck(store.backend, over)
    await asyncio.sleep(0.2)
    code, out, _ = await cli(capsys, *common, "pay-over", "--token", str(token + 1), "--release")
    assert code == 1 and f"its token is {token} now" in out
    code, out, _ = await cli(capsys, *common, "pay-over", "--token", str(token), "--release", "--dry-run")
    assert code == 0 and "would release it (dry run)" in out

    for key, held in ((live, live_token), (over, token)):  # untouched, both
        record = await store.backend.get(key)
        assert record is not None and record.state == IN_PROGRESS and record.token == held


async def test_nothing_found_says_why(store: Store, namespace: str, capsys: pytest.CaptureFixture[str]) -> None:
    key = key_of(namespace, "pay-3")
    token = await stuck(store.backend, key)
    await asyncio.sleep(0.2)
    # Without --scope the scoped key is not found: the message says what is missing.
    argv = [
        *store.args,
        "resolve",
        "pay-3",
        "--namespace",
        namespace,
        "--token",
        str(token),
        "--release",
        "--older-than",
        "0",
    ]
    code, out, _ = await cli(capsys, *argv)
    assert code == 1 and "needs --scope" in out
    code, out, _ = await cli(capsys, *store.args, "inspect", "pay-3", "--namespace", namespace)
    assert code == 1 and "--scope" in out


async def test_a_job_record_takes_a_result_and_refuses_an_http_answer(
    store: Store, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from idem_asgi.jobs.decorator import OutcomeUnknown, current_job, idempotent

    runs: list[str] = []

    @idempotent(store.backend, args=["order_id"], namespace=namespace, lease=0.2)
    async def charge(order_id: str) -> dict[str, Any]:
        runs.append(order_id)
        job = current_job()
        assert job is not None
        job.mark_effect()
        raise ConnectionError("the provider's answer was lost")

    with pytest.raises(ConnectionError):
        await charge("o-1")
    with pytest.raises(OutcomeUnknown):
        await charge("o-1")
    await asyncio.sleep(0.3)
    record = await store.backend.get(RecordKey.build(namespace, None, "order_id=o-1"))
    assert record is not None
    common = [
        *store.args,
        "resolve",
        "order_id=o-1",
        "--namespace",
        namespace,
        "--token",
        str(record.token),
        "--older-than",
        "0",
    ]
    code, _, err = await cli(capsys, *common, "--status", "200")
    assert code == 2 and "stored_result" in err, err
    code, out, err = await cli(capsys, *common, "--result", '{"charge": "ch_9", "amount": 100}')
    assert (code, err) == (0, ""), out
    assert await charge("o-1") == {"charge": "ch_9", "amount": 100} and runs == ["o-1"]
