"""One function per scenario (the storm, and each fault), and the judging they share."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any, Final

from ..http.middleware import IdempotencyMiddleware
from .driver import Storm, changed, plural, summary, unexpected
from .report import Answer, KeyReport, StormReport

FAULTS: Final = (
    "disconnect_mid_body",
    "cancel_first",
    "store_fails_after_claim",
    "response_lost",
    "retry_during_write",
    "app_fails_before_effect",
)
"""Every fault `storm()` can inject (all of them by default)."""

DISABLE_ENV: Final = "IDEM_ASGI_DISABLED"


def configure(run: Storm, report: StormReport, targets: Sequence[IdempotencyMiddleware]) -> None:
    """Take the replay-comparison rules from the middleware serving the path, and collect hints."""
    if os.environ.get(DISABLE_ENV):
        report.hints.append(f"{DISABLE_ENV} is set in this process: idempotency is off in every middleware built now")
    if not targets:
        report.hints.append(
            "no IdempotencyMiddleware was found in the app: is it installed? (or pass middleware=... / backend=...)"
        )
        return
    request = run.request
    routes = [r for mw in targets if (r := mw.route_for(request.method, request.path)) is not None]
    if routes:
        run.excluded = routes[0].excluded
        run.release = routes[0].release_statuses
    elif all(not mw.routes for mw in targets):
        report.hints.append("the IdempotencyMiddleware was built while idempotency was disabled (IDEM_ASGI_DISABLED)")
    else:
        report.hints.append(f"no RoutePolicy of the IdempotencyMiddleware matches {request.method} {request.path}")


def per_process(report: StormReport, targets: Sequence[IdempotencyMiddleware], workers: int) -> None:
    """A store each process keeps for itself cannot hold the contract across several workers."""
    from ..backends.memory import MemoryBackend

    local = [mw for mw in targets if isinstance(mw.backend, MemoryBackend)]
    if not local:
        return
    if workers > 1:
        report.problems.append(
            f"the store is a MemoryBackend, which each process keeps for itself: at {workers} workers a retry "
            "that reaches another worker runs again. Use RedisBackend or PostgresBackend"
        )
    else:
        report.hints.append("the store is a MemoryBackend: fine for one process, wrong as soon as there are two")


def _executions(kr: KeyReport, before: int, after: int) -> None:
    kr.executions = after - before
    if kr.executions > kr.expected_max:
        kr.problems.insert(
            0,
            f"the handler ran {plural(kr.executions, 'time')} for one key; the contract allows {kr.expected}",
        )
        effectful = [a for a in kr.answers if a.kind == "failed" and a.effect]
        if effectful:
            kr.problems.insert(
                1,
                f"{plural(len(effectful), 'request')} had the effect (the probe moved) and then failed "
                f"({summary(effectful)}): the claim was released and a retry ran it again. Call "
                "request.state.idempotency.mark_effect() right after the effect, so a later failure keeps the "
                "claim (outcome-unknown) instead",
            )
    elif kr.executions < kr.expected_min:
        kr.problems.insert(
            0,
            f"the handler ran {plural(kr.executions, 'time')} but the app answered "
            f"{plural(kr.expected_min, 'request')} with success: does the probe count this endpoint's executions "
            "(read live, not a copy)?",
        )


def _judge(run: Storm, kr: KeyReport) -> Answer | None:
    """Checks every scenario shares; sets the allowed executions; returns the first answer."""
    for a in kr.answers:
        if a.kind == "middleware-error":
            kr.problems.append(f"idem_asgi itself raised {a.error!r} on a {a.phase} request (a 500 of its own)")
    runs = [a for a in kr.answers if a.kind == "run"]
    failed = [a for a in kr.answers if a.kind == "failed"]
    if len(runs) > 1:
        kr.problems.append(
            f"{len(runs)} requests got a first answer from the app ({summary(runs)}): expected one; every "
            f"other one must be a replay marked {run.replay_header_name}: true, or a 409"
        )
    first = runs[0] if runs else None
    # A failure before any effect is released, and its retry may run again; one after the effect
    # (the probe moved during it) is the effect itself, which must never happen twice.
    effectful = [a for a in failed if a.effect]
    before_effect = [a for a in failed if not a.effect]  # effect 0, or unknown (concurrent requests)
    if failed:
        kr.notes.append(
            f"the app itself failed {plural(len(failed), 'time')} ({summary(failed)}): its own error; a failure "
            "before any effect is released and a retry may run again"
        )
    kr.expected_min = 1 if first is not None and first.status is not None and 200 <= first.status < 300 else 0
    hung = [a for a in kr.answers if a.timed_out]  # may have run before it was cut off
    if hung:
        phases = ", ".join(sorted({a.phase for a in hung}))
        kr.problems.append(f"{plural(len(hung), 'request')} ({phases}) got no answer within {run.timeout:g}s: hung")
    kr.expected_max = (1 if first is not None or effectful else 0) + len(before_effect) + len(hung)
    replays = [a for a in kr.answers if a.kind == "replay"]
    base = first or (replays[0] if replays else None)
    diffs = [(a, d) for a in replays if base is not None and (d := run.difference(base, a)) is not None]
    for a, d in diffs[:3]:
        what = "the first answer" if first is not None else "the first replay"
        kr.problems.append(f"a {a.phase} replay is not byte-identical to {what}: {d}")
    if len(diffs) > 3:
        kr.problems.append(f"... and {len(diffs) - 3} more replays differ")
    if first is not None and first.status is not None and not 200 <= first.status < 300:
        kr.notes.append(f"the first answer was {first.label}, not 2xx: check the request the storm sends")
    return first


def _stored(a: Answer) -> bool:
    return a.kind == "replay" or a.label.startswith("409 response-not-stored")


def _in_progress(a: Answer) -> bool:
    return a.label.startswith(("409 request-in-progress", "409 outcome-unknown"))


async def _sequential(run: Storm, kr: KeyReport, phase: str, n: int, **kwargs: Any) -> None:
    """`n` requests one after another, each with the probe's movement during it (`Answer.effect`)."""
    for _ in range(n):
        before = await run.count(kr.key)
        answer = await run.drive(kr.key, Answer(phase), **kwargs)
        answer.effect = await run.count(kr.key) - before
        kr.answers.append(answer)


