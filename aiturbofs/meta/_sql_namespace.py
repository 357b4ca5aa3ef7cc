"""The SQL of the namespace: directory entries and the moves they leave behind.

Transaction bodies of ``SqlMetaStore``'s lookup, lookup_path, readdir, paths_of,
parent_of, create, create_imported, link, unlink, rmdir and rename, and of the ``moves``
table that a name change writes in its own transaction (see the schema in
``_sql``).  Each body is a function ``body(tx, *args)`` (see ``_sql_tx``);
checks come before changes, so every error case is at the top of a body.
"""

from __future__ import annotations

import dataclasses
import os
import stat

from .. import _errors as err
from .._limits import (
    DIR_DEPTH_MAX,
    LINKS_PER_INODE_MAX,
    META_READDIR_ENTRIES_MAX,
    SYMLINK_TARGET_BYTES_MAX,
)
from ._base import ROOT_INO, SETTABLE_FIELDS, STATE_STAGED, STATE_XATTR, InodeRow
from ._sql_tx import (
    COLS,
    ICOLS,
    Tx,
    check_fields,
    check_name,
    drop_inode,
    get_inode,
    insert_inode,
    now_ns,
    to_row,
)

# --- pieces of the bodies below ---------------------------------------------------


def _dir(tx: Tx, ino: int) -> InodeRow:
    """The row of directory ``ino``; ``NotFound`` / ``NotADirectory``."""
    row = get_inode(tx, ino)
    if not stat.S_ISDIR(row.mode):
        raise err.NotADirectory(f"inode {ino}")
    return row


def _entry(tx: Tx, parent: int, name: bytes) -> InodeRow | None:
    found = tx.one(
        f"SELECT {ICOLS} FROM dentries d JOIN inodes i ON i.ino = d.ino"
        " WHERE d.parent = ? AND d.name = ?",
        parent,
        name,
    )
    return None if found is None else to_row(found)


def _has_entries(tx: Tx, parent: int) -> bool:
    return tx.one("SELECT 1 FROM dentries WHERE parent = ? LIMIT 1", parent) is not None


def _add_links(tx: Tx, ino: int, delta: int, now: int) -> InodeRow:
    """nlink += delta and ctime = now (a link came or went)."""
    found = tx.one(
        f"UPDATE inodes SET nlink = nlink + ?, ctime_ns = ? WHERE ino = ? RETURNING {COLS}",
        delta,
        now,
        ino,
    )
    assert found is not None, f"inode {ino} vanished inside its transaction"  # callers hold the inode
    return to_row(found)


def _touch_dir(tx: Tx, ino: int, now: int | None, nlink_delta: int = 0) -> None:
    """A directory's entries changed: mtime/ctime = now (None: they stay); a subdir came or went."""
    if now is None:
        tx.run("UPDATE inodes SET nlink = nlink + ? WHERE ino = ?", nlink_delta, ino)
        return
    tx.run(
        "UPDATE inodes SET mtime_ns = ?, ctime_ns = ?, nlink = nlink + ? WHERE ino = ?",
        now,
        now,
        nlink_delta,
        ino,
    )


def _note_move(tx: Tx, ino: int, *, is_dir: bool = False) -> None:
    """``ino``'s names are about to change: remember it in ``moves`` (a directory with its path now)."""
    dir_path = None
    if is_dir:
        paths = paths_of(tx, ino)
        dir_path = paths[0] if paths else None
    tx.run(
        "INSERT INTO moves (ino, gen, dir_path) VALUES (?, 1, ?) ON CONFLICT (ino) DO UPDATE"
        " SET gen = moves.gen + 1, dir_path = COALESCE(moves.dir_path, excluded.dir_path)",
        ino,
        dir_path,
    )


def _parent_of_dir(tx: Tx, ino: int) -> tuple[int, bytes] | None:
    """``(parent, name)`` of a directory (it has exactly one entry)."""
    found = tx.one("SELECT parent, name FROM dentries WHERE ino = ?", ino)
    return None if found is None else (found[0], bytes(found[1]))


