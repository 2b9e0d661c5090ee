"""Webhook signatures as a provider would send them: `sign_stripe` (a `Stripe-Signature` value)."""

from __future__ import annotations

import hashlib
import hmac
import time

SECRET = "whsec_current"
"""The endpoint secret the signature tests configure."""


def sign_stripe(body: bytes, secret: str = SECRET, t: int | None = None) -> str:
    t = int(time.time()) if t is None else t
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"