async def storm_key(run: Storm, key: str, concurrency: int, repeats: int, mismatch: bool) -> KeyReport:
    what = f"{concurrency} concurrent identical requests, then {plural(repeats, 'repeat')}"
    kr = KeyReport(key, "storm", what + (", then the same key with a changed body" if mismatch else ""))
    before = await run.count(key)
    kr.answers += await asyncio.gather(*(run.drive(key, Answer("concurrent")) for _ in range(concurrency)))
    await _sequential(run, kr, "repeat", repeats)
    first = next((a for a in kr.answers if a.kind == "run"), None)
    if mismatch and first is not None:
        await _sequential(run, kr, "mismatch", 1, body=changed(run.request.body))
    elif mismatch:
        kr.notes.append("no answer was stored for this key, so the changed-body request was not sent")
    first = _judge(run, kr)
    _executions(kr, before, await run.count(key))
    unexpected(
        kr,
        "concurrent",
        lambda a: a.kind in ("run", "failed", "replay") or _in_progress(a),
        "the app's answer, replays, or 409 request-in-progress",
    )
    if first is not None:
        unexpected(kr, "repeat", _stored, "replays of the first answer")
    unexpected(
        kr,
        "mismatch",
        lambda a: a.label in ("422 fingerprint-mismatch", "409 fingerprint-mismatch"),
        "422 fingerprint-mismatch (409 with mismatch_status=409)",
    )
    return kr


