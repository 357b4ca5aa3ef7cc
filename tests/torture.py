"""Random file operations against an oracle: the worker of the differential torture suite.

``python tests/torture.py DIR WORKER SEED OPS OUT`` runs ``OPS`` random
operations on the files of ``DIR/w<WORKER>`` and pickles its oracle to
``OUT``: what each name must hold (bytes and mode) if every operation's
close returned.  Much of what it writes is the same across workers and
files (whole chunks from a few shared templates, copies of other files,
links), so deduplication, sealing and the pool's sharing of keys are hot.
It checks every read it does through the mount against the oracle, and
stops at the first error.

If the mount goes away under it (a kill -9 of the daemon), the operation in
flight has its before and after recorded (``maybe``): after a restart each
of its names holds one or the other; every other name holds exactly the
oracle's.  A store through a mapping of a file whose daemon is gone ends
the process with SIGBUS (the kernel cannot fill the page), so the worker
writes the result such a death leaves to ``OUT.cut`` before every such
store: the names of that file may hold their bytes before it with any
prefix of the store applied (see ``allows``).  Used by tests/system/test_torture.py
and by scripts/soak.py.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import pickle
import random
import sys
import time

CHUNK = 1 << 23
MiB = 1 << 20
NAMES = [f"f{i}" for i in range(5)]
MODES = [0o600, 0o640, 0o644, 0o755, 0o700]
SIZE_MAX = 3 * CHUNK + 3 * MiB
# Errors that mean the daemon is gone (a kill -9): the run stops there, it is not a finding.
GONE = {errno.ENOTCONN, errno.ECONNABORTED, errno.ECONNREFUSED}
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x10
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def templates() -> list[bytes]:
    """Chunk-sized contents every worker shares (the same seed): whole chunks repeat across files."""
    rnd = random.Random(20261204)
    return [rnd.randbytes(CHUNK) for _ in range(4)]


class Obj:
    """One inode of the oracle: several names may share it (links)."""

    __slots__ = ("data", "mode")

    def __init__(self, data: bytes = b"", mode: int = 0o644):
        self.data = bytearray(data)
        self.mode = mode


class Mismatch(AssertionError):
    pass


def allows(allowed, got, modes: bool = True) -> bool:
    """Whether the state ``got`` (``(bytes, mode)`` or None) is the allowed state ``allowed``: a
    state, or ``("prefix", before, mode, at, data)``, a store through a mapping that a kill cut: the
    file held ``before`` and a prefix of ``data`` (none, part or all) landed at ``at``."""
    if got is None or allowed is None:
        return got is None and allowed is None
    if allowed[0] != "prefix":
        return got[0] == allowed[0] and (not modes or got[1] == allowed[1])
    _, before, mode, at, data = allowed
    g = got[0]
    if len(g) != len(before) or (modes and got[1] != mode):
        return False
    end = at + len(data)
    if g[:at] != before[:at] or g[end:] != before[end:]:
        return False
    k = next((i for i in range(len(data)) if g[at + i] != data[i]), len(data))
    return g[at + k : end] == before[at + k : end]


class Worker:
    def __init__(self, root: str, seed: int, cut_out: str | None = None):
        self.root = root
        self.cut_out = cut_out
        self.rnd = random.Random(seed)
        self.tpl = templates()
        self.names: dict[str, Obj] = {}
        self.ops = 0
        self.bytes_written = 0
        self.fallocate_refused = 0  # EOPNOTSUPP: the data path has no fallocate (pyfuse3)
        self.seen: dict[str, list] = {}  # name -> its states at the commit points of the operation in flight

    # ----------------------------------------------------------- helpers
    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def content(self) -> bytes:
        """Something to write: template chunks (deduplicated), a few shared 1 MiB blocks, random bytes."""
        r = self.rnd
        kind = r.random()
        if kind < 0.45:
            return b"".join(r.choice(self.tpl) for _ in range(r.randint(1, 2))) + r.randbytes(r.randint(0, 200_000))
        if kind < 0.7:
            t = r.choice(self.tpl)
            at = r.randrange(0, CHUNK - MiB, 4096)
            return t[at : at + r.randint(1, 3) * MiB]
        return r.randbytes(r.choice([1, 100, 4096, 65537, 300_000]))

    def existing(self) -> str | None:
        return self.rnd.choice(sorted(self.names)) if self.names else None

    def check(self, name: str, fd: int | None = None) -> None:
        want = self.names[name]
        if fd is None:
            with open(self.path(name), "rb") as f:
                got = f.read()
            mode = os.stat(self.path(name)).st_mode & 0o7777
        else:
            got = os.pread(fd, len(want.data) + 1, 0)
            mode = os.fstat(fd).st_mode & 0o7777
        if got != bytes(want.data):
            at = next((i for i in range(min(len(got), len(want.data))) if got[i] != want.data[i]), None)
            raise Mismatch(f"{self.path(name)} after op {self.ops}: {len(got)} bytes, want {len(want.data)}; "
                           f"first difference at {at}")
        if mode != want.mode:
            raise Mismatch(f"{self.path(name)} after op {self.ops}: mode {mode:o}, want {want.mode:o}")

    def committed(self, *names: str) -> None:
        """A commit point (close, fsync, truncate, a namespace change) is about to pass: what ``names``
        hold now is a state a crash may leave them in (linked names change together).  Called before
        the call it names: the daemon may commit and die before it answers."""
        for n in names:
            for m, o in self.names.items():
                if n == m or (n in self.names and o is self.names[n]):
                    self.seen.setdefault(m, []).append(self.state(m))
            if n not in self.names:
                self.seen.setdefault(n, []).append(None)

    def state(self, name: str) -> tuple[bytes, int] | None:
        o = self.names.get(name)
        return None if o is None else (bytes(o.data), o.mode)

    def _fsync(self, fd: int, name: str) -> None:
        self.committed(name)
        os.fsync(fd)

    def _close(self, fd: int, *names: str) -> None:
        self.committed(*names)
        os.close(fd)

    def _write_at(self, obj: Obj, fd: int, at: int, data: bytes, *, append: bool = False) -> None:
        if append:
            os.write(fd, data)
        else:
            os.pwrite(fd, data, at)
        if at > len(obj.data):
            obj.data.extend(bytes(at - len(obj.data)))
        obj.data[at : at + len(data)] = data
        self.bytes_written += len(data)

    def _truncating_open(self, name: str, obj: Obj) -> int:
        """open(O_CREAT|O_TRUNC) of ``name``, which then holds ``obj`` emptied."""
        self.names[name] = obj
        obj.data.clear()
        self.committed(name)
        return os.open(self.path(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, obj.mode)

    # ----------------------------------------------------------- operations
    def op_create(self) -> list[str]:
        """open(O_CREAT|O_TRUNC), buffered writes of a few MB, maybe fsync, close: a checkpoint."""
        name = self.rnd.choice(NAMES)
        data = b"".join(self.content() for _ in range(self.rnd.randint(1, 3)))[:SIZE_MAX]
        obj = self.names.get(name) or Obj(mode=self.rnd.choice(MODES))
        fd = self._truncating_open(name, obj)
        try:
            for at in range(0, len(data), 3_000_000):
                self._write_at(obj, fd, at, data[at : at + 3_000_000])
            if self.rnd.random() < 0.5:
                self._fsync(fd, name)
        finally:
            self._close(fd, name)
        return [name]

    def op_pwrite(self) -> list[str]:
        name = self.existing()
        if name is None:
            return self.op_create()
        obj = self.names[name]
        flags = self.rnd.choice([os.O_WRONLY, os.O_RDWR])
        fd = os.open(self.path(name), flags)
        try:
            for _ in range(self.rnd.randint(1, 3)):
                data = self.content()
                if self.rnd.random() < 0.3:
                    at = self.rnd.randrange(0, 3) * CHUNK  # a whole chunk in place
                    data = self.rnd.choice(self.tpl)
                else:
                    at = self.rnd.randrange(0, len(obj.data) + 2 * MiB)
                if at + len(data) <= SIZE_MAX:
                    self._write_at(obj, fd, at, data)
            if self.rnd.random() < 0.3:
                self._fsync(fd, name)
            if flags == os.O_RDWR and self.rnd.random() < 0.3:
                self.check(name, fd)
        finally:
            self._close(fd, name)
        return [name]

    def op_append(self) -> list[str]:
        name = self.existing()
        if name is None:
            return self.op_create()
        obj = self.names[name]
        data = self.content()[: max(0, SIZE_MAX - len(obj.data))]
        fd = os.open(self.path(name), os.O_WRONLY | os.O_APPEND)
        try:
            self._write_at(obj, fd, len(obj.data), data, append=True)
        finally:
            self._close(fd, name)
        return [name]

    def op_truncate(self) -> list[str]:
        name = self.existing()
        if name is None:
            return []
        obj = self.names[name]
        size = self.rnd.choice([0, self.rnd.randrange(0, len(obj.data) + 1),
                                min(SIZE_MAX, len(obj.data) + self.rnd.randrange(1, CHUNK + MiB))])
        del obj.data[size:]
        obj.data.extend(bytes(size - len(obj.data)))
        self.committed(name)
        os.truncate(self.path(name), size)
        return [name]

    def op_fallocate(self) -> list[str]:
        """fallocate(2): punch a hole or zero a range (whole chunks often), or grow the file."""
        name = self.existing()
        if name is None or not self.names[name].data:
            return []
        obj = self.names[name]
        size = len(obj.data)
        r = self.rnd
        at = r.randrange(0, size // CHUNK + 1) * CHUNK if r.random() < 0.5 else r.randrange(0, size)
        length = r.choice([1, 4096, 300_000, CHUNK, 2 * CHUNK])
        mode = r.choice([FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, FALLOC_FL_ZERO_RANGE,
                         FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, 0])
        end = at + length if mode & FALLOC_FL_KEEP_SIZE else min(at + length, SIZE_MAX)
        if end <= at:
            return []
        fd = os.open(self.path(name), os.O_RDWR)
        try:
            if _libc.fallocate(fd, mode, at, end - at) != 0:
                err = ctypes.get_errno()
                if err != errno.EOPNOTSUPP:
                    raise OSError(err, f"fallocate mode {mode:#x} of {end - at} bytes at {at}: {os.strerror(err)}")
                self.fallocate_refused += 1
            else:
                if mode & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE):
                    zeroed = min(end, size)
                    obj.data[at:zeroed] = bytes(max(0, zeroed - at))
                if not mode & FALLOC_FL_KEEP_SIZE and end > size:
                    obj.data.extend(bytes(end - size))
            if r.random() < 0.3:
                self.check(name, fd)
        finally:
            self._close(fd, name)
        return [name]

    def op_mmap(self) -> list[str]:
        """A write through a shared mapping (no WRITE request at all on some paths)."""
        name = self.existing()
        if name is None or not self.names[name].data:
            return []
        obj = self.names[name]
        fd = os.open(self.path(name), os.O_RDWR)
        try:
            with mmap.mmap(fd, len(obj.data)) as m:
                at = self.rnd.randrange(0, len(obj.data))
                data = self.rnd.randbytes(min(len(obj.data) - at, self.rnd.choice([1, 5000, 70_000])))
                self._may_die_in_store(obj, at, data)
                m[at : at + len(data)] = data
                obj.data[at : at + len(data)] = data
                if self.rnd.random() < 0.5:
                    self.committed(name)
                    m.flush()  # msync: an fsync of the file
                self._survived_store()
        finally:
            self._close(fd, name)
        return [name]

    def _may_die_in_store(self, obj: Obj, at: int, data: bytes) -> None:
        """Write what this worker's result is if the store about to happen kills it (SIGBUS)."""
        if self.cut_out is None:
            return
        cut = ("prefix", bytes(obj.data), obj.mode, at, data)
        result = {"oracle": {n: self.state(n) for n in NAMES if self.names.get(n) is not obj},
                  "maybe": {n: [cut] for n, o in self.names.items() if o is obj},
                  "ops": self.ops + 1, "bytes": self.bytes_written}
        with open(self.cut_out, "wb") as f:
            pickle.dump(result, f)

    def _survived_store(self) -> None:
        if self.cut_out is not None:
            os.unlink(self.cut_out)

    def op_rename(self) -> list[str]:
        a, b = self.existing(), self.rnd.choice(NAMES)
        if a is None or a == b:
            return []
        if self.names.get(b) is self.names[a]:
            os.rename(self.path(a), self.path(b))
            return []  # two links to one inode: POSIX rename does nothing
        self.names[b] = self.names.pop(a)
        self.committed(a, b)
        os.rename(self.path(a), self.path(b))
        return [a, b]

    def op_link(self) -> list[str]:
        a = self.existing()
        free = [n for n in NAMES if n not in self.names]
        if a is None or not free:
            return []
        b = self.rnd.choice(free)
        self.names[b] = self.names[a]
        self.committed(b)
        os.link(self.path(a), self.path(b))
        return [a, b]

    def op_unlink_open(self) -> list[str]:
        """Unlink a file that is open, keep writing and reading it through the descriptor."""
        name = self.existing()
        if name is None:
            return []
        obj = self.names[name]
        others = [n for n, o in self.names.items() if o is obj and n != name]
        fd = os.open(self.path(name), os.O_RDWR)
        try:
            del self.names[name]
            self.committed(name)
            os.unlink(self.path(name))
            self._write_at(obj, fd, self.rnd.randrange(0, len(obj.data) + 1), self.content()[:MiB])
            got = os.pread(fd, len(obj.data) + 1, 0)
            if got != bytes(obj.data):
                raise Mismatch(f"{self.path(name)} (unlinked, open) after op {self.ops}: other bytes")
        finally:
            self._close(fd, *others)
        return [name] + others

    def op_chmod(self) -> list[str]:
        name = self.existing()
        if name is None:
            return []
        mode = self.rnd.choice(MODES)
        self.names[name].mode = mode
        self.committed(name)
        os.chmod(self.path(name), mode)
        return [name]

    def op_copy(self) -> list[str]:
        """Read one file through the mount (checked) and write it to another name: dedup of a whole file."""
        a, b = self.existing(), self.rnd.choice(NAMES)
        if a is None or a == b:
            return []
        self.check(a)
        data = bytes(self.names[a].data)
        obj = self.names.get(b) or Obj(mode=0o644)
        fd = self._truncating_open(b, obj)
        try:
            self._write_at(obj, fd, 0, data)
        finally:
            self._close(fd, b)
        return [b]

    def op_check(self) -> list[str]:
        name = self.existing()
        if name is not None:
            if self.rnd.random() < 0.5:
                self.check(name)
            else:  # a fresh open beside one held open
                fd = os.open(self.path(name), os.O_RDONLY)
                try:
                    self.check(name)
                    self.check(name, fd)
                finally:
                    os.close(fd)
        return []

    OPS = [("create", 6), ("pwrite", 6), ("append", 2), ("truncate", 2), ("mmap", 2), ("rename", 2),
           ("link", 1), ("unlink_open", 1), ("chmod", 2), ("copy", 2), ("check", 3), ("fallocate", 2)]

    def run(self, count: int) -> dict:
        """``count`` operations; the oracle, and the before/after of an operation the daemon's end cut."""
        names, weights = zip(*self.OPS)
        maybe: dict[str, list] = {}
        for self.ops in range(count):
            op = self.rnd.choices(names, weights)[0]
            before = {n: self.state(n) for n in NAMES}
            self.seen = {}
            try:
                getattr(self, f"op_{op}")()
            except OSError as exc:
                if exc.errno not in GONE:
                    raise
                if self.cut_out is not None and os.path.exists(self.cut_out):
                    with open(self.cut_out, "rb") as f:  # it went away in (or right after) a store
                        return pickle.load(f)
                # The daemon went away mid-operation: a name it touched holds what it held before, or
                # what it held at one of the operation's commit points; nothing else.
                for n in NAMES:
                    if n in self.seen or before[n] != self.state(n):
                        maybe[n] = [before[n], *self.seen.get(n, [])]
                break
        oracle = {n: self.state(n) for n in NAMES if n not in maybe}
        return {"oracle": oracle, "maybe": maybe, "ops": self.ops + 1, "bytes": self.bytes_written,
                "fallocate_refused": self.fallocate_refused}


def main(argv: list[str]) -> int:
    directory, worker, seed, count, out = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    root = os.path.join(directory, f"w{worker}")
    os.makedirs(root, exist_ok=True)
    w = Worker(root, seed * 1000 + worker, cut_out=out + ".cut")
    started = time.monotonic()
    result = w.run(count)
    result["seconds"] = time.monotonic() - started
    with open(out, "wb") as f:
        pickle.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
