"""SignatureMiddleware: only correctly signed webhook deliveries reach the app, with their raw body intact."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from idem_asgi import ConfigurationError, IdempotencyMiddleware, RoutePolicy, event_id
from idem_asgi._types import Message, Receive, Scope, Send
from idem_asgi.backends import MemoryBackend
from idem_asgi.http import problems
from idem_asgi.http.signatures import (
    SIGNATURE_INVALID,
    SIGNATURE_MALFORMED,
    HmacScheme,
    Scheme,
    SignatureInvalid,
    SignatureMalformed,
    SignatureMiddleware,
    StripeScheme,
)
from idem_asgi.records import RecordKey
from tests.support.asgi import Result, drive, http_scope, read_body
from tests.support.problems import assert_problem
from tests.support.signing import SECRET, sign_stripe

pytestmark = pytest.mark.memory

OLD_SECRET = "whsec_previous"
PATH = "/webhooks/stripe"
# Not what any JSON encoder would write back: odd spacing, key order, escapes, a trailing newline.
BODY = b'{"id": "evt_1",  "type":"charge.succeeded", "amount" : 4200, "note":"caf\\u00e9 \xc3\xa9"}\n'


def raw_mac(body: bytes, secret: str = SECRET) -> bytes:
    return hmac.new(secret.encode(), body, hashlib.sha256).digest()


class Recorder:
    """An app that reads the whole body, remembers what it got, and answers 200."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.receives: list[Receive] = []

    @property
    def calls(self) -> int:
        return len(self.receives)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.receives.append(receive)
        if scope["type"] != "http":
            return
        self.bodies.append(await read_body(receive))
        payload = json.dumps({"run": self.calls}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})


def stripe_mw(app: Any, **kwargs: Any) -> SignatureMiddleware:
    kwargs.setdefault("secrets", [SECRET])
    return SignatureMiddleware(app, paths=[PATH], scheme=StripeScheme(), **kwargs)


def signed(header: str, path: str = PATH, name: str = "Stripe-Signature", method: str = "POST") -> dict[str, Any]:
    return http_scope(method, path, headers=[(name, header)])


# ---------------------------------------------------------------------------------------------
# Stripe-style signatures


async def test_valid_stripe_signature_reaches_the_app_with_the_exact_raw_body() -> None:
    app = Recorder()
    result = await drive(stripe_mw(app), signed(sign_stripe(BODY)), [BODY])
    assert result.status == 200
    assert app.bodies == [BODY]


async def test_a_body_in_several_chunks_is_verified_whole_and_reaches_the_app_unchanged() -> None:
    app = Recorder()
    chunks = [BODY[:7], b"", BODY[7:30], BODY[30:]]
    result = await drive(stripe_mw(app), signed(sign_stripe(BODY)), chunks)
    assert result.status == 200
    assert app.bodies == [BODY]


async def test_after_the_body_the_app_still_hears_the_disconnect() -> None:
    heard: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        heard.append(await receive())

    await drive(stripe_mw(app), signed(sign_stripe(BODY)), [BODY[:5], BODY[5:]], disconnect_after_first_chunk=True)
    assert heard == [{"type": "http.disconnect"}]


async def test_a_bad_signature_is_refused_with_401() -> None:
    app = Recorder()
    header = f"t={int(time.time())},v1={'ab' * 32}"
    result = await drive(stripe_mw(app), signed(header), [BODY])
    assert_problem(result, SIGNATURE_INVALID)
    assert app.calls == 0


async def test_a_signature_made_with_another_secret_is_refused_with_401() -> None:
    app = Recorder()
    result = await drive(stripe_mw(app), signed(sign_stripe(BODY, secret="whsec_attacker")), [BODY])
    assert_problem(result, SIGNATURE_INVALID)
    assert app.calls == 0


async def test_a_tampered_body_is_refused_with_401() -> None:
    app = Recorder()
    tampered = BODY.replace(b"4200", b"9900")
    result = await drive(stripe_mw(app), signed(sign_stripe(BODY)), [tampered])
    assert_problem(result, SIGNATURE_INVALID)
    assert app.calls == 0


