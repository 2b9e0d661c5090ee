"""`python3 dev.py demo` shows what the README promises: without the middleware, 200 retries charge
201 times; with it, one charge per payment, repeats that are
byte-identical replays marked `Idempotent-Replayed: true` or 409s with `Retry-After`, and both
kinds in the default storm (with `wait=` on the route: replays only)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.servers import ROOT


def storms(out: str) -> list[dict[str, int]]:
    """The counted lines (`name   N ...`) of each storm's block, by name."""
    return [
        {name.strip(): int(n) for name, n in re.findall(r"^([a-z0-9() ]+?)\s{2,}(\d+)", block, re.M)}
        for block in out.split("\n== ")[1:]
    ]


def test_the_demo_shows_replays_and_409s_with_their_headers_and_one_charge_each() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "examples.storm_demo"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    bare, default, waiting, many = storms(out)
    assert bare["charges executed"] == 201, "without the middleware every retry charges again"
    assert (default["charges executed"], waiting["charges executed"], many["charges executed"]) == (1, 1, 50)
    assert out.count("(double charges: 0)") == 3
    assert default["replays (201)"] > 0 and default["409 in progress"] > 0, "the default storm shows both kinds"
    assert default["replays (201)"] + default["409 in progress"] == 199
    assert waiting["replays (201)"] == 199 and waiting["409 in progress"] == 0, "wait= turns 409s into replays"
    assert re.search(r"^a replayed answer\s+201 .*idempotent-replayed: true", out, re.M)
    assert re.search(r"^a 409 answer\s+409 .*retry-after: \d+", out, re.M)
    assert re.search(r"^VERDICT  OK: 52 payments charged exactly once each", out, re.M)
