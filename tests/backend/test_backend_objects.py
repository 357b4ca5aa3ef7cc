"""Symlinks, empty directories and special files live in the backend too.

Over file:// and S3 (a mount of one backend is mounted again on a fresh
state dir, so nothing comes from the metadata file): what the mount made is
back after the remount, the raw backend holds the documented form
(docs/design.md, "What the backend holds"), and rm / rmdir / mv reach it.
Objects other tools wrote the s3fs-fuse way are imported as what they say.
"""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
import time

import pytest
from faults import FaultyS3Proxy
from mounting import aiturbo, aiturbo_proc, status
from s3server import S3Server
from waiting import WAIT_S

IMPORT_SETTLE_S = 1.6  # import_ttl=0.5 (tests' default) + the kernel's 1 s attribute cache


class Local:
    """A file:// backend directory."""

    kind = "file"

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.url = f"file://{root}"
        self.options: dict = {}

    def path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def exists(self, key: str) -> bool:
        return os.path.lexists(self.path(key))


class S3:
    """A bucket on the loopback moto server, under a prefix."""

    kind = "s3"

    def __init__(self, server: S3Server):
        self.server = server
        self.bucket = server.make_bucket(f"t-{secrets.token_hex(6)}")
        self.url = f"s3://{self.bucket}/pre"
        self.options = {"s3_endpoint": server.endpoint}

    def head(self, key: str) -> dict:
        return self.server.client().head_object(Bucket=self.bucket, Key=f"pre/{key}")

    def body(self, key: str) -> bytes:
        return self.server.client().get_object(Bucket=self.bucket, Key=f"pre/{key}")["Body"].read()

    def keys(self) -> set[str]:
        listing = self.server.client().list_objects_v2(Bucket=self.bucket, Prefix="pre/")
        return {o["Key"][len("pre/"):] for o in listing.get("Contents", ())}

    def exists(self, key: str) -> bool:
        return key in self.keys()

    def put(self, key: str, body: bytes, metadata: dict[str, str], content_type: str | None = None) -> None:
        extra = {"ContentType": content_type} if content_type else {}
        self.server.client().put_object(Bucket=self.bucket, Key=f"pre/{key}", Body=body, Metadata=metadata, **extra)


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return Local(str(tmp_path / "backend"))
    return S3(request.getfixturevalue("s3_server"))


_mounts = [0]


def mount(make_mount, store):
    """A mount of ``store`` on a state dir of its own (a fresh metadata file)."""
    _mounts[0] += 1
    return make_mount(store.url, name=f"m{_mounts[0]}", **store.options)


def settle(m) -> None:
    """Everything durable, then unmounted."""
    wait(m)
    assert m.stop() == 0, m.log()
    assert "BUG" not in m.log() and "Traceback" not in m.log(), m.log()


def wait(m) -> None:
    """``aiturbo wait`` on the whole mount: it covers directories and their symlinks and FIFOs."""
    r = aiturbo("wait", "--timeout", "60", m.mountpoint, check=False)
    assert r.returncode == 0, r.stderr + m.log()


def make_checkpoint(m) -> None:
    os.makedirs(m.path("ckpt", "step-100"))
    with open(m.path("ckpt", "step-100", "model.pt"), "wb") as f:
        f.write(b"weights")
    os.symlink("step-100", m.path("ckpt", "latest"))
    os.mkdir(m.path("ckpt", "empty"))
    os.mkfifo(m.path("ckpt", "pipe"), 0o640)