def _check_not_below(tx: Tx, start: int, moved: int) -> None:
    """``InvalidArgument`` if directory ``start`` is ``moved`` or inside it."""
    current = start
    for _ in range(DIR_DEPTH_MAX):
        if current == moved:
            raise err.InvalidArgument("cannot move a directory into itself")
        if current == ROOT_INO:
            return
        up = _parent_of_dir(tx, current)
        if up is None:
            return  # a detached directory cannot contain `moved`
        current = up[0]
    raise AssertionError(f"directory chain above inode {start} is a loop")


# --- reads ---------------------------------------------------------------------------


def lookup(tx: Tx, parent: int, name: bytes) -> InodeRow:
    row = _entry(tx, parent, name)
    if row is None:
        raise err.NotFound(f"{os.fsdecode(name)!r} in inode {parent}")
    return row


def lookup_path(tx: Tx, path: str) -> InodeRow | None:
    """The row at ``path`` (names from the root, ``/``-separated), in one statement: a join of the
    path's entries, each in the directory the one before it names.  At most
    ``META_LOOKUP_PATH_JOINED_MAX`` names: ``SqlMetaStore.lookup_path`` walks a deeper one (``lookup_path_walk``)."""
    names = [os.fsencode(name) for name in path.split("/")]
    last = len(names) - 1
    joins = "".join(f" JOIN dentries d{k} ON d{k}.parent = d{k - 1}.ino AND d{k}.name = ?" for k in range(1, last + 1))
    found = tx.one(
        f"SELECT {ICOLS} FROM dentries d0{joins} JOIN inodes i ON i.ino = d{last}.ino WHERE d0.parent = ? AND d0.name = ?",
        *names[1:],
        ROOT_INO,
        names[0],
    )
    return None if found is None else to_row(found)


def lookup_path_walk(tx: Tx, path: str) -> InodeRow | None:
    """``lookup_path`` a name at a time (one statement per name)."""
    row = None
    parent = ROOT_INO
    for name in path.split("/"):
        row = _entry(tx, parent, os.fsencode(name))
        if row is None:
            return None
        parent = row.ino
    return row


def readdir(tx: Tx, parent: int, offset: int, limit: int, dentries_from: str) -> list:
    """``dentries_from``: the dentries table as the engine names it (its ``READDIR_FROM``)."""
    limit = min(limit, META_READDIR_ENTRIES_MAX)
    if limit <= 0:
        _dir(tx, parent)
        return []
    found = tx.all(
        f"SELECT d.id, d.name, {ICOLS} FROM {dentries_from} JOIN inodes i ON i.ino = d.ino"
        " WHERE d.parent = ? AND d.id > ? ORDER BY d.id LIMIT ?",
        parent,
        offset,
        limit,
    )
    if not found:
        _dir(tx, parent)  # tell "empty" from "no such directory"
    return [(bytes(name), to_row(rest), token) for token, name, *rest in found]


def nodes_with_state(tx: Tx, parent: int, dentries_from: str) -> list[InodeRow]:
    """The entries of ``parent`` that are neither regular files nor directories and have a state, in
    readdir order: filtered here, not row by row in Python (a directory of 2,000 files took 3.3 ms to list)."""
    found = tx.all(
        f"SELECT {ICOLS} FROM {dentries_from} JOIN inodes i ON i.ino = d.ino"
        " WHERE d.parent = ? AND i.state IS NOT NULL AND (i.mode & ?) NOT IN (?, ?) ORDER BY d.id",
        parent,
        0o170000,  # the mask of the file type bits (S_IFMT)
        stat.S_IFREG,
        stat.S_IFDIR,
    )
    if not found:
        _dir(tx, parent)  # NotFound / NotADirectory, as readdir
    return [to_row(rest) for rest in found]


