"""The chunk store (``aiturbofs.store``) on fake backends: a reader's backend read retries
(``ChunkStore.read_range``, on trio's mock clock), and named chunks of imported objects."""

import logging
import os

import pytest
import trio
import trio.testing

from aiturbofs import chunk
from aiturbofs._errors import BackendNotFound, BackendUnreachable, SourceChanged, TransientBackendError
from aiturbofs._limits import (
    BACKEND_CHECK_TIMEOUT_S,
    CHUNK_BYTES,
    PERSIST_BACKOFF_JITTER,
    READ_BACKEND_TIMEOUT_S,
    READ_RETRY_ATTEMPTS,
    READ_RETRY_FIRST_S,
)
from aiturbofs.cluster import SingleNode
from aiturbofs.meta import InodeRow
from aiturbofs.staging import SpillStore, StagingPool
from aiturbofs.store import ChunkStore, external_key


class FlakyBackend:
    """Fails the first ``failures`` reads with ``error``; records when each read came (trio's clock)."""

    def __init__(self, failures: int, error: Exception):
        self.failures = failures
        self.error = error
        self.reads: list[float] = []

    async def read_range(self, key, offset, length, *, if_etag=None):
        self.reads.append(trio.current_time())
        if len(self.reads) <= self.failures:
            raise self.error
        return b"x" * length


class Health:
    def __init__(self, available: bool = True):
        self.available = available
        self.downs: list[str] = []
        self.ups = 0

    def mark_down(self, why: str) -> None:
        self.downs.append(why)

    def mark_up(self) -> None:
        self.ups += 1


def store_over(backend, health) -> ChunkStore:
    """A chunk store over ``backend`` alone (its backend reads need nothing else)."""
    return ChunkStore(None, backend, None, None, health, record_error=print)  # type: ignore[arg-type]


def read(backend, health=None):
    """``read_range`` of 4 bytes at 8 through a fetcher over ``backend``; (fetcher, result or error)."""
    fetcher = store_over(backend, health or Health())

    async def main():
        try:
            return await fetcher.read_range("k", 8, 4)
        except Exception as exc:  # noqa: BLE001  (the test looks at it)
            return exc

    return fetcher, trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def test_transient_errors_are_retried_with_jittered_doubling_backoff(caplog):
    backend = FlakyBackend(READ_RETRY_ATTEMPTS - 1, TransientBackendError("503 slow down"))
    with caplog.at_level(logging.INFO, logger="aiturbofs.store._store"):
        fetcher, got = read(backend)
    assert got == b"xxxx"
    assert len(backend.reads) == READ_RETRY_ATTEMPTS and fetcher.read_retries == READ_RETRY_ATTEMPTS - 1
    for n, gap in enumerate(gaps(backend.reads)):
        backoff = READ_RETRY_FIRST_S * 2**n
        assert backoff * (1 - PERSIST_BACKOFF_JITTER) <= gap <= backoff + 1e-9, (n, gap)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("read_retry ")]
    assert lines[0] == "read_retry key=k offset=8 error='503 slow down' retry_in_s=0.2"
    assert [line.rsplit("=", 1)[1] for line in lines] == ["0.2", "0.4", "0.8", "1.6"]


def test_the_last_transient_error_reaches_the_reader_as_it_is():
    error = TransientBackendError("503 slow down")
    backend = FlakyBackend(READ_RETRY_ATTEMPTS, error)
    fetcher, got = read(backend)
    assert got is error
    assert len(backend.reads) == READ_RETRY_ATTEMPTS and fetcher.read_retries == READ_RETRY_ATTEMPTS - 1


def test_other_errors_are_not_retried():
    error = BackendNotFound("no such key")
    backend = FlakyBackend(1, error)
    fetcher, got = read(backend)
    assert got is error and len(backend.reads) == 1 and fetcher.read_retries == 0


def test_an_unreachable_backend_is_marked_down_after_the_retries():
    health = Health()
    backend = FlakyBackend(READ_RETRY_ATTEMPTS, BackendUnreachable("connection refused"))
    _, got = read(backend, health)
    assert isinstance(got, BackendUnreachable) and len(backend.reads) == READ_RETRY_ATTEMPTS
    assert health.downs == ["connection refused"] and health.ups == 0


