"""``aiturbofs.wait`` and ``aiturbofs.states``: future 1 from Python, over a mount.

A file written to an aiturbofs mount is ``staged`` when close() returns
(future 0: its bytes are in DRAM), ``persisting`` while it is sent, and
``durable`` once the backend holds it (future 1); ``broken`` if it never
will.  ``states(paths)`` says where each file is now; ``wait(paths)``
returns once every one is durable.  A directory stands for the regular files
below it and for the directories the backend keeps (with their symlinks and
special files), as with ``aiturbo wait``.

Both ask the mount's daemon over its control socket (the ``wait`` request of
``node/_settle.py``), which answers when the files' states change: the
persister's own per-file events, not polling.  The socket is root's
(``/run/aiturbo``, mode 0700): where it cannot be reached (a process of
another user, a daemon that does not know the request, a mount whose socket
is named after another path to it), the states are read from the
``user.aiturbo.state`` xattr instead, every WAIT_POLL_S.  Imports nothing of
the daemon: no trio, no FUSE.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ._control_client import call, control_socket, mount_points
from ._limits import CONTROL_CALL_TIMEOUT_S, WAIT_HELD_INOS, WAIT_INOS_PER_CALL, WAIT_POLL_S, WAIT_SLICE_S

STATE_XATTR = "user.aiturbo.state"
STAGED = "staged"
PERSISTING = "persisting"
DURABLE = "durable"
BROKEN = "broken"
# Met while waiting, never reported: the file lost its last name (nothing left to persist), or the backend
# keeps nothing of it.  Either is as done as durable.
_REMOVED = "removed"
_NONE = "none"
_SETTLED = frozenset({DURABLE, BROKEN, _REMOVED, _NONE})

PathArg = str | os.PathLike[str]
Progress = Callable[[int, int], None]


class NotDurable(Exception):
    """Some files did not become durable.  ``states`` maps the path of each to its state."""

    def __init__(self, message: str, states: dict[str, str]):
        super().__init__(message)
        self.states = states

    @property
    def paths(self) -> list[str]:
        return list(self.states)


class BrokenFiles(NotDurable):
    """Files that will never be durable: their persist failed for good (past ``persist_retry_window``) or
    their staged bytes were lost (a host crash without a spill copy).  Reads of them get EIO; write them
    again.  Raised once every other file has settled: the files not named are durable."""


class WaitTimeout(NotDurable, TimeoutError):
    """The timeout passed with files not durable yet (named, with their states); they are still being
    persisted, and waiting again goes on from there."""


def states(paths: PathArg | Iterable[PathArg]) -> dict[str, str]:
    """The durability state of every file under ``paths``, now: ``staged``, ``persisting``, ``durable`` or
    ``broken``, by path (a directory adds the files below it, and itself if the backend keeps it).

    Does not block on persistence.  Raises OSError for a path that is missing or not on an aiturbofs
    mount (ENODATA, ENOTSUP), and ConnectionError if the daemon does not answer.
    """
    targets = targets_under(_path_list(paths))
    now: dict[str, str] = {}
    for _, _, found in _open_groups(targets):
        now.update(found)
    return {t.path: now[t.path] for t in targets}


def wait(paths: PathArg | Iterable[PathArg], timeout: float | None = None, *,
         progress: Progress | None = None) -> None:
    """Block until every file under ``paths`` (see ``states``) is durable in the backend (future 1).

    ``timeout``: give up after this many seconds (None: never) with WaitTimeout.  BrokenFiles if some
    files are broken, once every other file is durable.  ``progress(done_bytes, total_bytes)`` is called
    once the files are known and again as they become durable.  A file removed meanwhile is not waited
    for.  OSError for a path that is missing or not on an aiturbofs mount, before any waiting;
    ConnectionError if the daemon stops answering.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    targets = targets_under(_path_list(paths))
    groups = _open_groups(targets)  # every path checked before anything blocks
    tally = _Tally(targets, progress)
    for _, _, found in groups:
        tally.settled([path for path, state in found.items() if state in _SETTLED])
    tally.report()
    final: dict[str, str] = {}
    for source, group, found in groups:
        final.update(_settle(source, group, found, deadline, tally))
    pending = {t.path: final[t.path] for t in targets if final[t.path] not in _SETTLED}
    if pending:
        raise WaitTimeout(f"timed out after {timeout} s: {len(pending)} file(s) not durable yet, "
                          f"e.g. {next(iter(pending))}", pending)
    broken = {t.path: BROKEN for t in targets if final[t.path] == BROKEN}
    if broken:
        raise BrokenFiles(f"{len(broken)} file(s) broken: {', '.join(list(broken)[:3])}"
                          f"{' ...' if len(broken) > 3 else ''}", broken)


