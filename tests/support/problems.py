"""`assert_problem`: the one check that an answer is a given RFC 9457 refusal."""

from __future__ import annotations

import json
from typing import Any

import httpx

from idem_asgi.http.problems import DEFAULT_PROBLEM_BASE, ProblemType
from tests.support.asgi import Result


def _header(response: httpx.Response | Result, name: str) -> str | None:
    if isinstance(response, Result):
        value = response.header(name)
        return None if value is None else value.decode("latin-1")
    value = response.headers.get(name)
    return None if value is None else str(value)


def assert_problem(
    response: httpx.Response | Result, problem: ProblemType, *, base: str = DEFAULT_PROBLEM_BASE
) -> dict[str, Any]:
    """Assert an RFC 9457 refusal of the given kind: status, type (under `base`), title, a detail,
    no-store, never a replay, no stack trace; a `Link` to its page unless the base is the default's
    bare identifiers. Returns the problem document."""
    if isinstance(response, Result):
        status, body = response.status, response.body
    else:
        status, body = response.status_code, response.content
    assert status == problem.status, (status, body)
    assert _header(response, "content-type") == "application/problem+json"
    assert _header(response, "cache-control") == "no-store"
    assert _header(response, "idempotent-replayed") is None
    doc = json.loads(body)
    assert isinstance(doc, dict), doc
    assert doc["type"] == problem.url(base), doc
    link = None if base == DEFAULT_PROBLEM_BASE else f'<{doc["type"]}>; rel="describedby"'
    assert _header(response, "link") == link
    assert doc["status"] == problem.status
    assert doc["title"] == problem.title
    assert isinstance(doc["detail"], str) and doc["detail"]
    assert "Traceback" not in body.decode()
    return doc