async def test_a_signature_over_the_body_alone_is_refused_because_the_timestamp_is_signed_too() -> None:
    app = Recorder()
    header = f"t={int(time.time())},v1={raw_mac(BODY).hex()}"
    result = await drive(stripe_mw(app), signed(header), [BODY])
    assert_problem(result, SIGNATURE_INVALID)
    assert app.calls == 0


@pytest.mark.parametrize(("offset", "word"), [(-301, "old"), (301, "future")], ids=["expired", "future"])
async def test_a_timestamp_outside_the_tolerance_is_refused_with_401(offset: int, word: str) -> None:
    app = Recorder()
    header = sign_stripe(BODY, t=int(time.time()) + offset)
    result = await drive(stripe_mw(app), signed(header), [BODY])
    doc = assert_problem(result, SIGNATURE_INVALID)
    assert word in doc["detail"] and "300 s tolerance" in doc["detail"]
    assert app.calls == 0


async def test_a_timestamp_inside_a_configured_tolerance_passes() -> None:
    app = Recorder()
    mw = SignatureMiddleware(app, paths=[PATH], scheme=StripeScheme(tolerance=3600), secrets=[SECRET])
    result = await drive(mw, signed(sign_stripe(BODY, t=int(time.time()) - 1800)), [BODY])
    assert result.status == 200


async def test_old_and_new_secret_are_both_accepted_during_a_rotation() -> None:
    app = Recorder()
    mw = stripe_mw(app, secrets=[OLD_SECRET, SECRET])
    for secret in (OLD_SECRET, SECRET):
        result = await drive(mw, signed(sign_stripe(BODY, secret=secret)), [BODY])
        assert result.status == 200
    assert app.calls == 2


async def test_one_matching_v1_among_several_is_enough() -> None:
    app = Recorder()
    t = int(time.time())
    good = sign_stripe(BODY, t=t).split("v1=")[1]
    header = f"t={t},v0={'00' * 32},v1={'cd' * 32},v1={good}"
    result = await drive(stripe_mw(app), signed(header), [BODY])
    assert result.status == 200


async def test_a_missing_signature_header_is_refused_with_400() -> None:
    app = Recorder()
    result = await drive(stripe_mw(app), http_scope("POST", PATH), [BODY])
    doc = assert_problem(result, SIGNATURE_MALFORMED)
    assert "missing" in doc["detail"]
    assert app.calls == 0


@pytest.mark.parametrize(
    "header",
    [
        "",
        "garbage",
        "t=1700000000",
        f"v1={'ab' * 32}",
        f"t=yesterday,v1={'ab' * 32}",
        f"t={'9' * 5000},v1={'ab' * 32}",
        f"t=1700000000,t=1700000001,v1={'ab' * 32}",
        "t=1700000000,v1=not-hex",
        "t=1700000000,v1=abcd",
    ],
    ids=["empty", "garbage", "no-v1", "no-t", "t-not-int", "t-huge", "two-t", "v1-not-hex", "v1-short"],
)
async def test_an_unparseable_stripe_header_is_refused_with_400(header: str) -> None:
    app = Recorder()
    result = await drive(stripe_mw(app), signed(header), [BODY])
    assert_problem(result, SIGNATURE_MALFORMED)
    assert app.calls == 0


async def test_two_signature_header_lines_are_refused_with_400() -> None:
    app = Recorder()
    good = sign_stripe(BODY)
    scope = http_scope("POST", PATH, headers=[("Stripe-Signature", good), ("Stripe-Signature", good)])
    result = await drive(stripe_mw(app), scope, [BODY])
    assert_problem(result, SIGNATURE_MALFORMED)
    assert app.calls == 0


# ---------------------------------------------------------------------------------------------
# plain HMAC-over-body signatures


PLAIN = [
    pytest.param(HmacScheme(header="X-Signature"), raw_mac(BODY).hex(), id="hex"),
    pytest.param(HmacScheme(header="X-Signature"), raw_mac(BODY).hex().upper(), id="hex-upper"),
    pytest.param(
        HmacScheme(header="X-Signature", encoding="base64"), base64.b64encode(raw_mac(BODY)).decode(), id="base64"
    ),
    pytest.param(
        HmacScheme(header="X-Signature", prefix="sha256="), "sha256=" + raw_mac(BODY).hex(), id="github-prefix"
    ),
]


