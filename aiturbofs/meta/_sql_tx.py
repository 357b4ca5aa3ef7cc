"""What every SQL transaction body shares: the ``Tx`` it receives, the
conversion between ``InodeRow`` and columns, the checks of fields and names,
and the inode-row pieces that more than one group of bodies uses.

A transaction body is a plain function ``body(tx, *args)``: ``SqlMetaStore``
(``_sql``) hands it to the engine, which opens the transaction and wraps its
cursor in a ``Tx``.  The bodies are grouped by concern in ``_sql_namespace``
(entries and moves), ``_sql_inodes`` (attributes, manifests, states, xattrs)
and ``_sql_cluster`` (members and the chunk index).  Statements are written
with ``?`` placeholders; ``Tx`` rewrites them through the engine's ``_sql``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .. import _errors as err
from .._limits import HASH_BYTES, NAME_BYTES_MAX
from ._base import INODE_FIELDS, SETTABLE_FIELDS, STATES, InodeRow

COLS = ", ".join(INODE_FIELDS)
ICOLS = ", ".join("i." + name for name in INODE_FIELDS)
_BYTES_FIELDS = ("target", "manifest")
_JSON_FIELDS = ("backend_keys", "holders")  # lists of strings, stored as JSON text
_ATTRS_FIELD = "persisted_attrs"  # a tuple of ints or None, stored as JSON text or NULL


class Tx:
    """One open transaction: runs statements written with ``?`` placeholders."""

    __slots__ = ("_cursor", "_sql")

    def __init__(self, cursor: Any, sql: Callable[[str], str]):
        self._cursor = cursor
        self._sql = sql

    def all(self, sql: str, *params: Any) -> list[tuple]:
        """Every row the statement returns."""
        self._cursor.execute(self._sql(sql), params)
        return self._cursor.fetchall()

    def one(self, sql: str, *params: Any) -> tuple | None:
        """The first row, or ``None``.  Fetches all rows: a half-read
        statement would keep SQLite's statement open across COMMIT."""
        rows = self.all(sql, *params)
        return rows[0] if rows else None

    def run(self, sql: str, *params: Any) -> int:
        """Execute a statement without result rows; the number of rows changed."""
        self._cursor.execute(self._sql(sql), params)
        return self._cursor.rowcount

    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Execute a statement without result rows once per parameter row;
        the driver batches them (psycopg pipelines, no round trip each)."""
        self._cursor.executemany(self._sql(sql), rows)


def now_ns() -> int:
    """The time the bodies stamp on inodes (mtime, ctime)."""
    return time.time_ns()


# --- rows <-> columns -------------------------------------------------------------


def to_row(values: Sequence[Any]) -> InodeRow:
    """An ``InodeRow`` from columns selected in ``INODE_FIELDS`` order."""
    row = dict(zip(INODE_FIELDS, values))
    for name in _BYTES_FIELDS:
        if row[name] is not None:
            row[name] = bytes(row[name])  # psycopg may hand out memoryview
    for name in _JSON_FIELDS:
        row[name] = json.loads(row[name])
    if row[_ATTRS_FIELD] is not None:
        row[_ATTRS_FIELD] = tuple(json.loads(row[_ATTRS_FIELD]))
    return InodeRow(**row)


def to_column(name: str, value: Any) -> Any:
    """The database value of field ``name``."""
    if name in _JSON_FIELDS or (name == _ATTRS_FIELD and value is not None):
        return json.dumps(list(value))
    if name in _BYTES_FIELDS and value is not None:
        return bytes(value)
    return value


def assignments(fields: dict[str, Any]) -> tuple[str, list[Any]]:
    """``"a = ?, b = ?"`` and the column values, for an UPDATE of ``fields``."""
    sets = ", ".join(f"{name} = ?" for name in fields)
    return sets, [to_column(name, value) for name, value in fields.items()]


def check_fields(fields: dict[str, Any], allowed: Iterable[str] = SETTABLE_FIELDS) -> None:
    """Reject field names and values only a bug can produce.

    Field names are also interpolated into SQL, so this check is what keeps
    that safe.
    """
    unknown = set(fields) - set(allowed)
    if unknown:
        raise ValueError(f"not settable inode fields: {sorted(unknown)}")
    if "state" in fields and fields["state"] is not None and fields["state"] not in STATES:
        raise ValueError(f"unknown state {fields['state']!r}")
    manifest = fields.get("manifest")
    if manifest is not None and len(manifest) % HASH_BYTES:
        raise ValueError(f"manifest of {len(manifest)} bytes is not whole hashes")
    if fields.get("size", 0) < 0:
        raise ValueError("negative size")
    for name in _JSON_FIELDS:
        if isinstance(fields.get(name), (str, bytes)):  # list() would split it up
            raise ValueError(f"{name} must be a list of strings, not {fields[name]!r}")
    attrs = fields.get(_ATTRS_FIELD)
    if attrs is not None and (len(attrs) != 4 or not all(isinstance(v, int) for v in attrs)):
        raise ValueError(f"{_ATTRS_FIELD} must be four integers, not {attrs!r}")


def check_name(name: bytes) -> None:
    """Raise ``InvalidArgument`` / ``NameTooLong`` unless ``name`` can be an entry."""
    if not name or name in (b".", b"..") or b"/" in name or b"\0" in name:
        raise err.InvalidArgument(f"invalid name {name!r}")
    if len(name) > NAME_BYTES_MAX:
        raise err.NameTooLong(f"name of {len(name)} bytes")


# --- inode rows: the pieces several groups of bodies share --------------------------


def find_inode(tx: Tx, ino: int) -> InodeRow | None:
    found = tx.one(f"SELECT {COLS} FROM inodes WHERE ino = ?", ino)
    return None if found is None else to_row(found)


def get_inode(tx: Tx, ino: int) -> InodeRow:
    row = find_inode(tx, ino)
    if row is None:
        raise err.NotFound(f"inode {ino}")
    return row


def insert_inode(tx: Tx, row: InodeRow, *, with_ino: bool = False) -> InodeRow:
    names = INODE_FIELDS if with_ino else INODE_FIELDS[1:]
    values = [to_column(name, getattr(row, name)) for name in names]
    marks = ", ".join("?" * len(names))
    found = tx.one(
        f"INSERT INTO inodes ({', '.join(names)}) VALUES ({marks}) RETURNING {COLS}",
        *values,
    )
    assert found is not None  # INSERT ... RETURNING yields the inserted row
    return to_row(found)


def drop_inode(tx: Tx, ino: int) -> None:
    tx.run("DELETE FROM moves WHERE ino = ?", ino)
    tx.run("DELETE FROM xattrs WHERE ino = ?", ino)
    tx.run("DELETE FROM inodes WHERE ino = ?", ino)
