"""The SQL of an inode's own rows: attributes, manifests, states, xattrs.

Transaction bodies of ``SqlMetaStore``'s set_attrs, commit_manifest, the
compare-and-sets (set_state, set_manifest_if, claim_owner), the scans at
start (inodes_in_states, orphans), delete_inode, stats and the xattr
calls.  Each body is a function ``body(tx, *args)`` (see ``_sql_tx``); the
store checks the fields before it runs one.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from .. import _errors as err
from .._limits import XATTRS_PER_INODE_MAX
from ._base import InodeRow
from ._sql_tx import COLS, Tx, assignments, drop_inode, get_inode, now_ns, to_row

_S_IFMT = 0o170000  # file type bits of st_mode, for stats() in SQL

# --- attributes, manifests, states ------------------------------------------------


def update(tx: Tx, ino: int, fields: dict[str, Any]) -> InodeRow:
    """Set ``fields`` (already checked) on ``ino``; the updated row."""
    if not fields:
        return get_inode(tx, ino)
    sets, values = assignments(fields)
    found = tx.one(f"UPDATE inodes SET {sets} WHERE ino = ? RETURNING {COLS}", *values, ino)
    if found is None:
        raise err.NotFound(f"inode {ino}")
    return to_row(found)


def commit_manifest(tx: Tx, ino: int, fields: dict[str, Any]) -> InodeRow:
    sets, values = assignments(fields)
    found = tx.one(
        f"UPDATE inodes SET {sets}, version = version + 1 WHERE ino = ? RETURNING {COLS}",
        *values,
        ino,
    )
    if found is None:
        raise err.NotFound(f"inode {ino}")
    return to_row(found)


def update_if(tx: Tx, ino: int, fields: dict[str, Any], expect: dict[str, Any]) -> bool:
    """Compare-and-set: ``fields`` on ``ino`` if its columns equal ``expect``
    (``None`` matches NULL); ``False`` if not, ``NotFound`` if no row."""
    sets, values = assignments(fields)
    where = "".join(f" AND {name} {'IS NULL' if v is None else '= ?'}" for name, v in expect.items())
    compared = [v for v in expect.values() if v is not None]
    if tx.run(f"UPDATE inodes SET {sets} WHERE ino = ?{where}", *values, ino, *compared):
        return True
    get_inode(tx, ino)  # NotFound, or a lost compare-and-set
    return False


def inodes_in_states(tx: Tx, states: list[str]) -> list[InodeRow]:
    marks = ", ".join("?" * len(states))
    found = tx.all(f"SELECT {COLS} FROM inodes WHERE state IN ({marks}) ORDER BY ino", *states)
    return [to_row(values) for values in found]


def orphans(tx: Tx) -> list[InodeRow]:
    found = tx.all(f"SELECT {COLS} FROM inodes WHERE nlink = 0 ORDER BY ino")
    return [to_row(values) for values in found]


def delete_inode(tx: Tx, ino: int) -> None:
    if tx.one("SELECT 1 FROM dentries WHERE ino = ? LIMIT 1", ino) is not None:
        raise ValueError(f"inode {ino} still has a directory entry")
    drop_inode(tx, ino)


def stats(tx: Tx) -> tuple[int, int]:
    found = tx.one(
        "SELECT COUNT(*), COALESCE(SUM(CASE WHEN (mode & ?) = ? THEN size ELSE 0 END), 0)"
        " FROM inodes",
        _S_IFMT,
        stat.S_IFREG,
    )
    assert found is not None  # an aggregate without GROUP BY yields one row
    count, total = found
    return int(count), int(total)  # PostgreSQL sums bigint to numeric


# --- xattrs ----------------------------------------------------------------------


def getxattr(tx: Tx, ino: int, name: bytes) -> bytes:
    found = tx.one("SELECT value FROM xattrs WHERE ino = ? AND name = ?", ino, name)
    if found is None:
        get_inode(tx, ino)
        raise err.NoAttribute(os.fsdecode(name))
    return bytes(found[0])


def setxattr(tx: Tx, ino: int, name: bytes, value: bytes, flags: int) -> None:
    _touch_inode(tx, ino)
    present = tx.one("SELECT 1 FROM xattrs WHERE ino = ? AND name = ?", ino, name) is not None
    if present and flags & os.XATTR_CREATE:
        raise err.Exists(os.fsdecode(name))
    if not present and flags & os.XATTR_REPLACE:
        raise err.NoAttribute(os.fsdecode(name))
    if present:
        tx.run("UPDATE xattrs SET value = ? WHERE ino = ? AND name = ?", value, ino, name)
        return
    found = tx.one("SELECT COUNT(*) FROM xattrs WHERE ino = ?", ino)
    assert found is not None  # an aggregate without GROUP BY yields one row
    (count,) = found
    if count >= XATTRS_PER_INODE_MAX:
        raise err.OutOfRange(f"inode {ino} has {count} xattrs")
    tx.run("INSERT INTO xattrs (ino, name, value) VALUES (?, ?, ?)", ino, name, value)


def _touch_inode(tx: Tx, ino: int) -> None:
    """ctime = now (xattrs are inode metadata); ``NotFound`` if missing."""
    if not tx.run("UPDATE inodes SET ctime_ns = ? WHERE ino = ?", now_ns(), ino):
        raise err.NotFound(f"inode {ino}")


def listxattr(tx: Tx, ino: int) -> list[bytes]:
    found = tx.all("SELECT name FROM xattrs WHERE ino = ? ORDER BY name", ino)
    if not found:
        get_inode(tx, ino)
    return [bytes(name) for (name,) in found]


def removexattr(tx: Tx, ino: int, name: bytes) -> None:
    _touch_inode(tx, ino)
    if not tx.run("DELETE FROM xattrs WHERE ino = ? AND name = ?", ino, name):
        raise err.NoAttribute(os.fsdecode(name))
