"""The SQL of cluster mode: the members (``nodes``) and the index of chunks
already in the backend (``chunk_sources``).

The statements ``SqlMetaStore`` runs on ``nodes`` are one each, run through
``statement`` and ``query``; the chunk index has bodies of its own.  Each
body is a function ``body(tx, *args)`` (see ``_sql_tx``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._limits import HASH_BYTES, META_KEYS_PER_STATEMENT_MAX
from ._base import ChunkSource
from ._sql_tx import Tx

HOLE = bytes(HASH_BYTES)  # aiturbofs.chunk.HOLE (meta does not import chunk)
NODE_COLS = "name, address, state, heartbeat_ns, info"


def _upsert(table: str, key: str, columns: Sequence[str]) -> str:
    """INSERT of ``key`` and ``columns`` that overwrites them where ``key`` exists."""
    names = (key, *columns)
    sets = ", ".join(f"{name} = excluded.{name}" for name in columns)
    return (
        f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
        f" ON CONFLICT ({key}) DO UPDATE SET {sets}"
    )


UPSERT_NODE = _upsert("nodes", "name", ("address", "state", "heartbeat_ns", "info"))
_UPSERT_CHUNK_SOURCE = _upsert(
    "chunk_sources", "chunk_key", ("backend_key", "offset_bytes", "length_bytes", "etag")
)


def statement(tx: Tx, sql: str, *params: Any) -> int:
    """A transaction of one statement; the number of rows it changed."""
    return tx.run(sql, *params)


def query(tx: Tx, sql: str, *params: Any) -> list[tuple]:
    """A transaction of one query; every row."""
    return tx.all(sql, *params)


def record_chunk_sources(tx: Tx, rows: list[tuple]) -> None:
    tx.many(_UPSERT_CHUNK_SOURCE, rows)


def chunk_sources(tx: Tx, keys: list[bytes]) -> dict[bytes, ChunkSource]:
    found = {}
    for start in range(0, len(keys), META_KEYS_PER_STATEMENT_MAX):
        batch = keys[start : start + META_KEYS_PER_STATEMENT_MAX]
        rows = tx.all(
            "SELECT chunk_key, backend_key, offset_bytes, length_bytes, etag FROM chunk_sources"
            f" WHERE chunk_key IN ({', '.join('?' * len(batch))})",
            *batch,
        )
        for key, *source in rows:
            found[bytes(key)] = ChunkSource(*source)
    return found
