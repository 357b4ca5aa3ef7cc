"""Names and attributes: lookups, the kernel's references, creation, links, renames and directory listings.

Every change of a name goes to the metadata engine first; the persister
then gives the backend the change (a moved or deleted object, a directory
cleaned up), and a directory the backend may hold more of is imported
before it is looked at (``_importer``).  The attributes answered are the
metadata engine's row, with the size and mtime of a file written here that
the engine does not have yet (``attrs_of``).
"""

import stat

from .._errors import InvalidArgument, NameTooLong, NotFound
from .._limits import NAME_BYTES_MAX, READDIR_BATCH_ENTRIES, SYMLINK_TARGET_BYTES_MAX
from ..backend import Backend
from ..cluster import ClusterPort
from ..meta import ROOT_INO, STATE_STAGED, InodeRow, MetaStore
from ..persist import Persister
from ._content import FileContent
from ._importer import Importer
from ._inodes import Inode, InodeTable
from ._reader import attrs_of
from ._writer import Writer, now_ns


def _check_name(name: bytes) -> None:
    if len(name) > NAME_BYTES_MAX:
        raise NameTooLong(f"name of {len(name)} bytes exceeds {NAME_BYTES_MAX}")
    if not name or b"/" in name or name in (b".", b".."):
        raise InvalidArgument(f"bad name {name!r}")