async def _disconnect(run: Storm, key: str, repeats: int) -> KeyReport:
    kr = KeyReport(
        key,
        "disconnect_mid_body",
        "the client leaves with half its body sent, then retries with the whole body, then "
        f"{plural(repeats, 'repeat')}",
    )
    before = await run.count(key)
    await _sequential(run, kr, "disconnect", 1, disconnect_mid_body=True)
    early = await run.count(key) - before
    await _sequential(run, kr, "retry", 1)
    await _sequential(run, kr, "repeat", repeats)
    _judge(run, kr)
    # A request whose body never arrived earns no extra execution, even one that failed.
    kr.expected_max -= sum(a.kind == "failed" for a in kr.answers if a.phase == "disconnect")
    kr.expected_max = max(kr.expected_max, kr.expected_min)
    _executions(kr, before, await run.count(key))
    if early or kr.answers[0].kind == "run":
        kr.problems.append(
            f"the handler ran {plural(early, 'time')} for the request whose client left mid-body "
            f"({kr.answers[0].label}): nothing may run before the whole body has arrived"
        )
    retry = kr.answers[1]
    if retry.kind == "replay":
        kr.problems.append("the retry got a replay, but the first request never sent its whole body")
    elif retry.kind not in ("run", "failed", "middleware-error"):
        kr.problems.append(f"the retry got {retry.label}: a client that left mid-body must leave nothing claimed")
    if retry.kind == "run":
        unexpected(kr, "repeat", _stored, "replays of the retry's answer")
    return kr


async def _cancel_first(run: Storm, key: str, repeats: int) -> KeyReport:
    kr = KeyReport(
        key, "cancel_first", f"the first request's task is cancelled mid-flight, then {plural(repeats, 'retry')}"
    )
    loop = asyncio.get_running_loop()
    before = await run.count(key)
    stalled = asyncio.Event()
    first = Answer("cancelled")
    task = asyncio.ensure_future(run.drive(key, first, hang_at_send=stalled))
    deadline = loop.time() + run.timeout
    for spin in itertools.count():
        # Cancel as soon as the handler has counted, or has started answering (the client stalls there).
        if task.done() or stalled.is_set() or loop.time() > deadline or await run.count(key) > before:
            break
        await asyncio.sleep(0 if spin < 1000 else 0.001)
    if task.done():
        kr.notes.append("the first request finished before it could be cancelled")
    task.cancel()
    await asyncio.wait({task})
    kr.answers.append(run.classify(first))
    at_cancel = await run.count(key) - before
    await _sequential(run, kr, "retry", repeats)
    _judge(run, kr)
    if first.kind == "none":
        kr.expected_min = kr.expected_max = at_cancel  # retries must add nothing
    _executions(kr, before, await run.count(key))
    if first.kind == "failed":
        kr.notes.append("the app had already failed when it was cancelled: the claim may be released")
    elif first.cancelled:
        unexpected(
            kr,
            "retry",
            _in_progress,
            "409 request-in-progress or outcome-unknown: a cancelled request "
            "may have had its effect, so it keeps its claim and is never run again",
        )
    else:
        unexpected(kr, "retry", _stored, "replays of the first answer")
    return kr


async def _store_fails(run: Storm, key: str, repeats: int) -> KeyReport:
    kr = KeyReport(
        key,
        "store_fails_after_claim",
        f"the store fails between the claim and storing the answer, then {plural(repeats, 'retry')}",
    )
    if not run.injectable:
        kr.problems.append(
            "could not inject the store failure: no IdempotencyMiddleware found in the app (pass "
            "middleware=... or backend=..., or leave store_fails_after_claim out of faults=)"
        )
    run.armed.add(key)
    before = await run.count(key)
    await _sequential(run, kr, "first", 1)
    await _sequential(run, kr, "retry", repeats)
    _judge(run, kr)
    _executions(kr, before, await run.count(key))
    first = kr.answers[0]
    if first.kind == "run" and run.injectable and key not in run.fired:
        kr.problems.append(
            "the injected store failure never fired: the answer was stored through another store "
            "(pass the middleware= or backend= serving this path)"
        )
    elif first.kind == "problem":
        kr.problems.append(
            f"the first request got {first.label}: the app's answer must reach the client even when storing it fails"
        )
    elif first.kind == "failed":
        kr.notes.append("the app failed, so storing was never attempted: this fault was not exercised")
    if first.kind == "run" and run.injectable:
        unexpected(
            kr,
            "retry",
            lambda a: _in_progress(a) or a.kind == "replay",
            "409 request-in-progress or outcome-unknown (the effect happened but its answer was not "
            "stored, so the claim is kept and never run again), or a replay once a later attempt stored it",
        )
    return kr


