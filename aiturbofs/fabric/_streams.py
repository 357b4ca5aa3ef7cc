"""Shared pieces of the stream protocol: the error edge, chunk checks, farewells.

``stream_errors`` is the one place where a stream's foreign exceptions
(trio's Broken/ClosedResourceError, OSError, timeouts) become ``PeerBroken``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import trio

from .. import chunk
from .._errors import PeerBroken
from .._limits import FABRIC_ERROR_SEND_TIMEOUT_S, HASH_INLINE_BYTES_MAX
from ._wire import FrameType, encode_message, send_frame

log = logging.getLogger("aiturbofs.fabric")

StreamHandler = Callable[[trio.abc.Stream, str], Awaitable[None]]


@contextmanager
def stream_errors(what: str) -> Iterator[None]:
    """Map a stream's foreign exceptions to ``PeerBroken`` (the one place that does)."""
    try:
        yield
    except trio.TooSlowError:
        raise PeerBroken(f"{what}: timed out") from None
    except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
        cause = e.__cause__ or e
        raise PeerBroken(f"{what}: connection lost ({cause or type(cause).__name__})") from e
    except OSError as e:
        raise PeerBroken(f"{what}: {e.strerror or e}") from e


async def verify_chunk(data, key: bytes, what: str, limiter: trio.CapacityLimiter) -> None:
    """``IntegrityError`` unless ``data`` hashes to ``key``; big chunks hash in a worker thread."""
    if len(data) > HASH_INLINE_BYTES_MAX:
        await trio.to_thread.run_sync(chunk.verify, data, key, what, limiter=limiter)
    else:
        chunk.verify(data, key, what)


async def send_error(stream: trio.abc.Stream, message: str, request_id: int = 0) -> None:
    """Tell a peer why it is being dropped, if it still listens (best effort, short bound)."""
    with trio.move_on_after(FABRIC_ERROR_SEND_TIMEOUT_S):
        try:
            await send_frame(stream, FrameType.ERROR, request_id, body=encode_message(message))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
