"""A payments service worth copying: idempotent orders, payments, refunds and provider webhooks.

Run it with `python -m examples.payments`, or `python -m examples.payments --selftest` to watch
a lost response, a refund and a redelivered webhook each take effect exactly once.
"""

from .app import create_app, policies
from .provider import ForgetfulProvider, HonestProvider

__all__ = ["ForgetfulProvider", "HonestProvider", "create_app", "policies"]
