"""The port between the VFS and the cluster data plane, and its single-node side.

The VFS holds one ``ClusterPort`` and calls it at these points, whether or
not there is a cluster:

- ``stage`` at commit, before ``close()`` returns (future 0): place the
  file's chunks in the pools of ``replicas`` nodes (for grouped files as the
  controller's round plan says) and learn who holds them and how the persist
  is to be split; ``committed`` once the version is recorded;
- ``fetch`` when a chunk is in no local tier: ask the nodes that hold it;
- ``upload_part`` when the plan gives a part of an upload to another node;
- ``start_read`` when a grouped file is opened for reading (the read round:
  each chunk fetched from storage by one node, passed along a chain), and
  ``round_fetch`` when a chunk of such a file is missing locally.

``SingleNode`` is the port of a node alone: nothing to replicate, no peer
to ask, every file its own.  ``ClusterNode`` (``_node``) is the port of a
cluster member.  What the cluster asks of the VFS in turn (a chunk for a
chain successor, a part of another node's upload, a dead node's files) is
``LocalSide``, which the VFS implements.

The VFS and the controller never import each other: they meet here, in
plain values.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class StageRequest:
    ino: int
    path: str
    size: int
    manifest: bytes
    group: str | None
    group_size: int | None


@dataclass(frozen=True)
class ReadRequest:
    ino: int
    version: int
    path: str
    size: int
    manifest: bytes  # the chunks' keys; an object imported without a manifest: their names (``vfs._objects``)
    group: str
    group_size: int | None
    auto: bool = False  # an untagged file (-o autogroup): a round of the nodes opening it within a window


@dataclass(frozen=True)
class CloseReport:
    """A committed version of a grouped file, as a single node's control plane counts it."""

    ino: int
    path: str
    version: int
    size: int
    manifest: bytes
    group: str | None
    group_size: int | None


CloseReporter = Callable[[CloseReport], Awaitable[None]]


@dataclass(frozen=True)
class CopySource:
    """Where the bytes of a chunk already are in the backend."""

    backend_key: str
    offset: int
    length: int
    etag: str | None


@dataclass
class PersistHints:
    """How the round plan splits one file's upload (indices are chunk positions)."""

    persist: dict[int, str] = field(default_factory=dict)  # part -> node that uploads its bytes
    copy: dict[int, CopySource] = field(default_factory=dict)  # part -> durable copy (server-side copy)
    wait: set[int] = field(default_factory=set)  # another file of the round uploads these bytes


@dataclass(frozen=True)
class Staged:
    """Where a committed version's chunks are: ``holders`` (this node first; empty alone)."""

    holders: list[str]
    hints: PersistHints | None = None


class ClusterPort(Protocol):
    @property
    def owner(self) -> str | None:
        """The owner recorded for this node's commits; None on a single node (its rows name none)."""

    @property
    def shared(self) -> bool:
        """Other nodes share the metadata and backend.

        A file's state may then change elsewhere (a takeover), another node may
        commit a newer version, and durable chunks are recorded as server-side
        copy sources for later rounds.
        """

    async def stage(self, request: StageRequest) -> Staged:
        """Replicate (and, for grouped files, plan) before close() returns."""

    async def committed(self, request: StageRequest, version: int) -> None:
        """``request``'s file is now committed as ``version``."""

    async def fetch(self, key: bytes, holders: list[str]) -> bytes | None:
        """The verified bytes of chunk ``key`` from one of ``holders``, or None."""

    async def upload_part(self, node: str, backend_key: str, token: str, index: int, key: bytes, length: int, holders: list[str]) -> str:
        """Have ``node`` upload part ``index`` (chunk ``key``); returns its receipt."""

    def start_read(self, request: ReadRequest) -> None:
        """Join the group's read round for this file (in the background)."""

    async def round_fetch(self, ino: int, key: bytes) -> bytes | None:
        """Chunk ``key`` of ``ino`` through its read round's chain, or None (no round covers it)."""

    async def round_fetch_named(self, ino: int, name: bytes) -> tuple[bytes, bytes] | None:
        """``(digest, bytes)`` of the chunk named ``name`` through its read round's chain, or None."""

    def dead_nodes(self) -> set[str]:
        """Nodes the controller declared dead (their staged files need a new owner)."""


class LocalSide(Protocol):
    """What the cluster data plane asks of this node's VFS."""

    async def read_chunk(self, ino: int, index: int, key: bytes, length: int) -> bytes:
        """Chunk ``index`` of ``ino`` as a reader gets it: from the pool, else through the reader's tiers,
        kept in the file's backing file (a read round's prefetch; a chain successor waiting for it)."""

    def content_key(self, name: bytes) -> bytes | None:
        """The BLAKE3 digest of the bytes of the chunk named ``name``, if this node read it."""

    async def upload_for_peer(self, backend_key: str, token: str, index: int, key: bytes, length: int, holders: list[str]) -> str:
        """Send part ``index`` of another node's upload; returns its receipt."""

    async def take_over(self, dead: set[str]) -> None:
        """Persist the staged files of ``dead`` nodes whose first live replica is here."""

    def persist_summary(self) -> dict:
        """queue, durable, broken, uploaded: this node's persister in a heartbeat."""


class SingleNode:
    """The port of a node alone: its pool is the only DRAM copy, and every file is its own."""

    owner: str | None = None
    shared: bool = False

    def __init__(self, reporter: CloseReporter | None = None):
        self._reporter = reporter  # the embedded control plane: it counts grouped closes

    async def stage(self, request: StageRequest) -> Staged:
        return Staged(holders=[])

    async def committed(self, request: StageRequest, version: int) -> None:
        if self._reporter is None or request.group is None:
            return  # ungrouped files need no control-plane round
        await self._reporter(CloseReport(
            ino=request.ino, path=request.path, version=version, size=request.size,
            manifest=request.manifest, group=request.group, group_size=request.group_size,
        ))

    async def fetch(self, key: bytes, holders: list[str]) -> bytes | None:
        return None  # no peer holds anything

    async def upload_part(self, node: str, backend_key: str, token: str, index: int, key: bytes, length: int, holders: list[str]) -> str:
        raise AssertionError("a single node has no round plan that gives parts to other nodes")

    def start_read(self, request: ReadRequest) -> None:
        pass  # no other reader to share the fetches with

    async def round_fetch(self, ino: int, key: bytes) -> bytes | None:
        return None

    async def round_fetch_named(self, ino: int, name: bytes) -> tuple[bytes, bytes] | None:
        return None

    def dead_nodes(self) -> set[str]:
        return set()
