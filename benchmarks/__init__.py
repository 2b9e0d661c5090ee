"""Benchmarks for idem_asgi: overhead vs a bare app, and retry storms (see benchmarks/README.md)."""
