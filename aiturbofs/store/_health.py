"""Whether the backend answers: checked at mount, probed while it does not.

Owns the node's one view of the backend's availability.  A backend that does
not answer (at mount: refused, timed out or 5xx; later: a listing or read that
got no answer at all, ``BackendUnreachable``) is *unavailable*: the mount
still comes up and serves from the metadata and the staging pool, the
importer answers from the metadata instead of listing, readers fail fast,
and a probe asks the backend again with backoff until it answers.  A backend
that answers "no" for good (missing bucket, 403) is a configuration error:
at mount it fails the mount, like before.  Must never retry an operation
for a caller: it only says what the last answer was.
"""

import logging
import random
import time
from collections.abc import Callable

import trio

from .._errors import BackendError, BackendUnreachable, TransientBackendError
from .._limits import BACKEND_CHECK_TIMEOUT_S, BACKEND_PROBE_FIRST_S, BACKEND_PROBE_MAX_S, PERSIST_BACKOFF_JITTER
from ..backend import Backend

log = logging.getLogger(__name__)


class BackendHealth:
    """Available or unavailable since when and why (see module doc)."""

    def __init__(self, backend: Backend, record_error: Callable[[str], None]):
        self._backend = backend
        self._on_up: list[Callable[[], None]] = []
        self._record_error = record_error
        self.down_since: float | None = None  # time.time() when it stopped answering
        self.down_since_monotonic = 0.0
        self.reason = ""
        self._nursery: trio.Nursery | None = None
        self._probing = False

    def when_up(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` whenever the backend answers again after being unavailable."""
        self._on_up.append(fn)

    @property
    def available(self) -> bool:
        return self.down_since is None

    async def check_at_mount(self, nursery: trio.Nursery) -> None:
        """Ask the backend once, for at most BACKEND_CHECK_TIMEOUT_S.

        Raises ``BackendError`` for a configuration error (the mount fails);
        a backend that does not answer is only marked unavailable.
        """
        self._nursery = nursery
        try:
            await self._check()
        except TransientBackendError as exc:
            self.mark_down(str(exc), at_mount=True)

    def mark_down(self, reason: str, *, at_mount: bool = False) -> None:
        """The backend did not answer (``reason``): start probing it."""
        if self.down_since is not None:
            return
        self.down_since, self.down_since_monotonic, self.reason = time.time(), time.monotonic(), reason
        if at_mount:
            log.warning("backend unavailable at mount (%s); serving from metadata and the staging pool, "
                        "importing when it answers", reason)
        else:
            log.warning("backend_unavailable reason=%r (serving from metadata and the staging pool; probing it)", reason)
        if self._nursery is not None and not self._probing:
            self._probing = True
            self._nursery.start_soon(self._probe)

    def mark_up(self) -> None:
        """The backend answered a call."""
        if self.down_since is None:
            return
        log.warning("backend answers again after %.0f s unavailable: importing and persisting",
                    time.monotonic() - self.down_since_monotonic)
        self.down_since, self.reason = None, ""
        for fn in self._on_up:
            fn()

    def status(self) -> dict:
        since = None if self.down_since is None else time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.down_since))
        return {"available": self.available, "since": since, "reason": self.reason}

    async def _check(self) -> None:
        try:
            with trio.fail_after(BACKEND_CHECK_TIMEOUT_S):
                await self._backend.check()
        except trio.TooSlowError:
            raise BackendUnreachable(f"{self._backend.url}: no answer within {BACKEND_CHECK_TIMEOUT_S:g} s") from None

    async def _probe(self) -> None:
        backoff = BACKEND_PROBE_FIRST_S
        refused = ""
        try:
            while self.down_since is not None:
                await trio.sleep(backoff * random.uniform(1.0 - PERSIST_BACKOFF_JITTER, 1.0))
                if self.down_since is None:
                    return  # another call got through meanwhile
                try:
                    await self._check()
                except TransientBackendError as exc:
                    self.reason = str(exc)
                    backoff = min(backoff * 2, BACKEND_PROBE_MAX_S)
                    continue
                except BackendError as exc:
                    # It answers, but refuses what the mount needs (the bucket
                    # was deleted meanwhile): say so once, and keep probing.
                    if str(exc) != refused:
                        refused = str(exc)
                        self._record_error(f"backend answers but cannot be used: {exc}")
                    self.reason = str(exc)
                    backoff = min(backoff * 2, BACKEND_PROBE_MAX_S)
                    continue
                self.mark_up()
        finally:
            self._probing = False
