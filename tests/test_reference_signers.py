"""Schemes checked against the providers' reference signers: `StandardWebhooksScheme` against the
`standardwebhooks` package, `StripeScheme` against the `stripe` package. They sign; we verify,
through `SignatureMiddleware` and `IdempotencyMiddleware` keyed by the delivery id, on every store."""

from __future__ import annotations

import base64
import json
import os
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import stripe
from standardwebhooks import Webhook

from idem_asgi import IdempotencyMiddleware, RoutePolicy, StandardWebhooksScheme, StripeScheme, event_id
from idem_asgi.backends import Backend
from idem_asgi.errors import ConfigurationError
from idem_asgi.http.signatures import SIGNATURE_INVALID, SIGNATURE_MALFORMED, SignatureMiddleware
from tests.support.asgi import drive, http_scope
from tests.support.problems import assert_problem
from tests.test_signatures import Recorder

PATH = "/webhooks/provider"
SECRET = "whsec_" + base64.b64encode(os.urandom(24)).decode()
OLD = "whsec_" + base64.b64encode(os.urandom(24)).decode()
BODY = b'{"type": "invoice.paid", "data": {"id": "in_1", "amount": 4200}}'


def sw_headers(msg_id: str, body: bytes, secret: str = SECRET, at: datetime | None = None) -> list[tuple[str, str]]:
    at = at or datetime.now(tz=UTC)
    signature = Webhook(secret).sign(msg_id, at, body.decode())
    return [("webhook-id", msg_id), ("webhook-timestamp", str(int(at.timestamp()))), ("webhook-signature", signature)]


def stack(app: Any, backend: Backend, namespace: str, scheme: Any, key: Any, secrets: list[str]) -> SignatureMiddleware:
    inner = IdempotencyMiddleware(
        app,
        backend=backend,
        namespace=namespace,
        routes=[RoutePolicy(PATH, methods=["POST"], key=key, single_tenant=True)],
    )
    return SignatureMiddleware(inner, paths=[PATH], scheme=scheme, secrets=secrets)


async def test_standard_webhooks_deliveries_apply_once_on_every_store(backend: Backend, namespace: str) -> None:
    app = Recorder()
    mw = stack(app, backend, namespace, StandardWebhooksScheme(), StandardWebhooksScheme.event_key, [SECRET])
    msg_id = "msg_" + uuid.uuid4().hex
    first = await drive(mw, http_scope("POST", PATH, headers=sw_headers(msg_id, BODY)), [BODY])
    # A redelivery is re-signed with a new timestamp: same id, a replay, never a second effect or a 422.
    later = datetime.now(tz=UTC) + timedelta(seconds=30)
    again = await drive(mw, http_scope("POST", PATH, headers=sw_headers(msg_id, BODY, at=later)), [BODY])
    assert first.status == 200 and again.status == 200 and again.body == first.body
    assert app.calls == 1 and app.bodies == [BODY]
    other = await drive(mw, http_scope("POST", PATH, headers=sw_headers("msg_" + uuid.uuid4().hex, BODY)), [BODY])
    assert other.status == 200 and app.calls == 2


async def test_standard_webhooks_refusals() -> None:
    app = Recorder()
    mw = SignatureMiddleware(app, paths=[PATH], scheme=StandardWebhooksScheme(), secrets=[SECRET])
    tampered = await drive(mw, http_scope("POST", PATH, headers=sw_headers("m1", BODY)), [BODY + b" "])
    assert_problem(tampered, SIGNATURE_INVALID)
    stale = datetime.now(tz=UTC) - timedelta(minutes=6)
    old = await drive(mw, http_scope("POST", PATH, headers=sw_headers("m1", BODY, at=stale)), [BODY])
    assert_problem(old, SIGNATURE_INVALID)
    future = datetime.now(tz=UTC) + timedelta(minutes=6)
    assert_problem(
        await drive(mw, http_scope("POST", PATH, headers=sw_headers("m1", BODY, at=future)), [BODY]), SIGNATURE_INVALID
    )
    other_id = [(k, "m2" if k == "webhook-id" else v) for k, v in sw_headers("m1", BODY)]  # the id is signed
    assert_problem(await drive(mw, http_scope("POST", PATH, headers=other_id), [BODY]), SIGNATURE_INVALID)
    for headers in (
        [h for h in sw_headers("m1", BODY) if h[0] != "webhook-id"],
        [(k, "soon" if k == "webhook-timestamp" else v) for k, v in sw_headers("m1", BODY)],
        [(k, "v1a,abc" if k == "webhook-signature" else v) for k, v in sw_headers("m1", BODY)],  # no v1: malformed
        [(k, "v1,!!!" if k == "webhook-signature" else v) for k, v in sw_headers("m1", BODY)],
    ):
        assert_problem(await drive(mw, http_scope("POST", PATH, headers=headers), [BODY]), SIGNATURE_MALFORMED)
    assert app.calls == 0


