"""The documentation site as a reader sees it: built strict from this checkout, served on a local
port and opened in headless Chromium (Debian's `chromium`, driven by playwright; no browser
download). The home page, Get started and every guide render without a console error (a screenshot
of each is saved under the test's tmp dir), the flow picture and the benchmark chart show, the
search box finds `Retry-After` and `scope-required`, every internal link of every page answers 200
(and its anchor exists), the README's links land on pages and anchors of the site, and the API
reference of `IdempotencyMiddleware` shows every parameter of its signature.

Skips with the reason when the docs extra (`python3 dev.py docs` installs it) or chromium is
missing; under CI=true either fails the run."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import partial
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urldefrag, urljoin, urlsplit

import pytest

from idem_asgi import IdempotencyMiddleware
from idem_asgi.http import problem_pages, problems
from tests.support.servers import ROOT, missing

CHROMIUM = os.environ.get("IDEM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
GUIDES = [
    "frameworks/",
    "webhooks/",
    "keys/",
    "client/",
    "jobs/",
    "testing/",
    "production/",
    "operations/",
    "observability/",
    "examples/",
]
PAGES = ["", "get-started/", *GUIDES]
"""Pages opened in the browser: the home page, Get started and every guide (the flow picture's and
the benchmark chart's pages have a test of their own; every page is fetched by the link test)."""


def _require(*modules: str) -> None:
    absent = [name for name in modules if importlib.util.find_spec(name) is None]
    if absent:
        missing(f"the docs extra is not installed ({', '.join(absent)}): run `python3 dev.py docs`", "docs extra")


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log on stderr."""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built strict from this checkout into a tmp dir (as `python3 dev.py docs` does)."""
    _require("mkdocs", "material", "mkdocstrings_handlers")
    out = tmp_path_factory.mktemp("site")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    pages = len(list(out.rglob("index.html")))
    print(f"site built strict in {time.monotonic() - started:.1f} s: {pages} pages")
    return out


@pytest.fixture(scope="module")
def site(built: Path) -> Iterator[str]:
    """The built site served on a free local port (a thread of this process, shut down after)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(built)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(scope="module")
def browser(site: str) -> Iterator[Any]:
    """Debian's headless chromium, driven by playwright (which downloads no browser of its own)."""
    _require("playwright")
    if not Path(CHROMIUM).exists():
        missing("chromium is not installed: `apt-get install chromium` (or set IDEM_CHROMIUM)", "browser")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page whose console errors and uncaught exceptions are collected in `page.errors`."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    tab.set_default_timeout(10_000)
    tab.errors = []
    tab.on("console", lambda m: tab.errors.append(f"console: {m.text}") if m.type == "error" else None)
    tab.on("pageerror", lambda e: tab.errors.append(f"pageerror: {e}"))
    tab.on(  # a fetch cut short by the next page.goto (the favicon, on a slow machine) is no broken link
        "requestfailed",
        lambda r: tab.errors.append(f"request failed: {r.url}") if r.failure != "net::ERR_ABORTED" else None,
    )
    try:
        yield tab
    finally:
        context.close()


def test_home_and_every_guide_render_without_console_errors(site: str, page: Any, tmp_path: Path) -> None:
    shots = tmp_path / "screenshots"
    shots.mkdir()
    for path in PAGES:
        response = page.goto(site + path, wait_until="load")
        assert response is not None and response.status == 200, path
        title = page.locator("article h1").first
        assert title.is_visible() and title.inner_text().strip(), path
        assert page.locator("nav.md-nav--primary").count() > 0, path
        page.screenshot(path=str(shots / f"{path.strip('/') or 'home'}.png"))
    assert page.errors == []
    print(f"screenshots: {shots} ({len(PAGES)} pages)")


def test_the_flow_picture_and_the_benchmark_chart_show(site: str, page: Any, tmp_path: Path) -> None:
    page.goto(site + "how-it-works/", wait_until="networkidle")
    flows = page.locator("div.mermaid")  # Material swaps each source's <pre> for its drawing
    flows.first.wait_for(state="visible", timeout=10_000)
    assert flows.count() == 3  # before the store, what the claim answers, after the app ran
    box = flows.first.bounding_box()
    assert box is not None and box["height"] > 400, box  # the first, top to bottom (in a closed shadow root)
    for n in range(flows.count()):
        flows.nth(n).screenshot(path=str(tmp_path / f"flow-{n + 1}.png"))
    page.goto(site + "benchmarks/", wait_until="networkidle")
    chart = page.locator("article img[src$='benchmarks.png']").first
    assert chart.evaluate("img => img.complete && img.naturalWidth > 0")
    assert page.errors == []


TUTORIAL = "tutorial/" if (ROOT / "docs" / "tutorial" / "index.md").exists() else "get-started/"
"""The tutorial's first page; Get started until docs/tutorial/index.md exists."""
READABLE = ["", TUTORIAL, "api/", "how-it-works/"]
"""Pages checked for readable text at two widths (how-it-works for its flow pictures)."""
WIDTHS = {"desktop": (1280, 900), "phone": (390, 844)}
SMALLEST_PX = 11
OPEN_SHADOWS = """{
  const attach = Element.prototype.attachShadow;
  Element.prototype.attachShadow = function (init) { return attach.call(this, { ...init, mode: "open" }); };
}"""
"""Material draws each mermaid picture in a closed shadow root; opened (in this test only), its text
can be measured like the page's."""
TEXT_SIZES = """() => {
  const found = [];
  const width = window.innerWidth;
  const shown = (el) => {
    const rules = { opacityProperty: true, visibilityProperty: true, contentVisibilityAuto: true };
    if (!el.checkVisibility(rules)) return false;  // closed <details> included
    const r = el.getBoundingClientRect();  // off-canvas drawers (the phone's nav) are not shown
    return r.width > 0 && r.height > 0 && r.right > 0 && r.left < width;
  };
  const walk = (root, where) => {
    const texts = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    for (let node = texts.nextNode(); node; node = texts.nextNode()) {
      const el = node.parentElement;
      if (!node.textContent.trim() || !el || !shown(el)) continue;
      let px = parseFloat(getComputedStyle(el).fontSize);
      const svg = el.closest("svg");
      if (svg) px *= svg.getScreenCTM().a;  // a drawing scaled to fit draws its text smaller
      found.push({ where, px, text: node.textContent.trim().slice(0, 40) });
    }
  };
  for (const root of document.querySelectorAll("header.md-header, nav.md-tabs, .md-sidebar, article")) {
    walk(root, root.tagName.toLowerCase());
  }
  const drawings = [...document.querySelectorAll("div.mermaid")];
  for (const host of drawings) walk(host.shadowRoot, "mermaid");
  return { texts: found, drawings: drawings.length, opened: drawings.every((h) => h.shadowRoot !== null) };
}"""
"""Every text node shown in the header, the tabs, the sidebars and the article (mermaid pictures
included), with the size it is drawn at, in CSS px."""


def test_home_tutorial_and_api_read_at_desktop_and_phone_widths(browser: Any, site: str, tmp_path: Path) -> None:
    """Screenshots at two widths; no console error; no text drawn under 11 px (the pictures' too)."""
    shots = tmp_path / "screenshots"
    shots.mkdir()
    small: list[str] = []
    errors: list[str] = []
    sheets = True
    for name, (width, height) in WIDTHS.items():
        context = browser.new_context(viewport={"width": width, "height": height})
        context.add_init_script(OPEN_SHADOWS)
        tab = context.new_page()
        tab.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
        tab.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
        try:
            for path in READABLE:
                response = tab.goto(site + path, wait_until="networkidle")
                assert response is not None and response.status == 200, path
                if path == "how-it-works/":
                    tab.locator("div.mermaid").first.wait_for(state="visible", timeout=10_000)
                tab.screenshot(path=str(shots / f"{path.strip('/') or 'home'}-{name}.png"), full_page=True)
                seen = tab.evaluate(TEXT_SIZES)
                assert seen["opened"] and len(seen["texts"]) > 50, (path, name)
                if path == "how-it-works/":
                    drawn = [t for t in seen["texts"] if t["where"] == "mermaid"]
                    assert seen["drawings"] == 3 and len(drawn) >= 20, (name, seen["drawings"], len(drawn))
                small += [
                    f"{path or 'home'} ({name}) {t['where']}: {t['px']:.2f} px {t['text']!r}"
                    for t in seen["texts"]
                    if t["px"] < SMALLEST_PX - 0.005
                ]
                sheets = sheets and tab.evaluate(
                    "() => [...document.styleSheets].some((s) => (s.href || '').endsWith('readable.css'))"
                )
        finally:
            context.close()
    assert errors == []
    print(f"screenshots: {shots} ({len(READABLE)} pages x {len(WIDTHS)} widths)")
    assert sheets, "mkdocs.yml loads docs/assets/stylesheets/readable.css (Material's code in tables is 10.88 px)"
    assert small == [], small[:20]


def test_dark_mode_and_code_copy_buttons(site: str, page: Any, tmp_path: Path) -> None:
    page.goto(site + "get-started/", wait_until="networkidle")
    assert page.locator("body").get_attribute("data-md-color-scheme") == "default"
    page.locator("label[title='Dark mode']").first.click()
    assert page.locator("body").get_attribute("data-md-color-scheme") == "slate"
    page.screenshot(path=str(tmp_path / "get-started-dark.png"))
    copy = page.locator("article button[title='Copy to clipboard']")
    assert copy.count() >= 4  # one per code block
    assert page.errors == []


@pytest.mark.parametrize("term", ["Retry-After", "scope-required"])
def test_the_search_box_finds(term: str, site: str, page: Any) -> None:
    page.goto(site, wait_until="networkidle")
    box = page.locator("input.md-search__input")
    box.click()
    box.press_sequentially(term, delay=20)  # typed, as a reader does (the search reacts to keys)
    results = page.locator(".md-search-result__item")
    results.first.wait_for(state="visible", timeout=10_000)
    texts = [t.lower() for t in results.all_inner_texts()]
    assert any(term.lower() in re.sub(r"\s*-\s*", "-", t) for t in texts), texts[:3]
    assert page.errors == []


class _Links(HTMLParser):
    """Every href/src of a page, and every id it defines."""

    def __init__(self) -> None:
        super().__init__()
        self.targets: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            elif name in ("href", "src") and value and tag in ("a", "link", "img", "script"):
                self.targets.append(value)


def _parsed(url: str) -> tuple[int, _Links]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            status, body = answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, _Links()
    links = _Links()
    if url.endswith("/") or url.endswith(".html"):
        links.feed(body.decode("utf-8"))
    return status, links


def test_every_internal_link_of_every_page_answers_200(built: Path, site: str) -> None:
    pages = [site + str(p.relative_to(built).parent).replace(".", "") for p in sorted(built.rglob("index.html"))]
    pages = [p if p.endswith("/") else p + "/" for p in pages]
    seen: dict[str, tuple[int, _Links]] = {}
    broken: list[str] = []
    for url in pages:
        seen[url] = _parsed(url)
    for url in pages:
        for target in seen[url][1].targets:
            absolute = urljoin(url, target)
            if urlsplit(absolute).netloc != urlsplit(site).netloc:
                continue  # the site links nowhere else, but a guide may name an outside page
            address, anchor = urldefrag(absolute)
            if address not in seen:
                seen[address] = _parsed(address)
            status, links = seen[address]
            if status != 200:
                broken.append(f"{url}: {target} answers {status}")
            elif anchor and address.endswith("/") and anchor not in links.ids:
                broken.append(f"{url}: {target}: no element with id {anchor!r}")
    assert broken == []
    assert len(pages) >= 30, pages


def test_the_readmes_links_land_on_the_site(built: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    checked = 0
    for target in re.findall(r"\]\((docs/[^)\s]+)\)", readme):
        path, _, anchor = target.removeprefix("docs/").partition("#")
        if not path.endswith(".md"):  # a picture or another file the site serves as it is
            assert (built / path).is_file(), target
            checked += 1
            continue
        page = built / re.sub(r"(index)?\.md$", "", path) / "index.html"
        assert page.exists(), target
        if anchor:
            assert f'id="{anchor}"' in page.read_text(), target
        checked += 1
    assert checked >= 15


REFERENCE = {"": "api", "backends": "api/backends", "client": "api/client", "jobs": "api/jobs"}
REFERENCE |= {"jobs.consumers": "api/consumers", "testing": "api/testing"}
"""Module (under idem_asgi) -> its reference page."""


@pytest.mark.parametrize("module", sorted(REFERENCE))
def test_the_api_reference_covers_every_public_name(module: str, built: Path) -> None:
    """Everything in `__all__` (or, without one, every public class and function defined there)."""
    name = f"idem_asgi.{module}".rstrip(".")
    mod = importlib.import_module(name)
    public = getattr(mod, "__all__", None) or [
        n
        for n, obj in vars(mod).items()
        if not n.startswith("_") and getattr(obj, "__module__", "") == name and callable(obj)
    ]
    ids = set(re.findall(r'id="([^"]+)"', (built / REFERENCE[module] / "index.html").read_text()))
    absent = [n for n in public if f"{name}.{n}" not in ids and f"{name}.{n}.{n}" not in ids]
    assert absent == [], f"{name}: not in its reference page"


def test_the_payments_examples_excerpts_are_whole_blocks_at_their_line_numbers() -> None:
    """docs/examples.md includes parts of the example's files by line range (the site cannot link
    outside docs/): each range must still be one whole block of code, numbered from its first line,
    so an edit of the example that shifts it fails here instead of showing half a function."""
    page = (ROOT / "docs" / "examples.md").read_text()
    excerpts = re.findall(r'linenums="(\d+)"\n--8<-- "([^":]+):(\d+):(\d+)"', page)
    assert len(excerpts) >= 5
    for numbered, path, first, last in excerpts:
        lines = (ROOT / path).read_text().splitlines()
        start, end = int(first), int(last)
        part = lines[start - 1 : end]
        where = f"{path}:{start}:{end}"
        assert numbered == first, where
        assert part[0].strip() and part[-1].strip(), where  # starts and ends on code
        assert end == len(lines) or not lines[end].strip(), where  # the block ends there
        ast.parse(textwrap.dedent("\n".join(part)))  # whole statements, nothing cut in half
    whole = set(re.findall(r'--8<-- "(examples/payments/[^":]+\.py)"', page))
    assert whole == {str(f.relative_to(ROOT)) for f in (ROOT / "examples" / "payments").glob("*.py")}


def test_each_problem_type_has_its_anchor_and_the_served_pages_text(built: Path) -> None:
    """The site's problem page and the middleware's own problem pages say the same, from one source."""
    page = (built / "problems" / "index.html").read_text()
    flat = " ".join(page.split())
    for p in problems.DOCUMENTED:
        assert f'id="{p.slug}"' in page, p.slug
        section = flat[flat.index(f'id="{p.slug}"') :]
        for text in (p.happened, p.to_do):
            assert " ".join(problem_pages._text(text).split()) in section[:4000], (p.slug, text[:40])


def test_the_api_reference_of_the_middleware_shows_its_parameters(site: str, page: Any, tmp_path: Path) -> None:
    page.goto(site + "api/#idem_asgi.IdempotencyMiddleware", wait_until="networkidle")
    heading = page.locator("[id='idem_asgi.IdempotencyMiddleware']")
    assert heading.is_visible()
    block = page.locator("div.doc-object:has(> [id='idem_asgi.IdempotencyMiddleware'])").first
    text = block.inner_text()
    table = block.locator("table").first  # the Parameters table, from the docstring's Args
    assert "Name" in table.inner_text() or "Parameters" in text
    names = [p for p in inspect.signature(IdempotencyMiddleware).parameters if p != "self"]
    absent = [name for name in names if name not in table.inner_text()]
    assert absent == [], f"parameters missing from the reference: {absent}"
    block.screenshot(path=str(tmp_path / "api-middleware.png"))
    assert page.errors == []
