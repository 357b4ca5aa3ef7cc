"""The reader's backend read retries (``ChunkFetcher.read_range``), on a fake backend and trio's mock clock."""

import logging
import types

import pytest
import trio
import trio.testing

from aiturbofs._errors import BackendNotFound, BackendUnreachable, TransientBackendError
from aiturbofs._limits import (
    BACKEND_CHECK_TIMEOUT_S,
    PERSIST_BACKOFF_JITTER,
    READ_BACKEND_TIMEOUT_S,
    READ_RETRY_ATTEMPTS,
    READ_RETRY_FIRST_S,
)
from aiturbofs.vfs._fetch import ChunkFetcher


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


def read(backend, health=None):
    """``read_range`` of 4 bytes at 8 through a fetcher over ``backend``; (fetcher, result or error)."""
    fetcher = ChunkFetcher(types.SimpleNamespace(backend=backend, health=health or Health()))

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
    with caplog.at_level(logging.INFO, logger="aiturbofs.vfs._fetch"):
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
    fetcher = ChunkFetcher(types.SimpleNamespace(backend=SilentBackend(), health=health))

    async def main():
        t0 = trio.current_time()
        with pytest.raises(BackendUnreachable, match="no answer within"):
            await fetcher.read_range("k", 0, 4)
        return trio.current_time() - t0

    took = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert took == pytest.approx(timeout_s) and len(health.downs) == 1


def test_the_deadline_also_ends_a_backoff(monkeypatch):
    from aiturbofs.vfs import _fetch

    monkeypatch.setattr(_fetch, "READ_RETRY_FIRST_S", 3 * READ_BACKEND_TIMEOUT_S)  # the first backoff outlasts it
    backend = FlakyBackend(READ_RETRY_ATTEMPTS, TransientBackendError("503"))
    health = Health()
    fetcher, got = read(backend, health)
    assert isinstance(got, BackendUnreachable) and f"no answer within {READ_BACKEND_TIMEOUT_S:g} s" in str(got)
    assert len(backend.reads) == 1 and fetcher.read_retries == 1 and len(health.downs) == 1
