"""What a job must never do, on every store: run its effect twice because its result could not be
stored, accept a function it cannot make safe, take a legitimate retry for another call (or two
calls for one), or run outside its claim (`current_idempotency()`, `transaction()`)."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import uuid
from typing import Any

import asyncpg
import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from idem_asgi import current_idempotency
from idem_asgi.backends import Backend, MemoryBackend
from idem_asgi.errors import ConfigurationError
from idem_asgi.jobs.args import args_key, fingerprint
from idem_asgi.jobs.consumers import Settle, apply_once
from idem_asgi.jobs.decorator import (
    InProgress,
    JobError,
    KeyReused,
    OutcomeUnknown,
    ResultNotStorable,
    claim,
    current_job,
    idempotent,
)
from idem_asgi.records import COMPLETED, IN_PROGRESS, RecordKey
from tests.support.servers import POSTGRES_DSN
from tests.support.stores import Delegating, make_backend


def fresh() -> str:
    return f"jobs-{uuid.uuid4().hex}"


class Opaque:
    """A result msgspec cannot encode."""


# --- 1. the effect is marked before the result is stored ------------------------------------


async def test_an_unencodable_result_keeps_the_claim_and_never_runs_the_effect_again(backend: Backend) -> None:
    namespace = fresh()
    charges: list[str] = []

    @idempotent(backend, args=["order_id"], namespace=namespace)
    async def charge(order_id: str):  # type: ignore[no-untyped-def]  # no annotation: anything goes in
        charges.append(order_id)
        return Opaque()

    with pytest.raises(ResultNotStorable, match="outcome-unknown"):
        await charge("o1")
    for _ in range(2):
        with pytest.raises(OutcomeUnknown):
            await charge("o1")
    assert charges == ["o1"], "3 calls, 1 charge"
    record = await backend.get(RecordKey.build(namespace, None, "order_id=o1"))
    assert record is not None and record.state == IN_PROGRESS and record.holder_failed


async def test_a_result_that_does_not_match_its_annotation_is_refused_before_it_is_stored(backend: Backend) -> None:
    namespace = fresh()
    runs: list[str] = []

    @idempotent(backend, args=["order_id"], namespace=namespace)
    async def charge(order_id: str) -> int:
        runs.append(order_id)
        return "ch_1"  # type: ignore[return-value]  # the bug this refuses

    with pytest.raises(ResultNotStorable, match="Expected `int`"):
        await charge("o1")
    with pytest.raises(OutcomeUnknown):  # not a ValidationError for every repeat until the TTL
        await charge("o1")
    assert runs == ["o1"]
    record = await backend.get(RecordKey.build(namespace, None, "order_id=o1"))
    assert record is not None and record.state == IN_PROGRESS, "nothing was stored"


async def test_the_context_manager_form_keeps_an_unstorable_result_as_outcome_unknown(backend: Backend) -> None:
    namespace, key = fresh(), uuid.uuid4().hex
    with pytest.raises(ResultNotStorable):
        async with claim(backend, key, namespace=namespace) as job:
            await job.store(Opaque())
    with pytest.raises(OutcomeUnknown):
        async with claim(backend, key, namespace=namespace):
            pytest.fail("never run again")


async def test_a_block_that_marked_its_effect_and_stored_nothing_keeps_the_claim(backend: Backend) -> None:
    namespace, key = fresh(), uuid.uuid4().hex
    async with claim(backend, key, namespace=namespace) as job:
        assert job.claim is not None
        job.claim.mark_effect()  # the provider was called; the block then ends without a result
    with pytest.raises(OutcomeUnknown):
        async with claim(backend, key, namespace=namespace):
            pytest.fail("never run again")


async def test_storing_twice_says_it_was_already_stored(backend: Backend) -> None:
    namespace, key = fresh(), uuid.uuid4().hex
    async with claim(backend, key, namespace=namespace) as job:
        await job.store({"sent": True})
        with pytest.raises(JobError, match="already stored") as refused:
            await job.store({"sent": True})
        assert not isinstance(refused.value, OutcomeUnknown)
    record = await backend.get(RecordKey.build(namespace, None, key))
    assert record is not None and record.state == COMPLETED
    async with claim(backend, key, namespace=namespace) as again:
        assert again.done


async def test_a_consumer_whose_result_cannot_be_encoded_dead_letters_it_after_one_run(backend: Backend) -> None:
    namespace = fresh()
    ran: list[int] = []

    async def handler() -> Opaque:
        ran.append(1)
        return Opaque()

    common: dict[str, Any] = {"namespace": namespace, "ttl": 60.0, "lease": 5.0, "wait": 0.0}
    settles = [await apply_once(backend, "m-1", b"{}", handler, **common) for _ in range(3)]
    assert settles == [Settle.DEAD] * 3 and ran == [1], "never handed back for a second run"


# --- 2. what cannot be made safe is refused at decoration time --------------------------------


def test_sync_functions_and_generators_are_refused_at_decoration() -> None:
    jobs = idempotent(MemoryBackend(), args=["order_id"], namespace="jobs:refused")

    def sync(order_id: str) -> int:
        return 1

    async def agen(order_id: str):  # type: ignore[no-untyped-def]
        yield 1

    def gen(order_id: str):  # type: ignore[no-untyped-def]
        yield 1

    with pytest.raises(ConfigurationError, match="not an `async def` function"):
        jobs(sync)  # type: ignore[arg-type]
    for func in (agen, gen):
        with pytest.raises(ConfigurationError, match="generator"):
            jobs(func)
    with pytest.raises(ConfigurationError, match="not parameters"):
        idempotent(MemoryBackend(), args=["orderid"], namespace="jobs:refused")(_module_level_charge)


async def _module_level_charge(order_id: str) -> str:
    return f"charged {order_id}"


async def _module_level_refund(order_id: str) -> str:
    return f"refunded {order_id}"


def _as_if(func: Any, module: str | None = None, qualname: str | None = None, name: str | None = None) -> Any:
    """A copy of `func` that claims to come from elsewhere (as a script or a wrapper makes it)."""
    copy = type(func)(func.__code__, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    copy.__module__ = module or func.__module__
    copy.__qualname__ = qualname or func.__qualname__
    copy.__name__ = name or func.__name__
    return copy


def test_a_default_namespace_that_is_not_stable_is_refused_with_a_way_out() -> None:
    jobs = idempotent(MemoryBackend(), args=["order_id"])

    async def local(order_id: str) -> str:
        return order_id

    def unwrapped(f: Any) -> Any:
        async def wrapper(*a: Any, **kw: Any) -> Any:  # no functools.wraps
            return await f(*a, **kw)

        return wrapper

    assert jobs(_module_level_charge).namespace == f"jobs:{__name__}._module_level_charge"  # type: ignore[attr-defined]
    assert jobs(_module_level_charge).namespace == jobs(_module_level_charge).namespace  # type: ignore[attr-defined]
    with pytest.raises(ConfigurationError, match=r"__main__.*namespace="):
        jobs(_as_if(_module_level_charge, module="__main__"))
    with pytest.raises(ConfigurationError, match=r"inside another function.*namespace="):
        jobs(local)
    with pytest.raises(ConfigurationError, match="inside another function"):
        idempotent(MemoryBackend(), key=lambda order_id: order_id)(unwrapped(_module_level_charge))
    with pytest.raises(ConfigurationError, match="named apart from its code"):
        jobs(_as_if(_module_level_charge, qualname="charge", name="charge"))
    with pytest.raises(ConfigurationError, match="already used by another function"):
        jobs(_as_if(_module_level_refund, qualname="_module_level_charge", name="_module_level_refund"))
    assert idempotent(MemoryBackend(), args=["order_id"], namespace="jobs:local")(local).namespace == "jobs:local"  # type: ignore[attr-defined]


def test_a_return_annotation_msgspec_cannot_store_is_refused_at_decoration() -> None:
    jobs = idempotent(MemoryBackend(), args=["order_id"], namespace="jobs:refused")

    async def opaque(order_id: str) -> Opaque:
        return Opaque()

    async def opaques(order_id: str) -> dict[str, list[Opaque]]:
        return {}

    for func in (opaque, opaques):
        with pytest.raises(ConfigurationError, match="Opaque, which msgspec cannot store"):
            jobs(func)


async def test_two_functions_keyed_by_the_same_arguments_never_share_results(backend: Backend) -> None:
    charge = idempotent(backend, args=["order_id"])(_module_level_charge)
    refund = idempotent(backend, args=["order_id"])(_module_level_refund)
    order = uuid.uuid4().hex
    assert await charge(order) == f"charged {order}"
    assert await refund(order) == f"refunded {order}", "its own run, not the charge's stored result"


# --- 3. deterministic fingerprints, unambiguous typed keys -----------------------------------


async def test_a_retry_with_its_mappings_built_in_another_order_replays(backend: Backend) -> None:
    runs: list[dict[str, int]] = []

    @idempotent(backend, args=["order_id"], namespace=fresh())
    async def charge(order_id: str, lines: dict[str, int], tags: set[str], **extra: int) -> int:
        runs.append(lines)
        return sum(lines.values())

    assert await charge("o1", {"a": 1, "b": 2}, {"x", "y", "z"}, fee=1, tip=2) == 3
    assert await charge("o1", {"b": 2, "a": 1}, {"z", "y", "x"}, tip=2, fee=1) == 3  # not KeyReused
    assert len(runs) == 1
    with pytest.raises(KeyReused):
        await charge("o1", {"a": 1, "b": 2}, {"x", "y", "z"}, fee=1.0, tip=2)  # type: ignore[arg-type]  # 1.0 is not 1


async def test_keys_made_of_arguments_are_typed_and_unambiguous(backend: Backend) -> None:
    runs: list[tuple[Any, ...]] = []

    @idempotent(backend, args=["a", "b"], namespace=fresh())
    async def job(a: Any, b: Any) -> str:
        runs.append((a, b))
        return f"{a!r}/{b!r}"

    assert await job(1, "z") == "1/'z'"
    assert await job("1", "z") == "'1'/'z'"  # the string "1" is not the int 1
    assert await job("x,b=y", "z") == "'x,b=y'/'z'"
    assert await job("x", "y,b=z") == "'x'/'y,b=z'"  # not the same key as the one before
    assert len(runs) == 4
    assert current_job() is None


def test_args_keys_of_plain_values_read_as_before() -> None:
    assert args_key({"order_id": "o1"}, ["order_id"]) == "order_id=o1"
    assert args_key({"order_id": 7, "n": None}, ["order_id", "n"]) == "order_id=7,n=null"
    assert args_key({"order_id": "7"}, ["order_id"]) == 'order_id="7"'
    assert args_key({"d": datetime.date(2026, 1, 2)}, ["d"]) == "d=2026-01-02"


def _parse(key: str) -> list[tuple[str, Any]]:
    """The reading the `_job_args` docstring describes: a JSON value where one ends, else bare to `,`."""
    out: list[tuple[str, Any]] = []
    decoder, at = json.JSONDecoder(), 0
    while True:
        eq = key.index("=", at)
        name, at = key[at:eq], eq + 1
        try:
            value, end = decoder.raw_decode(key, at)
            if end != len(key) and key[end] != ",":
                raise ValueError
        except ValueError:
            end = key.find(",", at)
            end = len(key) if end < 0 else end
            value = key[at:end]
        out.append((name, value))
        if end == len(key):
            return out
        at = end + 1


tricky = st.text(alphabet=st.sampled_from(',="\\ []{}0123456789.-+eEtruefalsn'), max_size=8)  # JSON's own
json_texts = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3), lambda inner: st.lists(inner, max_size=2)
).map(json.dumps)  # strings that are themselves JSON: "1", "true", "[1, \"a\"]"
scalars = st.one_of(
    tricky,
    json_texts,
    st.text(),
    st.integers(),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False, allow_infinity=False),
)
values = st.one_of(scalars, st.lists(scalars, max_size=3))


def _typed(value: Any) -> Any:
    return [_typed(v) for v in value] if isinstance(value, list) else (type(value), value)


@settings(max_examples=300)
@given(st.lists(values, min_size=1, max_size=4))
@example(["x,b=y", "z"])
@example(['"a', '"'])  # bare, these two would read as one JSON string
@example(["1", 1, "true", True, "null", None, "", " 2"])
def test_an_args_key_reads_back_as_exactly_its_typed_values(arguments: list[Any]) -> None:
    names = [f"a{i}" for i in range(len(arguments))]
    parsed = _parse(args_key(dict(zip(names, arguments, strict=True)), names))
    assert [n for n, _ in parsed] == names
    assert [_typed(v) for _, v in parsed] == [_typed(v) for v in arguments]


msgpack_ints = st.integers(-(2**63), 2**64 - 1)


@given(
    st.dictionaries(st.one_of(st.text(), msgpack_ints), st.one_of(st.text(), msgpack_ints), max_size=6), st.randoms()
)
def test_a_fingerprint_does_not_depend_on_the_order_a_mapping_was_built_in(mapping: dict[Any, Any], rnd: Any) -> None:
    items = list(mapping.items())
    rnd.shuffle(items)
    shuffled = dict(items)
    assert fingerprint({"m": mapping, "s": set(mapping)}) == fingerprint({"m": shuffled, "s": set(shuffled)})


def test_fingerprints_of_plain_arguments_are_those_of_earlier_releases() -> None:
    plain = {"order_id": "o1", "amount": 100, "lines": {"a": 1, "b": 2}}
    assert fingerprint(plain) == hashlib.sha256(msgspec.msgpack.encode(plain)).digest()


# --- 4. results round-trip to the annotated type ---------------------------------------------


async def test_a_repeat_returns_the_annotated_type_and_without_one_msgspecs_natural_types(backend: Backend) -> None:
    when = datetime.datetime(2026, 12, 1, 9, 30, tzinfo=datetime.UTC)

    @idempotent(backend, args=["n"], namespace=fresh())
    async def typed(n: int) -> tuple[int, datetime.datetime]:
        return (n, when)

    @idempotent(backend, args=["n"], namespace=fresh())
    async def untyped(n: int):  # type: ignore[no-untyped-def]
        return (n, when.replace(tzinfo=None))

    assert await typed(1) == await typed(1) == (1, when)
    assert type(await typed(1)) is tuple
    assert await untyped(1) == (1, when.replace(tzinfo=None))  # the first call: the function's own value
    assert await untyped(1) == [1, "2026-12-01T09:30:00"]  # a repeat: msgpack's array and string


# --- 5. the job's claim is the current one -----------------------------------------------------


async def test_inside_a_job_current_idempotency_holds_its_live_claim(backend: Backend) -> None:
    seen: list[Any] = []

    @idempotent(backend, args=["order_id"], scope=lambda tenant, order_id: tenant, namespace=fresh())
    async def charge(tenant: str, order_id: str) -> int:
        info = current_idempotency()
        assert info is not None and info.claim is not None
        seen.append((info.key, info.scope, info.claim is current_job(), info.claim.backend is backend))
        return 1

    assert current_idempotency() is None
    await charge("t1", "o1")
    assert seen == [("order_id=o1", "t1", True, True)]
    assert current_idempotency() is None and current_job() is None

    async def handler() -> None:
        info = current_idempotency()
        seen.append(None if info is None or info.claim is None else info.key)

    await apply_once(backend, "m-9", b"{}", handler, namespace=fresh(), ttl=60, lease=5, wait=0)
    assert seen[-1] == "m-9"


async def test_a_transaction_inside_a_job_commits_with_its_claim_and_is_never_run_again() -> None:
    pg = await make_backend("postgres")
    raw = await asyncpg.connect(POSTGRES_DSN)
    ledger = f"idem_test_ledger_{uuid.uuid4().hex[:12]}"
    await raw.execute(f"CREATE TABLE {ledger} (order_id text NOT NULL)")
    namespace = fresh()
    try:

        @idempotent(pg, args=["order_id"], namespace=namespace)
        async def charge(order_id: str) -> str:
            async with pg.transaction() as conn:
                await conn.execute(f"INSERT INTO {ledger} VALUES ($1)", order_id)
            await pg.checkpoint("charged")  # on the job's own row
            raise ConnectionResetError("the worker lost its connection after the COMMIT")

        with pytest.raises(ConnectionResetError):
            await charge("o1")
        record = await pg.get(RecordKey.build(namespace, None, "order_id=o1"))
        assert record is not None and record.effect_committed and record.state == IN_PROGRESS
        assert record.checkpoint == "charged"
        with pytest.raises(OutcomeUnknown):
            await charge("o1")
        assert await raw.fetchval(f"SELECT count(*) FROM {ledger}") == 1
    finally:
        await raw.execute(f"DROP TABLE {ledger}")
        await raw.close()
        await pg.aclose()


# --- 6. lease renewal, scopes, a duplicate's wait ------------------------------------------------


async def test_a_job_running_past_its_lease_keeps_it_and_a_repeat_gets_in_progress(backend: Backend) -> None:
    lease = 0.3
    runs: list[str] = []
    gate, running = asyncio.Event(), asyncio.Event()

    @idempotent(backend, args=["order_id"], namespace=fresh(), lease=lease)
    async def charge(order_id: str) -> str:
        runs.append(order_id)
        running.set()
        await gate.wait()
        return "charged"

    first = asyncio.create_task(charge("o1"))
    await asyncio.wait_for(running.wait(), 10)
    await asyncio.sleep(4 * lease)  # four leases long: only renewals keep the claim live
    with pytest.raises(InProgress):
        await charge("o1")
    gate.set()
    assert await first == "charged" and await charge("o1") == "charged"
    assert runs == ["o1"]


async def test_a_jobs_scope_keeps_the_same_key_apart_per_owner(backend: Backend) -> None:
    runs: list[tuple[str, str]] = []

    @idempotent(
        backend, args=["order_id"], fingerprint=["order_id"], scope=lambda tenant, order_id: tenant, namespace=fresh()
    )
    async def charge(tenant: str, order_id: str) -> str:
        runs.append((tenant, order_id))
        return tenant

    assert await charge("t1", "o1") == "t1"
    assert await charge("t2", "o1") == "t2", "another owner's key: its own run"
    assert await charge("t1", "o1") == "t1"
    assert runs == [("t1", "o1"), ("t2", "o1")]

    namespace, key = fresh(), uuid.uuid4().hex
    for owner in ("t1", "t2"):
        async with claim(backend, key, namespace=namespace, scope=owner) as job:
            assert not job.done, f"{owner} runs its own"
            await job.store(owner)
    async with claim(backend, key, namespace=namespace, scope="t1") as job:
        assert job.done and job.result is not None
        assert msgspec.msgpack.decode(job.result) == "t1"


async def test_a_consumer_duplicate_whose_wait_runs_out_is_handed_back_not_dead_lettered(backend: Backend) -> None:
    namespace = fresh()
    gate, running = asyncio.Event(), asyncio.Event()

    async def slow() -> None:
        running.set()
        await gate.wait()

    common: dict[str, Any] = {"namespace": namespace, "ttl": 60.0, "lease": 5.0}
    elsewhere = Delegating(backend)  # the first delivery runs in another consumer process
    first = asyncio.create_task(apply_once(elsewhere, "m-1", b"{}", slow, wait=0.0, **common))
    await asyncio.wait_for(running.wait(), 10)
    assert await apply_once(backend, "m-1", b"{}", slow, wait=0.2, **common) is Settle.RETRY
    # Running in this very process (a redelivery after its channel closed), it is held here instead.
    assert await apply_once(elsewhere, "m-1", b"{}", slow, wait=0.2, **common) is Settle.HELD_HERE
    gate.set()
    assert await first is Settle.ACK
    assert await apply_once(backend, "m-1", b"{}", slow, wait=0.2, **common) is Settle.ACK