def test_symlink_empty_dir_and_fifo_survive_a_fresh_state_dir(make_mount, store):
    m = mount(make_mount, store)
    make_checkpoint(m)
    wait(m)  # the backend holds them once aiturbo wait returns, before any drain at unmount
    if store.kind == "file":
        assert os.readlink(store.path("ckpt/latest")) == "step-100"
        assert os.path.isdir(store.path("ckpt/empty")) and os.listdir(store.path("ckpt/empty")) == []
        assert stat.S_ISFIFO(os.lstat(store.path("ckpt/pipe")).st_mode)
    else:
        link = store.head("ckpt/latest")
        assert stat.S_ISLNK(int(link["Metadata"]["mode"])), link["Metadata"]
        assert store.body("ckpt/latest") == b"step-100"
        marker = store.head("ckpt/empty/")
        assert marker["ContentLength"] == 0 and stat.S_ISDIR(int(marker["Metadata"]["mode"]))
        pipe = store.head("ckpt/pipe")
        assert pipe["ContentLength"] == 0 and stat.S_ISFIFO(int(pipe["Metadata"]["mode"]))
        assert stat.S_IMODE(int(pipe["Metadata"]["mode"])) == 0o640
        for field in ("uid", "gid", "mtime"):
            assert field in link["Metadata"], link["Metadata"]
    assert m.stop() == 0, m.log()

    again = mount(make_mount, store)
    assert os.readlink(again.path("ckpt", "latest")) == "step-100"
    with open(again.path("ckpt", "latest", "model.pt"), "rb") as f:
        assert f.read() == b"weights"
    assert os.path.isdir(again.path("ckpt", "empty")) and os.listdir(again.path("ckpt", "empty")) == []
    assert stat.S_ISFIFO(os.lstat(again.path("ckpt", "pipe")).st_mode)
    # the marker of an empty directory is never a file named ''
    assert sorted(os.listdir(again.path("ckpt"))) == ["empty", "latest", "pipe", "step-100"]
    assert again.stop() == 0, again.log()


def test_rm_rmdir_and_mv_reach_the_backend(make_mount, store):
    m = mount(make_mount, store)
    make_checkpoint(m)
    os.makedirs(m.path("ckpt", "old", "inner"))
    settle(m)

    m = mount(make_mount, store)
    os.unlink(m.path("ckpt", "latest"))
    os.symlink("step-200", m.path("ckpt", "latest"))  # repointed: a new link at the same name
    os.rmdir(m.path("ckpt", "empty"))
    os.unlink(m.path("ckpt", "pipe"))
    os.rename(m.path("ckpt", "old"), m.path("ckpt", "moved"))  # with an empty subdirectory
    os.symlink("moved/inner", m.path("ckpt", "alias"))
    os.rename(m.path("ckpt", "alias"), m.path("ckpt", "step-100", "alias"))
    settle(m)

    if store.kind == "file":
        assert os.readlink(store.path("ckpt/latest")) == "step-200"
        assert os.readlink(store.path("ckpt/step-100/alias")) == "moved/inner"
        assert os.path.isdir(store.path("ckpt/moved/inner"))
        for gone in ("ckpt/empty", "ckpt/pipe", "ckpt/old", "ckpt/alias"):
            assert not store.exists(gone), gone
    else:
        assert store.body("ckpt/latest") == b"step-200"
        keys = store.keys()
        assert {"ckpt/moved/", "ckpt/moved/inner/", "ckpt/step-100/alias"} <= keys, keys
        assert not {k for k in keys if k.startswith(("ckpt/empty", "ckpt/pipe", "ckpt/old", "ckpt/alias"))}, keys

    again = mount(make_mount, store)
    assert os.readlink(again.path("ckpt", "latest")) == "step-200"
    assert os.readlink(again.path("ckpt", "step-100", "alias")) == "moved/inner"
    assert os.listdir(again.path("ckpt", "moved")) == ["inner"]
    assert sorted(os.listdir(again.path("ckpt"))) == ["latest", "moved", "step-100"]
    assert again.stop() == 0, again.log()


@pytest.mark.root("mknod of a device node")
def test_device_node_as_root(make_mount, store):
    m = mount(make_mount, store)
    os.mknod(m.path("null"), stat.S_IFCHR | 0o600, os.makedev(1, 3))
    settle(m)
    if store.kind == "file":
        st = os.lstat(store.path("null"))
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    else:
        meta = store.head("null")["Metadata"]
        assert stat.S_ISCHR(int(meta["mode"])) and int(meta["rdev"]) == os.makedev(1, 3)
    again = mount(make_mount, store)
    st = os.lstat(again.path("null"))
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    assert again.stop() == 0, again.log()


def test_objects_written_the_s3fs_fuse_way_are_imported(make_mount, s3_server):
    store = S3(s3_server)
    t = int(time.time()) - 3600
    store.put("other/link", b"../data/file", {"mode": str(stat.S_IFLNK | 0o777), "uid": "0", "gid": "0",
                                             "mtime": str(t)})
    store.put("other/dir/", b"", {"mode": str(stat.S_IFDIR | 0o750)}, "application/x-directory")
    store.put("other/fifo", b"", {"mode": str(stat.S_IFIFO | 0o600)})
    store.put("other/small.txt", b"plain", {})
    m = mount(make_mount, store)
    assert os.readlink(m.path("other", "link")) == "../data/file"
    assert os.lstat(m.path("other", "link")).st_mtime == t
    assert os.listdir(m.path("other", "dir")) == []
    assert stat.S_ISFIFO(os.lstat(m.path("other", "fifo")).st_mode)
    with open(m.path("other", "small.txt"), "rb") as f:
        assert f.read() == b"plain"
    assert sorted(os.listdir(m.path("other"))) == ["dir", "fifo", "link", "small.txt"]
    assert m.stop() == 0, m.log()