def parent_of(tx: Tx, ino: int) -> int:
    if ino == ROOT_INO:
        return ROOT_INO
    found = _parent_of_dir(tx, ino)
    if found is None:
        raise err.NotFound(f"directory inode {ino} is removed")
    return found[0]


def paths_of(tx: Tx, ino: int) -> list[str]:
    """Every name of ``ino`` from the root, in link order, in one statement: each link and the
    entries of the directories above it (a directory has one), walked up to the root."""
    if ino == ROOT_INO:
        return [""]
    found = tx.all(
        "WITH RECURSIVE up(link, depth, parent, name) AS ("
        " SELECT id, 0, parent, name FROM dentries WHERE ino = ?"
        " UNION ALL SELECT up.link, up.depth + 1, d.parent, d.name FROM up JOIN dentries d ON d.ino = up.parent"
        " WHERE up.depth < ?)"
        " SELECT link, depth, parent, name FROM up ORDER BY link, depth",
        ino,
        DIR_DEPTH_MAX,
    )
    paths = []
    names: list[bytes] = []
    for i, (_, depth, parent, name) in enumerate(found):
        names.append(bytes(name))
        if i + 1 < len(found) and found[i + 1][1] > depth:
            continue  # the directory above has an entry of its own
        if depth >= DIR_DEPTH_MAX:
            raise AssertionError(f"directory chain above inode {ino} is a loop")
        if parent == ROOT_INO:  # else the link hangs below no root
            paths.append("/".join(os.fsdecode(n) for n in reversed(names)))
        names = []
    return paths


# --- changes ---------------------------------------------------------------------------


def create(tx: Tx, parent: int, name: bytes, row: InodeRow, prefix: bytes | None, imported: bool) -> InodeRow:
    check_name(name)
    _check_new_row(row)
    _dir(tx, parent)
    if _entry(tx, parent, name) is not None:
        raise err.Exists(f"{os.fsdecode(name)!r} in inode {parent}")
    is_dir = stat.S_ISDIR(row.mode)
    # Regular files always have a state; other nodes have one when the
    # backend keeps them too (vfs decides), else None (metadata only).
    state = row.state
    if stat.S_ISREG(row.mode) and state is None:
        state = STATE_STAGED
    new = insert_inode(tx, dataclasses.replace(row, nlink=2 if is_dir else 1, state=state))
    tx.run("INSERT INTO dentries (parent, name, ino) VALUES (?, ?, ?)", parent, name, new.ino)
    _touch_dir(tx, parent, None if imported else now_ns(), 1 if is_dir else 0)
    # Tags steer the I/O of files and the files below directories; user.*
    # xattrs on other types are refused by Linux, so none are copied there.
    if prefix is not None and (is_dir or stat.S_ISREG(row.mode)):
        _inherit_xattrs(tx, parent, new.ino, prefix)
    return new


def create_imported(tx: Tx, parent: int, entries: list[tuple[bytes, InodeRow]], prefix: bytes | None) -> list:
    made: list[InodeRow | None] = []
    for name, row in entries:
        try:
            made.append(create(tx, parent, name, row, prefix, True))
        except err.Exists:  # raised before create changes anything
            made.append(None)
    return made


def _check_new_row(row: InodeRow) -> None:
    check_fields({name: getattr(row, name) for name in SETTABLE_FIELDS})
    if stat.S_ISLNK(row.mode):
        if row.target is None:
            raise ValueError("a symlink needs a target")
        if len(row.target) > SYMLINK_TARGET_BYTES_MAX:
            raise err.NameTooLong(f"symlink target of {len(row.target)} bytes")


def _inherit_xattrs(tx: Tx, parent: int, ino: int, prefix: bytes) -> None:
    """Copy the parent's ``prefix`` xattrs but the state to a new child."""
    for name, value in tx.all("SELECT name, value FROM xattrs WHERE ino = ?", parent):
        name = bytes(name)
        if name.startswith(prefix) and name != STATE_XATTR:
            tx.run("INSERT INTO xattrs (ino, name, value) VALUES (?, ?, ?)", ino, name, value)


