"""A store written outside the package passes the shipped contract suite with one fixture, the way
a user's own store would (`idem_asgi.testing.contract`), and the suite catches a store that breaks
the contract."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from idem_asgi.records import COMPLETED, IN_PROGRESS, Claimed, ClaimResult, Existing, Record, RecordKey, StoredResponse
from idem_asgi.testing.contract import StoreContract
from tests.support.servers import ROOT


class DictStore:
    """The whole `Backend` protocol over one dict, by the wall clock: no base class, nothing of the
    package's stores (no `stale()`/`purge()`, so the suite skips the ops tests)."""

    def __init__(self) -> None:
        self.rows: dict[str, Record] = {}
        self.tokens = itertools.count(1)

    def _live(self, key: RecordKey) -> Record | None:
        row = self.rows.get(key.digest)
        if row is not None and row.expires_at <= time.time():
            del self.rows[key.digest]
            return None
        return row

    def _held(self, key: RecordKey, token: int) -> Record | None:
        row = self._live(key)
        return row if row is not None and row.state == IN_PROGRESS and row.token == token else None

    def _new(self, key: RecordKey, fingerprint: bytes, lease: float, ttl: float) -> Claimed:
        now, token = time.time(), next(self.tokens)
        self.rows[key.digest] = Record(IN_PROGRESS, fingerprint, token, now + lease, now + max(ttl, lease), ttl=ttl)
        return Claimed(token)

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        row = self._live(key)
        return self._new(key, fingerprint, lease, ttl) if row is None else Existing(row, time.time())

    async def takeover(
        self, key: RecordKey, stale_token: int, fingerprint: bytes, *, lease: float, ttl: float
    ) -> ClaimResult | None:
        row = self._live(key)
        if row is None:
            return None
        if row.state != IN_PROGRESS or row.token != stale_token or row.lease_until > time.time():
            return Existing(row, time.time())
        return self._new(key, fingerprint, lease, ttl)

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        row = self._held(key, token)
        if row is None:
            return False
        now = time.time()
        self.rows[key.digest] = Record(COMPLETED, row.fingerprint, token, now, now + ttl, response, ttl=ttl)
        return True

    async def release(self, key: RecordKey, token: int) -> bool:
        row = self._held(key, token)
        if row is None or row.holder_failed:
            return False
        del self.rows[key.digest]
        return True

    async def extend(self, key: RecordKey, token: int, *, lease: float) -> bool:
        row = self._held(key, token)
        if row is None or row.holder_failed:
            return False
        until = time.time() + lease
        self.rows[key.digest] = Record(
            IN_PROGRESS, row.fingerprint, token, until, max(row.expires_at, until), ttl=row.ttl
        )
        return True

    async def mark_failed(self, key: RecordKey, token: int) -> bool:
        row = self._held(key, token)
        if row is None:
            return False
        self.rows[key.digest] = Record(
            IN_PROGRESS, row.fingerprint, token, time.time(), row.expires_at, ttl=row.ttl, holder_failed=True
        )
        return True

    async def get(self, key: RecordKey) -> Record | None:
        return self._live(key)

    async def aclose(self) -> None:
        self.rows.clear()


class TestDictStore(StoreContract):
    @pytest_asyncio.fixture
    async def contract_store(self) -> AsyncIterator[DictStore]:
        store = DictStore()
        yield store
        await store.aclose()


BROKEN = """
import pytest_asyncio

from idem_asgi.testing.contract import StoreContract
from tests.test_store_contract_external import DictStore


class Unfenced(DictStore):
    async def complete(self, key, token, response, *, ttl):  # completes whoever asks: no fencing
        row = self._live(key)
        return row is not None and await super().complete(key, row.token, response, ttl=ttl)


class TestUnfenced(StoreContract):
    @pytest_asyncio.fixture
    async def contract_store(self):
        yield Unfenced()
"""


def test_the_suite_fails_a_store_that_completes_with_a_stale_token(tmp_path: Path) -> None:
    """The same suite over a store whose `complete` ignores the token: the fencing tests fail."""
    (tmp_path / "test_unfenced.py").write_text(textwrap.dedent(BROKEN))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
    )
    failed = sorted(line.split("::")[-1].split(" ")[0] for line in run.stdout.splitlines() if line.startswith("FAILED"))
    assert run.returncode == 1, run.stdout[-2000:]
    assert "test_complete_with_a_stale_token_is_fenced_out" in failed
    assert "test_takeover_of_an_expired_lease_fences_the_old_holder" in failed