# ------------------------------------------------------------------------------ what to wait for


@dataclass(frozen=True)
class Target:
    path: str
    size: int  # bytes; 0 for a directory
    dev: int  # which mount
    ino: int  # the daemon's inode number
    is_dir: bool


def _path_list(paths: PathArg | Iterable[PathArg]) -> list[str]:
    if isinstance(paths, str | os.PathLike):
        return [os.fspath(paths)]
    return [os.fspath(p) for p in paths]


def targets_under(paths: list[str]) -> list[Target]:
    """The regular files under ``paths``, and the directories among them that have a durability state."""
    out = []
    for top in paths:
        if os.path.isfile(top) and not os.path.islink(top):
            out.append(_target(top, os.stat(top), False))
            continue
        if not os.path.isdir(top):
            raise FileNotFoundError(errno.ENOENT, "no such file or directory", top)
        # By directory descriptor: a path below the mount may be longer than PATH_MAX (a local
        # filesystem holds such trees, and so does the mount); only the label grows.
        for root, _, names, root_fd in os.fwalk(top):
            if _has_state(root_fd):
                out.append(_target(root, os.fstat(root_fd), True))  # its backend form, symlinks, special files
            for name in names:
                try:
                    st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed since it was listed
                if stat.S_ISREG(st.st_mode):
                    out.append(_target(os.path.join(root, name), st, False))
    return out


def _target(path: str, st: os.stat_result, is_dir: bool) -> Target:
    return Target(path, 0 if is_dir else st.st_size, st.st_dev, st.st_ino, is_dir)


def _has_state(directory: str | int) -> bool:
    """Does ``directory`` (a path or a descriptor) have a durability state (a directory the backend keeps,
    or one holding symlinks or special files it keeps)?"""
    try:
        _xattr_state(directory)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            return False
        raise
    return True


def _xattr_state(path: str | int) -> str:
    return os.getxattr(path, STATE_XATTR).decode()


# ------------------------------------------------------------------------------ where states come from


class _Unreachable(Exception):
    """The daemon's control socket cannot serve this process: read the xattr instead."""


class _Daemon:
    """States from the mount's daemon, which holds a request until some of them settle."""

    def __init__(self, sock: str, group: list[Target]):
        self.sock = sock
        self._ino = {t.path: t.ino for t in group}

    def read(self, paths: list[str], timeout_s: float) -> dict[str, str]:
        """The states of ``paths`` (all of them) now, with ``timeout_s`` 0; else of the first
        WAIT_HELD_INOS files, once one of them settles or ``timeout_s`` passed."""
        inos = list(dict.fromkeys(self._ino[p] for p in paths))  # hard links: one inode
        if timeout_s > 0:
            inos = inos[:min(WAIT_HELD_INOS, WAIT_INOS_PER_CALL)]
        found: dict[int, str] = {}
        for first in range(0, len(inos), WAIT_INOS_PER_CALL):
            batch = inos[first:first + WAIT_INOS_PER_CALL]
            found.update(zip(batch, self._call(batch, timeout_s)))
        return {p: found[self._ino[p]] for p in paths if self._ino[p] in found}

    def read_first(self, paths: list[str]) -> dict[str, str]:
        """``read`` now, failing like the xattr for a file that has no state, or no name any more."""
        found = self.read(paths, 0)
        for path, state in found.items():
            if state == _NONE:
                raise OSError(errno.ENODATA, os.strerror(errno.ENODATA), path)
            if state == _REMOVED:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return found

    def _call(self, inos: list[int], timeout_s: float) -> list[str]:
        try:
            answer = call(self.sock, {"cmd": "wait", "inos": inos, "timeout": timeout_s})
        except TimeoutError:
            raise ConnectionError(errno.ETIMEDOUT, f"the aiturbofs daemon did not answer within "
                                                   f"{CONTROL_CALL_TIMEOUT_S:.0f} s", self.sock) from None
        except ValueError:  # no JSON line: it closed the connection
            raise ConnectionError(errno.ECONNRESET, "the aiturbofs daemon hung up without an answer",
                                  self.sock) from None
        except OSError as exc:  # no such socket, not ours to open, nobody listening
            raise _Unreachable(exc) from exc
        error = str(answer.get("error"))
        if not answer.get("ok") and error.startswith(("unknown command", "permission denied")):
            raise _Unreachable(error)
        found = answer.get("states")
        if not answer.get("ok") or not isinstance(found, list) or len(found) != len(inos):
            raise ConnectionError(errno.EPROTO, f"the aiturbofs daemon refused a wait: {error}", self.sock)
        return found


