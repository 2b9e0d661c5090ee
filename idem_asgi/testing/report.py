"""What a storm found: one `Answer` per request, one `KeyReport` per scenario, one `StormReport` in all."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Answer:
    """One request of the storm, as the client saw it (or would have: `lost` answers were dropped)."""

    phase: str
    """Which step of the scenario sent it: `concurrent`, `repeat`, `mismatch`, `retry`, `disconnect`, ..."""
    status: int | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    complete: bool = False
    """The app sent its last body chunk."""
    error: BaseException | None = None
    """What the ASGI call raised, if anything."""
    lost: bool = False
    """The connection was lost: the client got none of the answer (fault `response_lost`)."""
    effect: int | None = None
    """How far the probe moved while this request ran, for requests sent one at a time (else None)."""
    cancelled: bool = False
    timed_out: bool = False
    kind: str = ""
    """`run` (the app's first answer), `failed` (the app's 5xx or exception), `replay`, `problem`
    (an idem_asgi refusal), `middleware-error` (idem_asgi itself raised), or `none` (no answer)."""
    label: str = ""
    """A short description: `201`, `201-replay`, `409 request-in-progress`, `cancelled`, ..."""

    def header(self, name: str) -> bytes | None:
        """The first value of header `name` (case-insensitive), or None."""
        raw = name.lower().encode("latin-1")
        return next((v for k, v in self.headers if k.lower() == raw), None)


@dataclass
class KeyReport:
    """What happened to one idempotency key (one scenario)."""

    key: str
    scenario: str
    description: str
    answers: list[Answer] = field(default_factory=list)
    executions: int = 0
    """Handler executions for this key, as counted by the probe."""
    expected_min: int = 1
    expected_max: int = 1
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the contract held for this key."""
        return not self.problems

    @property
    def expected(self) -> str:
        """The allowed number of executions, as text (`1`, `0 to 2`)."""
        if self.expected_min == self.expected_max:
            return str(self.expected_min)
        return f"{self.expected_min} to {self.expected_max}"

    def answer_summary(self) -> str:
        """`201 x1, 409 request-in-progress x48, 201-replay x1`, in order of first appearance."""
        counts = Counter(a.label for a in self.answers)
        return ", ".join(f"{label} x{n}" for label, n in counts.items()) or "none"

    def headline(self) -> str:
        """`key K: handler ran N times (expected 1); answers: ...`"""
        times = "time" if self.executions == 1 else "times"
        return (
            f"key {self.key}: handler ran {self.executions} {times} (expected {self.expected}); "
            f"answers: {self.answer_summary()}"
        )

    def explain(self) -> str:
        """The headline, what the scenario was, and each problem and note on its own line."""
        lines = [self.headline(), f"    scenario: {self.description}"]
        lines += [f"  - {p}" for p in self.problems]
        lines += [f"    note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class StormReport:
    """The result of `storm()`: one `KeyReport` per scenario, in the order they ran."""

    method: str
    path: str
    keys: list[KeyReport] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    """Likely causes when something failed (no middleware found, switch set, no matching policy)."""
    problems: list[str] = field(default_factory=list)
    """Problems of the setup rather than of one key (a per-process store behind several workers)."""

    @property
    def ok(self) -> bool:
        """True when every key kept the contract and the setup can."""
        return not self.problems and all(k.ok for k in self.keys)

    @property
    def failures(self) -> list[KeyReport]:
        """The keys that broke the contract."""
        return [k for k in self.keys if not k.ok]

    @property
    def executions(self) -> dict[str, int]:
        """Handler executions per key."""
        return {k.key: k.executions for k in self.keys}

    def __getitem__(self, scenario_or_key: str) -> KeyReport:
        for k in self.keys:
            if scenario_or_key in (k.scenario, k.key):
                return k
        raise KeyError(scenario_or_key)

    def explain(self) -> str:
        """A readable multi-line account: failing keys first, with reasons, then the passing ones."""
        failed = self.failures
        head = f"idem_asgi storm on {self.method} {self.path}: "
        head += f"{len(failed)} of {len(self.keys)} keys broke the contract" if failed else "contract held"
        if self.problems:
            head += " in this process, but the setup cannot hold it" if not failed else ""
        lines = [head, *(f"  - {p}" for p in self.problems)]
        lines += [k.explain() for k in failed]
        lines += [f"ok  {k.headline()}" for k in self.keys if k.ok]
        if (failed or self.problems) and self.hints:
            lines += ["hints:"] + [f"  * {h}" for h in self.hints]
        return "\n".join(lines)

    __str__ = explain

    def assert_ok(self) -> None:
        """Raise AssertionError explaining every key that broke the contract."""
        __tracebackhide__ = True
        if not self.ok:
            raise AssertionError(self.explain())
