"""docs/operations.md's worked example, resolved through the admin page in a real browser (Debian's
headless chromium, driven by playwright), on Redis and Postgres: a worker is SIGKILLed after the
charge, its retry gets 409; an on-call engineer opens the admin app (mounted in a Starlette app,
bearer token), lists the stuck claim, inspects it (its history shows the dead worker's claim and the
refused retry), stores the answer the provider confirmed; every retry then replays it, the payment
ran once, and the page's history shows who resolved it and the replays. Without the token the page
is refused (401). The page logs no console error; screenshots are saved under the test's tmp dir.

Skips with the reason when playwright (the docs extra) or chromium is missing; under CI=true
either fails the run."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from idem_asgi.admin import AdminApp, token_auth
from tests.crash_app import make_store
from tests.support.scorecard import http_post
from tests.support.servers import missing, serving
from tests.support.stores import SHARED
from tests.test_operations_example import CHARGE, KEY_SECRET, TABLE, stuck_payment

pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("IDEM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
TOKEN = "s3cret-on-call-token"


def _browser_or_skip() -> None:
    if importlib.util.find_spec("playwright") is None:
        missing("playwright is not installed (the docs extra): run `python3 dev.py docs`", "docs extra")
    if not Path(CHROMIUM).exists():
        missing("chromium is not installed: `apt-get install chromium` (or set IDEM_CHROMIUM)", "browser")


def _watch(page: Any) -> list[str]:
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    return errors


async def _history_rows(page: Any) -> list[list[str]]:
    rows: list[list[str]] = await page.eval_on_selector_all(
        "#history tbody tr", "rows => rows.map(r => Array.from(r.cells, c => c.textContent))"
    )
    return rows


@pytest.mark.parametrize("kind", SHARED)
async def test_a_sigkilled_workers_key_is_resolved_on_the_admin_page(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _browser_or_skip()
    monkeypatch.setenv("IDEM_ASGI_KEY_SECRET", KEY_SECRET)  # the workers' secret: claims listed by key
    from playwright.async_api import async_playwright, expect

    async with stuck_payment(kind, tmp_path) as stuck:
        store = make_store(stuck.url, namespace=stuck.namespace, table=TABLE, pool=2, history=16)
        admin = AdminApp(store, authorize=token_auth({TOKEN: "on-call"}), namespace=stuck.namespace)
        host = Starlette(routes=[Mount("/idem-admin", app=admin)])
        try:
            async with serving(host) as base, async_playwright() as pw:
                browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
                try:
                    anonymous = await browser.new_page()
                    refused = await anonymous.goto(f"{base}/idem-admin/")
                    assert refused is not None and refused.status == 401

                    context = await browser.new_context(
                        viewport={"width": 1280, "height": 900}, extra_http_headers={"Authorization": f"Bearer {TOKEN}"}
                    )
                    page = await context.new_page()
                    page.set_default_timeout(10_000)
                    errors = _watch(page)
                    opened = await page.goto(f"{base}/idem-admin/")
                    assert opened is not None and opened.status == 200

                    # The stuck claim, listed; its history: the dead worker's claim, the refused retry.
                    await page.fill("#older", "0")
                    await page.click("#list")
                    row = page.locator("#stuck tbody tr", has_text=stuck.key)
                    await row.get_by_role("button", name="Inspect").click()
                    await expect(page.locator("#resolve-box")).to_be_visible()
                    token = (await page.text_content("#r-token")) or ""
                    assert token.isdigit()
                    steps = [r[1] for r in await _history_rows(page)]
                    assert steps[0] == "claimed" and any(s.startswith("conflict") for s in steps), steps
                    await page.screenshot(path=str(tmp_path / f"admin-stuck-{kind}.png"), full_page=True)

                    # The provider, asked by the same key, says it charged: store that answer.
                    await page.fill("#r-status", "201")
                    await page.fill("#r-ctype", "application/json")
                    await page.fill("#r-body", CHARGE.decode())
                    await page.click("#resolve")
                    await expect(page.locator("#key-said")).to_contain_text("Resolved: stored the 201 answer")
                    await expect(page.locator("#resolve-box")).to_be_hidden()

                    for _ in range(3):
                        replay = await http_post(stuck.fresh.port, stuck.key)
                        assert replay.status == 201 and replay.replayed and replay.body == CHARGE, replay.outcome
                    assert (await stuck.ledger.counts([stuck.key]))[stuck.key] == 1

                    # Every step, in order, as the page shows it once the replays are written.
                    for _ in range(50):
                        await page.click("#look")
                        await expect(page.locator("#record")).to_be_visible()
                        rows = await _history_rows(page)
                        if any(r[1] == "replayed x3" for r in rows):
                            break
                        await page.wait_for_timeout(100)
                    steps = [r[1] for r in rows]
                    resolved = next(r for r in rows if r[1] == "resolved")
                    assert resolved[2] == "201" and resolved[4] == "on-call via the admin app", rows
                    assert resolved[3] == token[:8], rows
                    order = [s.split(" ")[0] for s in steps]
                    assert order.index("claimed") < order.index("conflict") < order.index("resolved"), steps
                    assert steps[-1] == "replayed x3", steps
                    assert (await page.text_content("#fields")) is not None
                    assert "completed" in ((await page.text_content("#fields")) or "")
                    await page.screenshot(path=str(tmp_path / f"admin-resolved-{kind}.png"), full_page=True)
                    assert errors == []
                finally:
                    await browser.close()
        finally:
            await store.aclose()