async def test_standard_webhooks_rotation_both_ways() -> None:
    app = Recorder()
    mw = SignatureMiddleware(app, paths=[PATH], scheme=StandardWebhooksScheme(), secrets=[SECRET, OLD])
    # our rotation: deliveries signed with the old or the new secret both pass
    for secret in (SECRET, OLD):
        r = await drive(mw, http_scope("POST", PATH, headers=sw_headers("m-" + secret[-6:], BODY, secret)), [BODY])
        assert r.status == 200
    # the provider's rotation: several signatures, one of them ours
    at = datetime.now(tz=UTC)
    unknown = "whsec_" + base64.b64encode(os.urandom(24)).decode()
    both = f"{Webhook(unknown).sign('m3', at, BODY.decode())} {Webhook(SECRET).sign('m3', at, BODY.decode())}"
    headers = [("webhook-id", "m3"), ("webhook-timestamp", str(int(at.timestamp()))), ("webhook-signature", both)]
    assert (await drive(mw, http_scope("POST", PATH, headers=headers), [BODY])).status == 200
    only_unknown = SignatureMiddleware(app, paths=[PATH], scheme=StandardWebhooksScheme(), secrets=[OLD])
    assert_problem(
        await drive(only_unknown, http_scope("POST", PATH, headers=sw_headers("m4", BODY, unknown)), [BODY]),
        SIGNATURE_INVALID,
    )


def test_a_secret_that_is_not_whsec_base64_fails_at_start_up() -> None:
    with pytest.raises(ConfigurationError, match="whsec_"):
        SignatureMiddleware(Recorder(), paths=[PATH], scheme=StandardWebhooksScheme(), secrets=["whsec_not*base64"])


def test_keying_by_the_signed_webhook_id_passes_the_start_up_check() -> None:
    inner = IdempotencyMiddleware(
        Recorder(), routes=[RoutePolicy(PATH, methods=["POST"], key=event_id(header="webhook-id"), single_tenant=True)]
    )
    SignatureMiddleware(inner, paths=[PATH], scheme=StandardWebhooksScheme(), secrets=[SECRET])  # no error


async def test_stripe_scheme_verifies_what_the_stripe_package_signs(backend: Backend, namespace: str) -> None:
    secret = "whsec_" + uuid.uuid4().hex
    app = Recorder()
    mw = stack(app, backend, namespace, StripeScheme(), event_id(field="id"), [secret])
    event = json.dumps({"id": "evt_" + uuid.uuid4().hex, "object": "event", "type": "charge.succeeded"}).encode()

    def delivery(body: bytes, sign_secret: str = secret, timestamp: int | None = None) -> dict[str, Any]:
        header = stripe.WebhookSignature.generate_signature_header(body.decode(), sign_secret, timestamp=timestamp)
        return http_scope("POST", PATH, headers=[("Stripe-Signature", header)])

    first = await drive(mw, delivery(event), [event])
    again = await drive(mw, delivery(event), [event])  # Stripe's redelivery: re-signed, same event id
    assert first.status == 200 and again.body == first.body and app.calls == 1
    assert_problem(await drive(mw, delivery(event, "whsec_other"), [event]), SIGNATURE_INVALID)
    assert_problem(await drive(mw, delivery(event), [event[:-1] + b" }"]), SIGNATURE_INVALID)
    stale = int(datetime.now(tz=UTC).timestamp()) - 301
    assert_problem(await drive(mw, delivery(event, timestamp=stale), [event]), SIGNATURE_INVALID)
    # and the stripe package accepts what it signed, as we do (the same rules)
    header = stripe.WebhookSignature.generate_signature_header(event.decode(), secret)
    assert stripe.WebhookSignature.verify_header(event.decode(), header, secret, tolerance=300)