@pytest.mark.parametrize(("scheme", "value"), PLAIN)
async def test_a_plain_signature_that_matches_passes(scheme: HmacScheme, value: str) -> None:
    app = Recorder()
    mw = SignatureMiddleware(app, paths=[PATH], scheme=scheme, secrets=[SECRET])
    result = await drive(mw, signed(value, name="X-Signature"), [BODY[:10], BODY[10:]])
    assert result.status == 200
    assert app.bodies == [BODY]


@pytest.mark.parametrize(("scheme", "value"), PLAIN)
async def test_a_plain_signature_over_a_tampered_body_is_refused_with_401(scheme: HmacScheme, value: str) -> None:
    app = Recorder()
    mw = SignatureMiddleware(app, paths=[PATH], scheme=scheme, secrets=[SECRET])
    result = await drive(mw, signed(value, name="X-Signature"), [BODY + b" "])
    assert_problem(result, SIGNATURE_INVALID)
    assert app.calls == 0


@pytest.mark.parametrize(
    ("scheme", "value"),
    [
        pytest.param(HmacScheme(header="X-Signature"), "zz" * 32, id="hex-not-hex"),
        pytest.param(HmacScheme(header="X-Signature"), raw_mac(BODY).hex()[:40], id="hex-short"),
        pytest.param(HmacScheme(header="X-Signature", encoding="base64"), "not base64!", id="base64-invalid"),
        pytest.param(
            HmacScheme(header="X-Signature", encoding="base64"), base64.b64encode(b"short").decode(), id="base64-short"
        ),
        pytest.param(HmacScheme(header="X-Signature", prefix="sha256="), raw_mac(BODY).hex(), id="prefix-missing"),
        pytest.param(HmacScheme(header="X-Signature", prefix="sha256="), "sha1=" + "ab" * 20, id="prefix-other"),
    ],
)
async def test_an_unparseable_plain_signature_is_refused_with_400(scheme: HmacScheme, value: str) -> None:
    app = Recorder()
    mw = SignatureMiddleware(app, paths=[PATH], scheme=scheme, secrets=[SECRET])
    result = await drive(mw, signed(value, name="X-Signature"), [BODY])
    assert_problem(result, SIGNATURE_MALFORMED)
    assert app.calls == 0


async def test_a_missing_plain_signature_header_is_refused_with_400() -> None:
    app = Recorder()
    mw = SignatureMiddleware(app, paths=[PATH], scheme=HmacScheme(header="X-Hub-Signature-256"), secrets=[SECRET])
    result = await drive(mw, http_scope("POST", PATH), [BODY])
    assert_problem(result, SIGNATURE_MALFORMED)
    assert app.calls == 0


class IdAndBodyScheme:
    """A provider that signs `<Webhook-Id>.<body>`: the scheme, not the middleware, decides what is signed."""

    def verify(self, headers: Sequence[tuple[bytes, bytes]], body: bytes, secrets: Sequence[bytes]) -> None:
        h = dict(headers)
        event, sig = h.get(b"webhook-id"), h.get(b"webhook-signature")
        if event is None or sig is None:
            raise SignatureMalformed("Webhook-Id and Webhook-Signature are required.")
        wanted = [hmac.new(s, event + b"." + body, hashlib.sha256).hexdigest().encode() for s in secrets]
        if not any(hmac.compare_digest(sig, w) for w in wanted):
            raise SignatureInvalid("The signature does not match.")


async def test_a_custom_scheme_decides_what_is_signed() -> None:
    app = Recorder()
    mw = SignatureMiddleware(app, paths=[PATH], scheme=IdAndBodyScheme(), secrets=[SECRET])
    good = hmac.new(SECRET.encode(), b"evt_1." + BODY, hashlib.sha256).hexdigest()

    def scope(event: str) -> dict[str, Any]:
        return http_scope("POST", PATH, headers=[("Webhook-Id", event), ("Webhook-Signature", good)])

    assert (await drive(mw, scope("evt_1"), [BODY])).status == 200
    assert (await drive(mw, scope("evt_2"), [BODY])).status == 401  # the id is signed: it cannot be swapped
    assert (await drive(mw, http_scope("POST", PATH), [BODY])).status == 400
    assert app.bodies == [BODY]


# ---------------------------------------------------------------------------------------------
# secrets and configuration


