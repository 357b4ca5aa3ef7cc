"""What the VFS asks of the cluster (implemented by the node layer).

On a single node ``Filesystem.cluster`` is None and none of this runs.  In a
cluster, the VFS calls the port at three points:

- ``stage`` at commit, before ``close()`` returns (future 0): place the
  file's chunks in the pools of ``replicas`` nodes (for grouped files as the
  controller's round plan says) and learn who holds them and how the persist
  is to be split;
- ``fetch`` when a chunk is in no local tier: ask the nodes that hold it;
- ``upload_part`` when the plan gives a part of an upload to another node;
- ``start_read`` when a grouped file is opened for reading (the read round:
  each chunk fetched from storage by one node, passed along a chain), and
  ``round_fetch`` when a chunk of such a file is missing locally.

The VFS and the controller never import each other: they meet here, in
plain values.
"""

from __future__ import annotations

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
    manifest: bytes
    group: str
    group_size: int | None


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
    """Where a committed version's chunks are: ``holders`` (this node first)."""

    holders: list[str]
    hints: PersistHints | None = None


class ClusterPort(Protocol):
    node: str  # this node's name: the owner recorded for its commits

    async def stage(self, request: StageRequest) -> Staged:
        """Replicate (and, for grouped files, plan) before close() returns."""

    async def fetch(self, key: bytes, holders: list[str]) -> bytes | None:
        """The verified bytes of chunk ``key`` from one of ``holders``, or None."""

    async def upload_part(self, node: str, backend_key: str, token: str, index: int, key: bytes, length: int, holders: list[str]) -> str:
        """Have ``node`` upload part ``index`` (chunk ``key``); returns its receipt."""

    def start_read(self, request: ReadRequest) -> None:
        """Join the group's read round for this file (in the background)."""

    async def round_fetch(self, ino: int, key: bytes) -> bytes | None:
        """Chunk ``key`` of ``ino`` through its read round's chain, or None (no round covers it)."""

    def dead_nodes(self) -> set[str]:
        """Nodes the controller declared dead (their staged files need a new owner)."""
