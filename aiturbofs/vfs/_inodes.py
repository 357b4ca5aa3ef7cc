"""The inode and handle table: what this node holds in memory of the inodes the kernel knows.

An ``Inode`` is held while the kernel has a reference to it (lookups), a
handle is open on it, or its content is staged; a ``Handle`` is one open.
The table also keeps the watchers of durability states and the
inode's ``user.aiturbo.*`` tags, read once from the metadata engine.  It
makes no decision about bytes: the writer and the reader do, over the
inodes it hands them.
"""

import os
import stat

from ..meta import InodeRow, MetaStore
from . import _xattr
from ._content import FileContent, VersionPins
from ._state_waits import StateWaits


class Inode:
    """What the daemon holds in memory for an inode the kernel knows."""

    __slots__ = ("ino", "row", "lookups", "opens", "served", "writers", "content", "cached_version", "tags", "pins")

    def __init__(self, row: InodeRow):
        self.ino = row.ino
        self.row = row
        self.lookups = 0
        self.opens = 0
        self.served = 0  # of the opens, those served through requests (not by the kernel) and not being released
        self.writers = 0  # of the opens, those whose close commits: while any is open this node keeps its own view
        self.content: FileContent | None = None
        self.cached_version = -1  # version whose pages the kernel may hold
        self.tags: dict[bytes, bytes] | None = None  # user.aiturbo.* cache
        # The pins of committed versions not yet durable (see VersionPins), oldest first.
        self.pins: list[VersionPins] = []

    @property
    def file(self) -> FileContent:
        """The content of a file whose content is loaded (it is open, or being written)."""
        assert self.content is not None, f"inode {self.ino} has no content loaded"
        return self.content

    @property
    def live(self) -> bool:
        """Size and mtime in ``row`` are ahead of the metadata engine's."""
        return self.content is not None and (self.content.dirty or self.opens > 0)


def without_suidgid(mode: int) -> int:
    """``mode`` as a write or truncate by a caller without CAP_FSETID (or any chown) leaves it:
    set-user-ID goes, and set-group-ID where the group may execute (the rule <linux/fuse.h> gives
    for HANDLE_KILLPRIV_V2).  Local filesystems on current kernels also drop set-group-ID without
    group execute when the caller is not in the file's group: the daemon is not told the
    caller's groups, so that one stays."""
    mode &= ~stat.S_ISUID
    if mode & stat.S_IXGRP:
        mode &= ~stat.S_ISGID
    return mode


class Handle:
    __slots__ = ("fh", "inode", "flags", "writable", "commits", "next_offset", "kernel")

    def __init__(self, fh: int, inode: Inode, flags: int, *, created: bool = False):
        self.fh = fh
        self.inode = inode
        self.flags = flags
        self.writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        # Its close() commits the file: a writer's, or the one that created the
        # file (open(O_CREAT|O_RDONLY) makes an empty file that must persist too).
        self.commits = self.writable or created
        self.next_offset = 0  # where a sequential reader reads next (read-ahead)
        self.kernel = False  # served by the kernel from the backing file (FUSE passthrough: _kernel_io)


class InodeTable:
    """Inodes by number, handles by ``fh``, and the watchers of durability states."""

    def __init__(self, meta: MetaStore):
        self._meta = meta
        self._inodes: dict[int, Inode] = {}
        self._handles: dict[int, Handle] = {}
        self._next_fh = 1
        self.state_waits = StateWaits()  # fsync, sync_close and the control socket's ``wait`` watch it

    # ---------------------------------------------------------------- inodes
    def get(self, ino: int) -> Inode | None:
        return self._inodes.get(ino)

    def __contains__(self, ino: int) -> bool:
        return ino in self._inodes

    async def load(self, ino: int) -> Inode:
        """The in-memory inode, loading its row if needed."""
        node = self._inodes.get(ino)
        if node is None:
            node = Inode(await self._meta.get_inode(ino))
            self._inodes[ino] = node
        return node

    def remember(self, row: InodeRow) -> Inode:
        """The inode of ``row``, held from now on; a held inode takes the row unless its own is ahead."""
        node = self._inodes.get(row.ino)
        if node is None:
            node = self._inodes[row.ino] = Inode(row)
        elif not node.live:
            node.row = row
        return node

    def inode_of(self, row: InodeRow) -> Inode:
        """The inode of ``row``, held from now on; a held inode keeps its own row."""
        node = self._inodes.get(row.ino)
        if node is None:
            node = self._inodes[row.ino] = Inode(row)
        return node

    def forget(self, ino: int) -> None:
        del self._inodes[ino]

    def is_open(self, ino: int) -> bool:
        node = self._inodes.get(ino)
        return node is not None and node.opens > 0

    def unlinked_keys(self) -> set[str]:
        """Backend keys of unlinked inodes still open or known to the kernel (the importer must not revive them)."""
        return {k for node in list(self._inodes.values()) if node.row.nlink == 0 for k in node.row.backend_keys}

    # --------------------------------------------------------------- handles
    def open_handle(self, node: Inode, flags: int, *, created: bool = False) -> Handle:
        fh = self._next_fh
        self._next_fh += 1
        handle = self._handles[fh] = Handle(fh, node, flags, created=created)
        node.opens += 1
        node.served += 1
        if handle.commits:
            node.writers += 1
        return handle

    def handle(self, fh: int) -> Handle:
        return self._handles[fh]

    def close_handle(self, fh: int) -> Handle:
        """The handle leaves the table (its inode still counts it open until the release is done)."""
        return self._handles.pop(fh)

    def handles(self) -> list[Handle]:
        return list(self._handles.values())

    def kernel_written(self) -> list[Inode]:
        """The files open for the kernel to write (FUSE passthrough)."""
        return [h.inode for h in self._handles.values() if h.kernel and h.writable]

    # ------------------------------------------------------------------ tags
    async def tags(self, node: Inode) -> dict[bytes, bytes]:
        """The inode's ``user.aiturbo.*`` xattrs (read once; ``setxattr`` and ``removexattr`` forget them)."""
        if node.tags is None:
            tags = {}
            for name in await self._meta.listxattr(node.ino):
                if name.startswith(_xattr.PREFIX):
                    tags[name] = await self._meta.getxattr(node.ino, name)
            node.tags = tags
        return node.tags

    async def grouping(self, node: Inode) -> tuple[str | None, int | None]:
        """The file's group tag and group size (``None`` where not set)."""
        tags = await self.tags(node)
        group, size = tags.get(_xattr.GROUP), tags.get(_xattr.GROUP_SIZE)
        return (group.decode() if group else None), (int(size) if size else None)

    async def path(self, ino: int) -> str:
        """One path of ``ino`` (its first link), for reports and logs."""
        paths = await self._meta.paths_of(ino)
        return paths[0] if paths else ""

    # ---------------------------------------------------------------- states
    def notify_state(self, ino: int) -> None:
        """``ino``'s state changed: tell its watchers."""
        self.state_waits.notify(ino)