def test_cp_a_of_the_file_backend_keeps_the_forms(make_mount, tmp_path):
    store = Local(str(tmp_path / "backend"))
    m = mount(make_mount, store)
    make_checkpoint(m)
    settle(m)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", store.root, str(copy)], check=True)
    assert os.readlink(copy / "ckpt" / "latest") == "step-100"
    assert os.listdir(copy / "ckpt" / "empty") == []
    assert stat.S_ISFIFO(os.lstat(copy / "ckpt" / "pipe").st_mode)


def test_s3_node_probe_off_imports_small_objects_as_files(make_mount, s3_server):
    store = S3(s3_server)
    store.put("link", b"target", {"mode": str(stat.S_IFLNK | 0o777)})
    m = make_mount(store.url, name="noprobe", s3_node_probe="no", **store.options)
    st = os.lstat(m.path("link"))
    assert stat.S_ISREG(st.st_mode) and st.st_size == len(b"target")
    assert m.stop() == 0, m.log()


def test_wait_covers_symlinks_and_directories_through_an_outage(s3m):
    m = s3m.mount()
    os.mkdir(m.path("ckpt"))
    r = aiturbo("wait", "--timeout", "30", m.mountpoint, check=False)
    assert r.returncode == 0, r.stderr
    s3m.server.stop()
    os.symlink("step-7", m.path("ckpt", "latest"))
    os.mkdir(m.path("ckpt", "empty"))
    assert os.getxattr(m.path("ckpt"), "user.aiturbo.state") in (b"staged", b"persisting")  # its symlink
    r = aiturbo("wait", "--timeout", "1", m.path("ckpt"), check=False)
    assert r.returncode == 3 and "timed out" in r.stderr, r.stderr
    waiter = aiturbo_proc("wait", m.path("ckpt"))
    time.sleep(2)
    assert waiter.poll() is None, "aiturbo wait returned while the backend was down"
    s3m.server.start()  # empty: the bucket comes back without ckpt/'s marker
    _, err = waiter.communicate(timeout=WAIT_S)
    assert waiter.returncode == 0, err
    assert os.getxattr(m.path("ckpt", "empty"), "user.aiturbo.state") == b"durable"
    client = s3m.server.client()
    link = client.head_object(Bucket=s3m.bucket, Key="pre/ckpt/latest")
    assert stat.S_ISLNK(int(link["Metadata"]["mode"]))
    assert client.head_object(Bucket=s3m.bucket, Key="pre/ckpt/empty/")["ContentLength"] == 0
    assert m.stop() == 0, m.log()


def test_nodes_staged_at_a_crash_persist_after_the_restart(s3m):
    m = s3m.mount()
    s3m.server.stop()
    os.mkdir(m.path("ckpt"))
    os.symlink("step-1", m.path("ckpt", "latest"))
    m.kill()  # kill -9: nothing of them reached the backend
    s3m.server.start()
    again = s3m.mount(name="again", state_dir=m.state_dir)
    wait(again)
    client = s3m.server.client()
    assert client.get_object(Bucket=s3m.bucket, Key="pre/ckpt/latest")["Body"].read() == b"step-1"
    assert client.head_object(Bucket=s3m.bucket, Key="pre/ckpt/")["ContentLength"] == 0
    assert os.readlink(again.path("ckpt", "latest")) == "step-1"
    assert again.stop() == 0, again.log()
    assert "BUG" not in again.log() and "Traceback" not in again.log(), again.log()


def test_a_symlink_whose_head_fails_is_imported_at_the_next_listing(make_mount, s3_server):
    """A 5xx on the HEAD that tells a symlink from a file: the entry waits, it
    does not become a plain file for good."""
    store = S3(s3_server)
    store.put("d/latest", b"step-3", {"mode": str(stat.S_IFLNK | 0o777)})
    with FaultyS3Proxy(s3_server.port) as proxy:
        m = make_mount(store.url, name="faulty", s3_endpoint=proxy.endpoint)
        proxy.set(error_rate=1.0, error_methods=frozenset({"HEAD"}))  # after the mount's HeadBucket
        assert os.listdir(m.path("d")) == []  # listed, but not known yet
        assert "skipped this time" in m.log()
        proxy.set(error_rate=0.0)
        time.sleep(IMPORT_SETTLE_S)
        assert os.readlink(m.path("d", "latest")) == "step-3"
        assert m.stop() == 0, m.log()


