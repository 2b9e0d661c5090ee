"""Helpers every test module may use (test modules import from here, never from each other)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from idem_asgi import problems
from tests.asgi import Result


def assert_problem(response: httpx.Response | Result, problem: problems.ProblemType) -> dict[str, Any]:
    """Assert an RFC 9457 refusal of the given kind: status, type, no-store, no stack trace."""
    if isinstance(response, Result):
        status, body = response.status, response.body
        result = response

        def get(name: str) -> str | None:
            value = result.header(name)
            return None if value is None else value.decode("latin-1")

    else:
        status, body, get = response.status_code, response.content, response.headers.get
    assert status == problem.status, body
    assert get("content-type") == "application/problem+json"
    assert get("cache-control") == "no-store"
    assert get("idempotent-replayed") is None
    doc: dict[str, Any] = json.loads(body)
    assert doc["type"] == problem.type
    assert doc["status"] == problem.status
    assert doc["title"] == problem.title
    assert isinstance(doc["detail"], str) and doc["detail"]
    assert "Traceback" not in body.decode()
    return doc