def link(tx: Tx, ino: int, new_parent: int, new_name: bytes) -> InodeRow:
    check_name(new_name)
    row = get_inode(tx, ino)
    if stat.S_ISDIR(row.mode):
        raise err.NotPermitted("hard link to a directory")
    if row.nlink == 0:
        raise err.NotFound(f"inode {ino} is unlinked")  # like linkat(2) of a deleted file
    if row.nlink >= LINKS_PER_INODE_MAX:
        raise err.TooManyLinks(f"inode {ino} has {row.nlink} links")
    _dir(tx, new_parent)
    if _entry(tx, new_parent, new_name) is not None:
        raise err.Exists(f"{os.fsdecode(new_name)!r} in inode {new_parent}")
    now = now_ns()
    tx.run("INSERT INTO dentries (parent, name, ino) VALUES (?, ?, ?)", new_parent, new_name, ino)
    _touch_dir(tx, new_parent, now)
    _note_move(tx, ino)
    return _add_links(tx, ino, +1, now)


def unlink(tx: Tx, parent: int, name: bytes) -> InodeRow:
    _dir(tx, parent)
    row = lookup(tx, parent, name)
    if stat.S_ISDIR(row.mode):
        raise err.IsADirectory(f"{os.fsdecode(name)!r} is a directory")
    now = now_ns()
    tx.run("DELETE FROM dentries WHERE parent = ? AND name = ?", parent, name)
    _touch_dir(tx, parent, now)
    if row.nlink > 1:  # (the last name's inode is an orphan: found at start anyway)
        _note_move(tx, row.ino)
    return _add_links(tx, row.ino, -1, now)


def rmdir(tx: Tx, parent: int, name: bytes) -> InodeRow:
    _dir(tx, parent)
    row = lookup(tx, parent, name)
    if not stat.S_ISDIR(row.mode):
        raise err.NotADirectory(f"{os.fsdecode(name)!r} is not a directory")
    if _has_entries(tx, row.ino):
        raise err.NotEmpty(f"{os.fsdecode(name)!r}")
    tx.run("DELETE FROM dentries WHERE parent = ? AND name = ?", parent, name)
    drop_inode(tx, row.ino)
    _touch_dir(tx, parent, now_ns(), -1)
    return dataclasses.replace(row, nlink=0)


def rename(
    tx: Tx,
    parent: int,
    name: bytes,
    new_parent: int,
    new_name: bytes,
    noreplace: bool,
    exchange: bool,
) -> InodeRow | None:
    if noreplace and exchange:
        raise err.InvalidArgument("RENAME_NOREPLACE with RENAME_EXCHANGE")
    check_name(new_name)
    _dir(tx, parent)
    _dir(tx, new_parent)
    src = lookup(tx, parent, name)
    if (parent, name) == (new_parent, new_name):
        return None
    dst = _entry(tx, new_parent, new_name)
    if exchange:
        if dst is None:
            raise err.NotFound(f"{os.fsdecode(new_name)!r} in inode {new_parent}")
        _exchange(tx, (parent, name, src), (new_parent, new_name, dst))
        return None
    if dst is not None and noreplace:
        raise err.Exists(f"{os.fsdecode(new_name)!r} in inode {new_parent}")
    if dst is not None and dst.ino == src.ino:
        return None  # POSIX: two links to one file, rename does nothing
    src_is_dir = stat.S_ISDIR(src.mode)
    if src_is_dir and parent != new_parent:
        _check_not_below(tx, new_parent, src.ino)
    now = now_ns()
    _note_move(tx, src.ino, is_dir=src_is_dir)
    replaced = None
    if dst is not None:
        replaced = _replace_target(tx, src, new_parent, new_name, dst, now)
        if replaced.nlink > 0:  # its other names stay; its object at this one goes
            _note_move(tx, replaced.ino)
    tx.run(
        "UPDATE dentries SET parent = ?, name = ? WHERE parent = ? AND name = ?",
        new_parent,
        new_name,
        parent,
        name,
    )
    tx.run("UPDATE inodes SET ctime_ns = ? WHERE ino = ?", now, src.ino)
    moved_dir = src_is_dir and parent != new_parent
    _touch_dir(tx, parent, now, -1 if moved_dir else 0)
    if new_parent != parent:
        _touch_dir(tx, new_parent, now, 1 if moved_dir else 0)
    return replaced


