"""Who may reach what: mount options, local state, the control socket, the
cluster secret, and names coming from the backend or from peers.

Peer authentication itself (wrong secret, no handshake, replay) is covered by
``test_fabric.py`` (handshake and ``load_secret`` unit tests) and
``test_cluster.py`` (a node with the wrong secret is refused).
"""

import json
import os
import socket
import stat
import subprocess
import sys
import tempfile

import pytest
from mounting import REPO, is_mounted, wait_state
from trees import tree

from aiturbofs._errors import BackendError, InvalidArgument
from aiturbofs.backend import open_backend
from aiturbofs.node._paths import control_socket

NOBODY = 65534
MOUNT = [sys.executable, os.path.join(REPO, "mount.aiturbo")]
ENV = dict(os.environ, PYTHONPATH=REPO)


def _mountinfo(path: str) -> tuple[set[str], set[str]]:
    """(per-mount options, superblock options) of the mount at ``path``."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == path:
                after = fields[fields.index("-") + 1:]
                return set(fields[5].split(",")), set(after[2].split(","))
    raise AssertionError(f"{path} is not mounted")


def _as_nobody(code: str, dir_fd: int) -> list[str]:
    """Run ``code`` as uid/gid nobody with the directory ``dir_fd`` as ``D``; its output lines.

    The test's tmp dirs are private to root: the child works relative to the
    passed descriptor.  The system Python runs it (the test's may live below /root).
    """
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("needs /usr/bin/python3 to run a child as another user")
    prelude = (
        "import errno, json, os, socket, sys\n"
        f"D = {dir_fd}\n"
        "def attempt(fn, *args, **kw):\n"
        "    try:\n"
        "        fn(*args, **kw)\n"
        "        return 'ok'\n"
        "    except OSError as e:\n"
        "        return errno.errorcode[e.errno]\n"
    )
    r = subprocess.run([python, "-c", prelude + code], user=NOBODY, group=NOBODY, extra_groups=[], pass_fds=(dir_fd,),
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def _write(path: str, data: bytes, mode: int) -> None:
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


# ------------------------------------------------------------ mount options
@pytest.mark.root("the options of a root mount, checked by another user")
def test_root_mount_is_shared_with_modes_checked_by_default(make_mount):
    # A training node's users share /mnt/aiturbo: root mounts with allow_other
    # and the kernel enforces the modes (default_permissions), as JuiceFS does.
    m = make_mount()
    per_mount, per_sb = _mountinfo(m.mountpoint)
    assert {"allow_other", "default_permissions"} <= per_sb, per_sb
    assert {"nosuid", "nodev"} <= per_mount, per_mount
    _write(m.path("public"), b"for everyone", 0o644)
    _write(m.path("secret"), b"root only", 0o600)
    fd = os.open(m.mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = _as_nobody("print(open(os.open('public', os.O_RDONLY, dir_fd=D), 'rb').read() == b'for everyone')\n"
                         "print(attempt(os.open, 'secret', os.O_RDONLY, dir_fd=D))\n"
                         "print(attempt(os.chmod, 'public', 0o666, dir_fd=D))\n", fd)
    finally:
        os.close(fd)
    assert out == ["True", "EACCES", "EPERM"], out


@pytest.mark.root("running a child as another user")
def test_write_by_another_user_clears_setuid_and_setgid(make_mount):
    # pjdfstest chmod/12.t: a write by a user without CAP_FSETID kills the
    # set-user-ID and set-group-ID bits, through an O_WRONLY handle too.
    m = make_mount()
    for name, mode in (("suid", 0o4777), ("sgid", 0o2777), ("both", 0o6777)):
        _write(m.path(name), b"old", mode)
        assert stat.S_IMODE(os.stat(m.path(name)).st_mode) == mode
    fd = os.open(m.mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = _as_nobody("for name in ('suid', 'sgid', 'both'):\n"
                         "    f = os.open(name, os.O_WRONLY, dir_fd=D)\n"
                         "    os.write(f, b'new')\n"
                         "    os.close(f)\n"
                         "    print(oct(os.stat(name, dir_fd=D).st_mode & 0o7777))\n", fd)
    finally:
        os.close(fd)
    assert out == ["0o777", "0o777", "0o777"], out
    for name in ("suid", "sgid", "both"):
        assert stat.S_IMODE(os.stat(m.path(name)).st_mode) == 0o777, name
        assert open(m.path(name), "rb").read() == b"new"


@pytest.mark.root("running a child as another user")
def test_open_with_o_trunc_by_another_user_clears_setuid_and_setgid(make_mount):
    # As truncate(2) does (tmpfs, ext4): an open(O_TRUNC) by a user without CAP_FSETID kills
    # set-user-ID, and set-group-ID where the group may execute.  The kernel sends the truncation
    # inside OPEN (atomic O_TRUNC), so the filesystem must do it: it kept 0o6777.
    m = make_mount()
    modes = {"suid": (0o4777, 0o777), "sgid": (0o2777, 0o777), "both": (0o6777, 0o777),
             "sgid_noexec": (0o2766, 0o2766), "empty": (0o4777, 0o777)}
    for name, (mode, _) in modes.items():
        _write(m.path(name), b"" if name == "empty" else b"old", mode)
    fd = os.open(m.mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = _as_nobody(f"for name in {list(modes)!r}:\n"
                         "    os.close(os.open(name, os.O_WRONLY | os.O_TRUNC, dir_fd=D))\n"
                         "    print(oct(os.stat(name, dir_fd=D).st_mode & 0o7777))\n", fd)
    finally:
        os.close(fd)
    assert out == [oct(after) for _, after in modes.values()], out
    for name, (_, after) in modes.items():
        assert stat.S_IMODE(os.stat(m.path(name)).st_mode) == after, name
        assert os.path.getsize(m.path(name)) == 0
    with open(m.path("suid"), "wb"):  # root keeps the bits (CAP_FSETID)
        pass
    os.chmod(m.path("suid"), 0o4755)
    with open(m.path("suid"), "wb"):
        pass
    assert stat.S_IMODE(os.stat(m.path("suid")).st_mode) == 0o4755


@pytest.mark.root("running a child as another user")
def test_truncate_by_another_user_and_any_chown_clear_setuid_and_setgid(make_mount):
    # A truncate by a user without CAP_FSETID, and a chown by anyone, kill set-user-ID, and
    # set-group-ID where the group may execute (the rule <linux/fuse.h> gives; tmpfs on current
    # kernels also drops set-group-ID without group execute for a caller outside the file's group);
    # a truncate or write by root keeps them.  (The kernel session asks the kernel to leave that to
    # the daemon, HANDLE_KILLPRIV_V2: it then says when in the SETATTR or WRITE, and the daemon
    # kills them.)
    m = make_mount()
    cut = {"suid": (0o4777, 0o777), "both": (0o6777, 0o777), "sgid_noexec": (0o2766, 0o2766)}
    chowned = {"c_both": (0o6755, 0o755), "c_suid": (0o4700, 0o700), "c_sgid_noexec": (0o2745, 0o2745)}
    for name, (mode, _) in {**cut, **chowned, "by_root": (0o6777, 0)}.items():
        _write(m.path(name), b"old", mode)
    fd = os.open(m.mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = _as_nobody(f"for name in {list(cut)!r}:\n"
                         "    f = os.open(name, os.O_WRONLY, dir_fd=D)\n"
                         "    os.ftruncate(f, 1)\n"
                         "    os.close(f)\n"
                         "    print(oct(os.stat(name, dir_fd=D).st_mode & 0o7777))\n", fd)
    finally:
        os.close(fd)
    assert out == [oct(after) for _, after in cut.values()], out
    for name in chowned:
        os.chown(m.path(name), 1234, 1234)
    for name, (_, after) in {**cut, **chowned}.items():
        st = os.stat(m.path(name))
        assert stat.S_IMODE(st.st_mode) == after, name
        assert st.st_size == (1 if name in cut else 3), name
    with open(m.path("by_root"), "r+b") as f:
        f.truncate(2)
        f.write(b"root")
    assert stat.S_IMODE(os.stat(m.path("by_root")).st_mode) == 0o6777
    assert open(m.path("by_root"), "rb").read() == b"root"


@pytest.mark.root("running a child as another user")
def test_another_user_writing_a_setuid_file_others_have_open_clears_the_bits(make_mount):
    # A file the kernel serves itself (passthrough, while a reader has it open) must serve every open
    # of it so: the daemon never sees those writes, so a writer without CAP_FSETID kills the bits at
    # its open.  On the other data paths the WRITE (or the kernel's setattr) does.
    m = make_mount()
    _write(m.path("suid"), b"old", 0o4777)
    fd = os.open(m.mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with open(m.path("suid"), "rb") as reader:
            out = _as_nobody("f = os.open('suid', os.O_WRONLY, dir_fd=D)\n"
                             "os.write(f, b'new')\n"
                             "os.close(f)\n"
                             "print(oct(os.stat('suid', dir_fd=D).st_mode & 0o7777))\n", fd)
            assert reader.read() == b"new"
    finally:
        os.close(fd)
    assert out == ["0o777"], out
    assert stat.S_IMODE(os.stat(m.path("suid")).st_mode) == 0o777


@pytest.mark.root("running a child as another user")
def test_allow_other_no_keeps_other_users_out(make_mount):
    m = make_mount(allow_other="no")
    per_mount, per_sb = _mountinfo(m.mountpoint)
    assert "default_permissions" in per_sb and "allow_other" not in per_sb, per_sb
    assert {"nosuid", "nodev"} <= per_mount, per_mount
    _write(m.path("public"), b"for everyone", 0o644)
    fd = os.open(m.mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = _as_nobody("print(attempt(os.stat, D))\n"
                         "print(attempt(os.open, 'public', os.O_RDONLY, dir_fd=D))\n", fd)
    finally:
        os.close(fd)
    assert out == ["EACCES", "EACCES"], out


@pytest.mark.root("running a child as another user")
def test_allow_other_still_checks_modes(make_mount):
    m = make_mount(allow_other=True)
    _, per_sb = _mountinfo(m.mountpoint)
    assert "allow_other" in per_sb and "default_permissions" in per_sb, per_sb
    _write(m.path("public"), b"for everyone", 0o644)
    _write(m.path("secret"), b"root only", 0o600)
    os.mkdir(m.path("private"), 0o700)
    _write(m.path("private", "inner"), b"x", 0o644)
    fd = os.open(m.mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = _as_nobody(
            "print(open(os.open('public', os.O_RDONLY, dir_fd=D), 'rb').read() == b'for everyone')\n"
            "print(attempt(os.open, 'secret', os.O_RDONLY, dir_fd=D))\n"
            "print(attempt(os.open, 'public', os.O_WRONLY, dir_fd=D))\n"
            "print(attempt(os.open, 'private/inner', os.O_RDONLY, dir_fd=D))\n"
            "print(attempt(os.open, 'new', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=D))\n"
            "print(attempt(os.chmod, 'secret', 0o644, dir_fd=D))\n",
            fd)
    finally:
        os.close(fd)
    assert out == ["True", "EACCES", "EACCES", "EACCES", "EACCES", "EPERM"], out


# ------------------------------------------------------------- local state
@pytest.mark.root("the mount's own files are root's")
def test_control_socket_and_state_dir_are_root_only(make_mount):
    m = make_mount()
    sock = control_socket(m.mountpoint)
    for path, kind, mode in ((os.path.dirname(sock), stat.S_ISDIR, 0o700), (sock, stat.S_ISSOCK, 0o600),
                             (m.state_dir, stat.S_ISDIR, 0o700)):
        st = os.stat(path)
        assert kind(st.st_mode) and st.st_uid == 0, path
        assert stat.S_IMODE(st.st_mode) & 0o077 == 0, f"{path} has mode {stat.S_IMODE(st.st_mode):04o}"
        assert stat.S_IMODE(st.st_mode) == mode, f"{path} has mode {stat.S_IMODE(st.st_mode):04o}"


def _ask(path: str, request: dict) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(json.dumps(request).encode() + b"\n")
        return json.loads(s.makefile("rb").readline())


@pytest.mark.root("running a child as another user")
def test_control_socket_refuses_other_users_even_when_reachable(make_mount):
    """A socket made reachable by mistake (mode loosened, hard-linked into a
    public directory) still answers only root: the daemon checks SO_PEERCRED."""
    m = make_mount(debug_faults=True)
    sock = control_socket(m.mountpoint)
    public = tempfile.mkdtemp(prefix="aiturbo-sec-", dir=os.path.dirname(os.path.dirname(sock)))  # same fs as /run
    link = os.path.join(public, "ctl.sock")
    try:
        os.chmod(public, 0o755)
        os.chmod(sock, 0o666)
        os.link(sock, link)
        assert _ask(link, {"cmd": "status"}).get("ok") is not False  # root gets in through the link
        fd = os.open(public, os.O_RDONLY | os.O_DIRECTORY)
        try:
            out = _as_nobody(
                "s = socket.socket(socket.AF_UNIX)\n"
                "s.settimeout(30)\n"
                f"s.connect({link!r})\n"
                "s.sendall(json.dumps({'cmd': 'debug-fault', 'handler': 'getattr', 'count': 1}).encode() + b'\\n')\n"
                "answer = json.loads(s.makefile('rb').readline())\n"
                "print(answer['ok'], 'permission' in answer['error'])\n", fd)
        finally:
            os.close(fd)
        assert out == ["False", "True"], out
        os.stat(m.mountpoint)  # the fault was not armed: getattr still works
        os.stat(m.path())
    finally:
        for path in (link,):
            if os.path.lexists(path):
                os.unlink(path)
        os.rmdir(public)
        if os.path.exists(sock):
            os.chmod(sock, 0o600)
    assert "refused a request from uid 65534" in m.log()


def test_control_clients_that_hang_up_do_not_stop_the_daemon(make_mount):
    """Clients that reset the connection mid-request or before the answer
    (^C on ``aiturbo wait``) used to end the control server and the daemon."""
    m = make_mount()
    sock = control_socket(m.mountpoint)
    linger_now = (1).to_bytes(4, "little") + (0).to_bytes(4, "little")  # close() sends a reset
    for request in (b'{"cmd": "status"}\n', b'{"cmd": "sta', b""):
        for _ in range(5):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(sock)
                s.sendall(request)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_now)
    assert _ask(sock, {"cmd": "status"})["ok"] is True
    assert m.proc.poll() is None and is_mounted(m.mountpoint)
    assert "Traceback" not in m.log()


def test_daemon_refuses_a_secret_readable_by_others(tmp_path):
    secret, mnt = tmp_path / "secret", tmp_path / "mnt"
    mnt.mkdir()
    (tmp_path / "backend").mkdir()
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o644)
    r = subprocess.run([*MOUNT, f"file://{tmp_path}/backend", str(mnt), "-o",
                        f"state_dir={tmp_path}/s,fabric=127.0.0.1:0,secret_file={secret}"],
                       capture_output=True, text=True, env=ENV, timeout=60)
    try:
        assert r.returncode == 32, r.stderr
        assert "group or others" in r.stderr and str(secret) in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not is_mounted(str(mnt))
    finally:
        if is_mounted(str(mnt)):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)


# --------------------------------------------------- names from the backend
ODD_KEYS = {
    "pre/ok.txt": b"fine",
    "pre/a b": b"space",
    "pre/tab\tname%41": b"tab",
    "pre/../x": b"dotdot",
    "pre/a/../../b": b"climb",
    "pre//abs": b"empty component",
    "pre/a//b": b"double slash",
    "pre/.": b"dot",
    "pre/..": b"dotdot2",
    "pre/./c": b"dot dir",
    "pre/" + "n" * 300: b"name too long",
    "pre/dir": b"object that is also a prefix",
    "pre/dir/inner": b"inside",
    "pre/d2/": b"",
    "pre/sub/..": b"trailing dotdot",
    "pre/.aiturbo-upload.x": b"reserved",
    "outside": b"not under the prefix",
}


def test_odd_backend_keys_never_escape_the_mount(make_mount, s3_server, datapath):
    bucket = s3_server.make_bucket(f"odd-keys-{datapath}")  # a bucket per data path: the server is shared
    client = s3_server.client()
    for key, body in ODD_KEYS.items():
        client.put_object(Bucket=bucket, Key=key, Body=body)
    m = make_mount(f"s3://{bucket}/pre", s3_endpoint=s3_server.endpoint)
    seen = tree(m.mountpoint)
    for path in seen:
        for part in path.split(b"/"):
            assert part not in (b"", b".", b"..") and len(part) <= 255, path
    assert seen == {
        b"ok.txt": b"fine", b"a b": b"space", b"tab\tname%41": b"tab",
        b"a": ("dir",), b"dir": ("dir",), b"dir/inner": b"inside", b"d2": ("dir",), b"sub": ("dir",),
    }, seen
    assert "n" * 300 in m.log(), "the skipped name is logged"
    # the mount still works next to the odd keys, and writes land under the prefix
    with open(m.path("dir", "new"), "wb") as f:
        f.write(b"new")
    assert m.stop() == 0, m.log()
    assert client.get_object(Bucket=bucket, Key="pre/dir/new")["Body"].read() == b"new"
    assert client.get_object(Bucket=bucket, Key="outside")["Body"].read() == b"not under the prefix"


def test_local_backend_symlinks_are_imported_as_symlinks_and_never_followed(make_mount, tmp_path):
    """Symlinks in a file:// backend are symlinks in the mount (docs/design.md,
    "What the backend holds"): the daemon lists, reads and replaces them as
    links and never reads or writes what they point at, inside the root or out."""
    backend = tmp_path / "backend"
    backend.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"not the backend's")
    (backend / "inside").write_bytes(b"ok")
    (backend / "odd\\name").write_bytes(b"backslash")
    os.symlink(str(outside / "secret"), backend / "to-file")
    os.symlink(str(outside), backend / "to-dir")
    os.symlink("../outside", backend / "relative")
    os.symlink("inside", backend / "alias")
    m = make_mount(f"file://{backend}")
    assert tree(m.mountpoint) == {
        b"inside": b"ok", b"odd\\name": b"backslash", b"alias": ("link", b"inside"),
        b"to-file": ("link", os.fsencode(outside / "secret")), b"to-dir": ("link", os.fsencode(outside)),
        b"relative": ("link", b"../outside"),
    }
    # replaced in the mount: the backend's links are replaced, their targets untouched
    os.unlink(m.path("to-dir"))
    os.makedirs(m.path("to-dir", "sub"))
    with open(m.path("to-dir", "sub", "x"), "wb") as f:
        f.write(b"must stay out of outside/")
    os.unlink(m.path("to-file"))
    with open(m.path("to-file"), "wb") as f:
        f.write(b"replaces the link, not its target")
    assert wait_state(m.path("to-dir", "sub", "x"), "durable") == "durable"
    assert wait_state(m.path("to-file"), "durable") == "durable"
    assert m.stop() == 0, m.log()
    assert (outside / "secret").read_bytes() == b"not the backend's" and os.listdir(outside) == ["secret"]
    assert (backend / "to-file").read_bytes() == b"replaces the link, not its target"
    assert (backend / "to-dir" / "sub" / "x").read_bytes() == b"must stay out of outside/"
    assert not (backend / "to-dir").is_symlink()
    assert os.readlink(backend / "relative") == "../outside"


# ------------------------------------------------------- keys from peers
async def test_upload_tokens_cannot_name_keys_outside_the_backend(tmp_path):
    """A peer that passed the handshake sends a key and an upload token with
    ``write_remote_part``: neither may point outside the backend root."""
    root = tmp_path / "root"
    root.mkdir()

    async def main():
        backend = await open_backend(f"file://{root}", {})
        upload = await backend.open_upload("dir/obj", part_bytes=4096)
        try:
            token = json.loads(await upload.token())
            attempts = []
            for key in ("../escape", "dir/../../escape", "/abs", "dir//obj", ".", "dir/./obj", "a\0b"):
                attempts.append((key, json.dumps(dict(token, key=key))))
            for temp in ("../../../escape", "0123456789abcdef/../../x", "", "ABCDEF0123456789"):
                attempts.append(("dir/obj", json.dumps(dict(token, temp=temp))))
            attempts.append(("dir/obj", json.dumps(dict(token, kind="s3"))))
            attempts.append(("dir/obj", "not json"))
            for key, bad in attempts:
                with pytest.raises((BackendError, InvalidArgument)):
                    await backend.write_remote_part(key, bad, 0, b"x" * 10, part_bytes=4096)
        finally:
            await upload.abort()
            await backend.aclose()

    await main()
    assert sorted(os.listdir(root)) in ([], ["dir"]) and not os.path.exists(tmp_path / "escape")
    assert not (root / "dir").exists() or os.listdir(root / "dir") == []
