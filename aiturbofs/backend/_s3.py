"""The S3 backend (``s3://bucket/optional/prefix``), on s3fs's client.

Owns: keys -> S3 object keys under the prefix, "directories" as common
prefixes, multipart uploads (lazily created, part ETags collected, one
PutObject for a lone short part, parts from other processes by UploadId),
server-side copies (conditional on the source's ETag), and the one place
botocore/aiohttp exceptions become backend errors (``_mapped``).

s3fs runs an asyncio loop in its own thread.  Requests are coroutines run on
that loop and awaited from trio through a future (``_on_loop``), behind a
``CapacityLimiter``: a timeout or cancellation then cancels the request on
the s3fs loop too, instead of abandoning a worker thread that would keep
reading the caller's buffer.  Nothing here retries (botocore's and s3fs's
retries are switched off): the persister owns retries and backoff.  The one
exception is an abort that failed: only this object knows the upload id, so
it aborts that upload again after the next publish and at close
(``_stale_uploads``), instead of leaving its parts in the bucket.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import errno
import hashlib
import logging
import stat
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import aiohttp
import botocore.exceptions as boto_errors
import s3fs
import trio

from .._errors import (
    BackendError,
    BackendNotFound,
    BackendUnreachable,
    ConfigError,
    InvalidArgument,
    SourceChanged,
    TransientBackendError,
)
from .._limits import (
    BACKEND_CONNECT_TIMEOUT_S,
    BACKEND_READ_TIMEOUT_S,
    BACKEND_THREADS_MAX,
    CHUNK_BYTES,
    LIST_ENTRIES_MAX,
    S3_COPY_OBJECT_BYTES_MAX,
    S3_KEY_BYTES_MAX,
    S3_OBJECT_BYTES_MAX,
    S3_PART_BYTES_MAX,
    S3_PART_BYTES_MIN,
    S3_PARTS_MAX,
    S3_PUT_BYTES_MAX,
    S3_STALE_UPLOADS_MAX,
    S3_ZERO_OBJECT_BYTES_MAX,
    SYMLINK_TARGET_BYTES_MAX,
    ZERO_BLOCK_BYTES,
)
from ._base import (
    UPLOAD_TEMP_PREFIX,
    Backend,
    Buffer,
    NodeAttrs,
    ObjectInfo,
    Upload,
    check_key,
    is_valid_name,
    join_key,
    make_token,
    option_bool,
    option_float,
    parse_token,
    take_options,
    timeout_option,
)

assert CHUNK_BYTES >= S3_PART_BYTES_MIN, "every part but the last must meet S3's minimum"

log = logging.getLogger(__name__)

T = TypeVar("T")
# Hidden objects of zeros, one per part size, that hole parts are copied
# from: S3 has no holes, so a sparse file's holes cost one upload of zeros
# per bucket prefix, then only UploadPartCopy requests.  The reserved
# upload-temp prefix keeps them out of every listing and every key.
ZERO_OBJECT_PREFIX = f"{UPLOAD_TEMP_PREFIX}zeros."
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
DIR_CONTENT_TYPE = "application/x-directory"  # of a directory marker, as s3fs-fuse writes it

# Error codes that say "try again later" even when the status is not 5xx.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "RequestTimeout",
        "RequestTimeoutException",
        "ServiceUnavailable",
        "InternalError",
        "OperationAborted",
    }
)
# The store is out of space or over its quota (MinIO, Ceph RGW, WebDAV-style
# 507): worth retrying, and reported as ENOSPC (writers learn it in the end).
_FULL_CODES = frozenset({"XMinioStorageFull", "StorageFull", "InsufficientStorage", "QuotaExceeded"})
# "The thing you named is gone" (HEAD answers carry only the status: "404").
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchUpload"})
# A conditional request's condition failed: CopySourceIfMatch on a copy,
# IfMatch on a read.
_CHANGED_CODES = frozenset({"PreconditionFailed", "412"})
# Connection trouble below the HTTP layer: refused, reset, timed out, DNS.
_TRANSIENT_EXCEPTIONS = (
    boto_errors.HTTPClientError,  # ReadTimeoutError, ConnectionClosedError...
    boto_errors.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError...
    aiohttp.ClientError,
    asyncio.TimeoutError,
    ConnectionError,
)
# Configuration trouble: no credentials, no region.  Permanent until fixed.
_CONFIG_EXCEPTIONS = (
    boto_errors.NoCredentialsError,
    boto_errors.PartialCredentialsError,
    boto_errors.NoRegionError,
)


@contextmanager
def _mapped(what: str) -> Iterator[None]:
    """The one place foreign exceptions become backend errors."""
    try:
        yield
    except trio.TooSlowError:
        raise BackendUnreachable(f"{what}: no answer in time") from None
    except boto_errors.ClientError as e:
        raise _client_error(what, e) from e
    except _TRANSIENT_EXCEPTIONS as e:
        raise BackendUnreachable(f"{what}: {type(e).__name__}: {e}") from e
    except _CONFIG_EXCEPTIONS as e:
        raise BackendError(f"{what}: {e}") from e


def _client_error(what: str, e: boto_errors.ClientError) -> BackendError:
    error = e.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    message = f"{what}: {code or status} {error.get('Message', '')}".rstrip()
    if code in _FULL_CODES or status == 507:
        return TransientBackendError(message, errno_=errno.ENOSPC)
    if code in _TRANSIENT_CODES or status >= 500 or status == 429:
        return TransientBackendError(message)
    if code in _NOT_FOUND_CODES:
        return BackendNotFound(message)
    if code in _CHANGED_CODES or status == 412:
        return SourceChanged(message)
    if status == 403:
        return BackendError(message, errno_=errno.EACCES)
    return BackendError(message)


async def _on_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on s3fs's asyncio loop and wait for it without a thread.

    If this task is cancelled (or its deadline passes), the coroutine is
    cancelled on its loop as well, so a request never outlives its caller.
    """
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_: object) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass  # the trio run is over: nobody is waiting any more

    future.add_done_callback(wake)
    try:
        await done.wait()
    finally:
        future.cancel()  # a no-op once done
    return future.result()


