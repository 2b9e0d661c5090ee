"""The problem pages, served by the middleware itself when `problem_base` is a path of the app.

`IdempotencyMiddleware(problem_base="/problems/")` (and `SignatureMiddleware`'s) answers
`GET`/`HEAD /problems/<slug>` with a small HTML page per problem type (what happened, what a
client should do), so every refusal's `type` and `Link` resolve through the app itself. Read-only
and static: any other method, or a slug it does not know, goes on to the app.
"""

from __future__ import annotations

import html
import re
from typing import Final

from .._types import Scope, Send
from . import problems
from .routing import route_path

_CODE: Final = re.compile(r"`([^`]+)`")
_STYLE: Final = "body{font-family:system-ui,sans-serif;max-width:40em;margin:2em auto;padding:0 1em;line-height:1.5}"


def _text(markdown: str) -> str:
    """A page paragraph from the source text: escaped, its backticks as `<code>`."""
    return _CODE.sub(r"<code>\1</code>", html.escape(markdown, quote=False))


def render(problem: problems.ProblemType) -> bytes:
    """The page of one problem type."""
    title = html.escape(problem.title)
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{_STYLE}</style></head>\n<body><h1>{title}</h1>\n"
        f"<p><code>{problem.slug}</code>, HTTP {problem.status}</p>\n<p>{_text(problem.happened)}</p>\n"
        f"<h2>What to do</h2>\n<p>{_text(problem.to_do[:1].upper() + problem.to_do[1:])}</p>\n</body></html>\n"
    ).encode()


_PAGES: Final = {p.slug: render(p) for p in problems.DOCUMENTED}


async def serve(base: str, scope: Scope, send: Send) -> bool:
    """Answer a GET/HEAD of `<base><slug>` with its page; False (nothing sent) for anything else."""
    if scope["method"] not in ("GET", "HEAD"):
        return False
    path = route_path(scope)
    page = _PAGES.get(path[len(base) :]) if path.startswith(base) else None
    if page is None:
        return False
    headers = [
        (b"content-type", b"text/html; charset=utf-8"),
        (b"content-length", str(len(page)).encode("ascii")),
        (b"cache-control", b"public, max-age=3600"),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else page})
    return True
