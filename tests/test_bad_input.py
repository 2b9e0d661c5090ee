"""Bad input never yields a 5xx or a bad record (issue #8, item 6), on memory, Redis and Postgres.

Hypothesis drives the real middleware in-process through raw ASGI, so header lines, body chunks,
`more_body` flags and disconnects are exactly what the strategy says. Three properties:

1. Idempotency-Key values (empty, 256+, control and non-ASCII bytes, quoted, two header lines,
   injection-shaped, arbitrary bytes): malformed -> 400 key-malformed problem, the app never runs
   and the store gets no call at all; well-formed -> the app runs once, then a byte-identical replay.
2. Bodies (empty, 1-byte and empty chunks, over the limit, lying or invalid Content-Length, a
   disconnect before the last chunk): over the limit -> 413 before any store call; otherwise the
   app gets the actual bytes, the stored fingerprint is that of the actual bytes, another chunking
   of them replays and other bytes get 422. Never an in-progress record left behind.
3. Methods and paths (lowercase, unknown tokens, percent-encoded, unicode, `..`, very long,
   trailing slashes): protected requests follow the contract, the rest pass through untouched
   (the app gets the very same scope, receive and send objects) with no store call.

Every property ends by counting the records of its namespace in the store itself.
Examples per property and backend: `EXAMPLES` (fixed seed: `derandomize=True`).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idem_asgi import IdempotencyMiddleware, RawBody, RoutePolicy
from idem_asgi.backends import MemoryBackend
from idem_asgi.http import problems
from idem_asgi.http.keys import scope_from_header
from idem_asgi.records import COMPLETED, RecordKey
from tests.support.asgi import Result, drive, http_scope, messages_of
from tests.support.hostile import Charge, Recorder, Store, contract_key, open_store, status_of
from tests.support.problems import assert_problem
from tests.support.scorecard import report
from tests.support.stores import BACKENDS

# 1,000 per property and store (about 10-20 s each on the network stores).
# IDEM_BAD_INPUT_EXAMPLES=200 (one number: every store) or "memory=1000,redis=300,postgres=300".
EXAMPLES = {"memory": 1000, "redis": 1000, "postgres": 1000}
for _item in filter(None, os.environ.get("IDEM_BAD_INPUT_EXAMPLES", "").split(",")):
    _name, _, _n = _item.rpartition("=")
    EXAMPLES.update({_name: int(_n)} if _name else dict.fromkeys(EXAMPLES, int(_n)))
LIMIT = 64  # max_body of the body property: small, so bodies on both sides of it are cheap
TTL = 600  # records left behind by an aborted run expire by themselves


def examples(store: Store) -> settings:
    return settings(
        max_examples=EXAMPLES[store.name],
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@pytest.fixture(scope="module", params=BACKENDS)
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    with open_store(request.param) as s:
        yield s


def middleware(app: Any, recorder: Recorder, namespace: str, routes: list[RoutePolicy]) -> IdempotencyMiddleware:
    return IdempotencyMiddleware(
        app, backend=recorder, namespace=namespace, routes=routes, scope=scope_from_header("x-tenant")
    )


def tenant() -> bytes:
    """A scope of its own for each example, so examples never meet even when their keys are equal."""
    return uuid.uuid4().hex.encode()


def assert_replay_of(replay: Result, first: Result) -> None:
    assert replay.status == first.status and replay.body == first.body
    assert replay.headers == [*first.headers, (b"idempotent-replayed", b"true")]


# --- 1. key header values --------------------------------------------------------------------

VISIBLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
visible = st.text(VISIBLE, max_size=40).map(lambda s: s.encode("ascii"))
INJECTION = [
    b"*",
    b"{tag}",
    b"{}",
    b"}{",
    b"idem:*",
    b"a?b[c]",
    b"[^a]",
    b"\\",
    b"'; DROP TABLE idem_test_records; --",
    b"' OR '1'='1",
    b"$1",
    b"%s",
    b"%00",
    b"%0d%0a",
    b"\x00",
    b"\r\n",
    b"\r\nX-Injected: 1",
    b"\n",
    b"\t",
    b" ",
    b"\x7f",
    b"\xff",
    b"\xc3\xa9",  # "é" in UTF-8
    b"\xe9",  # "é" in latin-1
    b'"',
    b'""',
    b'"abc',
    b'abc"',
    b'"a\\"b"',
    b'"a\\\\b"',
    b'"a\\b"',
    b'"a"b"',
    b'"a b"',
    b"${jndi:ldap://x/a}",
    b"../../etc/passwd",
    b"..",
    b"null",
    b"-1",
    b":",
    b"::",
]


def quoted(key: bytes) -> bytes:
    return b'"' + key.replace(b"\\", b"\\\\").replace(b'"', b'\\"') + b'"'


def of_length(lo: int, hi: int) -> st.SearchStrategy[bytes]:
    """Visible-ASCII values of lo..hi bytes: a short random pattern repeated (drawing 1,000
    characters one by one would spend the time budget in Hypothesis rather than in the middleware)."""
    return st.tuples(visible.filter(bool), st.integers(lo, hi)).map(lambda t: (t[0] * (t[1] // len(t[0]) + 1))[: t[1]])


key_values = st.one_of(
    st.sampled_from([b"", b" ", b"\t", b" \t ", b'""', b'" "']),  # empty
    st.text(VISIBLE, min_size=1, max_size=80).map(lambda s: s.encode("ascii")),  # valid bare token
    of_length(250, 260),  # around the 255 bound
    of_length(256, 5000),  # too long
    of_length(250, 258).map(quoted),  # quoted, around the bound (escapes make some longer)
    st.text(VISIBLE, min_size=0, max_size=60).map(lambda s: quoted(s.encode("ascii"))),  # quoted
    st.tuples(visible, st.sampled_from(INJECTION), visible).map(b"".join),  # injection-shaped
    st.tuples(visible, st.binary(min_size=1, max_size=3).filter(lambda b: any(c < 0x21 for c in b)), visible).map(
        b"".join
    ),  # control characters
    st.tuples(visible, st.binary(min_size=1, max_size=3).filter(lambda b: any(c > 0x7E for c in b)), visible).map(
        b"".join
    ),  # non-ASCII / latin-1 bytes
    st.tuples(st.sampled_from([b" ", b"\t", b""]), visible, st.sampled_from([b" ", b"\t", b""])).map(b"".join),
    st.binary(max_size=300),  # anything at all
)
key_lines = st.one_of(
    key_values.map(lambda v: [v]),
    key_values.map(lambda v: [v, v]),  # the same key twice
    st.tuples(key_values, key_values).filter(lambda p: p[0] != p[1]).map(list),  # two different keys
)


def summary(test: str, store: Store, seen: dict[str, int], examples: int) -> None:
    """One result line per property and store; reached only when every example held (no 5xx)."""
    report({"test": test, "backend": store.name, "examples": examples, **seen, "5xx": 0}, "PROPERTY")


def test_key_header_values(store: Store) -> None:
    namespace = store.namespace()
    recorder = Recorder(store.backend)
    app = Charge()
    mw = middleware(app, recorder, namespace, [RoutePolicy("/payments", methods=["POST"], required=True, ttl=TTL)])
    seen = {"valid": 0, "malformed": 0, "two_lines": 0}
    body = b'{"amount":100}'

    @examples(store)
    @given(lines=key_lines)
    def check(lines: list[bytes]) -> None:
        recorder.calls.clear()
        owner = tenant()
        headers = [(b"content-type", b"application/json")]
        headers += [(b"idempotency-key", v) for v in lines]
        headers.append((b"x-tenant", owner))
        scope = http_scope(raw_headers=headers, state={})
        calls_before = app.calls
        first = store.run(drive(mw, scope, messages=messages_of([body])))
        assert first.status < 500
        key = contract_key(lines[0])
        if len(lines) > 1 or key is None:
            seen["two_lines" if len(lines) > 1 else "malformed"] += 1
            assert_problem(first, problems.KEY_MALFORMED)
            assert app.calls == calls_before
            assert recorder.calls == []  # nothing claimed, nothing stored, not even read
            # and nothing under any key the raw value could be taken for
            for candidate in {v.strip(b" \t").decode("latin-1").replace("\x00", "") for v in lines}:
                rk = RecordKey.build(namespace, owner.decode(), candidate)
                assert store.run(store.backend.get(rk)) is None
            return
        seen["valid"] += 1
        assert first.status == 201, first.body
        assert app.calls == calls_before + 1 and app.bodies[-1] == body
        assert recorder.calls == ["claim", "complete"]
        record = store.run(store.backend.get(RecordKey.build(namespace, owner.decode(), key)))
        assert record is not None and record.state == COMPLETED and record.response is not None
        assert record.response.body == first.body

        again = store.run(drive(mw, scope, messages=messages_of([body])))
        assert_replay_of(again, first)
        assert app.calls == calls_before + 1
        # the bare and the quoted spelling are one key
        respelled = http_scope(raw_headers=[(b"idempotency-key", quoted(key.encode())), (b"x-tenant", owner)], state={})
        assert_replay_of(store.run(drive(mw, respelled, messages=messages_of([body]))), first)
        assert app.calls == calls_before + 1

    check()
    assert store.run(store.count(namespace)) == seen["valid"]
    summary("bad_input_keys", store, seen, sum(seen.values()))
    assert min(seen.values()) > 0.05 * EXAMPLES[store.name], seen  # every class was really tried


# --- 2. bodies -------------------------------------------------------------------------------

BAD_LENGTHS = [
    b"",
    b" ",
    b"abc",
    b"-1",
    b"-0",
    b"+5",
    b"5 ",
    b" 5",
    b"1e3",
    b"0x10",
    b"1,1",
    b"1.0",
    b"\xd9\xa3",  # ARABIC-INDIC DIGIT THREE in UTF-8
    b"\xb2",  # latin-1 superscript two
    b"9" * 40,
    b"18446744073709551616",
    b"0" * 300 + b"1",
    b"\x00",
]


# Strategies are built once, here: a strategy made inside a composite for each draw (say
# `st.integers(0, len(body))`) costs Hypothesis milliseconds of set-up per example.
BODY = st.one_of(
    st.just(b""),
    st.binary(max_size=LIMIT),
    st.binary(min_size=LIMIT - 2, max_size=LIMIT + 2),
    st.binary(min_size=LIMIT + 1, max_size=4 * LIMIT),
)
CHUNKING = st.sampled_from(["whole", "bytes", "cuts"])
POSITIONS = st.lists(st.integers(0, 4 * LIMIT), max_size=8)  # taken modulo the size they cut
EMPTY_CHUNKS = st.lists(st.integers(0, 4 * LIMIT), max_size=3)
LENGTH_KIND = st.sampled_from(["none", "honest", "more", "less", "over", "bad"])
DELTA = st.integers(1, 10 * LIMIT)
OVER = st.integers(LIMIT + 1, 1 << 70)
SECOND_LENGTH = st.sampled_from(["honest", "0", "over", "abc"])
ONE_IN_TEN = st.integers(0, 9)
ONE_IN_FIVE = st.sampled_from([False, False, False, False, True])
BAD_LENGTH = st.sampled_from(BAD_LENGTHS)


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = draw(BODY)
    n = len(body)
    how = draw(CHUNKING)
    if how == "whole":
        chunks = [body]
    elif how == "bytes":
        chunks = [body[i : i + 1] for i in range(n)]
    else:
        cuts = sorted(c % (n + 1) for c in draw(POSITIONS))
        edges = [0, *cuts, n]
        chunks = [body[a:b] for a, b in itertools.pairwise(edges)]  # repeated cuts: empty chunks
    for at in draw(EMPTY_CHUNKS):
        chunks.insert(at % (len(chunks) + 1), b"")
    kind = draw(LENGTH_KIND)
    length: bytes | None = None
    if kind == "honest":
        length = b"%d" % n
    elif kind == "more":  # declares more than is sent
        length = b"%d" % (n + draw(DELTA))
    elif kind == "less":  # declares less than is sent
        length = b"%d" % max(n - draw(DELTA), 0)
    elif kind == "over":  # over the limit, whatever is sent
        length = b"%d" % draw(OVER)
    elif kind == "bad":
        length = draw(BAD_LENGTH)
    lengths = [] if length is None else [length]
    if length is not None and draw(ONE_IN_TEN) == 0:  # a second Content-Length line
        second = draw(SECOND_LENGTH)
        lengths.append({"honest": b"%d" % n, "0": b"0", "over": b"%d" % (LIMIT + 1), "abc": b"abc"}[second])
    # a client that hangs up before its last chunk (never sends more_body=False)
    disconnect = draw(ONE_IN_FIVE)
    cut = draw(POSITIONS.map(len)) % (len(chunks) + 1) if disconnect else len(chunks)
    return {"body": body, "chunks": chunks, "lengths": lengths, "disconnect": disconnect, "cut": cut}


def declared_over(lengths: list[bytes]) -> bool:
    """Does some Content-Length line state, as a plain decimal number, more than the limit?"""
    return any(re.fullmatch(rb"[0-9]+", v) is not None and int(v) > LIMIT for v in lengths)


def refused(sent: bytes, lengths: list[bytes]) -> tuple[bool, bool]:
    """(must be 413, may be 413). Over the limit must be refused; so must one Content-Length line
    declaring more than the limit. With two conflicting lines (a request HTTP/1.1 servers reject
    anyway) either reading is fine: the bytes actually sent are what the limit is enforced on."""
    must = len(sent) > LIMIT or (len(lengths) == 1 and declared_over(lengths))
    return must, must or declared_over(lengths)


def test_bodies(store: Store) -> None:
    namespace = store.namespace()
    recorder = Recorder(store.backend)
    app = Charge()
    mw = middleware(
        app, recorder, namespace, [RoutePolicy("/payments", methods=["POST"], required=True, max_body=LIMIT, ttl=TTL)]
    )
    seen = {"run": 0, "413": 0, "disconnect": 0}

    @examples(store)
    @given(case=bodies())
    def check(case: dict[str, Any]) -> None:
        recorder.calls.clear()
        owner, key = tenant(), b"body-key"
        rk = RecordKey.build(namespace, owner.decode(), key.decode())
        body: bytes = case["body"]
        headers = [(b"idempotency-key", key), (b"x-tenant", owner)]
        headers += [(b"content-length", v) for v in case["lengths"]]
        scope = http_scope(raw_headers=headers, state={})
        messages = messages_of(case["chunks"])
        if case["disconnect"]:
            messages = [*messages[: case["cut"]], {"type": "http.disconnect"}]
            for m in messages[:-1]:
                m["more_body"] = True
        calls_before = app.calls
        first = store.run(drive(mw, scope, messages=messages))
        status = status_of(first)
        assert status is None or status < 500, first.messages

        sent = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        must, may = refused(sent, case["lengths"])
        if must or (may and status == 413):
            seen["413"] += 1
            assert_problem(first, problems.BODY_TOO_LARGE)
        elif case["disconnect"]:
            seen["disconnect"] += 1
            assert status is None  # nobody to answer; and nothing was claimed
        if case["disconnect"] or status == 413:
            assert app.calls == calls_before
            assert recorder.calls == []
            assert store.run(store.backend.get(rk)) is None
            return

        # a body within the limit, sent whole: run once, on the actual bytes
        seen["run"] += 1
        assert status == 201, first.body
        assert app.calls == calls_before + 1 and app.bodies[-1] == body
        record = store.run(store.backend.get(rk))
        assert record is not None and record.state == COMPLETED
        hasher = RawBody().begin(scope)
        hasher.update(body)
        assert record.fingerprint == hasher.digest()  # of the bytes sent, not of what was declared

        # the same bytes, chunked another way and declared honestly: a replay
        honest = http_scope(raw_headers=[*headers[:2], (b"content-length", b"%d" % len(body))], state={})
        replay = store.run(drive(mw, honest, messages=messages_of([body[i : i + 1] for i in range(len(body))])))
        assert_replay_of(replay, first)
        # other bytes under the same key: refused, whatever Content-Length says
        other = body[:-1] + bytes([body[-1] ^ 1]) if body else b"x"
        mismatch = store.run(drive(mw, http_scope(raw_headers=headers, state={}), messages=messages_of([other])))
        assert_problem(mismatch, problems.FINGERPRINT_MISMATCH)
        assert app.calls == calls_before + 1
        record = store.run(store.backend.get(rk))
        assert record is not None and record.state == COMPLETED and record.response is not None
        assert record.response.body == first.body

    check()
    assert store.run(store.count(namespace)) == seen["run"]
    summary("bad_input_bodies", store, seen, sum(seen.values()))
    assert min(seen.values()) > 0.05 * EXAMPLES[store.name], seen


def test_a_content_length_of_5000_digits_is_413_not_500(store: Store) -> None:
    """More digits than Python's int() converts (4,300) raised ValueError: a 500. It states a number
    over any limit: 413 before any store call. Zeros first still state the true length."""
    namespace = store.namespace()
    recorder = Recorder(store.backend)
    app = Charge()
    route = RoutePolicy("/payments", methods=["POST"], required=True, max_body=LIMIT, ttl=TTL)
    mw = middleware(app, recorder, namespace, [route])
    headers = [(b"idempotency-key", b"long-length"), (b"x-tenant", tenant())]
    huge = http_scope(raw_headers=[*headers, (b"content-length", b"9" * 5000)], state={})
    assert_problem(store.run(drive(mw, huge, messages=messages_of([b"{}"]))), problems.BODY_TOO_LARGE)
    assert app.calls == 0 and recorder.calls == []
    padded = http_scope(raw_headers=[*headers, (b"content-length", b"0" * 4999 + b"2")], state={})
    assert status_of(store.run(drive(mw, padded, messages=messages_of([b"{}"])))) == 201
    assert app.calls == 1


# --- 3. methods and paths --------------------------------------------------------------------

ROUTES = [
    RoutePolicy("/payments", methods=["POST", "PATCH"], required=True, ttl=TTL),
    RoutePolicy("/orders/{order_id}/refunds", methods=["POST"], required=True, ttl=TTL),
    RoutePolicy("/api/*", methods=["POST", "PUT", "DELETE"], required=True, ttl=TTL),
]


def protected(method: str, path: str) -> bool:
    """The routes above, matched the way the contract reads: methods case-sensitively (RFC 9110),
    `{name}` as one non-empty segment, `/api/*` as `/api` and everything under `/api/`."""
    if method in ("POST", "PATCH") and path == "/payments":
        return True
    parts = path.split("/")
    if method == "POST" and len(parts) == 4 and parts[:2] == ["", "orders"] and parts[2] and parts[3] == "refunds":
        return True
    return method in ("POST", "PUT", "DELETE") and (path == "/api" or path.startswith("/api/"))


STANDARD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT", "PROPFIND", "QUERY"]
methods = st.one_of(
    st.sampled_from(STANDARD),
    st.sampled_from(STANDARD).map(str.lower),
    st.sampled_from(STANDARD).flatmap(
        lambda m: st.lists(st.booleans(), min_size=len(m), max_size=len(m)).map(
            lambda up: "".join(c.upper() if u else c.lower() for c, u in zip(m, up, strict=True))
        )
    ),
    st.from_regex(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,24}", fullmatch=True),  # any RFC 9110 token
    st.text(max_size=12),  # not even a token
)
PATHS = [
    "/payments",
    "/payments/",
    "/payments//",
    "/payments/..",
    "/payments/../payments",
    "/./payments",
    "//payments",
    "/Payments",
    "/PAYMENTS",
    "/payments%2F",
    "/payments%00",
    "/payments\x00",
    "/payments\n",
    "/payments ",
    "/payment",
    "/paymentsX",
    "/orders/1/refunds",
    "/orders/1/refunds/",
    "/orders//refunds",
    "/orders/a/b/refunds",
    "/orders/%2F/refunds",
    "/orders/../refunds",
    "/orders/\n/refunds",
    "/orders/ü/refunds",
    "/api",
    "/api/",
    "/api/x",
    "/api/x/../../payments",
    "/api/a\nb",
    "/api/\r\n",
    "/api\n",
    "/apix",
    "/API/x",
    "/",
    "",
    "*",
]
SEGMENT = st.text(
    st.one_of(st.sampled_from(list("/.%2Fa\n\r\t \x00?#;")), st.characters(codec="utf-8", exclude_categories=["Cs"])),
    max_size=30,
)
paths = st.one_of(
    st.sampled_from(PATHS),
    st.tuples(st.sampled_from(["/payments", "/api", "/api/", "/orders/", "/orders/1/refunds", "/"]), SEGMENT).map(
        "".join
    ),
    st.tuples(SEGMENT, SEGMENT).map(lambda p: f"/orders/{p[0]}/refunds{p[1]}"),
    st.integers(1, 20_000).map(lambda n: "/api/" + "a" * n),  # very long
    st.integers(1, 2_000).map(lambda n: "/api" + "/" * n),
    st.text(max_size=60).map(lambda s: "/" + s),
)
# Aimed at the routes: a method a route protects on a path of that route's shape, odd characters included.
ODD = st.tuples(SEGMENT, st.sampled_from(["\n", "\r", "\r\n", "\x00", "\t", " ", "%0A", "..", "//", "\u2028"]), SEGMENT)
aimed = st.one_of(
    st.tuples(st.sampled_from(["POST", "PATCH"]), st.just("/payments")),
    st.tuples(st.just("POST"), st.one_of(SEGMENT, ODD.map("".join)).map(lambda s: f"/orders/{s}/refunds")),
    st.tuples(
        st.sampled_from(["POST", "PUT", "DELETE"]),
        st.one_of(
            st.just("/api"),
            SEGMENT.map(lambda s: "/api/" + s),
            ODD.map(lambda t: "/api/" + "".join(t)),
            st.integers(1, 20_000).map(lambda n: "/api/" + "%41" * (n // 3)),
        ),
    ),
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str]:
    if draw(st.integers(0, 9)) < 6:
        return draw(aimed)
    return draw(methods), draw(paths)


def test_methods_and_paths(store: Store) -> None:
    namespace = store.namespace()
    recorder = Recorder(store.backend)
    app = Charge()
    mw = middleware(app, recorder, namespace, ROUTES)
    seen = {"protected": 0, "passed": 0, "stored": 0}
    body = b'{"amount":7}'

    @examples(store)
    @given(request=requests(), with_key=st.booleans())
    def check(request: tuple[str, str], with_key: bool) -> None:
        method, path = request
        recorder.calls.clear()
        owner = tenant()
        headers = [(b"x-tenant", owner)] + ([(b"idempotency-key", b"k-" + owner)] if with_key else [])
        scope = http_scope(method, path, raw_headers=headers, state={})
        calls_before = app.calls
        received: list[Any] = []

        async def receive() -> Any:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: Any) -> None:
            received.append(message)

        async def spy(s: Any, r: Any, se: Any) -> None:
            seen_objects.append((s, r, se))
            await app(s, r, se)

        seen_objects: list[tuple[Any, Any, Any]] = []
        mw.app = spy
        store.run(mw(scope, receive, send))
        result = Result(received)
        assert result.status < 500

        if not protected(method, path):
            seen["passed"] += 1
            assert seen_objects == [(scope, receive, send)]  # the very same objects: untouched, unbuffered
            assert seen_objects[0][0] is scope and seen_objects[0][1] is receive and seen_objects[0][2] is send
            assert recorder.calls == []
            assert result.status == 201 and result.header("idempotent-replayed") is None
            return
        seen["protected"] += 1
        if not with_key:
            assert_problem(result, problems.KEY_REQUIRED)
            assert app.calls == calls_before and recorder.calls == []
            return
        seen["stored"] += 1
        assert result.status == 201 and app.calls == calls_before + 1
        assert recorder.calls == ["claim", "complete"]
        replay = Result([])

        async def send_replay(message: Any) -> None:
            replay.messages.append(message)

        store.run(mw(http_scope(method, path, raw_headers=headers, state={}), receive, send_replay))
        assert_replay_of(replay, result)
        assert app.calls == calls_before + 1

    try:
        check()
    finally:
        mw.app = app
    assert store.run(store.count(namespace)) == seen["stored"]
    summary("bad_input_methods_paths", store, seen, seen["protected"] + seen["passed"])
    assert min(seen.values()) > 0.05 * EXAMPLES[store.name], seen


@pytest.mark.memory
@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/api/a\nb"), ("PUT", "/api/\n"), ("DELETE", "/api/x/\r\n/y"), ("POST", "/orders/a\nb/refunds")],
)
def test_a_decoded_newline_in_the_path_does_not_bypass_a_pattern_route(method: str, path: str) -> None:
    """Servers percent-decode the path (`/api/a%0Ab` arrives as `/api/a\\nb`). A `/api/*` pattern
    compiled without DOTALL stopped its `.*` at the newline, matched no policy, and the request ran
    unprotected: every retry executed again. Found by test_methods_and_paths."""
    app = Charge()
    recorder = Recorder(MemoryBackend())
    mw = middleware(app, recorder, "nl", ROUTES)
    headers = [(b"idempotency-key", b"nl-1"), (b"x-tenant", b"t")]

    async def scenario() -> tuple[Result, Result]:
        first = await drive(mw, http_scope(method, path, raw_headers=headers, state={}), messages=messages_of([b"{}"]))
        return first, await drive(
            mw, http_scope(method, path, raw_headers=headers, state={}), messages=messages_of([b"{}"])
        )

    first, again = asyncio.run(scenario())
    assert first.status == 201 and recorder.calls == ["claim", "complete", "claim"]
    assert_replay_of(again, first)
    assert app.calls == 1
