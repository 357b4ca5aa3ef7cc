"""``aiturbo verify``: a scrub of durable files' backend objects against their manifests.

For a durable regular file, each of its names in the backend must be an
object of the file's size whose every chunk hashes (BLAKE3, as the manifest
records it) to the manifest's key.  The CLI asks for a file a few chunks at a
time (``VERIFY_CHUNKS_PER_CALL``), so one request never outlives the control
socket's timeout and the progress bar moves; the daemon reads through the
reader's retries (``ChunkStore.read_range``).  An object imported from the
backend and never read whole has no manifest: its size is checked, its
chunks cannot be.
"""

from __future__ import annotations

import logging
import stat

import trio

from .. import chunk
from .._errors import BackendError, NotFound
from ..backend import ObjectInfo
from ..meta import STATE_DURABLE
from ._host import PersistHost

log = logging.getLogger("aiturbofs.persist")


async def holds_version(host: PersistHost, key: str, row) -> ObjectInfo | None:
    """The object at ``key`` if its bytes are exactly ``row``'s version (its size, and every chunk
    hashes to the manifest; without a manifest, its etag is the row's), else None."""
    info = await host.backend.stat(key)
    if info is None or info.is_dir or info.size != row.size:
        return None
    if row.manifest is None:
        return info if row.backend_etag is not None and info.etag == row.backend_etag else None
    keys = chunk.unpack_manifest(row.manifest)
    for index in range(chunk.chunk_count(row.size)):
        data = await host.store.read_range(key, index * chunk.CHUNK_BYTES, chunk.chunk_length(row.size, index))
        if index >= len(keys) or await trio.to_thread.run_sync(chunk.content_key, data) != keys[index]:
            return None
    return info


async def verify_chunks(host: PersistHost, ino: int, first: int, count: int) -> dict:
    """Check chunks ``[first, first + count)`` of ``ino``'s backend objects (and, with ``first`` 0, that
    each exists with the file's size).  Returns what the CLI reports: the row's state and size, the
    chunk count, and ``problems``: one ``{"path", "what", "chunks"}`` per finding."""
    try:
        row = await host.meta.get_inode(ino)
    except NotFound:
        return {"ok": True, "state": "gone", "size": 0, "chunks": 0, "problems": []}
    n = chunk.chunk_count(row.size)
    answer: dict = {"ok": True, "state": row.state, "size": row.size, "chunks": n, "problems": [],
                    "hashed": row.manifest is not None}
    if not stat.S_ISREG(row.mode) or row.state != STATE_DURABLE:
        return answer
    keys = chunk.unpack_manifest(row.manifest) if row.manifest is not None else None
    problems = answer["problems"]
    for path in await host.meta.paths_of(ino):
        if first == 0:
            try:
                info = await host.backend.stat(path)
            except BackendError as exc:
                problems.append({"path": path, "what": f"unreadable: {exc}", "chunks": []})
                continue
            if info is None or info.is_dir:
                problems.append({"path": path, "what": "missing", "chunks": []})
                continue
            if info.size != row.size:
                problems.append({"path": path, "what": f"size {info.size}, recorded {row.size}", "chunks": []})
                continue
        if keys is None:
            continue
        bad = []
        for index in range(first, min(n, first + count)):
            length = chunk.chunk_length(row.size, index)
            try:
                data = await host.store.read_range(path, index * chunk.CHUNK_BYTES, length)
            except BackendError as exc:
                problems.append({"path": path, "what": f"unreadable: {exc}", "chunks": [index]})
                break
            if len(data) != length or await trio.to_thread.run_sync(chunk.content_key, data) != keys[index]:
                bad.append(index)
        if bad:
            problems.append({"path": path, "what": "chunks differ from the manifest", "chunks": bad})
    if problems:
        for p in problems:
            log.error("verify: %s (inode %d): %s%s", p["path"], ino, p["what"],
                      f" (chunks {p['chunks']})" if p["chunks"] else "")
    return answer