async def _response_lost(run: Storm, key: str, repeats: int) -> KeyReport:
    kr = KeyReport(
        key,
        "response_lost",
        f"the connection is lost after the app ran (the client gets nothing), then {plural(repeats, 'retry')}",
    )
    before = await run.count(key)
    await _sequential(run, kr, "lost", 1, lost=True)
    await _sequential(run, kr, "retry", repeats)
    _judge(run, kr)
    lost = kr.answers[0]
    if lost.effect:  # it ran: that was the one execution, and every retry must replay its answer
        kr.expected_min = 1
        kr.expected_max = 1 + sum(a.kind == "failed" and not a.effect for a in kr.answers[1:])
    _executions(kr, before, await run.count(key))
    if lost.effect:
        unexpected(
            kr,
            "retry",
            lambda a: _stored(a) or a.label.startswith("409 outcome-unknown"),
            "replays of the lost answer (the app ran; its client hanging up must not free the key), or "
            "409 outcome-unknown when the app failed after its effect",
        )
    return kr


async def _retry_during_write(run: Storm, key: str, repeats: int) -> KeyReport:
    n = max(repeats, 1)
    kr = KeyReport(
        key,
        "retry_during_write",
        f"{plural(n, 'retry')} land while the first answer is being written, then {plural(repeats, 'repeat')}",
    )
    retries: list[asyncio.Future[Answer]] = []

    def fire() -> None:
        if not retries:
            retries.extend(asyncio.ensure_future(run.drive(key, Answer("during-write"))) for _ in range(n))

    before = await run.count(key)
    if run.injectable:
        run.writing[key] = fire  # when the store write begins
        first = await run.drive(key, Answer("first"))
    else:
        first = await run.drive(key, Answer("first"), on_last_chunk=fire)  # as the last byte arrives
    run.writing.pop(key, None)
    first.effect = None
    kr.answers.append(first)
    if retries:
        kr.answers += await asyncio.gather(*retries)
    else:
        kr.notes.append("the first request never got to writing its answer, so no retry landed during the write")
    await _sequential(run, kr, "repeat", repeats)
    _judge(run, kr)
    _executions(kr, before, await run.count(key))
    unexpected(
        kr,
        "during-write",
        lambda a: _in_progress(a) or a.kind == "replay",
        "409 request-in-progress or a replay: the key stays held until its answer is stored",
    )
    if first.kind == "run":
        unexpected(kr, "repeat", _stored, "replays of the first answer")
    return kr


async def _app_fails(run: Storm, key: str, repeats: int) -> KeyReport:
    kr = KeyReport(
        key,
        "app_fails_before_effect",
        f"the handler fails once before any effect (injected), then {plural(max(repeats, 1), 'retry')}",
    )
    if not run.injectable:
        kr.problems.append(
            "could not inject the handler failure: no IdempotencyMiddleware found in the app (pass "
            "middleware=..., or leave app_fails_before_effect out of faults=)"
        )
    run.failing.add(key)
    before = await run.count(key)
    await _sequential(run, kr, "failing", 1)
    run.failing.discard(key)
    await _sequential(run, kr, "retry", max(repeats, 1))
    _judge(run, kr)
    _executions(kr, before, await run.count(key))
    failing, retry = kr.answers[0], kr.answers[1]
    if run.injectable and failing.kind == "failed" and retry.kind not in ("run", "failed", "middleware-error"):
        kr.problems.append(
            f"the retry after a failure before any effect got {retry.label}: the key must be released so the "
            "retry runs (a layer that keeps it answers 409 for as long as the record lives)"
        )
    if retry.kind == "run":
        unexpected(kr, "retry", lambda a: a is retry or _stored(a), "the retry's answer, then replays of it")
    return kr


SCENARIOS: Final[dict[str, Callable[[Storm, str, int], Any]]] = {
    "disconnect_mid_body": _disconnect,
    "cancel_first": _cancel_first,
    "store_fails_after_claim": _store_fails,
    "response_lost": _response_lost,
    "retry_during_write": _retry_during_write,
    "app_fails_before_effect": _app_fails,
}
"""Each fault's scenario, in the order of `FAULTS`."""
