"""Conformance tests of the metadata engines.

``MetaConformance`` holds every test; an engine's test class supplies only
the fixture ``meta_url`` (a fresh, empty database per test), from which the
suite builds ``store`` (opened and initialised) and, for the multi-daemon and
restart tests, more stores on the same database.
"""

import dataclasses
import errno
import os
import sqlite3
import stat

import pytest
import trio
from loopback import free_port
from pgserver import PgServer

from aiturbofs import _errors as err
from aiturbofs._limits import (
    META_KEYS_PER_STATEMENT_MAX,
    META_LOOKUP_PATH_JOINED_MAX,
    META_PG_CONNECTIONS,
    NAME_BYTES_MAX,
    SYMLINK_TARGET_BYTES_MAX,
    XATTR_NAME_BYTES_MAX,
    XATTR_VALUE_BYTES_MAX,
    XATTRS_PER_INODE_MAX,
)
from aiturbofs.chunk import HOLE
from aiturbofs.meta import (
    NODE_ALIVE,
    NODE_DEAD,
    NODE_LEFT,
    ROOT_INO,
    STATE_BROKEN,
    STATE_DURABLE,
    STATE_PERSISTING,
    STATE_STAGED,
    ChunkSource,
    InodeRow,
    MetaStore,
    NodeRow,
    open_meta,
)

UID, GID = 1000, 1001
T0 = 1_700_000_000_000_000_000  # a fixed timestamp for rows the tests make
HASH_A, HASH_B, HASH_C = b"\xaa" * 32, b"\xbb" * 32, b"\xcc" * 32


def file_row(mode=0o644, **fields) -> InodeRow:
    row = InodeRow(0, stat.S_IFREG | mode, UID, GID, 0, 1, T0, T0, T0)
    return dataclasses.replace(row, **fields)


def dir_row(mode=0o755) -> InodeRow:
    return InodeRow(0, stat.S_IFDIR | mode, UID, GID, 0, 2, T0, T0, T0)


def symlink_row(target: bytes) -> InodeRow:
    return InodeRow(0, stat.S_IFLNK | 0o777, UID, GID, len(target), 1, T0, T0, T0, target=target)


async def open_store(url: str) -> MetaStore:
    store = open_meta(url)
    await store.init(root_uid=UID, root_gid=GID, root_mode=0o755)
    return store


async def mkdirs(store: MetaStore, path: bytes) -> int:
    """Create every directory of ``a/b/c`` under the root; the last one's ino."""
    ino = ROOT_INO
    for name in path.split(b"/"):
        ino = (await store.create(ino, name, dir_row())).ino
    return ino


async def names(store: MetaStore, parent: int) -> list[bytes]:
    return [name for name, _, _ in await store.readdir(parent, 0, 10_000)]


def v1_schema(blob: str, integer: str, identity: str) -> list[str]:
    """The DDL of metadata schema v1, frozen here as released, to test migrations."""
    b, i = blob, integer
    return [
        f"CREATE TABLE meta_schema (version {i} NOT NULL)",
        f"""CREATE TABLE inodes (
            ino {identity}, mode {i} NOT NULL, uid {i} NOT NULL, gid {i} NOT NULL,
            size {i} NOT NULL, nlink {i} NOT NULL, atime_ns {i} NOT NULL,
            mtime_ns {i} NOT NULL, ctime_ns {i} NOT NULL, rdev {i} NOT NULL,
            target {b}, state TEXT, version {i} NOT NULL,
            backend_keys TEXT NOT NULL, backend_etag TEXT,
            imported_ns {i} NOT NULL, persisted_version {i} NOT NULL,
            manifest {b})""",
        "CREATE INDEX inodes_state ON inodes (state)",
        "CREATE INDEX inodes_orphan ON inodes (ino) WHERE nlink = 0",
        f"""CREATE TABLE dentries (
            id {identity}, parent {i} NOT NULL, name {b} NOT NULL, ino {i} NOT NULL,
            UNIQUE (parent, name))""",
        "CREATE INDEX dentries_readdir ON dentries (parent, id)",
        "CREATE INDEX dentries_ino ON dentries (ino)",
        f"""CREATE TABLE xattrs (
            ino {i} NOT NULL, name {b} NOT NULL, value {b} NOT NULL,
            PRIMARY KEY (ino, name))""",
        "INSERT INTO meta_schema (version) VALUES (1)",
    ]


_V1_INODE_COLS = (
    "mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns, rdev, state, version,"
    " backend_keys, persisted_version, imported_ns, manifest"
)


