"""Directory trees as dicts, compared; and the check that a mount left its tree in the backend.

``tree(root)`` maps each relative path (bytes) to the file's bytes, ``("dir",)``,
``("link", target)`` or ``("special", type)``.  ``verify_persisted`` stops a
mount, checks that its backend directory holds the natural layout with exactly
the mount's bytes and no upload leftovers, then mounts the same backend with a
new state dir (everything imported from the backend) and checks it shows the
same tree.  Modes, owners, times and xattrs live in the metadata engine only:
no tree compares them.
"""

import os
import stat

from aiturbofs.backend import UPLOAD_TEMP_PREFIX

UPLOAD_TEMP = os.fsencode(UPLOAD_TEMP_PREFIX)  # tree() keys are bytes


def tree(root, *, with_links: bool = True) -> dict:
    """relpath (bytes) -> file bytes | ("dir",) | ("link", target)."""
    root = os.fsencode(str(root))
    out = {}
    stack = [b""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            for e in it:
                path = os.path.join(rel, e.name) if rel else e.name
                st = e.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    if with_links:
                        out[path] = ("link", os.readlink(e.path))
                elif stat.S_ISDIR(st.st_mode):
                    out[path] = ("dir",)
                    stack.append(path)
                elif not stat.S_ISREG(st.st_mode):
                    out[path] = ("special", stat.S_IFMT(st.st_mode))
                else:
                    with open(e.path, "rb") as f:
                        out[path] = f.read()
    return out


def files_of(t: dict) -> dict:
    return {k: v for k, v in t.items() if isinstance(v, bytes)}


def dirs_of(t: dict) -> set:
    return {k for k, v in t.items() if v == ("dir",)}


def ancestors(paths) -> set:
    out = set()
    for p in paths:
        d = os.path.dirname(p)
        while d:
            out.add(d)
            d = os.path.dirname(d)
    return out


def describe_diff(want: dict, got: dict) -> str:
    lines = []
    for k in sorted(set(want) | set(got)):
        a, b = want.get(k), got.get(k)
        if a != b:
            show = lambda v: "absent" if v is None else (f"{len(v)} bytes" if isinstance(v, bytes) else str(v))  # noqa: E731
            lines.append(f"  {k!r}: want {show(a)}, got {show(b)}")
    return "\n".join(lines[:40])


_fresh_count = [0]


def verify_persisted(make_mount, m, tmp_path, snapshot: dict | None = None, *, keep_fresh: bool = False):
    """Stop ``m``; check the backend layout; check a fresh import shows it.

    ``snapshot`` is the tree the mount showed (taken here if None).  Returns
    the fresh mount if ``keep_fresh``.
    """
    if snapshot is None:
        snapshot = tree(m.mountpoint)
    rc = m.stop()
    assert rc == 0, f"daemon exit code {rc}:\n{m.log()}"
    assert "BUG" not in m.log() and "Traceback" not in m.log(), m.log()
    backend = tree(tmp_path / "backend")
    leftovers = [k for k in backend if os.path.basename(k).startswith(UPLOAD_TEMP)]
    assert not leftovers, f"upload leftovers in the backend: {leftovers}"
    # symlinks and special files are in the backend as themselves (docs/design.md, "What the backend holds")
    nodes_of = lambda t: {k: v for k, v in t.items() if isinstance(v, tuple) and v[0] != "dir"}  # noqa: E731
    assert nodes_of(backend) == nodes_of(snapshot), describe_diff(nodes_of(snapshot), nodes_of(backend))
    want_files = files_of(snapshot)
    got_files = files_of(backend)
    assert got_files == want_files, "backend files differ from the mount:\n" + describe_diff(want_files, got_files)
    # Every directory holding a file exists; no directory the namespace
    # does not have (e.g. the old name of a renamed directory).
    assert ancestors(want_files) <= dirs_of(backend)
    ghosts = dirs_of(backend) - dirs_of(snapshot)
    assert not ghosts, f"backend directories that are not in the namespace: {sorted(ghosts)}"
    _fresh_count[0] += 1
    fresh = make_mount(name=f"fresh{_fresh_count[0]}")
    try:
        seen = tree(fresh.mountpoint)
        assert seen == backend, "fresh import differs from the backend:\n" + describe_diff(backend, seen)
    finally:
        if not keep_fresh:
            assert fresh.stop() == 0, fresh.log()
    return fresh if keep_fresh else None