async def test_secrets_from_the_environment_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEBHOOK_SECRETS", f" {OLD_SECRET} , {SECRET},")
    app = Recorder()
    mw = SignatureMiddleware(app, paths=[PATH], scheme=StripeScheme(), secrets_env="WEBHOOK_SECRETS")
    statuses = [
        (await drive(mw, signed(sign_stripe(BODY, secret=s)), [BODY])).status
        for s in (OLD_SECRET, SECRET, "whsec_other")
    ]
    assert statuses == [200, 200, 401]


@pytest.mark.parametrize("value", [None, "", " , "], ids=["unset", "empty", "only-commas"])
def test_no_secret_in_the_environment_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    if value is None:
        monkeypatch.delenv("WEBHOOK_SECRETS", raising=False)
    else:
        monkeypatch.setenv("WEBHOOK_SECRETS", value)
    with pytest.raises(ConfigurationError, match="WEBHOOK_SECRETS"):
        SignatureMiddleware(Recorder(), paths=[PATH], scheme=StripeScheme(), secrets_env="WEBHOOK_SECRETS")


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"secrets": []},
        {"secrets": [SECRET, ""]},
        {"secrets": [SECRET], "secrets_env": "WEBHOOK_SECRETS"},
        {"secrets": [SECRET], "paths": []},
        {"secrets": [SECRET], "paths": ["webhooks"]},
        {"secrets": [SECRET], "methods": []},
        {"secrets": [SECRET], "max_body": 0},
        {"secrets": [SECRET], "scheme": object()},
    ],
    ids=["none", "empty-list", "empty-secret", "both", "no-path", "bad-path", "no-method", "no-body", "no-scheme"],
)
def test_configuration_errors_are_raised_at_construction(kwargs: dict[str, Any]) -> None:
    kwargs = {"paths": [PATH], "scheme": StripeScheme(), **kwargs}
    with pytest.raises(ConfigurationError):
        SignatureMiddleware(Recorder(), **kwargs)


def test_bad_scheme_options_are_configuration_errors() -> None:
    with pytest.raises(ConfigurationError):
        HmacScheme(header="X-Signature", encoding="base32")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        StripeScheme(tolerance=0)


async def test_a_bare_string_secret_is_one_secret_not_one_per_character() -> None:
    app = Recorder()
    mw = stripe_mw(app, secrets=SECRET)
    assert (await drive(mw, signed(sign_stripe(BODY)), [BODY])).status == 200
    assert (await drive(mw, signed(sign_stripe(BODY, secret="w")), [BODY])).status == 401


def test_the_schemes_satisfy_the_protocol_and_repr_hides_the_secrets() -> None:
    assert isinstance(StripeScheme(), Scheme) and isinstance(HmacScheme(header="X-Signature"), Scheme)
    assert SECRET not in repr(stripe_mw(Recorder()))


# ---------------------------------------------------------------------------------------------
# body limit, disconnects, pass-through


async def test_a_declared_content_length_over_the_limit_is_refused_with_413_before_reading() -> None:
    app = Recorder()
    scope = http_scope("POST", PATH, headers=[("Stripe-Signature", sign_stripe(BODY)), ("Content-Length", "2000")])
    result = await drive(stripe_mw(app, max_body=1000), scope, [BODY])
    assert_problem(result, problems.BODY_TOO_LARGE)
    assert app.calls == 0


async def test_a_content_length_of_5000_digits_is_refused_with_413_not_500() -> None:
    """More digits than Python's int() takes (4,300): still a number over the limit, never a ValueError."""
    app = Recorder()
    length = "9" * 5000
    scope = http_scope("POST", PATH, headers=[("Stripe-Signature", sign_stripe(BODY)), ("Content-Length", length)])
    result = await drive(stripe_mw(app, max_body=1000), scope, [BODY])
    assert_problem(result, problems.BODY_TOO_LARGE)
    assert app.calls == 0
    padded = "0" * 4999 + str(len(BODY))  # zeros first: the true length
    scope = http_scope("POST", PATH, headers=[("Stripe-Signature", sign_stripe(BODY)), ("Content-Length", padded)])
    assert (await drive(stripe_mw(app, max_body=1000), scope, [BODY])).status == 200
    assert app.calls == 1