# --- attributes: modes, owners and mtimes, both ways (file://) ------------------------------------------

NOBODY = 65534
T_NS = 1_600_000_000_000_000_123  # explicit mtimes (rsync -a, tar, cp -a set them)
# (path below the tree, mode, owner); a directory ends with '/'
TREE = [
    ("private/", 0o700, NOBODY),
    ("private/key", 0o600, NOBODY),
    ("group.txt", 0o640, 0),
    ("run.sh", 0o755, NOBODY),
    ("shared", 0o666, 0),
    ("setuid", 0o4755, 0),
    ("team/", 0o2770, NOBODY),
    ("team/notes", 0o660, NOBODY),
]


def make_tree(top: str) -> None:
    """``TREE`` below ``top``, then each entry's owner, mode and mtime, children
    before their directories and the top last (as rsync -a does: creating an
    entry moves its directory's mtime)."""
    for rel, _, _ in TREE:
        path = os.path.join(top, rel)
        if rel.endswith("/"):
            os.mkdir(path)
        else:
            with open(path, "wb") as f:
                f.write(rel.encode() * 1000)
    os.link(os.path.join(top, "run.sh"), os.path.join(top, "run-link"))  # a hard link: a copy in the backend
    for i, (rel, mode, owner) in reversed(list(enumerate([("", 0o750, NOBODY), *TREE]))):
        path = os.path.join(top, rel)
        os.chown(path, owner, owner)
        os.chmod(path, mode)  # after chown, which clears setuid and setgid
        os.utime(path, ns=(T_NS + i * 10**9, T_NS + i * 10**9))


