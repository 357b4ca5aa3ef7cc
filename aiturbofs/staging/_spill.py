"""The spill tier: content-addressed chunk files on a local disk.

A spilled chunk lives in ``DIR/<hex digest>``, written to a temporary name,
fsynced and renamed, so a crash leaves either a whole chunk or nothing.  Each
file is verified against its name (its BLAKE3 digest) when read back.  The
spill store knows nothing of files or the pool; it only keeps bytes by hash.
"""

import itertools
import logging
import os

import trio

from .. import chunk
from .._errors import IntegrityError
from .._limits import SPILL_IN_FLIGHT_MAX
from .._threads import background

log = logging.getLogger(__name__)

# A directory in the spill dir for the backing files of files the kernel writes (``_backing``): not chunks.
SPILL_FILES_DIR = "files"


class SpillStore:
    """Chunks by digest in one local directory (created 0700 if missing)."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._limiter = trio.CapacityLimiter(SPILL_IN_FLIGHT_MAX)
        self._lengths: dict[bytes, int] = {}
        self._tmp_ids = itertools.count()
        for name in os.listdir(directory):
            if name == SPILL_FILES_DIR:
                continue
            if name.endswith(".tmp"):
                os.unlink(os.path.join(directory, name))  # torn write from a crash
                continue
            try:
                key = bytes.fromhex(name)
            except ValueError:
                log.warning("spill: ignoring foreign file %s in %s", name, directory)
                continue
            self._lengths[key] = os.stat(os.path.join(directory, name)).st_size

    def __contains__(self, key: bytes) -> bool:
        return key in self._lengths

    def keys(self) -> list[bytes]:
        return list(self._lengths)

    @property
    def bytes_used(self) -> int:
        return sum(self._lengths.values())

    def _path(self, key: bytes) -> str:
        return os.path.join(self.directory, key.hex())

    def _write_sync(self, key: bytes, data) -> None:
        path = self._path(key)
        # A temp name of its own per write: the pool may spill one chunk from
        # two tasks at once (the background spiller and a waiting writer).
        # With one shared name, the second O_TRUNC emptied the first's file,
        # which the first then renamed into place half-written; the next read
        # failed verification and removed the only copy of a staged chunk.
        tmp = f"{path}.{next(self._tmp_ids)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)  # e.g. ENOSPC: no torn temp file left to fill the disk
            raise

    async def write(self, key: bytes, data) -> None:
        """Store ``data`` under ``key``; raises OSError (e.g. ENOSPC) on failure."""
        if key in self._lengths:
            return
        await trio.to_thread.run_sync(background, self._write_sync, key, data, limiter=self._limiter)
        self._lengths[key] = len(data)

    def _read_sync(self, key: bytes) -> bytes:
        with open(self._path(key), "rb") as f:
            data = f.read()
        chunk.verify(data, key, f"spill file {self._path(key)}")
        return data

    async def read(self, key: bytes) -> bytes:
        """The verified bytes of ``key``.

        Raises KeyError if absent, IntegrityError if the file was corrupted
        (the bad file is removed so it is never read again).
        """
        if key not in self._lengths:
            raise KeyError(key)
        try:
            return await trio.to_thread.run_sync(self._read_sync, key, limiter=self._limiter)
        except IntegrityError:
            log.error("spill: %s is corrupt; removing it", self._path(key))
            self.discard(key)
            raise

    def discard(self, key: bytes) -> None:
        """Forget ``key`` and remove its file (missing is fine)."""
        if self._lengths.pop(key, None) is not None:
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                pass