def test_while_the_backend_is_unavailable_a_read_gets_one_try():
    health = Health(available=False)
    backend = FlakyBackend(1, TransientBackendError("503"))
    fetcher, got = read(backend, health)
    assert isinstance(got, TransientBackendError) and len(backend.reads) == 1 and fetcher.read_retries == 0


class SilentBackend:
    async def read_range(self, key, offset, length, *, if_etag=None):
        await trio.sleep_forever()


@pytest.mark.parametrize(("available", "timeout_s"), [(True, READ_BACKEND_TIMEOUT_S), (False, BACKEND_CHECK_TIMEOUT_S)])
def test_a_backend_that_does_not_answer_fails_the_read_within_its_deadline(available, timeout_s):
    health = Health(available)
    fetcher = store_over(SilentBackend(), health)

    async def main():
        t0 = trio.current_time()
        with pytest.raises(BackendUnreachable, match="no answer within"):
            await fetcher.read_range("k", 0, 4)
        return trio.current_time() - t0

    took = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert took == pytest.approx(timeout_s) and len(health.downs) == 1


def test_the_deadline_also_ends_a_backoff(monkeypatch):
    from aiturbofs.store import _store

    monkeypatch.setattr(_store, "READ_RETRY_FIRST_S", 3 * READ_BACKEND_TIMEOUT_S)  # the first backoff outlasts it
    backend = FlakyBackend(READ_RETRY_ATTEMPTS, TransientBackendError("503"))
    health = Health()
    fetcher, got = read(backend, health)
    assert isinstance(got, BackendUnreachable) and f"no answer within {READ_BACKEND_TIMEOUT_S:g} s" in str(got)
    assert len(backend.reads) == 1 and fetcher.read_retries == 1 and len(health.downs) == 1


class ObjectBackend:
    """One object ``obj`` at etag ``e1``; counts reads, answers ``SourceChanged`` for another etag."""

    def __init__(self, body: bytes):
        self.body = body
        self.etag = "e1"
        self.reads = 0

    async def read_range(self, key, offset, length, *, if_etag=None):
        self.reads += 1
        await trio.sleep(0.01)  # long enough for the other readers to miss too
        if if_etag is not None and if_etag != self.etag:
            raise SourceChanged(f"{key}: etag {self.etag}, asked for {if_etag}")
        return self.body[offset:offset + length]


def test_concurrent_reads_of_a_named_chunk_fetch_and_hash_it_once(tmp_path):
    """A chunk of an object imported without a manifest, read by three tasks
    at once: one backend read, the bytes for all three, its BLAKE3 handed to
    the one call that fetched it (for the manifest) and known by name after;
    an object replaced in the bucket fails the read and is recorded."""
    body = os.urandom(3 * CHUNK_BYTES // 2)
    backend = ObjectBackend(body)
    errors: list[str] = []
    pool = StagingPool(4 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    store = ChunkStore(None, backend, pool, SingleNode(), Health(), record_error=errors.append)  # type: ignore[arg-type]
    row = InodeRow(ino=9, mode=0o100644, uid=0, gid=0, size=len(body), nlink=1, atime_ns=0, mtime_ns=0, ctime_ns=0,
                   backend_keys=["obj"], backend_etag="e1")

    async def main():
        got: list[tuple[bytes, bytes | None]] = []

        async def one():
            data, digest = await store.read_named(row, 1, len(body) - CHUNK_BYTES)
            got.append((bytes(data), digest))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
        return got

    got = trio.run(main)
    tail = body[CHUNK_BYTES:]
    assert backend.reads == 1 and [data for data, _ in got] == [tail] * 3
    digests = [d for _, d in got if d is not None]
    assert digests == [chunk.digest(tail)] and store.content_key(external_key(row, 1)) == digests[0]
    assert store.bytes_fetched == len(tail) and pool.has(external_key(row, 1))

    backend.etag = "e2"  # replaced in the bucket: chunk 0 (not read yet) must not come back under its old name

    async def stale():
        with pytest.raises(SourceChanged):
            await store.read_named(row, 0, CHUNK_BYTES)

    trio.run(stale)
    assert len(errors) == 1 and "changed in the backend since it was imported" in errors[0]
    assert not pool.has(external_key(row, 0)) and store.content_key(external_key(row, 0)) is None