class S3Backend(Backend):
    """Objects are S3 objects under ``prefix``; directories are common prefixes.

    Options: ``s3_endpoint`` (endpoint URL), ``s3_region``, ``s3_anon``,
    ``s3_key`` / ``s3_secret`` (else AWS_* env vars and the boto chain),
    ``s3_connect_timeout`` (seconds, default BACKEND_CONNECT_TIMEOUT_S),
    ``s3_parts_max`` (the most parts of one multipart upload, default
    S3_PARTS_MAX: lower it for S3-compatible stores that allow fewer),
    ``s3_node_probe`` (default on: see ``node_probe_bytes_max``),
    ``call_timeout_s``.  ``makedirs`` is a no-op: S3 has no directories.
    ``move`` is a copy then a delete, not atomic.  Where an object ``a`` and
    a prefix ``a/`` both exist, ``list_dir`` returns both.

    Nodes follow s3fs-fuse: the object's ``x-amz-meta-mode`` (decimal
    st_mode) names its type, with ``uid``, ``gid``, ``mtime`` (seconds) and
    ``rdev`` beside it; a symlink's body is its target, a FIFO's or device's
    is empty, and a directory's node is the zero-byte marker ``key/``
    (``application/x-directory``), which ``remove_dir`` deletes once it is
    all that is left under the prefix.  Regular objects carry no attributes
    (``keeps_attrs`` is off: ``complete`` and ``copy`` ignore them).
    """

    supports_server_copy = True  # CopyObject / UploadPartCopy
    supports_remote_parts = True  # UploadPart with the owner's UploadId
    list_page_keys = 1000  # S3's own maximum; tests lower it to exercise paging
    node_kinds = frozenset({stat.S_IFDIR, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFSOCK})
    node_probe_bytes_max = SYMLINK_TARGET_BYTES_MAX  # a listing has no metadata: small objects are HEADed
    _OPTIONS = {"s3_endpoint", "s3_region", "s3_anon", "s3_key", "s3_secret", "s3_connect_timeout", "s3_parts_max",
                "s3_node_probe",
                "call_timeout_s"}

    def __init__(self, fs: s3fs.S3FileSystem, bucket: str, prefix: str, timeout_s: float, endpoint: str = "AWS",
                 parts_max: int = S3_PARTS_MAX):
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._endpoint = endpoint  # for messages
        # S3 names objects of up to 1024 bytes, the prefix and its slash included
        self.key_bytes_max = S3_KEY_BYTES_MAX - (len(prefix.encode()) + 1 if prefix else 0)
        # An upload of more chunks than parts_max sends parts of several chunks
        # (the persister's wide parts), up to S3's 5 GiB a part.
        self.parts_max: int = parts_max
        self.object_bytes_max = min(S3_OBJECT_BYTES_MAX, parts_max * S3_PART_BYTES_MAX)
        self._fs = fs
        self._bucket = bucket
        self._prefix = prefix
        self._timeout_s = timeout_s
        self._limiter = trio.CapacityLimiter(BACKEND_THREADS_MAX)
        # Multipart uploads whose abort failed (S3 down or answering 5xx):
        # upload id -> S3 key, aborted again after the next publish (S3 answers
        # again) and at close.  Without this an outage during an upload left
        # its parts in the bucket, invisible and billed, until a lifecycle rule.
        self._stale_uploads: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._zero_objects: dict[int, ObjectInfo] = {}  # part size -> its verified zero object
        self._zero_lock = trio.Lock()  # concurrent hole parts make the zero object once

    @classmethod
    async def open(cls, url: str, options: dict[str, Any], *, check: bool = True) -> S3Backend:
        """Connect and (with ``check``) check the bucket exists (one HeadBucket).

        Raises ``ConfigError`` for a bad URL or option, and what ``check`` raises.
        """
        take_options(options, cls._OPTIONS, "s3")
        bucket, prefix = _parse_url(url)
        backend = cls(_make_fs(options), bucket, prefix, timeout_option(options), options.get("s3_endpoint") or "AWS",
                      _parts_max_option(options))
        if not option_bool(options, "s3_node_probe", True):
            backend.node_probe_bytes_max = -1  # a HEAD per small new object costs a round trip each
        if check:
            await backend.check()
        return backend

    async def check(self) -> None:
        """One HeadBucket: ``BackendError`` naming the bucket if it is missing or
        forbidden, ``TransientBackendError`` if the endpoint does not answer."""
        await self._check_bucket(self._endpoint)

    async def list_dir(self, key: str) -> list[ObjectInfo]:
        check_key(key, allow_root=True)
        prefix = self._dir_prefix(key)
        out: list[ObjectInfo] = []
        kwargs = {"Bucket": self._bucket, "Prefix": prefix, "Delimiter": "/", "MaxKeys": self.list_page_keys}
        while True:  # one request (and one deadline) per page
            page = await self._call(f"list {key!r}", "list_objects_v2", **kwargs)
            out.extend(_page_entries(key, prefix, page))
            if len(out) > LIST_ENTRIES_MAX:
                raise BackendError(f"list {key!r}: more than {LIST_ENTRIES_MAX} entries")
            if not page.get("IsTruncated"):
                return out
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    async def stat(self, key: str) -> ObjectInfo | None:
        check_key(key, allow_root=True)
        if not key:
            return ObjectInfo("", 0, 0, None, True)
        info = await self._head(key)
        if info is not None:
            return info
        page = await self._call(
            f"stat {key!r}", "list_objects_v2", Bucket=self._bucket, Prefix=self._dir_prefix(key), MaxKeys=1
        )
        return ObjectInfo(key, 0, 0, None, True) if page.get("KeyCount", 0) else None

    async def read_range(self, key: str, offset: int, length: int, *, if_etag: str | None = None) -> bytes:
        """One (ranged) GetObject; with ``if_etag``, conditional on the ETag
        (``IfMatch``): the check and the bytes are one answer, and a
        replaced object answers 412, ``SourceChanged``."""
        check_key(key)
        if offset < 0 or length < 0:
            raise ValueError(f"read_range({key!r}, {offset}, {length}): negative")
        what = f"read {key!r}"
        if length == 0:
            info = await self._stat_object(key)  # still report a missing or replaced object
            if if_etag is not None and info.etag != if_etag:
                raise SourceChanged(f"{what}: the object's etag is {info.etag}, not {if_etag}")
            return b""
        kwargs = {"Bucket": self._bucket, "Key": self._s3_key(key), "Range": f"bytes={offset}-{offset + length - 1}"}
        if if_etag is not None:
            kwargs["IfMatch"] = f'"{if_etag}"'
        return await self._run(what, self._get_body, kwargs)

    async def _open_upload(self, key: str, part_bytes: int) -> S3Upload:
        if part_bytes < S3_PART_BYTES_MIN:
            raise ValueError(f"S3 parts must be at least {S3_PART_BYTES_MIN} bytes, not {part_bytes}")
        return S3Upload(self, key, part_bytes)

    async def _write_remote_part(self, key: str, token: str, index: int, data: Buffer, part_bytes: int) -> str:
        root, upload_id = parse_token(token, "s3", key, part_bytes, "root", "upload_id")
        if root != self.url:  # the same key under another bucket or prefix is another object
            raise InvalidArgument(f"upload token of {key!r} is for {root}, not {self.url}")
        _check_part_number(key, index, part_bytes, self.parts_max)
        return await self._upload_part(f"write remote part {index} of {key!r}", key, upload_id, index, data)

    async def copy(self, src: str, dst: str, *, attrs: NodeAttrs | None = None) -> None:
        """CopyObject, or UploadPartCopy part by part above S3_COPY_OBJECT_BYTES_MAX."""
        check_key(dst)
        info = await self._stat_object(src)
        if src == dst:
            return  # S3 refuses to copy an object onto itself unchanged
        if info.size > S3_COPY_OBJECT_BYTES_MAX:
            await self._copy_by_parts(info, dst)
            return
        await self._call(
            f"copy {src!r} to {dst!r}",
            "copy_object",
            Bucket=self._bucket,
            Key=self._s3_key(dst),
            CopySource={"Bucket": self._bucket, "Key": self._s3_key(src)},
        )

    async def move(self, src: str, dst: str) -> None:
        """Copy, then delete the source: a crash in between leaves both."""
        await self.copy(src, dst)
        if src != dst:
            await self.delete(src)

    async def delete(self, key: str) -> None:
        check_key(key)
        await self._call(f"delete {key!r}", "delete_object", Bucket=self._bucket, Key=self._s3_key(key))

    async def _write_node(self, key: str, node: NodeAttrs) -> None:
        is_dir = stat.S_ISDIR(node.mode)
        extra = {"ContentType": DIR_CONTENT_TYPE} if is_dir else {}
        await self._call(
            f"write node {key!r}", "put_object", Bucket=self._bucket,
            Key=self._dir_prefix(key) if is_dir else self._s3_key(key),
            Body=b"" if is_dir else (node.target or b""), Metadata=_node_metadata(node), **extra,
        )

    async def read_node(self, key: str) -> NodeAttrs | None:
        check_key(key)
        try:
            head = await self._call(f"stat {key!r}", "head_object", Bucket=self._bucket, Key=self._s3_key(key))
        except BackendNotFound:
            return None
        node = _node_from_metadata(head.get("Metadata") or {}, head.get("LastModified"))
        if node is None or stat.S_ISDIR(node.mode) or stat.S_ISREG(node.mode):
            return None  # a plain object (a directory is a prefix, never a node at ``key``)
        if stat.S_ISLNK(node.mode):
            size = head["ContentLength"]
            if not 0 < size <= SYMLINK_TARGET_BYTES_MAX:
                raise BackendError(f"symlink object {key!r} has a body of {size} bytes, not a target")
            target = await self.read_range(key, 0, size)
            node = dataclasses.replace(node, target=target)
        return node

    async def makedirs(self, key: str) -> None:
        check_key(key, allow_root=True)

    async def remove_dir(self, key: str) -> None:
        """Delete the directory marker ``key/`` if nothing else is under the prefix."""
        check_key(key, allow_root=True)
        if not key:
            return
        prefix = self._dir_prefix(key)
        page = await self._call(f"list {key!r}", "list_objects_v2", Bucket=self._bucket, Prefix=prefix, MaxKeys=2)
        if [o["Key"] for o in page.get("Contents", ())] == [prefix]:
            await self._call(f"delete marker of {key!r}", "delete_object", Bucket=self._bucket, Key=prefix)

    async def aclose(self) -> None:
        with trio.move_on_after(self._timeout_s):
            await self._abort_stale_uploads()
        if self._stale_uploads:
            log.warning("s3_uploads_left_open count=%d root=%s uploads=%s", len(self._stale_uploads),
                        self.url, ",".join(f"{k}:{u}" for u, k in self._stale_uploads.items()))
        # s3fs closes its client only when the filesystem is garbage
        # collected; close it now so no socket outlives the backend.
        with trio.move_on_after(self._timeout_s), _mapped("close"):
            await _on_loop(self._fs.loop, self._close_client())

    # -- helpers --

    async def _abort_upload(self, s3_key: str, upload_id: str) -> None:
        """Abort a multipart upload now, or remember it to abort later.

        Never raises ``TransientBackendError``: an upload the server may
        still hold is kept in ``_stale_uploads`` instead (the persister's
        retry opens a new upload, so nothing else would ever abort this one).
        """
        try:
            await self._call(
                f"abort upload of {s3_key!r}", "abort_multipart_upload",
                Bucket=self._bucket, Key=s3_key, UploadId=upload_id,
            )
        except BackendNotFound:
            pass  # already gone (an earlier abort whose answer was lost)
        except TransientBackendError as e:
            self._stale_uploads[upload_id] = s3_key
            while len(self._stale_uploads) > S3_STALE_UPLOADS_MAX:
                lost_id, lost_key = self._stale_uploads.popitem(last=False)
                log.warning("s3_upload_left_open key=%s upload_id=%s reason=too_many_stale_uploads", lost_key, lost_id)
            log.info("s3_abort_deferred key=%s upload_id=%s error=%r", s3_key, upload_id, str(e))
            return
        self._stale_uploads.pop(upload_id, None)

    async def _abort_stale_uploads(self) -> None:
        """One more abort of each upload whose abort failed (see ``_abort_upload``)."""
        for upload_id, s3_key in list(self._stale_uploads.items()):
            self._stale_uploads.pop(upload_id, None)
            try:
                await self._abort_upload(s3_key, upload_id)
            except BackendError as e:  # refused for good: nothing more to do about it
                log.warning("s3_upload_left_open key=%s upload_id=%s error=%r", s3_key, upload_id, str(e))

    async def _zero_object(self, size: int, stale: ObjectInfo | None = None) -> tuple[ObjectInfo, int]:
        """The hidden object of ``size`` zeros, and the bytes sent to make it (0 if it was there).

        One found in the bucket is used only if its size and MD5 ETag say it
        holds zeros.  ``stale``: that version failed a copy (removed or
        replaced): write it again.
        """
        key = f"{ZERO_OBJECT_PREFIX}{size}"
        async with self._zero_lock:
            info = self._zero_objects.get(size)
            if info is not None and info != stale:
                return info, 0
            info = None if stale is not None else await self._head(key)
            sent = 0
            if info is None or info.size != size or info.etag != await trio.to_thread.run_sync(_zeros_md5, size):
                await self._call(f"write zero object {key!r}", "put_object", Bucket=self._bucket,
                                 Key=self._s3_key(key), Body=bytes(size))
                sent = size
                info = await self._head(key)
                if info is None or info.size != size:
                    raise BackendError(f"write zero object {key!r}: the server has {info}, not {size} bytes")
                log.info("s3_zero_object key=%s size=%d (hole parts are copied from it)", self._s3_key(key), size)
            self._zero_objects[size] = info
            return info, sent

    def _s3_key(self, key: str) -> str:
        return join_key(self._prefix, key) if key else self._prefix

    async def _upload_part(self, what: str, key: str, upload_id: str, index: int, data: Buffer) -> str:
        response = await self._call(
            what,
            "upload_part",
            Bucket=self._bucket,
            Key=self._s3_key(key),
            UploadId=upload_id,
            PartNumber=index + 1,
            Body=data,
        )
        return response["ETag"]

    def _dir_prefix(self, key: str) -> str:
        full = self._s3_key(key)
        return f"{full}/" if full else ""

    async def _check_bucket(self, endpoint: str) -> None:
        try:
            await self._call(f"bucket {self._bucket!r}", "head_bucket", Bucket=self._bucket)
        except TransientBackendError:
            raise
        except BackendNotFound:
            raise BackendError(f"bucket {self._bucket!r} does not exist at {endpoint}") from None
        except BackendError as e:
            raise BackendError(f"bucket {self._bucket!r} at {endpoint} cannot be used: {e}", errno_=e.errno) from None

    async def _head(self, key: str) -> ObjectInfo | None:
        try:
            head = await self._call(f"stat {key!r}", "head_object", Bucket=self._bucket, Key=self._s3_key(key))
        except BackendNotFound:
            return None
        return ObjectInfo(key, head["ContentLength"], _mtime_ns(head.get("LastModified")), _etag(head), False)

    async def _call(self, what: str, method: str, **kwargs: Any) -> dict[str, Any]:
        return await self._run(what, self._client_call, method, kwargs)

    async def _run(self, what: str, coro_fn, *args: Any):
        with _mapped(what):
            with trio.fail_after(self._timeout_s):  # waiting for a slot counts
                async with self._limiter:
                    return await _on_loop(self._fs.loop, coro_fn(*args))

    # Coroutines below run on s3fs's asyncio loop, never on trio's.

    async def _client_call(self, method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        client = await self._fs.set_session()
        return await getattr(client, method)(**kwargs)

    async def _get_body(self, kwargs: dict[str, Any]) -> bytes:
        client = await self._fs.set_session()
        try:
            response = await client.get_object(**kwargs)
        except boto_errors.ClientError as e:
            if e.response.get("Error", {}).get("Code") == "InvalidRange":
                # The object exists and ends before the range starts; an
                # IfMatch is judged before the range (RFC 9110 13.2.2), so
                # it is the version asked for.
                return b""
            raise
        async with response["Body"] as body:
            return await body.read()

    async def _close_client(self) -> None:
        creator = getattr(self._fs, "_s3creator", None)
        if getattr(self._fs, "_s3", None) is not None and creator is not None:
            self._fs._s3 = None
            await creator.__aexit__(None, None, None)


class S3Upload(Upload):
    """A multipart upload created on the first stored part.

    A short part 0 (under S3_PUT_BYTES_MAX) is the whole object: it is copied
    and sent as one PutObject at ``complete``, which saves two requests per
    small file.  Parts are capped at the backend's ``parts_max`` (``BackendError``
    with EFBIG beyond).
    """

    def __init__(self, backend: S3Backend, key: str, part_bytes: int):
        super().__init__(key, part_bytes)
        self._b = backend
        self._s3_key = backend._s3_key(key)
        self._upload_id: str | None = None
        self._create_lock = trio.Lock()
        self._etags: dict[int, str] = {}
        self._small: bytes | None = None  # a short part 0, sent at complete
        self._sources: dict[str, ObjectInfo] = {}
        self._published = False

    async def _write_part(self, index: int, data: Buffer) -> None:
        _check_part_number(self.key, index, self.part_bytes, self._b.parts_max)
        if index == 0 and len(data) < min(self.part_bytes, S3_PUT_BYTES_MAX):
            self._small = bytes(data)  # data is only borrowed until we return
            self._etags.pop(0, None)
            return
        upload_id = await self._multipart_id()
        etag = await self._b._upload_part(f"write part {index} of {self.key!r}", self.key, upload_id, index, data)
        self._store_etag(index, etag)

    async def _copy_part(self, index: int, src_key: str, offset: int, length: int, if_etag: str | None) -> None:
        _check_part_number(self.key, index, self.part_bytes, self._b.parts_max)
        what = f"copy {src_key!r}[{offset}:{offset + length}] to part {index} of {self.key!r}"
        await self._check_source(what, src_key, offset + length, if_etag)
        upload_id = await self._multipart_id()
        condition = {} if if_etag is None else {"CopySourceIfMatch": f'"{if_etag}"'}
        response = await self._b._call(
            what,
            "upload_part_copy",
            Bucket=self._b._bucket,
            Key=self._s3_key,
            UploadId=upload_id,
            PartNumber=index + 1,
            CopySource={"Bucket": self._b._bucket, "Key": self._b._s3_key(src_key)},
            CopySourceRange=f"bytes={offset}-{offset + length - 1}",
            **condition,
        )
        self._store_etag(index, response["CopyPartResult"]["ETag"])

    async def _zero_part(self, index: int, length: int) -> tuple[int, int]:
        _check_part_number(self.key, index, self.part_bytes, self._b.parts_max)
        if (index == 0 and length < min(self.part_bytes, S3_PUT_BYTES_MAX)) or self.part_bytes > S3_ZERO_OBJECT_BYTES_MAX:
            return await super()._zero_part(index, length)  # a small object goes whole in one PutObject anyway
        src, sent = await self._b._zero_object(self.part_bytes)
        try:
            await self._copy_part(index, src.key, 0, length, src.etag)
        except (SourceChanged, BackendNotFound) as exc:
            log.warning("s3_zero_object_changed key=%s error=%r (writing it again)", src.key, str(exc))
            src, again = await self._b._zero_object(self.part_bytes, stale=src)
            sent += again
            await self._copy_part(index, src.key, 0, length, src.etag)
        return sent, length

    async def _token(self) -> str:
        upload_id = await self._multipart_id()
        return make_token("s3", self.key, self.part_bytes, root=self._b.url, upload_id=upload_id)

    def _add_remote_part(self, index: int, length: int, receipt: str) -> None:
        _check_part_number(self.key, index, self.part_bytes, self._b.parts_max)
        if self._upload_id is None:
            raise ValueError(f"remote part {index} of {self.key!r} added before any token was handed out")
        self._store_etag(index, receipt)

    async def _complete(self, size: int, part_count: int, attrs: NodeAttrs | None) -> ObjectInfo:
        if not self._published:  # a retried complete goes straight to the check
            put = await self._publish(part_count)
            self._published = True
            await self._b._abort_stale_uploads()  # S3 answers again
            if put is not None and put[0] == size:
                # One PutObject of the whole body: its answer has the ETag, and
                # its size is the body's (no copy range to check): no HEAD.
                return ObjectInfo(self.key, size, 0, _etag(put[1]), False)
        info = await self._b._head(self.key)
        # Check the other side of the boundary: S3 servers differ in how they
        # treat odd copy ranges, and a wrong size must not pass silently.
        if info is None or info.size != size:
            raise BackendError(f"publish {self.key!r}: expected {size} bytes, the server has {info}")
        return info

    async def _abort(self) -> None:
        self._small = None
        await self._discard_multipart()

    # -- helpers --

    async def _publish(self, part_count: int) -> tuple[int, dict[str, Any]] | None:
        """Make the object; for a PutObject, the body's length and the answer."""
        if part_count == 0 or (part_count == 1 and self._small is not None):
            body = (self._small or b"") if part_count else b""
            answer = await self._b._call(f"publish {self.key!r}", "put_object", Bucket=self._b._bucket,
                                         Key=self._s3_key, Body=body)
            await self._discard_multipart()  # one started for an earlier version of part 0
            return len(body), answer
        await self._complete_multipart(part_count)
        return None

    async def _discard_multipart(self) -> None:
        if self._upload_id is None:
            return
        upload_id, self._upload_id = self._upload_id, None
        await self._b._abort_upload(self._s3_key, upload_id)

    def _store_etag(self, index: int, etag: str) -> None:
        self._etags[index] = etag
        if index == 0:
            self._small = None  # the multipart version of part 0 is now the latest

    async def _multipart_id(self) -> str:
        async with self._create_lock:  # concurrent first parts create it once
            if self._upload_id is None:
                response = await self._b._call(
                    f"start upload of {self.key!r}",
                    "create_multipart_upload",
                    Bucket=self._b._bucket,
                    Key=self._s3_key,
                )
                self._upload_id = response["UploadId"]
            return self._upload_id

    async def _check_source(self, what: str, src_key: str, end: int, if_etag: str | None) -> None:
        # Some S3 servers (moto) copy a range past the end short, silently,
        # and ignore CopySourceIfMatch: a conditional copy looks afresh.
        info = self._sources.get(src_key)
        if info is None or if_etag is not None:
            info = await self._b._head(src_key)
            if info is None:
                raise BackendNotFound(f"{what}: no such source object")
            self._sources[src_key] = info
        if if_etag is not None and info.etag != if_etag:
            raise SourceChanged(f"{what}: the source's etag is {info.etag}, not {if_etag}")
        if end > info.size:
            raise BackendError(f"{what}: the source ends at byte {info.size}")

    async def _complete_multipart(self, part_count: int) -> None:
        etags = [self._etags[i] for i in range(part_count)]
        parts = [{"PartNumber": i + 1, "ETag": etag} for i, etag in enumerate(etags)]
        try:
            await self._b._call(
                f"publish {self.key!r}",
                "complete_multipart_upload",
                Bucket=self._b._bucket,
                Key=self._s3_key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BackendNotFound:
            # The upload is gone: if an earlier attempt completed it and only
            # the answer was lost, the object carries this upload's ETag.
            info = await self._b._head(self.key)
            if info is None or info.etag != _multipart_etag(etags):
                raise
        self._upload_id = None


# --- pure helpers ---------------------------------------------------------------------------


def _check_part_number(key: str, index: int, part_bytes: int, parts_max: int) -> None:
    if index >= parts_max:
        raise BackendError(
            f"{key!r}: part {index} is beyond the store's {parts_max} parts ({parts_max * part_bytes} bytes at most)",
            errno_=errno.EFBIG,
        )
    if part_bytes > S3_PART_BYTES_MAX:
        raise ValueError(f"{key!r}: parts of {part_bytes} bytes exceed S3's {S3_PART_BYTES_MAX}")


def _parts_max_option(options: dict[str, Any]) -> int:
    value = options.get("s3_parts_max", S3_PARTS_MAX)
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"backend option s3_parts_max={value!r} is not a whole number") from None
    if not 1 <= number <= S3_PARTS_MAX:
        raise ConfigError(f"backend option s3_parts_max={value!r} must be 1..{S3_PARTS_MAX}")
    return number


def _parse_url(url: str) -> tuple[str, str]:
    rest = url[len("s3://") :] if url.startswith("s3://") else ""
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not bucket:
        raise ConfigError(f"S3 backend {url!r}: want s3://bucket[/prefix]")
    try:
        check_key(prefix, allow_root=True)
    except BackendError as e:
        raise ConfigError(f"S3 backend {url!r}: bad prefix: {e}") from None
    return bucket, prefix


def _make_fs(options: dict[str, Any]) -> s3fs.S3FileSystem:
    endpoint = options.get("s3_endpoint")
    client_kwargs: dict[str, Any] = {}
    if options.get("s3_region"):
        client_kwargs["region_name"] = options["s3_region"]
    if endpoint and str(endpoint).startswith("http://"):
        # aiobotocore loads AWS_CA_BUNDLE for every connection, even plain
        # HTTP ones, and a bundle path that does not exist here would then
        # fail every request.  TLS settings cannot matter to plain HTTP.
        client_kwargs["verify"] = False
    config_kwargs = {
        "connect_timeout": option_float(options, "s3_connect_timeout", BACKEND_CONNECT_TIMEOUT_S),
        "read_timeout": BACKEND_READ_TIMEOUT_S,
        "retries": {"total_max_attempts": 1},  # the persister owns retries
        "max_pool_connections": BACKEND_THREADS_MAX,
        # botocore's type check refuses memoryview bodies, which would force
        # a copy of every part; the types we send are fixed by this module.
        "parameter_validation": False,
        # Only where S3 requires one: newer default checksums break many
        # S3-compatible servers, and chunks carry BLAKE3 end to end anyway.
        "request_checksum_calculation": "when_required",
        "response_checksum_validation": "when_required",
    }
    fs = s3fs.S3FileSystem(
        anon=option_bool(options, "s3_anon", False),
        key=options.get("s3_key"),
        secret=options.get("s3_secret"),
        endpoint_url=endpoint,
        client_kwargs=client_kwargs,
        config_kwargs=config_kwargs,
        skip_instance_cache=True,
        use_listings_cache=False,
    )
    fs.retries = 1  # s3fs's own retry loop (SlowDown, timeouts): one attempt only
    return fs


def _page_entries(key: str, prefix: str, page: dict[str, Any]) -> Iterator[ObjectInfo]:
    for common in page.get("CommonPrefixes", ()):
        name = common["Prefix"][len(prefix) :].rstrip("/")
        if is_valid_name(name):
            yield ObjectInfo(join_key(key, name), 0, 0, None, True)
    for obj in page.get("Contents", ()):
        name = obj["Key"][len(prefix) :]
        if is_valid_name(name):  # skips the "dir/" marker object and unusable names
            yield ObjectInfo(join_key(key, name), obj["Size"], _mtime_ns(obj.get("LastModified")), _etag(obj), False)


def _node_metadata(node: NodeAttrs) -> dict[str, str]:
    """s3fs-fuse's user metadata of a node (x-amz-meta-*: decimal strings)."""
    meta = {"mode": str(node.mode)}
    if node.uid is not None:
        meta["uid"] = str(node.uid)
    if node.gid is not None:
        meta["gid"] = str(node.gid)
    if node.mtime_ns is not None:
        meta["mtime"] = str(node.mtime_ns // 1_000_000_000)
    if node.rdev:
        meta["rdev"] = str(node.rdev)
    return meta


def _node_from_metadata(meta: dict[str, str], last_modified: datetime | None) -> NodeAttrs | None:
    """The node s3fs-fuse-style metadata describes; None without a usable mode."""
    def number(name: str) -> int | None:
        try:
            return int(float(meta[name]))  # mtime may carry a fraction
        except (KeyError, ValueError):
            return None

    mode = number("mode")
    if mode is None or not 0 < mode < 1 << 32:
        return None
    mtime_s = number("mtime")
    mtime_ns = mtime_s * 1_000_000_000 if mtime_s is not None else (_mtime_ns(last_modified) or None)
    return NodeAttrs(mode, number("uid"), number("gid"), mtime_ns, number("rdev") or 0)


def _mtime_ns(when: datetime | None) -> int:
    if when is None:
        return 0
    return (when - _EPOCH) // timedelta(microseconds=1) * 1000


def _etag(head: dict[str, Any]) -> str | None:
    etag = head.get("ETag")
    return etag.strip('"') if etag else None


def _zeros_md5(size: int) -> str:
    """The ETag S3 gives one PutObject of ``size`` zeros (hashed piecewise)."""
    h = hashlib.md5()
    block = memoryview(bytes(ZERO_BLOCK_BYTES))
    for start in range(0, size, ZERO_BLOCK_BYTES):
        h.update(block[: min(ZERO_BLOCK_BYTES, size - start)])
    return h.hexdigest()


def _multipart_etag(etags: list[str]) -> str | None:
    """The ETag S3 gives an object completed from parts with these ETags."""
    try:
        digests = b"".join(bytes.fromhex(etag.strip('"')) for etag in etags)
    except ValueError:
        return None  # not MD5 ETags (e.g. SSE-KMS): cannot tell
    return f"{hashlib.md5(digests).hexdigest()}-{len(etags)}"