def _replace_target(tx: Tx, src: InodeRow, new_parent: int, new_name: bytes, dst: InodeRow, now: int) -> InodeRow:
    """Remove the entry a rename overwrites; the replaced row (see rename)."""
    src_is_dir, dst_is_dir = stat.S_ISDIR(src.mode), stat.S_ISDIR(dst.mode)
    if src_is_dir and not dst_is_dir:
        raise err.NotADirectory(f"{os.fsdecode(new_name)!r} is not a directory")
    if dst_is_dir and not src_is_dir:
        raise err.IsADirectory(f"{os.fsdecode(new_name)!r} is a directory")
    if dst_is_dir and _has_entries(tx, dst.ino):
        raise err.NotEmpty(f"{os.fsdecode(new_name)!r}")
    tx.run("DELETE FROM dentries WHERE parent = ? AND name = ?", new_parent, new_name)
    if not dst_is_dir:
        return _add_links(tx, dst.ino, -1, now)
    drop_inode(tx, dst.ino)
    _touch_dir(tx, new_parent, now, -1)
    return dataclasses.replace(dst, nlink=0)


def _exchange(tx: Tx, a: tuple[int, bytes, InodeRow], b: tuple[int, bytes, InodeRow]) -> None:
    """Swap the inodes two entries name (RENAME_EXCHANGE)."""
    (a_parent, a_name, a_row), (b_parent, b_name, b_row) = a, b
    if a_row.ino == b_row.ino:
        return
    a_is_dir, b_is_dir = stat.S_ISDIR(a_row.mode), stat.S_ISDIR(b_row.mode)
    if a_parent != b_parent:
        if a_is_dir:
            _check_not_below(tx, b_parent, a_row.ino)
        if b_is_dir:
            _check_not_below(tx, a_parent, b_row.ino)
    now = now_ns()
    _note_move(tx, a_row.ino, is_dir=a_is_dir)
    _note_move(tx, b_row.ino, is_dir=b_is_dir)
    tx.run("UPDATE dentries SET ino = ? WHERE parent = ? AND name = ?", b_row.ino, a_parent, a_name)
    tx.run("UPDATE dentries SET ino = ? WHERE parent = ? AND name = ?", a_row.ino, b_parent, b_name)
    tx.run("UPDATE inodes SET ctime_ns = ? WHERE ino IN (?, ?)", now, a_row.ino, b_row.ino)
    # a_parent gains b and loses a; subdirectory counts move accordingly.
    delta = int(b_is_dir) - int(a_is_dir) if a_parent != b_parent else 0
    _touch_dir(tx, a_parent, now, delta)
    if a_parent != b_parent:
        _touch_dir(tx, b_parent, now, -delta)


# --- moves: names changed, not yet in the backend --------------------------------------


def moves(tx: Tx) -> list[tuple[int, int, str | None]]:
    return [(ino, gen, dir_path) for ino, gen, dir_path in tx.all("SELECT ino, gen, dir_path FROM moves ORDER BY ino")]


def move_of(tx: Tx, ino: int) -> tuple[int, str | None] | None:
    found = tx.one("SELECT gen, dir_path FROM moves WHERE ino = ?", ino)
    return None if found is None else (found[0], found[1])


def moves_add(tx: Tx, inos: list[int]) -> None:
    for ino in inos:
        _note_move(tx, ino)


def moves_done(tx: Tx, ino: int, gen: int) -> None:
    tx.run("DELETE FROM moves WHERE ino = ? AND gen = ?", ino, gen)
