"""The VFS's side of the cluster port: what peers and the controller's plans ask of this node."""

from ..cluster import LocalSide


class VfsLocalSide(LocalSide):
    """``LocalSide`` over a Filesystem: its reader's tiers and its persister."""

    def __init__(self, fs):
        self._fs = fs

    async def read_chunk(self, ino: int, index: int, key: bytes, length: int) -> bytes:
        return await self._fs.read_chunk(ino, index, key, length)

    def content_key(self, name: bytes) -> bytes | None:
        return self._fs.store.content_key(name)

    async def upload_for_peer(self, backend_key: str, token: str, index: int, key: bytes, length: int, holders: list[str]) -> str:
        return await self._fs.persister.upload_for_peer(backend_key, token, index, key, length, holders)

    async def take_over(self, dead: set[str]) -> None:
        await self._fs.persister.take_over(dead)

    def persist_summary(self) -> dict:
        p = self._fs.persister
        return {"queue": p.queue_length(), "durable": p.stats.files_durable, "broken": p.stats.files_broken,
                "uploaded": p.stats.bytes_uploaded}
