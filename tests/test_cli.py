"""The mount helper and the ``aiturbo`` command as a user runs them."""

import os
import subprocess
import sys
import time

from mounting import REPO, aiturbo, is_mounted

MOUNT = [sys.executable, os.path.join(REPO, "mount.aiturbo")]
ENV = dict(os.environ, PYTHONPATH=REPO)


def test_help_explains_itself():
    out = subprocess.run([*MOUNT, "--help"], capture_output=True, text=True, env=ENV, check=True).stdout
    for word in ("BACKEND", "dram=", "spill=", "fsync=", "sync_close", "fstab"):
        assert word in out


def test_bad_option_names_the_option_and_fails(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run([*MOUNT, f"file://{tmp_path}", str(mnt), "-o", "dram=1G,fsync=sometimes"],
                       capture_output=True, text=True, env=ENV)
    assert r.returncode == 1 and "fsync" in r.stderr and "staged" in r.stderr
    r = subprocess.run([*MOUNT, f"file://{tmp_path}", str(mnt), "-o", "nosuchopt"], capture_output=True, text=True, env=ENV)
    assert r.returncode == 1 and "nosuchopt" in r.stderr
    assert not is_mounted(str(mnt))


def test_unusable_backend_fails_before_mounting(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run([*MOUNT, "s3://no-such-bucket", str(mnt), "-o",
                        f"state_dir={tmp_path}/s,s3_endpoint=http://127.0.0.1:9,s3_connect_timeout=1"],
                       capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 32 and "no-such-bucket" in r.stderr
    assert not is_mounted(str(mnt))


def test_daemonizes_after_the_mount_is_ready_and_drains_at_umount(tmp_path):
    backend, mnt = tmp_path / "backend", tmp_path / "mnt"
    backend.mkdir()
    mnt.mkdir()
    r = subprocess.run([*MOUNT, f"file://{backend}", str(mnt), "-o", f"state_dir={tmp_path}/s,defaults,_netdev"],
                       capture_output=True, text=True, env=ENV, timeout=60)
    try:
        assert r.returncode == 0, r.stderr
        assert is_mounted(str(mnt)), "exit 0 must mean mounted"
        with open(mnt / "f.bin", "wb") as f:
            f.write(os.urandom(3 << 20))
        status = aiturbo("status", str(mnt)).stdout
        assert str(mnt) in status and "pool" in status
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
    deadline = time.monotonic() + 30
    while subprocess.run(["pgrep", "-f", f"{mnt} "], capture_output=True).returncode == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (backend / "f.bin").stat().st_size == 3 << 20
    log = (tmp_path / "s" / "aiturbo.log").read_text()
    assert "drain complete" in log


def test_second_mount_on_the_same_state_dir_is_refused(make_mount, tmp_path):
    m = make_mount()
    other = tmp_path / "other"
    other.mkdir()
    r = subprocess.run([*MOUNT, f"file://{tmp_path}/backend", str(other), "-f", "-o", f"state_dir={m.state_dir}"],
                       capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 32 and "in use" in r.stderr
    assert not is_mounted(str(other))
