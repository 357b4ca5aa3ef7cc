"""Tests of aiturbofs.backend.

``BackendConformance`` holds the contract tests; every implementation passes
them by supplying one fixture, ``target`` (fsspec style).  Implementation-
specific behaviour (temp files, multipart uploads, outages, URL forms) is
tested in the subclasses.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import math
import os
import secrets
import stat
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pytest
import trio
import trio.testing
from fileio import upload_temps
from loopback import free_port
from s3server import S3Server

from aiturbofs._errors import (
    BackendError,
    BackendNotFound,
    ConfigError,
    InvalidArgument,
    NotSupported,
    SourceChanged,
    TransientBackendError,
)
from aiturbofs._limits import CHUNK_BYTES, MiB
from aiturbofs.backend import UPLOAD_TEMP_PREFIX, Backend, NodeAttrs, _base, _local, _s3, check_key, open_backend
from aiturbofs.backend._base import parent_key

P = CHUNK_BYTES


@dataclass
class Target:
    """How to open one backend under test, and how to find what it left behind."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)
    leftovers: Callable[[], list[str]] = lambda: []  # temp files, pending multipart uploads


async def run(target: Target, body: Callable[[Backend], Awaitable[None]]) -> None:
    """Open a backend of ``target``, run ``body`` on it and close it."""
    backend = await open_backend(target.url, target.options)
    try:
        await body(backend)
    finally:
        await backend.aclose()


async def run_pair(target: Target, body: Callable[[Backend, Backend], Awaitable[None]]) -> None:
    """Like ``run`` with two backends opened separately, as two node processes would:
    the owner of an upload and another writer of its parts.  Skips where
    the backend cannot take parts from other processes."""
    owner = await open_backend(target.url, target.options)
    try:
        if not owner.supports_remote_parts:
            pytest.skip(f"{type(owner).__name__} stages parts in its own process: supports_remote_parts is False")
        other = await open_backend(target.url, target.options)
        try:
            await body(owner, other)
        finally:
            await other.aclose()
    finally:
        await owner.aclose()


async def put(backend: Backend, key: str, data: bytes, order: list[int] | None = None):
    upload = await backend.open_upload(key)
    for index in order if order is not None else range(math.ceil(len(data) / P)):
        await upload.write_part(index, data[index * P : (index + 1) * P])
    return await upload.complete(len(data))


async def read_all(backend: Backend, key: str) -> bytes:
    info = await backend.stat(key)
    assert info is not None and not info.is_dir
    return await backend.read_range(key, 0, info.size)


async def names(backend: Backend, key: str) -> dict[str, bool]:
    return {info.key: info.is_dir for info in await backend.list_dir(key)}


