"""The PostgreSQL store (`PostgresBackend`); its parts (SQL, pools, pooler probe, effects) are private modules here."""

from ...records import StaleRecord
from ._store import PostgresBackend

__all__ = ["PostgresBackend", "StaleRecord"]