class _Xattr:
    """States read from ``user.aiturbo.state``, every WAIT_POLL_S."""

    def read(self, paths: list[str], timeout_s: float) -> dict[str, str]:
        if timeout_s > 0:
            time.sleep(min(WAIT_POLL_S, timeout_s))
        return {path: _xattr_state_now(path) for path in paths}

    def read_first(self, paths: list[str]) -> dict[str, str]:
        return {path: _xattr_state(path) for path in paths}


def _xattr_state_now(path: str) -> str:
    try:
        return _xattr_state(path)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return _REMOVED
        if exc.errno == errno.ENODATA:
            return _NONE  # (a directory whose last symlink went)
        raise


_Source = _Daemon | _Xattr


def _open_groups(targets: list[Target]) -> list[tuple[_Source, list[Target], dict[str, str]]]:
    """The targets by mount, each mount's source of states, and their states now (which fails for a path
    not on an aiturbofs mount)."""
    by_dev: dict[int, list[Target]] = {}
    for t in targets:
        by_dev.setdefault(t.dev, []).append(t)
    groups: list[tuple[_Source, list[Target], dict[str, str]]] = []
    for dev, group in by_dev.items():
        paths = [t.path for t in group]
        for point in mount_points(dev):
            daemon = _Daemon(control_socket(point), group)
            try:
                groups.append((daemon, group, daemon.read_first(paths)))
                break
            except _Unreachable:
                continue
        else:
            xattr = _Xattr()
            groups.append((xattr, group, xattr.read_first(paths)))
    return groups


# ------------------------------------------------------------------------------ waiting


class _Tally:
    """Bytes settled out of the total, for ``progress``."""

    def __init__(self, targets: list[Target], progress: Progress | None):
        self._size = {t.path: t.size for t in targets}
        self._counted: set[str] = set()
        self._progress = progress
        self.total = sum(self._size.values())
        self.done = 0

    def settled(self, paths: list[str]) -> None:
        for path in paths:
            if path not in self._counted:
                self._counted.add(path)
                self.done += self._size[path]

    def report(self) -> None:
        if self._progress is not None:
            self._progress(self.done, self.total)


def _settle(source: _Source, group: list[Target], found: dict[str, str], deadline: float | None,
            tally: _Tally) -> dict[str, str]:
    """Wait until every file of one mount has settled, or the deadline; their last states."""
    states = dict(found)
    dirs = [t.path for t in group if t.is_dir]
    pending = [path for path, state in states.items() if state not in _SETTLED]
    while True:
        while pending:
            left = WAIT_SLICE_S if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                got = source.read(pending, min(WAIT_SLICE_S, left))
            except _Unreachable:  # the daemon went away (or was replaced by an older one)
                source = _Xattr()
                continue
            states.update(got)
            settled = [path for path, state in got.items() if state in _SETTLED]
            if settled:
                tally.settled(settled)
                tally.report()
            pending = [path for path in pending if states[path] not in _SETTLED]
            if pending and left == 0:
                return states
        if not dirs:
            return states
        # A file persisted last moved its directory's mtime in the backend (file://), which the
        # directory then gets back: a directory seen settled before that is asked once more.
        try:
            states.update(source.read(dirs, 0))
        except _Unreachable:
            source = _Xattr()
            states.update(source.read(dirs, 0))
        pending = [path for path in dirs if states[path] not in _SETTLED]
        if not pending:
            return states