class BackendConformance:
    """The contract of ``Backend`` / ``Upload``; subclasses supply ``target``."""

    ended_upload_error: Any = BackendNotFound  # a remote part of a completed or aborted upload

    @pytest.fixture
    def target(self) -> Target:
        raise NotImplementedError

    # --- uploads -------------------------------------------------------------------------

    @pytest.mark.parametrize("size", [0, 1, P, 2 * P + P // 2], ids=["empty", "1B", "1part", "2.5parts"])
    async def test_upload_and_read_back(self, target: Target, size: int):
        data = os.urandom(size)

        async def body(b: Backend):
            info = await put(b, "dir/obj", data)
            assert (info.key, info.size, info.is_dir) == ("dir/obj", size, False)
            assert info.etag
            found = await b.stat("dir/obj")
            assert found is not None and found.mtime_ns  # complete() may not know the mtime (0)
            assert found == (info if info.mtime_ns else dataclasses.replace(info, mtime_ns=found.mtime_ns))
            assert await read_all(b, "dir/obj") == data

        await run(target, body)
        assert target.leftovers() == []

    async def test_parts_out_of_order_and_concurrent(self, target: Target):
        data = os.urandom(2 * P + 100)

        async def body(b: Backend):
            upload = await b.open_upload("ooo")
            async with trio.open_nursery() as nursery:
                for index in (2, 0, 1):
                    nursery.start_soon(upload.write_part, index, memoryview(data)[index * P : (index + 1) * P])
            await upload.complete(len(data))
            assert await read_all(b, "ooo") == data

        await run(target, body)

    async def test_resent_part_last_write_wins(self, target: Target):
        good = os.urandom(P + 10)

        async def body(b: Backend):
            upload = await b.open_upload("resend")
            await upload.write_part(0, bytes(P))  # wrong bytes first
            await upload.write_part(1, os.urandom(P))  # a longer last part first
            await upload.write_part(0, good[:P])
            await upload.write_part(1, good[P:])
            await upload.complete(len(good))
            assert await read_all(b, "resend") == good

        await run(target, body)

    async def test_complete_refuses_missing_or_wrong_parts(self, target: Target):
        async def body(b: Backend):
            upload = await b.open_upload("holes")
            await upload.write_part(0, os.urandom(P))
            await upload.write_part(2, b"tail")
            with pytest.raises(BackendError, match="missing parts \\[1\\]"):
                await upload.complete(2 * P + 4)
            with pytest.raises(BackendError, match="wrong-length"):
                await upload.complete(2 * P + 5)
            await upload.abort()
            assert await b.stat("holes") is None

        await run(target, body)
        assert target.leftovers() == []

    async def test_copy_part_server_side_ranges(self, target: Target):
        src = os.urandom(3 * P)

        async def body(b: Backend):
            await put(b, "src", src)
            upload = await b.open_upload("dst")
            await upload.copy_part(0, "src", P, P)  # a whole middle chunk
            await upload.write_part(1, b"x" * P)
            await upload.copy_part(2, "src", P + 123, 1000)  # a byte range in the middle
            info = await upload.complete(2 * P + 1000)
            assert info.size == 2 * P + 1000
            assert await read_all(b, "dst") == src[P : 2 * P] + b"x" * P + src[P + 123 : P + 1123]

        await run(target, body)

    async def test_zero_parts_read_as_zeros(self, target: Target):
        data = os.urandom(P)

        async def body(b: Backend):
            upload = await b.open_upload("sparse")
            await upload.write_part(1, os.urandom(P))  # written, then a hole: the latest entry of a part wins
            for index in (0, 1):
                sent, copied = await upload.zero_part(index, P)
                assert 0 <= sent <= P and 0 <= copied <= P
            await upload.write_part(2, data)
            await upload.zero_part(3, 100)  # a short last part
            info = await upload.complete(3 * P + 100)
            assert info.size == 3 * P + 100
            assert await read_all(b, "sparse") == bytes(2 * P) + data + bytes(100)
            assert await names(b, "") == {"sparse": False}  # nothing else to see

        await run(target, body)
        assert target.leftovers() == []

    async def test_copy_part_source_errors(self, target: Target):
        async def body(b: Backend):
            await put(b, "short", b"0123456789")
            upload = await b.open_upload("dst")
            with pytest.raises(BackendNotFound):
                await upload.copy_part(0, "missing", 0, 10)
            with pytest.raises(BackendError, match="source ends"):
                await upload.copy_part(0, "short", 5, 10)
            with pytest.raises(BackendError, match="missing parts \\[0\\]"):
                await upload.complete(10)  # the failed part does not count
            await upload.abort()

        await run(target, body)
        assert target.leftovers() == []

    async def test_complete_replaces_existing_object(self, target: Target):
        async def body(b: Backend):
            old = await put(b, "obj", b"old version, longer")
            new = await put(b, "obj", b"new")
            assert new.etag != old.etag
            assert await read_all(b, "obj") == b"new"
            assert await names(b, "") == {"obj": False}

        await run(target, body)

    async def test_abort_leaves_nothing(self, target: Target):
        async def body(b: Backend):
            upload = await b.open_upload("d/aborted")
            await upload.write_part(0, os.urandom(P))
            await upload.write_part(1, b"x")
            await upload.abort()
            await upload.abort()  # idempotent
            assert await b.stat("d/aborted") is None
            assert "d/aborted" not in await names(b, "d")
            with pytest.raises(BackendError, match="aborted"):
                await upload.write_part(0, b"late")

        await run(target, body)
        assert target.leftovers() == []

    async def test_cancelled_part_counts_as_missing(self, target: Target):
        async def body(b: Backend):
            upload = await b.open_upload("cancelled")
            await upload.write_part(0, b"first")
            with trio.CancelScope() as scope:
                scope.cancel()
                await upload.write_part(0, b"again")  # may have written half of it
            with pytest.raises(BackendError, match="missing parts \\[0\\]"):
                await upload.complete(5)
            await upload.write_part(0, b"third")
            await upload.complete(5)
            assert await read_all(b, "cancelled") == b"third"

        await run(target, body)

    async def test_abort_waits_for_parts_in_flight(self, target: Target):
        async def body(b: Backend):
            upload = await b.open_upload("racing")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(upload.write_part, 0, os.urandom(P))
                nursery.start_soon(upload.write_part, 1, os.urandom(P))
                await trio.testing.wait_all_tasks_blocked()
                await upload.abort()  # the parts finish first; nothing may land after
            assert await b.stat("racing") is None

        await run(target, body)
        assert target.leftovers() == []

    async def test_abort_after_complete_keeps_object(self, target: Target):
        async def body(b: Backend):
            upload = await b.open_upload("kept")
            await upload.write_part(0, b"data")
            await upload.complete(4)
            await upload.abort()
            assert await read_all(b, "kept") == b"data"

        await run(target, body)

    async def test_copy_part_if_etag(self, target: Target):
        old = os.urandom(2 * P)
        new = os.urandom(2 * P + 1)  # another size too: local etags are mtime (coarse) and size

        async def body(b: Backend):
            etag = (await put(b, "src", old)).etag
            upload = await b.open_upload("dst")
            await upload.copy_part(0, "src", 0, P, if_etag=etag)
            await put(b, "src", new)
            with pytest.raises(SourceChanged) as caught:
                await upload.copy_part(1, "src", P, P, if_etag=etag)
            assert caught.value.errno == errno.ESTALE and not isinstance(caught.value, TransientBackendError)
            with pytest.raises(BackendNotFound):
                await upload.copy_part(1, "missing", P, P, if_etag=etag)
            with pytest.raises(BackendError, match="missing parts \\[1\\]"):
                await upload.complete(2 * P)  # the refused copies do not count
            await upload.write_part(1, old[P:])  # the fallback: send the bytes
            await upload.complete(2 * P)
            assert await read_all(b, "dst") == old

        await run(target, body)
        assert target.leftovers() == []

    # --- parts written by other processes -------------------------------------------------

    async def test_remote_parts_from_another_backend(self, target: Target):
        data = os.urandom(3 * P + 100)
        parts = [memoryview(data)[offset : offset + P] for offset in range(0, len(data), P)]

        async def body(owner: Backend, other: Backend):
            upload = await owner.open_upload("shared/obj")
            token = await upload.token()
            assert await upload.token() == token
            receipts = {}

            async def remote(index: int) -> None:
                receipts[index] = await other.write_remote_part("shared/obj", token, index, parts[index])

            async with trio.open_nursery() as nursery:
                for index in (0, 2):
                    nursery.start_soon(remote, index)
                nursery.start_soon(upload.write_part, 1, parts[1])
                nursery.start_soon(upload.write_part, 3, parts[3])
            for index, receipt in receipts.items():
                upload.add_remote_part(index, len(parts[index]), receipt)
            info = await upload.complete(len(data))
            assert info.size == len(data)
            assert await read_all(other, "shared/obj") == data

        await run_pair(target, body)
        assert target.leftovers() == []

    async def test_remote_part_replaces_small_local_part(self, target: Target):
        async def body(owner: Backend, other: Backend):
            upload = await owner.open_upload("tiny")
            await upload.write_part(0, b"old!")
            receipt = await other.write_remote_part("tiny", await upload.token(), 0, b"new!")
            upload.add_remote_part(0, 4, receipt)  # the latest entry of a part wins
            await upload.complete(4)
            assert await read_all(owner, "tiny") == b"new!"

        await run_pair(target, body)
        assert target.leftovers() == []

    async def test_bad_tokens_rejected(self, target: Target):
        async def body(owner: Backend, other: Backend):
            upload = await owner.open_upload("a")
            token = await upload.token()
            fields = json.loads(token)
            bad = [
                "",
                "not json",
                "[]",
                "{}",
                json.dumps({**fields, "kind": "elsewhere"}),
                json.dumps({"kind": fields["kind"], "key": "a", "part_bytes": P}),
                json.dumps({**fields, "key": "b"}),
                "x" * 100_000,
            ]
            for candidate in bad:
                with pytest.raises(InvalidArgument):
                    await other.write_remote_part("a", candidate, 0, b"x")
            with pytest.raises(InvalidArgument, match="is for 'a', not 'b'"):
                await other.write_remote_part("b", token, 0, b"x")
            with pytest.raises(InvalidArgument, match="parts"):
                await other.write_remote_part("a", token, 0, b"x", part_bytes=2 * P)
            with pytest.raises(BackendError, match="bad backend key"):
                await other.write_remote_part("../a", token, 0, b"x")
            with pytest.raises(InvalidArgument):
                upload.add_remote_part(0, 1, "")
            await upload.abort()

        await run_pair(target, body)
        assert target.leftovers() == []

    async def test_remote_part_wrong_length_caught_at_complete(self, target: Target):
        data = os.urandom(2 * P)

        async def body(owner: Backend, other: Backend):
            upload = await owner.open_upload("short")
            token = await upload.token()
            receipt = await other.write_remote_part("short", token, 0, data[: P // 2])  # a short middle part
            upload.add_remote_part(0, P // 2, receipt)
            await upload.write_part(1, data[P:])
            with pytest.raises(BackendError, match=r"wrong-length parts \[0 \("):
                await upload.complete(2 * P)
            upload.add_remote_part(0, P, await other.write_remote_part("short", token, 0, data[:P]))
            await upload.complete(2 * P)
            assert await read_all(other, "short") == data

        await run_pair(target, body)
        assert target.leftovers() == []

    async def test_remote_write_after_complete_or_abort_fails(self, target: Target):
        async def body(owner: Backend, other: Backend):
            for end in ("complete", "abort"):
                upload = await owner.open_upload(f"ended-{end}")
                token = await upload.token()
                upload.add_remote_part(0, 4, await other.write_remote_part(f"ended-{end}", token, 0, b"data"))
                await (upload.complete(4) if end == "complete" else upload.abort())
                with pytest.raises(self.ended_upload_error):
                    await other.write_remote_part(f"ended-{end}", token, 0, b"late")
                with pytest.raises(BackendError, match="already"):
                    await upload.token()
            assert await read_all(other, "ended-complete") == b"data"
            assert await owner.stat("ended-abort") is None

        await run_pair(target, body)
        assert target.leftovers() == []

    # --- reads and listings -----------------------------------------------------------------

    async def test_read_range(self, target: Target):
        data = os.urandom(1000)

        async def body(b: Backend):
            await put(b, "r", data)
            await put(b, "empty", b"")
            assert await b.read_range("r", 0, 10) == data[:10]
            assert await b.read_range("r", 500, 100) == data[500:600]
            assert await b.read_range("r", 990, 100) == data[990:]  # short at EOF only
            assert await b.read_range("r", 1000, 10) == b""
            assert await b.read_range("r", 5000, 10) == b""
            assert await b.read_range("r", 3, 0) == b""
            assert await b.read_range("empty", 0, 10) == b""
            with pytest.raises(BackendNotFound):
                await b.read_range("missing", 0, 10)

        await run(target, body)

    async def test_read_range_if_etag(self, target: Target):
        old = os.urandom(1000)
        new = os.urandom(1001)  # another size too: local etags hold the mtime (coarse) and size

        async def body(b: Backend):
            await put(b, "r", old)
            etag = (await b.stat("r")).etag
            assert etag is not None and [i.etag for i in await b.list_dir("") if i.key == "r"] == [etag]
            assert await b.read_range("r", 10, 100, if_etag=etag) == old[10:110]
            assert await b.read_range("r", 990, 100, if_etag=etag) == old[990:]  # short at EOF only
            assert await b.read_range("r", 5000, 10, if_etag=etag) == b""
            assert await b.read_range("r", 3, 0, if_etag=etag) == b""
            await put(b, "r", new)  # another writer replaces it
            for offset, length in ((10, 100), (990, 100), (1000, 1), (5000, 10), (3, 0)):
                with pytest.raises(SourceChanged) as caught:
                    await b.read_range("r", offset, length, if_etag=etag)
                assert caught.value.errno == errno.ESTALE and not isinstance(caught.value, TransientBackendError)
            assert await b.read_range("r", 10, 100, if_etag=(await b.stat("r")).etag) == new[10:110]
            with pytest.raises(BackendNotFound):
                await b.read_range("missing", 0, 10, if_etag=etag)
            await b.delete("r")
            for length in (10, 0):
                with pytest.raises(BackendNotFound):
                    await b.read_range("r", 0, length, if_etag=etag)

        await run(target, body)

    async def test_list_dir(self, target: Target):
        async def body(b: Backend):
            await put(b, "a/b/c.bin", b"c")
            await put(b, "a/d.bin", b"dd")
            await put(b, "e.bin", b"eee")
            assert await names(b, "") == {"a": True, "e.bin": False}
            assert await names(b, "a") == {"a/b": True, "a/d.bin": False}
            assert await names(b, "a/b") == {"a/b/c.bin": False}
            sizes = {info.key: info.size for info in await b.list_dir("a")}
            assert sizes["a/d.bin"] == 2
            assert await b.list_dir("missing") == []
            assert await b.list_dir("a/missing/deeper") == []
            assert await b.list_dir("e.bin") == []  # an object is not a directory

        await run(target, body)

    async def test_stat(self, target: Target):
        async def body(b: Backend):
            await put(b, "x/y", b"12345")
            info = await b.stat("x/y")
            assert (info.size, info.is_dir) == (5, False) and info.mtime_ns > 0
            assert (await b.stat("x")).is_dir
            assert (await b.stat("")).is_dir
            assert await b.stat("x/missing") is None
            assert await b.stat("x/y/under-a-file") is None

        await run(target, body)

    # --- whole-object operations ------------------------------------------------------------

    async def test_copy(self, target: Target):
        async def body(b: Backend):
            await put(b, "c/src", b"source")
            await put(b, "c/existing", b"to be replaced")
            await b.copy("c/src", "new/parent/dst")
            await b.copy("c/src", "c/existing")
            await b.copy("c/src", "c/src")
            for key in ("c/src", "new/parent/dst", "c/existing"):
                assert await read_all(b, key) == b"source"
            with pytest.raises(BackendNotFound):
                await b.copy("c/missing", "c/x")

        await run(target, body)
        assert target.leftovers() == []

    async def test_copy_by_parts(self, target: Target, monkeypatch):
        # Force the part-by-part path used for objects beyond CopyObject's limit.
        monkeypatch.setattr(_base, "BACKEND_COPY_PART_BYTES", 5 * MiB)
        monkeypatch.setattr(_s3, "S3_COPY_OBJECT_BYTES_MAX", 1)
        data = os.urandom(11 * MiB)

        async def body(b: Backend):
            await put(b, "big", data)
            await b.copy("big", "big-copy")
            assert await read_all(b, "big-copy") == data

        await run(target, body)
        assert target.leftovers() == []

    async def test_move(self, target: Target):
        async def body(b: Backend):
            await put(b, "m/src", b"moving")
            await b.move("m/src", "elsewhere/deep/dst")
            assert await b.stat("m/src") is None
            assert await read_all(b, "elsewhere/deep/dst") == b"moving"
            await b.move("elsewhere/deep/dst", "elsewhere/deep/dst")  # onto itself keeps it
            assert await read_all(b, "elsewhere/deep/dst") == b"moving"
            with pytest.raises(BackendNotFound):
                await b.move("m/missing", "m/x")

        await run(target, body)

    async def test_delete(self, target: Target):
        async def body(b: Backend):
            await put(b, "del/me", b"x")
            await b.delete("del/me")
            assert await b.stat("del/me") is None
            await b.delete("del/me")  # missing is not an error
            await b.delete("never/existed")

        await run(target, body)

    async def test_makedirs_and_remove_dir(self, target: Target):
        async def body(b: Backend):
            await b.makedirs("m/n/o")
            await b.makedirs("m/n/o")  # exists: fine
            await b.remove_dir("m/n/o")
            await b.remove_dir("m/n/o")  # missing: fine
            await put(b, "full/file", b"x")
            await b.remove_dir("full")  # not empty: left alone
            await b.remove_dir("")  # the root is never removed
            assert await read_all(b, "full/file") == b"x"

        await run(target, body)

    # --- keys ---------------------------------------------------------------------------------

    async def test_nodes_written_read_and_removed(self, target: Target):
        """Symlinks, FIFOs and empty directories in the backend's form (docs/design.md)."""
        async def body(b: Backend):
            kinds = b.node_kinds
            assert stat.S_IFDIR in kinds
            mtime_ns = 1_700_000_000 * 10**9
            if stat.S_IFLNK in kinds:
                await b.write_node("n/link", NodeAttrs(stat.S_IFLNK | 0o777, os.getuid(), os.getgid(), mtime_ns,
                                                      target=b"../t"))
                node = await b.read_node("n/link")
                assert node is not None and stat.S_ISLNK(node.mode) and node.target == b"../t"
                assert (node.uid, node.gid, node.mtime_ns) == (os.getuid(), os.getgid(), mtime_ns)
                await b.write_node("n/link", NodeAttrs(stat.S_IFLNK | 0o777, target=b"other"))  # replaced
                assert (await b.read_node("n/link")).target == b"other"
            else:
                with pytest.raises(NotSupported):
                    await b.write_node("n/link", NodeAttrs(stat.S_IFLNK | 0o777, target=b"t"))
            if stat.S_IFIFO in kinds:
                await b.write_node("n/fifo", NodeAttrs(stat.S_IFIFO | 0o640))
                node = await b.read_node("n/fifo")
                assert node is not None and stat.S_ISFIFO(node.mode) and stat.S_IMODE(node.mode) == 0o640
            await b.write_node("n/empty", NodeAttrs(stat.S_IFDIR | 0o755))
            await put(b, "n/plain", b"x")
            listing = await names(b, "n")
            assert listing["n/empty"] is True and listing["n/plain"] is False
            assert await names(b, "n/empty") == {}  # a marker is never an entry of its own directory
            for plain in ("n/plain", "n/empty", "n/missing"):
                assert await b.read_node(plain) is None
            await b.write_node("n/full", NodeAttrs(stat.S_IFDIR | 0o755))
            await put(b, "n/full/f", b"y")
            await b.remove_dir("n/full")  # not empty: stays, marker and all
            assert await names(b, "n/full") == {"n/full/f": False}
            await b.delete("n/full/f")
            await b.delete("n/link")
            await b.delete("n/fifo")
            await b.remove_dir("n/empty")
            assert (await names(b, "n"))["n/full"] is True  # its marker keeps the emptied directory
            await b.remove_dir("n/full")
            assert await names(b, "n") == {"n/plain": False}

        await run(target, body)

    @pytest.mark.parametrize(
        "key", ["..", "../x", "a/../b", "/abs", "a//b", "a/", ".", "a/./b", "x\0y", UPLOAD_TEMP_PREFIX + "x"]
    )
    async def test_bad_keys_rejected(self, target: Target, key: str):
        async def body(b: Backend):
            for call in (
                lambda: b.stat(key),
                lambda: b.list_dir(key),
                lambda: b.read_range(key, 0, 1),
                lambda: b.open_upload(key),
                lambda: b.delete(key),
                lambda: b.copy("ok", key),
                lambda: b.copy(key, "ok"),
                lambda: b.move(key, "ok"),
                lambda: b.makedirs(key),
                lambda: b.remove_dir(key),
            ):
                with pytest.raises(BackendError, match="bad backend key"):
                    await call()

        await run(target, body)

    async def test_root_is_not_an_object(self, target: Target):
        async def body(b: Backend):
            for call in (lambda: b.open_upload(""), lambda: b.delete(""), lambda: b.read_range("", 0, 1)):
                with pytest.raises(BackendError):
                    await call()

        await run(target, body)


# --- implementations -----------------------------------------------------------------------------


_UPLOAD_AND_HANG = """
import json, sys, trio
from aiturbofs.backend import open_backend
async def main(url, options, key):
    backend = await open_backend(url, options)
    upload = await backend.open_upload(key, part_bytes=4)
    await upload.write_part(1, b"5678")
    print("writing", flush=True)
    await trio.sleep_forever()
trio.run(main, sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])
"""


def _kill_mid_upload(target: Target, key: str) -> None:
    """An uploader (a process of its own) killed with SIGKILL while it writes ``key``."""
    proc = subprocess.Popen([sys.executable, "-c", _UPLOAD_AND_HANG, target.url, json.dumps(target.options), key],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
    finally:
        proc.kill()
        proc.wait()


async def _dead_temps_go_and_live_ones_stay(target: Target, key: str, other_key: str) -> None:
    """The temp of an uploader killed while writing ``key`` is gone once the next upload starts (in
    its directory, for backends whose temps are beside the target); a live upload's temp is kept
    meanwhile by everything that removes dead ones, in this process and in another."""
    _kill_mid_upload(target, key)
    assert len(target.leftovers()) == 1

    async def body(b: Backend):
        live = await b.open_upload(key, part_bytes=4)
        await live.write_part(1, b"live")
        (kept,) = target.leftovers()
        await put(b, other_key, b"mine")
        _kill_mid_upload(target, other_key)  # whose first upload looks for dead temps too
        (dead,) = set(target.leftovers()) - {kept}
        other = await open_backend(target.url, target.options)  # as another process would
        try:
            await other.list_dir(parent_key(key))
            await other.remove_dir(parent_key(key))
            await put(other, other_key, b"other")  # its first upload: looks for dead temps
        finally:
            await other.aclose()
        assert target.leftovers() == [kept], dead
        await live.write_part(0, b"1234")
        await live.complete(8)
        assert await read_all(b, key) == b"1234live"
        assert await read_all(b, other_key) == b"other"

    await run(target, body)
    assert target.leftovers() == []


class TestLocal(BackendConformance):
    @pytest.fixture
    def target(self, tmp_path) -> Target:
        root = str(tmp_path / "root")
        return Target(f"file://{root}", leftovers=lambda: upload_temps(root))

    async def test_temp_file_is_hidden_and_beside_target(self, target: Target):
        root = target.url[len("file://") :]

        async def body(b: Backend):
            upload = await b.open_upload("sub/name.bin")
            await upload.write_part(0, b"x")
            (temp,) = upload_temps(root)
            assert os.path.dirname(temp) == os.path.join(root, "sub")
            assert await names(b, "sub") == {}
            await upload.complete(1)
            assert upload_temps(root) == []
            assert sorted(os.listdir(os.path.join(root, "sub"))) == ["name.bin"]

        await run(target, body)

    async def test_temps_of_a_killed_uploader_go_at_the_next_upload_and_a_live_ones_stay(self, target: Target):
        """issue 23: a kill -9 during uploads left ``.aiturbo-upload.*`` files in the backend forever."""
        await _dead_temps_go_and_live_ones_stay(target, "sub/a.bin", "sub/b.bin")

    async def test_temps_of_a_killed_uploader_go_when_listed_or_in_the_way_of_a_rmdir(self, target: Target):
        root = target.url[len("file://") :]
        _kill_mid_upload(target, "listed/a.bin")
        _kill_mid_upload(target, "removed/a.bin")
        assert len(target.leftovers()) == 2

        async def body(b: Backend):
            assert await names(b, "listed") == {}
            assert os.listdir(os.path.join(root, "listed")) == []
            await b.remove_dir("removed")  # only a dead upload's temp was in it
            assert not os.path.exists(os.path.join(root, "removed"))

        await run(target, body)

    async def test_a_temp_reaped_while_its_upload_waits_to_publish_fails_that_publish_for_a_retry(self, target: Target):
        """The shared lock an upload holds turns exclusive at publish, and flock drops it while it
        waits for remote writers: a reaper that comes between must not make a publish of a
        removed temp look done."""
        root = target.url[len("file://") :]

        async def body(b: Backend):
            upload = await b.open_upload("k", part_bytes=4)
            await upload.write_part(0, b"1234")
            await upload.token()  # shared: publish takes the exclusive lock
            (temp,) = upload_temps(root)
            os.unlink(temp)  # what a reaper in that window does
            with pytest.raises(TransientBackendError, match="removed"):
                await upload.complete(4)
            await upload.abort()
            assert await b.stat("k") is None

        await run(target, body)

    async def test_published_object_has_its_attributes_and_its_temp_was_its_owners_only(self, target: Target):
        """A 0600 file of another user never is, not even while it is written,
        a file every local user can read (issue 23: files arrived 0644 root)."""
        root = target.url[len("file://") :]
        other = _OTHER_ID
        mtime_ns = 1_600_000_000_123_456_789

        async def body(b: Backend):
            assert b.keeps_attrs
            for key, mode, owner in [("secret", 0o600, other), ("suid", 0o4755, 0), ("shared", 0o666, other),
                                     ("group", 0o2640, other)]:
                owner = owner if _ROOT else os.getuid()
                upload = await b.open_upload(f"d/{key}", part_bytes=4)
                await upload.write_part(1, b"5678")  # into the temp file now (a small part 0 waits in memory)
                (temp,) = upload_temps(root)
                assert stat.S_IMODE(os.stat(temp).st_mode) == 0o600, key
                await upload.write_part(0, b"1234")
                info = await upload.complete(8, attrs=NodeAttrs(stat.S_IFREG | mode, owner, owner, mtime_ns))
                st = os.stat(os.path.join(root, "d", key))
                assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns) == (mode, owner, owner, mtime_ns)
                assert (info.etag, info.mode, info.uid, info.gid) == (_local._etag(st), st.st_mode, owner, owner)
                assert await read_all(b, f"d/{key}") == b"12345678"
            await put(b, "plain", b"x")  # no attributes: the backend's default
            assert stat.S_IMODE(os.stat(os.path.join(root, "plain")).st_mode) == 0o644
            listed = {info.key: info for info in await b.list_dir("d")}
            assert stat.S_IMODE(listed["d/secret"].mode) == 0o600 and listed["d/secret"].uid == (other if _ROOT else os.getuid())
            await b.copy("d/secret", "copy", attrs=NodeAttrs(stat.S_IFREG | 0o640, 0, 0, mtime_ns + 1))
            st = os.stat(os.path.join(root, "copy"))
            assert (stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (0o640, mtime_ns + 1)

        await run(target, body)

    async def test_set_attrs_changes_no_bytes(self, target: Target):
        """chmod/chown/utime of a durable file, directory or node reach the backend in place."""
        root = target.url[len("file://") :]
        uid = _OTHER_ID if _ROOT else os.getuid()
        t = 1_500_000_000_000_000_007

        def attrs_of(key: str) -> tuple[int, int, int, int]:
            st = os.lstat(os.path.join(root, key))
            return (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns)

        async def body(b: Backend):
            await put(b, "f", b"data")
            before = os.stat(os.path.join(root, "f"))
            info = await b.set_attrs("f", NodeAttrs(stat.S_IFREG | 0o4750, uid, uid, t))
            assert attrs_of("f") == (stat.S_IFREG | 0o4750, uid, uid, t)
            assert os.stat(os.path.join(root, "f")).st_ino == before.st_ino and await read_all(b, "f") == b"data"
            assert info.etag == _local._etag(os.stat(os.path.join(root, "f"))) != _local._etag(before)
            await b.write_node("d", NodeAttrs(stat.S_IFDIR | 0o700, uid, uid, t))  # a directory gets them too
            assert attrs_of("d") == (stat.S_IFDIR | 0o700, uid, uid, t)
            await b.set_attrs("d", NodeAttrs(stat.S_IFDIR | 0o1777, 0, 0, t + 1))
            assert attrs_of("d") == (stat.S_IFDIR | 0o1777, 0, 0, t + 1)
            await b.write_node("link", NodeAttrs(stat.S_IFLNK | 0o777, target=b"f"))
            await b.set_attrs("link", NodeAttrs(stat.S_IFLNK | 0o777, uid, uid, t + 2))  # the link, not f
            assert attrs_of("link")[1:] == (uid, uid, t + 2) and attrs_of("f")[3] == t
            await b.write_node("fifo", NodeAttrs(stat.S_IFIFO | 0o600))
            await b.set_attrs("fifo", NodeAttrs(stat.S_IFIFO | 0o644, uid, uid, t + 3))  # never opened for it
            assert attrs_of("fifo") == (stat.S_IFIFO | 0o644, uid, uid, t + 3)
            with pytest.raises(BackendError, match="type"):
                await b.set_attrs("d", NodeAttrs(stat.S_IFREG | 0o600))
            with pytest.raises(BackendNotFound):
                await b.set_attrs("missing", NodeAttrs(stat.S_IFREG | 0o600))

        await run(target, body)

    async def test_long_name_still_fits_beside_it(self, target: Target):
        async def body(b: Backend):
            await put(b, "n" * 255, b"long")
            assert await read_all(b, "n" * 255) == b"long"

        await run(target, body)

    async def test_root_created_if_parent_exists(self, tmp_path):
        await run(Target(str(tmp_path / "fresh")), lambda b: trio.sleep(0))  # a plain path works too
        assert oct(os.stat(tmp_path / "fresh").st_mode & 0o777) == oct(0o755 & ~_umask())
        with pytest.raises(BackendError, match="neither does its parent"):
            await run(Target(f"file://{tmp_path}/no/such/root"), lambda b: trio.sleep(0))

    async def test_unknown_option_rejected(self, target: Target):
        with pytest.raises(ConfigError, match="s3_endpoint"):
            await run(Target(target.url, {"s3_endpoint": "http://x"}), lambda b: trio.sleep(0))

    async def test_token_names_only_a_temp_beside_the_key(self, target: Target):
        root = target.url[len("file://") :]

        async def body(owner: Backend, other: Backend):
            upload = await owner.open_upload("d/k")
            fields = json.loads(await upload.token())
            (temp,) = upload_temps(root)
            assert os.path.basename(temp).startswith(UPLOAD_TEMP_PREFIX + fields["temp"] + ".")
            # upper case: a nonce of digits only has none, so make sure it differs
            shouted = fields["temp"].upper() if fields["temp"].upper() != fields["temp"] else "A" * len(fields["temp"])
            for evil in ("../../../etc/passwd", "/tmp/x", fields["temp"] + "/..", shouted):
                with pytest.raises(InvalidArgument):
                    await other.write_remote_part("d/k", json.dumps({**fields, "temp": evil}), 0, b"x")
            await upload.abort()

        await run_pair(target, body)

    async def test_receipt_must_match_length(self, target: Target):
        async def body(owner: Backend, other: Backend):
            upload = await owner.open_upload("r")
            receipt = await other.write_remote_part("r", await upload.token(), 0, b"12345")
            with pytest.raises(InvalidArgument, match="not for 9 bytes"):
                upload.add_remote_part(0, 9, receipt)  # the bytes beyond 5 would be a hole of zeros
            await upload.abort()

        await run_pair(target, body)

    async def test_publish_waits_for_a_remote_write_in_flight(self, target: Target):
        root = target.url[len("file://") :]

        async def body(owner: Backend, other: Backend):
            upload = await owner.open_upload("locked")
            upload.add_remote_part(0, 1, await other.write_remote_part("locked", await upload.token(), 0, b"x"))
            (temp,) = upload_temps(root)
            fd = os.open(temp, os.O_RDWR)  # a remote writer between its lock and its write
            fcntl.flock(fd, fcntl.LOCK_SH)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(upload.complete, 1)
                try:
                    await trio.sleep(0.3)
                    early = await owner.stat("locked")
                finally:
                    os.close(fd)  # drops the lock
            assert early is None  # the rename waited for the writer
            assert await read_all(owner, "locked") == b"x"

        await run_pair(target, body)

    async def test_zero_parts_stay_holes(self, target: Target):
        root = target.url[len("file://") :]

        async def body(b: Backend):
            upload = await b.open_upload("sparse")
            await upload.write_part(0, os.urandom(P))
            await upload.zero_part(0, P)  # punched: no block of the written part is left
            assert await upload.zero_part(1, P) == (0, 0)  # nothing sent, nothing copied
            # a data part mostly of zeros (a write into a hole): only its data takes blocks,
            # also where older bytes of the part were written first
            await upload.write_part(2, os.urandom(P))
            await upload.write_part(2, part)
            await upload.write_part(3, b"tail")
            await upload.complete(3 * P + 4)
            assert await read_all(b, "sparse") == bytes(2 * P) + part + b"tail"

        part = bytes(P // 2) + os.urandom(MiB) + bytes(P // 2 - MiB)
        await run(target, body)
        st = os.stat(os.path.join(root, "sparse"))
        assert st.st_size == 3 * P + 4
        assert st.st_blocks * 512 <= MiB + 64 * 1024, st.st_blocks  # the data's blocks, not 24 MiB

    async def test_copy_keeps_holes(self, target: Target):
        # copy_file_range alone writes a source's holes as zeros (ext4, tmpfs):
        # a hard link of a sparse file would be stored dense
        root = target.url[len("file://") :]
        want = bytes(P) + b"x" * P + bytes(P) + b"tail"

        async def body(b: Backend):
            upload = await b.open_upload("src")
            await upload.zero_part(0, P)
            await upload.write_part(1, b"x" * P)
            await upload.zero_part(2, P)
            await upload.write_part(3, b"tail")
            await upload.complete(len(want))
            await b.copy("src", "dst")
            assert await read_all(b, "dst") == want
            upload = await b.open_upload("ranges")
            await upload.copy_part(0, "src", P - 4096, P)  # a hole's end, then data
            await upload.copy_part(1, "src", 2 * P, P)  # a whole hole
            await upload.copy_part(2, "src", 3 * P, 4)  # the tail
            await upload.complete(2 * P + 4)
            assert await read_all(b, "ranges") == want[P - 4096 : 2 * P - 4096] + want[2 * P :]

        await run(target, body)
        for name, data_bytes in (("dst", P + 4), ("ranges", P + 4)):
            allocated = os.stat(os.path.join(root, name)).st_blocks * 512
            assert allocated <= data_bytes + 64 * 1024, (name, allocated)

    async def test_read_range_if_etag_sees_an_in_place_write_during_the_read(self, target: Target, monkeypatch):
        # Another tool rewrites the object in place (the same inode): the
        # etag checked before the read still matches, the one after does not.
        root = target.url[len("file://") :]
        real_pread_all = _local._pread_all

        def pread_racing_a_writer(fd: int, offset: int, length: int) -> bytes:
            path = os.path.join(root, "r")
            with open(path, "r+b") as f:
                f.write(b"new bytes")
            mtime_ns = os.stat(path).st_mtime_ns + 1_000_000  # a tick later, however coarse the clock
            os.utime(path, ns=(mtime_ns, mtime_ns))
            return real_pread_all(fd, offset, length)

        async def body(b: Backend):
            await put(b, "r", b"old bytes")
            etag = (await b.stat("r")).etag
            monkeypatch.setattr(_local, "_pread_all", pread_racing_a_writer)
            with pytest.raises(SourceChanged):
                await b.read_range("r", 0, 9, if_etag=etag)
            assert await b.read_range("r", 0, 9) == b"new bytes"

        await run(target, body)

    async def test_copy_part_uses_copy_file_range(self, target: Target, monkeypatch):
        calls = []
        real = os.copy_file_range
        monkeypatch.setattr(os, "copy_file_range", lambda *args: calls.append(args) or real(*args))

        async def body(b: Backend):
            info = await put(b, "src", b"0123456789")
            upload = await b.open_upload("dst")
            await upload.copy_part(0, "src", 2, 5, if_etag=info.etag)
            await upload.complete(5)
            assert await read_all(b, "dst") == b"23456"

        await run(target, body)
        assert calls  # in the kernel, not through this process (supports_server_copy)


_ROOT = os.geteuid() == 0  # only root gives files away (chown)
_OTHER_ID = 65534  # nobody


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class TestMemory(BackendConformance):
    """memory:// through the generic fsspec implementation."""

    @pytest.fixture
    def target(self, tmp_path):
        root = f"memory://aiturbo-test-{secrets.token_hex(4)}"
        yield Target(root, {"upload_tmp_dir": str(tmp_path)}, leftovers=lambda: upload_temps(str(tmp_path)))
        fsspec.filesystem("memory").rm(root, recursive=True)  # the store is process-wide

    async def test_unknown_protocol_is_config_error(self):
        with pytest.raises(ConfigError, match="nosuchproto"):
            await run(Target("nosuchproto://x"), lambda b: trio.sleep(0))

    async def test_temps_of_a_killed_uploader_go_at_the_next_upload_and_a_live_ones_stay(self, target: Target):
        """Parts are staged in the local temp dir: a kill -9 left them there for good."""
        await _dead_temps_go_and_live_ones_stay(target, "sub/a.bin", "sub/b.bin")

    async def test_remote_parts_not_supported(self, target: Target):
        async def body(b: Backend):
            assert not b.supports_remote_parts
            upload = await b.open_upload("k")
            with pytest.raises(NotSupported):
                await upload.token()
            with pytest.raises(NotSupported):
                upload.add_remote_part(0, 1, "1")
            with pytest.raises(NotSupported):
                await b.write_remote_part("k", "{}", 0, b"x")
            await upload.abort()

        await run(target, body)
        assert target.leftovers() == []


class TestS3(BackendConformance):
    """moto on loopback; every test gets its own bucket and works under a prefix."""

    # S3 answers NoSuchUpload (404); moto 5 fails with a KeyError, a 500.
    ended_upload_error = (BackendNotFound, TransientBackendError)

    @pytest.fixture
    def target(self, s3_server: S3Server) -> Target:
        bucket = s3_server.make_bucket(f"t-{secrets.token_hex(6)}")

        def pending_uploads() -> list[str]:
            listing = s3_server.client().list_multipart_uploads(Bucket=bucket)
            return [upload["Key"] for upload in listing.get("Uploads", [])]

        return Target(f"s3://{bucket}/pre/fix", {"s3_endpoint": s3_server.endpoint}, leftovers=pending_uploads)

    async def test_prefix_maps_keys(self, target: Target, s3_server: S3Server):
        bucket = target.url.split("/")[2]

        async def body(b: Backend):
            await put(b, "k", b"v")

        await run(target, body)
        keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]]
        assert keys == ["pre/fix/k"]
        whole = Target(f"s3://{bucket}", target.options)
        await run(whole, lambda b: _expect(names(b, "pre"), {"pre/fix": True}))

    async def test_hole_parts_copy_one_zero_object(self, target: Target, s3_server: S3Server):
        bucket = target.url.split("/")[2]

        async def sparse(b: Backend, key: str, holes: int) -> list[tuple[int, int]]:
            upload = await b.open_upload(key)
            got = [await upload.zero_part(i, P) for i in range(holes)]
            await upload.write_part(holes, b"tail")
            await upload.complete(holes * P + 4)
            return got

        async def body(b: Backend):
            # the first hole uploads the zero object, every hole is a copy of it
            assert await sparse(b, "a", 3) == [(P, P), (0, P), (0, P)]
            client = s3_server.client()
            zeros = f"pre/fix/{_s3.ZERO_OBJECT_PREFIX}{P}"
            client.put_object(Bucket=bucket, Key=zeros, Body=b"x" * P)  # replaced behind our back
            assert await sparse(b, "b", 1) == [(P, P)]  # noticed (etag), made again
            assert await read_all(b, "b") == bytes(P) + b"tail"
            assert await names(b, "") == {"a": False, "b": False}  # hidden from listings

        await run(target, body)
        # another process (a remount) finds the zero object and sends nothing
        await run(target, lambda b: _expect(sparse(b, "c", 2), [(0, P), (0, P)]))
        assert target.leftovers() == []

    async def test_complete_recovers_when_its_answer_is_lost(self, target: Target):
        data = os.urandom(P + 5)

        async def body(b: Backend):
            real_call = b._call

            async def lossy_call(what, method, **kwargs):
                result = await real_call(what, method, **kwargs)
                if method == "complete_multipart_upload" and kwargs["Key"].endswith("lost"):
                    # Done on the server, but a retry would find the upload gone.
                    raise BackendNotFound(f"{what}: NoSuchUpload (simulated)")
                return result

            b._call = lossy_call
            upload = await b.open_upload("lost")
            await upload.write_part(0, data[:P])
            await upload.write_part(1, data[P:])
            info = await upload.complete(len(data))
            assert info.etag.endswith("-2")  # the multipart ETag we computed matched the server's
            assert await read_all(b, "lost") == data

            async def gone_call(what, method, **kwargs):
                if method == "complete_multipart_upload":
                    raise BackendNotFound(f"{what}: NoSuchUpload (simulated)")
                return await real_call(what, method, **kwargs)

            b._call = gone_call
            upload = await b.open_upload("gone")
            await upload.write_part(0, data[:P])
            await upload.write_part(1, data[P:])
            await put(b, "gone", b"someone else's object")
            with pytest.raises(BackendNotFound):  # not this upload's object: do not claim success
                await upload.complete(len(data))
            await upload.abort()
            assert await read_all(b, "gone") == b"someone else's object"

        await run(target, body)

    async def test_token_of_another_prefix_rejected(self, target: Target):
        async def body(b: Backend):
            upload = await b.open_upload("k")
            token = await upload.token()
            elsewhere = await open_backend(target.url.replace("/pre/fix", "/pre/other"), target.options)
            try:
                with pytest.raises(InvalidArgument, match="is for s3://.*/pre/fix, not s3://.*/pre/other"):
                    await elsewhere.write_remote_part("k", token, 0, b"x")
            finally:
                await elsewhere.aclose()
            await upload.abort()

        await run(target, body)
        assert target.leftovers() == []

    async def test_copy_part_sends_copy_source_if_match(self, target: Target):
        # moto ignores CopySourceIfMatch (the HEAD before the copy catches a
        # change there); real S3 answers 412, mapped to SourceChanged.
        async def body(b: Backend):
            real_call, sent = b._call, []

            async def spy(what, method, **kwargs):
                if method == "upload_part_copy":
                    sent.append(kwargs.get("CopySourceIfMatch"))
                return await real_call(what, method, **kwargs)

            b._call = spy
            etag = (await put(b, "src", os.urandom(P))).etag
            upload = await b.open_upload("dst")
            await upload.copy_part(0, "src", 0, P, if_etag=etag)
            await upload.copy_part(0, "src", 0, P)
            await upload.complete(P)
            assert sent == [f'"{etag}"', None]

        await run(target, body)

    async def test_read_range_if_etag_is_one_conditional_get(self, target: Target):
        # IfMatch on the GetObject itself: a HEAD before the read would leave
        # a gap in which the object could be replaced (moto honours IfMatch
        # on ranged GETs, 412 before 416, as S3 does).
        async def body(b: Backend):
            real_call, real_get_body, calls, if_match = b._call, b._get_body, [], []

            async def spy_call(what, method, **kwargs):
                calls.append(method)
                return await real_call(what, method, **kwargs)

            async def spy_get_body(kwargs):
                if_match.append(kwargs.get("IfMatch"))
                return await real_get_body(kwargs)

            etag = (await put(b, "r", b"0123456789")).etag
            b._call, b._get_body = spy_call, spy_get_body
            assert await b.read_range("r", 2, 3, if_etag=etag) == b"234"
            assert await b.read_range("r", 2, 3) == b"234"
            assert (calls, if_match) == ([], [f'"{etag}"', None])

        await run(target, body)

    async def test_list_dir_pages(self, target: Target):
        async def body(b: Backend):
            b.list_page_keys = 2
            for name in ("a", "b", "c", "d/x", "e/y"):
                await put(b, f"many/{name}", b"x")
            assert await names(b, "many") == {
                "many/a": False, "many/b": False, "many/c": False, "many/d": True, "many/e": True
            }

        await run(target, body)

    async def test_missing_bucket_is_permanent(self, s3_server: S3Server):
        with pytest.raises(BackendError, match="no-such-bucket") as caught:
            await run(Target("s3://no-such-bucket", {"s3_endpoint": s3_server.endpoint}), lambda b: trio.sleep(0))
        assert not isinstance(caught.value, TransientBackendError)

    async def test_nothing_listening_is_transient(self):
        options = {"s3_endpoint": f"http://127.0.0.1:{free_port()}", "s3_connect_timeout": "0.5"}
        with pytest.raises(TransientBackendError):
            await run(Target("s3://bucket", options), lambda b: trio.sleep(0))

    async def test_ca_bundle_does_not_break_plain_http(self, target: Target, monkeypatch):
        monkeypatch.setenv("AWS_CA_BUNDLE", "/nonexistent/ca-bundle.pem")
        await run(target, lambda b: _expect(names(b, ""), {}))

    async def test_outage_is_transient_then_recovers(self):
        options = {"s3_connect_timeout": "0.5", "call_timeout_s": "10"}
        with S3Server() as server:
            server.make_bucket("outage")
            options["s3_endpoint"] = server.endpoint

            async def body(b: Backend):
                await put(b, "before", b"x")
                upload = await b.open_upload("during")
                server.stop()
                with pytest.raises(TransientBackendError):
                    await b.stat("before")
                with pytest.raises(TransientBackendError):
                    await upload.write_part(0, os.urandom(P))
                server.start()  # same port, empty: moto keeps no state
                server.make_bucket("outage")
                await put(b, "after", b"y")
                assert await read_all(b, "after") == b"y"

            await run(Target("s3://outage", options), body)

    async def test_options_from_strings(self, target: Target):
        options = {**target.options, "s3_anon": "false", "s3_region": "us-east-1", "call_timeout_s": "30"}
        await run(Target(target.url, options), lambda b: _expect(names(b, ""), {}))
        with pytest.raises(ConfigError, match="s3_anon"):
            await run(Target(target.url, {**target.options, "s3_anon": "maybe"}), lambda b: trio.sleep(0))


async def _expect(awaitable: Awaitable[Any], want: Any) -> None:
    assert await awaitable == want


# --- error mapping, without a server ---------------------------------------------------------


def _client_error(code: str, status: int) -> Exception:
    import botocore.exceptions

    response = {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return botocore.exceptions.ClientError(response, "PutObject")


@pytest.mark.parametrize(
    "code, status, want",
    [
        ("SlowDown", 503, TransientBackendError),
        ("InternalError", 500, TransientBackendError),
        ("RequestTimeout", 400, TransientBackendError),
        ("Throttling", 429, TransientBackendError),
        ("NoSuchKey", 404, BackendNotFound),
        ("404", 404, BackendNotFound),
        ("AccessDenied", 403, BackendError),
        ("InvalidRequest", 400, BackendError),
        ("NoSuchBucket", 404, BackendError),
        ("PreconditionFailed", 412, SourceChanged),
    ],
)
def test_s3_client_errors_mapped(code: str, status: int, want: type):
    with pytest.raises(BackendError) as caught, _s3._mapped("put 'k'"):
        raise _client_error(code, status)
    assert type(caught.value) is want
    assert "put 'k'" in str(caught.value) and code in str(caught.value)


def test_s3_connection_errors_are_transient():
    import botocore.exceptions as e

    for error in (
        e.EndpointConnectionError(endpoint_url="http://x"),
        e.ConnectTimeoutError(endpoint_url="http://x"),
        e.ReadTimeoutError(endpoint_url="http://x"),
        e.ConnectionClosedError(endpoint_url="http://x"),
        ConnectionResetError(),
        TimeoutError(),
    ):
        with pytest.raises(TransientBackendError), _s3._mapped("read 'k'"):
            raise error


def test_local_os_errors_mapped():
    cases = [
        (OSError(errno.ENOSPC, "No space left on device"), TransientBackendError),
        (OSError(errno.ESTALE, "Stale file handle"), TransientBackendError),
        (PermissionError(errno.EACCES, "Permission denied"), BackendError),
        (FileNotFoundError(errno.ENOENT, "No such file"), BackendNotFound),
    ]
    for error, want in cases:
        with pytest.raises(BackendError) as caught, _local._mapped("write 'k'"):
            raise error
        assert type(caught.value) is want
    assert caught.value.errno == errno.ENOENT


# --- keys, without a backend --------------------------------------------------------------------


def test_check_key():
    assert check_key("a/b.c") == "a/b.c"
    assert check_key("", allow_root=True) == ""
    assert check_key("..a/b..") == "..a/b.."  # dots inside names are fine
    for bad in ("", "/a", "a/", "a//b", "..", "a/../b", "x" * 5000):
        with pytest.raises(BackendError):
            check_key(bad)


async def test_open_backend_rejects_bad_urls():
    for url in ("relative/path", "nonsense"):
        with pytest.raises(ConfigError):
            await open_backend(url, {})


async def test_local_etag_changes_for_a_same_size_rewrite_within_one_mtime_tick(tmp_path):
    # A coarse clock (or a fast rewrite) gives two versions one mtime; the
    # etag must still tell them apart, or copy_part(if_etag=) takes the new
    # bytes for the old ones.
    async def body(b: Backend):
        old = await put(b, "obj", b"version one")
        mtime_ns = (tmp_path / "obj").stat().st_mtime_ns
        await put(b, "obj", b"version two")
        os.utime(tmp_path / "obj", ns=(mtime_ns, mtime_ns))
        new = await b.stat("obj")
        assert new is not None and new.size == old.size and new.mtime_ns == old.mtime_ns
        assert new.etag != old.etag

    await run(Target(f"file://{tmp_path}"), body)


@pytest.mark.parametrize("what", ["upload", "node", "move"])
async def test_local_write_below_a_parent_removed_while_it_is_made(tmp_path, monkeypatch, what):
    # The persister removes an empty directory left where a node must go
    # (Reconciler._place) while another job may be making that directory as
    # the parent of its own key: makedirs made d/, the other job removed it,
    # and the mkdir of d/sub failed with ENOENT (a file marked broken, CI).
    real_mkdir = os.mkdir
    raced: list[str] = []

    def mkdir(path, mode=0o777, *args, **kwargs):
        if (os.path.basename(os.fspath(path)) == "sub") and not raced:  # by its name, in d/'s fd
            raced.append(os.fspath(path))
            os.rmdir(tmp_path / "d")  # the other job's remove_dir of the empty d/
        return real_mkdir(path, mode, *args, **kwargs)

    async def body(b: Backend):
        monkeypatch.setattr(os, "mkdir", mkdir)
        if what == "upload":
            await put(b, "d/sub/x", b"below")
            assert await read_all(b, "d/sub/x") == b"below"
        elif what == "node":
            await b.write_node("d/sub/fifo", NodeAttrs(stat.S_IFIFO | 0o644, None, None, None, 0, None))
            assert stat.S_ISFIFO((tmp_path / "d" / "sub" / "fifo").lstat().st_mode)
        else:
            (tmp_path / "top").write_bytes(b"moved")
            await b.move("top", "d/sub/x")
            assert await read_all(b, "d/sub/x") == b"moved"
        assert raced, "the race was not staged"

    await run(Target(f"file://{tmp_path}"), body)
