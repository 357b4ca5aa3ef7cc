"""Who waits for a change of a file's durability state, and the wake-up the persister gives them.

The persister calls ``notify`` whenever an inode's state changes (committed,
persisting, durable, broken); fsync, ``sync_close`` and the control socket's
``wait`` watch it.  A watcher registers *before* it reads a state, so a
change landing while it reads is not missed, and stays registered until it
leaves: every change meanwhile is recorded, none has to be waited for again.
Nothing is kept for an inode nobody watches.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import trio


class StateWatcher:
    """The inodes one waiter watches; ``wait`` returns those whose state changed since it last returned."""

    def __init__(self, waits: "StateWaits"):
        self._waits = waits
        self.inos: set[int] = set()
        self._changed: set[int] = set()
        self._event = trio.Event()

    def add(self, ino: int) -> None:
        """Watch ``ino`` too (from now on: read its state after this)."""
        if ino not in self.inos:
            self.inos.add(ino)
            self._waits._watchers.setdefault(ino, set()).add(self)

    async def wait(self) -> set[int]:
        """Block until a watched inode's state changes; the inodes that changed since the last call."""
        while not self._changed:
            await self._event.wait()
            self._event = trio.Event()
        changed, self._changed = self._changed, set()
        return changed

    def _fire(self, ino: int) -> None:
        self._changed.add(ino)
        self._event.set()


class StateWaits:
    """The watchers of each inode's durability state."""

    def __init__(self) -> None:
        self._watchers: dict[int, set[StateWatcher]] = {}

    @contextmanager
    def watch(self, *inos: int) -> Iterator[StateWatcher]:
        """A watcher of ``inos`` (``add`` more); read their states inside, then ``wait``."""
        watcher = StateWatcher(self)
        try:
            for ino in inos:
                watcher.add(ino)
            yield watcher
        finally:
            for ino in watcher.inos:
                watchers = self._watchers.get(ino)
                if watchers is not None:
                    watchers.discard(watcher)
                    if not watchers:
                        del self._watchers[ino]

    def notify(self, ino: int) -> None:
        """``ino``'s state changed: tell its watchers."""
        for watcher in self._watchers.get(ino, ()):
            watcher._fire(ino)

    def __len__(self) -> int:
        """Inodes watched (for tests: none once every waiter left)."""
        return len(self._watchers)
