"""Tools run by hand or by `dev.py`, not collected as tests: `python -m tools.soak` (the retry
storms with many seeds, time-capped) and `python -m tools.reliability_table` (docs/reliability.md's
reliability table, built from the scorecards of a full run)."""