def snapshot(top: str) -> dict[str, tuple]:
    """``{path: (mode, uid, gid, mtime_ns, size)}`` of everything below ``top``, ``top`` itself as '.'."""
    out = {}
    for root, dirs, files in os.walk(top):
        for name in [".", *dirs, *files] if root == top else [*dirs, *files]:
            path = os.path.normpath(os.path.join(root, name))
            st = os.lstat(path)
            size = 0 if stat.S_ISDIR(st.st_mode) else st.st_size
            out[os.path.relpath(path, top)] = (oct(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns, size)
    return out


def rsync_changes(src: str, dst: str) -> str:
    """What ``rsync -a`` would change to make ``dst`` like ``src`` (-n: nothing is)."""
    return subprocess.run(["rsync", "-a", "-n", "-i", f"{src}/", f"{dst}/"], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.root("giving files to other users (chown)")
def test_modes_owners_and_mtimes_reach_the_file_backend_and_come_back(make_mount, tmp_path):
    """A -rw------- nobody file stays that in the backend dir (not -rw-r--r-- root, readable
    by every local user); chmod/chown/utime of durable files get there without a new upload;
    a mount on a fresh state dir shows it all again, so rsync -a finds nothing to send."""
    store = Local(str(tmp_path / "backend"))
    src = str(tmp_path / "src")
    os.mkdir(src)
    make_tree(src)
    m = mount(make_mount, store)
    os.mkdir(m.path("tree"))
    make_tree(m.path("tree"))
    wait(m)
    assert snapshot(store.path("tree")) == snapshot(src)
    assert rsync_changes(src, m.path("tree")) == ""

    before = status(m)["persist"]
    for top in (src, m.path("tree")):
        os.chmod(os.path.join(top, "group.txt"), 0o600)
        os.chown(os.path.join(top, "shared"), NOBODY, 0)
        os.chmod(os.path.join(top, "shared"), 0o604)
        os.utime(os.path.join(top, "run.sh"), ns=(T_NS - 10**9, T_NS - 10**9))  # run-link too: the same inode
        os.chmod(os.path.join(top, "private"), 0o750)
        os.utime(os.path.join(top, "private"), ns=(T_NS + 7, T_NS + 7))
    wait(m)
    after = status(m)["persist"]
    assert (after["bytes_uploaded"], after["files_durable"]) == (before["bytes_uploaded"], before["files_durable"])
    assert after["attrs_persisted"] >= before["attrs_persisted"] + 4, after
    assert snapshot(store.path("tree")) == snapshot(src)
    assert m.stop() == 0, m.log()
    assert "BUG" not in m.log() and "Traceback" not in m.log(), m.log()

    fresh = make_mount(store.url, name="fresh")
    assert snapshot(fresh.path("tree")) == snapshot(src)
    assert rsync_changes(src, fresh.path("tree")) == ""
    assert fresh.stop() == 0, fresh.log()


@pytest.mark.root("giving files to other users (chown)")
def test_rsync_a_through_the_mount_sends_nothing_the_second_time(make_mount, tmp_path):
    """rsync -a writes temp files, renames them and sets directory times last, while
    the persister publishes behind it (each publish moves its backend directory's mtime)."""
    store = Local(str(tmp_path / "backend"))
    src = str(tmp_path / "src")
    os.mkdir(src)
    make_tree(src)
    for d in ("bulk", "bulk/inner"):
        os.mkdir(os.path.join(src, d), 0o711)
    for i in range(60):
        with open(os.path.join(src, "bulk" if i % 2 else "bulk/inner", f"f{i}"), "wb") as f:
            f.write(os.urandom(i * 1000))
    os.utime(os.path.join(src, "bulk", "inner"), ns=(T_NS + 11, T_NS + 11))
    os.utime(os.path.join(src, "bulk"), ns=(T_NS + 12, T_NS + 12))
    os.utime(src, ns=(T_NS + 13, T_NS + 13))
    m = mount(make_mount, store)
    subprocess.run(["rsync", "-a", f"{src}/", m.path("tree") + "/"], check=True)
    assert rsync_changes(src, m.path("tree")) == ""
    wait(m)
    assert snapshot(store.path("tree")) == snapshot(src)
    assert m.stop() == 0, m.log()

    fresh = make_mount(store.url, name="fresh")
    assert rsync_changes(src, fresh.path("tree")) == ""
    assert snapshot(fresh.path("tree")) == snapshot(src)
    assert fresh.stop() == 0, fresh.log()


def test_a_chmod_racing_the_upload_ends_with_the_latest_mode(make_mount, tmp_path):
    store = Local(str(tmp_path / "backend"))
    m = mount(make_mount, store)
    path = m.path("big")
    with open(path, "wb") as f:
        f.write(os.urandom(24 << 20))
    modes = [0o600, 0o640, 0o604, 0o700, 0o644, 0o600]
    for i, mode in enumerate(modes):  # while it persists, and (the last ones, maybe) after
        os.chmod(path, mode)
        os.utime(path, ns=(T_NS + i, T_NS + i))
        time.sleep(0.05)
    wait(m)
    st = os.stat(store.path("big"))
    assert (stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (modes[-1], T_NS + len(modes) - 1)
    assert m.stop() == 0, m.log()


@pytest.mark.root("giving files to other users (chown)")
def test_backend_modes_and_owners_show_in_the_mount(make_mount, tmp_path):
    """A backend file 0600 of uid 1000 in a 0700 directory is not -rw-r--r-- root in
    the mount, where (allow_other, on as root; default_permissions) anyone could read it."""
    store = Local(str(tmp_path / "backend"))
    os.makedirs(store.path("home/private"))
    with open(store.path("home/private/id_rsa"), "wb") as f:
        f.write(b"secret")
    with open(store.path("home/public.txt"), "wb") as f:
        f.write(b"hello")
    for key, mode, mtime_ns in [("home/private/id_rsa", 0o600, T_NS), ("home/private", 0o700, T_NS + 1),
                                ("home/public.txt", 0o644, T_NS + 2), ("home", 0o755, T_NS + 3)]:
        os.chown(store.path(key), 1000, 1000)
        os.chmod(store.path(key), mode)
        os.utime(store.path(key), ns=(mtime_ns, mtime_ns))
    want = snapshot(store.path("home"))
    m = mount(make_mount, store)
    assert snapshot(m.path("home")) == want
    # nobody, from inside the mount (the test's temp dirs above it are root's alone)
    as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "cat"]
    home = m.path("home")
    assert subprocess.run([*as_nobody, "public.txt"], cwd=home, capture_output=True).stdout == b"hello"
    r = subprocess.run([*as_nobody, "private/id_rsa"], cwd=home, capture_output=True)
    assert r.returncode != 0 and r.stdout == b"" and b"Permission denied" in r.stderr, r
    assert m.stop() == 0, m.log()
