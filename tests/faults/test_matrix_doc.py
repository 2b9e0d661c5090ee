"""docs/reliability.md shows the fault matrix exactly as tests/support/fault_matrix.py defines it."""

from __future__ import annotations

from tests.support.fault_matrix import PAGE, START, cells, on_page, render


def test_the_reliability_page_shows_the_fault_matrix_the_tests_run() -> None:
    shown = on_page(PAGE.read_text())
    assert shown is not None, f"docs/reliability.md lost its {START} markers"
    assert shown == render(), "docs/reliability.md drifted from the table: python -m tests.support.fault_matrix --write"


def test_every_blocked_cell_is_after_the_claim_and_every_later_one_before_it() -> None:
    """The table's own sense: nothing claimed cannot be blocked; a claim never runs again later."""
    for surface, point, kind, store, outcome in cells():
        cell = (surface, point, kind, store)
        if outcome == "later":
            assert point == "before_claim", cell
        if outcome == "blocked":
            assert point in ("after_claim", "mid_effect", "before_store"), cell