async def test_a_chunked_body_crossing_the_limit_is_refused_with_413() -> None:
    app = Recorder()
    big = b"x" * 600
    result = await drive(stripe_mw(app, max_body=1000), signed(sign_stripe(big + big)), [big, big])
    assert_problem(result, problems.BODY_TOO_LARGE)
    assert app.calls == 0


async def test_a_client_that_leaves_mid_body_gets_nothing_and_the_app_is_not_run() -> None:
    app = Recorder()
    messages: list[Message] = [
        {"type": "http.request", "body": BODY[:5], "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return messages.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    await stripe_mw(app)(signed(sign_stripe(BODY)), receive, send)
    assert sent == [] and app.calls == 0


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/payments"), ("GET", PATH), ("POST", PATH + "/extra"), ("POST", "/webhooks/stripex")],
)
async def test_unprotected_requests_pass_through_untouched(method: str, path: str) -> None:
    app = Recorder()
    mw = stripe_mw(app)

    async def receive() -> Message:
        return {"type": "http.request", "body": b"unsigned", "more_body": False}

    result = Result()

    async def send(message: Message) -> None:
        result.messages.append(message)

    await mw(http_scope(method, path), receive, send)
    assert app.receives == [receive]  # the original callable: nothing buffered, nothing wrapped
    assert app.bodies == [b"unsigned"] and result.status == 200


async def test_non_http_scopes_pass_through_untouched() -> None:
    app = Recorder()

    async def receive() -> Message:
        return {"type": "lifespan.startup"}

    async def send(message: Message) -> None:
        pass

    await stripe_mw(app)({"type": "lifespan"}, receive, send)
    assert app.receives == [receive]


async def test_a_prefix_and_a_segment_pattern_protect_every_path_under_them() -> None:
    app = Recorder()
    mw = SignatureMiddleware(app, paths=["/hooks/*", "/p/{name}/events"], scheme=StripeScheme(), secrets=[SECRET])
    for path in ("/hooks", "/hooks/a", "/hooks/a/b", "/p/acme/events"):
        assert (await drive(mw, http_scope("POST", path), [BODY])).status == 400, path
        assert (await drive(mw, signed(sign_stripe(BODY), path=path), [BODY])).status == 200, path
    assert (await drive(mw, http_scope("POST", "/hooksx"), [BODY])).status == 200


# ---------------------------------------------------------------------------------------------
# composition with IdempotencyMiddleware


async def test_outside_idempotency_a_forgery_never_reaches_the_store_and_never_blocks_the_genuine_delivery() -> None:
    app = Recorder()
    backend = MemoryBackend()
    routes = [RoutePolicy(PATH, methods=["POST"], key=event_id(field="id"), required=True, single_tenant=True)]
    mw = SignatureMiddleware(
        IdempotencyMiddleware(app, backend=backend, routes=routes),
        paths=[PATH],
        scheme=StripeScheme(),
        secrets=[SECRET],
    )
    record = RecordKey.build("idem", None, "evt_1")
    now = int(time.time())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://t") as client:

        async def deliver(header: str, body: bytes = BODY) -> httpx.Response:
            return await client.post(PATH, content=body, headers={"Stripe-Signature": header})

        forged = await deliver(sign_stripe(BODY, secret="whsec_attacker", t=now))
        assert forged.status_code == 401
        assert forged.json()["type"] == SIGNATURE_INVALID.type
        assert app.calls == 0 and await backend.get(record) is None  # the event id was never claimed

        first = await deliver(sign_stripe(BODY, t=now))
        assert first.status_code == 200 and first.json() == {"run": 1}
        assert "idempotent-replayed" not in first.headers

        # The provider redelivers later: new timestamp, new signature, same event id.
        for later in (now + 5, now + 60):
            again = await deliver(sign_stripe(BODY, t=later))
            assert again.status_code == 200
            assert again.content == first.content
            assert again.headers["idempotent-replayed"] == "true"

        # A forgery of an event already done is refused too; it never gets the stored answer.
        tampered = BODY.replace(b"4200", b"1")
        late_forgery = await deliver(sign_stripe(BODY, t=now), tampered)
        assert late_forgery.status_code == 401 and "idempotent-replayed" not in late_forgery.headers
    assert app.calls == 1
    assert app.bodies == [BODY]
