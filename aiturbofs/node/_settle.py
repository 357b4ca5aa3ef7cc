"""The control socket's ``wait``: files' durability states, held until they settle.

``{"cmd": "wait", "inos": [...], "timeout": s}`` answers ``{"ok": true,
"states": [...]}``, one state per inode in the order asked: what
``user.aiturbo.state`` shows (``staged``, ``persisting``, ``durable``,
``broken``), or ``removed`` (no name left: nothing to persist) or ``none``
(the backend keeps nothing of it: the xattr's ENODATA).  The answer comes
once every inode has settled (durable, broken, removed, none), or
WAIT_GATHER_S after one did (so that a client shows progress), or after
``timeout`` (capped at WAIT_SLICE_S, well within the socket's call timeout:
a client waits longer by asking again); ``timeout`` 0 answers at once.
Woken by the persister's per-inode state changes (``vfs.StateWaits``, what
fsync waits on), not by polling; except in a cluster, where another node
may persist a file and only the shared metadata shows it.

It only reads: asking changes nothing beyond what reading the xattr does (a
durable inode whose attributes the backend lacks is queued for them).
"""

import math

import trio

from .._errors import NoAttribute, NotFound
from .._limits import CLUSTER_STATE_POLL_S, WAIT_GATHER_S, WAIT_INOS_PER_CALL, WAIT_SLICE_S
from ..meta import STATE_BROKEN, STATE_DURABLE
from ..vfs import Filesystem, StateWatcher

REMOVED = "removed"
NONE = "none"
SETTLED = frozenset({STATE_DURABLE, STATE_BROKEN, REMOVED, NONE})


def parse(request: dict) -> tuple[list[int], float]:
    """The inodes and the timeout (capped) a ``wait`` request names; ValueError if it is malformed."""
    inos = request.get("inos")
    if not isinstance(inos, list) or not all(type(ino) is int for ino in inos):
        raise ValueError("wait: inos must be a list of inode numbers")
    if len(inos) > WAIT_INOS_PER_CALL:
        raise ValueError(f"wait: {len(inos)} inodes, more than the {WAIT_INOS_PER_CALL} a call may name")
    timeout_s = float(request.get("timeout", 0))
    if not timeout_s >= 0:  # NaN too
        raise ValueError(f"wait: a timeout of {timeout_s} s")
    return inos, min(timeout_s, WAIT_SLICE_S)


async def settle(fs: Filesystem, inos: list[int], timeout_s: float) -> list[str]:
    """The states of ``inos``, once they settle or time is up (see the module doc)."""
    poll_s = CLUSTER_STATE_POLL_S if fs.cluster.shared else math.inf
    with fs.state_waits.watch() as changes:
        states: dict[int, str] = {}
        part_of: dict[int, int] = {}  # a directory's symlink or special file -> the directory
        inputs: dict[int, list[int]] = {}  # a directory -> its symlinks and special files, listed once a call
        for ino in inos:
            states[ino] = await _read(fs, ino, changes, part_of, inputs)
        deadline = trio.current_time() + timeout_s
        while True:
            pending = [ino for ino, state in states.items() if state not in SETTLED]
            now = trio.current_time()
            if not pending or now >= deadline:
                break
            if len(pending) < len(states):
                deadline = min(deadline, now + WAIT_GATHER_S)
            changed: set[int] | None = None
            with trio.move_on_at(min(deadline, now + poll_s)):
                changed = await changes.wait()
            if changed is None:
                if trio.current_time() >= deadline:
                    break
                changed = set(pending)  # the cluster's poll: every one read again
            for ino in {part_of.get(ino, ino) for ino in changed} & set(pending):
                states[ino] = await _read(fs, ino, changes, part_of, inputs)
    return [states[ino] for ino in inos]


async def _read(fs: Filesystem, ino: int, changes: StateWatcher, part_of: dict[int, int],
                inputs: dict[int, list[int]]) -> str:
    """``ino``'s state, read after ``changes`` watches it (and, for a directory, the inodes its state is
    made of): a change while it is read is seen.  A directory is listed at its first read only: the
    persister changes its state at every file it publishes in it, and listing it at each of those made
    a wait on a directory of n files cost n^2 (``inputs`` keeps what the listing found)."""
    changes.add(ino)
    try:
        row = await fs.getattr(ino)
        if row.nlink == 0:
            return REMOVED
        if ino not in inputs:
            inputs[ino] = (await fs.state_inputs(row))[1:]  # a directory's symlinks and special files
            for other in inputs[ino]:
                changes.add(other)
                part_of[other] = ino
        return await fs.state_shown(row, inputs[ino])  # (each input read again: a change is not missed)
    except NotFound:
        return REMOVED
    except NoAttribute:
        return NONE