class MetaConformance:
    """Every ``MetaStore`` engine passes these; subclasses supply ``meta_url``
    and ``raw_sql`` (``run(sql, *params) -> rows``: one statement with ``?``
    placeholders, autocommitted, on the same database, past the store)."""

    @pytest.fixture
    async def store(self, meta_url):
        store = await open_store(meta_url)
        yield store
        await store.close()

    # --- group commit --------------------------------------------------------------

    async def test_concurrent_writes_each_get_their_own_result(self, store):
        """Writes that arrive together (one group commit on SQLite): the ones
        that fail get their own error and change nothing; the others commit."""
        await store.create(ROOT_INO, b"taken", file_row())
        results: list[tuple[bytes, object]] = []

        async def create(name: bytes):
            try:
                results.append((name, (await store.create(ROOT_INO, name, file_row())).ino))
            except err.AiturboError as exc:
                results.append((name, exc))

        names = [f"n{i}".encode() for i in range(40)] + [b"taken", b"n3"]
        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(create, name)
        failed = [(name, exc) for name, exc in results if not isinstance(exc, int)]
        assert sorted(name for name, _ in failed) == [b"n3", b"taken"]  # n3 made once; its twin got Exists
        assert all(isinstance(exc, err.Exists) for _, exc in failed)
        made = {name: ino for name, ino in results if isinstance(ino, int)}
        assert len(made) == 40 and len(set(made.values())) == 40
        for name, ino in made.items():
            assert (await store.lookup(ROOT_INO, name)).ino == ino
        assert len(await store.readdir(ROOT_INO, 0, 100)) == 41

    async def test_sync_after_unsynced_commits(self, store):
        f = await store.create(ROOT_INO, b"f", file_row(state=STATE_STAGED))
        row = await store.commit_manifest(f.ino, size=3, manifest=HASH_A, state=STATE_STAGED, sync=False)
        await store.sync()
        assert (await store.get_inode(f.ino)).version == row.version

    # --- init ----------------------------------------------------------------------

    async def test_init_creates_root(self, store):
        root = await store.get_inode(ROOT_INO)
        assert stat.S_ISDIR(root.mode) and stat.S_IMODE(root.mode) == 0o755
        assert (root.uid, root.gid, root.nlink, root.state) == (UID, GID, 2, None)
        assert await store.readdir(ROOT_INO, 0, 100) == []
        assert await store.stats() == (1, 0)

    async def test_init_again_keeps_data(self, store, meta_url):
        await store.set_attrs(ROOT_INO, mode=stat.S_IFDIR | 0o700)
        await store.create(ROOT_INO, b"f", file_row())
        again = open_meta(meta_url)
        await again.init(root_uid=0, root_gid=0, root_mode=0o777)
        try:
            root = await again.get_inode(ROOT_INO)
            assert (stat.S_IMODE(root.mode), root.uid) == (0o700, UID)
            assert await names(again, ROOT_INO) == [b"f"]
        finally:
            await again.close()

    async def test_refuses_newer_schema(self, store, meta_url, raw_sql):
        raw_sql("UPDATE meta_schema SET version = version + 1")
        with pytest.raises(err.ConfigError):
            await open_store(meta_url)

    async def test_migrates_v1_database(self, meta_url, raw_sql):
        engine = open_meta(meta_url)  # not opened: only its column types
        for ddl in v1_schema(engine.BLOB, engine.INT, engine.IDENTITY):
            raw_sql(ddl)
        marks = ", ".join("?" * 15)
        root = (stat.S_IFDIR | 0o755, UID, GID, 0, 2, T0, T0, T0, 0, None, 0, "[]", -1, 0, None)
        raw_sql(f"INSERT INTO inodes (ino, {_V1_INODE_COLS}) VALUES (1, {marks})", *root)
        f = (stat.S_IFREG | 0o644, UID, GID, 9, 1, T0, T0, T0, 0, STATE_DURABLE, 3, '["k"]', 3, 0, HASH_A)
        raw_sql(f"INSERT INTO inodes ({_V1_INODE_COLS}) VALUES ({marks})", *f)
        raw_sql("INSERT INTO dentries (parent, name, ino) VALUES (1, ?, 2)", b"f")
        store = await open_store(meta_url)
        try:
            row = await store.lookup(ROOT_INO, b"f")
            assert (row.ino, row.version, row.state, row.manifest) == (2, 3, STATE_DURABLE, HASH_A)
            assert (row.backend_keys, row.owner, row.holders) == (["k"], None, [])
            # v4: what the backend holds of rows persisted before is unknown; taken to be the row's own
            assert row.persisted_attrs == (stat.S_IFREG | 0o644, UID, GID, T0)
            assert await store.claim_owner(row.ino, 3, None, "n1")
            await store.upsert_node("n1", "10.0.0.1:7000", {}, T0)
            assert [node.name for node in await store.nodes()] == ["n1"]
            await store.record_chunk_sources("k", "e", [(HASH_A, 0, 9)])
            assert await store.chunk_sources([HASH_A]) == {HASH_A: ChunkSource("k", 0, 9, "e")}
            assert (await store.create(ROOT_INO, b"g", file_row())).ino == 3
            await store.rename(ROOT_INO, b"g", ROOT_INO, b"h")  # v3: the moves table
            assert await store.moves() == [(3, 1, None)]
        finally:
            await store.close()
        assert raw_sql("SELECT version FROM meta_schema") == [(4,)]
        again = await open_store(meta_url)  # finds v4: nothing left to migrate
        try:
            assert (await again.lookup(ROOT_INO, b"f")).owner == "n1"
        finally:
            await again.close()

    async def test_name_changes_are_noted_until_the_persister_lets_them_go(self, store):
        """rename, link, an unlink that leaves a name and a directory rename note a pending move in the
        same transaction; ``moves_done`` forgets it only at the generation it was read at."""
        f = await store.create(ROOT_INO, b"f", file_row())
        g = await store.create(ROOT_INO, b"g", file_row())
        d = await store.create(ROOT_INO, b"d", dir_row())
        assert await store.moves() == []
        await store.rename(ROOT_INO, b"f", ROOT_INO, b"f2")
        await store.link(g.ino, ROOT_INO, b"g2")
        await store.rename(ROOT_INO, b"d", ROOT_INO, b"d2")
        await store.rename(ROOT_INO, b"d2", ROOT_INO, b"d3")  # the first old path stays: the backend has it
        assert await store.moves() == [(f.ino, 1, None), (g.ino, 1, None), (d.ino, 2, "d")]
        await store.moves_done(f.ino, 1)
        await store.unlink(ROOT_INO, b"g")  # g2 stays: its object at g goes
        assert await store.move_of(g.ino) == (2, None)
        await store.moves_done(g.ino, 1)  # read before the unlink: a newer change is still pending
        assert await store.move_of(g.ino) == (2, None)
        await store.moves_done(g.ino, 2)
        assert await store.move_of(g.ino) is None
        await store.moves_add([g.ino])
        await store.unlink(ROOT_INO, b"g2")  # the last name: an orphan, found at start anyway
        assert await store.move_of(g.ino) == (1, None)
        await store.delete_inode(g.ino)
        assert await store.moves() == [(d.ino, 2, "d")]

    # --- create / lookup / get_inode --------------------------------------------------

    async def test_create_file_dir_symlink(self, store):
        f = await store.create(ROOT_INO, b"f.bin", file_row(0o600, ino=99, nlink=7))
        d = await store.create(ROOT_INO, b"d", dir_row())
        s = await store.create(ROOT_INO, b"s", symlink_row(b"f.bin"))
        assert len({f.ino, d.ino, s.ino, ROOT_INO}) == 4
        assert f.ino != 99 and f.nlink == 1 and f.state == STATE_STAGED
        assert (f.mode, f.uid, f.gid, f.mtime_ns) == (stat.S_IFREG | 0o600, UID, GID, T0)
        assert d.nlink == 2 and d.state is None
        assert s.target == b"f.bin" and s.state is None and stat.S_ISLNK(s.mode)
        for name, row in [(b"f.bin", f), (b"d", d), (b"s", s)]:
            assert await store.lookup(ROOT_INO, name) == row
            assert await store.get_inode(row.ino) == row

    async def test_create_keeps_imported_fields(self, store):
        row = file_row(
            size=5,
            state=STATE_DURABLE,
            backend_keys=["bucket/f"],
            backend_etag="e1",
            persisted_version=0,
        )
        f = await store.create(ROOT_INO, b"f", row)
        assert f.manifest is None and f.size == 5 and f.state == STATE_DURABLE
        assert (f.backend_keys, f.backend_etag, f.persisted_version) == (["bucket/f"], "e1", 0)

    async def test_persisted_attrs_round_trip(self, store):
        f = await store.create(ROOT_INO, b"f", file_row(0o600))
        assert f.persisted_attrs is None  # nothing persisted yet
        assert f.attrs() == (stat.S_IFREG | 0o600, UID, GID, T0)
        v = (await store.commit_manifest(f.ino, size=1, manifest=HASH_A, state=STATE_STAGED)).version
        assert await store.set_state(f.ino, STATE_DURABLE, if_version=v, persisted_version=v,
                                     persisted_attrs=(stat.S_IFREG | 0o4755, 65534, 65534, 2**62))
        assert (await store.get_inode(f.ino)).persisted_attrs == (stat.S_IFREG | 0o4755, 65534, 65534, 2**62)
        assert (await store.set_attrs(f.ino, persisted_attrs=None)).persisted_attrs is None
        with pytest.raises(ValueError):
            await store.set_attrs(f.ino, persisted_attrs=(1, 2, 3))

    async def test_create_updates_parent(self, store):
        before = await store.get_inode(ROOT_INO)
        d = await store.create(ROOT_INO, b"d", dir_row())
        await store.create(d.ino, b"f", file_row())
        root = await store.get_inode(ROOT_INO)
        assert root.nlink == 3  # a file does not count, a subdirectory does
        assert root.mtime_ns >= before.mtime_ns and root.ctime_ns >= before.ctime_ns
        assert (await store.get_inode(d.ino)).nlink == 2
        assert (await store.get_inode(d.ino)).mtime_ns > T0

    async def test_an_imported_entry_leaves_its_directorys_times(self, store):
        """The backend's directory already had it: listing it must not make the directory new."""
        d = await store.create(ROOT_INO, b"d", dir_row())
        d = await store.set_attrs(d.ino, mtime_ns=T0, ctime_ns=T0)
        await store.create(d.ino, b"taken", file_row())
        d = await store.set_attrs(d.ino, mtime_ns=T0, ctime_ns=T0)
        made = await store.create_imported(d.ino, [(b"f", file_row()), (b"taken", file_row()), (b"sub", dir_row())])
        row = await store.get_inode(d.ino)
        assert (row.mtime_ns, row.ctime_ns, row.nlink) == (T0, T0, 3)
        # a name that exists stays the namespace's (None); the others are made, in one call
        assert made[1] is None
        assert [(await store.lookup(d.ino, name)).ino for name in (b"f", b"sub")] == [made[0].ino, made[2].ino]
        assert stat.S_ISDIR(made[2].mode) and made[2].nlink == 2

    async def test_create_errors(self, store):
        f = await store.create(ROOT_INO, b"f", file_row())
        with pytest.raises(err.Exists):
            await store.create(ROOT_INO, b"f", dir_row())
        with pytest.raises(err.NotFound):
            await store.create(12345, b"x", file_row())
        with pytest.raises(err.NotADirectory):
            await store.create(f.ino, b"x", file_row())
        for bad in [b"", b".", b"..", b"a/b", b"a\0b"]:
            with pytest.raises(err.InvalidArgument):
                await store.create(ROOT_INO, bad, file_row())
        with pytest.raises(err.NameTooLong):
            await store.create(ROOT_INO, b"n" * (NAME_BYTES_MAX + 1), file_row())
        with pytest.raises(err.NameTooLong):
            await store.create(ROOT_INO, b"s", symlink_row(b"t" * (SYMLINK_TARGET_BYTES_MAX + 1)))
        assert await names(store, ROOT_INO) == [b"f"]  # failed creates left nothing

    async def test_names_are_arbitrary_bytes(self, store):
        name = b"\xff\xfe caf\xc3\xa9 \n*?"
        longest = b"n" * NAME_BYTES_MAX
        f = await store.create(ROOT_INO, name, file_row())
        await store.create(ROOT_INO, longest, file_row())
        assert (await store.lookup(ROOT_INO, name)).ino == f.ino
        assert sorted(await names(store, ROOT_INO)) == sorted([name, longest])

    async def test_lookup_and_get_missing(self, store):
        with pytest.raises(err.NotFound):
            await store.lookup(ROOT_INO, b"nope")
        with pytest.raises(err.NotFound):
            await store.get_inode(4242)

    async def test_lookup_path_walks_every_name_and_agrees_with_paths_of(self, store):
        a = await store.create(ROOT_INO, b"a", dir_row())
        d = await store.create(a.ino, b"caf\xc3\xa9 \xff", dir_row())
        f = await store.create(d.ino, b"f", file_row())
        await store.link(f.ino, ROOT_INO, b"g")
        for path in await store.paths_of(f.ino):
            assert (await store.lookup_path(path)).ino == f.ino
        [d_path] = await store.paths_of(d.ino)
        assert (await store.lookup_path(d_path)).ino == d.ino
        assert (await store.lookup_path("a")).ino == a.ino
        # missing names, a name below a file, the root's empty path: no row
        for missing in ["b", "a/x", d_path + "/f/x", "g/x", "", "a/"]:
            assert await store.lookup_path(missing) is None, missing
        name = os.fsdecode(b"caf\xc3\xa9 \xff")
        assert await store.paths_of(f.ino) == [f"a/{name}/f", "g"]  # in the order linked
        await store.rename(ROOT_INO, b"a", ROOT_INO, b"b")
        assert await store.lookup_path("a") is None
        assert (await store.lookup_path((await store.paths_of(f.ino))[0])).ino == f.ino
        deep = await store.create(d.ino, b"deep", dir_row())
        await store.link(f.ino, deep.ino, b"h")
        assert await store.paths_of(f.ino) == [f"b/{name}/f", "g", f"b/{name}/deep/h"]
        assert await store.paths_of(deep.ino) == [f"b/{name}/deep"]
        assert (await store.lookup_path(f"b/{name}/deep/h")).ino == f.ino
        parent, path = ROOT_INO, []  # deeper than one statement joins: walked a name at a time
        for depth in range(META_LOOKUP_PATH_JOINED_MAX + 2):
            parent = (await store.create(parent, b"d%d" % depth, dir_row())).ino
            path.append(f"d{depth}")
            assert (await store.lookup_path("/".join(path))).ino == parent
            assert await store.lookup_path("/".join([*path[:-1], "x"])) is None

    # --- readdir -------------------------------------------------------------------------

    async def test_readdir_order_tokens_errors(self, store):
        f = await store.create(ROOT_INO, b"zz", file_row())
        await store.create(ROOT_INO, b"aa", dir_row())
        entries = await store.readdir(ROOT_INO, 0, 100)
        assert [name for name, _, _ in entries] == [b"zz", b"aa"]  # creation order
        assert entries[0][1] == await store.get_inode(f.ino)
        tokens = [token for _, _, token in entries]
        assert tokens[0] > 0 and tokens == sorted(set(tokens))
        assert await store.readdir(ROOT_INO, tokens[0], 100) == entries[1:]
        assert await store.readdir(ROOT_INO, tokens[-1], 100) == []
        assert await store.readdir(ROOT_INO, 0, 0) == []
        with pytest.raises(err.NotADirectory):
            await store.readdir(f.ino, 0, 10)
        with pytest.raises(err.NotFound):
            await store.readdir(4242, 0, 10)

    async def test_nodes_with_state_are_a_directorys_symlinks_and_special_files_the_backend_keeps(self, store):
        d = await mkdirs(store, b"d")
        await store.create(d, b"f", file_row())  # a file (staged): not one of them
        await store.create(d, b"sub", dataclasses.replace(dir_row(), state=STATE_DURABLE))
        await store.create(d, b"bare", symlink_row(b"f"))  # the backend keeps nothing of it
        kept = await store.create(d, b"kept", dataclasses.replace(symlink_row(b"f"), state=STATE_DURABLE))
        fifo = await store.create(d, b"fifo", dataclasses.replace(file_row(), mode=stat.S_IFIFO | 0o600,
                                                                  state=STATE_PERSISTING))
        assert [r.ino for r in await store.nodes_with_state(d)] == [kept.ino, fifo.ino]  # readdir order
        assert await store.nodes_with_state(d) == [await store.get_inode(kept.ino), await store.get_inode(fifo.ino)]
        assert await store.nodes_with_state(ROOT_INO) == []  # (only a directory: d)
        with pytest.raises(err.NotADirectory):
            await store.nodes_with_state(kept.ino)
        with pytest.raises(err.NotFound):
            await store.nodes_with_state(4242)

    async def test_readdir_paging_stable_while_changing(self, store):
        for i in range(40):
            await store.create(ROOT_INO, b"old%02d" % i, file_row())
        removed_unread = set()
        seen, offset, page = [], 0, 0
        while entries := await store.readdir(ROOT_INO, offset, 7):
            seen += [name for name, _, _ in entries]
            offset, page = entries[-1][2], page + 1
            # Between pages: remove entries already read and not yet read,
            # add new ones, rename one already read in place.
            if page == 1:
                await store.unlink(ROOT_INO, seen[0])
            if page == 2:
                await store.rename(ROOT_INO, b"old03", ROOT_INO, b"renamed")
            if page <= 4:
                removed_unread.add(b"old%02d" % (39 - page))
                await store.unlink(ROOT_INO, b"old%02d" % (39 - page))
                await store.create(ROOT_INO, b"new%d" % page, file_row())
        assert len(seen) == len(set(seen)), "an entry was returned twice"
        stayed = {b"old%02d" % i for i in range(40)} - removed_unread
        assert stayed <= set(seen), "an entry that stayed was skipped"
        assert not removed_unread & set(seen)
        assert b"renamed" not in seen  # it kept old03's place, already read

    async def test_readdir_keeps_position_of_renamed_entry(self, store):
        for name in [b"a", b"b", b"c"]:
            await store.create(ROOT_INO, name, file_row())
        await store.rename(ROOT_INO, b"b", ROOT_INO, b"B")
        assert await names(store, ROOT_INO) == [b"a", b"B", b"c"]

    # --- link / unlink / rmdir ------------------------------------------------------------

    async def test_link(self, store):
        d = await store.create(ROOT_INO, b"d", dir_row())
        f = await store.create(ROOT_INO, b"f", file_row())
        linked = await store.link(f.ino, d.ino, b"g")
        assert linked.ino == f.ino and linked.nlink == 2 and linked.ctime_ns > T0
        assert (await store.lookup(d.ino, b"g")).ino == f.ino
        assert (await store.get_inode(d.ino)).nlink == 2  # a file link is no subdir
        with pytest.raises(err.NotPermitted):
            await store.link(d.ino, ROOT_INO, b"d2")
        with pytest.raises(err.Exists):
            await store.link(f.ino, d.ino, b"g")
        with pytest.raises(err.NotFound):
            await store.link(4242, d.ino, b"x")
        with pytest.raises(err.NotADirectory):
            await store.link(f.ino, f.ino, b"x")
        with pytest.raises(err.InvalidArgument):
            await store.link(f.ino, d.ino, b"a/b")

    async def test_link_of_unlinked_inode_fails(self, store):
        f = await store.create(ROOT_INO, b"f", file_row())
        await store.unlink(ROOT_INO, b"f")
        with pytest.raises(err.NotFound):
            await store.link(f.ino, ROOT_INO, b"again")

    async def test_unlink_keeps_row_until_delete(self, store):
        f = await store.create(ROOT_INO, b"f", file_row())
        await store.link(f.ino, ROOT_INO, b"g")
        assert (await store.unlink(ROOT_INO, b"f")).nlink == 1
        gone = await store.unlink(ROOT_INO, b"g")
        assert gone.ino == f.ino and gone.nlink == 0
        assert (await store.get_inode(f.ino)).nlink == 0
        assert [row.ino for row in await store.orphans()] == [f.ino]
        assert await store.paths_of(f.ino) == []
        with pytest.raises(err.NotFound):
            await store.lookup(ROOT_INO, b"g")
        await store.delete_inode(f.ino)
        assert await store.orphans() == []
        with pytest.raises(err.NotFound):
            await store.get_inode(f.ino)

    async def test_unlink_errors(self, store):
        f = await store.create(ROOT_INO, b"f", file_row())
        await store.create(ROOT_INO, b"d", dir_row())
        with pytest.raises(err.IsADirectory):
            await store.unlink(ROOT_INO, b"d")
        with pytest.raises(err.NotFound):
            await store.unlink(ROOT_INO, b"nope")
        with pytest.raises(err.NotADirectory):
            await store.unlink(f.ino, b"x")

    async def test_rmdir(self, store):
        d = await store.create(ROOT_INO, b"d", dir_row())
        sub = await store.create(d.ino, b"sub", dir_row())
        await store.setxattr(sub.ino, b"user.x", b"1")
        with pytest.raises(err.NotEmpty):
            await store.rmdir(ROOT_INO, b"d")
        removed = await store.rmdir(d.ino, b"sub")
        assert removed.ino == sub.ino and removed.nlink == 0
        assert (await store.get_inode(d.ino)).nlink == 2
        with pytest.raises(err.NotFound):
            await store.get_inode(sub.ino)
        await store.rmdir(ROOT_INO, b"d")
        assert (await store.get_inode(ROOT_INO)).nlink == 2
        assert await store.orphans() == []  # rmdir leaves no row behind
        assert await store.stats() == (1, 0)

    async def test_rmdir_errors(self, store):
        f = await store.create(ROOT_INO, b"f", file_row())
        with pytest.raises(err.NotADirectory):
            await store.rmdir(ROOT_INO, b"f")
        with pytest.raises(err.NotFound):
            await store.rmdir(ROOT_INO, b"nope")
        with pytest.raises(err.NotADirectory):
            await store.rmdir(f.ino, b"x")

    # --- rename -------------------------------------------------------------------------------

    async def test_rename_file_across_dirs(self, store):
        a = await store.create(ROOT_INO, b"a", dir_row())
        b = await store.create(ROOT_INO, b"b", dir_row())
        f = await store.create(a.ino, b"f", file_row())
        await store.setxattr(f.ino, b"user.k", b"v")
        assert await store.rename(a.ino, b"f", b.ino, b"g") is None
        assert await names(store, a.ino) == [] and await names(store, b.ino) == [b"g"]
        moved = await store.lookup(b.ino, b"g")
        assert moved.ino == f.ino and moved.ctime_ns > T0 and moved.nlink == 1
        assert await store.getxattr(f.ino, b"user.k") == b"v"
        assert [(await store.get_inode(d)).nlink for d in (a.ino, b.ino)] == [2, 2]
        assert await store.paths_of(f.ino) == ["b/g"]

    async def test_rename_dir_moves_nlink(self, store):
        a = await store.create(ROOT_INO, b"a", dir_row())
        b = await store.create(ROOT_INO, b"b", dir_row())
        d = await store.create(a.ino, b"d", dir_row())
        await store.create(d.ino, b"inner", file_row())
        assert (await store.get_inode(a.ino)).nlink == 3
        await store.rename(a.ino, b"d", b.ino, b"d")
        assert (await store.get_inode(a.ino)).nlink == 2
        assert (await store.get_inode(b.ino)).nlink == 3
        assert (await store.get_inode(d.ino)).nlink == 2
        assert await store.paths_of((await store.lookup(d.ino, b"inner")).ino) == ["b/d/inner"]
        await store.rename(b.ino, b"d", b.ino, b"e")  # same parent: counts unchanged
        assert (await store.get_inode(b.ino)).nlink == 3

    async def test_rename_over_file(self, store):
        src = await store.create(ROOT_INO, b"src", file_row())
        dst = await store.create(ROOT_INO, b"dst", file_row())
        replaced = await store.rename(ROOT_INO, b"src", ROOT_INO, b"dst")
        assert replaced.ino == dst.ino and replaced.nlink == 0
        assert (await store.lookup(ROOT_INO, b"dst")).ino == src.ino
        assert await names(store, ROOT_INO) == [b"dst"]
        assert (await store.get_inode(dst.ino)).nlink == 0  # kept like unlink
        assert [row.ino for row in await store.orphans()] == [dst.ino]

    async def test_rename_over_hard_linked_file(self, store):
        src = await store.create(ROOT_INO, b"src", file_row())
        dst = await store.create(ROOT_INO, b"dst", file_row())
        await store.link(dst.ino, ROOT_INO, b"other")
        replaced = await store.rename(ROOT_INO, b"src", ROOT_INO, b"dst")
        assert replaced.ino == dst.ino and replaced.nlink == 1
        assert await store.paths_of(dst.ino) == ["other"]
        assert await store.paths_of(src.ino) == ["dst"]

    async def test_rename_over_empty_dir(self, store):
        a = await store.create(ROOT_INO, b"a", dir_row())
        d = await store.create(ROOT_INO, b"d", dir_row())
        target = await store.create(a.ino, b"t", dir_row())
        await store.setxattr(target.ino, b"user.x", b"1")
        assert (await store.get_inode(a.ino)).nlink == 3
        replaced = await store.rename(ROOT_INO, b"d", a.ino, b"t")
        assert replaced.ino == target.ino and replaced.nlink == 0
        with pytest.raises(err.NotFound):
            await store.get_inode(target.ino)  # an empty dir is deleted at once
        assert (await store.lookup(a.ino, b"t")).ino == d.ino
        assert (await store.get_inode(a.ino)).nlink == 3  # lost t, gained d
        assert (await store.get_inode(ROOT_INO)).nlink == 3  # lost d
        assert await store.orphans() == []

    async def test_rename_over_nonempty_dir(self, store):
        await store.create(ROOT_INO, b"d", dir_row())
        t = await store.create(ROOT_INO, b"t", dir_row())
        await store.create(t.ino, b"f", file_row())
        with pytest.raises(err.NotEmpty):
            await store.rename(ROOT_INO, b"d", ROOT_INO, b"t")
        assert await names(store, ROOT_INO) == [b"d", b"t"]

    async def test_rename_type_mismatch(self, store):
        await store.create(ROOT_INO, b"d", dir_row())
        await store.create(ROOT_INO, b"f", file_row())
        with pytest.raises(err.NotADirectory):
            await store.rename(ROOT_INO, b"d", ROOT_INO, b"f")
        with pytest.raises(err.IsADirectory):
            await store.rename(ROOT_INO, b"f", ROOT_INO, b"d")

    async def test_rename_into_own_subtree(self, store):
        c = await mkdirs(store, b"a/b/c")
        a = (await store.lookup(ROOT_INO, b"a")).ino
        b = (await store.lookup(a, b"b")).ino
        for target in (a, b, c):
            with pytest.raises(err.InvalidArgument):
                await store.rename(ROOT_INO, b"a", target, b"x")
        with pytest.raises(err.InvalidArgument):
            await store.rename(a, b"b", c, b"x")
        await store.rename(b, b"c", ROOT_INO, b"c")  # up the tree is fine
        assert await store.paths_of(c) == ["c"]
        assert (await store.get_inode(b)).nlink == 2

    async def test_rename_noreplace(self, store):
        await store.create(ROOT_INO, b"a", file_row())
        await store.create(ROOT_INO, b"b", file_row())
        with pytest.raises(err.Exists):
            await store.rename(ROOT_INO, b"a", ROOT_INO, b"b", noreplace=True)
        assert await store.rename(ROOT_INO, b"a", ROOT_INO, b"c", noreplace=True) is None
        assert await names(store, ROOT_INO) == [b"c", b"b"]

    async def test_rename_exchange(self, store):
        a = await store.create(ROOT_INO, b"a", dir_row())
        f = await store.create(ROOT_INO, b"f", file_row())
        d = await store.create(a.ino, b"d", dir_row())
        assert await store.rename(ROOT_INO, b"f", a.ino, b"d", exchange=True) is None
        assert (await store.lookup(ROOT_INO, b"f")).ino == d.ino
        assert (await store.lookup(a.ino, b"d")).ino == f.ino
        assert (await store.get_inode(ROOT_INO)).nlink == 4  # a and (now) d
        assert (await store.get_inode(a.ino)).nlink == 2
        assert await store.paths_of(d.ino) == ["f"]
        with pytest.raises(err.NotFound):
            await store.rename(ROOT_INO, b"f", ROOT_INO, b"nope", exchange=True)
        with pytest.raises(err.InvalidArgument):
            await store.rename(ROOT_INO, b"f", ROOT_INO, b"a", exchange=True, noreplace=True)

    async def test_rename_exchange_with_own_ancestor(self, store):
        a = await store.create(ROOT_INO, b"a", dir_row())
        await store.create(a.ino, b"b", dir_row())
        with pytest.raises(err.InvalidArgument):
            await store.rename(ROOT_INO, b"a", a.ino, b"b", exchange=True)

    async def test_rename_noops_and_missing(self, store):
        f = await store.create(ROOT_INO, b"f", file_row())
        await store.link(f.ino, ROOT_INO, b"g")
        assert await store.rename(ROOT_INO, b"f", ROOT_INO, b"f") is None
        assert await store.rename(ROOT_INO, b"f", ROOT_INO, b"g") is None  # same inode
        assert await names(store, ROOT_INO) == [b"f", b"g"]
        assert (await store.get_inode(f.ino)).nlink == 2
        with pytest.raises(err.NotFound):
            await store.rename(ROOT_INO, b"nope", ROOT_INO, b"x")
        with pytest.raises(err.NotFound):
            await store.rename(ROOT_INO, b"f", 4242, b"x")

    # --- attributes, manifests, states ---------------------------------------------------------

    async def test_set_attrs(self, store):
        f = await store.create(ROOT_INO, b"f", file_row())
        row = await store.set_attrs(
            f.ino, mode=stat.S_IFREG | 0o600, uid=7, size=123, atime_ns=5, backend_keys=["k1", "k2"]
        )
        assert (row.mode, row.uid, row.size, row.atime_ns) == (stat.S_IFREG | 0o600, 7, 123, 5)
        assert row.backend_keys == ["k1", "k2"]
        assert await store.get_inode(f.ino) == row
        assert await store.set_attrs(f.ino) == row
        with pytest.raises(ValueError):
            await store.set_attrs(f.ino, ino=5)
        with pytest.raises(ValueError):
            await store.set_attrs(f.ino, colour="red")
        with pytest.raises(err.NotFound):
            await store.set_attrs(4242, size=1)

    async def test_commit_manifest(self, store):
        f = await store.create(ROOT_INO, b"f", file_row())
        manifest = HASH_A + HOLE + HASH_B
        row = await store.commit_manifest(
            f.ino, size=20 << 20, manifest=manifest, state=STATE_STAGED, mtime_ns=T0 + 9
        )
        assert (row.version, row.size, row.manifest) == (1, 20 << 20, manifest)
        assert (row.mtime_ns, row.ctime_ns) == (T0 + 9, T0 + 9)
        assert await store.get_inode(f.ino) == row
        again = await store.commit_manifest(f.ino, size=0, manifest=None, state=STATE_STAGED)
        assert (again.version, again.manifest, again.mtime_ns) == (2, None, T0 + 9)
        with pytest.raises(err.NotFound):
            await store.commit_manifest(4242, size=0, manifest=b"", state=STATE_STAGED)
        with pytest.raises(ValueError):
            await store.commit_manifest(f.ino, size=1, manifest=b"x" * 31, state=STATE_STAGED)
        with pytest.raises(ValueError):
            await store.commit_manifest(f.ino, size=1, manifest=b"", state="lost")

    async def test_set_state_compare_and_set(self, store):
        f = await store.create(ROOT_INO, b"f", file_row())
        v1 = (await store.commit_manifest(f.ino, size=1, manifest=HASH_A, state=STATE_STAGED)).version
        assert await store.set_state(f.ino, STATE_PERSISTING, if_version=v1)
        v2 = (await store.commit_manifest(f.ino, size=2, manifest=HASH_B, state=STATE_STAGED)).version
        # The upload of v1 finishes after v2 was committed: it must not win.
        assert not await store.set_state(
            f.ino, STATE_DURABLE, if_version=v1, backend_keys=["f"], persisted_version=v1
        )
        row = await store.get_inode(f.ino)
        assert (row.state, row.backend_keys, row.persisted_version) == (STATE_STAGED, [], -1)
        assert await store.set_state(
            f.ino, STATE_DURABLE, if_version=v2, backend_keys=["f"], persisted_version=v2, backend_etag="e"
        )
        row = await store.get_inode(f.ino)
        assert (row.state, row.backend_keys, row.persisted_version, row.backend_etag) == (
            STATE_DURABLE, ["f"], v2, "e"
        )
        assert row.version == v2  # set_state never moves the version
        assert await store.set_state(f.ino, STATE_BROKEN)  # unconditional
        assert (await store.get_inode(f.ino)).state == STATE_BROKEN
        with pytest.raises(err.NotFound):
            await store.set_state(4242, STATE_DURABLE)
        with pytest.raises(err.NotFound):
            await store.set_state(4242, STATE_DURABLE, if_version=0)
        with pytest.raises(ValueError):
            await store.set_state(f.ino, STATE_DURABLE, version=9)
        with pytest.raises(ValueError):
            await store.set_state(f.ino, "gone")

    async def test_set_manifest_if_only_while_the_imported_version_has_none(self, store):
        f = await store.create(ROOT_INO, b"f", file_row(state=STATE_DURABLE, manifest=None, backend_keys=["f"],
                                                          backend_etag="e1", size=5))
        assert not await store.set_manifest_if(f.ino, HASH_A, etag="e0")  # another version of the object
        assert (await store.get_inode(f.ino)).manifest is None
        assert await store.set_manifest_if(f.ino, HASH_A, etag="e1")
        row = await store.get_inode(f.ino)
        assert (row.manifest, row.version, row.backend_etag) == (HASH_A, f.version, "e1")  # the version stays
        assert not await store.set_manifest_if(f.ino, HASH_B, etag="e1")  # it has one: a second never replaces it
        assert (await store.get_inode(f.ino)).manifest == HASH_A
        await store.set_attrs(f.ino, manifest=None, backend_etag="e2")  # overwritten in the bucket
        assert not await store.set_manifest_if(f.ino, HASH_A, etag="e1")  # hashes of the old bytes
        with pytest.raises(err.NotFound):
            await store.set_manifest_if(4242, HASH_A, etag="e1")

    async def test_inodes_in_states(self, store):
        rows = {}
        for name, state in [(b"s", STATE_STAGED), (b"p", STATE_PERSISTING), (b"d", STATE_DURABLE)]:
            rows[state] = await store.create(ROOT_INO, name, file_row(state=state))
        await store.create(ROOT_INO, b"dir", dir_row())
        found = await store.inodes_in_states([STATE_STAGED, STATE_PERSISTING])
        assert [row.ino for row in found] == [rows[STATE_STAGED].ino, rows[STATE_PERSISTING].ino]
        assert await store.inodes_in_states([STATE_BROKEN]) == []
        assert await store.inodes_in_states([]) == []

    # --- cluster: owner and holders of a version ---------------------------------------------

    async def test_owner_and_holders(self, store):
        f = await store.create(ROOT_INO, b"f", file_row())
        assert (f.owner, f.holders) == (None, [])
        row = await store.commit_manifest(
            f.ino, size=1, manifest=HASH_A, state=STATE_STAGED, owner="n1", holders=["n1", "n2"]
        )
        assert (row.owner, row.holders) == ("n1", ["n1", "n2"])
        assert await store.get_inode(f.ino) == row
        row = await store.set_attrs(f.ino, holders=["n2"])
        assert (row.owner, row.holders) == ("n1", ["n2"])
        assert await store.set_state(f.ino, STATE_PERSISTING, if_version=row.version, owner="n2", holders=[])
        row = await store.get_inode(f.ino)
        assert (row.owner, row.holders) == ("n2", [])
        # A new version starts unowned and held nowhere unless the commit says otherwise.
        await store.set_attrs(f.ino, holders=["n3"])
        row = await store.commit_manifest(f.ino, size=2, manifest=HASH_B, state=STATE_STAGED)
        assert (row.version, row.owner, row.holders) == (2, None, [])
        with pytest.raises(ValueError):
            await store.set_attrs(f.ino, holders="n1")  # a string is not a list of nodes

    async def test_claim_owner_compare_and_set(self, store):
        f = await store.create(ROOT_INO, b"f", file_row())
        v1 = (await store.commit_manifest(f.ino, size=1, manifest=HASH_A, state=STATE_STAGED)).version
        assert await store.claim_owner(f.ino, v1, None, "a")
        assert not await store.claim_owner(f.ino, v1, None, "b")  # "a" was first
        assert (await store.get_inode(f.ino)).owner == "a"
        assert not await store.claim_owner(f.ino, v1, "b", "c")  # not b's to hand over
        assert await store.claim_owner(f.ino, v1, "a", "b")  # handed over
        assert (await store.get_inode(f.ino)).owner == "b"
        v2 = (await store.commit_manifest(f.ino, size=2, manifest=HASH_B, state=STATE_STAGED)).version
        assert not await store.claim_owner(f.ino, v1, None, "a")  # stale version
        assert not await store.claim_owner(f.ino, v2, "b", "a")  # the commit reset the owner
        assert await store.claim_owner(f.ino, v2, None, "a")
        assert await store.claim_owner(f.ino, v2, "a", None)  # released
        row = await store.get_inode(f.ino)
        assert (row.owner, row.version, row.size) == (None, v2, 2)
        with pytest.raises(err.NotFound):
            await store.claim_owner(4242, 0, None, "a")

    # --- cluster: nodes -----------------------------------------------------------------------

    async def test_nodes_round_trip(self, store, meta_url):
        assert await store.nodes() == []
        await store.upsert_node("node-b", "10.0.0.2:7000", {"dram": 64 << 30}, T0)
        await store.upsert_node("node-a", "10.0.0.1:7000", {"dram": 32 << 30, "snic_gbps": 100}, T0 + 1)
        assert await store.nodes() == [
            NodeRow("node-a", "10.0.0.1:7000", NODE_ALIVE, T0 + 1, {"dram": 32 << 30, "snic_gbps": 100}),
            NodeRow("node-b", "10.0.0.2:7000", NODE_ALIVE, T0, {"dram": 64 << 30}),
        ]
        assert await store.node_heartbeat("node-a", T0 + 5)
        assert await store.node_heartbeat("node-b", T0 + 6, {"dram": 1})
        assert not await store.node_heartbeat("node-z", T0 + 7)
        a, b = await store.nodes()
        assert (a.heartbeat_ns, a.info) == (T0 + 5, {"dram": 32 << 30, "snic_gbps": 100})  # info kept
        assert (b.heartbeat_ns, b.info) == (T0 + 6, {"dram": 1})
        assert await store.set_node_state("node-a", NODE_DEAD)
        assert await store.set_node_state("node-b", NODE_LEFT)
        assert not await store.set_node_state("node-z", NODE_DEAD)
        with pytest.raises(ValueError):
            await store.set_node_state("node-a", "zombie")
        assert await store.node_heartbeat("node-a", T0 + 8)  # a heartbeat does not revive
        assert [n.state for n in await store.nodes()] == [NODE_DEAD, NODE_LEFT]
        await store.upsert_node("node-a", "10.0.0.9:7001", {}, T0 + 9)  # rejoins
        restarted = await open_store(meta_url)  # a controller that restarted resumes from here
        try:
            assert await restarted.nodes() == [
                NodeRow("node-a", "10.0.0.9:7001", NODE_ALIVE, T0 + 9, {}),
                NodeRow("node-b", "10.0.0.2:7000", NODE_LEFT, T0 + 6, {"dram": 1}),
            ]
        finally:
            await restarted.close()

    # --- cluster: chunk sources -------------------------------------------------------------------

    async def test_chunk_sources_upsert_and_forget(self, store):
        four_mib = 4 << 20
        entries = [(HASH_A, 0, four_mib), (HOLE, four_mib, four_mib), (HASH_B, 2 * four_mib, 100)]
        await store.record_chunk_sources("ckpt/rank0.bin", "etag-0", entries)
        assert await store.chunk_sources([HASH_A, HASH_B, HASH_C, HOLE, HASH_A]) == {
            HASH_A: ChunkSource("ckpt/rank0.bin", 0, four_mib, "etag-0"),
            HASH_B: ChunkSource("ckpt/rank0.bin", 2 * four_mib, 100, "etag-0"),
        }
        await store.record_chunk_sources("ckpt/rank1.bin", None, [(HASH_A, four_mib, four_mib)])
        found = await store.chunk_sources([HASH_A, HASH_B])
        assert found[HASH_A] == ChunkSource("ckpt/rank1.bin", four_mib, four_mib, None)  # replaced
        assert await store.forget_chunk_sources("ckpt/rank0.bin") == 1  # only B still pointed there
        assert await store.chunk_sources([HASH_A, HASH_B]) == {HASH_A: found[HASH_A]}
        assert await store.forget_chunk_sources("ckpt/rank0.bin") == 0
        assert await store.forget_chunk_sources("ckpt/rank1.bin") == 1
        assert await store.chunk_sources([HASH_A, HASH_B, HASH_C]) == {}
        assert await store.chunk_sources([]) == {}
        await store.record_chunk_sources("empty", None, [])
        await store.record_chunk_sources("holes", None, [(HOLE, 0, 1)])
        assert await store.forget_chunk_sources("holes") == 0
        for bad in [(HASH_A[:31], 0, 1), (HASH_A, -1, 1), (HASH_A, 0, -1)]:
            with pytest.raises(ValueError):
                await store.record_chunk_sources("k", None, [bad])

    async def test_chunk_sources_in_bulk(self, store):
        count = 3 * META_KEYS_PER_STATEMENT_MAX + 7  # several IN lists
        keys = [i.to_bytes(32, "big") for i in range(1, count + 1)]
        chunk = 1 << 20
        entries = [(key, i * chunk, chunk) for i, key in enumerate(keys)]
        entries.append((keys[0], 99 * chunk, chunk))  # one key twice in a call: stored once
        await store.record_chunk_sources("big.bin", "e", entries)
        unknown = [b"\xff" + key[1:] for key in keys[:100]]
        found = await store.chunk_sources(unknown + keys[::-1])
        assert len(found) == count
        assert found[keys[0]] == ChunkSource("big.bin", 99 * chunk, chunk, "e")
        assert all(found[key].offset == i * chunk for i, key in enumerate(keys) if i)
        assert await store.forget_chunk_sources("big.bin") == count

    # --- paths_of -------------------------------------------------------------------------------------

    async def test_paths_of_nested_and_hard_links(self, store):
        c = await mkdirs(store, b"a/b/c")
        x = await mkdirs(store, b"x")
        f = await store.create(c, b"f.bin", file_row())
        await store.link(f.ino, x, b"g.bin")
        await store.link(f.ino, ROOT_INO, b"top")
        assert await store.paths_of(f.ino) == ["a/b/c/f.bin", "x/g.bin", "top"]
        assert await store.paths_of(c) == ["a/b/c"]
        assert await store.paths_of(ROOT_INO) == [""]
        assert await store.paths_of(4242) == []
        await store.rename(ROOT_INO, b"a", x, b"A")
        assert await store.paths_of(f.ino) == ["x/A/b/c/f.bin", "x/g.bin", "top"]

    async def test_paths_of_decodes_like_os(self, store):
        d = await store.create(ROOT_INO, b"\xff", dir_row())
        f = await store.create(d.ino, "é".encode(), file_row())
        assert await store.paths_of(f.ino) == [os.fsdecode(b"\xff") + "/é"]

    # --- orphans / delete_inode / stats --------------------------------------------------------------

    async def test_delete_inode(self, store):
        f = await store.create(ROOT_INO, b"f", file_row())
        await store.setxattr(f.ino, b"user.x", b"1")
        with pytest.raises(ValueError):
            await store.delete_inode(f.ino)  # still linked
        with pytest.raises(ValueError):
            await store.delete_inode(ROOT_INO)
        await store.unlink(ROOT_INO, b"f")
        await store.delete_inode(f.ino)
        await store.delete_inode(f.ino)  # idempotent
        with pytest.raises(err.NotFound):
            await store.getxattr(f.ino, b"user.x")
        assert await store.stats() == (1, 0)

    async def test_stats(self, store):
        d = await store.create(ROOT_INO, b"d", dir_row())
        await store.set_attrs(d.ino, size=4096)  # a directory's size is not data
        f = await store.create(d.ino, b"f", file_row(size=100))
        await store.create(ROOT_INO, b"g", file_row(size=23))
        await store.create(ROOT_INO, b"s", symlink_row(b"d/f"))
        assert await store.stats() == (5, 123)
        await store.commit_manifest(f.ino, size=1000, manifest=HASH_A, state=STATE_STAGED)
        assert await store.stats() == (5, 1023)

    # --- xattrs --------------------------------------------------------------------------------------------

    async def test_xattr_roundtrip(self, store):
        f = await store.create(ROOT_INO, b"f", file_row())
        assert await store.listxattr(f.ino) == []
        await store.setxattr(f.ino, b"user.b", b"\0binary\xff")
        await store.setxattr(f.ino, b"user.a", b"")
        assert await store.getxattr(f.ino, b"user.b") == b"\0binary\xff"
        assert await store.getxattr(f.ino, b"user.a") == b""
        assert await store.listxattr(f.ino) == [b"user.a", b"user.b"]
        await store.setxattr(f.ino, b"user.a", b"new")
        assert await store.getxattr(f.ino, b"user.a") == b"new"
        assert (await store.get_inode(f.ino)).ctime_ns > T0
        await store.removexattr(f.ino, b"user.a")
        assert await store.listxattr(f.ino) == [b"user.b"]
        with pytest.raises(err.NoAttribute):
            await store.getxattr(f.ino, b"user.a")
        with pytest.raises(err.NoAttribute):
            await store.removexattr(f.ino, b"user.a")

    async def test_xattr_flags(self, store):
        f = await store.create(ROOT_INO, b"f", file_row())
        with pytest.raises(err.NoAttribute):
            await store.setxattr(f.ino, b"user.k", b"1", os.XATTR_REPLACE)
        await store.setxattr(f.ino, b"user.k", b"1", os.XATTR_CREATE)
        with pytest.raises(err.Exists):
            await store.setxattr(f.ino, b"user.k", b"2", os.XATTR_CREATE)
        await store.setxattr(f.ino, b"user.k", b"3", os.XATTR_REPLACE)
        assert await store.getxattr(f.ino, b"user.k") == b"3"
        with pytest.raises(err.InvalidArgument):
            await store.setxattr(f.ino, b"user.k", b"4", os.XATTR_CREATE | os.XATTR_REPLACE)

    async def test_xattr_limits_and_missing_inode(self, store):
        f = await store.create(ROOT_INO, b"f", file_row())
        await store.setxattr(f.ino, b"n" * XATTR_NAME_BYTES_MAX, b"v" * XATTR_VALUE_BYTES_MAX)
        with pytest.raises(err.OutOfRange):
            await store.setxattr(f.ino, b"user.big", b"v" * (XATTR_VALUE_BYTES_MAX + 1))
        with pytest.raises(err.OutOfRange):
            await store.setxattr(f.ino, b"n" * (XATTR_NAME_BYTES_MAX + 1), b"")
        with pytest.raises(err.InvalidArgument):
            await store.setxattr(f.ino, b"", b"")
        for call in (
            store.getxattr(4242, b"user.x"),
            store.setxattr(4242, b"user.x", b""),
            store.listxattr(4242),
            store.removexattr(4242, b"user.x"),
        ):
            with pytest.raises(err.NotFound):
                await call

    async def test_xattr_count_limit(self, store):
        f = await store.create(ROOT_INO, b"f", file_row())
        for i in range(XATTRS_PER_INODE_MAX):
            await store.setxattr(f.ino, b"user.%d" % i, b"")
        with pytest.raises(err.OutOfRange):
            await store.setxattr(f.ino, b"user.one-too-many", b"")
        await store.setxattr(f.ino, b"user.0", b"replacing is fine")

    async def test_xattr_inheritance(self, store):
        ckpt = await store.create(ROOT_INO, b"ckpt", dir_row())
        await store.setxattr(ckpt.ino, b"user.aiturbo.group", b"job7")
        await store.setxattr(ckpt.ino, b"user.aiturbo.group.size", b"8")
        await store.setxattr(ckpt.ino, b"user.aiturbo.state", b"durable")
        await store.setxattr(ckpt.ino, b"user.other", b"not inherited")
        step = await store.create(ckpt.ino, b"step1", dir_row())
        shard = await store.create(step.ino, b"shard0", file_row())
        for child in (step, shard):  # grandchildren inherit through the child
            assert await store.listxattr(child.ino) == [b"user.aiturbo.group", b"user.aiturbo.group.size"]
            assert await store.getxattr(child.ino, b"user.aiturbo.group") == b"job7"
        link = await store.create(ckpt.ino, b"link", symlink_row(b"step1"))
        assert await store.listxattr(link.ino) == []  # Linux has no user.* on symlinks
        plain = await store.create(ckpt.ino, b"plain", file_row(), inherit_xattr_prefix=None)
        assert await store.listxattr(plain.ino) == []
        custom = await store.create(ckpt.ino, b"custom", file_row(), inherit_xattr_prefix=b"user.")
        assert b"user.other" in await store.listxattr(custom.ino)
        assert b"user.aiturbo.state" not in await store.listxattr(custom.ino)
        await store.setxattr(ckpt.ino, b"user.aiturbo.group", b"job8")
        assert await store.getxattr(shard.ino, b"user.aiturbo.group") == b"job7"  # copied, not linked

    # --- several stores, restarts -----------------------------------------------------------------------

    async def test_persists_across_reopen(self, store, meta_url):
        d = await store.create(ROOT_INO, b"d", dir_row())
        f = await store.create(d.ino, b"f", file_row())
        await store.commit_manifest(f.ino, size=9, manifest=HASH_A, state=STATE_STAGED)
        await store.setxattr(d.ino, b"user.aiturbo.group", b"g")
        gone = await store.create(ROOT_INO, b"gone", file_row())
        await store.unlink(ROOT_INO, b"gone")
        await store.delete_inode(gone.ino)
        orphan = await store.create(ROOT_INO, b"orphan", file_row())
        await store.unlink(ROOT_INO, b"orphan")
        await store.close()
        await store.close()  # idempotent
        reopened = await open_store(meta_url)
        try:
            row = await reopened.lookup(d.ino, b"f")
            assert (row.ino, row.version, row.manifest, row.size) == (f.ino, 1, HASH_A, 9)
            assert await reopened.getxattr(d.ino, b"user.aiturbo.group") == b"g"
            assert [r.ino for r in await reopened.orphans()] == [orphan.ino]
            fresh = await reopened.create(ROOT_INO, b"fresh", file_row())
            assert fresh.ino > orphan.ino > gone.ino  # inode numbers are never reused
        finally:
            await reopened.close()

    async def test_two_stores_share_one_database(self, store, meta_url):
        other = await open_store(meta_url)
        try:
            f = await store.create(ROOT_INO, b"f", file_row())
            assert (await other.lookup(ROOT_INO, b"f")).ino == f.ino
            row = await other.commit_manifest(f.ino, size=1, manifest=HASH_B, state=STATE_STAGED)
            assert (await store.get_inode(f.ino)).version == row.version == 1
            await store.setxattr(f.ino, b"user.k", b"v")
            assert await other.getxattr(f.ino, b"user.k") == b"v"

            async def create_many(s: MetaStore, prefix: bytes) -> None:
                for i in range(25):
                    await s.create(ROOT_INO, prefix + b"%d" % i, file_row())

            async with trio.open_nursery() as nursery:  # two daemons writing at once
                nursery.start_soon(create_many, store, b"a")
                nursery.start_soon(create_many, other, b"b")
            assert len(await names(store, ROOT_INO)) == 51
            assert len({row.ino for _, row, _ in await other.readdir(ROOT_INO, 0, 100)}) == 51
        finally:
            await other.close()


