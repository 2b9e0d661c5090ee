"""The admin app's one HTML page: plain HTML, CSS and script (no build step, no CDN), under a
content security policy with a fresh nonce per response. Every value from the store is written
with `textContent`, never parsed as HTML."""

from __future__ import annotations

import html

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>idem-asgi admin</title>
<style nonce="{nonce}">
body {{ font: 15px/1.45 system-ui, sans-serif; margin: 0; color: #1b1f24; background: #f6f7f9; }}
header {{ background: #1f3a5f; color: #fff; padding: 12px 20px; }}
header h1 {{ font-size: 18px; margin: 0; }}
main {{ max-width: 1100px; margin: 0 auto; padding: 16px 20px; }}
section {{ background: #fff; border: 1px solid #d9dde3; border-radius: 6px; padding: 14px 16px; margin: 0 0 16px; }}
h2 {{ font-size: 16px; margin: 0 0 10px; }}
label {{ display: inline-block; margin: 0 12px 8px 0; font-size: 14px; }}
input, select, textarea {{ font: inherit; font-size: 14px; padding: 4px 6px; border: 1px solid #b8bfc9;
  border-radius: 4px; }}
textarea {{ width: 100%; box-sizing: border-box; font-family: ui-monospace, monospace; }}
button {{ font: inherit; font-size: 14px; padding: 5px 12px; border-radius: 4px; border: 1px solid #1f3a5f;
  background: #1f3a5f; color: #fff; cursor: pointer; }}
button.quiet {{ background: #fff; color: #1f3a5f; }}
table {{ border-collapse: collapse; width: 100%; font-size: 14px; }}
th, td {{ text-align: left; padding: 5px 8px; border-bottom: 1px solid #e6e8ec; vertical-align: top; }}
code, .mono {{ font-family: ui-monospace, monospace; font-size: 13px; word-break: break-all; }}
.said {{ margin: 10px 0 0; padding: 8px 10px; border-radius: 4px; background: #eef3f8; }}
.said.bad {{ background: #fbecec; }}
.said.good {{ background: #e9f6ec; }}
dl {{ display: grid; grid-template-columns: max-content 1fr; gap: 4px 14px; margin: 0 0 10px; font-size: 14px; }}
dt {{ color: #4a5360; }}
[hidden] {{ display: none !important; }}
</style>
</head>
<body data-base="{base}">
<header><h1>idem-asgi admin: stuck claims and key histories</h1></header>
<main>
<section>
  <h2>Stuck claims</h2>
  <label>Namespace <input id="ns" value="{namespace}" size="14"></label>
  <label>Lease over for at least
    <input id="older" type="number" min="0" step="1" value="{older_than}" size="5"> s</label>
  <button id="list">List</button>
  <table id="stuck"><thead><tr><th>Key</th><th>Scope</th><th>Token</th><th>Lease ended</th><th>Checkpoint</th>
  <th></th></tr></thead><tbody></tbody></table>
  <p id="stuck-said" class="said" hidden></p>
</section>
<section>
  <h2>One key</h2>
  <label>Key <input id="key" size="30"></label>
  <label>Scope <input id="scope" size="16" placeholder="(unscoped)"></label>
  <button id="look">Inspect</button>
  <div id="record" hidden>
    <dl id="fields"></dl>
    <h2>History</h2>
    <table id="history"><thead><tr><th>At (UTC)</th><th>Step</th><th>Status</th><th>Token</th><th>By</th>
    <th>Note</th></tr></thead><tbody></tbody></table>
  </div>
  <p id="key-said" class="said" hidden></p>
</section>
<section id="resolve-box" hidden>
  <h2>Resolve this claim</h2>
  <p>Ask the provider first. Then store the answer it confirms, or release the key if nothing happened
  (the next retry runs it). Fenced by token <code id="r-token"></code>: a claim that renewed or changed since is
  left alone.</p>
  <label><input type="radio" name="what" value="answer" checked> Store an answer</label>
  <label><input type="radio" name="what" value="release"> Release (nothing happened)</label>
  <label><input type="radio" name="what" value="result"> Store a job's result (JSON)</label>
  <div id="answer-fields">
    <label>Status <input id="r-status" type="number" min="100" max="599" value="201" size="5"></label>
    <label>Content-Type <input id="r-ctype" value="application/json" size="24"></label>
    <textarea id="r-body" rows="4" placeholder="the answer's body"></textarea>
  </div>
  <textarea id="r-result" rows="3" placeholder='{{"id": "ch_1"}}' hidden></textarea>
  <p><button id="resolve">Resolve</button> <button id="dry" class="quiet">Dry run</button></p>
  <p id="resolve-said" class="said" hidden></p>
</section>
</main>
<script nonce="{nonce}">
"use strict";
const base = document.body.dataset.base;
const $ = (id) => document.getElementById(id);
let current = null;
let byDigest = "";  // a claim listed by its digest: its store keeps no raw key

function say(id, text, kind) {{
  const p = $(id);
  p.textContent = text;
  p.className = "said" + (kind ? " " + kind : "");
  p.hidden = false;
}}

function cell(row, text, mono) {{
  const td = row.insertCell();
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (mono) td.className = "mono";
  return td;
}}

async function api(path, options) {{
  const response = await fetch(base + path, options);
  let doc = null;
  try {{ doc = await response.json(); }} catch (e) {{ doc = {{detail: response.statusText}}; }}
  return [response.status, doc];
}}

async function listStuck() {{
  const query = new URLSearchParams({{namespace: $("ns").value, older_than: $("older").value}});
  const [status, doc] = await api("/api/stuck?" + query);
  const body = $("stuck").tBodies[0];
  body.replaceChildren();
  if (status !== 200) return say("stuck-said", doc.detail || doc.title, "bad");
  for (const c of doc.claims) {{
    const row = body.insertRow();
    const hidden = c.key === "?";
    cell(row, hidden ? "sha256:" + c.digest.slice(0, 16) : c.key, true);
    cell(row, hidden ? "?" : (c.scope || "-"), true); cell(row, c.token, true);
    cell(row, c.lease_until, true); cell(row, c.checkpoint);
    const open = document.createElement("button");
    open.className = "quiet"; open.textContent = "Inspect";
    open.addEventListener("click", () => {{
      byDigest = hidden ? c.digest : "";
      $("key").value = hidden ? "" : c.key;
      $("scope").value = hidden ? "" : c.scope;
      inspect();
    }});
    row.insertCell().append(open);
  }}
  say("stuck-said", doc.claims.length + " stuck claim(s) in " + doc.namespace +
      " whose lease ended over " + doc.older_than + " s ago");
}}

async function inspect() {{
  const query = new URLSearchParams({{namespace: $("ns").value, key: $("key").value, scope: $("scope").value}});
  if (byDigest && !$("key").value) query.set("digest", byDigest);
  const [status, doc] = await api("/api/key?" + query);
  $("resolve-box").hidden = true;
  if (status !== 200) {{ $("record").hidden = true; return say("key-said", doc.detail || doc.title, "bad"); }}
  current = doc;
  const fields = $("fields");
  fields.replaceChildren();
  const show = (name, value) => {{
    const dt = document.createElement("dt"); dt.textContent = name;
    const dd = document.createElement("dd"); dd.textContent = value; dd.className = "mono";
    fields.append(dt, dd);
  }};
  if (doc.found) {{
    const lease = doc.lease_over ? " (lease over: outcome unknown)" : " (running)";
    show("State", doc.state + (doc.state === "in_progress" ? lease : ""));
    show("Token", doc.token);
    show("Lease until", doc.lease_until);
    show("Expires", doc.expires_at);
    if (doc.checkpoint) show("Checkpoint", doc.checkpoint);
    if (doc.response) show("Answer", doc.response.status + ", " + doc.response.body_size + " bytes");
  }} else {{
    show("State", "no record (expired, released, or never claimed)");
  }}
  const body = $("history").tBodies[0];
  body.replaceChildren();
  for (const s of doc.history) {{
    const row = body.insertRow();
    cell(row, s.at, true); cell(row, s.what + (s.n > 1 ? " x" + s.n : "")); cell(row, s.status);
    cell(row, s.token, true); cell(row, s.by, true); cell(row, s.note);
  }}
  $("record").hidden = false;
  say("key-said", doc.history.length + " step(s) in its history");
  if (doc.found && doc.state === "in_progress" && doc.lease_over) {{
    $("r-token").textContent = doc.token;
    $("resolve-box").hidden = false;
    $("resolve-said").hidden = true;
  }}
}}

function chosen() {{ return document.querySelector("input[name=what]:checked").value; }}

function toggle() {{
  $("answer-fields").hidden = chosen() !== "answer";
  $("r-result").hidden = chosen() !== "result";
}}

async function resolve(dryRun) {{
  if (!current) return;
  const ask = {{key: current.key, scope: current.scope, digest: current.digest, namespace: current.namespace,
    token: String(current.token),
    older_than: $("older").value, dry_run: dryRun}};
  const what = chosen();
  if (what === "release") ask.release = true;
  else if (what === "result") {{
    try {{ ask.result = JSON.parse($("r-result").value); }}
    catch (e) {{ return say("resolve-said", "The result is not JSON: " + e.message, "bad"); }}
  }} else {{
    ask.answer = {{status: Number($("r-status").value), headers: [["content-type", $("r-ctype").value]],
      body: $("r-body").value}};
  }}
  const [status, doc] = await api("/api/resolve", {{method: "POST", headers: {{"content-type": "application/json"}},
    body: JSON.stringify(ask)}});
  const text = doc.said || doc.detail || doc.title;
  say("resolve-said", text, doc.resolved ? "good" : (status === 200 ? "" : "bad"));
  if (doc.resolved) {{
    if ($("stuck").tBodies[0].rows.length) await listStuck();
    await inspect();
    say("key-said", "Resolved: " + text, "good");
  }}
}}

$("list").addEventListener("click", listStuck);
$("look").addEventListener("click", () => {{ byDigest = ""; inspect(); }});
$("resolve").addEventListener("click", () => resolve(false));
$("dry").addEventListener("click", () => resolve(true));
for (const radio of document.querySelectorAll("input[name=what]")) radio.addEventListener("change", toggle);
</script>
</body>
</html>
"""


def page(nonce: str, base: str, namespace: str, older_than: float) -> tuple[str, str]:
    """(nonce, the page): its script and style allowed by `nonce`; the API under `base` (the mount path)."""
    return nonce, _PAGE.format(
        nonce=nonce, base=html.escape(base), namespace=html.escape(namespace), older_than=f"{older_than:g}"
    )
