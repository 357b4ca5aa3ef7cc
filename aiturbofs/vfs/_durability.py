"""Future 1 as the filesystem sees it: durability states, the persister's news, recovery and repair.

The persister (below) makes versions durable; this is what the filesystem
does about it: the state ``user.aiturbo.state`` shows, the pins a durable
or broken version lets go, the waits of ``fsync`` and ``-o sync_close``,
the pins of files recovered after a restart, and ``aiturbo verify
--repair`` staging a durable file again from copies held here.
"""

import logging
import stat

import trio

from .. import chunk
from .._errors import BrokenFile, NoAttribute, NotFound
from .._limits import CLUSTER_STATE_POLL_S
from ..cluster import ClusterPort
from ..meta import STATE_BROKEN, STATE_DURABLE, STATE_PERSISTING, STATE_STAGED, InodeRow, MetaStore
from ..persist import Persister
from ..staging import BackingFile, Pins, StagingPool
from ._content import FileContent, VersionPins, punch
from ._inodes import InodeTable
from ._writer import Writer

log = logging.getLogger(__name__)


class Durability:
    """Durability states and what follows from them (see module doc)."""

    def __init__(self, inodes: InodeTable, meta: MetaStore, pool: StagingPool, persister: Persister, writer: Writer,
                 cluster: ClusterPort):
        self._inodes = inodes
        self._meta = meta
        self._pool = pool
        self._persister = persister
        self._writer = writer
        self._cluster = cluster

    async def shown(self, row: InodeRow, inputs: list[int] | None = None) -> str:
        """``user.aiturbo.state`` of the inode whose attributes are ``row``.  ``inputs``: a directory's
        symlinks and special files as ``state_inputs`` listed them (beyond itself), read again instead of
        listing the directory again (see ``dir_state``)."""
        if stat.S_ISDIR(row.mode):
            return await self.dir_state(row, inputs)
        if row.state is None:
            raise NoAttribute("only regular files have a durability state")
        node = self._inodes.get(row.ino)
        if node is not None and node.content is not None and node.content.dirty:
            return STATE_STAGED
        return self.state(row)

    async def dir_state(self, row: InodeRow, inputs: list[int] | None = None) -> str:
        """A directory's durability state: that of its own backend form and of
        the symlinks and special files in it, which Linux lets carry no user.*
        xattr (so ``aiturbo wait`` asks their directory).  The worst one wins.

        ``inputs``: those symlinks and special files as listed before, each
        read again (one gone since is left out; one made since is not seen).
        A wait reads a directory again at every change of its state, and the
        persister changes it at every file it publishes in it (the mtime):
        listing it each time made waiting on a directory of n files cost n^2.
        """
        children = await self._meta.nodes_with_state(row.ino) if inputs is None else await self._rows(inputs)
        states = set() if row.state is None else {self.state(row)}
        states.update(self.state(child) for child in children)
        for state in (STATE_BROKEN, STATE_STAGED, STATE_PERSISTING, STATE_DURABLE):
            if state in states:
                return state
        raise NoAttribute("this directory and its symlinks and special files live in the metadata only")

    async def _rows(self, inos: list[int]) -> list[InodeRow]:
        """The rows of ``inos`` that still have a name and a state."""
        rows = []
        for ino in inos:
            try:
                row = await self._meta.get_inode(ino)
            except NotFound:
                continue
            if row.nlink > 0 and row.state is not None:
                rows.append(row)
        return rows

    async def state_inputs(self, row: InodeRow) -> list[int]:
        """The inodes whose durability states make up ``row``'s (``user.aiturbo.state``): its own and, for a
        directory, those of its symlinks and special files.  A watcher of its state watches them all."""
        if not stat.S_ISDIR(row.mode):
            return [row.ino]
        return [row.ino] + [child.ino for child in await self._meta.nodes_with_state(row.ino)]

    def state(self, row: InodeRow) -> str:
        """``row``'s state as ``user.aiturbo.state`` shows it: a durable inode
        whose mode, owner or mtime the backend still lacks is ``persisting``,
        and is queued (it may not be: a crash, a directory whose entries
        changed), so asking is enough for it to get there."""
        if self._persister.attrs_pending(row):
            self._persister.enqueue(row.ino)
            return STATE_PERSISTING
        assert row.state is not None  # callers ask only about inodes the backend keeps
        return row.state

    async def on_persisted(self, ino: int, row: InodeRow) -> None:
        """The persister made version ``row.version`` durable (or broken), or
        gave its objects new attributes."""
        node = self._inodes.get(ino)
        if node is not None:
            if not node.live:
                node.row = row
            else:
                node.row.state = row.state
                node.row.version = row.version
                node.row.backend_keys = row.backend_keys
                node.row.persisted_version = row.persisted_version
                node.row.persisted_attrs = row.persisted_attrs
                node.row.backend_etag = row.backend_etag  # a new mtime gives a file:// object a new etag
            content = node.content
            if row.state in (STATE_DURABLE, STATE_BROKEN):
                self._writer.release_pins(node, row.version)
            if row.state == STATE_BROKEN and content is not None and not content.dirty:
                content.broken = True
            await self._writer.release_unused(node)
        self._inodes.notify_state(ino)

    def adopt_recovered(self, row: InodeRow, pinned: set[int], backings: list[BackingFile]) -> None:
        """After a restart: hold the pins of a staged file recovered from its backing file or spill.

        ``pinned``: the chunk indexes recovery pinned; ``backings``: the
        backing files the previous run left for it (two after a crash while
        it moved to disk: the one recovery took more chunks from is its own).
        """
        node = self._inodes.inode_of(row)
        content = FileContent.from_manifest(row.size, row.manifest)
        # Recovery pinned exactly the chunks it found.  The others are
        # unchanged since the last durable version (or lost): they hold no pin.
        keys = chunk.unpack_manifest(row.manifest or b"")
        node.pins.append(VersionPins(row.version, Pins(self._pool, [keys[i] for i in sorted(pinned)])))
        for backing in backings:
            # What recovery did not take from the file's backing files is not the file's: bytes a
            # passthrough writer left there after its last close (never committed), or a chunk now kept
            # elsewhere.  Read through the kernel they would be served; they go.
            for index in range(chunk.chunk_count(backing.size)):
                rng = backing.range(index)
                if rng.entry is None:
                    punch(rng)
        if backings:
            backing = max(backings, key=lambda b: sum(r.entry is not None for r in b.ranges()))
            content.backing = backing
            backing.users += 1
        node.content = content

    async def restage(self, ino: int) -> dict:
        """``aiturbo verify --repair``: upload durable ``ino`` again from copies of its chunks held here.

        Every chunk of the manifest must be in this node's DRAM, its spill
        store or a holder's pool: each is pinned (a peer's copy is stored
        here first), the file goes back to staged and the persister uploads
        it like any commit.  The backend is never a source: its object is
        what is being repaired.  Answers ``missing``: the chunk indexes with
        no copy (then nothing changes), or ``changed`` if a newer version
        was committed meanwhile (it is persisted anyway).
        """
        try:
            row = await self._meta.get_inode(ino)
        except NotFound:
            return {"ok": True, "missing": [], "changed": True, "state": "gone"}
        if row.state != STATE_DURABLE:
            return {"ok": True, "missing": [], "changed": True, "state": row.state}
        if row.manifest is None:  # imported, never read whole: no hash says which bytes are right
            return {"ok": True, "missing": list(range(chunk.chunk_count(row.size))), "changed": False,
                    "state": row.state}
        keys = chunk.unpack_manifest(row.manifest)[: chunk.chunk_count(row.size)]
        pins, missing = Pins(self._pool), []
        others = [h for h in row.holders if h != self._cluster.owner]
        for index, key in enumerate(keys):
            if key == chunk.HOLE:
                continue
            if self._pool.has(key):
                pins.add(key)
            elif self._pool.recover_spilled(key):  # pinned by that call
                pins.keys.append(key)
            elif others and (data := await self._cluster.fetch(key, others)) is not None:
                await self._pool.store(key, data)  # verified by the fabric; pinned by that call
                pins.keys.append(key)
            else:
                missing.append(index)
        if missing or not await self._meta.set_state(ino, STATE_STAGED, if_version=row.version):
            pins.release()
            return {"ok": True, "missing": missing, "changed": not missing, "state": row.state}
        node = self._inodes.inode_of(row)
        node.pins.append(VersionPins(row.version, pins))
        node.row.state = STATE_STAGED
        log.warning("verify: re-uploading %s (inode %d) from the copies of its %d chunk(s) held here",
                    (await self._meta.paths_of(ino) or ["?"])[0], ino, len(pins.keys))
        self._persister.enqueue(ino)
        return {"ok": True, "missing": [], "changed": False, "state": STATE_STAGED}

    async def wait_durable(self, ino: int) -> None:
        """Block until the committed version of ``ino`` is durable (future 1)."""
        with self._inodes.state_waits.watch(ino) as changes:  # before the state is read: no change goes unseen
            while True:
                row = await self._meta.get_inode(ino)
                if row.state == STATE_BROKEN:
                    raise BrokenFile(f"inode {ino} is broken")
                if row.nlink == 0:
                    return
                if row.state == STATE_DURABLE and row.persisted_version == row.version and self.state(row) == STATE_DURABLE:
                    return
                if not self._cluster.shared:
                    await changes.wait()
                else:
                    # another node may persist it (a takeover): its progress is
                    # seen in the shared metadata only
                    with trio.move_on_after(CLUSTER_STATE_POLL_S):
                        await changes.wait()
