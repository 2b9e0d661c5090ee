"""The store contract as tests: run them against a store of your own with one fixture.

Any object with the `Backend` protocol's methods works as a store (`idem_asgi.backends.Backend`).
`StoreContract` is the suite such a store must pass: the same tests the package runs on each of
its own stores. Subclass it in a test module of yours (the class name must start with `Test`) and
give it one fixture, `contract_store`, that yields a ready store:

```python
import pytest_asyncio

from idem_asgi.testing.contract import StoreContract


class TestMyStore(StoreContract):
    @pytest_asyncio.fixture
    async def contract_store(self):
        store = MyStore()  # yours, ready to serve (set up, connected)
        yield store
        await store.aclose()
```

The fixture may also live in a `conftest.py`, or be parametrized over several setups of your
store. Each test makes keys under a namespace of its own (`contract_namespace`), so one store
shared by every test is fine, and so is a store shared with other tests. The tests run on
asyncio through pytest-asyncio (each is marked `asyncio`, so they run in its strict mode too; in
strict mode an async fixture needs `@pytest_asyncio.fixture`, as above).

Nothing runs until you subclass it: installing the package (whose pytest plugin only provides the
storm fixtures) adds no test to your suite.

Times are judged by the store's clock. The shortest lease the suite uses is `short_lease` seconds
(0.2) and it sleeps small multiples of it; a store whose clock or expiry has a coarser grain
(whole seconds) sets it higher in its subclass. The tests of `stale()` and `purge()` are skipped
for a store without them (`Maintenance`: only the ops tools need them).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import ClassVar

import pytest

from ..backends import Backend, Maintenance
from ..claims.decide import Action, decide
from ..records import COMPLETED, IN_PROGRESS, Claimed, Existing, RecordKey, StaleRecord, StoredResponse

__all__ = ["StoreContract"]

DAY = 86_400.0

RESPONSE = StoredResponse(
    201,
    [(b"content-type", b"application/json"), (b"x-b", b"2"), (b"x-a", b"1"), (b"x-b", b"3")],
    bytes(range(256)) * 4,
)
"""An answer with repeated headers out of order and every byte value in its body."""


def _key(namespace: str, key: str = "key-1", scope: str | None = None) -> RecordKey:
    return RecordKey.build(namespace, scope, key)


def _maintained(store: Backend) -> Maintenance:
    if not isinstance(store, Maintenance):
        pytest.skip(f"{type(store).__name__} has no stale()/purge() (Maintenance, for the ops tools)")
    return store


class StoreContract:
    """The tests every store passes. Subclass it as `Test<YourStore>` and provide the fixture
    `contract_store` (a ready store; see the module's documentation)."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.asyncio]

    short_lease: ClassVar[float] = 0.2
    """The shortest lease (seconds) the tests take; their waits are multiples of it. Raise it for a
    store whose clock or expiry has a coarser grain."""

    @pytest.fixture
    def contract_namespace(self) -> str:
        """A namespace no other test uses: each test's keys are its own, on a shared store too."""
        return f"contract-{uuid.uuid4().hex}"

    async def pause(self, leases: float) -> None:
        """Sleep `leases` times `short_lease`."""
        await asyncio.sleep(leases * self.short_lease)

    # --- claims ----------------------------------------------------------------------------------

    async def test_the_store_has_every_method_of_the_backend_protocol(self, contract_store: Backend) -> None:
        """claim, takeover, complete, release, extend, mark_failed, get and aclose."""
        assert isinstance(contract_store, Backend)

    async def test_first_claim_owns_the_key(self, contract_store: Backend, contract_namespace: str) -> None:
        """The first claim of a key wins it with a fencing token (never 0: 0 may mean "none")."""
        result = await contract_store.claim(_key(contract_namespace), b"fp", lease=30, ttl=DAY)
        assert isinstance(result, Claimed)
        assert result.token > 0

    async def test_second_claim_reads_the_in_progress_record(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """A second claim wins nothing: it gets the holder's record (its fingerprint, token, lease
        and expiry, by the store's clock, which `now` carries)."""
        store, key = contract_store, _key(contract_namespace)
        first = await store.claim(key, b"fp", lease=30, ttl=DAY)
        second = await store.claim(key, b"other", lease=30, ttl=DAY)
        assert isinstance(first, Claimed) and isinstance(second, Existing)
        rec = second.record
        assert (rec.state, rec.fingerprint, rec.token, rec.response) == (IN_PROGRESS, b"fp", first.token, None)
        assert 29 < rec.lease_until - second.now <= 30.5
        assert DAY - 5 < rec.expires_at - second.now <= DAY + 1

    async def test_completed_record_returns_response_verbatim(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """A completed record gives back the stored answer byte for byte: status, header pairs in
        their order (repeats included), body."""
        store, key = contract_store, _key(contract_namespace)
        claimed = await store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(claimed, Claimed)
        assert await store.complete(key, claimed.token, RESPONSE, ttl=DAY) is True
        again = await store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(again, Existing)
        assert again.record.state == COMPLETED
        assert again.record.fingerprint == b"fp"
        assert again.record.response == RESPONSE
        assert decide(again, b"fp") is Action.REPLAY

    async def test_trailers_and_the_sealed_flag_survive_the_store(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """Every field of a stored answer is kept: trailers (replayed after the body) and `sealed`
        (a body only the route's transform opens)."""
        store, key = contract_store, _key(contract_namespace)
        trailers = [(b"x-checksum", b"1")]
        answer = StoredResponse(200, [(b"trailer", b"x-checksum")], b"sealed", trailers=trailers, sealed=True)
        claimed = await store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(claimed, Claimed)
        assert await store.complete(key, claimed.token, answer, ttl=DAY)
        rec = await store.get(key)
        assert rec is not None and rec.response == answer

    async def test_complete_with_a_stale_token_is_fenced_out(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """Only the holder's token completes a claim; any other changes nothing."""
        store, key = contract_store, _key(contract_namespace)
        claimed = await store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(claimed, Claimed)
        assert await store.complete(key, claimed.token + 1, RESPONSE, ttl=DAY) is False
        rec = await store.get(key)
        assert rec is not None and rec.state == IN_PROGRESS and rec.response is None

    async def test_release_frees_the_key_for_a_new_claim(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """A released claim is gone: the next claim wins the key, with another token."""
        store, key = contract_store, _key(contract_namespace)
        first = await store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(first, Claimed)
        assert await store.release(key, first.token) is True
        assert await store.get(key) is None
        second = await store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(second, Claimed) and second.token != first.token

    async def test_release_with_a_stale_token_is_fenced_out(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """Only the holder's token releases a claim."""
        store, key = contract_store, _key(contract_namespace)
        first = await store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(first, Claimed)
        assert await store.release(key, first.token + 1) is False
        assert await store.get(key) is not None

    async def test_release_never_deletes_a_completed_record(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """A completed record stays, whoever asks to release it (its repeats must replay)."""
        store, key = contract_store, _key(contract_namespace)
        first = await store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(first, Claimed)
        assert await store.complete(key, first.token, RESPONSE, ttl=DAY)
        assert await store.release(key, first.token) is False
        rec = await store.get(key)
        assert rec is not None and rec.state == COMPLETED

    # --- leases ----------------------------------------------------------------------------------

    async def test_extend_pushes_the_lease_by_the_store_clock(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """A renewal moves the lease to store-now + `lease`; a stale token renews nothing."""
        store, key = contract_store, _key(contract_namespace)
        first = await store.claim(key, b"fp", lease=1, ttl=DAY)
        assert isinstance(first, Claimed)
        before = await store.get(key)
        assert await store.extend(key, first.token, lease=60) is True
        after = await store.get(key)
        assert before is not None and after is not None
        assert after.lease_until >= before.lease_until + 58
        assert await store.extend(key, first.token + 1, lease=60) is False

    async def test_extend_keeps_a_running_claim_past_its_ttl(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """A renewal carries the record's expiry along: a holder running past the TTL keeps its key
        (else a retry would claim it and run a second time)."""
        store, key = contract_store, _key(contract_namespace)
        first = await store.claim(key, b"fp", lease=self.short_lease, ttl=1.5 * self.short_lease)
        assert isinstance(first, Claimed)
        assert await store.extend(key, first.token, lease=60) is True
        await self.pause(2.5)  # past the TTL it was claimed with
        again = await store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(again, Existing) and again.record.token == first.token
        assert decide(again, b"fp") is Action.IN_PROGRESS

    async def test_extend_of_a_completed_record_is_refused(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """A completed record has no lease to renew."""
        store, key = contract_store, _key(contract_namespace)
        first = await store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(first, Claimed)
        assert await store.complete(key, first.token, RESPONSE, ttl=DAY)
        assert await store.extend(key, first.token, lease=60) is False

    async def test_expired_lease_is_reported_and_the_record_kept(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """A lease that ran out leaves the record in place (its holder may have had its effect): a
        claim reads it, and the store's `now` shows the lease over."""
        store, key = contract_store, _key(contract_namespace)
        first = await store.claim(key, b"fp", lease=self.short_lease, ttl=DAY)
        assert isinstance(first, Claimed)
        await self.pause(1.75)
        again = await store.claim(key, b"fp", lease=self.short_lease, ttl=DAY)
        assert isinstance(again, Existing)
        assert again.record.token == first.token
        assert decide(again, b"fp") is Action.EXPIRED

    async def test_takeover_of_an_expired_lease_fences_the_old_holder(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """A takeover of an expired lease gets a new token; the old holder, should it wake up, can
        no longer complete, release or renew."""
        store, key = contract_store, _key(contract_namespace)
        first = await store.claim(key, b"fp", lease=self.short_lease, ttl=DAY)
        assert isinstance(first, Claimed)
        await self.pause(1.75)
        taken = await store.takeover(key, first.token, b"fp", lease=30, ttl=DAY)
        assert isinstance(taken, Claimed) and taken.token != first.token
        assert await store.complete(key, first.token, RESPONSE, ttl=DAY) is False
        assert await store.release(key, first.token) is False
        assert await store.extend(key, first.token, lease=30) is False
        assert await store.complete(key, taken.token, RESPONSE, ttl=DAY) is True

    async def test_takeover_of_a_live_lease_is_refused(self, contract_store: Backend, contract_namespace: str) -> None:
        """A live holder is never taken over: the takeover reads its record."""
        store, key = contract_store, _key(contract_namespace)
        first = await store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(first, Claimed)
        taken = await store.takeover(key, first.token, b"fp", lease=30, ttl=DAY)
        assert isinstance(taken, Existing) and taken.record.token == first.token

    async def test_takeover_with_the_wrong_stale_token_is_refused(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """A takeover names the claim it read: another token (someone took it over since) takes nothing."""
        store, key = contract_store, _key(contract_namespace)
        first = await store.claim(key, b"fp", lease=self.short_lease, ttl=DAY)
        assert isinstance(first, Claimed)
        await self.pause(1.75)
        taken = await store.takeover(key, first.token + 1, b"fp", lease=30, ttl=DAY)
        assert isinstance(taken, Existing) and taken.record.token == first.token

    async def test_takeover_of_an_absent_or_released_record_creates_nothing(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """A takeover never creates a record (None): recovery must not bring back a claim that
        ended meanwhile."""
        store = contract_store
        never = _key(contract_namespace, "never-claimed")
        assert await store.takeover(never, 1, b"fp", lease=30, ttl=DAY) is None
        assert await store.get(never) is None
        released = _key(contract_namespace, "released")
        first = await store.claim(released, b"fp", lease=self.short_lease, ttl=DAY)
        assert isinstance(first, Claimed) and await store.release(released, first.token)
        await self.pause(1.75)
        assert await store.takeover(released, first.token, b"fp", lease=30, ttl=DAY) is None
        assert await store.get(released) is None

    async def test_only_one_of_two_concurrent_takeovers_wins(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """Twenty takeovers of one expired claim at once: exactly one wins."""
        store, key = contract_store, _key(contract_namespace)
        first = await store.claim(key, b"fp", lease=self.short_lease, ttl=DAY)
        assert isinstance(first, Claimed)
        await self.pause(1.75)
        results = await asyncio.gather(*[store.takeover(key, first.token, b"fp", lease=30, ttl=DAY) for _ in range(20)])
        assert sum(isinstance(r, Claimed) for r in results) == 1

    # --- a holder that failed --------------------------------------------------------------------

    async def test_mark_failed_ends_the_lease_at_once_and_flags_the_record(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """A holder that failed after its effect marks its claim: the record stays in progress,
        flagged `holder_failed`, its lease over by the store's clock at once, so a repeat gets
        outcome-unknown and recovery can take it over by its token (fencing the failed holder)."""
        store, key = contract_store, _key(contract_namespace)
        first = await store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(first, Claimed)
        assert await store.mark_failed(key, first.token) is True
        again = await store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(again, Existing)
        rec = again.record
        assert (rec.state, rec.token, rec.holder_failed, rec.response) == (IN_PROGRESS, first.token, True, None)
        assert rec.lease_until <= again.now
        assert decide(again, b"fp") is Action.EXPIRED
        taken = await store.takeover(key, first.token, b"fp", lease=30, ttl=DAY)
        assert isinstance(taken, Claimed) and taken.token != first.token
        assert await store.complete(key, first.token, RESPONSE, ttl=DAY) is False

    async def test_a_failed_holders_claim_is_never_released_nor_renewed(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """After `mark_failed` the effect may have happened: its release is refused (a retry must not
        run it again) and so is a renewal (the lease stays over)."""
        store, key = contract_store, _key(contract_namespace)
        first = await store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(first, Claimed)
        assert await store.mark_failed(key, first.token) is True
        assert await store.release(key, first.token) is False
        assert await store.extend(key, first.token, lease=60) is False
        rec = await store.get(key)
        assert rec is not None and rec.holder_failed and rec.state == IN_PROGRESS

    async def test_mark_failed_with_a_stale_token_or_on_a_completed_record_is_fenced_out(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """Only the holder marks its claim failed, and only while it is in progress."""
        store = contract_store
        held, done = _key(contract_namespace, "held"), _key(contract_namespace, "done")
        first = await store.claim(held, b"fp", lease=30, ttl=DAY)
        assert isinstance(first, Claimed)
        assert await store.mark_failed(held, first.token + 1) is False
        rec = await store.get(held)
        assert rec is not None and not rec.holder_failed
        completed = await store.claim(done, b"fp", lease=30, ttl=DAY)
        assert isinstance(completed, Claimed) and await store.complete(done, completed.token, RESPONSE, ttl=DAY)
        assert await store.mark_failed(done, completed.token) is False
        rec = await store.get(done)
        assert rec is not None and rec.state == COMPLETED and rec.response == RESPONSE

    # --- expiry and keys -------------------------------------------------------------------------

    async def test_expired_record_counts_as_new(self, contract_store: Backend, contract_namespace: str) -> None:
        """A record past its TTL is absent: `get` finds nothing and a claim (any fingerprint) wins."""
        store, key = contract_store, _key(contract_namespace)
        ttl = 1.5 * self.short_lease
        first = await store.claim(key, b"fp", lease=self.short_lease, ttl=ttl)
        assert isinstance(first, Claimed)
        assert await store.complete(key, first.token, RESPONSE, ttl=ttl)
        await self.pause(2.5)
        assert await store.get(key) is None
        again = await store.claim(key, b"other", lease=30, ttl=DAY)
        assert isinstance(again, Claimed)

    async def test_thirty_day_ttl_is_kept(self, contract_store: Backend, contract_namespace: str) -> None:
        """A long TTL (30 days) is kept as given, not clamped."""
        store, key = contract_store, _key(contract_namespace)
        first = await store.claim(key, b"fp", lease=30, ttl=30 * DAY)
        assert isinstance(first, Claimed)
        assert await store.complete(key, first.token, RESPONSE, ttl=30 * DAY)
        again = await store.claim(key, b"fp", lease=30, ttl=30 * DAY)
        assert isinstance(again, Existing)
        assert 30 * DAY - 5 < again.record.expires_at - again.now <= 30 * DAY + 1

    async def test_get_of_an_absent_key_is_none(self, contract_store: Backend, contract_namespace: str) -> None:
        """Reading a key never claimed finds nothing."""
        assert await contract_store.get(_key(contract_namespace)) is None

    async def test_scopes_never_share_a_record(self, contract_store: Backend, contract_namespace: str) -> None:
        """One key under two scopes (tenants) and unscoped: three records."""
        store, ns = contract_store, contract_namespace
        a = await store.claim(_key(ns, "same", scope="tenant-a"), b"fp", lease=30, ttl=DAY)
        b = await store.claim(_key(ns, "same", scope="tenant-b"), b"fp", lease=30, ttl=DAY)
        c = await store.claim(_key(ns, "same"), b"fp", lease=30, ttl=DAY)
        assert isinstance(a, Claimed) and isinstance(b, Claimed) and isinstance(c, Claimed)

    async def test_length_prefixing_keeps_look_alike_keys_apart(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """Scope `a:b` with key `c` and scope `a` with key `b:c` are two records (a store keys records
        by the digest, or by all three parts, never by a joined string)."""
        store, ns = contract_store, contract_namespace
        a = await store.claim(RecordKey.build(ns, "a:b", "c"), b"fp", lease=30, ttl=DAY)
        b = await store.claim(RecordKey.build(ns, "a", "b:c"), b"fp", lease=30, ttl=DAY)
        assert isinstance(a, Claimed) and isinstance(b, Claimed)

    async def test_hostile_key_characters_are_stored_safely(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """Glob, hash-tag, SQL and escape characters in a client's key are data, nothing more."""
        store = contract_store
        for name in ("*", "{tag}", "'; DROP TABLE idem_records; --", "a:b:c", "\\x00"):
            key = _key(contract_namespace, name)
            claimed = await store.claim(key, b"fp", lease=30, ttl=DAY)
            assert isinstance(claimed, Claimed), name
            assert await store.complete(key, claimed.token, RESPONSE, ttl=DAY)
            rec = await store.get(key)
            assert rec is not None and rec.response == RESPONSE

    async def test_hundred_concurrent_claims_have_exactly_one_winner(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """A hundred claims of one key at once: one wins, every other reads the winner's record."""
        store, key = contract_store, _key(contract_namespace)
        results = await asyncio.gather(*[store.claim(key, b"fp", lease=30, ttl=DAY) for _ in range(100)])
        winners = [r for r in results if isinstance(r, Claimed)]
        assert len(winners) == 1
        assert all(r.record.token == winners[0].token for r in results if isinstance(r, Existing))

    async def test_not_replayable_marker_survives_the_store(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """An answer kept as "completed, not replayable" (too large to store) reads back so."""
        store, key = contract_store, _key(contract_namespace)
        claimed = await store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(claimed, Claimed)
        marker = StoredResponse(200, [(b"content-type", b"text/plain")], b"", replayable=False)
        assert await store.complete(key, claimed.token, marker, ttl=DAY)
        again = await store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(again, Existing) and again.record.response == marker
        assert decide(again, b"fp") is Action.NOT_STORED

    # --- the ops half (Maintenance): stale() and purge(); skipped for a store without them ------

    async def test_stale_lists_expired_in_progress_records_with_their_key(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """`stale()` lists in-progress claims whose lease ended, oldest lease first, by a key the
        other calls accept (full, or its digest alone when the store keeps no raw key); running,
        completed and expired records are not listed."""
        store, ns, short = _maintained(contract_store), contract_namespace, self.short_lease
        crashed = RecordKey.build(ns, "tenant:a{x}", "crashed*[1]")
        older = RecordKey.build(ns, None, "older")
        first = await contract_store.claim(older, b"fp0", lease=short / 2, ttl=DAY)
        second = await contract_store.claim(crashed, b"fp1", lease=short, ttl=DAY)
        assert isinstance(first, Claimed) and isinstance(second, Claimed)
        assert isinstance(await contract_store.claim(_key(ns, "running"), b"fp", lease=30, ttl=DAY), Claimed)
        done = await contract_store.claim(_key(ns, "done"), b"fp", lease=short / 2, ttl=DAY)
        assert isinstance(done, Claimed)
        assert await contract_store.complete(_key(ns, "done"), done.token, RESPONSE, ttl=DAY)
        gone = await contract_store.claim(_key(ns, "gone"), b"fp", lease=short / 2, ttl=1.5 * short)  # TTL over too
        assert isinstance(gone, Claimed)
        await self.pause(2.25)

        stale = await store.stale(0, namespace=ns)
        assert [s.key.digest for s in stale] == [older.digest, crashed.digest]  # oldest lease first
        assert all(isinstance(s, StaleRecord) and not s.effect_committed for s in stale)
        for listed, made in zip(stale, (older, crashed), strict=True):
            assert listed.key.namespace == ns
            if listed.key.hidden:  # a store that keeps only the digest: nothing a client sent
                assert (listed.key.scope, listed.key.key) == ("?", "?")
            else:
                assert (listed.key.scope, listed.key.key) == (made.scope, made.key)
        rec = stale[1].record
        assert (rec.state, rec.fingerprint, rec.token, rec.response) == (IN_PROGRESS, b"fp1", second.token, None)
        assert rec.lease_until < rec.expires_at
        assert await store.stale(60, namespace=ns) == []
        assert len(await store.stale(0, 1, namespace=ns)) == 1
        # The listed key is usable as is: take it over by its token, and it is no longer stale.
        taken = await contract_store.takeover(stale[1].key, rec.token, rec.fingerprint, lease=30, ttl=DAY)
        assert isinstance(taken, Claimed)
        assert [s.key.digest for s in await store.stale(0, namespace=ns)] == [older.digest]

    async def test_stale_lists_a_failed_holders_claim_at_once(
        self, contract_store: Backend, contract_namespace: str
    ) -> None:
        """A claim marked failed is listed without waiting for its lease (reconcile resolves it)."""
        store, key = _maintained(contract_store), _key(contract_namespace)
        first = await contract_store.claim(key, b"fp", lease=30, ttl=DAY)
        assert isinstance(first, Claimed) and await contract_store.mark_failed(key, first.token)
        stale = await store.stale(0, namespace=contract_namespace)
        assert [(s.key.digest, s.record.token, s.record.holder_failed) for s in stale] == [
            (key.digest, first.token, True)
        ]

    async def test_stale_keeps_to_its_namespace(self, contract_store: Backend, contract_namespace: str) -> None:
        """`stale(namespace=...)` lists that namespace's claims only (apps sharing a store each
        reconcile their own)."""
        store, other = _maintained(contract_store), contract_namespace + "-other"
        assert isinstance(await contract_store.claim(_key(other), b"fp", lease=self.short_lease / 2, ttl=DAY), Claimed)
        await self.pause(1.25)
        assert await store.stale(0, namespace=contract_namespace) == []
        assert [s.key.digest for s in await store.stale(0, namespace=other)] == [_key(other).digest]

    async def test_purge_deletes_only_expired_records(self, contract_store: Backend, contract_namespace: str) -> None:
        """`purge()` removes records past their TTL (completed or not) and keeps live ones; it returns
        how many it deleted (0 from a store that expires records by itself)."""
        store, ns, short = _maintained(contract_store), contract_namespace, self.short_lease
        for name in ("short-done", "short-running"):
            claimed = await contract_store.claim(_key(ns, name), b"fp", lease=short / 2, ttl=1.5 * short)
            assert isinstance(claimed, Claimed)
            if name == "short-done":
                assert await contract_store.complete(_key(ns, name), claimed.token, RESPONSE, ttl=1.5 * short)
        live = await contract_store.claim(_key(ns, "live"), b"fp", lease=30, ttl=DAY)
        assert isinstance(live, Claimed)
        await self.pause(2.25)
        assert await store.purge(batch_size=1) >= 0
        assert await contract_store.get(_key(ns, "short-done")) is None
        assert await contract_store.get(_key(ns, "short-running")) is None
        rec = await contract_store.get(_key(ns, "live"))
        assert rec is not None and rec.token == live.token
        assert await store.purge() >= 0