class Namespace:
    """The names and attributes of the filesystem (see module doc)."""

    def __init__(self, inodes: InodeTable, meta: MetaStore, backend: Backend, importer: Importer,
                 persister: Persister, writer: Writer, cluster: ClusterPort):
        self._inodes = inodes
        self._meta = meta
        self._backend = backend
        self._importer = importer
        self._persister = persister
        self._writer = writer
        self._cluster = cluster

    async def refresh(self, node: Inode) -> InodeRow:
        """Re-read the row from the metadata engine (close-to-open).

        A row older than the one held (a commit landed while it was read)
        is not taken: it would turn a just-committed file back into its
        previous, durable version, and sync_close would return at once.
        """
        row = await self._meta.get_inode(node.ino)
        if row.version < node.row.version:
            return node.row
        if node.live:
            row.size = node.file.size
            row.mtime_ns = node.row.mtime_ns
        node.row = row
        return row

    async def getattr(self, ino: int) -> InodeRow:
        node = self._inodes.get(ino)
        if node is not None:
            if node.live:
                return attrs_of(node)
            return await self.refresh(node)
        return await self._meta.get_inode(ino)

    async def lookup(self, parent: int, name: bytes) -> InodeRow:
        """Resolve ``name`` in ``parent`` and count a kernel reference."""
        if len(name) > NAME_BYTES_MAX:
            raise NameTooLong(f"name of {len(name)} bytes exceeds {NAME_BYTES_MAX}")
        if name == b".":
            row = await self.getattr(parent)
        elif name == b"..":
            raise NotFound("'..' is resolved by the kernel")
        else:
            await self._importer.refresh(parent)
            row = await self._meta.lookup(parent, name)
        node = self._inodes.remember(row)
        node.lookups += 1
        return attrs_of(node)

    async def forget(self, ino: int, count: int) -> None:
        node = self._inodes.get(ino)
        if node is None:
            return
        node.lookups = max(0, node.lookups - count)
        await self._writer.release_unused(node)

    def _creation_ids(self, parent_row: InodeRow, uid: int, gid: int, mode: int) -> tuple[int, int]:
        if parent_row.mode & stat.S_ISGID:
            gid = parent_row.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        return gid, mode

    async def _check_path_bytes(self, parent: int, name: bytes) -> None:
        """``NameTooLong`` if ``parent/name`` is longer than a backend key may be.

        A local filesystem refuses such a path at once (ENAMETOOLONG); accepted,
        it would be marked broken at persist, when the backend refuses the key.
        """
        parent_path = await self._inodes.path(parent)
        above = len(parent_path.encode("utf-8", "surrogateescape")) + 1 if parent_path else 0
        if above + len(name) > self._backend.key_bytes_max:
            raise NameTooLong(f"path of {above + len(name)} bytes exceeds the {self._backend.key_bytes_max} "
                              "the backend can name")

    async def _create(self, parent: int, name: bytes, mode: int, uid: int, gid: int, *, rdev: int = 0, target: bytes | None = None) -> Inode:
        _check_name(name)
        await self._check_path_bytes(parent, name)
        parent_row = await self._meta.get_inode(parent)
        await self._importer.refresh(parent, parent_row)
        gid, mode = self._creation_ids(parent_row, uid, gid, mode)
        now = now_ns()
        is_reg = stat.S_ISREG(mode)
        # Other nodes get a state too where the backend can hold them: the
        # persister writes them there (see docs/design.md, "What the backend holds").
        kept = is_reg or stat.S_IFMT(mode) in self._backend.node_kinds
        row = InodeRow(
            ino=0, mode=mode, uid=uid, gid=gid, size=len(target) if target else 0,
            nlink=1, atime_ns=now, mtime_ns=now, ctime_ns=now, rdev=rdev, target=target,
            state=STATE_STAGED if kept else None, backend_keys=[],
            # a node persists from its row alone: its creator writes it (a file's commit names its owner)
            owner=self._cluster.owner if kept and not is_reg else None,
        )
        row = await self._meta.create(parent, name, row)
        node = self._inodes.remember(row)
        node.lookups += 1
        if is_reg:
            node.content = FileContent(0)
            node.content.seq = 1  # a new file is dirty until its (empty) manifest commits
            parent_node = self._inodes.get(parent)
            if parent_node is not None and not self._cluster.shared:
                # Its tags are its directory's, which the create copied: known here, not read back at its
                # first commit (a listxattr per small file).  Not in a cluster: another node may have
                # tagged the directory since this one read its tags.
                node.tags = dict(await self._inodes.tags(parent_node))
        return node

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> InodeRow:
        node = await self._create(parent, name, mode, uid, gid, rdev=rdev)
        if stat.S_ISREG(mode):
            await self._writer.commit(node)
        else:
            self._persist_node(node)
        return attrs_of(node)

    def _persist_node(self, node: Inode) -> None:
        """A new symlink, directory or special file: to the backend, if it keeps them."""
        if node.row.state is not None:
            self._persister.enqueue(node.ino)

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> InodeRow:
        node = await self._create(parent, name, stat.S_IFDIR | (mode & 0o7777), uid, gid)
        node.row.imported_ns = now_ns()  # nothing in the backend below a new dir
        await self._meta.set_attrs(node.ino, imported_ns=node.row.imported_ns)
        self._importer.note_imported(node.ino, node.row.imported_ns)
        self._persist_node(node)
        return attrs_of(node)

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> InodeRow:
        if len(target) > SYMLINK_TARGET_BYTES_MAX:
            raise NameTooLong(f"symlink target of {len(target)} bytes exceeds {SYMLINK_TARGET_BYTES_MAX}")
        node = await self._create(parent, name, stat.S_IFLNK | 0o777, uid, gid, target=target)
        self._persist_node(node)
        return attrs_of(node)

    async def readlink(self, ino: int) -> bytes:
        row = await self.getattr(ino)
        if not stat.S_ISLNK(row.mode):
            raise InvalidArgument("not a symlink")
        return row.target or b""

    async def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        """A new regular file, its content empty and dirty until its (empty) manifest commits."""
        return await self._create(parent, name, stat.S_IFREG | (mode & 0o7777), uid, gid)

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> InodeRow:
        _check_name(new_name)
        await self._check_path_bytes(new_parent, new_name)
        row = await self._meta.link(ino, new_parent, new_name)
        node = self._inodes.remember(row)
        # _remember keeps the row of a file open for writing: count the link there too
        node.row.nlink = row.nlink
        node.row.ctime_ns = row.ctime_ns
        node.lookups += 1
        if row.state is not None:
            self._persister.enqueue(ino, moved=True)  # the backend gets a copy at the new path
        return attrs_of(node)

    async def unlink(self, parent: int, name: bytes) -> None:
        row = await self._meta.unlink(parent, name)
        node = self._inodes.get(row.ino)
        if node is not None:
            node.row.nlink = row.nlink
            node.row.ctime_ns = row.ctime_ns
            await self._writer.release_unused(node)
        if row.nlink > 0 or node is None or self._inodes.is_open(row.ino):
            # (still open: its objects move aside, readable through its descriptors, freeing its name)
            self._persister.enqueue(row.ino, moved=True)

    async def rmdir(self, parent: int, name: bytes) -> None:
        await self._importer.refresh_named(parent, name)
        parent_paths = await self._meta.paths_of(parent) if parent != ROOT_INO else [""]
        row = await self._meta.rmdir(parent, name)
        node = self._inodes.get(row.ino)
        if node is not None:
            node.row.nlink = 0
        if parent_paths:
            n = name.decode("utf-8", "surrogateescape")
            self._persister.enqueue_dir_cleanup(f"{parent_paths[0]}/{n}" if parent_paths[0] else n)

    async def rename(self, parent: int, name: bytes, new_parent: int, new_name: bytes, *, noreplace: bool, exchange: bool) -> None:
        _check_name(new_name)
        await self._check_path_bytes(new_parent, new_name)
        await self._importer.refresh(new_parent)
        moved = await self._meta.lookup(parent, name)
        other = None if noreplace else await self._lookup_or_none(new_parent, new_name)
        for row in (moved, other):
            if row is not None and stat.S_ISDIR(row.mode):
                await self._importer.refresh_tree(row.ino)  # what only the backend has below it moves too
        old_path = None  # a moved directory's backend path, cleaned up once its files moved out
        if stat.S_ISDIR(moved.mode) and not exchange:
            above = await self._meta.paths_of(parent)
            if above:
                n = name.decode("utf-8", "surrogateescape")
                old_path = f"{above[0]}/{n}" if above[0] else n
        replaced = await self._meta.rename(parent, name, new_parent, new_name, noreplace=noreplace, exchange=exchange)
        for row in (moved, other):
            if row is None:
                continue
            if stat.S_ISDIR(row.mode):
                if replaced is not None and replaced.ino == row.ino:
                    continue  # a replaced empty directory: deleted, nothing below it
                if row.state is not None:
                    self._persister.enqueue(row.ino, moved=True)  # its own backend form moves too
                await self._persister.enqueue_tree(row.ino, old_path if row is moved else None)
            else:
                self._persister.enqueue(row.ino, moved=True)
        if replaced is not None and not exchange:
            node = self._inodes.get(replaced.ino)
            if node is not None:
                node.row.nlink = replaced.nlink
                await self._writer.release_unused(node)
                if self._inodes.is_open(replaced.ino):
                    self._persister.enqueue(replaced.ino, moved=True)  # see unlink
            else:
                self._persister.enqueue(replaced.ino, moved=True)

    async def _lookup_or_none(self, parent: int, name: bytes) -> InodeRow | None:
        try:
            return await self._meta.lookup(parent, name)
        except NotFound:
            return None

    async def readdir(self, ino: int, offset: int) -> list[tuple[bytes, InodeRow, int]]:
        """Entries after ``offset`` (a token from a previous batch)."""
        if offset == 0:
            await self._importer.refresh(ino)
        entries = await self._meta.readdir(ino, offset, READDIR_BATCH_ENTRIES)
        out = []
        for name, row, token in entries:
            node = self._inodes.get(row.ino)
            out.append((name, attrs_of(node) if node is not None else row, token))
        return out

    async def dots(self, ino: int) -> list[tuple[bytes, InodeRow]]:
        """A directory's ``.`` and ``..`` entries (readdir lists them first; the kernel takes no reference)."""
        here = await self.getattr(ino)
        parent = await self._meta.parent_of(ino)
        return [(b".", here), (b"..", here if parent == ino else await self.getattr(parent))]

    def note_lookup(self, row: InodeRow) -> None:
        """readdirplus handed the kernel a reference to ``row``'s inode."""
        self._inodes.remember(row).lookups += 1

    async def statfs(self) -> tuple[int, int]:
        return await self._meta.stats()