class TestSQLite(MetaConformance):
    @pytest.fixture
    def meta_url(self, tmp_path):
        return f"sqlite://{tmp_path}/meta.db"

    @pytest.fixture
    def raw_sql(self, tmp_path):
        def run(sql, *params):
            conn = sqlite3.connect(tmp_path / "meta.db", isolation_level=None)
            try:
                return conn.execute(sql, params).fetchall()
            finally:
                conn.close()

        return run

    async def test_too_many_links(self, store, monkeypatch):
        from aiturbofs.meta import _sql_namespace

        monkeypatch.setattr(_sql_namespace, "LINKS_PER_INODE_MAX", 3)
        f = await store.create(ROOT_INO, b"f0", file_row())
        await store.link(f.ino, ROOT_INO, b"f1")
        await store.link(f.ino, ROOT_INO, b"f2")
        with pytest.raises(err.TooManyLinks):
            await store.link(f.ino, ROOT_INO, b"f3")

    async def test_uses_wal(self, store, tmp_path):
        with sqlite3.connect(tmp_path / "meta.db") as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        conn.close()

    async def test_durable_commits_share_fsyncs(self, store, monkeypatch):
        """64 durable state changes at once: every one returns synced, with far
        fewer fsyncs of the WAL than changes, and none while a commit ran."""
        files = [await store.create(ROOT_INO, f"f{i}".encode(), file_row(state=STATE_STAGED)) for i in range(64)]
        fsyncs = []
        real = store._fsync_wal

        def counted():
            fsyncs.append(store._groups)
            real()

        monkeypatch.setattr(store, "_fsync_wal", counted)
        synced = []

        async def durable(row):
            assert await store.set_state(row.ino, STATE_DURABLE, if_version=row.version)
            synced.append(store._synced_group)

        async with trio.open_nursery() as nursery:
            for row in files:
                nursery.start_soon(durable, row)
        assert all(r.state == STATE_DURABLE for r in [await store.get_inode(f.ino) for f in files])
        assert 1 <= len(fsyncs) <= 8, fsyncs
        assert len(synced) == 64 and min(synced) >= 1

    async def test_durable_write_committing_in_a_thread_gets_an_fsync_after_its_commit(self, store, tmp_path, monkeypatch):
        """A sync() while a durable write still waits (in a thread) for another
        daemon's lock must not count that write as synced: it gets an fsync
        that began after its commit."""
        f = await store.create(ROOT_INO, b"f", file_row(state=STATE_STAGED))
        fsyncs = []
        real = store._fsync_wal

        def counted():
            fsyncs.append(len(fsyncs))
            real()

        monkeypatch.setattr(store, "_fsync_wal", counted)
        other = sqlite3.connect(tmp_path / "meta.db", isolation_level=None, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.set_state, f.ino, STATE_DURABLE)
            await trio.sleep(0.2)  # it waits for the lock in a thread now
            await store.sync()
            other.execute("COMMIT")
        other.close()
        assert (await store.get_inode(f.ino)).state == STATE_DURABLE
        assert len(fsyncs) == 2, fsyncs  # sync()'s, and one after the write's commit

    async def test_write_waits_in_a_thread_while_another_daemon_holds_the_lock(self, store, tmp_path):
        """A write finding the database locked by another connection does not
        block the trio thread: it waits in a thread, and commits once free."""
        other = sqlite3.connect(tmp_path / "meta.db", isolation_level=None, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await trio.sleep(0.01)
                ticks += 1

        made: dict[bytes, object] = {}

        async def create(name: bytes, label: bytes):
            try:
                made[label] = (await store.create(ROOT_INO, name, file_row())).ino
            except err.AiturboError as exc:
                made[label] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            nursery.start_soon(trio.to_thread.run_sync, lambda: (__import__("time").sleep(0.5), other.execute("COMMIT")))
            async with trio.open_nursery() as writers:
                # The first waits in a thread; the rest queue behind it and
                # commit as one group, the duplicate name failing alone.
                for i in range(20):
                    writers.start_soon(create, f"w{i}".encode(), f"w{i}".encode())
                    await trio.sleep(0)
                writers.start_soon(create, b"w7", b"dup")
            nursery.cancel_scope.cancel()
        other.close()
        assert ticks >= 20  # the loop ran on while the writes waited ~0.5 s
        assert isinstance(made.pop(b"dup"), err.Exists)
        for label, ino in made.items():
            assert (await store.lookup(ROOT_INO, label)).ino == ino
        assert store._groups <= 5  # they did commit together


class TestPostgres(MetaConformance):
    @pytest.fixture
    def meta_url(self, pg_server: PgServer):
        return pg_server.new_database()

    @pytest.fixture
    def raw_sql(self, meta_url):
        import psycopg

        def run(sql, *params):
            with psycopg.connect(meta_url, autocommit=True) as conn:
                cursor = conn.execute(sql.replace("?", "%s"), params)
                return cursor.fetchall() if cursor.description else []

        return run

    async def test_inode_numbers_start_after_root(self, store):
        assert (await store.create(ROOT_INO, b"first", file_row())).ino == ROOT_INO + 1

    async def test_a_one_statement_read_is_sent_alone_and_is_a_serializable_transaction(self, store, monkeypatch):
        """An inode, a name or an xattr read takes one round trip where BEGIN, the statement and COMMIT took
        three; the server still runs it at SERIALIZABLE, as its own transaction."""
        from aiturbofs.meta import _postgres

        def probe(tx):  # a transaction begun by BEGIN started before its first statement
            return tuple(tx.one("SELECT current_setting('transaction_isolation'), now() = statement_timestamp()"))

        assert await store._run(probe, write=False) == ("serializable", False)
        monkeypatch.setattr(_postgres, "ONE_STATEMENT_READS", _postgres.ONE_STATEMENT_READS | {probe})
        assert await store._run(probe, write=False) == ("serializable", True)
        assert await store._run(probe, write=True) == ("serializable", False)  # a write never goes alone
        f = await store.create(ROOT_INO, b"f", file_row())
        assert (await store.get_inode(f.ino)).ino == (await store.lookup(ROOT_INO, b"f")).ino == f.ino
        with pytest.raises(err.NotFound):
            await store.lookup(ROOT_INO, b"none")

    async def test_connection_loss_is_transient(self, store, meta_url):
        import psycopg

        f = await store.create(ROOT_INO, b"f", file_row())
        for _ in range(50):  # concurrent calls open more pooled connections
            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(store.get_inode, f.ino)
            if store._pool.get_stats()["pool_available"] >= 2:
                break
        with psycopg.connect(meta_url, autocommit=True) as admin:  # a server restart, in effect
            (killed,) = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchone()
        assert killed >= 2
        with pytest.raises(err.AiturboError) as caught:
            await store.get_inode(f.ino)
        assert type(caught.value) is err.MetaUnavailable and caught.value.errno == errno.EIO
        assert "connection lost" in str(caught.value)
        assert (await store.get_inode(f.ino)).ino == f.ino  # reconnected

    async def test_a_connection_lost_mid_call_is_not_used_again(self, store, meta_url, monkeypatch):
        import psycopg

        from aiturbofs.meta import _sql_inodes

        await store.stats()
        pids: list[int] = []

        def lost_on_first_run(tx):
            (pid,) = tx.one("SELECT pg_backend_pid()")
            pids.append(pid)
            if len(pids) == 1:  # the server drops this session in the middle of the transaction
                with psycopg.connect(meta_url, autocommit=True) as admin:
                    admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
                tx.one("SELECT 1")
            return (0, 0)

        monkeypatch.setattr(_sql_inodes, "stats", lost_on_first_run)  # the body stats() runs
        with pytest.raises(err.MetaUnavailable, match="connection lost"):
            await store.stats()
        for _ in range(5):  # every connection the pool holds, several times
            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(store.stats)
        assert len(pids) == 1 + 5 * 8 and pids[0] not in pids[1:]
        assert store._pool.get_stats()["pool_size"] <= META_PG_CONNECTIONS

    def test_a_restarted_server_is_connected_to_again(self, monkeypatch):
        from aiturbofs.meta import _postgres

        monkeypatch.setattr(_postgres, "META_PG_CONNECT_TIMEOUT_S", 1.0)  # a call's wait while it is down
        with PgServer() as pg:

            async def main():
                store = await open_store(pg.url)
                try:
                    f = await store.create(ROOT_INO, b"f", file_row())
                    pg.kill()
                    with pytest.raises(err.MetaUnavailable, match="connection lost"):
                        await store.get_inode(f.ino)
                    t0 = trio.current_time()
                    with pytest.raises(err.MetaUnavailable, match="cannot connect"):
                        await store.get_inode(f.ino)  # down: the pool cannot hand out a connection
                    assert trio.current_time() - t0 < 1.0 + 0.5
                    pg.start_again()
                    with trio.fail_after(30):
                        while True:  # the pool reconnects within its backoff, or the next call asks again
                            try:
                                assert (await store.get_inode(f.ino)).ino == f.ino
                                break
                            except err.MetaUnavailable:
                                await trio.sleep(0.2)
                    assert (await store.create(ROOT_INO, b"g", file_row())).ino > f.ino
                finally:
                    await store.close()

            trio.run(main)

    async def test_gives_up_after_bounded_conflicts(self, store, monkeypatch):
        import psycopg

        from aiturbofs.meta import _postgres, _sql_inodes

        monkeypatch.setattr(_postgres, "META_PG_TX_ATTEMPTS_MAX", 3)
        runs = []

        def always_conflicts(tx):
            runs.append(1)
            tx.one("SELECT 1")
            raise psycopg.errors.SerializationFailure("simulated")

        with monkeypatch.context() as patch:
            patch.setattr(_sql_inodes, "stats", always_conflicts)  # the body stats() runs
            with pytest.raises(err.AiturboError) as caught:
                await store.stats()
        assert caught.value.errno == errno.EIO and len(runs) == 3
        assert await store.stats() == (1, 0)  # the connection is fine

    async def test_only_conflicts_run_a_transaction_again(self, store, monkeypatch):
        import psycopg

        from aiturbofs.meta import _sql_inodes

        runs = []

        def conflicts_twice(tx):
            runs.append(1)
            tx.one("SELECT 1")
            if len(runs) <= 2:
                raise psycopg.errors.DeadlockDetected("simulated")
            return (7, 0)

        with monkeypatch.context() as patch:
            patch.setattr(_sql_inodes, "stats", conflicts_twice)  # the body stats() runs
            assert await store.stats() == (7, 0) and len(runs) == 3
        runs.clear()

        def bad_sql(tx):
            runs.append(1)
            tx.one("SELECT * FROM no_such_table")

        with monkeypatch.context() as patch:
            patch.setattr(_sql_inodes, "stats", bad_sql)
            with pytest.raises(psycopg.errors.UndefinedTable):  # a bug in our SQL: as it is, at once
                await store.stats()
        assert len(runs) == 1
        assert await store.stats() == (1, 0)

    async def test_directory_locks_are_released(self, store, meta_url):
        import psycopg

        d = await store.create(ROOT_INO, b"d", dir_row())
        await store.create(d.ino, b"f", file_row())
        failing = [
            lambda: store.create(d.ino, b"f", file_row()),  # Exists
            lambda: store.rmdir(ROOT_INO, b"d"),  # NotEmpty
            lambda: store.unlink(d.ino, b"nope"),  # NotFound
            lambda: store.rename(d.ino, b"f", 4242, b"x"),  # NotFound, two locks
        ]
        for call in failing:
            with pytest.raises(err.AiturboError):
                await call()
        await store.rename(d.ino, b"f", ROOT_INO, b"g")
        with psycopg.connect(meta_url, autocommit=True) as admin:
            held = admin.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()[0]
        assert held == 0

    async def test_unreachable_server_is_transient(self):
        store = open_meta(f"postgresql://aiturbo@127.0.0.1:{free_port()}/nowhere")
        with pytest.raises(err.AiturboError) as caught:
            await store.init(root_uid=UID, root_gid=GID, root_mode=0o755)
        assert caught.value.errno == errno.EIO and "cannot connect" in str(caught.value)

    async def test_concurrent_init_and_same_name_creates(self, meta_url):
        stores = [open_meta(meta_url) for _ in range(4)]
        created, existed = [], []

        async def run(s: MetaStore) -> None:
            await s.init(root_uid=UID, root_gid=GID, root_mode=0o755)  # all on an empty database
            for i in range(10):
                try:
                    created.append((await s.create(ROOT_INO, b"n%d" % i, dir_row())).ino)
                except err.Exists:
                    existed.append(i)

        try:
            async with trio.open_nursery() as nursery:
                for s in stores:
                    nursery.start_soon(run, s)
            assert len(created) == 10 and len(existed) == 30 and len(set(created)) == 10
            root = await stores[0].get_inode(ROOT_INO)
            assert root.nlink == 2 + 10  # every winner counted once
            assert await stores[1].stats() == (11, 0)
        finally:
            for s in stores:
                await s.close()


def test_postgres_conflict_backoff_is_full_jitter_within_the_limits():
    pytest.importorskip("psycopg")
    from tenacity import RetryCallState

    from aiturbofs._limits import META_PG_RETRY_BACKOFF_FIRST_S, META_PG_RETRY_BACKOFF_MAX_S, META_PG_TX_ATTEMPTS_MAX

    retries = open_meta("postgresql://h/db")._conflict_retries  # not connected: only its policy is looked at
    for n in range(1, META_PG_TX_ATTEMPTS_MAX):
        state = RetryCallState(retries, fn=None, args=(), kwargs={})
        state.attempt_number = n
        high = min(META_PG_RETRY_BACKOFF_FIRST_S * 2 ** (n - 1), META_PG_RETRY_BACKOFF_MAX_S)
        waits = [retries.wait(state) for _ in range(200)]
        assert all(0 <= w <= high for w in waits) and max(waits) > high / 2, (n, high, max(waits))
        assert not retries.stop(state)
    state.attempt_number = META_PG_TX_ATTEMPTS_MAX
    assert retries.stop(state)


@pytest.mark.parametrize(
    "url",
    [
        "sqlite://relative.db",
        "sqlite:/x.db",
        "mysql://h/db",
        "/plain/path",
        "postgresql://h/%zz",  # malformed
        "postgres://h",  # no database
    ],
)
def test_open_meta_rejects_bad_urls(url):
    with pytest.raises(err.ConfigError):
        open_meta(url)


async def test_the_sqlite_database_is_readable_by_its_owner_only(tmp_path):
    # It names every file, of 0700 directories too: it was created 0644 (and its -wal, -shm with it).
    old = os.umask(0o022)
    try:
        existing = tmp_path / "old.db"
        existing.write_bytes(b"")
        os.chmod(existing, 0o644)  # what an earlier release left
        for path in (tmp_path / "meta.db", existing):
            store = await open_store(f"sqlite://{path}")
            try:
                await store.create(ROOT_INO, b"secret-name", file_row())
                await store.sync()
                for name in (path, f"{path}-wal", f"{path}-shm"):
                    assert os.stat(name).st_mode & 0o777 == 0o600, name
            finally:
                await store.close()
    finally:
        os.umask(old)


def test_a_state_dir_readable_by_others_is_made_private(tmp_path):
    from aiturbofs.node._run import _lock_state_dir

    d = tmp_path / "state"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    fd = _lock_state_dir(str(d))
    try:
        assert os.stat(d).st_mode & 0o777 == 0o700
    finally:
        os.close(fd)
